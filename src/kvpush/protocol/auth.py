"""Data-plane message authentication: with a token configured, every message between two
ranks carries a MAC under a key for that pair, and a sequence number, so only a token
holder can make a message that counts, and a message counts once.

The pair key is derived from the token and what each side learns of the other over the
authenticated side channel, and is never sent anywhere::

    root        = HMAC-SHA256(token, "kvpush data-plane message keys, v1")
    K(src->dst) = BLAKE2b-256(key=root, src agent, src incarnation id,
                              dst agent, dst incarnation id)

one key per direction, per (sending rank, receiving rank), per incarnation of each: a
restarted process has new keys, and a message meant for one rank means nothing to
another. An incarnation id is a digest of the incarnation string the side channel
publishes. The frame (after the receiver's message key, see `identity`)::

    body | sender's incarnation id (16) | sequence number (8, big-endian) | tag (16)

with tag = BLAKE2b-128(key=K(src->dst), body | incarnation id | sequence number). The
sender's incarnation id travels so that a receiver can check a message from an agent it
has not looked up yet (a sender's first Register, see `identity.SenderGate`): the key
binds it, so a wrong one only makes the tag wrong.

What a reader of the network sees (agent names, message keys, incarnations, earlier
messages) grants nothing: without the token no key can be derived, so a message under a
real peer's agent name, or with a real message's bytes changed, fails its tag
("bad_mac"); a real message sent again, by anyone, fails its sequence number
("replayed"). Either is dropped unread and counted, and ends no transfer.

Sequence numbers: each pair's numbers rise from where the sender's numbering stood for any
pair, so a counter forgotten (the table is bounded) and made again still rises above
everything it sent before. The receiver keeps, per sending agent and incarnation, the
highest number it accepted and which of the `WINDOW` below it it has seen (as IPsec and
DTLS do): the data plane may deliver one sender's messages out of order (a `Done` riding
on a write arrives after the write, so after messages sent later), and a message older
than the window is dropped like a replay. Tables are bounded by `MAX_PAIRS`, and a
receiver's window is made only for a message whose tag was right, so a forger cannot grow
them. (A window forgotten because `MAX_PAIRS` newer pairs spoke since would let that
pair's old messages count again: by then its agent is long gone, and the identity gate
drops what an unknown agent sends.)

Pure computation, no I/O: `PushProtocol` seals what it sends (`wire`) and opens what it
receives (`receive_message`).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import struct
from typing import Literal

TAG_BYTES = 16
INCARNATION_ID_BYTES = 16
SEQUENCE_BYTES = 8
TRAILER_BYTES = INCARNATION_ID_BYTES + SEQUENCE_BYTES + TAG_BYTES
# How far behind the newest accepted number a message may still arrive (in messages
# of that sender to us).
WINDOW = 4096
# Pairs whose keys, counters and windows are kept (the oldest is forgotten first).
MAX_PAIRS = 4096

_ROOT_LABEL = b"kvpush data-plane message keys, v1"
_PAIR_PERSON = b"kvpush-pair-v1"
_INCARNATION_PERSON = b"kvpush-inc-v1"
_FULL = (1 << WINDOW) - 1
_SEQUENCE = struct.Struct(">Q")
_UNKNOWN_INCARNATION = bytes(INCARNATION_ID_BYTES)

Dropped = Literal["bad_mac", "replayed"]


def incarnation_id(incarnation: str) -> bytes:
    """The fixed-size id of an incarnation string, as it goes into keys and frames."""
    return hashlib.blake2b(
        incarnation.encode(), digest_size=INCARNATION_ID_BYTES, person=_INCARNATION_PERSON
    ).digest()


def _field(value: bytes) -> bytes:
    return len(value).to_bytes(2, "big") + value


def _tagger(key: bytes) -> hashlib.blake2b:
    """A keyed BLAKE2b, copied for each tag (cheaper than keying one per message)."""
    return hashlib.blake2b(key=key, digest_size=TAG_BYTES)


class _Counter:
    """What we send one agent: the incarnation its key is for, the keyed hash, and the
    next number."""

    __slots__ = ("incarnation", "next", "tagger")

    def __init__(self, incarnation: bytes, key: bytes, first: int) -> None:
        self.incarnation = incarnation
        self.tagger = _tagger(key)
        self.next = first


class _Window:
    """What one sender (agent and incarnation) sent us: its pair key, the highest
    sequence number accepted, and which of the `WINDOW` numbers below it were seen (bit
    k: number `high - k`). Number 0 is never sent, so it starts as seen."""

    __slots__ = ("high", "seen", "tagger")

    def __init__(self, tagger: hashlib.blake2b) -> None:
        self.tagger = tagger
        self.high = 0
        self.seen = 1

    def accept(self, seq: int) -> bool:
        if seq > self.high:
            shift = seq - self.high
            self.seen = ((self.seen << shift) | 1) & _FULL if shift < WINDOW else 1
            self.high = seq
            return True
        back = self.high - seq
        if back >= WINDOW:
            return False
        bit = 1 << back
        if self.seen & bit:
            return False
        self.seen |= bit
        return True


class MessageAuth:
    """One rank's MACs: it seals what we send to an agent, and opens what an agent sent
    us (see the module's docstring).

    `token` is the deployment's side-channel token; `agent` and `incarnation` are ours.
    `learn` tells it a peer's incarnation, as its side channel gave it, before we send
    that peer anything (a rank sends only to peers it looked up)."""

    def __init__(self, token: str | bytes, agent: str, incarnation: str) -> None:
        secret = token.encode() if isinstance(token, str) else bytes(token)
        if not secret:
            raise ValueError("MessageAuth needs a non-empty token")
        self._root = hmac.digest(secret, _ROOT_LABEL, "sha256")
        self._agent = agent.encode()
        self._incarnation = incarnation_id(incarnation)
        self._peer_incarnations: dict[str, bytes] = {}
        # By agent: a counter for an old incarnation of it is replaced when it is used.
        self._counters: collections.OrderedDict[str, _Counter] = collections.OrderedDict()
        self._high = 0  # the highest sequence number we sent anyone
        self._windows: collections.OrderedDict[tuple[str, bytes], _Window] = (
            collections.OrderedDict()
        )

    def _key(self, src: bytes, src_inc: bytes, dst: bytes, dst_inc: bytes) -> bytes:
        material = b"".join((_field(src), src_inc, _field(dst), dst_inc))
        return hashlib.blake2b(
            material, key=self._root, digest_size=32, person=_PAIR_PERSON
        ).digest()

    def learn(self, agent: str, incarnation: str) -> None:
        """`agent`'s incarnation, as its side channel said."""
        self._peer_incarnations[agent] = incarnation_id(incarnation)

    def seal(self, agent: str, body: bytes) -> bytes:
        """`body` framed for `agent`: our incarnation id, the pair's next sequence number
        and the tag. To an agent whose incarnation we never learned the tag is made for
        an unknown incarnation, and the agent drops it: we send only to peers we looked
        up, so that is a peer that never was one."""
        counter = self._counters.get(agent)
        if counter is None or counter.incarnation != self._peer_incarnations.get(
            agent, _UNKNOWN_INCARNATION
        ):
            counter = self._new_counter(agent)
        seq = counter.next
        counter.next = seq + 1
        if seq > self._high:  # noqa: PLR1730 (a comparison costs less than max() here)
            self._high = seq
        trailer = self._incarnation + _SEQUENCE.pack(seq)
        h = counter.tagger.copy()
        h.update(body)
        h.update(trailer)
        return body + trailer + h.digest()

    def _new_counter(self, agent: str) -> _Counter:
        """A counter for `agent`'s incarnation as we know it now, numbered above
        everything we sent anyone. The table forgets the oldest made first (not the
        least used: a counter made again costs a key derivation, and still rises)."""
        inc = self._peer_incarnations.get(agent, _UNKNOWN_INCARNATION)
        key = self._key(self._agent, self._incarnation, agent.encode(), inc)
        counter = self._counters[agent] = _Counter(inc, key, self._high + 1)
        if len(self._counters) > MAX_PAIRS:
            self._counters.popitem(last=False)
        return counter

    def open(self, agent: str, frame: bytes) -> bytes | Dropped:
        """The body of `frame`, from `agent` as the data plane names the sender; or why it
        is dropped: "bad_mac" (no token holder made it for this pair, or it was changed)
        or "replayed" (its sequence number was accepted before, or is older than the
        window). Nothing is remembered of a frame whose tag is wrong."""
        if len(frame) < TRAILER_BYTES:
            return "bad_mac"
        # Plain slices: a memoryview costs more than copying a message's bytes.
        inc = frame[-TRAILER_BYTES : -TAG_BYTES - SEQUENCE_BYTES]
        pair = (agent, inc)
        window = self._windows.get(pair)
        tagger = (
            window.tagger
            if window is not None
            else _tagger(self._key(agent.encode(), inc, self._agent, self._incarnation))
        )
        h = tagger.copy()
        h.update(frame[:-TAG_BYTES])
        if not hmac.compare_digest(h.digest(), frame[-TAG_BYTES:]):
            return "bad_mac"
        if window is None:
            window = self._windows[pair] = _Window(tagger)
            if len(self._windows) > MAX_PAIRS:
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end(pair)
        if not window.accept(
            int.from_bytes(frame[-TAG_BYTES - SEQUENCE_BYTES : -TAG_BYTES], "big")
        ):
            return "replayed"
        return frame[:-TRAILER_BYTES]
