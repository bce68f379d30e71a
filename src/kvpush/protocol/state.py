"""The push protocol's state machines: every transition, in one place, with no I/O.

Theory of operation
===================

Two machines per rank: `SenderProtocol` (the side whose engine computed the KV blocks,
usually prefill) and `ReceiverProtocol` (the side that allocated blocks for them, usually
decode). `PushProtocol` holds both and is the one inbound entry point for wire bytes.
They take engine calls, decoded messages, transport events and the current time `now`
(monotonic seconds, fed by the caller), and return lists of *effects*: `SendMessage`,
`WriteBlocks`, `Handshake`, `DropPeer`, `TransferEnded`. They import no socket, thread or
clock; the runtime carries out the effects.

A transfer is named by its `transfer_id`, end to end. Peers are named by data-plane agent
name, which is new for every process incarnation, so a restarted peer is a new peer.

The happy path::

    receiver                                 sender
    expect(T, blocks)  --Register(T)-->      (handshake back if new peer)
                                             submit(T, blocks) / layers_ready(T, ...)
                       <==WRITE blocks===    (one write per batch of ready layers)
                       <--Done(T)--          the last write's notification
    TransferEnded(ok)                        TransferEnded(ok) on its WriteDone

`Done` rides on the transfer's last write as its data-plane notification, which arrives
only after that write's bytes (NIXL's guarantee, and the loopback's): no round trip after
the data. It rides only when no other write of the transfer is in flight; otherwise, and
for a full prefix hit (nothing to write), it goes as a message once every write reported
`WriteDone`. A write that fails delivers no notification, so the sender sends `Failed`.

Registration may come before or after the sender's engine submits: whichever comes
second starts the writes. `Register.sender_offset = k` says the receiver's blocks stand
for the sender's blocks from `k` on (a prefix-cache hit); a full hit registers no blocks
and the sender answers `Done` at once without writing.

The fencing rules, which make "nothing is written after a failure" hold:

* The sender sends `Done`, `Failed` or `CancelAck` for a transfer only when none of its
  writes is in flight (a `Done` riding on the last write is delivered only after that
  write landed), and never writes for it afterwards (it keeps a tombstone). So a
  receiver that gets any of these may reuse its blocks at once.
* A receiver that gives up on its own (engine abort, deadline, silent sender, bad
  message) sends `Cancel` and *fences* its blocks: it keeps them until the sender's
  `CancelAck`/`Failed`/`Done`, or until the sender's lease has certainly run out
  (`lease_s + 2 * liveness_timeout_s` after it stopped renewing), and reports the
  transfer only then. `TransferEnded` therefore always means "the blocks are yours".
* The sender holds its blocks under a lease (`lease_s`) that the receiver's heartbeats
  renew, per transfer. It starts no write after the lease ran out, and a sender that
  ends a transfer waits for its in-flight writes (at most `liveness_timeout_s`).
* A peer whose process is certainly gone (the data plane lost it, or it came back with a
  new incarnation) can write nothing more: its transfers end at once, and `DropPeer`
  tells the runtime to forget it, so the next transfer handshakes afresh.
* A peer silent for `liveness_timeout_s` is declared dead: the sender abandons its
  transfers with it; the receiver fences them.

One exception to "a lost peer ends its transfers": a receiver's first `Register` that
certainly reached no live sender (the runtime saw the data plane lose the peer in the
same pass that sent it, and nothing was heard from the peer since) may be `withdraw`n
and registered again, once, with a freshly handshaken peer: no byte of it can have been
written, and nothing is reported for the withdrawn attempt.

Every transfer the engine handed in ends with exactly one `TransferEnded`, on each side,
within `transfer_deadline_s` plus the fence. Tombstones make late, duplicate and
reordered messages harmless: a late `Register` gets the recorded answer again, a `Cancel`
that overtakes its `Register` leaves a tombstone that the `Register` then meets.

Errors: engine misuse raises `LocalProtocolError` at the call; bytes that are not a
message raise `RemoteProtocolError` from `PushProtocol.receive_message` with no state
changed (the runtime then calls `peer_misbehaved`). A decodable message that makes no
sense for its transfer fails that transfer with MALFORMED_MESSAGE.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar

from kvpush.config import TimingConfig
from kvpush.errors import (
    FailureReason,
    LocalProtocolError,
    RemoteProtocolError,
    TransferFailed,
)
from kvpush.geometry import PROTOCOL_VERSION
from kvpush.protocol.messages import (
    Cancel,
    CancelAck,
    Done,
    Failed,
    Heartbeat,
    Message,
    Register,
    Reject,
    decode,
)

Side = Literal["sender", "receiver"]


# --------------------------------------------------------------------------- effects


@dataclass(frozen=True, slots=True)
class SendMessage:
    peer: str
    message: Message


@dataclass(frozen=True, slots=True)
class WriteBlocks:
    """Copy `our_blocks[i]` to the peer's `their_blocks[i]`, in the regions of `layers`
    (None: every region). Report the outcome with `write_done`/`write_failed`.

    `notification`, when set, is the transfer's `Done`: the data plane delivers it to the
    peer only after every byte of this write landed, and never if the write failed."""

    peer: str
    transfer_id: str
    write_id: int
    our_blocks: tuple[int, ...]
    their_blocks: tuple[int, ...]
    layers: tuple[int, ...] | None
    notification: Message | None = None


@dataclass(frozen=True, slots=True)
class Handshake:
    """Load this peer (its side channel is at host:port, rank) and call `peer_ready`
    or `peer_unreachable`. Only the sender asks: the receiver handshakes before `expect`."""

    peer: str
    host: str
    port: int
    rank: int


@dataclass(frozen=True, slots=True)
class DropPeer:
    """Forget this peer (it is dead or restarted): the next contact handshakes afresh."""

    peer: str
    reason: FailureReason
    detail: str


@dataclass(frozen=True, slots=True)
class TransferEnded:
    """The transfer ended, once and for good; kvpush no longer holds `blocks`."""

    transfer_id: str
    side: Side
    reason: FailureReason | None  # None: finished
    detail: str
    blocks: tuple[int, ...]

    @property
    def ok(self) -> bool:
        return self.reason is None

    def raise_for_failure(self) -> None:
        if self.reason is not None:
            raise TransferFailed(self.transfer_id, self.reason, self.detail)


Effect = SendMessage | WriteBlocks | Handshake | DropPeer | TransferEnded


@dataclass(frozen=True, slots=True)
class LocalIdentity:
    """Who we are, as a receiver puts it into `Register` so the sender can call back."""

    engine_id: str
    incarnation: str
    host: str
    port: int
    rank: int


# --------------------------------------------------------------------------- shared


@dataclass(slots=True)
class _Peer:
    agent: str
    engine_id: str
    last_heard: float
    last_heartbeat_sent: float = float("-inf")
    ready: bool = True
    outbox: list[Message] = field(default_factory=list)
    known_by_them: frozenset[str] | None = None  # receiver: ids in the sender's last heartbeat
    messages_heard: int = 0  # receiver: how many messages it sent us, ever


class _Clock:
    def __init__(self) -> None:
        self.now = float("-inf")

    def advance(self, now: float) -> float:
        # A clock that steps back is treated as standing still: timers never rewind.
        self.now = max(self.now, now)
        return self.now


def _check_blocks(blocks: Sequence[int], what: str) -> tuple[int, ...]:
    out = tuple(blocks)
    for b in out:
        if not isinstance(b, int) or isinstance(b, bool) or b < 0:
            raise LocalProtocolError(f"{what}: block id {b!r} is not a non-negative integer")
    if len(set(out)) != len(out):
        raise LocalProtocolError(f"{what}: block ids repeat: {list(out)}")
    return out


# --------------------------------------------------------------------------- sender


class _Record(Protocol):
    @property
    def peer(self) -> str | None: ...  # None: a sender still waiting for its Register


_Rec = TypeVar("_Rec", bound=_Record)


class _Side(Generic[_Rec]):
    """What both sides do alike: their transfers, by id, each with one peer."""

    _clock: _Clock
    _transfers: dict[str, _Rec]
    _peers: dict[str, _Peer]

    def in_flight(self) -> bool:
        return bool(self._transfers)

    def peer_lost(self, now: float, peer: str, reason: FailureReason, detail: str) -> list[Effect]:
        """`peer` is certainly gone: it can write or confirm nothing more, so its
        transfers end now and it is forgotten."""
        now = self._clock.advance(now)
        if peer not in self._peers:
            return []
        out: list[Effect] = []
        for rec in list(self._transfers.values()):
            if rec.peer == peer:
                out += self._end_with_lost_peer(now, rec, reason, detail)
        del self._peers[peer]
        out.append(DropPeer(peer, reason, detail))
        return out

    def _end_with_lost_peer(
        self, now: float, rec: _Rec, reason: FailureReason, detail: str
    ) -> list[Effect]:
        raise NotImplementedError


class SenderState(enum.StrEnum):
    AWAITING_REGISTER = "awaiting_register"  # submitted, receiver not heard yet
    REGISTERED = "registered"  # receiver registered, engine has not submitted (no blocks)
    WRITING = "writing"  # both known: writes go out as layers become ready
    ENDING = "ending"  # outcome decided, waiting for in-flight writes to drain


@dataclass(slots=True)
class _Outgoing:
    transfer_id: str
    state: SenderState
    deadline: float
    blocks: tuple[int, ...] | None = None
    ready_layers: set[int] = field(default_factory=set)
    issued_layers: set[int] = field(default_factory=set)
    peer: str | None = None
    register: Register | None = None
    lease_until: float = float("inf")
    inflight: set[int] = field(default_factory=set)
    reason: FailureReason | None = None
    detail: str = ""
    reply: Message | None = None
    drain_until: float = float("inf")
    done_write: int | None = None  # the write that carries our Done as its notification


@dataclass(slots=True)
class _Tombstone:
    peer: str | None
    reply: Message | None  # what a late Register/Cancel/heartbeat gets
    expires: float
    # Set when the engine has not submitted yet: its submit then fails at once.
    pending_failure: tuple[FailureReason, str] | None = None


class SenderProtocol(_Side["_Outgoing"]):
    """The sending side of every transfer of one rank. See the module docstring."""

    def __init__(self, identity: LocalIdentity, timing: TimingConfig, num_layers: int) -> None:
        if num_layers < 1:
            raise LocalProtocolError(f"num_layers must be at least 1, got {num_layers}")
        self._me = identity
        self._timing = timing
        self._num_layers = num_layers
        self._clock = _Clock()
        self._transfers: dict[str, _Outgoing] = {}
        self._tombstones: dict[str, _Tombstone] = {}
        self._peers: dict[str, _Peer] = {}
        self._writes: dict[int, str] = {}
        self._next_write_id = 1
        self.ignored_messages = 0

    # ----- inspection (read-only; what statistics and tests read)

    def state_of(self, transfer_id: str) -> SenderState | None:
        rec = self._transfers.get(transfer_id)
        return rec.state if rec else None

    def held_blocks(self) -> dict[str, tuple[int, ...]]:
        return {t: r.blocks for t, r in self._transfers.items() if r.blocks is not None}

    def states(self) -> dict[str, SenderState]:
        return {t: r.state for t, r in self._transfers.items()}

    # ----- engine calls

    def submit(
        self,
        now: float,
        transfer_id: str,
        blocks: Sequence[int],
        ready_layers: Iterable[int] | None = None,
    ) -> list[Effect]:
        """Our blocks for `transfer_id`; `ready_layers=None`: all computed already."""
        now = self._clock.advance(now)
        ours = _check_blocks(blocks, f"submit({transfer_id!r})")
        layers = self._check_layers(transfer_id, ready_layers)
        rec = self._transfers.get(transfer_id)
        if rec is not None and rec.blocks is not None:
            raise LocalProtocolError(f"transfer {transfer_id!r} was already submitted")
        tomb = self._tombstones.get(transfer_id)
        if tomb is not None:
            if tomb.pending_failure is None:
                raise LocalProtocolError(f"transfer id {transfer_id!r} was already used")
            reason, detail = tomb.pending_failure
            tomb.pending_failure = None
            return [TransferEnded(transfer_id, "sender", reason, detail, ours)]
        if rec is None:
            rec = _Outgoing(
                transfer_id,
                SenderState.AWAITING_REGISTER,
                deadline=now + self._timing.transfer_deadline_s,
            )
            self._transfers[transfer_id] = rec
        rec.blocks = ours
        rec.ready_layers = layers
        if rec.register is None:
            return []
        rec.state = SenderState.WRITING
        return self._start(now, rec)

    def layers_ready(self, now: float, transfer_id: str, layers: Iterable[int]) -> list[Effect]:
        now = self._clock.advance(now)
        rec = self._transfers.get(transfer_id)
        new = self._check_layers(transfer_id, layers)
        if rec is None or rec.blocks is None:
            if transfer_id in self._tombstones:
                return []  # it already ended; the engine learns that from poll()
            raise LocalProtocolError(f"layers_ready: transfer {transfer_id!r} was not submitted")
        rec.ready_layers |= new
        if rec.state is SenderState.WRITING:
            return self._issue_writes(rec)
        return []

    def abort(
        self,
        now: float,
        transfer_id: str,
        reason: FailureReason = FailureReason.CANCELLED,
        detail: str = "aborted by the sending engine",
    ) -> list[Effect]:
        """End the transfer as failed. Unknown or already-ended ids are ignored."""
        now = self._clock.advance(now)
        rec = self._transfers.get(transfer_id)
        if rec is None or rec.blocks is None or rec.state is SenderState.ENDING:
            return []
        return self._fail(now, rec, reason, detail, Failed(transfer_id, reason, detail))

    def abort_with_peer(
        self, now: float, transfer_id: str, peer: str, reason: FailureReason, detail: str
    ) -> list[Effect]:
        """Fail `transfer_id` if `peer` is its receiver (the safe way: drain, then tell)."""
        now = self._clock.advance(now)
        rec = self._transfers.get(transfer_id)
        if rec is None or rec.peer != peer or rec.state is SenderState.ENDING:
            return []
        if rec.blocks is None:
            del self._transfers[transfer_id]
            self._bury(now, transfer_id, peer, None, (reason, detail))
            return []
        return self._fail(now, rec, reason, detail, Failed(transfer_id, reason, detail))

    # ----- peer and transport events

    def peer_ready(self, now: float, peer: str) -> list[Effect]:
        """The handshake back to `peer` succeeded: flush what waited for it."""
        now = self._clock.advance(now)
        p = self._peers.get(peer)
        if p is None or p.ready:
            return []
        p.ready = True
        p.last_heard = now
        out: list[Effect] = [SendMessage(peer, m) for m in p.outbox]
        p.outbox.clear()
        for rec in list(self._transfers.values()):
            if rec.peer == peer and rec.state is SenderState.WRITING:
                out += self._issue_writes(rec)
        return out

    def peer_unreachable(
        self, now: float, peer: str, reason: FailureReason, detail: str
    ) -> list[Effect]:
        """The handshake back to `peer` failed: its transfers fail, it is forgotten."""
        return self.peer_lost(now, peer, reason, detail)

    def _end_with_lost_peer(
        self, now: float, rec: _Outgoing, reason: FailureReason, detail: str
    ) -> list[Effect]:
        return self._abandon(now, rec, reason, detail)

    def write_done(self, now: float, write_id: int) -> list[Effect]:
        now = self._clock.advance(now)
        rec = self._pop_write(write_id)
        if rec is None:
            return []
        if rec.done_write == write_id:
            return self._done_delivered(now, rec)
        if rec.state is SenderState.ENDING:
            return self._end(now, rec) if not rec.inflight else []
        return self._maybe_done(now, rec)

    def write_failed(
        self, now: float, write_id: int, reason: FailureReason, detail: str
    ) -> list[Effect]:
        now = self._clock.advance(now)
        rec = self._pop_write(write_id)
        if rec is None:
            return []
        if rec.state is SenderState.ENDING:
            return self._end(now, rec) if not rec.inflight else []
        detail = f"write to {rec.peer} failed ({reason.value}): {detail}"
        failure = FailureReason.WRITE_ERROR
        return self._fail(now, rec, failure, detail, Failed(rec.transfer_id, failure, detail))

    # ----- messages (routed here by PushProtocol)

    def handle(self, now: float, peer: str, message: Message) -> list[Effect]:
        now = self._clock.advance(now)
        p = self._peers.get(peer)
        if p is not None:
            p.last_heard = now
        match message:
            case Register():
                return self._on_register(now, peer, message)
            case Cancel(transfer_id=tid, reason=reason, detail=detail):
                return self._on_cancel(now, peer, tid, reason, detail)
            case Reject(transfer_id=tid, detail=detail):
                return self._on_reject(now, peer, tid, detail)
            case Heartbeat(role="receiver", transfer_ids=ids):
                return self._on_heartbeat(now, peer, ids)
            case _:
                self.ignored_messages += 1
                return []

    def _on_register(self, now: float, peer: str, msg: Register) -> list[Effect]:
        tid = msg.transfer_id
        out = self._note_peer(now, peer, msg)
        tomb = self._tombstones.get(tid)
        if tomb is not None:
            if tomb.peer is None:  # it ended before any receiver registered: this one is it
                tomb.peer = peer
            if tomb.peer == peer:
                if tomb.reply is not None:
                    out += self._send(peer, tomb.reply)
            else:
                out += self._send(peer, self._id_taken(tid))
            return out
        if msg.protocol_version != PROTOCOL_VERSION:
            detail = (
                f"receiver speaks push protocol version {msg.protocol_version}, "
                f"we speak {PROTOCOL_VERSION}"
            )
            failure = FailureReason.INCOMPATIBLE_PEER
            return out + self._send(peer, Failed(tid, failure, detail))
        rec = self._transfers.get(tid)
        if rec is not None and rec.register is not None:
            if rec.peer == peer:
                rec.lease_until = max(rec.lease_until, now + self._timing.lease_s)
                return out  # a duplicate
            return out + self._send(peer, self._id_taken(tid))
        if rec is None:
            rec = _Outgoing(
                tid, SenderState.REGISTERED, deadline=now + self._timing.transfer_deadline_s
            )
            self._transfers[tid] = rec
        rec.register = msg
        rec.peer = peer
        rec.lease_until = now + self._timing.lease_s
        if rec.blocks is None:
            return out
        rec.state = SenderState.WRITING
        return out + self._start(now, rec)

    def _note_peer(self, now: float, peer: str, msg: Register) -> list[Effect]:
        """Learn `peer` from its Register; a new incarnation of a known engine ends the old."""
        out: list[Effect] = []
        for old in list(self._peers.values()):
            if old.engine_id == msg.receiver_engine_id and old.agent != peer:
                detail = (
                    f"receiver engine {msg.receiver_engine_id} restarted "
                    f"(incarnation {msg.receiver_incarnation}, agent {peer})"
                )
                out += self.peer_lost(now, old.agent, FailureReason.PEER_RESTARTED, detail)
        if peer not in self._peers:
            self._peers[peer] = _Peer(peer, msg.receiver_engine_id, last_heard=now, ready=False)
            out.append(Handshake(peer, msg.receiver_host, msg.receiver_port, msg.receiver_rank))
        return out

    def _on_cancel(
        self, now: float, peer: str, tid: str, reason: FailureReason, detail: str
    ) -> list[Effect]:
        rec = self._transfers.get(tid)
        why = f"receiver cancelled ({reason.value}): {detail}"
        if rec is not None and rec.peer is None:
            # Submitted, but its Register never arrived (lost): nothing was written.
            rec.peer = peer
            return self._fail(now, rec, FailureReason.CANCELLED, why, CancelAck(tid))
        if rec is not None and rec.peer == peer:
            if rec.blocks is None:  # registered, never submitted: nothing to drain
                del self._transfers[tid]
                self._bury(now, tid, peer, CancelAck(tid), (FailureReason.CANCELLED, why))
                return self._send(peer, CancelAck(tid))
            if rec.state is SenderState.ENDING:
                rec.reply = CancelAck(tid)  # the ack must wait for the drain too
                return []
            return self._fail(now, rec, FailureReason.CANCELLED, why, CancelAck(tid))
        tomb = self._tombstones.get(tid)
        if tomb is None and rec is None:
            # The Cancel overtook its Register (or the Register was lost): fence it here.
            self._bury(now, tid, peer, CancelAck(tid), (FailureReason.CANCELLED, why))
        elif tomb is None or tomb.peer != peer:
            self.ignored_messages += 1
            return []
        return self._send(peer, CancelAck(tid)) if peer in self._peers else []

    def _on_reject(self, now: float, peer: str, tid: str, detail: str) -> list[Effect]:
        rec = self._transfers.get(tid)
        why = f"receiver rejected the request: {detail}"
        failure = FailureReason.REJECTED
        if rec is None:
            if tid not in self._tombstones:
                self._bury(now, tid, peer, None, (failure, why))
            return []
        if rec.register is not None and rec.peer != peer:
            self.ignored_messages += 1
            return []
        if rec.state is SenderState.ENDING:
            return []
        if rec.blocks is None:
            del self._transfers[tid]
            self._bury(now, tid, peer, None, (failure, why))
            return []
        return self._fail(now, rec, failure, why, Failed(tid, failure, why))

    def _on_heartbeat(self, now: float, peer: str, ids: Sequence[str]) -> list[Effect]:
        out: list[Effect] = []
        for tid in ids:
            rec = self._transfers.get(tid)
            if rec is not None and rec.peer == peer:
                if rec.state is not SenderState.ENDING:
                    rec.lease_until = max(rec.lease_until, now + self._timing.lease_s)
                continue
            tomb = self._tombstones.get(tid)
            if tomb is not None and tomb.peer == peer and tomb.reply is not None:
                out += self._send(peer, tomb.reply)  # it missed our Done/Failed: again
        return out

    # ----- time

    def tick(self, now: float) -> list[Effect]:
        now = self._clock.advance(now)
        out: list[Effect] = []
        t = self._timing
        for p in list(self._peers.values()):
            live = [r for r in self._transfers.values() if r.peer == p.agent]
            if not live:
                continue
            if now - p.last_heard >= t.liveness_timeout_s:
                detail = f"receiver {p.agent} silent for {now - p.last_heard:.3f}s"
                out += self.peer_lost(now, p.agent, FailureReason.PEER_TIMEOUT, detail)
        for rec in list(self._transfers.values()):
            if rec.state is SenderState.ENDING:
                if now >= rec.drain_until:
                    rec.inflight.clear()
                    out += self._end(now, rec)
            elif now >= rec.deadline:
                detail = f"not finished within {t.transfer_deadline_s}s"
                out += self._timeout(now, rec, FailureReason.DEADLINE_EXCEEDED, detail)
            elif rec.peer is not None and now >= rec.lease_until:
                detail = f"lease of {t.lease_s}s not renewed by receiver {rec.peer}"
                out += self._timeout(now, rec, FailureReason.PEER_TIMEOUT, detail)
        # Oldest first: every tombstone lives the same time and `now` never goes back,
        # so insertion order is expiry order (`_bury` re-inserts). Scanning them all
        # each tick cost O(transfers of the last minute) and, at thousands of transfers
        # a second, most of the runtime thread's time.
        tombs = self._tombstones
        while tombs:
            oldest = next(iter(tombs))
            if now < tombs[oldest].expires:
                break
            del tombs[oldest]
        out += self._heartbeats(now)
        return out

    def next_deadline(self) -> float | None:
        """When `tick` next has something to do; None while nothing is in flight."""
        times: list[float] = []
        for rec in self._transfers.values():
            times += [rec.deadline, rec.lease_until, rec.drain_until]
        for p in self._peers.values():
            if any(r.peer == p.agent for r in self._transfers.values()):
                times.append(p.last_heard + self._timing.liveness_timeout_s)
                if p.ready:
                    times.append(p.last_heartbeat_sent + self._timing.heartbeat_interval_s)
        if self._tombstones and not times:
            times.append(min(t.expires for t in self._tombstones.values()))
        return min(times) if times else None

    def _timeout(
        self, now: float, rec: _Outgoing, reason: FailureReason, detail: str
    ) -> list[Effect]:
        if rec.blocks is None:  # a registration the engine never submitted
            del self._transfers[rec.transfer_id]
            self._bury(now, rec.transfer_id, rec.peer, Failed(rec.transfer_id, reason, detail))
            return self._send(rec.peer, Failed(rec.transfer_id, reason, detail)) if rec.peer else []
        return self._fail(now, rec, reason, detail, Failed(rec.transfer_id, reason, detail))

    def _heartbeats(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        for p in self._peers.values():
            ids = tuple(t for t, r in self._transfers.items() if r.peer == p.agent)
            if ids and p.ready and now >= p.last_heartbeat_sent + self._timing.heartbeat_interval_s:
                p.last_heartbeat_sent = now
                hb = Heartbeat("sender", self._me.engine_id, self._me.incarnation, ids)
                out.append(SendMessage(p.agent, hb))
        return out

    # ----- transitions

    def _start(self, now: float, rec: _Outgoing) -> list[Effect]:
        """Both sides known: check the mapping, then write (or finish on a full hit)."""
        assert rec.blocks is not None and rec.register is not None and rec.peer is not None
        reg = rec.register
        if reg.sender_offset + len(reg.block_ids) != len(rec.blocks):
            detail = (
                f"receiver registered {len(reg.block_ids)} blocks at offset "
                f"{reg.sender_offset}, but the sender has {len(rec.blocks)} blocks: expected "
                f"offset + registered blocks = {len(rec.blocks)}"
            )
            failure = FailureReason.MALFORMED_MESSAGE
            return self._fail(now, rec, failure, detail, Failed(rec.transfer_id, failure, detail))
        if not reg.block_ids:
            return self._maybe_done(now, rec)
        return self._issue_writes(rec)

    def _issue_writes(self, rec: _Outgoing) -> list[Effect]:
        assert rec.blocks is not None and rec.register is not None and rec.peer is not None
        p = self._peers.get(rec.peer)
        if p is None or not p.ready or not rec.register.block_ids:
            return []
        new = rec.ready_layers - rec.issued_layers
        if not new:
            return []
        all_now = not rec.issued_layers and len(new) == self._num_layers
        rec.issued_layers |= new
        wid = self._next_write_id
        self._next_write_id += 1
        self._writes[wid] = rec.transfer_id
        # The last write carries Done, which the data plane delivers after its bytes: no
        # round trip after the data. Only when no other write of the transfer is in
        # flight, though (Done promises that nothing more will land): else Done goes
        # alone once the last WriteDone is in (`_maybe_done`).
        done: Done | None = None
        if not rec.inflight and len(rec.issued_layers) == self._num_layers:
            done = Done(rec.transfer_id, len(rec.register.block_ids))
            rec.done_write = wid
        rec.inflight.add(wid)
        off = rec.register.sender_offset
        return [
            WriteBlocks(
                rec.peer,
                rec.transfer_id,
                wid,
                rec.blocks[off:],
                rec.register.block_ids,
                None if all_now else tuple(sorted(new)),
                done,
            )
        ]

    def _maybe_done(self, now: float, rec: _Outgoing) -> list[Effect]:
        assert rec.register is not None and rec.peer is not None and rec.blocks is not None
        written_all = len(rec.issued_layers) == self._num_layers or not rec.register.block_ids
        if rec.inflight or not written_all:
            return []
        done = Done(rec.transfer_id, len(rec.register.block_ids))
        del self._transfers[rec.transfer_id]
        self._bury(now, rec.transfer_id, rec.peer, done)
        return [
            *self._send(rec.peer, done),
            TransferEnded(rec.transfer_id, "sender", None, "", rec.blocks),
        ]

    def _done_delivered(self, now: float, rec: _Outgoing) -> list[Effect]:
        """The write carrying our Done landed, so the receiver has its Done: the transfer
        finished, even if it was ending (an engine abort or a timeout that came too late
        to stop the write). Only a receiver that cancelled meanwhile ends it as failed:
        it is fencing and reports its own reason, so we report that one too."""
        assert rec.register is not None and rec.peer is not None and rec.blocks is not None
        done = Done(rec.transfer_id, len(rec.register.block_ids))
        if rec.state is SenderState.ENDING and isinstance(rec.reply, CancelAck):
            return self._end(now, rec)
        del self._transfers[rec.transfer_id]
        self._bury(now, rec.transfer_id, rec.peer, done)
        return [TransferEnded(rec.transfer_id, "sender", None, "", rec.blocks)]

    def _fail(
        self, now: float, rec: _Outgoing, reason: FailureReason, detail: str, reply: Message
    ) -> list[Effect]:
        """End as failed once no write is in flight; `reply` tells the receiver."""
        rec.state = SenderState.ENDING
        rec.reason, rec.detail, rec.reply = reason, detail, reply
        if rec.inflight:
            rec.drain_until = now + self._timing.liveness_timeout_s
            return []
        return self._end(now, rec)

    def _end(self, now: float, rec: _Outgoing) -> list[Effect]:
        assert rec.reason is not None and rec.blocks is not None
        del self._transfers[rec.transfer_id]
        for wid in rec.inflight:  # only after a drain timeout: their events are ignored
            self._writes.pop(wid, None)
        self._bury(now, rec.transfer_id, rec.peer, rec.reply)
        out: list[Effect] = []
        if rec.peer is not None and rec.reply is not None:
            out += self._send(rec.peer, rec.reply)
        out.append(TransferEnded(rec.transfer_id, "sender", rec.reason, rec.detail, rec.blocks))
        return out

    def _abandon(
        self, now: float, rec: _Outgoing, reason: FailureReason, detail: str
    ) -> list[Effect]:
        """The peer is gone: end at once, tell nobody; its write events are ignored."""
        del self._transfers[rec.transfer_id]
        for wid in rec.inflight:
            self._writes.pop(wid, None)
        if rec.blocks is None:
            self._bury(now, rec.transfer_id, rec.peer, None, (reason, detail))
            return []
        self._bury(now, rec.transfer_id, rec.peer, None)
        if rec.state is SenderState.ENDING and rec.reason is not None:
            reason, detail = rec.reason, rec.detail
        return [TransferEnded(rec.transfer_id, "sender", reason, detail, rec.blocks)]

    # ----- helpers

    def _check_layers(self, tid: str, layers: Iterable[int] | None) -> set[int]:
        if layers is None:
            return set(range(self._num_layers))
        out = set(layers)
        bad = [x for x in out if not isinstance(x, int) or not 0 <= x < self._num_layers]
        if bad:
            raise LocalProtocolError(
                f"transfer {tid!r}: layers {sorted(map(str, bad))} out of range: "
                f"expected 0..{self._num_layers - 1}"
            )
        return out

    def _pop_write(self, write_id: int) -> _Outgoing | None:
        tid = self._writes.pop(write_id, None)
        rec = self._transfers.get(tid) if tid is not None else None
        if rec is not None:
            rec.inflight.discard(write_id)
        return rec

    def _send(self, peer: str, message: Message) -> list[Effect]:
        p = self._peers.get(peer)
        if p is None:
            return []
        if not p.ready:
            p.outbox.append(message)
            return []
        return [SendMessage(peer, message)]

    def _bury(
        self,
        now: float,
        tid: str,
        peer: str | None,
        reply: Message | None,
        pending_failure: tuple[FailureReason, str] | None = None,
    ) -> None:
        keep = self._timing.transfer_deadline_s + self._timing.lease_s
        self._tombstones.pop(tid, None)  # keep insertion order = expiry order
        self._tombstones[tid] = _Tombstone(peer, reply, now + keep, pending_failure)

    @staticmethod
    def _id_taken(tid: str) -> Failed:
        detail = f"transfer id {tid!r} is already in use by another receiver"
        return Failed(tid, FailureReason.MALFORMED_MESSAGE, detail)


# --------------------------------------------------------------------------- receiver


class ReceiverState(enum.StrEnum):
    WAITING = "waiting"  # registered; blocks may be written any time
    FENCING = "fencing"  # given up; blocks kept until the sender confirms or its lease ran out


@dataclass(slots=True)
class _Incoming:
    transfer_id: str
    peer: str
    blocks: tuple[int, ...]
    register: Register
    deadline: float
    register_sent_at: float
    heard_before: int  # the peer's `messages_heard` when the Register went out
    first_attempt: bool = True
    state: ReceiverState = ReceiverState.WAITING
    reason: FailureReason | None = None
    detail: str = ""
    fence_until: float = float("inf")
    cancel_sent_at: float = float("-inf")


class ReceiverProtocol(_Side["_Incoming"]):
    """The receiving side of every transfer of one rank. See the module docstring."""

    def __init__(self, identity: LocalIdentity, timing: TimingConfig) -> None:
        self._me = identity
        self._timing = timing
        self._clock = _Clock()
        self._transfers: dict[str, _Incoming] = {}
        self._ended: dict[str, float] = {}  # transfer id -> forget after
        self._peers: dict[str, _Peer] = {}
        self.ignored_messages = 0

    @property
    def fence_s(self) -> float:
        """How long blocks stay fenced when the sender never confirms."""
        return self._timing.lease_s + 2 * self._timing.liveness_timeout_s

    def state_of(self, transfer_id: str) -> ReceiverState | None:
        rec = self._transfers.get(transfer_id)
        return rec.state if rec else None

    def held_blocks(self) -> dict[str, tuple[int, ...]]:
        return {t: r.blocks for t, r in self._transfers.items()}

    def states(self) -> dict[str, ReceiverState]:
        return {t: r.state for t, r in self._transfers.items()}

    # ----- engine calls

    def expect(
        self,
        now: float,
        transfer_id: str,
        peer: str,
        peer_engine_id: str,
        blocks: Sequence[int],
        *,
        sender_offset: int = 0,
        first_attempt: bool = True,
    ) -> list[Effect]:
        """Register our `blocks` for the sender's blocks from `sender_offset` on.

        `peer` must have been handshaken (loaded on the data plane) already.
        `first_attempt=False`: this is the one retry after `withdraw`; it cannot be
        withdrawn again.
        """
        now = self._clock.advance(now)
        ours = _check_blocks(blocks, f"expect({transfer_id!r})")
        if not transfer_id:
            raise LocalProtocolError("transfer id must be a non-empty string")
        if isinstance(sender_offset, bool) or not isinstance(sender_offset, int):
            raise LocalProtocolError(f"sender_offset must be an int, got {sender_offset!r}")
        if sender_offset < 0:
            raise LocalProtocolError(f"sender_offset must be >= 0, got {sender_offset}")
        if transfer_id in self._transfers or transfer_id in self._ended:
            raise LocalProtocolError(f"transfer id {transfer_id!r} was already used")
        out: list[Effect] = []
        for old in list(self._peers.values()):
            if old.engine_id == peer_engine_id and old.agent != peer:
                detail = f"sender engine {peer_engine_id} restarted (new agent {peer})"
                out += self.peer_lost(now, old.agent, FailureReason.PEER_RESTARTED, detail)
        p = self._peers.get(peer)
        if p is None:
            p = self._peers[peer] = _Peer(peer, peer_engine_id, last_heard=now)
        elif not any(r.peer == peer for r in self._transfers.values()):
            p.last_heard = now  # idle until now: its silence so far says nothing
        me = self._me
        reg = Register(
            transfer_id,
            me.engine_id,
            me.incarnation,
            me.host,
            me.port,
            me.rank,
            ours,
            sender_offset,
        )
        self._transfers[transfer_id] = _Incoming(
            transfer_id,
            peer,
            ours,
            reg,
            deadline=now + self._timing.transfer_deadline_s,
            register_sent_at=now,
            heard_before=p.messages_heard,
            first_attempt=first_attempt,
        )
        out.append(SendMessage(peer, reg))
        return out

    def withdraw(self, now: float, transfer_id: str) -> bool:
        """Take back a first Register that certainly reached no live sender, so that the
        caller can handshake afresh and `expect` the transfer again (once).

        The caller knows the Register's own send failed: the data plane lost the peer in
        the same pass that sent it (a sender restarted at the same address faster than
        metadata is revalidated). Withdrawn only if nothing at all was heard from the peer
        since the Register went out and the transfer is still waiting: then no byte of
        it can have been written. Returns False, changing nothing, otherwise; the caller
        then ends it as usual (`peer_lost`). Nothing is reported for a withdrawn transfer.
        """
        self._clock.advance(now)
        rec = self._transfers.get(transfer_id)
        if rec is None or not rec.first_attempt or rec.state is not ReceiverState.WAITING:
            return False
        p = self._peers.get(rec.peer)
        if p is None or p.messages_heard != rec.heard_before:
            return False
        del self._transfers[transfer_id]
        return True

    def reject(self, now: float, transfer_id: str, peer: str, detail: str) -> list[Effect]:
        """Refuse a request before allocating: the sender frees its blocks at once."""
        self._clock.advance(now)
        return [SendMessage(peer, Reject(transfer_id, detail))]

    def abort(
        self,
        now: float,
        transfer_id: str,
        reason: FailureReason = FailureReason.CANCELLED,
        detail: str = "aborted by the receiving engine",
    ) -> list[Effect]:
        now = self._clock.advance(now)
        rec = self._transfers.get(transfer_id)
        if rec is None or rec.state is ReceiverState.FENCING:
            return []
        return self._fence(now, rec, reason, detail)

    def abort_with_peer(
        self, now: float, transfer_id: str, peer: str, reason: FailureReason, detail: str
    ) -> list[Effect]:
        rec = self._transfers.get(transfer_id)
        if rec is None or rec.peer != peer:
            return []
        return self.abort(now, transfer_id, reason, detail)

    # ----- events

    def _end_with_lost_peer(
        self, now: float, rec: _Incoming, reason: FailureReason, detail: str
    ) -> list[Effect]:
        return self._end(now, rec, reason, detail)

    def handle(self, now: float, peer: str, message: Message) -> list[Effect]:
        now = self._clock.advance(now)
        p = self._peers.get(peer)
        if p is not None:
            p.last_heard = now
        self.heard_from(peer)
        match message:
            case Heartbeat(role="sender", transfer_ids=ids):
                if p is not None:
                    p.known_by_them = frozenset(ids)
                return self._resend_registers(now, peer)
            case Done(transfer_id=tid) | Failed(transfer_id=tid) | CancelAck(transfer_id=tid):
                rec = self._transfers.get(tid)
                if rec is None or rec.peer != peer:
                    self.ignored_messages += 1
                    return []
                return self._on_sender_final(now, rec, message)
            case _:
                self.ignored_messages += 1
                return []

    def heard_from(self, peer: str) -> None:
        """`peer` sent us something (for either machine, decodable or not): it was alive
        after our Registers to it went out, so none of them can be withdrawn."""
        p = self._peers.get(peer)
        if p is not None:
            p.messages_heard += 1

    def _on_sender_final(self, now: float, rec: _Incoming, message: Message) -> list[Effect]:
        # Each of these promises that no write for the transfer is or will be in flight.
        if rec.state is ReceiverState.FENCING:
            assert rec.reason is not None
            return self._end(now, rec, rec.reason, rec.detail)
        match message:
            case Done(num_blocks=n) if n == len(rec.blocks):
                return self._end(now, rec, None, "")
            case Done(num_blocks=n):
                detail = f"sender wrote {n} blocks, we registered {len(rec.blocks)}"
                return self._end(now, rec, FailureReason.MALFORMED_MESSAGE, detail)
            case Failed(reason=reason, detail=detail):
                return self._end(now, rec, reason, f"sender failed: {detail}")
            case _:
                detail = "sender acknowledged a cancel we never sent"
                return self._end(now, rec, FailureReason.MALFORMED_MESSAGE, detail)

    def tick(self, now: float) -> list[Effect]:
        now = self._clock.advance(now)
        t = self._timing
        out: list[Effect] = []
        for p in list(self._peers.values()):
            live = [r for r in self._transfers.values() if r.peer == p.agent]
            if live and now - p.last_heard >= t.liveness_timeout_s:
                detail = f"sender {p.agent} silent for {now - p.last_heard:.3f}s"
                for rec in live:
                    if rec.state is ReceiverState.WAITING:
                        out += self._fence(now, rec, FailureReason.PEER_TIMEOUT, detail)
                del self._peers[p.agent]
                out.append(DropPeer(p.agent, FailureReason.PEER_TIMEOUT, detail))
        for rec in list(self._transfers.values()):
            if rec.state is ReceiverState.WAITING and now >= rec.deadline:
                detail = f"not finished within {t.transfer_deadline_s}s"
                out += self._fence(now, rec, FailureReason.DEADLINE_EXCEEDED, detail)
            elif rec.state is ReceiverState.FENCING:
                assert rec.reason is not None
                if now >= rec.fence_until:
                    out += self._end(now, rec, rec.reason, rec.detail)
                elif rec.peer in self._peers and now >= rec.cancel_sent_at + t.heartbeat_interval_s:
                    rec.cancel_sent_at = now
                    out.append(
                        SendMessage(rec.peer, Cancel(rec.transfer_id, rec.reason, rec.detail))
                    )
        ended = self._ended  # oldest first, as the sender's tombstones
        while ended:
            oldest = next(iter(ended))
            if now < ended[oldest]:
                break
            del ended[oldest]
        for p in self._peers.values():
            out += self._resend_registers(now, p.agent)
            live = [r for r in self._transfers.values() if r.peer == p.agent]
            if live and now >= p.last_heartbeat_sent + t.heartbeat_interval_s:
                p.last_heartbeat_sent = now
                ids = tuple(r.transfer_id for r in live if r.state is ReceiverState.WAITING)
                out.append(
                    SendMessage(
                        p.agent,
                        Heartbeat("receiver", self._me.engine_id, self._me.incarnation, ids),
                    )
                )
        return out

    def next_deadline(self) -> float | None:
        t = self._timing
        times: list[float] = []
        for rec in self._transfers.values():
            if rec.state is ReceiverState.WAITING:
                times += [rec.deadline, rec.register_sent_at + t.heartbeat_interval_s]
            else:
                times += [rec.fence_until, rec.cancel_sent_at + t.heartbeat_interval_s]
        for p in self._peers.values():
            if any(r.peer == p.agent for r in self._transfers.values()):
                times.append(p.last_heard + t.liveness_timeout_s)
                times.append(p.last_heartbeat_sent + t.heartbeat_interval_s)
        if self._ended and not times:
            times.append(min(self._ended.values()))
        return min(times) if times else None

    # ----- transitions

    def _resend_registers(self, now: float, peer: str) -> list[Effect]:
        """Registrations the sender does not list (lost, or not there yet) go again."""
        p = self._peers.get(peer)
        if p is None:
            return []
        known = p.known_by_them or frozenset()
        out: list[Effect] = []
        for rec in self._transfers.values():
            if (
                rec.peer == peer
                and rec.state is ReceiverState.WAITING
                and rec.transfer_id not in known
                and now >= rec.register_sent_at + self._timing.heartbeat_interval_s
            ):
                rec.register_sent_at = now
                out.append(SendMessage(peer, rec.register))
        return out

    def _fence(
        self, now: float, rec: _Incoming, reason: FailureReason, detail: str
    ) -> list[Effect]:
        rec.state = ReceiverState.FENCING
        rec.reason, rec.detail = reason, detail
        rec.fence_until = now + self.fence_s
        rec.cancel_sent_at = now
        if rec.peer not in self._peers:
            return []
        return [SendMessage(rec.peer, Cancel(rec.transfer_id, reason, detail))]

    def _end(
        self, now: float, rec: _Incoming, reason: FailureReason | None, detail: str
    ) -> list[Effect]:
        del self._transfers[rec.transfer_id]
        self._ended.pop(rec.transfer_id, None)  # keep insertion order = expiry order
        self._ended[rec.transfer_id] = now + self._timing.transfer_deadline_s + self.fence_s
        return [TransferEnded(rec.transfer_id, "receiver", reason, detail, rec.blocks)]


# --------------------------------------------------------------------------- both


class PushProtocol:
    """Both sides of one rank, and the one inbound entry point for wire bytes."""

    def __init__(self, identity: LocalIdentity, timing: TimingConfig, num_layers: int) -> None:
        self.identity = identity
        self.sender = SenderProtocol(identity, timing, num_layers)
        self.receiver = ReceiverProtocol(identity, timing)

    def receive_message(self, now: float, peer: str, payload: bytes) -> list[Effect]:
        """Decode and route one message. Raises `RemoteProtocolError` (nothing changed)
        when the bytes are not a message; the caller then calls `peer_misbehaved`."""
        try:
            message = decode(payload)
        except RemoteProtocolError:
            self.receiver.heard_from(peer)
            raise
        match message:
            case Register() | Cancel() | Reject() | Heartbeat(role="receiver"):
                self.receiver.heard_from(peer)
                return self.sender.handle(now, peer, message)
            case _:
                return self.receiver.handle(now, peer, message)

    def peer_misbehaved(self, now: float, peer: str, detail: str) -> list[Effect]:
        """`peer` sent garbage: everything with it fails (MALFORMED_MESSAGE), safely."""
        out: list[Effect] = []
        reason = FailureReason.MALFORMED_MESSAGE
        for tid in list(self.sender.states()):
            out += self.sender.abort_with_peer(now, tid, peer, reason, detail)
        for tid in list(self.receiver.states()):
            out += self.receiver.abort_with_peer(now, tid, peer, reason, detail)
        return out

    def peer_lost(self, now: float, peer: str, reason: FailureReason, detail: str) -> list[Effect]:
        return self.sender.peer_lost(now, peer, reason, detail) + self.receiver.peer_lost(
            now, peer, reason, detail
        )

    def tick(self, now: float) -> list[Effect]:
        return self.sender.tick(now) + self.receiver.tick(now)

    def in_flight(self) -> bool:
        return self.sender.in_flight() or self.receiver.in_flight()

    def next_deadline(self) -> float | None:
        times = [
            t for t in (self.sender.next_deadline(), self.receiver.next_deadline()) if t is not None
        ]
        return min(times) if times else None


__all__ = [
    "DropPeer",
    "Effect",
    "Handshake",
    "LocalIdentity",
    "PushProtocol",
    "ReceiverProtocol",
    "ReceiverState",
    "RemoteProtocolError",
    "SendMessage",
    "SenderProtocol",
    "SenderState",
    "Side",
    "TransferEnded",
    "WriteBlocks",
]
