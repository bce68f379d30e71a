"""Claims (issue 39): a sender gives up a transfer nobody registered for after
`claim_window_s`, not at its deadline, unless its receiver, holding the request queued,
claims it with its heartbeats. Real protocol objects on the fake wire (helpers/wire.py),
time fed by the test."""

from __future__ import annotations

import msgspec
import pytest

from helpers.wire import TIMING, Wire
from kvpush.config import TimingConfig
from kvpush.errors import ConfigError, FailureReason
from kvpush.protocol import Heartbeat, SenderState, decode, encode

WINDOW = 4.0
CLAIMS = TimingConfig(
    heartbeat_interval_s=TIMING.heartbeat_interval_s,
    liveness_timeout_s=TIMING.liveness_timeout_s,
    lease_s=TIMING.lease_s,
    transfer_deadline_s=TIMING.transfer_deadline_s,
    claim_window_s=WINDOW,
)


@pytest.fixture
def claims() -> Wire:
    w = Wire(CLAIMS)
    w.add("p-1", "engine-p")
    w.add("d-1", "engine-d")
    return w


def _claim(w: Wire, d: str, tid: str, p: str) -> None:
    w.apply(d, w.ends[d].receiver.claim(w.now, tid, w.address_of[p]))


def test_an_unclaimed_transfer_ends_at_the_claim_window_not_the_deadline(claims: Wire) -> None:
    claims.submit("p-1", "t1", [1, 2])
    claims.run_for(WINDOW - 0.5)
    assert claims.ends["p-1"].sender.held_blocks() == {"t1": (1, 2)}
    claims.run_for(1.0)
    ended = claims.ended("p-1", "t1")
    assert ended.reason is FailureReason.PEER_TIMEOUT
    assert "no receiver registered or claimed it for 4.0s" in ended.detail
    assert claims.ends["p-1"].sender.held_blocks() == {}
    # A Register that comes late learns it at once, and nothing is written.
    claims.expect("d-1", "t1", "p-1", [3, 4])
    claims.settle()
    assert claims.ended("d-1", "t1").reason is FailureReason.PEER_TIMEOUT
    assert claims.write_log == []


def test_a_claiming_receiver_keeps_the_transfer_past_the_window_and_receives_it(
    claims: Wire,
) -> None:
    claims.submit("p-1", "t1", [1, 2])
    _claim(claims, "d-1", "t1", "p-1")  # a lookup of the sender's side channel first
    claims.settle()
    claims.run_for(3 * WINDOW)  # queued for three windows, claiming every heartbeat
    assert claims.ends["p-1"].sender.state_of("t1") is SenderState.AWAITING_REGISTER
    assert claims.ends["d-1"].receiver.claimed() == ["t1"]
    claims.expect("d-1", "t1", "p-1", [3, 4])
    claims.settle()
    claims.run_for(1.0)
    assert claims.ended("p-1", "t1").ok and claims.ended("d-1", "t1").ok
    claims.check_content("d-1", "t1", (3, 4))
    assert claims.ends["d-1"].receiver.claimed() == []


def test_a_receiver_stopped_for_less_than_the_window_keeps_its_transfer(claims: Wire) -> None:
    claims.submit("p-1", "t1", [1])
    _claim(claims, "d-1", "t1", "p-1")
    claims.run_for(2.0)
    claims.run_only("p-1", WINDOW - 1.0)  # the receiver is stopped (SIGSTOP)
    claims.run_for(1.0)  # resumed: it claims again, then registers
    claims.expect("d-1", "t1", "p-1", [5])
    claims.run_for(1.0)
    assert claims.ended("p-1", "t1").ok and claims.ended("d-1", "t1").ok


def test_a_receiver_that_stops_claiming_frees_the_senders_blocks_one_window_later(
    claims: Wire,
) -> None:
    claims.submit("p-1", "t1", [1])
    _claim(claims, "d-1", "t1", "p-1")
    claims.run_for(WINDOW * 2)
    claims.kill("d-1")  # died with the request queued; the data plane has not said so
    start = claims.now
    while "t1" in claims.ends["p-1"].sender.held_blocks():
        claims.advance(0.25)
    assert WINDOW - 0.5 <= claims.now - start <= WINDOW + 0.5
    assert claims.ended("p-1", "t1").reason is FailureReason.PEER_TIMEOUT


def test_the_claimer_certainly_gone_ends_its_claimed_transfers_at_once(claims: Wire) -> None:
    claims.submit("p-1", "t1", [1])
    claims.submit("p-1", "t2", [2])
    _claim(claims, "d-1", "t1", "p-1")
    claims.run_for(1.0)
    p = claims.ends["p-1"]
    claims.apply("p-1", p.peer_lost(claims.now, "d-1", FailureReason.PEER_GONE, "disconnected"))
    ended = claims.ended("p-1", "t1")
    assert ended.reason is FailureReason.PEER_GONE
    assert "claimed it is gone" in ended.detail
    # Another request's transfer, claimed by nobody, keeps its own window.
    assert p.sender.state_of("t2") is SenderState.AWAITING_REGISTER


def test_a_claim_for_a_transfer_named_for_another_receiver_keeps_nothing_alive(
    claims: Wire,
) -> None:
    claims.add("d-2", "engine-d2")
    claims.submit("p-1", "t1", [1], receiver=claims.address_of["d-1"])
    _claim(claims, "d-2", "t1", "p-1")
    claims.run_for(WINDOW + 0.5)
    assert claims.ended("p-1", "t1").reason is FailureReason.PEER_TIMEOUT


def test_without_a_window_an_unregistered_transfer_waits_for_its_deadline(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1])
    wire.run_for(TIMING.transfer_deadline_s - 1.0, step=1.0)
    assert wire.ends["p-1"].sender.held_blocks() == {"t1": (1,)}
    wire.run_for(2.0, step=1.0)
    assert wire.ended("p-1", "t1").reason is FailureReason.DEADLINE_EXCEEDED


def test_claiming_heartbeats_decode_for_older_peers_and_theirs_for_us() -> None:
    # New fields go last with defaults: an older peer's decoder (the struct as it was)
    # reads a claiming heartbeat, and ours reads an older peer's as claiming nothing.
    class OldHeartbeat(msgspec.Struct, frozen=True, tag_field="type", tag="heartbeat"):
        role: str
        engine_id: str
        incarnation: str
        transfer_ids: tuple[str, ...] = ()
        sent_at: float | None = None
        echo: float | None = None

    new = Heartbeat("receiver", "e", "1", ("t1",), 1.0, 0.5, ("t2",), "::1", 5600, 1)
    old = msgspec.msgpack.decode(encode(new), type=OldHeartbeat)
    assert (old.transfer_ids, old.sent_at, old.echo) == (("t1",), 1.0, 0.5)
    theirs = decode(msgspec.msgpack.encode(OldHeartbeat("receiver", "e", "1", ("t1",), 1.0)))
    assert isinstance(theirs, Heartbeat)
    assert (theirs.claimed, theirs.receiver_host) == ((), "")


def test_a_claim_window_no_longer_than_a_heartbeat_interval_is_refused() -> None:
    with pytest.raises(ConfigError, match="claim_window_s"):
        TimingConfig(heartbeat_interval_s=1.0, liveness_timeout_s=2.0, claim_window_s=1.0)
