"""The engine API an integrator needs: a transfer's state, the in-flight ids,
`layers_ready` on a transfer that ended, and publishing metadata from a side channel
that picks its own port. Real runtimes, real `MetadataServer`s (port 0) and
`SideChannelPeerDirectory` over ZeroMQ, bytes on the loopback data plane."""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from helpers.fakes import CrashingTransport
from helpers.ranks import TIMING, Engine
from helpers.waiting import wait_results, wait_until
from kvpush.errors import FailureReason, LocalProtocolError, RuntimeStopped
from kvpush.protocol import ReceiverState, SenderState
from kvpush.runtime import (
    PushRuntime,
    RuntimeIdentity,
    RuntimeSettings,
    SideChannelPeerDirectory,
)
from kvpush.transports.base import TransportEvent
from kvpush.transports.loopback import LoopbackFabric, LoopbackTransport
from transport_conformance import make_kv

pytestmark = pytest.mark.timeout(60)


def timer_slack_ns() -> int:
    """The calling thread's timer slack, from the kernel (Linux prctl PR_GET_TIMERSLACK)."""
    return int(ctypes.CDLL(None).prctl(30, 0, 0, 0, 0))


class SlackRecordingTransport(LoopbackTransport):
    """A loopback transport that notes, per polling thread, that thread's timer slack."""

    def __init__(self, fabric: LoopbackFabric, name: str) -> None:
        super().__init__(fabric, name)
        self.slack_by_thread: dict[str, int] = {}

    def poll(self) -> list[TransportEvent]:
        self.slack_by_thread[threading.current_thread().name] = timer_slack_ns()
        return super().poll()


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_metadata_published_from_a_side_channel_on_port_0(stack: ExitStack, host: str) -> None:
    fabric = LoopbackFabric()
    p, d = Engine(stack, fabric, "p", host), Engine(stack, fabric, "d", host)
    assert p.address.port != 0 and d.address.port != 0
    p.runtime.send("t1", [0, 1])
    d.runtime.receive("t1", p.address, [6, 7])
    [rd], [rp] = wait_results(d.runtime), wait_results(p.runtime)
    assert rd.ok and rp.ok, (rd, rp)
    for region in range(len(p.kv.geometry.regions)):
        assert d.kv.block(region, 6) == p.kv.block(region, 0)
        assert d.kv.block(region, 7) == p.kv.block(region, 1)


@pytest.mark.skipif(sys.platform != "linux", reason="timer slack is a Linux setting")
def test_the_runtimes_thread_waits_with_a_tight_timer_slack_and_the_engines_keep_theirs(
    stack: ExitStack,
) -> None:
    """Linux stretches every timed wait by the thread's timer slack (50 us by default);
    the runtime's short waits between polls would take about 75 us instead of 20."""
    engine_slack = timer_slack_ns()
    fabric = LoopbackFabric()
    p_transport = SlackRecordingTransport(fabric, "p")
    p = Engine(stack, fabric, "p", transport=p_transport)
    d = Engine(stack, fabric, "d", "127.0.0.1")
    d.runtime.receive("t1", p.address, [6, 7])
    wait_until(lambda: p.runtime.statistics().sending.get("registered", 0) == 1)
    p.runtime.send("t1", [0, 1])
    assert all(r.ok for r in wait_results(d.runtime) + wait_results(p.runtime))
    polled = p_transport.slack_by_thread
    runtime_threads = [name for name in polled if name.startswith("kvpush-runtime-")]
    assert runtime_threads, polled
    assert {polled[name] for name in runtime_threads} == {5_000}, polled
    # In-step passes (send(), wait() on this thread) poll with the engine's own slack.
    assert polled[threading.current_thread().name] == engine_slack
    assert timer_slack_ns() == engine_slack


def test_transfer_state_and_in_flight_ids_follow_the_transfer(stack: ExitStack) -> None:
    fabric = LoopbackFabric()
    p, d = Engine(stack, fabric, "p", "127.0.0.1"), Engine(stack, fabric, "d", "127.0.0.1")
    assert d.runtime.transfer_state("t1", "receiver") is None  # never handed in
    d.runtime.receive("t1", p.address, [3, 4])
    wait_until(lambda: d.runtime.transfer_state("t1", "receiver") is ReceiverState.WAITING)
    assert d.runtime.statistics().receiving_transfers == {"t1": "waiting"}
    assert d.runtime.transfer_state("t1", "sender") is None  # not sent from here

    p.runtime.send("t1", [0, 1], ready_layers=[0])  # layer 1 not computed yet
    wait_until(lambda: p.runtime.transfer_state("t1", "sender") is SenderState.WRITING)
    assert p.runtime.statistics().sending_transfers == {"t1": "writing"}
    assert d.runtime.transfer_state("t1", "receiver") is ReceiverState.WAITING

    p.runtime.layers_ready("t1", [1])
    [rd], [rp] = wait_results(d.runtime), wait_results(p.runtime)
    assert rd.ok and rp.ok, (rd, rp)
    assert p.runtime.transfer_state("t1", "sender") is None
    assert d.runtime.transfer_state("t1", "receiver") is None
    assert p.runtime.statistics().sending_transfers == {}
    assert d.runtime.statistics().receiving_transfers == {}
    with pytest.raises(LocalProtocolError, match="side must be"):
        p.runtime.transfer_state("t1", "prefill")  # type: ignore[arg-type]


def test_layers_ready_for_a_transfer_that_ended_raises(stack: ExitStack) -> None:
    fabric = LoopbackFabric()
    p, d = Engine(stack, fabric, "p", "127.0.0.1"), Engine(stack, fabric, "d", "127.0.0.1")
    with pytest.raises(LocalProtocolError, match="never passed to send"):
        p.runtime.layers_ready("never-sent", [0])

    p.runtime.send("t1", [0], ready_layers=[0])
    d.runtime.receive("t1", p.address, [5])
    wait_until(lambda: p.runtime.transfer_state("t1", "sender") is SenderState.WRITING)
    d.runtime.abort("t1")
    [rd] = wait_results(d.runtime)
    assert not rd.ok
    # The sender's result is in, not yet taken: the engine cannot know, so it is accepted.
    wait_until(lambda: p.runtime.statistics().results_queued == 1)
    p.runtime.layers_ready("t1", [1])
    [rp] = p.runtime.poll()
    assert not rp.ok and rp.transfer_id == "t1"
    # Taken: the engine was told its blocks are its own again; computing on is a bug.
    with pytest.raises(LocalProtocolError, match="ended and poll"):
        p.runtime.layers_ready("t1", [1])


def test_failure_says_why_a_runtime_cannot_serve(stack: ExitStack) -> None:
    """What a server's /health reports: None while it serves, the crash once its
    thread died (every transfer reported LOCAL_ERROR), "closed" after close()."""
    fabric = LoopbackFabric()
    kv = make_kv(num_layers=2, num_blocks=8, block_bytes=128)
    transport = CrashingTransport(fabric, "crashy", OSError("the data plane broke"))
    runtime = PushRuntime(
        transport,
        kv.geometry,
        RuntimeIdentity("engine-crashy", "1", "127.0.0.1", 1),
        SideChannelPeerDirectory(timeout_ms=1000),
        RuntimeSettings(timing=TIMING),
    )
    assert runtime.failure is None  # not started yet: nothing wrong
    runtime.start()
    stack.callback(runtime.close)
    assert runtime.failure is None
    runtime.send("t1", [1])
    transport.crash.set()
    [result] = runtime.wait(timeout=10)
    assert result.reason is FailureReason.LOCAL_ERROR and "the data plane broke" in result.detail
    failure = runtime.failure
    assert failure is not None and "crashed" in failure and "the data plane broke" in failure
    with pytest.raises(RuntimeStopped):
        runtime.send("t2", [2])
    runtime.close()
    assert runtime.failure is not None


def test_a_closed_runtime_reports_it(stack: ExitStack) -> None:
    engine = Engine(stack, LoopbackFabric(), "closing")
    assert engine.runtime.failure is None
    engine.runtime.close()
    assert engine.runtime.failure == "push runtime closed"
