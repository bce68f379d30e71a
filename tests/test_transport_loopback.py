"""The loopback transport: the conformance suite, and the faults it injects."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from helpers.fakes import FakeClock
from kvpush.errors import FailureReason, LocalProtocolError, TransportError
from kvpush.transports.base import MessageReceived, PeerLost, Transport, WriteDone, WriteFailed
from kvpush.transports.loopback import Fault, LoopbackFabric, LoopbackTransport
from transport_conformance import (
    KVBuffers,
    TransportConformance,
    TransportFactory,
    make_kv,
    messages,
    pump,
    settle,
    write_results,
)


class TestLoopbackConformance(TransportConformance):
    @pytest.fixture
    def transport_factory(self) -> TransportFactory:
        fabric = LoopbackFabric()
        return lambda name: LoopbackTransport(fabric, name)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fabric(clock: FakeClock) -> LoopbackFabric:
    return LoopbackFabric(clock=clock)


class Endpoints:
    def __init__(self, fabric: LoopbackFabric) -> None:
        self.fabric = fabric
        self.made: list[tuple[LoopbackTransport, KVBuffers]] = []

    def __call__(self, name: str, seed: int | None = None) -> tuple[LoopbackTransport, KVBuffers]:
        kv = make_kv()
        if seed is not None:
            kv.fill_random(seed)
        t = LoopbackTransport(self.fabric, name)
        t.start()
        t.register_memory(kv.geometry)
        for other, other_kv in self.made:
            t.add_peer(other.agent_name, other.metadata(), other_kv.geometry)
            other.add_peer(name, t.metadata(), kv.geometry)
        self.made.append((t, kv))
        return t, kv


@pytest.fixture
def endpoints(fabric: LoopbackFabric) -> Iterator[Endpoints]:
    eps = Endpoints(fabric)
    yield eps
    for t, _ in eps.made:
        t.close()


def payloads(t: Transport) -> list[bytes]:
    return [m.payload for m in messages(t.poll())]


def test_drop(endpoints: Endpoints, fabric: LoopbackFabric) -> None:
    a, _ = endpoints("a")
    b, _ = endpoints("b")
    fabric.drop("a", "b", count=2)
    for i in range(4):
        a.send_message("b", bytes([i]))
    assert payloads(b) == [b"\x02", b"\x03"]
    assert fabric.statistics().messages_dropped == 2


def test_drop_only_matching_messages(endpoints: Endpoints, fabric: LoopbackFabric) -> None:
    a, _ = endpoints("a")
    b, _ = endpoints("b")
    fabric.inject("a", "b", Fault.DROP, count=1, match=lambda p: p.startswith(b"done"))
    for p in (b"hb", b"done 1", b"hb", b"done 2"):
        a.send_message("b", p)
    assert payloads(b) == [b"hb", b"hb", b"done 2"]


def test_duplicate(endpoints: Endpoints, fabric: LoopbackFabric) -> None:
    a, _ = endpoints("a")
    b, _ = endpoints("b")
    fabric.duplicate("a", "b")
    a.send_message("b", b"x")
    a.send_message("b", b"y")
    assert payloads(b) == [b"x", b"x", b"y"]


def test_delay_by_clock(endpoints: Endpoints, fabric: LoopbackFabric, clock: FakeClock) -> None:
    a, _ = endpoints("a")
    b, _ = endpoints("b")
    fabric.delay("a", "b", delay_s=2.0)
    a.send_message("b", b"late")
    a.send_message("b", b"on time")
    assert payloads(b) == [b"on time"]
    clock.advance(1.9)
    assert payloads(b) == []
    clock.advance(0.2)
    assert payloads(b) == [b"late"]


def test_delay_until_released(endpoints: Endpoints, fabric: LoopbackFabric) -> None:
    a, _ = endpoints("a")
    b, _ = endpoints("b")
    fabric.delay("a", "b")
    a.send_message("b", b"held")
    assert payloads(b) == []
    assert fabric.statistics().messages_held == 1
    assert fabric.release_delayed() == 1
    assert payloads(b) == [b"held"]


def test_reorder(endpoints: Endpoints, fabric: LoopbackFabric) -> None:
    a, _ = endpoints("a")
    b, _ = endpoints("b")
    fabric.reorder("a", "b")
    a.send_message("b", b"1")
    assert payloads(b) == []
    a.send_message("b", b"2")
    a.send_message("b", b"3")
    assert payloads(b) == [b"2", b"1", b"3"]


def test_faults_apply_per_direction(endpoints: Endpoints, fabric: LoopbackFabric) -> None:
    a, _ = endpoints("a")
    b, _ = endpoints("b")
    fabric.drop("a", "b")
    b.send_message("a", b"from b")
    a.send_message("b", b"from a")
    assert payloads(a) == [b"from b"]
    assert payloads(b) == []


def test_delayed_notification_still_follows_its_data(
    endpoints: Endpoints, fabric: LoopbackFabric
) -> None:
    a, a_kv = endpoints("a", seed=3)
    b, b_kv = endpoints("b")
    fabric.delay("a", "b")
    a.write_blocks("b", 1, [0], [0], b"done")
    assert a.poll() == [WriteDone(1)]
    assert b.poll() == []
    assert b_kv.block(0, 0) == a_kv.block(0, 0)  # data landed, notification held
    fabric.release_delayed()
    assert b.poll() == [MessageReceived("a", b"done")]


def test_failed_write_sends_no_notification(endpoints: Endpoints, fabric: LoopbackFabric) -> None:
    a, a_kv = endpoints("a", seed=3)
    b, b_kv = endpoints("b")
    fabric.fail_writes("a", "b", partial=True)
    a.write_blocks("b", 1, [0, 1, 2, 3], [0, 1, 2, 3], b"done")
    [event] = a.poll()
    assert isinstance(event, WriteFailed)
    assert event.write_id == 1 and event.reason is FailureReason.WRITE_ERROR
    assert b.poll() == []
    # Partly written: the first half landed, the rest did not.
    assert b_kv.block(0, 0) == a_kv.block(0, 0)
    assert b_kv.block(0, 3) == bytes(256)
    # The fault is spent: the next write goes through.
    a.write_blocks("b", 2, [3], [3], b"done 2")
    assert a.poll() == [WriteDone(2)]
    assert payloads(b) == [b"done 2"]


def test_killed_receiver(endpoints: Endpoints, fabric: LoopbackFabric) -> None:
    a, _ = endpoints("a", seed=1)
    b, b_kv = endpoints("b")
    fabric.kill("b")
    a.write_blocks("b", 1, [0], [0], b"done")
    a.send_message("b", b"hello?")
    events = a.poll()
    [failed] = [e for e in events if isinstance(e, WriteFailed)]
    [lost] = [e for e in events if isinstance(e, PeerLost)]
    assert len(events) == 2, events
    assert failed.write_id == 1 and failed.reason is FailureReason.PEER_GONE
    assert lost.reason is FailureReason.PEER_GONE
    assert lost.peer == "b" and "not delivered" in lost.detail
    assert fabric.statistics().messages_dropped == 1
    assert b_kv.block(0, 0) == bytes(256)  # nothing written into a dead process
    assert b.poll() == []
    assert "b" not in fabric.endpoints()


def test_killed_sender_sends_nothing_more(endpoints: Endpoints, fabric: LoopbackFabric) -> None:
    a, _ = endpoints("a", seed=1)
    b, b_kv = endpoints("b")
    a.write_blocks("b", 1, [0], [0], b"done")
    a.send_message("b", b"queued before death")
    fabric.kill("a")
    # The message was already on the wire; the write was still queued in the dead process.
    assert a.poll() == []
    assert payloads(b) == [b"queued before death"]
    assert b_kv.block(0, 0) == bytes(256)
    a.send_message("b", b"from beyond")
    assert b.poll() == []


def test_kill_can_be_announced(endpoints: Endpoints, fabric: LoopbackFabric) -> None:
    a, _ = endpoints("a")
    _, _ = endpoints("b")
    c, _ = endpoints("c")
    fabric.kill("b", announce=True)
    [lost] = a.poll()
    assert isinstance(lost, PeerLost)
    assert lost.peer == "b" and lost.reason is FailureReason.PEER_GONE
    assert [e for e in c.poll() if isinstance(e, PeerLost)] == [lost]


def test_a_killed_peer_cannot_be_handshaked_again(
    endpoints: Endpoints, fabric: LoopbackFabric
) -> None:
    a, _ = endpoints("a")
    b, b_kv = endpoints("b")
    metadata = b.metadata()
    fabric.kill("b")
    a.remove_peer("b")
    with pytest.raises(TransportError) as info:
        a.add_peer("b", metadata, b_kv.geometry)
    assert info.value.reason is FailureReason.HANDSHAKE_FAILED


def test_partition_and_heal(endpoints: Endpoints, fabric: LoopbackFabric) -> None:
    a, _ = endpoints("a", seed=1)
    b, _ = endpoints("b")
    c, _ = endpoints("c")
    fabric.partition("a", "b")
    a.send_message("b", b"lost")
    b.send_message("a", b"lost too")
    a.send_message("c", b"fine")
    a.write_blocks("b", 1, [0], [0], b"done")
    [failed] = a.poll()
    assert isinstance(failed, WriteFailed) and failed.reason is FailureReason.PEER_GONE
    assert payloads(b) == []
    assert payloads(c) == [b"fine"]
    fabric.heal("a", "b")
    a.write_blocks("b", 2, [0], [0], b"done")
    assert a.poll() == [WriteDone(2)]
    assert payloads(b) == [b"done"]


def test_remove_peer_fails_queued_writes(endpoints: Endpoints) -> None:
    a, _ = endpoints("a")
    _, _ = endpoints("b")
    a.write_blocks("b", 1, [0], [0], b"done")
    a.remove_peer("b")
    [failed] = a.poll()
    assert isinstance(failed, WriteFailed) and failed.write_id == 1


def test_names_are_never_reused(fabric: LoopbackFabric) -> None:
    first = LoopbackTransport(fabric, "engine-1")
    first.start()
    first.close()
    second = LoopbackTransport(fabric, "engine-1")
    with pytest.raises(LocalProtocolError, match="unique"):
        second.start()


def test_cuda_regions_are_refused(fabric: LoopbackFabric) -> None:
    import msgspec

    kv = make_kv()
    geometry = msgspec.structs.replace(
        kv.geometry,
        regions=tuple(msgspec.structs.replace(r, device="cuda:0") for r in kv.geometry.regions),
    )
    t = LoopbackTransport(fabric, "gpu")
    t.start()
    try:
        with pytest.raises(TransportError, match="CPU memory only"):
            t.register_memory(geometry)
    finally:
        t.close()


def test_foreign_region_addresses_are_refused(endpoints: Endpoints) -> None:
    import msgspec

    a, _ = endpoints("a")
    b_kv = make_kv()
    b = LoopbackTransport(endpoints.fabric, "b")
    b.start()
    b.register_memory(b_kv.geometry)
    bogus = msgspec.structs.replace(
        b_kv.geometry,
        regions=tuple(
            msgspec.structs.replace(r, base_addr=r.base_addr + 4096) for r in b_kv.geometry.regions
        ),
    )
    try:
        with pytest.raises(TransportError, match="not inside memory"):
            a.add_peer("b", b.metadata(), bogus)
    finally:
        b.close()


def test_endpoints_on_their_own_threads(endpoints: Endpoints) -> None:
    """Each endpoint driven by its own thread, as the runtime does; the fabric is shared."""
    a, a_kv = endpoints("a", seed=11)
    b, b_kv = endpoints("b")
    n = 200
    received: list[bytes] = []

    def receiver() -> None:
        while len(received) < n:
            received.extend(m.payload for m in messages(b.poll()))

    thread = threading.Thread(target=receiver)
    thread.start()
    results = []
    for i in range(n):
        a.write_blocks("b", i, [i % 8], [(i * 3) % 8], f"{i}".encode())
        if i % 10 == 0:
            results.extend(write_results(a.poll()))
    results.extend(pump([a], lambda ev: len(results) + len(write_results(ev[0])) == n)[0])
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert sorted(r.write_id for r in write_results(results)) == list(range(n))
    assert sorted(received, key=int) == [f"{i}".encode() for i in range(n)]
    for x in range(8):
        src = next(i % 8 for i in reversed(range(n)) if (i * 3) % 8 == x)
        assert b_kv.block(0, x) == a_kv.block(0, src)
    assert settle([a, b], 0.05) == [[], []]
