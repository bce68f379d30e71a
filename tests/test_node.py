"""`Node` and `Rank` over the loopback transport, with real side channels on loopback.

Two nodes in one process share one `LoopbackFabric`; each serves its rank's metadata on
its own `MetadataServer` (IPv4 and IPv6), peers are found through it, and the bytes
written are compared.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvpush.config import TimingConfig
from kvpush.errors import ClosedError, FailureReason, KVPushError, LocalProtocolError
from kvpush.node import Node, NodeIdentity, Rank, RankSettings, TransportFactory
from kvpush.runtime import PeerAddress, PushRuntime, TransferResult
from kvpush.transports.base import Transport
from kvpush.transports.loopback import LoopbackFabric, LoopbackTransport
from transport_conformance import KVBuffers, make_kv

pytestmark = pytest.mark.timeout(60)

TIMING = TimingConfig(heartbeat_interval_s=0.2, liveness_timeout_s=2.0, lease_s=3.0)


def loopback(fabric: LoopbackFabric) -> TransportFactory:
    def make(name: str) -> Transport:
        return LoopbackTransport(fabric, name)

    return make


def node(
    fabric: LoopbackFabric,
    kv: KVBuffers,
    engine_id: str,
    role: str,
    host: str = "127.0.0.1",
    token: str | None = None,
) -> Node:
    return Node(
        [kv.geometry],
        NodeIdentity(engine_id, role, host),
        settings=RankSettings(token=token, timing=TIMING, lookup_timeout_ms=1000),
        transport_factory=loopback(fabric),
    )


def results(rt: PushRuntime, n: int = 1, timeout: float = 10.0) -> list[TransferResult]:
    out: list[TransferResult] = []
    end = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        out += rt.wait(max(0.0, end - time.monotonic()))
    assert len(out) == n, out
    return out


@pytest.fixture
def fabric() -> Iterator[LoopbackFabric]:
    yield LoopbackFabric()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_two_nodes_push_the_bytes_through_their_side_channels(
    fabric: LoopbackFabric, host: str
) -> None:
    p_kv, d_kv = make_kv(num_blocks=8, block_bytes=128), make_kv(num_blocks=8, block_bytes=128)
    p_kv.fill_random(11)
    with (
        node(fabric, p_kv, "engine-p", "sender", host, token="s3cret") as p,
        node(fabric, d_kv, "engine-d", "receiver", host, token="s3cret") as d,
    ):
        assert p.port != 0 and p.rank(0).identity.port == p.port
        assert p.rank(0).metadata().agent_name.startswith("engine-p-r0-")
        p.runtime.send("t1", [0, 1, 2])
        d.runtime.receive("t1", PeerAddress(host, p.port, 0), [5, 6], sender_offset=1)
        [rd] = results(d.runtime)
        [rp] = results(p.runtime)
        assert rd.ok and rp.ok
        for region in range(len(p_kv.geometry.regions)):
            assert d_kv.block(region, 5) == p_kv.block(region, 1)
            assert d_kv.block(region, 6) == p_kv.block(region, 2)


def test_a_wrong_token_is_a_refused_handshake(fabric: LoopbackFabric) -> None:
    with (
        node(fabric, make_kv(), "engine-p", "sender", token="right") as p,
        node(fabric, make_kv(), "engine-d", "receiver", token="wrong") as d,
    ):
        d.runtime.receive("t1", PeerAddress("127.0.0.1", p.port, 0), [1])
        [r] = results(d.runtime)
        assert r.reason is FailureReason.HANDSHAKE_REFUSED


def test_start_once_close_as_often_as_wanted(fabric: LoopbackFabric) -> None:
    n = node(fabric, make_kv(), "engine-p", "sender")
    n.start()
    with pytest.raises(LocalProtocolError):
        n.start()
    n.close()
    n.close()
    with pytest.raises(ClosedError):
        n.start()
    assert fabric.endpoints() == []  # the transport went with the rank


def test_a_node_closes_after_a_failed_start(fabric: LoopbackFabric) -> None:
    def broken(name: str) -> Transport:
        raise KVPushError(f"no transport for {name}")

    n = Node(
        [make_kv().geometry, make_kv().geometry],
        NodeIdentity("engine-x", "both"),
        transport_factory=broken,
    )
    with pytest.raises(KVPushError, match="no transport for engine-x-r0-"):
        n.start()
    n.close()  # again: nothing left open, nothing raised
    health = n.health()
    assert health.started and not health.side_channel_healthy and not health.healthy
    assert health.runtime_failures == ("not started",)


def test_the_health_view_follows_the_side_channel_and_the_runtimes(
    fabric: LoopbackFabric,
) -> None:
    n = node(fabric, make_kv(), "engine-p", "sender")
    before = n.health()
    assert not before.started and before.side_channel_port is None
    assert before.runtime_failure == "not started" and not before.healthy
    with n:
        up = n.health()
        assert up.healthy and up.side_channel_healthy and up.side_channel_port == n.port
        assert up.runtime_failures == (None,) and up.side_channel_failure is None
    down = n.health()
    assert not down.healthy and down.runtime_failure == "push runtime closed"


def test_a_rank_alone_runs_without_a_side_channel(fabric: LoopbackFabric) -> None:
    rank = Rank(
        make_kv().geometry,
        NodeIdentity("engine-w", "sender"),
        port=5600,
        rank=3,
        transport_factory=loopback(fabric),
    )
    with pytest.raises(LocalProtocolError):
        rank.metadata()
    assert rank.failure == "not started"
    with rank:
        meta = rank.metadata()
        assert (meta.rank, meta.role, meta.engine_id) == (3, "sender", "engine-w")
        assert meta.agent_name in fabric.endpoints()
        assert rank.identity.port == 5600 and rank.failure is None
    assert fabric.endpoints() == []
    rank.close()
