"""Sans-IO tests of who a message is from (issue 11; `kvpush.protocol.state`, "Who sent
it"): a message is attributed to the agent the data plane names, an agent is believed to
be an engine only once that engine's side channel named it, and only a transfer's own
counterpart can end it. Forged messages are dropped and counted, never acted on.

The forgers here are agents the wire delivers messages from (`receive_message` with
their name) carrying real engine ids, incarnations, addresses and transfer ids.
"""

from __future__ import annotations

from helpers.wire import COMPAT, NUM_LAYERS, TIMING, Wire, assert_block_copied
from kvpush.errors import FailureReason
from kvpush.protocol import (
    Cancel,
    CancelAck,
    Done,
    Failed,
    Handshake,
    Heartbeat,
    LocalIdentity,
    Message,
    PeerAddress,
    PeerInfo,
    PushProtocol,
    Register,
    Reject,
    SendMessage,
    encode,
)


def assert_t1_still_finishes(w: Wire) -> None:
    """The real transfer t1 (p-1 to d-1, held with no layer ready) ends ok on both sides
    once its layers are ready: the forgeries before did not end or spoil it."""
    w.apply("p-1", w.ends["p-1"].sender.layers_ready(w.now, "t1", [0, 1]))
    w.settle()
    assert w.ended("p-1", "t1").ok and w.ended("d-1", "t1").ok


def forge(w: Wire, src: str, dst: str, message: Message) -> None:
    """`message` reaches `dst` from agent `src`, as the data plane reports it."""
    w.apply(dst, w.ends[dst].receive_message(w.now, src, encode(message)))


def register_as(w: Wire, real: str, tid: str, blocks: tuple[int, ...]) -> Register:
    """A Register that claims to be `real`'s: its engine, incarnation and address."""
    a = w.address_of[real]
    info = w.info_of[real]
    return Register(
        tid, info.engine_id, info.incarnation, a.host, a.port, a.rank, blocks, sent_at=w.now
    )


def test_a_forged_register_for_a_predicted_id_binds_nothing(wire: Wire) -> None:
    """The issue's case 1 and 2 at once: a foreign agent registers the id first,
    naming the real receiver's engine and side channel; that side channel names another
    agent, so the Register is dropped unread and the real transfer is untouched."""
    wire.submit("p-1", "t1", [1])
    forge(wire, "forger", "p-1", register_as(wire, "d-1", "t1", (9,)))
    [(_, hs)] = [(src, h) for src, h in wire.handshakes if src == "p-1"]
    assert (hs.address, hs.peer) == (wire.address_of["d-1"], "forger")
    assert wire.ends["p-1"].forged_messages() == {"impostor": 1}
    assert wire.results["p-1"] == []  # nothing ended: nothing was bound to the forger
    # Nor is the name unloaded: the runtime never loaded it, and it may be borrowed.
    assert wire.dropped_peers["p-1"] == []
    wire.expect("d-1", "t1", "p-1", [3])
    wire.settle()
    assert wire.ended("p-1", "t1").ok and wire.ended("d-1", "t1").ok
    assert_block_copied(wire, "p-1", 1, "d-1", 3)
    assert [w[1] for w in wire.write_log] == ["d-1"]  # never a byte to the forger


def test_messages_of_an_agent_under_verification_wait_unread_and_then_are_dropped(
    wire: Wire,
) -> None:
    wire.auto_handshake = False
    forge(wire, "forger", "p-1", register_as(wire, "d-1", "t1", (9,)))
    for message in (
        Cancel("t1", FailureReason.CANCELLED, "forged"),
        Reject("t2", "forged"),
        Heartbeat("receiver", "engine-d", "1", ("t1",), sent_at=wire.now),
    ):
        forge(wire, "forger", "p-1", message)
    assert wire.ends["p-1"].forged_messages() == {}  # not read yet, not acted on either
    wire.submit("p-1", "t2", [2])
    [(_, hs)] = wire.handshakes
    wire.answer_handshake("p-1", hs)  # the side channel names d-1, not the forger
    assert wire.ends["p-1"].forged_messages() == {"impostor": 4}
    assert wire.results["p-1"] == []  # t2's forged Reject was never read


def test_a_foreign_agent_without_an_address_is_never_read(wire: Wire) -> None:
    wire.submit("p-1", "t1", [1])
    wire.expect("d-1", "t1", "p-1", [3])
    for message in (
        Cancel("t1", FailureReason.CANCELLED, "forged"),
        Reject("t1", "forged, naming nobody"),
        Heartbeat("receiver", "engine-d", "1", (), sent_at=wire.now),
    ):
        forge(wire, "forger", "p-1", message)
    for message in (
        Done("t1", 1),
        Failed("t1", FailureReason.PEER_GONE, "forged"),
        CancelAck("t1"),
        Heartbeat("sender", "engine-p", "1", ("t1",), sent_at=wire.now),
    ):
        forge(wire, "forger", "d-1", message)
    assert wire.ends["p-1"].forged_messages() == {"unknown_agent": 3}
    assert wire.ends["d-1"].forged_messages() == {"unknown_agent": 4}
    wire.settle()
    assert wire.ended("p-1", "t1").ok and wire.ended("d-1", "t1").ok


def test_a_cancel_for_an_id_nobody_registered_ends_only_its_own_agents_register(
    wire: Wire,
) -> None:
    """Another real receiver (vouched for by its own side channel) cancels an id it
    never registered: on main a tombstone then failed the real receiver's transfer
    ("id in use"); now it is remembered against that receiver's own Register only."""
    wire.add("d-2", "engine-e")
    wire.expect("d-2", "t0", "p-1", [5])  # so that p-1 has vouched for d-2
    wire.submit("p-1", "t0", [0])
    wire.settle()
    assert wire.ended("d-2", "t0").ok
    wire.submit("p-1", "t1", [1])
    forge(wire, "d-2", "p-1", Cancel("t1", FailureReason.CANCELLED, "not mine"))
    wire.settle()  # d-2 hears a CancelAck for an id it does not know: ignored there
    wire.expect("d-1", "t1", "p-1", [3])
    wire.settle()
    assert wire.ended("p-1", "t1").ok and wire.ended("d-1", "t1").ok
    assert_block_copied(wire, "p-1", 1, "d-1", 3)


def test_messages_about_another_peers_transfer_are_dropped(wire: Wire) -> None:
    wire.add("d-2", "engine-e")
    wire.add("p-2", "engine-q")
    wire.expect("d-2", "t0", "p-1", [5])
    wire.submit("p-1", "t0", [0])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.submit("p-1", "t1", [1], layers=[])
    wire.settle()
    assert wire.ended("d-2", "t0").ok
    # d-2 is a real receiver of p-1's, but t1 is d-1's.
    forge(wire, "d-2", "p-1", Cancel("t1", FailureReason.CANCELLED, "not mine"))
    forge(wire, "d-2", "p-1", Reject("t1", "not mine"))
    # p-2 is a real sender, looked up by d-1 below, but t1 is p-1's.
    wire.expect("d-1", "t2", "p-2", [4])
    wire.settle()
    forge(wire, "p-2", "d-1", Done("t1", 1))
    forge(wire, "p-2", "d-1", Failed("t1", FailureReason.PEER_GONE, "not mine"))
    assert wire.ends["p-1"].forged_messages() == {"not_counterpart": 2}
    assert wire.ends["d-1"].forged_messages() == {"not_counterpart": 2}
    assert_t1_still_finishes(wire)


def test_a_peer_that_claims_another_engine_than_its_side_channel_said_is_dropped(
    wire: Wire,
) -> None:
    wire.submit("p-1", "t1", [1], layers=[])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.settle()
    forge(wire, "d-1", "p-1", Heartbeat("receiver", "engine-x", "1", ("t1",), sent_at=wire.now))
    forge(wire, "d-1", "p-1", Heartbeat("receiver", "engine-d", "9", ("t1",), sent_at=wire.now))
    forge(wire, "p-1", "d-1", Heartbeat("sender", "engine-x", "1", ("t1",), sent_at=wire.now))
    elsewhere = Register("t2", "engine-d", "1", "10.0.0.1", 1, 0, (4,), sent_at=wire.now)
    forge(wire, "d-1", "p-1", elsewhere)  # its own engine, but not its side channel
    assert wire.ends["p-1"].forged_messages() == {"wrong_engine": 3}
    assert wire.ends["d-1"].forged_messages() == {"wrong_engine": 1}
    assert_t1_still_finishes(wire)


def test_a_second_side_channel_claiming_a_live_engine_is_not_a_restart(wire: Wire) -> None:
    """A foreign side channel (one the token admits, say) serves an agent of its own as
    a new incarnation of engine-d. On main the sender believed it and ended every
    transfer with the real engine-d (PEER_RESTARTED); now it asks engine-d's own side
    channel again, which still names d-1, and refuses the newcomer."""
    wire.submit("p-1", "t1", [1], layers=[])
    wire.expect("d-1", "t1", "p-1", [3])
    wire.settle()
    wire.add("forger", "engine-f")  # its own address...
    wire.info_of["forger"] = PeerInfo("forger", "engine-d", "2", COMPAT)  # ...claiming d's
    forge(wire, "forger", "p-1", register_as(wire, "forger", "t9", (1,)))
    revalidations = [h for src, h in wire.handshakes if src == "p-1" and h.revalidate]
    assert [(h.address, h.peer) for h in revalidations] == [(wire.address_of["d-1"], "d-1")]
    assert wire.ends["p-1"].forged_messages() == {"impostor": 1}
    assert wire.results["p-1"] == [] and wire.dropped_peers["p-1"][-1].peer == "forger"
    assert_t1_still_finishes(wire)


def test_two_ranks_of_one_decode_engine_each_take_their_part_from_one_sender(
    wire: Wire,
) -> None:
    """A prefill rank writing into two decode ranks (prefill TP 1, decode TP 2): both
    are agents of engine-d, vouched for by its one side channel under their own rank.
    On main the sender took rank 1 for a rival of rank 0 claiming the same engine,
    asked again, and refused it as an impostor: its part never moved."""
    wire.add("d-2", "engine-d", rank=1)
    assert wire.address_of["d-2"] == PeerAddress("127.0.0.1", wire.address_of["d-1"].port, 1)
    # (Blocks of their own: this wire's engine reuses a block once a transfer ends.)
    wire.submit("p-1", "t1#0>0", [1])
    wire.submit("p-1", "t1#0>1", [2])
    wire.expect("d-1", "t1#0>0", "p-1", [3])
    wire.expect("d-2", "t1#0>1", "p-1", [4])
    wire.settle()
    for d in ("d-1", "d-2"):
        tid = "t1#0>0" if d == "d-1" else "t1#0>1"
        assert wire.ended("p-1", tid).ok and wire.ended(d, tid).ok
    assert_block_copied(wire, "p-1", 1, "d-1", 3)
    assert_block_copied(wire, "p-1", 2, "d-2", 4)
    assert wire.ends["p-1"].forged_messages() == {}
    assert not [h for _, h in wire.handshakes if h.revalidate]


def test_a_restart_at_a_new_address_is_believed_once_the_old_one_no_longer_vouches(
    wire: Wire,
) -> None:
    wire.expect("d-1", "t1", "p-1", [3])
    wire.submit("p-1", "t1", [1])
    wire.settle()
    wire.kill("d-1")
    del wire.serving[wire.address_of["d-1"]]  # its side channel died with it
    wire.add("d-2", "engine-x")  # a new address (the engine bound port 0 anew)...
    wire.engine_of["d-2"] = "engine-d"
    wire.info_of["d-2"] = PeerInfo("d-2", "engine-d", "2", COMPAT)  # ...same engine
    wire.ends["d-2"] = PushProtocol(
        LocalIdentity("engine-d", "2", "127.0.0.1", wire.address_of["d-2"].port, 0),
        TIMING,
        NUM_LAYERS,
        COMPAT,
    )
    wire.submit("p-1", "t2", [2])
    wire.expect("d-2", "t2", "p-1", [6])
    wire.settle()
    assert wire.ended("p-1", "t2").ok and wire.ended("d-2", "t2").ok
    assert_block_copied(wire, "p-1", 2, "d-2", 6)
    assert wire.ends["p-1"].forged_messages() == {}


def test_the_message_key_keeps_out_whoever_lacks_it_under_any_name() -> None:
    key = b"k" * 16
    me = PushProtocol(
        LocalIdentity("engine-p", "1", "127.0.0.1", 5000, 0),
        TIMING,
        NUM_LAYERS,
        COMPAT,
        message_key=key,
    )
    register = Register("t1", "engine-d", "1", "127.0.0.1", 5001, 0, (3,), sent_at=0.0)
    assert me.receive_message(0.0, "d-1", encode(register)) == []  # a real name, no key
    assert me.receive_message(0.0, "d-1", b"k" * 15 + b"x" + encode(register)) == []
    assert me.forged_messages() == {"bad_key": 2}
    [hs] = me.receive_message(0.0, "d-1", key + encode(register))
    assert isinstance(hs, Handshake) and hs.address == PeerAddress("127.0.0.1", 5001, 0)
    theirs = b"d" * 16
    info = PeerInfo("d-1", "engine-d", "1", COMPAT, message_key=theirs)
    effects = me.handshake_done(0.0, hs.address, info)
    [hb] = [e for e in effects if isinstance(e, SendMessage)]
    assert me.wire("d-1", hb.message) == theirs + encode(hb.message)
    assert me.wire("someone-else", hb.message) == encode(hb.message)


def test_too_many_unread_messages_from_one_agent_are_dropped(wire: Wire) -> None:
    wire.auto_handshake = False
    forge(wire, "forger", "p-1", register_as(wire, "d-1", "t1", (9,)))
    for i in range(100):
        forge(wire, "forger", "p-1", Reject(f"x{i}", "forged"))
    counted = wire.ends["p-1"].forged_messages()
    [(_, hs)] = wire.handshakes
    wire.answer_handshake("p-1", hs)
    after = wire.ends["p-1"].forged_messages()
    assert counted["unread_overflow"] + after["impostor"] == 101
    assert counted["unread_overflow"] > 0 and after["unread_overflow"] == counted["unread_overflow"]


# ----- the decode server a transfer is for (issue 22: an insider holds the token)


def with_insider(wire: Wire) -> Wire:
    """`wire` plus x-1: an agent of engine-x, admitted by a side channel of its own (it
    holds the token), that predicted transfer id t1 and expects it too."""
    wire.add("x-1", "engine-x")
    return wire


def test_a_transfer_named_for_a_decode_server_goes_there_though_an_insider_registered_first(
    wire: Wire,
) -> None:
    """The insider registers t1 before the real receiver and before submit; submit names
    the decode server by its side channel (any rank: the rank is not compared). The
    insider is refused with a reason that names both, counted, and never written to;
    the real receiver's Register, held until submit, takes the transfer."""
    w = with_insider(wire)
    w.expect("x-1", "t1", "p-1", [5])
    w.settle()
    w.expect("d-1", "t1", "p-1", [3])
    w.settle()
    assert w.results["d-1"] == []  # held, unanswered, until submit says which one
    d = w.address_of["d-1"]
    w.submit("p-1", "t1", [1], receiver=PeerAddress(d.host, d.port, 7))
    w.settle()
    assert w.ended("p-1", "t1").ok and w.ended("d-1", "t1").ok
    assert_block_copied(w, "p-1", 1, "d-1", 3)
    refused = w.ended("x-1", "t1")
    assert refused.reason is FailureReason.MALFORMED_MESSAGE
    assert f"{d.host}:{d.port}" in refused.detail and "not receiver x-1" in refused.detail
    assert [wr[1] for wr in w.write_log] == ["d-1"]
    assert w.ends["p-1"].sender.wrong_receivers == 1


def test_a_register_from_another_decode_server_after_submit_is_refused(wire: Wire) -> None:
    w = with_insider(wire)
    w.submit("p-1", "t1", [1, 2], receiver=w.address_of["d-1"])
    w.expect("x-1", "t1", "p-1", [5, 6])
    w.settle()
    assert w.ended("x-1", "t1").reason is FailureReason.MALFORMED_MESSAGE
    assert w.results["p-1"] == []  # the transfer still waits for the one it is for
    w.expect("d-1", "t1", "p-1", [3, 4])
    w.settle()
    assert w.ended("p-1", "t1").ok and w.ended("d-1", "t1").ok
    assert_block_copied(w, "p-1", 2, "d-1", 4)
    assert w.ends["p-1"].sender.wrong_receivers == 1


def test_without_a_named_decode_server_the_first_to_register_takes_the_transfer(
    wire: Wire,
) -> None:
    """What `submit(receiver=None)` promises, and no more: the real receiver that came
    second is told the id is taken; nothing is written to it."""
    w = with_insider(wire)
    w.expect("x-1", "t1", "p-1", [5])
    w.settle()
    w.expect("d-1", "t1", "p-1", [3])
    w.settle()
    w.submit("p-1", "t1", [1])
    w.settle()
    assert w.ended("p-1", "t1").ok and w.ended("x-1", "t1").ok
    assert not w.ended("d-1", "t1").ok
    assert [wr[1] for wr in w.write_log] == ["x-1"]
    assert w.ends["p-1"].sender.wrong_receivers == 0


def test_a_held_register_that_is_cancelled_is_acknowledged_and_forgotten(wire: Wire) -> None:
    w = with_insider(wire)
    w.expect("x-1", "t1", "p-1", [5])
    w.settle()
    w.expect("d-1", "t1", "p-1", [3])
    w.settle()
    w.apply("d-1", w.ends["d-1"].receiver.abort(w.now, "t1"))
    w.settle()
    assert w.ended("d-1", "t1").reason is FailureReason.CANCELLED
    w.submit("p-1", "t1", [1], receiver=w.address_of["d-1"])
    w.settle()
    assert w.ended("x-1", "t1").reason is FailureReason.MALFORMED_MESSAGE
    assert w.results["p-1"] == [] and w.write_log == []  # still waiting, for d-1 only
