"""Claims and stopping (issue 39), through `PushRuntime` over the loopback transport:
real threads, real byte copies, a fake clock given to the constructors.

A sender gives up a transfer that no receiver registered or claimed within its claim
window; a receiver holding the request queued claims it; a runtime that closes tells
its peers about what it held, so none waits for its deadline."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helpers.fakes import FakeClock
from helpers.waiting import wait_results, wait_until
from kvpush.config import TimingConfig
from kvpush.errors import FailureReason
from kvpush.runtime import (
    InMemoryPeerDirectory,
    PeerAddress,
    PushRuntime,
    RuntimeIdentity,
    RuntimeSettings,
    TransferResult,
)
from kvpush.transports.loopback import LoopbackFabric, LoopbackTransport
from transport_conformance import KVBuffers, make_kv

pytestmark = pytest.mark.timeout(60)

WINDOW = 4.0
TIMING = TimingConfig(
    heartbeat_interval_s=0.5,
    liveness_timeout_s=3.0,
    lease_s=5.0,
    transfer_deadline_s=60.0,
    claim_window_s=WINDOW,
)
HOST = "127.0.0.1"


class Pair:
    """A sender and a receiver runtime on one loopback fabric and one fake clock."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.fabric = LoopbackFabric(clock=self.clock)
        self.directory = InMemoryPeerDirectory()
        self.kv: dict[str, KVBuffers] = {}
        self.runtimes: list[PushRuntime] = []
        self.sender, self.sender_address = self.add("p-1", "engine-p", 7100)
        self.receiver, self.receiver_address = self.add("d-1", "engine-d", 7101)

    def add(self, agent: str, engine: str, port: int) -> tuple[PushRuntime, PeerAddress]:
        kv = make_kv(num_layers=2, num_blocks=16, block_bytes=64)
        kv.fill_random(port)
        rt = PushRuntime(
            LoopbackTransport(self.fabric, agent),
            kv.geometry,
            RuntimeIdentity(engine, agent, HOST, port),
            self.directory,
            RuntimeSettings(timing=TIMING),
            clock=self.clock,
        )
        rt.start()
        address = PeerAddress(HOST, port)
        self.directory.publish(address, rt.local_metadata())
        self.kv[agent] = kv
        self.runtimes.append(rt)
        return rt, address

    def run(self, seconds: float, step: float = 0.25) -> None:
        """Protocol time passes in steps, each seen by both runtimes' threads."""
        moved = 0.0
        while moved < seconds:
            self.clock.advance(step)
            moved += step
            for rt in self.runtimes:
                rt.statistics()  # a pass on its thread: it ticks at the new time

    def until_result(self, rt: PushRuntime, limit: float, step: float = 0.25) -> TransferResult:
        moved = 0.0
        while moved <= limit:
            got = rt.wait(timeout=0.02)
            if got:
                [r] = got
                return r
            self.clock.advance(step)
            moved += step
        raise AssertionError(f"no result within {limit}s of protocol time")

    def close(self) -> None:
        for rt in self.runtimes:
            rt.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_an_unclaimed_transfer_is_given_up_at_the_window_well_before_the_deadline(
    pair: Pair,
) -> None:
    pair.sender.send("t1", [1, 2])
    start = pair.clock()
    r = pair.until_result(pair.sender, limit=TIMING.transfer_deadline_s)
    assert r.reason is FailureReason.PEER_TIMEOUT and "claimed" in r.detail
    assert WINDOW <= pair.clock() - start <= WINDOW + 1.0
    assert pair.sender.statistics().blocks_held_sending == 0


def test_a_claimed_transfer_outlives_several_windows_and_its_bytes_arrive(pair: Pair) -> None:
    pair.sender.send("t1", [3, 4])
    pair.receiver.claim("t1", pair.sender_address)
    assert pair.receiver.statistics().claimed == 1
    # The lookup of the sender runs on a thread of its own, in real time: until it is
    # done the receiver has no one to send its claim to, and the protocol's time must
    # not run past the window meanwhile (a loaded CI host took longer than 4 s of it).
    wait_until(lambda: pair.receiver.statistics().peers == 1)
    pair.run(3 * WINDOW)
    assert pair.sender.transfer_state("t1", "sender") is not None, "given up while claimed"
    pair.receiver.receive("t1", pair.sender_address, [9, 10])
    [sent] = wait_results(pair.sender)
    [received] = wait_results(pair.receiver)
    assert sent.ok and received.ok
    assert pair.receiver.statistics().claimed == 0  # the Register speaks for it now
    p, d = pair.kv["p-1"], pair.kv["d-1"]
    for region in range(len(p.geometry.regions)):
        assert d.block(region, 9) == p.block(region, 3)
        assert d.block(region, 10) == p.block(region, 4)


def test_a_receiver_that_closes_hands_its_claims_back_at_once(pair: Pair) -> None:
    pair.sender.send("t1", [1])
    pair.receiver.claim("t1", pair.sender_address)
    wait_until(lambda: pair.receiver.statistics().peers == 1)
    pair.receiver.close()
    # Told with a Reject: no window, no deadline waited for (the clock stands still).
    [r] = wait_results(pair.sender)
    assert r.reason is FailureReason.REJECTED and "shutting down" in r.detail
    assert pair.sender.statistics().blocks_held_sending == 0


def test_a_sender_that_closes_tells_a_receiver_registered_before_the_send(pair: Pair) -> None:
    # Legs at once: the receiver registered, the sender never sent (it was stopped first).
    pair.receiver.receive("t1", pair.sender_address, [5])
    wait_until(lambda: pair.sender.statistics().sending == {"registered": 1})
    pair.sender.close()
    [r] = wait_results(pair.receiver)
    assert r.reason is FailureReason.REJECTED and "shutting down" in r.detail
    assert pair.receiver.statistics().blocks_held_receiving == 0
