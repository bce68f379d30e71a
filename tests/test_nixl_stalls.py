"""Whole ranks over real NIXL, one of them stopped with SIGSTOP past every timer.

"Silent" is not "dead": a stopped process comes back, and its data plane with it. Each
rank runs `tests/chaos_peer.py`, whose engine reuses blocks the moment kvpush hands them
back (the sender's engine overwrites them, the receiver's engine fills them with
canaries), so a write from reused memory, or into reused blocks, shows in the bytes.
Each test ends with `Ledger.audit()`: every transfer ended exactly once per side, a
receiver's `ok` holds exactly the submitted bytes, no sender block was handed back while
the data plane still ran a write of it, no canary was overwritten.

Timers are short (liveness 1 s, lease 2 s, so the receiver's fence is 4 s); stalls last
longer than liveness + fence with a margin, and every wait has a margin for a loaded
2-core machine. Only the stall itself is a sleep: everything else waits for an event.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import pytest

from chaos_procs import ChaosRank, Ledger, close_all, ended
from helpers.waiting import wait_until

pytestmark = pytest.mark.nixl

LIVENESS_S = 1.0
LEASE_S = 2.0
FENCE_S = LEASE_S + 2 * LIVENESS_S  # a receiver's fence when the sender never answers
STALL_S = LIVENESS_S + FENCE_S + 1.5  # past liveness, lease and fence, with a margin
MARGIN_S = 10.0  # scheduling noise on a shared 2-core machine, never a speed claim
OPTIONS = ("--liveness", str(LIVENESS_S), "--lease", str(LEASE_S), "--blocks", "32")


@pytest.fixture
def ranks() -> Iterator[Callable[..., ChaosRank]]:
    """Start a chaos rank; call `.ready()` before using it. Stopped ones are resumed and
    every one is closed at the end, whatever happened."""
    made: list[ChaosRank] = []

    def start(engine_id: str, role: str, *options: str) -> ChaosRank:
        rank = ChaosRank(f"{engine_id}-{os.getpid()}", role, *OPTIONS, *options)
        made.append(rank)
        return rank

    yield start
    close_all(made)


def warm_up(ledger: Ledger, receiver_blocks: list[int], sender_blocks: list[int]) -> None:
    """One whole transfer first: both handshakes done, both data-plane links up."""
    r, s = ledger.receiver, ledger.sender
    r.call(op="receive", transfer_id="warm-up", sender_port=s.port, blocks=receiver_blocks)
    ledger.sent("warm-up", s.call(op="send", transfer_id="warm-up", blocks=sender_blocks)["sums"])
    for rank in (r, s):
        [result] = rank.wait_results(ended("warm-up"), MARGIN_S)
        assert result["reason"] is None, result


def layer0_landed(ledger: Ledger, transfer_id: str, blocks: list[int]) -> Callable[[], bool]:
    """Layer 0 (regions 0 and 1) of what the sender submitted is in `blocks`."""
    want = [w[:2] for w in ledger.submitted[transfer_id]]
    return lambda: (
        [g[:2] for g in ledger.receiver.call(op="checksums", blocks=blocks)["sums"]] == want
    )


def sender_states(sender: ChaosRank, want: dict[str, int]) -> Callable[[], bool]:
    return lambda: sender.call(op="stats")["sending"] == want


def finish(ledger: Ledger, request: pytest.FixtureRequest) -> None:
    ledger.wait_ended(FENCE_S + MARGIN_S)
    violations = ledger.audit()
    figures = ledger.figures(violations)
    request.node.user_properties.append(("chaos", figures))
    print(f"chaos {request.node.name}: {figures}")
    for rank in (ledger.receiver, ledger.sender):
        for r in rank.results:
            print(rank.engine_id, {k: v for k, v in r.items() if k not in ("at_end",)})
    assert not violations, "\n".join(violations)


def test_receiver_stopped_past_every_timer(
    ranks: Callable[..., ChaosRank], request: pytest.FixtureRequest
) -> None:
    """Writes posted to a receiver that then stops: the sender waits for them before it
    hands its blocks back (whether it gives up on the silent receiver or its engine
    aborts), and the receiver, once resumed, reports `ok` only with the submitted bytes."""
    receiver, sender = ranks("decode", "receiver", "--seed", "1"), ranks("prefill", "sender")
    receiver.ready()
    sender.ready()
    ledger = Ledger(receiver, sender)
    warm_up(ledger, [0], [0])
    # t1 is mid-write (layer 0 landed, layer 1 not computed yet); t2 and t3 are
    # registered and have nothing computed. All get their writes while the receiver is
    # stopped, and the sender's engine aborts t3 right after.
    receiver.call(op="receive", transfer_id="t1", sender_port=sender.port, blocks=[1, 2, 3, 4])
    receiver.call(op="receive", transfer_id="t2", sender_port=sender.port, blocks=[5, 6, 7])
    receiver.call(op="receive", transfer_id="t3", sender_port=sender.port, blocks=[8, 9])
    sums = sender.call(op="send", transfer_id="t1", blocks=[10, 11, 12, 13], ready_layers=[0])
    ledger.sent("t1", sums["sums"])
    ledger.sent(
        "t2", sender.call(op="send", transfer_id="t2", blocks=[14, 15, 16], ready_layers=[])["sums"]
    )
    ledger.sent(
        "t3", sender.call(op="send", transfer_id="t3", blocks=[17, 18], ready_layers=[])["sums"]
    )
    wait_until(sender_states(sender, {"writing": 3}), MARGIN_S, "the registrations")
    wait_until(layer0_landed(ledger, "t1", [1, 2, 3, 4]), MARGIN_S, "t1's layer 0 to land")

    receiver.sigstop()
    ledger.stalls += 1
    sender.call(op="layers_ready", transfer_id="t1", layers=[1])
    sender.call(op="layers_ready", transfer_id="t2", layers=[0, 1])
    sender.call(op="layers_ready", transfer_id="t3", layers=[0, 1])
    sender.call(op="abort", transfer_id="t3")
    time.sleep(STALL_S)  # the stall itself: the receiver is stopped all this time
    receiver.sigcont()
    finish(ledger, request)


def test_a_receiver_stopped_with_nothing_in_flight_is_written_to_again_after(
    ranks: Callable[..., ChaosRank], request: pytest.FixtureRequest
) -> None:
    """The receiver stops while the sender's only transfer with it waits for the engine;
    the sender gives that one up at liveness and then has nothing to heartbeat for. The
    resumed receiver answers the sender's heartbeats from before, seconds late, so the
    sender's bound on its clock comes out loose by more than the lease, and nothing in
    flight measures it again: before the fix every later Register looked stale and was
    refused for good. Now the bound is measured again first, and the next transfer
    goes through."""
    receiver, sender = ranks("decode", "receiver", "--seed", "3"), ranks("prefill", "sender")
    receiver.ready()
    sender.ready()
    ledger = Ledger(receiver, sender)
    warm_up(ledger, [0], [0])
    receiver.call(op="receive", transfer_id="t1", sender_port=sender.port, blocks=[1, 2])
    wait_until(sender_states(sender, {"registered": 1}), MARGIN_S, "t1's registration")
    receiver.sigstop()
    ledger.stalls += 1
    time.sleep(STALL_S)  # the sender gives t1 up after liveness and goes quiet
    receiver.sigcont()
    receiver.wait_results(ended("t1"), MARGIN_S)
    for tid, theirs, ours in (("t2", [3, 4], [5, 6]), ("t3", [7, 8], [9, 10])):
        receiver.call(op="receive", transfer_id=tid, sender_port=sender.port, blocks=theirs)
        ledger.sent(tid, sender.call(op="send", transfer_id=tid, blocks=ours)["sums"])
        for rank in (receiver, sender):
            rank.wait_results(ended(tid), MARGIN_S)
            [result] = rank.result_of(tid)
            assert result["reason"] is None, (tid, result)
    [r1] = receiver.result_of("t1")
    assert r1["reason"] is not None, r1  # the sender gave it up: never submitted
    finish(ledger, request)


@pytest.mark.parametrize(
    ("waiting", "host"),
    [("register_in_inbox", "::1"), ("queued_calls", "127.0.0.1")],
    ids=["register_in_inbox-ipv6", "queued_calls-ipv4"],
)
def test_sender_stopped_past_every_timer(
    ranks: Callable[..., ChaosRank], request: pytest.FixtureRequest, waiting: str, host: str
) -> None:
    """A sender stopped while work waits for it: a receiver's Register in its inbox, or
    a `layers_ready` and a `send` its engine made just before the stop. The receiver
    gives up and reuses its blocks; the resumed sender writes nothing into them and
    reports each transfer failed, once."""
    # The receiver registers from the sender's metadata it handshook with: it must not
    # look the (stopped) sender's side channel up again before each Register.
    # Side channels on either address family (one case each: a stall costs seconds).
    receiver = ranks(
        "decode", "receiver", "--host", host, "--seed", "1", "--revalidate-after", "600"
    )
    # Calls queued across the stall need a runtime whose engine calls only queue them
    # (by default an engine call runs the runtime's pass itself, when it can).
    queue_calls = ("--queue-engine-calls",) if waiting == "queued_calls" else ()
    sender = ranks("prefill", "sender", "--host", host, "--seed", "2", *queue_calls)
    receiver.ready()
    sender.ready()
    ledger = Ledger(receiver, sender)
    warm_up(ledger, [0], [0])
    if waiting == "register_in_inbox":
        # Submitted; the receiver registers while the sender is stopped.
        ledger.sent("t1", sender.call(op="send", transfer_id="t1", blocks=[20, 21])["sums"])
        ledger.sent("t2", sender.call(op="send", transfer_id="t2", blocks=[22, 23, 24])["sums"])
        wait_until(sender_states(sender, {"awaiting_register": 2}), MARGIN_S, "both sends")
        sender.sigstop()
        stalled_at = time.monotonic()
        receiver.call(op="receive", transfer_id="t1", sender_port=sender.port, blocks=[1, 2])
        receiver.call(op="receive", transfer_id="t2", sender_port=sender.port, blocks=[3, 4, 5])
    else:
        # t1 is mid-write and its last layer is announced just before the stop; t2 is
        # registered and submitted just before the stop.
        receiver.call(op="receive", transfer_id="t1", sender_port=sender.port, blocks=[1, 2, 3, 4])
        receiver.call(op="receive", transfer_id="t2", sender_port=sender.port, blocks=[5, 6, 7])
        sums = sender.call(op="send", transfer_id="t1", blocks=[10, 11, 12, 13], ready_layers=[0])
        ledger.sent("t1", sums["sums"])
        wait_until(layer0_landed(ledger, "t1", [1, 2, 3, 4]), MARGIN_S, "t1's layer 0 to land")
        wait_until(
            sender_states(sender, {"writing": 1, "registered": 1}), MARGIN_S, "t2's Register"
        )
        queued = sender.stop_after(
            {"op": "layers_ready", "transfer_id": "t1", "layers": [1]},
            {"op": "send", "transfer_id": "t2", "blocks": [14, 15, 16]},
        )
        stalled_at = time.monotonic()
        ledger.sent("t2", queued["sums"]["t2"])
    ledger.stalls += 1
    ledger.must_fail.update(("t1", "t2"))
    # The receiver gives up on both and reuses their blocks (canaries).
    receiver.wait_results(ended("t1", "t2"), FENCE_S + LIVENESS_S + MARGIN_S)
    time.sleep(max(0.0, STALL_S - (time.monotonic() - stalled_at)))  # the rest of the stall
    sender.sigcont()
    finish(ledger, request)
