"""Sans-IO tests of the push protocol: real state machines wired by a fake wire.

`Wire` (helpers/wire.py) carries the effects of one `PushProtocol` to another, through a
message queue the test controls and block memories that writes really copy between.
"""

from __future__ import annotations

import pytest

from helpers.wire import COMPAT, NUM_BLOCKS, NUM_LAYERS, TIMING, Wire, assert_block_copied
from kvpush.config import CompatibilityPolicy, TimingConfig
from kvpush.errors import ConfigError, FailureReason, LocalProtocolError, RemoteProtocolError
from kvpush.protocol import (
    Cancel,
    CancelAck,
    Done,
    Failed,
    Heartbeat,
    ReceiverState,
    Register,
    Reject,
    SenderState,
    TransferEnded,
    decode,
    encode,
)

# --------------------------------------------------------------------------- happy paths


def test_registration_before_sender_ready(wire: Wire) -> None:
    wire.expect("d-1", "t1", "p-1", [7, 8])
    wire.settle()
    assert wire.ends["p-1"].sender.state_of("t1") is SenderState.REGISTERED
    assert wire.ends["p-1"].sender.held_blocks() == {}
    wire.submit("p-1", "t1", [1, 2])
    wire.settle()
    assert wire.ended("p-1", "t1").ok and wire.ended("d-1", "t1").ok
    assert_block_copied(wire, "p-1", 1, "d-1", 7)
    assert_block_copied(wire, "p-1", 2, "d-1", 8)
    assert wire.ends["p-1"].sender.held_blocks() == {}
    assert wire.ends["d-1"].receiver.held_blocks() == {}


def test_registration_after_sender_ready(wire: Wire) -> None:
    wire.submit("p-1", "t1", [3, 4, 5])
    assert wire.ends["p-1"].sender.state_of("t1") is SenderState.AWAITING_REGISTER
    wire.expect("d-1", "t1", "p-1", [0, 1, 2])
    wire.settle()
    assert wire.ended("p-1", "t1").ok and wire.ended("d-1", "t1").ok
    for ours, theirs in [(3, 0), (4, 1), (5, 2)]:
        assert_block_copied(wire, "p-1", ours, "d-1", theirs)


def test_layer_by_layer_push_writes_each_layer_once_and_finishes_after_the_last(
    wire: Wire,
) -> None:
    wire.submit("p-1", "t1", [1, 2], layers=[])
    wire.expect("d-1", "t1", "p-1", [5, 6])
    wire.settle()
    assert wire.write_log == [] and wire.results["d-1"] == []
    wire.apply("p-1", wire.ends["p-1"].sender.layers_ready(wire.now, "t1", [0]))
    wire.settle()
    assert wire.memory["d-1"][0][5] == b"p-1:L0:B1"
    assert wire.memory["d-1"][1][5] == b"d-1:L1:B5"  # layer 1 not written yet
    assert wire.results["d-1"] == []
    wire.apply("p-1", wire.ends["p-1"].sender.layers_ready(wire.now, "t1", [1, 0]))
    wire.settle()
    assert len(wire.write_log) == 2
    assert wire.ended("d-1", "t1").ok
    assert_block_copied(wire, "p-1", 2, "d-1", 6)


def test_partial_prefix_hit_maps_the_sender_tail_onto_the_receiver_blocks(wire: Wire) -> None:
    # The receiver already has the first 2 of 5 blocks cached; it registers the last 3.
    wire.submit("p-1", "t1", [10, 11, 12, 13, 14])
    wire.expect("d-1", "t1", "p-1", [3, 9, 4], offset=2)
    wire.settle()
    assert wire.ended("d-1", "t1").ok
    assert_block_copied(wire, "p-1", 12, "d-1", 3)
    assert_block_copied(wire, "p-1", 13, "d-1", 9)
    assert_block_copied(wire, "p-1", 14, "d-1", 4)
    # Nothing else of the receiver was touched.
    untouched = [b for b in range(NUM_BLOCKS) if b not in (3, 9, 4)]
    for b in untouched:
        assert wire.memory["d-1"][0][b] == f"d-1:L0:B{b}".encode()


def test_full_prefix_hit_writes_nothing_and_frees_the_sender_at_once(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1, 2, 3], layers=[])  # not even computed yet
    wire.expect("d-1", "t1", "p-1", [], offset=3)
    wire.deliver()  # the Register
    assert wire.ended("p-1", "t1").ok
    assert wire.ended("p-1", "t1").blocks == (1, 2, 3)
    assert wire.writes == []
    wire.settle()
    assert wire.ended("d-1", "t1").ok


def test_both_sides_report_the_blocks_moved_not_the_blocks_held(wire: Wire) -> None:
    # A prefix hit of one block at the receiver: the sender held 3, 2 moved.
    wire.submit("p-1", "t1", [1, 2, 3])
    wire.expect("d-1", "t1", "p-1", [5, 6], offset=1)
    wire.settle()
    sent, received = wire.ended("p-1", "t1"), wire.ended("d-1", "t1")
    assert sent.ok and received.ok
    assert (sent.blocks, sent.blocks_moved) == ((1, 2, 3), 2)
    assert (received.blocks, received.blocks_moved) == ((5, 6), 2)
    # A full hit moves nothing; a failed transfer counts nothing as moved.
    wire.submit("p-1", "t2", [1, 2])
    wire.expect("d-1", "t2", "p-1", [], offset=2)
    wire.submit("p-1", "t3", [1, 2, 3])
    wire.expect("d-1", "t3", "p-1", [5, 6, 7], offset=1)
    wire.settle()
    assert wire.ended("p-1", "t2").ok and wire.ended("p-1", "t2").blocks_moved == 0
    assert wire.ended("d-1", "t2").ok and wire.ended("d-1", "t2").blocks_moved == 0
    for agent in ("p-1", "d-1"):
        assert not wire.ended(agent, "t3").ok and wire.ended(agent, "t3").blocks_moved == 0


def test_prefix_mapping_that_does_not_add_up_fails_both_sides(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1, 2, 3])
    wire.expect("d-1", "t1", "p-1", [5, 6, 7], offset=1)
    wire.settle()
    for agent in ("p-1", "d-1"):
        r = wire.ended(agent, "t1")
        assert r.reason is FailureReason.BLOCK_MISMATCH
    assert "offset 1" in wire.ended("p-1", "t1").detail
    assert wire.write_log == []


# --------------------------------------------------------------------------- rejects


def test_receiver_rejects_before_allocating_and_the_sender_frees_at_once(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1, 2])
    wire.apply(
        "d-1",
        wire.ends["d-1"].receiver.reject(wire.now, "t1", wire.address_of["p-1"], "out of memory"),
    )
    wire.settle()
    r = wire.ended("p-1", "t1")
    assert r.reason is FailureReason.REJECTED and "out of memory" in r.detail
    assert wire.ends["p-1"].sender.held_blocks() == {}
    # The rejecting side has its own record, at once, holding no blocks.
    [mine] = wire.results["d-1"]
    assert (mine.side, mine.reason, mine.blocks) == ("receiver", FailureReason.REJECTED, ())
    assert "out of memory" in mine.detail


def test_reject_of_an_id_in_flight_here_leaves_its_record_to_the_transfer(wire: Wire) -> None:
    wire.expect("d-1", "t1", "p-1", [3])
    wire.settle()
    effects = wire.ends["d-1"].receiver.reject(wire.now, "t1", wire.address_of["p-1"], "again")
    assert [e for e in effects if isinstance(e, TransferEnded)] == []
    # A refused id stays free: the request may come again.
    reject = wire.ends["d-1"].receiver.reject(wire.now, "t2", wire.address_of["p-1"], "busy")
    wire.apply("d-1", reject)
    wire.expect("d-1", "t2", "p-1", [4])
    assert wire.ends["d-1"].receiver.state_of("t2") is ReceiverState.WAITING


def test_reject_that_arrives_before_submit_fails_the_submit_at_once(wire: Wire) -> None:
    wire.apply(
        "d-1", wire.ends["d-1"].receiver.reject(wire.now, "t1", wire.address_of["p-1"], "busy")
    )
    wire.settle()
    wire.submit("p-1", "t1", [1])
    assert wire.ended("p-1", "t1").reason is FailureReason.REJECTED


# --------------------------------------------------------------------------- duplicates etc.


def test_duplicate_register_and_done_are_harmless(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [2])
    wire.queue.append(wire.queue[0])  # Register twice
    wire.settle()
    assert len(wire.write_log) == 1
    done = encode(Done("t1", 1))
    wire.apply("d-1", wire.ends["d-1"].receive_message(wire.now, "p-1", done))
    assert len(wire.results["d-1"]) == 1  # the Wire asserts "not twice" on every report


def test_lost_register_is_sent_again(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [2])
    wire.queue.clear()  # the Register is lost
    wire.run_for(1.0)
    assert wire.ended("d-1", "t1").ok and wire.ended("p-1", "t1").ok


def test_lost_done_is_sent_again_when_the_receiver_still_waits(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [2])
    wire.deliver_register()  # Register
    wire.complete_write()
    assert wire.ended("p-1", "t1").ok
    wire.queue = [m for m in wire.queue if not isinstance(decode(m[2]), Done)]
    wire.run_for(1.5)
    assert wire.ended("d-1", "t1").ok


def test_cancel_that_overtakes_its_register_keeps_the_sender_from_writing(wire: Wire) -> None:
    wire.expect("d-1", "t1", "p-1", [2])
    wire.apply("d-1", wire.ends["d-1"].receiver.abort(wire.now, "t1"))
    assert isinstance(decode(wire.queue[1][2]), Cancel)
    wire.deliver(1)  # Cancel first
    wire.settle()  # then the Register, then the ack
    wire.submit("p-1", "t1", [1])
    wire.settle()
    assert wire.write_log == []
    assert wire.ended("p-1", "t1").reason is FailureReason.CANCELLED
    assert wire.ended("d-1", "t1").reason is FailureReason.CANCELLED


def test_sender_abort_before_the_register_arrives_tells_the_receiver_why(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1])
    wire.apply("p-1", wire.ends["p-1"].sender.abort(wire.now, "t1"))
    assert wire.ended("p-1", "t1").reason is FailureReason.CANCELLED
    wire.expect("d-1", "t1", "p-1", [2])
    wire.settle()
    assert wire.ended("d-1", "t1").reason is FailureReason.CANCELLED
    assert wire.write_log == []


def test_sender_refusing_a_registration_fails_the_receiver_at_once_and_a_later_submit(
    wire: Wire,
) -> None:
    # A registration our engine will never send (another prompt's legs share the id):
    # the receiver learns it now, not at its deadline; nothing is written.
    wire.expect("d-1", "t1", "p-1", [2])
    wire.settle()
    assert wire.ends["p-1"].sender.state_of("t1") is SenderState.REGISTERED
    wire.apply("p-1", wire.ends["p-1"].sender.refuse(wire.now, "t1", "prompts differ"))
    wire.settle()
    ended = wire.ended("d-1", "t1")
    assert ended.reason is FailureReason.REJECTED and "prompts differ" in ended.detail
    assert wire.ends["p-1"].sender.state_of("t1") is None
    wire.submit("p-1", "t1", [1])
    wire.settle()
    assert wire.ended("p-1", "t1").reason is FailureReason.REJECTED
    assert wire.write_log == []
    # Not registered, or already submitted: refuse changes nothing.
    wire.submit("p-1", "t2", [1])
    assert wire.ends["p-1"].sender.refuse(wire.now, "t2", "x") == []
    assert wire.ends["p-1"].sender.refuse(wire.now, "t3", "x") == []


def test_cancel_after_a_lost_register_ends_the_sender_side_at_once(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [2])
    wire.queue.clear()  # the Register is lost
    wire.apply("d-1", wire.ends["d-1"].receiver.abort(wire.now, "t1"))
    # The Cancel, then the Register again (the sender never listed it): a Cancel ends
    # only what its own agent registered, so the Register must reach the sender.
    assert [type(decode(m[2])) for m in wire.queue] == [Cancel, Register]
    wire.deliver()
    wire.deliver()
    assert wire.ended("p-1", "t1").reason is FailureReason.CANCELLED
    wire.settle()
    wire.run_for(wire.ends["d-1"].receiver.fence_s + 0.5)
    assert wire.ended("d-1", "t1").reason is FailureReason.CANCELLED
    assert wire.write_log == []


def test_late_done_after_the_receiver_ended_is_ignored(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [2])
    wire.settle()
    late = encode(Done("t1", 1))
    wire.run_for(1.0)
    wire.apply("d-1", wire.ends["d-1"].receive_message(wire.now, "p-1", late))
    assert [r.transfer_id for r in wire.results["d-1"]] == ["t1"]


def test_done_from_another_peer_than_the_registered_sender_is_ignored(wire: Wire) -> None:
    wire.add("p-2", "engine-q")
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [2])
    forged = encode(Done("t1", 1))
    wire.apply("d-1", wire.ends["d-1"].receive_message(wire.now, "p-2", forged))
    assert wire.results["d-1"] == []
    wire.settle()
    assert wire.ended("d-1", "t1").ok


# --------------------------------------------------------------------------- aborts, failures


def test_receiver_abort_mid_write_fences_its_blocks_until_the_sender_acks(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1, 2])
    wire.expect("d-1", "t1", "p-1", [3, 4])
    wire.deliver_register()  # Register: the write is now in flight
    assert len(wire.writes) == 1
    wire.apply("d-1", wire.ends["d-1"].receiver.abort(wire.now, "t1"))
    assert wire.ends["d-1"].receiver.state_of("t1") is ReceiverState.FENCING
    wire.settle()  # Cancel reaches the sender; the write lands; only then the ack
    ack_order = [(src, type(decode(p))) for src, _, p in wire.queue]
    assert ack_order == []
    assert wire.ended("p-1", "t1").reason is FailureReason.CANCELLED
    r = wire.ended("d-1", "t1")
    assert r.reason is FailureReason.CANCELLED and r.blocks == (3, 4)


def test_cancel_ack_is_sent_only_after_the_in_flight_write_finished(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.deliver_register()
    wire.apply("d-1", wire.ends["d-1"].receiver.abort(wire.now, "t1"))
    wire.deliver()  # the Cancel, while the write is still in flight
    assert wire.sent("p-1", CancelAck) == []
    assert wire.results["p-1"] == []
    wire.complete_write()
    assert len(wire.sent("p-1", CancelAck)) == 1
    assert wire.ended("p-1", "t1").reason is FailureReason.CANCELLED
    assert wire.results["d-1"] == []  # still fenced until the ack arrives
    wire.settle()
    assert wire.ended("d-1", "t1").reason is FailureReason.CANCELLED


def test_sender_abort_tells_the_receiver_which_frees_at_once(wire: Wire) -> None:
    # Layer 0 only: the write in flight is not the last one, so it carries no Done.
    wire.submit("p-1", "t1", [1], layers=[0])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.deliver_register()
    wire.apply("p-1", wire.ends["p-1"].sender.abort(wire.now, "t1"))
    assert wire.results["p-1"] == []  # waits for the in-flight write
    wire.settle()
    assert wire.ended("p-1", "t1").reason is FailureReason.CANCELLED
    assert wire.ended("d-1", "t1").reason is FailureReason.CANCELLED


def test_done_rides_on_the_last_write_and_arrives_after_its_data(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1, 2])
    wire.expect("d-1", "t1", "p-1", [3, 4])
    wire.deliver_register()  # Register: one write for every layer, carrying Done
    [w] = wire.writes
    assert w.write.notification == Done("t1", 2)
    assert wire.queue == []  # nothing else travels: no round trip after the data
    wire.complete_write()
    assert wire.ended("p-1", "t1").ok
    assert wire.sent("p-1", Done) == [Done("t1", 2)]
    wire.settle()
    assert wire.ended("d-1", "t1").ok


def test_done_waits_for_every_write_when_the_last_one_is_not_alone(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1], layers=[0])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.deliver_register()  # layer 0 in flight
    wire.apply("p-1", wire.ends["p-1"].sender.layers_ready(wire.now, "t1", [1]))
    assert [w.write.notification for w in wire.writes] == [None, None]
    wire.complete_write(1)  # the last layer lands first: still no Done
    assert wire.sent("p-1", Done) == [] and wire.results["p-1"] == []
    wire.complete_write(0)
    assert wire.sent("p-1", Done) == [Done("t1", 1)]
    wire.settle()
    assert wire.ended("p-1", "t1").ok and wire.ended("d-1", "t1").ok


def test_only_the_last_layer_write_carries_done(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1], layers=[0])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.deliver_register()
    wire.complete_write()  # layer 0 landed, alone and without Done
    assert wire.queue == [] and wire.results["p-1"] == []
    wire.apply("p-1", wire.ends["p-1"].sender.layers_ready(wire.now, "t1", [1]))
    [w] = wire.writes
    assert w.write.notification == Done("t1", 1)
    wire.settle()
    assert wire.ended("p-1", "t1").ok and wire.ended("d-1", "t1").ok


def test_a_write_the_data_plane_failed_as_peer_gone_ends_as_peer_gone(wire: Wire) -> None:
    """NIXL reports a remote disconnect during a write (nixlRemoteDisconnectError, which
    the transport maps to PEER_GONE): the transfer ends PEER_GONE, not WRITE_ERROR."""
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.deliver_register()
    [w] = wire.writes
    wire.writes.clear()
    effects = wire.ends["p-1"].sender.write_failed(
        wire.now, w.write.write_id, FailureReason.PEER_GONE, "remote disconnect"
    )
    wire.apply("p-1", effects)
    wire.settle()
    assert wire.ended("p-1", "t1").reason is FailureReason.PEER_GONE
    assert wire.ended("d-1", "t1").reason is FailureReason.PEER_GONE


def test_failed_last_write_delivers_no_done_and_the_sender_says_failed(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.deliver_register()
    wire.complete_write(ok=False)
    assert wire.sent("p-1", Done) == [] and len(wire.sent("p-1", Failed)) == 1
    wire.settle()
    assert wire.ended("d-1", "t1").reason is FailureReason.WRITE_ERROR


def test_sender_abort_too_late_to_stop_the_write_carrying_done_finishes_both(
    wire: Wire,
) -> None:
    # The receiver gets Done with the data, so the transfer did finish: both sides say so.
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.deliver_register()
    wire.apply("p-1", wire.ends["p-1"].sender.abort(wire.now, "t1"))
    wire.settle()
    assert wire.ended("p-1", "t1").ok and wire.ended("d-1", "t1").ok
    assert_block_copied(wire, "p-1", 1, "d-1", 3)


def test_failed_write_is_told_to_the_receiver(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.deliver_register()
    wire.complete_write(ok=False)
    wire.settle()
    assert wire.ended("p-1", "t1").reason is FailureReason.WRITE_ERROR
    r = wire.ended("d-1", "t1")
    assert r.reason is FailureReason.WRITE_ERROR and "injected" in r.detail


def test_sender_dies_the_receiver_fails_within_liveness_plus_fence(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.deliver()
    wire.kill("p-1")
    wire.run_for(TIMING.liveness_timeout_s + 0.25)
    assert wire.ends["d-1"].receiver.state_of("t1") is ReceiverState.FENCING
    assert wire.dropped_peers["d-1"] == []  # silent is not dead: it is not dropped
    assert wire.ends["d-1"].receiver.known_peers() == 0  # but looked up before reuse
    assert wire.results["d-1"] == []
    wire.run_for(wire.ends["d-1"].receiver.fence_s)
    r = wire.ended("d-1", "t1")
    assert r.reason is FailureReason.PEER_TIMEOUT and r.blocks == (3,)


def test_sender_certainly_gone_ends_receiver_transfers_at_once(wire: Wire) -> None:
    wire.expect("d-1", "t1", "p-1", [3])
    wire.kill("p-1")
    effects = wire.ends["d-1"].peer_lost(wire.now, "p-1", FailureReason.PEER_GONE, "killed")
    wire.apply("d-1", effects)
    assert wire.ended("d-1", "t1").reason is FailureReason.PEER_GONE


def test_a_first_register_that_reached_no_live_sender_is_withdrawn_and_registered_again(
    wire: Wire,
) -> None:
    wire.submit("p-1", "t0", [0])
    wire.expect("d-1", "t0", "p-1", [0])
    wire.settle()  # d-1 now has p-1's address cached
    wire.kill("p-1")
    wire.add("p-2", "engine-p", incarnation="2")  # restarted there within revalidate_after_s
    wire.expect("d-1", "t1", "p-1", [3])  # registered from the cache: to dead p-1
    receiver = wire.ends["d-1"].receiver
    assert receiver.state_of("t1") is ReceiverState.WAITING
    assert receiver.withdraw(wire.now, "t1", "p-2") is None  # not the peer it went to
    effects = receiver.withdraw(wire.now, "t1", "p-1")
    assert effects is not None and receiver.state_of("t1") is ReceiverState.HANDSHAKING
    wire.apply("d-1", wire.ends["d-1"].peer_lost(wire.now, "p-1", FailureReason.PEER_GONE, "x"))
    wire.apply("d-1", effects)  # looks the address up again: p-2 answers there now
    wire.expected[("d-1", "t1")] = ("p-2", 0)
    assert [r.transfer_id for r in wire.results["d-1"]] == ["t0"]  # nothing for t1
    assert receiver.state_of("t1") is ReceiverState.WAITING
    wire.submit("p-2", "t1", [5])
    wire.settle()
    assert wire.ended("d-1", "t1").ok
    assert_block_copied(wire, "p-2", 5, "d-1", 3)


def test_a_register_is_not_withdrawn_after_a_lookup_once_the_sender_spoke_or_on_its_retry(
    wire: Wire,
) -> None:
    receiver = wire.ends["d-1"].receiver
    wire.expect("d-1", "t0", "p-1", [2])  # after a fresh lookup, which found p-1 alive
    assert receiver.withdraw(wire.now, "t0", "p-1") is None
    wire.expect("d-1", "t1", "p-1", [3])  # from the cache
    # p-1 handshakes back at 0.25 s (when the Register arrives), then heartbeats every
    # 0.5 s, listing t0 and t1: it is heard at 1.25 s.
    wire.run_for(TIMING.heartbeat_interval_s * 2 + 0.25)
    assert receiver.withdraw(wire.now, "t1", "p-1") is None  # p-1 spoke after t1's Register
    lookups = len(wire.handshakes)
    wire.expect("d-1", "t2", "p-1", [4])  # from the cache: p-1 was heard just now
    assert len(wire.handshakes) == lookups
    effects = receiver.withdraw(wire.now, "t2", "p-1")
    assert effects is not None
    wire.apply("d-1", effects)  # looked up again: p-1 answers, registered once more
    assert receiver.state_of("t2") is ReceiverState.WAITING
    assert receiver.withdraw(wire.now, "t2", "p-1") is None  # one retry, no more
    assert receiver.withdraw(wire.now, "unknown", "p-1") is None


def test_receiver_dies_the_sender_frees_its_blocks_within_liveness(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.deliver()
    wire.kill("d-1")
    wire.writes.clear()  # a write to a dead process never completes...
    wire.run_for(TIMING.liveness_timeout_s + 0.25)
    r = wire.ended("p-1", "t1")
    assert r.reason is FailureReason.PEER_TIMEOUT and r.blocks == (1,)
    assert wire.ends["p-1"].sender.held_blocks() == {}


def test_sender_restart_fails_old_transfers_and_new_ones_work(wire: Wire) -> None:
    wire.expect("d-1", "t1", "p-1", [3])
    wire.settle()
    wire.kill("p-1")
    wire.add("p-2", "engine-p", incarnation="2")  # same engine and address, new incarnation
    wire.advance(0.2)  # past revalidate_after_s: the next expect looks the address up again
    wire.submit("p-2", "t2", [4])
    wire.expect("d-1", "t2", "p-2", [5])
    r = wire.ended("d-1", "t1")
    assert r.reason is FailureReason.PEER_RESTARTED
    assert [d.peer for d in wire.dropped_peers["d-1"]] == ["p-1"]
    wire.settle()
    assert wire.ended("d-1", "t2").ok
    assert_block_copied(wire, "p-2", 4, "d-1", 5)


def test_receiver_restart_fails_old_transfers_and_new_ones_work(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1], layers=[])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.settle()
    wire.kill("d-1")
    wire.add("d-2", "engine-d", incarnation="2")
    wire.submit("p-1", "t2", [2])
    wire.expect("d-2", "t2", "p-1", [6])
    wire.settle()
    assert wire.ended("p-1", "t1").reason is FailureReason.PEER_RESTARTED
    assert wire.ended("p-1", "t2").ok and wire.ended("d-2", "t2").ok
    assert [h.peer for _, h in wire.handshakes if h.peer] == ["d-1", "d-2"]
    assert_block_copied(wire, "p-1", 2, "d-2", 6)


def test_deadline_fails_a_sender_that_never_hears_from_a_receiver(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1])
    wire.run_for(TIMING.transfer_deadline_s + 0.25, step=1.0)
    assert wire.ended("p-1", "t1").reason is FailureReason.DEADLINE_EXCEEDED


def test_deadline_fails_a_receiver_whose_sender_never_submits(wire: Wire) -> None:
    wire.expect("d-1", "t1", "p-1", [3])
    wire.run_for(TIMING.transfer_deadline_s + 1.0, step=1.0)
    r = wire.ended("d-1", "t1")
    assert r.reason is FailureReason.DEADLINE_EXCEEDED
    # The sender saw the cancel (or its own deadline), so no fence wait was needed.
    wire.submit("p-1", "t1", [1])
    assert wire.ended("p-1", "t1").reason in (
        FailureReason.CANCELLED,
        FailureReason.DEADLINE_EXCEEDED,
    )


def test_handshake_back_failure_fails_the_sender_side(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.auto_handshake = False
    wire.deliver()
    [hs] = [hs for src, hs in wire.handshakes if src == "p-1"]
    assert (hs.peer, hs.address) == ("d-1", wire.address_of["d-1"])
    assert hs.port == wire.ends["d-1"].identity.port
    effects = wire.ends["p-1"].handshake_failed(
        wire.now, hs.address, FailureReason.HANDSHAKE_FAILED, "connection refused"
    )
    wire.apply("p-1", effects)
    # Nobody vouched for d-1, so its Register was never read: nothing is bound to it,
    # and the engine's transfer still waits for a receiver that can be vouched for.
    assert wire.ends["p-1"].forged_messages() == {"unverified": 1}
    assert wire.ends["p-1"].sender.state_of("t1") is SenderState.AWAITING_REGISTER
    wire.auto_handshake = True
    wire.advance(TIMING.heartbeat_interval_s + 0.01)  # d-1 sends its Register again
    wire.settle()
    assert wire.ended("p-1", "t1").ok and wire.ended("d-1", "t1").ok


# --------------------------------------------------------------------------- bad input


def test_garbage_bytes_raise_remote_protocol_error_and_change_nothing(wire: Wire) -> None:
    wire.expect("d-1", "t1", "p-1", [3])
    with pytest.raises(RemoteProtocolError, match="expected a msgpack map"):
        wire.ends["d-1"].receive_message(wire.now, "p-1", b"\x00garbage")
    assert wire.ends["d-1"].receiver.state_of("t1") is ReceiverState.WAITING
    effects = wire.ends["d-1"].peer_misbehaved(wire.now, "p-1", "garbage")
    wire.apply("d-1", effects)
    assert wire.ends["d-1"].receiver.state_of("t1") is ReceiverState.FENCING
    wire.settle()
    assert wire.ended("d-1", "t1").reason is FailureReason.MALFORMED_MESSAGE


def test_register_with_a_negative_block_id_is_refused_by_the_decoder() -> None:
    bad = encode(Register("t", "e", "i", "h", 1, 0, (1,), 0)).replace(b"\x91\x01", b"\x91\xff")
    with pytest.raises(RemoteProtocolError, match=r"block_ids"):
        decode(bad)


def test_register_from_another_protocol_version_is_refused(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1])
    reg = Register("t1", "engine-d", "1", "127.0.0.1", 5001, 0, (3,), 0, protocol_version=99)
    wire.apply("p-1", wire.ends["p-1"].receive_message(wire.now, "d-1", encode(reg)))
    msgs = [decode(p) for _, _, p in wire.queue]
    assert [m.reason for m in msgs if hasattr(m, "reason")] == [FailureReason.INCOMPATIBLE_PEER]


def test_engine_misuse_raises_local_protocol_error(wire: Wire) -> None:
    sender = wire.ends["p-1"].sender
    sender.submit(wire.now, "t1", [1])
    with pytest.raises(LocalProtocolError, match="already submitted"):
        sender.submit(wire.now, "t1", [1])
    with pytest.raises(LocalProtocolError, match="out of range"):
        sender.submit(wire.now, "t2", [1], ready_layers=[NUM_LAYERS])
    with pytest.raises(LocalProtocolError, match="repeat"):
        sender.submit(wire.now, "t3", [1, 1])
    with pytest.raises(LocalProtocolError, match="not submitted"):
        sender.layers_ready(wire.now, "nope", [0])
    receiver = wire.ends["d-1"].receiver
    with pytest.raises(LocalProtocolError, match="non-negative"):
        receiver.expect(wire.now, "t9", wire.address_of["p-1"], [-1])
    with pytest.raises(LocalProtocolError, match="sender_offset"):
        receiver.expect(wire.now, "t9", wire.address_of["p-1"], [1], sender_offset=-2)


def test_heartbeats_renew_the_lease_so_a_long_transfer_survives(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1], layers=[])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.run_for(TIMING.lease_s * 3)
    assert wire.ends["p-1"].sender.state_of("t1") is SenderState.WRITING
    hb = [m for m in wire.results["p-1"]]
    assert hb == []
    wire.apply("p-1", wire.ends["p-1"].sender.layers_ready(wire.now, "t1", [0, 1]))
    wire.settle()
    assert wire.ended("d-1", "t1").ok


def test_lease_runs_out_when_the_receiver_stops_renewing_it(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1], layers=[])  # nothing computed: it just holds blocks
    wire.expect("d-1", "t1", "p-1", [3])
    wire.settle()
    wire.apply("d-1", wire.ends["d-1"].receiver.abort(wire.now, "t1"))
    held_since = wire.now
    # Every Cancel is lost; heartbeats still flow, but no longer name t1.
    while not wire.results["p-1"]:
        wire.advance(0.25, settle=False)
        wire.queue = [m for m in wire.queue if not isinstance(decode(m[2]), Cancel)]
        wire.settle()
        assert wire.now - held_since <= TIMING.lease_s + 0.5
    r = wire.ended("p-1", "t1")
    assert r.reason is FailureReason.PEER_TIMEOUT and "lease" in r.detail
    assert wire.write_log == []


def test_heartbeat_message_round_trips() -> None:
    hb = Heartbeat("sender", "e", "i", ("a", "b"))
    assert decode(encode(hb)) == hb


def test_idle_machines_have_no_deadline(wire: Wire) -> None:
    assert wire.ends["p-1"].next_deadline() is None
    wire.submit("p-1", "t1", [1])
    assert wire.ends["p-1"].next_deadline() == TIMING.transfer_deadline_s


def test_ended_transfers_are_remembered_for_their_bound_then_forgotten_in_order(
    wire: Wire,
) -> None:
    keep = TIMING.transfer_deadline_s + TIMING.lease_s
    for i in range(3):
        wire.submit("p-1", f"t{i}", [i])
        wire.expect("d-1", f"t{i}", "p-1", [i])
        wire.settle()
        wire.advance(1.0)
    assert all(wire.ended("p-1", f"t{i}").ok for i in range(3))
    sender = wire.ends["p-1"].sender

    def refused(tid: str, blocks: list[int]) -> bool:
        [ended] = sender.submit(wire.now, tid, blocks)  # an outcome, not an exception:
        assert isinstance(ended, TransferEnded)  # the engine cannot see the memory's span
        return ended.reason is FailureReason.LOCAL_ERROR and "already used" in ended.detail

    assert refused("t2", [9])
    # t0 ended 3 s before t2: once t0's memory ran out, t0 is new again, t2 not yet.
    wire.advance(keep - 2.5, settle=False)
    assert sender.submit(wire.now, "t0", [9]) == []
    assert sender.state_of("t0") is SenderState.AWAITING_REGISTER
    assert refused("t2", [10])
    wire.advance(3.0, settle=False)
    assert sender.submit(wire.now, "t2", [10]) == []


# --------------------------------------------------------------------------- never wrong


def test_an_incompatible_sender_fails_the_transfer_before_anything_is_registered(
    wire: Wire,
) -> None:
    theirs = COMPAT | {"dtype": "float16", "layout": "kv_separate/HND"}
    wire.add("p-x", "engine-px", compat=theirs)
    wire.submit("p-x", "t1", [1])
    wire.expect("d-1", "t1", "p-x", [3])
    r = wire.ended("d-1", "t1")
    assert r.reason is FailureReason.INCOMPATIBLE_PEER and r.blocks == (3,)
    assert "dtype: theirs 'float16', ours 'bfloat16'" in r.detail
    assert "layout: theirs 'kv_separate/HND', ours 'kv_separate/NHD'" in r.detail
    # No Register, so nothing can be written; only a Reject tells the sender why, from
    # its own point of view, so that it frees its blocks now and not at its deadline.
    [reject] = [decode(m) for _, _, m in wire.queue]
    assert isinstance(reject, Reject) and reject.reason is FailureReason.INCOMPATIBLE_PEER
    assert wire.ends["d-1"].receiver.known_peers() == 0  # and nothing cached for next time
    wire.settle()
    s = wire.ended("p-x", "t1")
    assert s.reason is FailureReason.INCOMPATIBLE_PEER and s.blocks == (1,)
    assert "dtype: theirs 'bfloat16', ours 'float16'" in s.detail
    assert wire.writes == [] and wire.write_log == []


def test_an_incompatible_receiver_is_never_written_to_even_if_it_registers(
    wire: Wire,
) -> None:
    # This receiver was told (explicitly, typed) that a different dtype is fine; the
    # sender was not: the sender's own check refuses it when it handshakes back.
    lenient = CompatibilityPolicy(frozenset({"dtype"}), reason="test: a lenient receiver")
    wire.add("d-x", "engine-dx", compat=COMPAT | {"dtype": "float16"}, compatibility=lenient)
    wire.submit("p-1", "t1", [1])
    wire.expect("d-x", "t1", "p-1", [3])
    wire.settle()
    r = wire.ended("p-1", "t1")
    assert r.reason is FailureReason.INCOMPATIBLE_PEER
    assert "dtype: theirs 'float16', ours 'bfloat16'" in r.detail
    assert wire.write_log == [] and wire.writes == []
    # The sender's Failed says so at once: the receiver need not wait out its deadline.
    d = wire.ended("d-x", "t1")
    assert d.reason is FailureReason.INCOMPATIBLE_PEER and d.blocks == (3,)
    assert "dtype: theirs 'bfloat16', ours 'float16'" in d.detail


def test_fields_an_explicit_policy_allows_may_differ(wire: Wire) -> None:
    policy = CompatibilityPolicy(frozenset({"layout"}), reason="test mapping")
    wire.add("p-x", "engine-px", compat=COMPAT | {"layout": "kv_first/NHD"}, compatibility=policy)
    wire.add("d-x", "engine-dx", compatibility=policy)
    wire.submit("p-x", "t1", [1])
    wire.expect("d-x", "t1", "p-x", [3])
    wire.settle()
    assert wire.ended("p-x", "t1").ok and wire.ended("d-x", "t1").ok


def test_a_register_counted_in_another_block_size_than_the_senders_is_refused(
    wire: Wire,
) -> None:
    # Block sizes the compatibility check lets differ (here by policy; vLLM engines by
    # their heads): the receiver's ids must count in the sender's blocks, and say so.
    policy = CompatibilityPolicy(frozenset({"block_size_tokens"}), reason="test mapping")
    wire.add("p-x", "engine-px", compat=COMPAT | {"block_size_tokens": 32}, compatibility=policy)
    wire.add("d-x", "engine-dx", compatibility=policy)
    wire.submit("p-x", "t1", [1])
    wire.expect("d-x", "t1", "p-x", [3])  # counted in its own 16-token blocks
    wire.settle()
    r = wire.ended("p-x", "t1")
    assert r.reason is FailureReason.BLOCK_MISMATCH and wire.write_log == []
    assert "receiver counted in blocks of 16 tokens, but the sender's blocks hold 32" in r.detail
    assert wire.ended("d-x", "t1").reason is FailureReason.BLOCK_MISMATCH
    wire.submit("p-x", "t2", [2])
    wire.expect("d-x", "t2", "p-x", [4], sender_block_tokens=32)
    wire.settle()
    assert wire.ended("p-x", "t2").ok and wire.ended("d-x", "t2").ok


@pytest.mark.parametrize(
    ("fields", "reason", "match"),
    [
        ({"colour"}, "x", "unknown fields"),
        ({"protocol_version"}, "x", "can never differ"),
        ({"dtype"}, "", "say why"),
    ],
)
def test_a_compatibility_policy_is_an_explicit_decision(
    fields: set[str], reason: str, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        CompatibilityPolicy(frozenset(fields), reason=reason)


def test_a_silent_receiver_is_not_dead_the_sender_holds_its_blocks_until_the_write_reports(
    wire: Wire,
) -> None:
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.deliver_register()
    [stalled] = wire.writes  # in flight, with Done riding on it, when d-1 stops
    wire.writes.clear()
    wire.run_only("p-1", TIMING.liveness_timeout_s + TIMING.lease_s + 10.0)
    sender = wire.ends["p-1"].sender
    # Silence, then the lease: the outcome is decided, but the write may still read
    # block 1, so it is not handed back (the engine would reuse it at once).
    assert sender.state_of("t1") is SenderState.ENDING
    assert sender.held_blocks() == {"t1": (1,)} and wire.results["p-1"] == []
    wire.writes.append(stalled)  # d-1 resumes: the write lands, from block 1 as it is
    wire.complete_write()
    wire.settle()
    # Done landed with the data, so both sides finished, with the sender's bytes.
    assert wire.ended("p-1", "t1").ok
    assert wire.ended("d-1", "t1").ok  # the Wire compared the bytes
    assert_block_copied(wire, "p-1", 1, "d-1", 3)


def test_a_sender_that_is_aborted_holds_its_blocks_for_as_long_as_a_write_is_out(
    wire: Wire,
) -> None:
    wire.submit("p-1", "t1", [1], layers=[0])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.deliver_register()
    wire.apply("p-1", wire.ends["p-1"].sender.abort(wire.now, "t1"))
    [stalled] = wire.writes
    wire.writes.clear()
    wire.run_only("p-1", 4 * TIMING.liveness_timeout_s)  # no drain time-out any more
    assert wire.results["p-1"] == [] and wire.ends["p-1"].sender.held_blocks() == {"t1": (1,)}
    wire.writes.append(stalled)
    wire.complete_write(ok=False)
    wire.settle()
    assert wire.ended("p-1", "t1").reason is FailureReason.CANCELLED
    assert wire.ended("d-1", "t1").reason is FailureReason.CANCELLED


def warm_up(wire: Wire) -> None:
    """One transfer p-1 -> d-1, so that the two have talked (the sender's clock bound)."""
    wire.submit("p-1", "t0", [0])
    wire.expect("d-1", "t0", "p-1", [0])
    wire.settle()
    assert wire.ended("d-1", "t0").ok


def stall_sender_past_the_fence(wire: Wire) -> None:
    """p-1 stops; d-1 gives up on t1 and, after its fence, hands block 3 back (which its
    engine reuses at once: the Wire then refuses any write into it)."""
    receiver = wire.ends["d-1"].receiver
    wire.run_only("d-1", TIMING.liveness_timeout_s + receiver.fence_s + 1.0)
    r = wire.ended("d-1", "t1")
    assert r.reason is FailureReason.PEER_TIMEOUT and r.blocks == (3,)


def test_a_register_that_waited_in_a_stalled_senders_inbox_is_refused(wire: Wire) -> None:
    warm_up(wire)
    wire.expect("d-1", "t1", "p-1", [3])  # p-1 stops before it reads this Register
    stall_sender_past_the_fence(wire)
    wire.submit("p-1", "t1", [1])  # p-1 resumes: its engine submits, then it reads...
    wire.settle()  # ...the Register (then the Cancel): it looks fresh on p-1's clock
    assert wire.write_log == [("p-1", "d-1", "t0", (0,))]  # nothing written for t1
    # Before refusing, p-1 measures the receiver's clock again; meanwhile it reads d-1's
    # Cancel, which ends t1 (had the Cancel been lost, the fresh bound refuses it).
    r = wire.ended("p-1", "t1")
    assert r.reason is FailureReason.CANCELLED, r


def test_a_stale_register_is_refused_once_a_fresh_bound_confirms_it(wire: Wire) -> None:
    """The same stall, with d-1's Cancel lost: p-1 asks d-1 again, d-1's answer no longer
    lists t1, and the fresh bound still puts the Register past its lease: refused."""
    warm_up(wire)
    wire.expect("d-1", "t1", "p-1", [3])
    stall_sender_past_the_fence(wire)
    wire.queue = [m for m in wire.queue if not isinstance(decode(m[2]), Cancel)]
    wire.submit("p-1", "t1", [1])
    wire.settle()
    assert wire.write_log == [("p-1", "d-1", "t0", (0,))]  # nothing written for t1
    r = wire.ended("p-1", "t1")
    assert r.reason is FailureReason.PEER_TIMEOUT and "Register" in r.detail, r
    assert wire.ends["p-1"].sender.stale_registers == 1


def test_nothing_ends_ok_while_a_lease_that_looked_over_is_measured_again(wire: Wire) -> None:
    """A full prefix hit writes nothing, but its Done still says "your blocks are good":
    a layers_ready that comes while the stale-looking Register is being rechecked must
    not finish it. The fresh bound then refuses it (d-1 gave up; its Cancel was lost)."""
    warm_up(wire)
    wire.expect("d-1", "t1", "p-1", [], offset=1)  # every block a prefix hit
    wire.run_only("d-1", TIMING.liveness_timeout_s + wire.ends["d-1"].receiver.fence_s + 1.0)
    assert not wire.ended("d-1", "t1").ok
    wire.queue = [m for m in wire.queue if not isinstance(decode(m[2]), Cancel)]  # lost
    wire.submit("p-1", "t1", [1], layers=[])  # nothing computed yet
    [i, *_] = [i for i, m in enumerate(wire.queue) if isinstance(decode(m[2]), Register)]
    wire.deliver(i)  # p-1 reads the oldest Register and asks d-1 again
    wire.apply("p-1", wire.ends["p-1"].sender.layers_ready(wire.now, "t1", [0, 1]))
    wire.settle()
    r = wire.ended("p-1", "t1")
    assert r.reason is FailureReason.PEER_TIMEOUT and "Register" in r.detail, r


def test_a_bound_loosened_by_a_starved_receiver_is_measured_again_not_trusted_for_good(
    wire: Wire,
) -> None:
    """A round trip that waited in a stopped receiver leaves the sender's bound on its
    clock too small by the wait. With no transfer left, no heartbeat measures it again,
    so before the fix every later Register looked stale and was refused, for good."""
    warm_up(wire)
    wire.expect("d-1", "t1", "p-1", [3])
    wire.submit("p-1", "t1", [1], layers=[])  # open, heartbeats flow
    wire.settle()
    wire.run_only("p-1", TIMING.liveness_timeout_s + TIMING.lease_s + 2.0)  # d-1 stopped
    wire.settle()  # d-1 resumes: reads p-1's heartbeats late, answers them, and t1's end
    assert wire.ended("p-1", "t1").reason is FailureReason.PEER_TIMEOUT
    for tid, ours, theirs in (("t2", 2, 5), ("t3", 4, 6)):
        wire.expect("d-1", tid, "p-1", [theirs])
        wire.submit("p-1", tid, [ours])
        wire.settle()
        assert wire.ended("p-1", tid).ok and wire.ended("d-1", tid).ok, wire.results
        wire.check_content("d-1", tid, (theirs,))
    assert wire.ends["p-1"].sender.stale_registers == 0


def test_a_submit_queued_during_a_stall_writes_nothing_once_the_lease_ran_out(
    wire: Wire,
) -> None:
    warm_up(wire)
    wire.expect("d-1", "t1", "p-1", [3])
    wire.settle()  # p-1 read the Register: its lease runs on d-1's clock; then p-1 stops
    stall_sender_past_the_fence(wire)
    wire.submit("p-1", "t1", [1])  # runs before any tick on resume
    wire.settle()
    assert [w[2] for w in wire.write_log] == ["t0"]
    # The lease looks over: p-1 measures d-1's clock again before deciding, and reads
    # d-1's Cancel meanwhile (with the Cancel lost, the fresh bound ends it PEER_TIMEOUT).
    assert wire.ended("p-1", "t1").reason is FailureReason.CANCELLED


def test_a_submit_after_a_stall_whose_cancel_was_lost_ends_peer_timeout(wire: Wire) -> None:
    warm_up(wire)
    wire.expect("d-1", "t1", "p-1", [3])
    wire.settle()
    stall_sender_past_the_fence(wire)
    wire.queue = [m for m in wire.queue if not isinstance(decode(m[2]), Cancel)]  # lost
    wire.submit("p-1", "t1", [1])
    wire.settle()
    assert [w[2] for w in wire.write_log] == ["t0"]
    r = wire.ended("p-1", "t1")
    assert r.reason is FailureReason.PEER_TIMEOUT and "lease" in r.detail, r


def test_a_first_contact_register_from_a_stall_is_never_written(wire: Wire) -> None:
    # No earlier contact, so p-1 has no bound on d-1's clock when the old Register comes.
    wire.expect("d-1", "t1", "p-1", [3])
    stall_sender_past_the_fence(wire)
    wire.queue = [m for m in wire.queue if not isinstance(decode(m[2]), Cancel)]  # lost
    wire.submit("p-1", "t1", [1])
    wire.run_for(TIMING.liveness_timeout_s + 1.0)
    assert wire.write_log == []  # no echo from d-1, so no proof of a lease: no write
    assert wire.ended("p-1", "t1").reason is FailureReason.PEER_TIMEOUT


def test_writes_wait_for_the_first_echo_then_flow_without_one_per_transfer(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.deliver()  # the Register: p-1 handshakes back and sends its heartbeat
    assert wire.writes == [] and len(wire.sent("p-1", Heartbeat)) == 1
    wire.deliver()  # d-1 answers at once, echoing p-1's clock
    assert wire.writes == []
    wire.deliver()  # the echo: now p-1 can prove the lease holds
    assert len(wire.writes) == 1
    wire.settle()
    wire.submit("p-1", "t2", [2])
    wire.expect("d-1", "t2", "p-1", [4])
    wire.deliver()  # the Register alone starts the write: the bound is kept
    assert len(wire.writes) == 1 and wire.queue == []
    wire.settle()
    assert wire.ended("d-1", "t2").ok


def test_the_sender_reports_its_bound_on_a_receivers_clock_and_how_wide_it_is(
    wire: Wire,
) -> None:
    """`clock_bounds()`: what the leases know of each receiver's clock, from the newest
    echoed heartbeat: its round trip on our clock, and when the echo came."""
    sender = wire.ends["p-1"].sender
    assert sender.clock_bounds() == {}
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.now = 10.0
    wire.deliver()  # the Register: p-1 handshakes back and sends its heartbeat at 10.0
    assert sender.clock_bounds() == {}  # nothing echoed yet
    wire.now = 10.25
    wire.deliver()  # d-1 answers at once, echoing 10.0, stamped 10.25 on its clock
    wire.now = 10.75
    wire.deliver()  # the echo comes back 0.75 s after its heartbeat left
    [(agent, bound)] = sender.clock_bounds().items()
    assert agent == "d-1"
    assert (bound.round_trip_s, bound.measured_at, bound.skew_lb_s) == (0.75, 10.75, -0.25)
    assert len(wire.writes) == 1  # the bound is what let the write start


def test_receiver_lookups_are_per_address_and_the_deadline_runs_from_expect(
    wire: Wire,
) -> None:
    wire.auto_handshake = False
    wire.add("p-2", "engine-p2")
    wire.expect("d-1", "t1", "p-1", [1])
    wire.expect("d-1", "t2", "p-1", [2])
    wire.expect("d-1", "t3", "p-2", [3])
    assert [(s, h.address) for s, h in wire.handshakes] == [
        ("d-1", wire.address_of["p-1"]),
        ("d-1", wire.address_of["p-2"]),
    ]
    receiver = wire.ends["d-1"].receiver
    assert receiver.states() == dict.fromkeys(["t1", "t2", "t3"], ReceiverState.HANDSHAKING)
    wire.answer_handshake("d-1", wire.handshakes[1][1])  # p-2 answers first
    assert receiver.state_of("t3") is ReceiverState.WAITING
    wire.apply("d-1", receiver.abort(wire.now, "t2"))
    assert wire.ended("d-1", "t2").reason is FailureReason.CANCELLED  # nothing registered
    wire.run_only("d-1", TIMING.transfer_deadline_s + 0.25, step=1.0)
    r = wire.ended("d-1", "t1")
    assert r.reason is FailureReason.DEADLINE_EXCEEDED and "handshake" in r.detail


def test_an_old_echo_repeated_after_an_idle_spell_does_not_shorten_the_lease(
    wire: Wire,
) -> None:
    warm_up(wire)
    wire.run_for(600.0, step=10.0)  # idle: nobody heartbeats, both ends keep the echo
    sender = wire.ends["p-1"].sender
    wire.submit("p-1", "t1", [1], layers=[])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.deliver()  # the Register, renewing the lease from now on d-1's clock
    expires = sender.lease_expires_at("t1")
    assert expires is not None and expires >= wire.now + TIMING.lease_s - 0.5
    # d-1's next heartbeat still echoes p-1's heartbeat from before the idle spell.
    stale = Heartbeat("receiver", "engine-d", "1", ("t1",), sent_at=wire.now, echo=0.0)
    wire.apply("p-1", wire.ends["p-1"].receive_message(wire.now, "d-1", encode(stale)))
    assert sender.lease_expires_at("t1") == expires
    wire.apply("p-1", sender.layers_ready(wire.now, "t1", [0, 1]))
    wire.settle()
    assert wire.ended("d-1", "t1").ok


def test_a_receiver_resumed_past_its_deadline_sends_no_register_the_sender_forgot() -> None:
    # Found by the model checker: the receiver stops right after registering; the sender
    # gives the registration up (Failed, queued to the receiver), and forgets it after its
    # tombstone's time; its engine submits the id late. The resumed receiver reads the
    # sender's old heartbeat before that Failed: a Register sent again then would be new
    # to the sender, which writes, while the Failed ends the transfer on the receiver.
    timing = TimingConfig(
        heartbeat_interval_s=0.5, liveness_timeout_s=3.0, lease_s=5.0, transfer_deadline_s=10.0
    )
    w = Wire(timing)
    w.add("p-1", "engine-p")
    w.add("d-1", "engine-d")
    w.expect("d-1", "t1", "p-1", [3])
    w.auto_handshake = False
    w.deliver()  # the Register: p-1 handshakes back, slowly; d-1 stops
    w.run_only("p-1", timing.transfer_deadline_s + timing.lease_s + 5.0)
    assert "t1" not in w.ends["p-1"].sender.states()  # given up and forgotten since
    w.submit("p-1", "t1", [1])  # the engine's late submit: a new transfer to p-1
    [hs] = [h for src, h in w.handshakes if src == "p-1"]
    w.answer_handshake("p-1", hs)  # sends the queued Failed, and a heartbeat listing none
    while mine := [i for i, m in enumerate(w.queue) if m[1] == "d-1"]:  # d-1 resumes,
        hb = [i for i in mine if isinstance(decode(w.queue[i][2]), Heartbeat)]
        w.deliver((hb or mine)[0])  # reading the sender's heartbeat first
    w.settle()
    w.run_for(w.ends["d-1"].receiver.fence_s + 1.0)
    assert [t for _, _, t, _ in w.write_log] == []
    assert w.ended("d-1", "t1").reason is not None
