"""PushRuntime over the loopback transport: real threads, real byte copies, a fake clock.

The clock is injected; the runtime's own thread still waits in real time, so tests wait
for results with `wait()` (bounded) and move protocol time with `FakeClock.advance`.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Iterator, Sequence

import msgspec
import pytest

from helpers.fakes import CrashingTransport, FakeClock, GatedDirectory, HeldWritesTransport
from helpers.waiting import wait_results, wait_until
from kvpush.config import CompatibilityPolicy, TimingConfig
from kvpush.errors import (
    ClosedError,
    ConfigError,
    FailureReason,
    LocalProtocolError,
    PeerUnreachable,
    TransferFailed,
)
from kvpush.runtime import (
    InMemoryPeerDirectory,
    PeerAddress,
    PeerDirectory,
    PushRuntime,
    RuntimeIdentity,
    RuntimeSettings,
    RuntimeStopped,
    TransferResult,
)
from kvpush.transports.base import TransportEvent
from kvpush.transports.loopback import LoopbackFabric, LoopbackTransport
from transport_conformance import KVBuffers, make_kv

pytestmark = pytest.mark.timeout(60)

TIMING = TimingConfig(
    heartbeat_interval_s=0.5, liveness_timeout_s=3.0, lease_s=5.0, transfer_deadline_s=60.0
)
HOST = "127.0.0.1"


class Cluster:
    """Runtimes on one loopback fabric, published in one in-memory directory."""

    def __init__(self, directory: PeerDirectory | None = None) -> None:
        self.clock = FakeClock()
        self.fabric = LoopbackFabric(clock=self.clock)
        self.published = InMemoryPeerDirectory()
        self.directory = directory or self.published
        self.runtimes: list[PushRuntime] = []
        self.kv: dict[str, KVBuffers] = {}
        self.ports = iter(range(7000, 8000))

    def add(
        self,
        agent: str,
        engine_id: str,
        port: int | None = None,
        transport: LoopbackTransport | None = None,
        cache: dict[str, object] | None = None,
        **kwargs: object,
    ) -> tuple[PushRuntime, PeerAddress]:
        """`cache`: CacheGeometry fields that differ from the default (dtype, layout...)."""
        port = port or next(self.ports)
        kv = make_kv(num_layers=2, num_blocks=16, block_bytes=64)
        kv.fill_random(hash(agent) % 1000)
        geometry = msgspec.structs.replace(kv.geometry, **(cache or {}))
        rt = PushRuntime(
            transport or LoopbackTransport(self.fabric, agent),
            geometry,
            RuntimeIdentity(engine_id, agent, HOST, port),
            self.directory,
            RuntimeSettings(timing=TIMING, **kwargs),  # type: ignore[arg-type]
            clock=self.clock,
        )
        rt.start()
        address = PeerAddress(HOST, port)
        self.published.publish(address, rt.local_metadata())
        self.runtimes.append(rt)
        self.kv[agent] = kv
        return rt, address

    def close(self) -> None:
        for rt in self.runtimes:
            rt.close()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    yield c
    c.close()


def advance_until(
    cluster: Cluster, rt: PushRuntime, step: float, limit: float
) -> list[TransferResult]:
    """Move protocol time in steps, letting the runtime tick, until `rt` reports."""
    moved = 0.0
    while moved <= limit:
        got = rt.wait(timeout=0.02)
        if got:
            return got
        cluster.clock.advance(step)
        moved += step
    raise AssertionError(f"no result within {limit}s of protocol time")


def same_block(a: KVBuffers, a_block: int, b: KVBuffers, b_block: int) -> bool:
    return all(a.block(r, a_block) == b.block(r, b_block) for r in range(len(a.geometry.regions)))


# --------------------------------------------------------------------------- happy paths


def test_whole_request_push_copies_the_bytes(cluster: Cluster) -> None:
    p, p_addr = cluster.add("p-1", "engine-p")
    d, _ = cluster.add("d-1", "engine-d")
    p.send("t1", [1, 2, 3])
    d.receive("t1", p_addr, [9, 4, 5])
    [rd] = wait_results(d)
    [rp] = wait_results(p)
    assert rd.ok and rp.ok and rd.blocks == (9, 4, 5) and rp.blocks == (1, 2, 3)
    a, b = cluster.kv["p-1"], cluster.kv["d-1"]
    assert same_block(a, 1, b, 9) and same_block(a, 2, b, 4) and same_block(a, 3, b, 5)
    stats = p.statistics()
    assert stats.finished == 1 and stats.bytes_written == 3 * a.geometry.bytes_per_block
    assert stats.blocks_held_sending == 0 and stats.in_flight == 0
    # The heartbeat round trip that let the write start bounds d-1's clock; the protocol
    # clock here stands still, so the round trip and its age are 0. Receivers bound none.
    assert stats.clock_bounds == {
        d.agent_name: {"round_trip_s": 0.0, "skew_lb_s": 0.0, "age_s": 0.0}
    }
    assert d.statistics().clock_bounds == {}


def test_statistics_give_the_age_of_the_oldest_transfer_in_flight(cluster: Cluster) -> None:
    p, p_addr = cluster.add("p-1", "engine-p")
    d, _ = cluster.add("d-1", "engine-d")
    assert d.statistics().oldest_in_flight_s is None
    d.receive("t1", p_addr, [1])  # its sender never submits it
    wait_until(lambda: d.statistics().in_flight == 1, what="t1 in flight on d-1")
    cluster.clock.advance(2.5)
    d.receive("t2", p_addr, [2])
    wait_until(lambda: d.statistics().in_flight == 2, what="t2 in flight on d-1")
    cluster.clock.advance(0.5)
    assert d.statistics().oldest_in_flight_s == 3.0  # t1's age, not t2's
    d.abort("t1")
    d.abort("t2")
    assert sorted(r.transfer_id for r in wait_results(d, 2)) == ["t1", "t2"]
    assert d.statistics().oldest_in_flight_s is None
    assert p.statistics().oldest_in_flight_s is None


def test_partial_prefix_hit_and_layer_by_layer(cluster: Cluster) -> None:
    p, p_addr = cluster.add("p-1", "engine-p")
    d, _ = cluster.add("d-1", "engine-d")
    d.receive("t1", p_addr, [7, 8], sender_offset=2)  # registered before the sender is ready
    p.send("t1", [10, 11, 12, 13], ready_layers=[])
    p.layers_ready("t1", [1])
    wait_until(lambda: p.statistics().bytes_written > 0)
    assert d.poll() == []
    p.layers_ready("t1", [0])
    [rd] = wait_results(d)
    assert rd.ok
    a, b = cluster.kv["p-1"], cluster.kv["d-1"]
    assert same_block(a, 12, b, 7) and same_block(a, 13, b, 8)
    assert not same_block(a, 10, b, 7)


def test_a_sending_result_says_what_its_writes_measured(cluster: Cluster) -> None:
    """What vLLM's NIXL metrics read (`result.writes`): a whole push is one write, a
    layer-wise one a write per announcement; bytes and contiguous copies are the data
    plane's, times real and bounded. The receiving side measures nothing."""
    p, p_addr = cluster.add("p-1", "engine-p")
    d, _ = cluster.add("d-1", "engine-d")
    geometry = cluster.kv["p-1"].geometry
    regions = len(geometry.regions)
    started = time.perf_counter()
    p.send("whole", [1, 2, 3])
    d.receive("whole", p_addr, [9, 4, 5])  # 1 -> 9, then 2-3 -> 4-5: two runs per region
    [rd] = wait_results(d)
    [rp] = wait_results(p)
    took = time.perf_counter() - started
    assert rp.ok and rd.ok and rd.writes is None
    w = rp.writes
    assert w is not None
    assert (w.writes, w.nbytes, w.descriptors) == (1, 3 * geometry.bytes_per_block, 2 * regions)
    assert 0 < w.post_s <= w.busy_s < took
    d.receive("layers", p_addr, [7, 8], sender_offset=2)
    p.send("layers", [10, 11, 12, 13], ready_layers=[])
    p.layers_ready("layers", [1])
    wait_until(lambda: p.statistics().bytes_written > w.nbytes)
    p.layers_ready("layers", [0])
    assert wait_results(d)[0].ok
    [rp] = wait_results(p)
    lw = rp.writes
    assert lw is not None
    # Two writes of one layer's regions each, blocks 12-13 -> 7-8: one run per region.
    assert (lw.writes, lw.nbytes, lw.descriptors) == (2, 2 * geometry.bytes_per_block, regions)
    assert 0 < lw.post_s <= lw.busy_s
    # A failed write is a write posted that moved nothing.
    cluster.fabric.fail_writes("p-1", "d-1")
    p.send("failed", [1])
    d.receive("failed", p_addr, [2])
    [rp] = wait_results(p)
    assert rp.reason is FailureReason.WRITE_ERROR and wait_results(d)[0].writes is None
    assert rp.writes is not None and (rp.writes.writes, rp.writes.nbytes) == (1, 0)
    # A full prefix hit at the receiver: finished, nothing written, nothing measured.
    p.send("hit", [1, 2])
    d.receive("hit", p_addr, [], sender_offset=2)
    [rp] = wait_results(p)
    assert rp.ok and rp.writes is None and wait_results(d)[0].ok


def test_full_prefix_hit_frees_the_sender_without_a_write(cluster: Cluster) -> None:
    p, p_addr = cluster.add("p-1", "engine-p")
    d, _ = cluster.add("d-1", "engine-d")
    p.send("t1", [1, 2])
    d.receive("t1", p_addr, [], sender_offset=2)
    assert wait_results(p)[0].ok and wait_results(d)[0].ok
    assert p.statistics().bytes_written == 0


def test_reject_frees_the_sender_at_once(cluster: Cluster) -> None:
    p, p_addr = cluster.add("p-1", "engine-p")
    d, _ = cluster.add("d-1", "engine-d")
    p.send("t1", [1])
    d.reject("t1", p_addr, "no room")
    [r] = wait_results(p)
    assert r.reason is FailureReason.REJECTED and "no room" in r.detail
    # The rejecting side has its own record of the id: REJECTED, no blocks held.
    [mine] = wait_results(d)
    assert (mine.transfer_id, mine.side, mine.reason) == ("t1", "receiver", FailureReason.REJECTED)
    assert mine.blocks == () and "no room" in mine.detail
    assert d.statistics().failures == {"rejected": 1}


# --------------------------------------------------------------------------- the failure queue


def test_peer_not_handshaked_yet_queues_the_failure_once() -> None:
    c = Cluster()
    gated = GatedDirectory(c.published)
    c.directory = gated
    try:
        d, _ = c.add("d-1", "engine-d")
        nowhere = PeerAddress(HOST, 1)  # nobody published there
        d.receive("t1", nowhere, [3, 4])  # returns at once although the lookup blocks
        d.receive("t2", nowhere, [5])  # joins the same handshake
        wait_until(lambda: len(gated.calls) == 1)
        assert d.statistics().receiving == {"handshaking": 2}
        assert d.poll() == []
        gated.gate.set()
        wait_until(lambda: d.statistics().results_queued == 2)
        # Queued, not handled: nothing was reported anywhere until the engine asks.
        results = d.poll()
        assert sorted(r.transfer_id for r in results) == ["t1", "t2"]
        assert {r.reason for r in results} == {FailureReason.HANDSHAKE_FAILED}
        assert "no peer published" in results[0].detail
        assert d.poll() == [] and d.wait(0.05) == []
        stats = d.statistics()
        assert stats.failures == {"handshake_failed": 2} and stats.duplicate_reports == 0
        assert len(gated.calls) == 1
        with pytest.raises(TransferFailed, match="handshake_failed"):
            results[0].raise_for_failure()
    finally:
        c.close()


def test_abort_during_handshake_reports_cancelled_once() -> None:
    c = Cluster()
    gated = GatedDirectory(c.published)
    c.directory = gated
    try:
        p, p_addr = c.add("p-1", "engine-p")
        d, _ = c.add("d-1", "engine-d")
        d.receive("t1", p_addr, [3])
        wait_until(lambda: len(gated.calls) == 1)
        d.abort("t1")
        [r] = wait_results(d)
        assert r.reason is FailureReason.CANCELLED
        p.send("t1", [1])
        gated.gate.set()
        [rp] = wait_results(p)  # told by a Reject once the handshake finished
        assert rp.reason is FailureReason.REJECTED and "before the handshake" in rp.detail
        assert d.wait(0.05) == []
    finally:
        c.close()


def test_write_error_fails_both_sides_and_frees_the_receiver_at_once(cluster: Cluster) -> None:
    p, p_addr = cluster.add("p-1", "engine-p")
    d, _ = cluster.add("d-1", "engine-d")
    cluster.fabric.fail_writes("p-1", "d-1")
    p.send("t1", [1])
    d.receive("t1", p_addr, [2])
    [rp] = wait_results(p)
    [rd] = wait_results(d)
    assert rp.reason is FailureReason.WRITE_ERROR
    assert rd.reason is FailureReason.WRITE_ERROR and "injected" in rd.detail
    assert d.statistics().blocks_held_receiving == 0


def test_sender_dies_receiver_fails_after_liveness_and_fence(cluster: Cluster) -> None:
    _p, p_addr = cluster.add("p-1", "engine-p")
    d, _ = cluster.add("d-1", "engine-d")
    d.receive("t1", p_addr, [2])
    wait_until(lambda: d.statistics().receiving == {"waiting": 1})
    # The sender's host falls off the network, then dies: only silence tells.
    cluster.fabric.partition("p-1", "d-1")
    cluster.fabric.kill("p-1")
    [r] = advance_until(cluster, d, step=0.5, limit=TIMING.transfer_deadline_s)
    assert r.reason is FailureReason.PEER_TIMEOUT and r.blocks == (2,)


def test_announced_peer_loss_fails_at_once(cluster: Cluster) -> None:
    _p, p_addr = cluster.add("p-1", "engine-p")
    d, _ = cluster.add("d-1", "engine-d")
    d.receive("t1", p_addr, [2])
    wait_until(lambda: d.statistics().receiving == {"waiting": 1})
    cluster.fabric.kill("p-1", announce=True)
    [r] = wait_results(d)
    assert r.reason is FailureReason.PEER_GONE


def test_receiver_dies_sender_frees_its_blocks(cluster: Cluster) -> None:
    p, p_addr = cluster.add("p-1", "engine-p")
    d, _ = cluster.add("d-1", "engine-d")
    p.send("t1", [1], ready_layers=[])
    d.receive("t1", p_addr, [2])
    wait_until(lambda: p.statistics().sending == {"writing": 1})
    # The receiver's host falls off the network, then dies: only silence tells.
    cluster.fabric.partition("p-1", "d-1")
    cluster.fabric.kill("d-1")
    [r] = advance_until(cluster, p, step=0.5, limit=TIMING.transfer_deadline_s)
    assert r.reason is FailureReason.PEER_TIMEOUT
    assert p.statistics().blocks_held_sending == 0


def test_restarted_receiver_fails_old_transfers_and_is_handshaked_afresh(
    cluster: Cluster,
) -> None:
    p, p_addr = cluster.add("p-1", "engine-p")
    d1, d_addr = cluster.add("d-1", "engine-d")
    p.send("t1", [1], ready_layers=[])
    d1.receive("t1", p_addr, [2])
    wait_until(lambda: p.statistics().sending == {"writing": 1})
    cluster.fabric.kill("d-1")
    d2, _ = cluster.add("d-2", "engine-d", port=d_addr.port)  # same engine, same address
    p.send("t2", [3])
    d2.receive("t2", p_addr, [4])
    assert wait_results(d2)[0].ok
    results = {r.transfer_id: r for r in wait_results(p, 2)}
    assert results["t1"].reason is FailureReason.PEER_RESTARTED
    assert results["t2"].ok
    assert same_block(cluster.kv["p-1"], 3, cluster.kv["d-2"], 4)


def test_restarted_sender_is_handshaked_afresh(cluster: Cluster) -> None:
    p1, p_addr = cluster.add("p-1", "engine-p")
    d, _ = cluster.add("d-1", "engine-d")
    p1.send("t1", [1])
    d.receive("t1", p_addr, [2])
    assert wait_results(d)[0].ok
    p1.send("t2", [3], ready_layers=[])  # in flight when the sender restarts
    d.receive("t2", p_addr, [4])
    wait_until(lambda: d.statistics().receiving == {"waiting": 1})
    # The old process dies unnoticed (its link falls silent first), so only the new
    # incarnation at its address tells the receiver.
    cluster.fabric.partition("p-1", "d-1")
    cluster.fabric.kill("p-1")
    p2, _ = cluster.add("p-2", "engine-p", port=p_addr.port)
    cluster.clock.advance(2 * TIMING.heartbeat_interval_s + 0.1)  # p-1 has gone quiet
    p2.send("t3", [5])
    d.receive("t3", p_addr, [6])
    results = {r.transfer_id: r for r in wait_results(d, 2)}
    assert results["t2"].reason is FailureReason.PEER_RESTARTED
    assert results["t3"].ok
    assert same_block(cluster.kv["p-2"], 5, cluster.kv["d-1"], 6)


def test_sender_restarted_while_idle_succeeds_on_the_first_transfer(cluster: Cluster) -> None:
    # Nothing in flight when the sender restarts, and it comes back at once: the receiver
    # has heard from its old incarnation moments ago. Its first transfer must still work.
    p1, p_addr = cluster.add("p-1", "engine-p")
    d, _ = cluster.add("d-1", "engine-d")
    p1.send("t1", [1])
    d.receive("t1", p_addr, [2])
    assert wait_results(d)[0].ok
    assert wait_results(p1)[0].ok
    cluster.fabric.kill("p-1")  # silently, as kill -9: nothing tells the receiver
    p2, _ = cluster.add("p-2", "engine-p", port=p_addr.port)
    cluster.clock.advance(0.2)  # well within a heartbeat interval
    p2.send("t2", [5])
    d.receive("t2", p_addr, [6])
    [r] = wait_results(d)
    assert r.ok, r
    assert wait_results(p2)[0].ok
    assert same_block(cluster.kv["p-2"], 5, cluster.kv["d-1"], 6)
    stats = d.statistics()
    assert stats.peers == 1 and stats.failed == 0


def test_sender_restarted_within_the_revalidation_window_succeeds_on_the_first_transfer(
    cluster: Cluster,
) -> None:
    # The sender comes back faster than `revalidate_after_s`: the receiver still trusts its
    # cached metadata and its Register goes to the dead agent. The data plane reports that
    # agent gone in the same pass (as NIXL does when the notification cannot be sent), so
    # the Register reached nobody: the receiver handshakes afresh and registers once more.
    # The receiver's idle wake-up is out of the way, so nothing polls between the kill and
    # the Register.
    p1, p_addr = cluster.add("p-1", "engine-p")
    d, _ = cluster.add("d-1", "engine-d", idle_poll_s=60.0)
    p1.send("t1", [1])
    d.receive("t1", p_addr, [2])
    assert wait_results(d)[0].ok
    assert wait_results(p1)[0].ok
    cluster.fabric.kill("p-1", announce=True)
    p2, _ = cluster.add("p-2", "engine-p", port=p_addr.port)
    cluster.clock.advance(0.05)  # within revalidate_after_s (0.1 s)
    p2.send("t2", [5])
    d.receive("t2", p_addr, [6])
    [r] = wait_results(d)
    assert r.ok, r
    assert wait_results(p2)[0].ok
    assert same_block(cluster.kv["p-2"], 5, cluster.kv["d-1"], 6)
    stats = d.statistics()
    assert stats.failed == 0 and stats.register_retries == 1
    assert stats.peers == 1 and stats.in_flight == 0


def test_register_retry_that_finds_no_live_sender_fails_once(cluster: Cluster) -> None:
    # Nobody came back at that address yet: the one retry's fresh handshake fails (the
    # side channel still names the dead agent), and the transfer ends once, with that reason.
    p1, p_addr = cluster.add("p-1", "engine-p")
    d, _ = cluster.add("d-1", "engine-d", idle_poll_s=60.0)
    p1.send("t1", [1])
    d.receive("t1", p_addr, [2])
    assert wait_results(d)[0].ok
    cluster.fabric.kill("p-1", announce=True)
    d.receive("t2", p_addr, [6])
    [r] = wait_results(d)
    assert r.reason is FailureReason.HANDSHAKE_FAILED and r.blocks == (6,)
    assert "not reachable" in r.detail
    # Nothing is left that could end a second time: nothing in flight, nothing held,
    # no lookup running, and no result was ever dropped as a duplicate.
    stats = d.statistics()
    assert stats.register_retries == 1 and stats.failed == 1
    assert stats.blocks_held_receiving == 0 and stats.in_flight == 0
    assert stats.handshakes_in_flight == 0 and stats.duplicate_reports == 0
    assert stats.results_queued == 0 and d.poll() == []


def test_receiver_abort_mid_transfer_fences_until_the_sender_acks(cluster: Cluster) -> None:
    p, p_addr = cluster.add("p-1", "engine-p")
    d, _ = cluster.add("d-1", "engine-d")
    p.send("t1", [1], ready_layers=[0])
    d.receive("t1", p_addr, [2])
    wait_until(lambda: p.statistics().bytes_written > 0)
    d.abort("t1")
    [rd] = wait_results(d)
    [rp] = wait_results(p)
    assert rd.reason is FailureReason.CANCELLED and rp.reason is FailureReason.CANCELLED
    with pytest.raises(LocalProtocolError, match="ended"):
        p.layers_ready("t1", [1])  # too late: refused, and nothing more is written
    # The snapshot is taken on the runtime's thread after it handled layers_ready: a
    # write issued for it would be in flight (or done) by then.
    stats = p.statistics()
    assert stats.writes_in_flight == 0 and stats.sending == {}
    assert stats.bytes_written == cluster.kv["p-1"].geometry.bytes_per_block // 2
    assert cluster.fabric.statistics().writes_done == 1


def test_garbage_from_a_peer_is_counted_and_does_not_stop_the_runtime(
    cluster: Cluster,
) -> None:
    p, p_addr = cluster.add("p-1", "engine-p")
    d, _ = cluster.add("d-1", "engine-d")
    rogue = LoopbackTransport(cluster.fabric, "rogue")
    rogue.start()
    rogue.register_memory(make_kv(num_layers=2, num_blocks=16, block_bytes=64).geometry)
    meta = d.local_metadata()
    rogue.add_peer(meta.agent_name, meta.agent_metadata, meta.geometry)
    # Without d's message key it is not even read; with it (the rogue read d's
    # metadata, as a peer the side channel admits can), it is garbage, counted.
    rogue.send_message(meta.agent_name, b"\xc1 not msgpack")
    wait_until(lambda: d.statistics().forged_messages == {"bad_key": 1})
    rogue.send_message(meta.agent_name, meta.message_key + b"\xc1 not msgpack")
    wait_until(lambda: d.statistics().malformed_messages == 1)
    p.send("t1", [1])
    d.receive("t1", p_addr, [2])
    assert wait_results(d)[0].ok
    rogue.close()


# --------------------------------------------------------------------------- lifecycle, misuse


def test_exception_on_the_background_thread_fails_transfers_and_stops_the_runtime(
    cluster: Cluster,
) -> None:
    crashing = CrashingTransport(cluster.fabric, "p-1")
    p, _ = cluster.add("p-1", "engine-p", transport=crashing)
    p.send("t1", [1])
    crashing.crash.set()
    [r] = wait_results(p)
    assert r.reason is FailureReason.LOCAL_ERROR and "boom in the data plane" in r.detail
    with pytest.raises(RuntimeStopped, match="boom") as info:
        p.send("t2", [2])
    assert isinstance(info.value.__cause__, RuntimeError)


def test_close_ends_in_flight_transfers_as_shutdown_and_joins_threads(
    cluster: Cluster,
) -> None:
    p, _ = cluster.add("p-1", "engine-p")
    p.send("t1", [1])
    p.close()
    [r] = p.poll()
    assert r.reason is FailureReason.SHUTDOWN
    names = {t.name for t in threading.enumerate()}
    assert not {n for n in names if n.endswith("p-1")}
    with pytest.raises(ClosedError):
        p.send("t2", [1])


class RecordingTransport(LoopbackTransport):
    """A loopback endpoint that notes when each poll() happens (on the runtime thread)."""

    def __init__(self, fabric: LoopbackFabric, name: str) -> None:
        super().__init__(fabric, name)
        self.polls: list[float] = []

    def poll(self) -> list[TransportEvent]:
        self.polls.append(time.monotonic())
        return super().poll()

    def gaps_after(self, mark: int, n: int) -> list[float]:
        """The `n` waits between polls that followed poll number `mark` (waits for them)."""
        wait_until(lambda: len(self.polls) > mark + n, timeout=30.0)
        times = self.polls[mark : mark + n + 1]
        return [b - a for a, b in itertools.pairwise(times)]


def test_idle_runtime_waits_idle_poll_s_between_polls(cluster: Cluster) -> None:
    recording = RecordingTransport(cluster.fabric, "p-1")
    cluster.add("p-1", "engine-p", transport=recording, idle_poll_s=0.05)
    gaps = recording.gaps_after(1, 5)  # nothing in flight: it blocks on its queue
    assert min(gaps) >= 0.045, gaps  # a lower bound only: a slow machine waits longer


def backed_off_from(gaps: list[float], max_backoff_s: float) -> int:
    """Where the back-off first reached `max_backoff_s`: the first wait at least 90 % of
    it. Found by what the waits show, not by a count of polls, which a slow host shifts."""
    reached = [i for i, g in enumerate(gaps) if g >= 0.9 * max_backoff_s]
    assert reached, f"the loop never waited {max_backoff_s} s between polls: {gaps}"
    return reached[0]


def test_in_flight_runtime_backs_off_to_max_backoff_not_a_busy_loop(cluster: Cluster) -> None:
    recording = RecordingTransport(cluster.fabric, "p-1")
    p, _ = cluster.add("p-1", "engine-p", transport=recording, max_backoff_s=0.002)
    p.send("t1", [1])  # waits for a receiver that never comes: in flight, nothing to do
    mark = len(recording.polls)
    gaps = recording.gaps_after(mark, 100)
    capped = backed_off_from(gaps, 0.002)  # past the doubling from 50 us
    # Lower bounds only: a loaded host lengthens the waits, it never shortens them.
    assert statistics.median(gaps[capped : capped + 30]) >= 0.0018, gaps


def test_polling_after_activity_spins_briefly_then_backs_off(cluster: Cluster) -> None:
    # A transfer finished (data-plane activity on both sides), then a new one waits for a
    # receiver that never comes: the short spin after the activity ends, and the loop
    # backs off again.
    recording = RecordingTransport(cluster.fabric, "p-1")
    p, p_addr = cluster.add(
        "p-1", "engine-p", transport=recording, spin_s=0.005, max_backoff_s=0.002
    )
    d, _ = cluster.add("d-1", "engine-d")
    p.send("t1", [1])
    d.receive("t1", p_addr, [2])
    assert wait_results(p)[0].ok
    p.send("t2", [3])
    mark = len(recording.polls)
    # Up to 5 ms / 20 us = 250 polls of spin (the runtime's thread runs with a 5 us timer
    # slack, so its 20 us waits are not stretched to 75 us), then the back-off.
    gaps = recording.gaps_after(mark, 400)
    spin_end = backed_off_from(gaps, 0.002)  # it does back off: the spin ended
    # Briefly: the spin and the doubling took less wall time than the back-off polls
    # that followed (about 150 waits of 2 ms), a baseline measured in this run at this
    # host's load. A spin that went on, by time or by count, would have used up the
    # 400 polls or outlasted that baseline.
    assert sum(gaps[:spin_end]) < sum(gaps[spin_end:]), (spin_end, gaps)
    assert statistics.median(gaps[-30:]) >= 0.0018, gaps


def test_poll_settings_are_checked_at_construction(cluster: Cluster) -> None:
    geometry = make_kv(num_layers=2, num_blocks=16, block_bytes=64).geometry
    for bad in ({"spin_s": -1.0}, {"revalidate_after_s": -0.1}, {"max_backoff_s": 0.0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            PushRuntime(
                LoopbackTransport(cluster.fabric, "x"),
                geometry,
                RuntimeIdentity("e", "1", HOST, 1),
                cluster.directory,
                RuntimeSettings(**bad),  # type: ignore[arg-type]
            )


def test_engine_misuse_raises_at_the_call(cluster: Cluster) -> None:
    p, p_addr = cluster.add("p-1", "engine-p")
    p.send("t1", [1], ready_layers=[])
    with pytest.raises(LocalProtocolError, match="already in flight"):
        p.send("t1", [2])
    with pytest.raises(LocalProtocolError, match=r"outside the cache: expected integers in 0..15"):
        p.send("t2", [16])
    with pytest.raises(LocalProtocolError, match="repeat"):
        p.send("t2", [1, 1])
    with pytest.raises(LocalProtocolError, match="layers"):
        p.layers_ready("t1", [5])
    with pytest.raises(LocalProtocolError, match="sender_offset"):
        p.receive("t3", p_addr, [1], sender_offset=-1)
    # Counted in a sender's smaller blocks: ids of the parts of ours (16 blocks, 2 each).
    with pytest.raises(LocalProtocolError, match=r"outside the cache: expected integers in 0..31"):
        p.receive("t3", p_addr, [31, 32], sender_block_tokens=8)
    for size in (3, 32, 0):
        with pytest.raises(
            LocalProtocolError,
            match=rf"sender_block_tokens {size} does not divide our 16-token blocks: expected",
        ):
            p.receive("t3", p_addr, [1], sender_block_tokens=size)
    with pytest.raises(LocalProtocolError, match="non-empty"):
        p.abort("")
    fresh = PushRuntime(
        LoopbackTransport(cluster.fabric, "x"),
        cluster.kv["p-1"].geometry,
        RuntimeIdentity("e", "1", HOST, 1),
        cluster.directory,
    )
    with pytest.raises(LocalProtocolError, match="start"):
        fresh.send("t", [1])
    with pytest.raises(LocalProtocolError, match="start"):
        fresh.local_metadata()
    fresh.close()


def test_in_memory_directory_says_what_is_missing() -> None:
    directory = InMemoryPeerDirectory()
    with pytest.raises(PeerUnreachable, match="no peer published at h:1"):
        directory.lookup("h", 1, 0)


# --------------------------------------------------------------------------- never wrong


@pytest.mark.parametrize(
    ("theirs", "named"),
    [
        ({"dtype": "float16"}, "dtype: theirs 'float16', ours 'uint8'"),
        ({"layout": "kv_separate/HND"}, "layout: theirs 'kv_separate/HND', ours 'kv_separate/NHD'"),
    ],
)
def test_caches_that_differ_only_in_dtype_or_layout_never_transfer(
    cluster: Cluster, theirs: dict[str, object], named: str
) -> None:
    # Set up as the README shows, no compatibility option anywhere: the check is on.
    p, p_addr = cluster.add("p-1", "engine-p", cache=theirs)
    d, _ = cluster.add("d-1", "engine-d")
    p.send("t1", [1])
    d.receive("t1", p_addr, [2])
    [rd] = wait_results(d)
    assert rd.reason is FailureReason.INCOMPATIBLE_PEER and rd.blocks == (2,)
    assert named in rd.detail
    # The receiver refused before registering, and told the sender why (its Reject
    # names the same field from the sender's side): the sender frees its blocks now.
    [rp] = wait_results(p)
    assert rp.reason is FailureReason.INCOMPATIBLE_PEER and rp.blocks == (1,)
    field = named.split(":", maxsplit=1)[0]
    assert f"{field}: theirs" in rp.detail and rp.detail != rd.detail
    assert p.statistics().bytes_written == 0 and cluster.fabric.statistics().writes_done == 0
    assert d.statistics().peers == 0  # and nothing was cached for the next transfer


def test_a_sender_refuses_an_incompatible_receiver_on_its_own_handshake(
    cluster: Cluster,
) -> None:
    # This receiver decided (explicitly, typed) that another dtype is fine; the sender
    # did not, and its own check refuses when it handshakes back.
    lenient = CompatibilityPolicy(frozenset({"dtype"}), reason="test: a lenient receiver")
    p, p_addr = cluster.add("p-1", "engine-p")
    d, _ = cluster.add("d-1", "engine-d", cache={"dtype": "float16"}, compatibility=lenient)
    p.send("t1", [1])
    d.receive("t1", p_addr, [2])
    [rp] = wait_results(p)
    assert rp.reason is FailureReason.INCOMPATIBLE_PEER
    assert "dtype: theirs 'float16', ours 'uint8'" in rp.detail
    assert p.statistics().bytes_written == 0 and cluster.fabric.statistics().writes_done == 0
    # Its Failed tells the receiver at once, in the receiver's own terms.
    [rd] = wait_results(d)
    assert rd.reason is FailureReason.INCOMPATIBLE_PEER and rd.blocks == (2,)
    assert "dtype: theirs 'uint8', ours 'float16'" in rd.detail


def test_an_explicit_policy_lets_a_named_field_differ(cluster: Cluster) -> None:
    policy = CompatibilityPolicy(frozenset({"layout"}), reason="test mapping")
    p, p_addr = cluster.add(
        "p-1", "engine-p", cache={"layout": "kv_first/NHD"}, compatibility=policy
    )
    d, _ = cluster.add("d-1", "engine-d", compatibility=policy)
    p.send("t1", [1])
    d.receive("t1", p_addr, [2])
    assert wait_results(d)[0].ok and wait_results(p)[0].ok
    with pytest.raises(ConfigError, match="CompatibilityPolicy"):
        cluster.add("x-1", "engine-x", compatibility="off")


def start_a_held_write(cluster: Cluster) -> tuple[HeldWritesTransport, PushRuntime, PushRuntime]:
    """Transfer t1 (sender block 1 -> receiver block 2), its write issued and held."""
    held = HeldWritesTransport(cluster.fabric, "p-1")
    p, p_addr = cluster.add("p-1", "engine-p", transport=held)
    d, _ = cluster.add("d-1", "engine-d")
    p.send("t1", [1])
    d.receive("t1", p_addr, [2])
    wait_until(lambda: held.held() == 1)
    return held, p, d


def test_a_silent_receiver_does_not_get_the_senders_blocks_back_while_a_write_is_out(
    cluster: Cluster,
) -> None:
    held, p, d = start_a_held_write(cluster)
    cluster.fabric.delay("d-1", "p-1", count=10**6)  # the receiver falls silent
    # Past liveness and the lease: the sender gives up, but a write is out.
    for _ in range(int((TIMING.liveness_timeout_s + TIMING.lease_s) / 0.5) + 4):
        cluster.clock.advance(0.5)
        assert p.wait(timeout=0.02) == [], "blocks handed back while the write is out"
    stats = p.statistics()
    assert stats.sending == {"ending": 1} and stats.writes_in_flight == 1
    assert stats.blocks_held_sending == 1
    held.release()  # the write goes (from block 1 as it is: not reused, since held)
    [rp] = wait_results(p)
    [rd] = wait_results(d)
    assert rp.ok and rd.ok  # Done rode on the write: both finished, with the right bytes
    assert same_block(cluster.kv["p-1"], 1, cluster.kv["d-1"], 2)


def test_close_waits_for_a_write_that_is_out_before_it_reports(cluster: Cluster) -> None:
    held, p, d = start_a_held_write(cluster)
    released = threading.Event()

    def release() -> None:
        released.set()  # first: the write can finish only after this
        held.release()

    releaser = threading.Timer(0.3, release)
    releaser.start()
    p.close(timeout=6.0)
    # It waited for the write: by the time close returns, the write was let go. (A bound
    # on the time close took read a clock started after the timer's, and came 0.3 ms short.)
    assert released.is_set()
    releaser.join()
    [rp] = p.poll()
    assert rp.ok  # the write carried Done: it finished during the drain
    assert wait_results(d)[0].ok and same_block(cluster.kv["p-1"], 1, cluster.kv["d-1"], 2)


def test_close_reports_a_write_that_never_finishes_only_after_the_transport_closed(
    cluster: Cluster,
) -> None:
    held, p, _ = start_a_held_write(cluster)
    held.on_close = p.poll  # what had been reported when the transport closed
    start = time.monotonic()
    p.close(timeout=1.0)
    assert time.monotonic() - start < 1.0 + 0.5  # the drain is bounded by close's timeout
    assert held.seen_at_close == []  # its blocks came back only once the transport closed
    [rp] = p.poll()
    assert rp.reason is FailureReason.SHUTDOWN and rp.blocks == (1,)
    assert not any(t.name.endswith("p-1") for t in threading.enumerate())


class StallingTransport(LoopbackTransport):
    """A loopback endpoint whose runtime thread the test can stop in poll(), before it
    reads anything, as a SIGSTOP would: nothing it was sent is read, no command it was
    given runs. The stopped poll returns nothing, so on resume the commands queued
    meanwhile run first, then the inbox is read (a stop between two loop passes)."""

    def __init__(self, fabric: LoopbackFabric, name: str) -> None:
        super().__init__(fabric, name)
        self.stop = threading.Event()
        self.stopped = threading.Event()
        self.resume = threading.Event()

    def poll(self) -> list[TransportEvent]:
        if self.stop.is_set():
            self.stopped.set()
            self.resume.wait(30)
            self.stop.clear()
            return []
        return super().poll()


def test_a_stalled_sender_never_writes_into_blocks_the_receiver_gave_back(
    cluster: Cluster,
) -> None:
    stalling = StallingTransport(cluster.fabric, "p-1")
    p, p_addr = cluster.add("p-1", "engine-p", transport=stalling)
    d, _ = cluster.add("d-1", "engine-d")
    p.send("t0", [0])
    d.receive("t0", p_addr, [0])
    assert wait_results(d)[0].ok and wait_results(p)[0].ok
    writes_before = cluster.fabric.statistics().writes_done
    stalling.stop.set()
    assert stalling.stopped.wait(10)  # the sender's runtime thread is stopped
    d.receive("t1", p_addr, [2])  # its Register waits in the stopped sender's inbox
    wait_until(lambda: d.statistics().receiving == {"waiting": 1})
    p.send("t1", [1])  # queued: it runs first when the sender resumes
    [rd] = advance_until(cluster, d, step=0.5, limit=TIMING.liveness_timeout_s + 20.0)
    assert rd.reason is FailureReason.PEER_TIMEOUT and rd.blocks == (2,)
    kv = cluster.kv["d-1"]
    for tensor in kv.tensors:  # the engine reuses block 2 at once: a canary
        tensor[2].fill_(0xAB)
    canary = [kv.block(r, 2) for r in range(len(kv.geometry.regions))]
    stalling.resume.set()  # the sender resumes, its clock far ahead of the Register
    [rp] = wait_results(p)
    assert rp.reason in (FailureReason.PEER_TIMEOUT, FailureReason.CANCELLED), rp
    assert [kv.block(r, 2) for r in range(len(kv.geometry.regions))] == canary
    assert cluster.fabric.statistics().writes_done == writes_before
    # PEER_TIMEOUT when the sender refused the stale Register, CANCELLED when it read the
    # receiver's Cancel first, while it measured the receiver's clock again.
    assert "Register" in rp.detail or rp.reason is FailureReason.CANCELLED, rp


# --------------------------------------------------------------------------- in-step driving


class ThreadNotingTransport(LoopbackTransport):
    """A loopback endpoint that notes which thread polls it and which issues each write."""

    def __init__(self, fabric: LoopbackFabric, name: str) -> None:
        super().__init__(fabric, name)
        self.last_poll_thread = ""
        self.write_threads: list[str] = []

    def poll(self) -> list[TransportEvent]:
        self.last_poll_thread = threading.current_thread().name
        return super().poll()

    def write_blocks(
        self,
        peer: str,
        write_id: int,
        our_blocks: Sequence[int],
        their_blocks: Sequence[int],
        notification: bytes | None,
        regions: Sequence[int] | None = None,
    ) -> None:
        self.write_threads.append(threading.current_thread().name)
        super().write_blocks(peer, write_id, our_blocks, their_blocks, notification, regions)


def _registered_sender(
    cluster: Cluster, **kwargs: object
) -> tuple[ThreadNotingTransport, PushRuntime]:
    noting = ThreadNotingTransport(cluster.fabric, "p-1")
    p, p_addr = cluster.add("p-1", "engine-p", transport=noting, **kwargs)
    d, _ = cluster.add("d-1", "engine-d")
    d.receive("t1", p_addr, [2])
    wait_until(lambda: p.statistics().sending == {"registered": 1})
    return noting, p


def test_an_engine_call_runs_the_runtime_pass_on_the_engine_thread(cluster: Cluster) -> None:
    # No hand-off to the runtime's thread: the engine's send() writes itself, when no
    # other thread is driving. An engine that polls has the runtime thread stand by.
    noting, p = _registered_sender(cluster)
    me = threading.current_thread().name
    wait_until(lambda: not p.poll() and noting.last_poll_thread == me)
    p.send("t1", [1])
    assert noting.write_threads == [me]
    [r] = wait_results(p)
    assert r.ok
    assert same_block(cluster.kv["p-1"], 1, cluster.kv["d-1"], 2)


def test_without_in_step_driving_the_runtime_thread_writes(cluster: Cluster) -> None:
    noting, p = _registered_sender(cluster, drive_in_step=False)
    p.send("t1", [1])
    [r] = wait_results(p)
    assert r.ok and noting.write_threads == ["kvpush-runtime-p-1"]
    assert noting.last_poll_thread == "kvpush-runtime-p-1"
