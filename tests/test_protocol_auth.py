"""Data-plane message authentication (`kvpush.protocol.auth`): only a token holder makes
a message that counts, for one pair of ranks, once; and inside `PushProtocol`, forged,
changed and replayed messages are dropped, counted and end nothing."""

from __future__ import annotations

import pytest

from helpers.wire import Wire, assert_block_copied
from kvpush.errors import FailureReason
from kvpush.protocol import (
    Cancel,
    CancelAck,
    Done,
    Failed,
    Heartbeat,
    Message,
    Register,
    Reject,
    encode,
)
from kvpush.protocol.auth import MAX_PAIRS, TRAILER_BYTES, WINDOW, MessageAuth

TOKEN = "deployment-token"


def _pair() -> tuple[MessageAuth, MessageAuth]:
    p = MessageAuth(TOKEN, "p-1", "inc-p")
    d = MessageAuth(TOKEN, "d-1", "inc-d")
    p.learn("d-1", "inc-d")
    d.learn("p-1", "inc-p")
    return p, d


def test_a_sealed_message_opens_once_at_its_peer_only() -> None:
    p, d = _pair()
    frame = p.seal("d-1", b"hello")
    assert len(frame) == len(b"hello") + TRAILER_BYTES
    assert d.open("p-1", frame) == b"hello"
    assert d.open("p-1", frame) == "replayed"
    # Named as another sender, or opened by another rank, it is nobody's.
    assert d.open("p-2", p.seal("d-1", b"x")) == "bad_mac"
    other = MessageAuth(TOKEN, "d-2", "inc-d")
    assert other.open("p-1", p.seal("d-1", b"x")) == "bad_mac"


def test_without_the_token_no_frame_opens_whatever_it_copies() -> None:
    p, d = _pair()
    thief = MessageAuth("a-guess", "p-1", "inc-p")  # the real name and incarnation
    thief.learn("d-1", "inc-d")
    assert d.open("p-1", thief.seal("d-1", b"cancel everything")) == "bad_mac"
    real = p.seal("d-1", b"done t1")
    for i in range(len(real)):  # any byte changed, trailer included
        changed = bytearray(real)
        changed[i] ^= 0x01
        assert d.open("p-1", bytes(changed)) == "bad_mac", i
    assert d.open("p-1", real[:-1]) == "bad_mac"
    assert d.open("p-1", b"") == "bad_mac"
    assert d.open("p-1", real) == b"done t1"  # the real one still counts, once


def test_a_new_incarnation_has_new_keys() -> None:
    p, d = _pair()
    old = p.seal("d-1", b"from the old process")
    restarted = MessageAuth(TOKEN, "d-1", "inc-d2")  # same agent name, new incarnation
    assert restarted.open("p-1", old) == "bad_mac"
    # A sender that learned only the old incarnation seals for it: the new one drops it.
    assert restarted.open("p-1", p.seal("d-1", b"x")) == "bad_mac"
    p.learn("d-1", "inc-d2")
    assert restarted.open("p-1", p.seal("d-1", b"y")) == b"y"
    # And nothing sealed before we learned any incarnation of a peer opens anywhere.
    stranger = MessageAuth(TOKEN, "p-9", "inc-9")
    assert d.open("p-9", stranger.seal("d-1", b"z")) == "bad_mac"


def test_reordering_inside_the_window_is_kept_and_older_is_dropped() -> None:
    p, d = _pair()
    frames = [p.seal("d-1", str(i).encode()) for i in range(WINDOW + 2)]
    assert d.open("p-1", frames[1]) == b"1"
    assert d.open("p-1", frames[WINDOW]) == str(WINDOW).encode()
    assert d.open("p-1", frames[0]) == "replayed"  # WINDOW behind the newest
    assert d.open("p-1", frames[2]) == b"2"  # just inside
    assert d.open("p-1", frames[2]) == "replayed"
    assert d.open("p-1", frames[WINDOW + 1]) == str(WINDOW + 1).encode()
    assert d.open("p-1", frames[WINDOW - 5]) == str(WINDOW - 5).encode()


def test_a_counter_forgotten_and_made_again_still_rises() -> None:
    """The sender's tables are bounded; a pair's numbers never go back, so its receiver
    (which remembers) does not take the new messages for replays."""
    p, d = _pair()
    assert d.open("p-1", p.seal("d-1", b"a")) == b"a"
    for i in range(MAX_PAIRS + 1):  # push d-1's counter out
        p.seal(f"x-{i}", b"")
    assert d.open("p-1", p.seal("d-1", b"b")) == b"b"


def test_a_token_is_required() -> None:
    with pytest.raises(ValueError, match="non-empty token"):
        MessageAuth("", "a", "b")


# --------------------------------------------------------------- in PushProtocol


def _forgeries(tid: str) -> list[Message]:
    """Every message kind, as either side of the pair might send it."""
    return [
        Register(tid, "engine-d", "1", "127.0.0.1", 5001, 0, (1, 2), sent_at=0.0),
        Cancel(tid, FailureReason.CANCELLED, "forged"),
        Reject(tid, "forged"),
        Heartbeat("receiver", "engine-d", "1", (tid,), sent_at=0.0),
        Heartbeat("sender", "engine-p", "1", (tid,), sent_at=0.0),
        Done(tid, 2),
        Failed(tid, FailureReason.WRITE_ERROR, "forged"),
        CancelAck(tid),
    ]


def test_forged_and_replayed_messages_under_real_names_end_nothing() -> None:
    """An attacker holding everything a reader of the network sees (the real agent names
    it sends under, every message so far, which it replays before each real delivery)
    but no token: the real transfers finish with the right bytes, and every message it
    made is dropped and counted."""
    wire = Wire(token=TOKEN)
    wire.add("p-1", "engine-p")
    wire.add("d-1", "engine-d")
    seen: list[tuple[str, str, bytes]] = []
    injected = {"p-1": 0, "d-1": 0}

    def attack() -> None:
        for src, dst, payload in list(seen):  # replays, under the real sender's name
            wire.ends[dst].receive_message(wire.now, src, payload)
            injected[dst] += 1
        for tid in ("t1", "t2", "t3"):  # live and predicted ids, every kind, both ways
            for msg in _forgeries(tid):
                for src, dst in (("d-1", "p-1"), ("p-1", "d-1")):
                    # In clear, and with a trailer copied from a real message.
                    wire.ends[dst].receive_message(wire.now, src, encode(msg))
                    tail = seen[-1][2][-TRAILER_BYTES:] if seen else bytes(TRAILER_BYTES)
                    wire.ends[dst].receive_message(wire.now, src, encode(msg) + tail)
                    injected[dst] += 2

    wire.expect("d-1", "t1", "p-1", [3, 4])
    wire.submit("p-1", "t1", [1, 2])
    wire.expect("d-1", "t2", "p-1", [5])
    wire.submit("p-1", "t2", [6])
    for _ in range(200):
        if not wire.queue and not wire.writes:
            break
        attack()
        if wire.queue:
            seen.append(wire.queue[0])
            wire.deliver()
        else:
            wire.complete_write()
    attack()
    for tid in ("t1", "t2"):
        assert wire.ended("p-1", tid).ok and wire.ended("d-1", tid).ok
    assert_block_copied(wire, "p-1", 1, "d-1", 3)
    assert_block_copied(wire, "p-1", 6, "d-1", 5)
    for agent in ("p-1", "d-1"):
        forged = wire.ends[agent].forged_messages()
        assert set(forged) <= {"bad_mac", "replayed"}, forged
        assert sum(forged.values()) == injected[agent], (agent, forged, injected)
        assert forged["replayed"] > 0 and forged["bad_mac"] > 0
    # Nothing of t3 (only ever forged) exists anywhere.
    assert not [r for rs in wire.results.values() for r in rs if r.transfer_id == "t3"]
