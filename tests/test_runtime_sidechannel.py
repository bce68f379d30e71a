"""PushRuntime handshaking over the real side channel: ZeroMQ sockets on loopback.

Each runtime publishes `local_metadata()` through its own `MetadataServer`; peers are
found with `SideChannelPeerDirectory`, IPv4 and IPv6 alike. Data moves on the loopback
fabric, so the bytes are compared for real.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack

import msgspec
import pytest

from kvpush.config import SideChannelConfig, TimingConfig
from kvpush.errors import FailureReason
from kvpush.runtime import (
    PeerAddress,
    PushRuntime,
    RuntimeIdentity,
    SideChannelPeerDirectory,
    TransferResult,
)
from kvpush.sidechannel import MetadataServer, PeerMetadata
from kvpush.transports.loopback import LoopbackFabric, LoopbackTransport
from transport_conformance import KVBuffers, make_kv

pytestmark = pytest.mark.timeout(60)

TIMING = TimingConfig(heartbeat_interval_s=0.2, liveness_timeout_s=2.0, lease_s=3.0)


class Engine:
    """One rank: a runtime and the side channel that publishes it."""

    def __init__(
        self,
        stack: ExitStack,
        fabric: LoopbackFabric,
        name: str,
        host: str,
        token: str | None = None,
        num_layers: int = 2,
        dtype: str | None = None,
        expect_compat_hash: bool = True,
    ) -> None:
        self.kv: KVBuffers = make_kv(num_layers=num_layers, num_blocks=8, block_bytes=128)
        geometry = self.kv.geometry
        if dtype is not None:
            geometry = msgspec.structs.replace(geometry, dtype=dtype)
        self.kv.fill_random(len(name) * 7 + ord(name[-1]))
        self.runtime: PushRuntime | None = None
        server = MetadataServer(
            host, 0, SideChannelConfig(token=token), lambda: {0: self._metadata()}
        )
        stack.enter_context(server)
        self.address = PeerAddress(host, server.port)
        rt = PushRuntime(
            LoopbackTransport(fabric, name),
            geometry,
            RuntimeIdentity(f"engine-{name}", "1", host, server.port),
            SideChannelPeerDirectory(
                timeout_ms=1000,
                token=token,
                expect_compat_hash=geometry.compat_hash() if expect_compat_hash else None,
            ),
            timing=TIMING,
        )
        stack.enter_context(rt)
        self.runtime = rt

    def _metadata(self) -> PeerMetadata:
        assert self.runtime is not None, "asked before the runtime started"
        return self.runtime.local_metadata()


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


def results(rt: PushRuntime, n: int = 1, timeout: float = 10.0) -> list[TransferResult]:
    out: list[TransferResult] = []
    end = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        out += rt.wait(max(0.0, end - time.monotonic()))
    assert len(out) == n, out
    return out


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_push_over_a_real_side_channel(stack: ExitStack, host: str) -> None:
    fabric = LoopbackFabric()
    p = Engine(stack, fabric, "p", host, token="s3cret")
    d = Engine(stack, fabric, "d", host, token="s3cret")
    assert p.runtime is not None and d.runtime is not None
    p.runtime.send("t1", [0, 1, 2])
    d.runtime.receive("t1", p.address, [5, 6], sender_offset=1)
    [rd] = results(d.runtime)
    [rp] = results(p.runtime)
    assert rd.ok and rp.ok
    for region in range(len(p.kv.geometry.regions)):
        assert d.kv.block(region, 5) == p.kv.block(region, 1)
        assert d.kv.block(region, 6) == p.kv.block(region, 2)


def test_wrong_token_is_a_refused_handshake(stack: ExitStack) -> None:
    fabric = LoopbackFabric()
    p = Engine(stack, fabric, "p", "127.0.0.1", token="right")
    d = Engine(stack, fabric, "d", "127.0.0.1", token="wrong")
    assert d.runtime is not None
    d.runtime.receive("t1", p.address, [1])
    [r] = results(d.runtime)
    assert r.reason is FailureReason.HANDSHAKE_REFUSED


def test_incompatible_geometry_is_refused_with_the_reason(stack: ExitStack) -> None:
    fabric = LoopbackFabric()
    p = Engine(stack, fabric, "p", "127.0.0.1", num_layers=3)
    d = Engine(stack, fabric, "d", "127.0.0.1")
    assert d.runtime is not None
    d.runtime.receive("t1", p.address, [1])
    [r] = results(d.runtime)
    assert r.reason is FailureReason.INCOMPATIBLE_PEER


def test_nobody_listening_fails_the_handshake(stack: ExitStack) -> None:
    fabric = LoopbackFabric()
    d = Engine(stack, fabric, "d", "127.0.0.1")
    assert d.runtime is not None
    d.runtime.receive("t1", PeerAddress("127.0.0.1", 9), [1])
    [r] = results(d.runtime)
    assert r.reason is FailureReason.HANDSHAKE_FAILED and "127.0.0.1:9" in r.detail


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_dtype_mismatch_is_refused_without_any_compatibility_option(
    stack: ExitStack, host: str
) -> None:
    # Directories as the README builds them (no expected hash): the runtime checks.
    fabric = LoopbackFabric()
    p = Engine(stack, fabric, "p", host, dtype="float16", expect_compat_hash=False)
    d = Engine(stack, fabric, "d", host, dtype="bfloat16", expect_compat_hash=False)
    assert p.runtime is not None and d.runtime is not None
    p.runtime.send("t1", [0])
    d.runtime.receive("t1", p.address, [1])
    [r] = results(d.runtime)
    assert r.reason is FailureReason.INCOMPATIBLE_PEER
    assert "dtype: theirs 'float16', ours 'bfloat16'" in r.detail
    assert p.runtime.statistics().bytes_written == 0
