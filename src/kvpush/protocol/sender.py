"""The sending side's state machine (`SenderProtocol`). The theory of operation, every
rule this file follows, is in `kvpush.protocol.state`."""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvpush.config import STRICT_COMPATIBILITY, CompatibilityPolicy, TimingConfig
from kvpush.errors import (
    FailureReason,
    LocalProtocolError,
)
from kvpush.geometry import PROTOCOL_VERSION
from kvpush.protocol._common import (
    Effect,
    Handshake,
    LocalIdentity,
    PeerAddress,
    PeerInfo,
    SendMessage,
    TransferEnded,
    WriteBlocks,
    _check_blocks,
    _Clock,
    _Compatibility,
    _Peer,
    _Side,
)
from kvpush.protocol.messages import (
    Cancel,
    CancelAck,
    Done,
    Failed,
    Heartbeat,
    Message,
    Register,
    Reject,
)

# How many messages an agent may send before a side channel vouched for it (a real
# receiver sends a Register or Reject or two, and a heartbeat, in that time); the rest
# are dropped and counted. And how many early Cancels are remembered at once.
_MAX_UNREAD = 64
_MAX_EARLY_CANCELS = 65536


def _named_address(message: Message) -> PeerAddress | None:
    """The side channel a message names as its sender's (Register, and Reject from a
    peer that fills it in), to ask whether it vouches for the agent that sent it."""
    match message:
        case Register(receiver_host=host, receiver_port=port, receiver_rank=rank):
            return PeerAddress(host, port, rank)
        case Reject(receiver_host=host, receiver_port=port, receiver_rank=rank) if host:
            return PeerAddress(host, port, rank)
    return None


def _claims(p: _Peer, message: Message) -> bool:
    """Whether what `message` says about its sender is what `p`'s side channel said."""
    match message:
        case Register(receiver_engine_id=engine, receiver_incarnation=inc):
            return (engine, inc, _named_address(message)) == (
                p.engine_id,
                p.incarnation,
                p.address,
            )
        case Reject(receiver_engine_id=engine, receiver_incarnation=inc, receiver_host=host):
            if not host:
                return True
            return (engine, inc, _named_address(message)) == (
                p.engine_id,
                p.incarnation,
                p.address,
            )
        case Heartbeat(engine_id=engine, incarnation=inc):
            return (engine, inc) == (p.engine_id, p.incarnation)
    return True


# --------------------------------------------------------------------------- sender


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
    # The lease runs out at this time of the *receiver's* clock (see the module docstring).
    lease_until_theirs: float = float("-inf")
    inflight: set[int] = field(default_factory=set)
    reason: FailureReason | None = None
    detail: str = ""
    reply: Message | None = None
    done_write: int | None = None  # the write that carries our Done as its notification
    # The lease looked over on a bound of the receiver's clock measured before it did:
    # (our clock when we asked for a fresh bound, why it looked over, a Register's?).
    recheck: tuple[float, str, bool] | None = None


@dataclass(slots=True)
class _Tombstone:
    peer: str | None
    reply: Message | None  # what a late Register/Cancel/heartbeat gets
    expires: float
    # Set when the engine has not submitted yet: its submit then fails at once.
    pending_failure: tuple[FailureReason, str] | None = None


class SenderProtocol(_Side["_Outgoing"]):
    """The sending side of every transfer of one rank. See the module docstring."""

    def __init__(
        self,
        identity: LocalIdentity,
        timing: TimingConfig,
        num_layers: int,
        compat: Mapping[str, object],
        *,
        compatibility: CompatibilityPolicy = STRICT_COMPATIBILITY,
    ) -> None:
        if num_layers < 1:
            raise LocalProtocolError(f"num_layers must be at least 1, got {num_layers}")
        self._me = identity
        self._timing = timing
        self._num_layers = num_layers
        self._compat = _Compatibility(compat, compatibility)
        self._clock = _Clock()
        self._transfers: dict[str, _Outgoing] = {}
        self._tombstones: dict[str, _Tombstone] = {}
        self._peers: dict[str, _Peer] = {}
        self._writes: dict[int, str] = {}
        self._next_write_id = 1
        self.ignored_messages = 0
        self.stale_registers = 0  # Registers refused because their lease had run out
        # Ids whose `recheck` waits for a fresh echo, in order (a dict: deterministic).
        self._rechecking: dict[str, None] = {}
        self.forged = collections.Counter()
        # (agent, transfer id) -> forget after: a Cancel from that agent for an id it had
        # not registered (yet). It ends that agent's Register for the id, nobody else's.
        self._early_cancels: dict[tuple[str, str], float] = {}
        self._tombstone_s = timing.transfer_deadline_s + timing.lease_s

    # ----- inspection (read-only; what statistics and tests read)

    def state_of(self, transfer_id: str) -> SenderState | None:
        rec = self._transfers.get(transfer_id)
        return rec.state if rec else None

    def held_blocks(self) -> dict[str, tuple[int, ...]]:
        return {t: r.blocks for t, r in self._transfers.items() if r.blocks is not None}

    def states(self) -> dict[str, SenderState]:
        return {t: r.state for t, r in self._transfers.items()}

    def writes_in_flight(self) -> int:
        """Writes issued whose outcome the data plane has not reported yet."""
        return len(self._writes)

    def lease_expires_at(self, transfer_id: str) -> float | None:
        """When, on our clock, the transfer's lease certainly runs out; None while the
        receiver's clock is not bounded yet (or the transfer is unknown or unregistered)."""
        rec = self._transfers.get(transfer_id)
        if rec is None or rec.peer is None:
            return None
        p = self._peers.get(rec.peer)
        if p is None or p.skew_lb is None:
            return None
        return rec.lease_until_theirs + p.skew_lb

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
        ours = _check_blocks(blocks, "submit", transfer_id)
        layers = self._check_layers(transfer_id, ready_layers)
        rec = self._transfers.get(transfer_id)
        if rec is not None and rec.blocks is not None:
            raise LocalProtocolError(f"transfer {transfer_id!r} was already submitted")
        tomb = self._tombstones.get(transfer_id)
        if tomb is not None:
            if tomb.pending_failure is None:
                # The engine cannot know how long ended ids are remembered: an outcome.
                detail = (
                    f"transfer id {transfer_id!r} was already used by a transfer that ended "
                    f"less than {self._tombstone_s}s ago: use a new id per transfer"
                )
                return [
                    TransferEnded(transfer_id, "sender", FailureReason.LOCAL_ERROR, detail, ours)
                ]
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
            return self._issue_writes(now, rec)
        return []

    def abort(
        self,
        now: float,
        transfer_id: str,
        reason: FailureReason = FailureReason.CANCELLED,
        detail: str = "aborted by the sending engine",
    ) -> list[Effect]:
        """End the transfer as failed (after its writes drained). Unknown or already-ended
        ids are ignored."""
        now = self._clock.advance(now)
        rec = self._transfers.get(transfer_id)
        if rec is None or rec.blocks is None or rec.state is SenderState.ENDING:
            return []
        return self._fail(now, rec, reason, detail, Failed(transfer_id, reason, detail))

    def refuse(self, now: float, transfer_id: str, detail: str) -> list[Effect]:
        """Refuse a registration our engine will never submit (it names a request that
        is not ours to send, such as another prompt's): the receiver is told at once
        (`Failed(REJECTED)`), and a later `submit` of the id ends with that failure.
        Ignored unless the transfer is registered and not submitted (nothing to drain,
        nothing reported here: the engine never handed it in)."""
        now = self._clock.advance(now)
        rec = self._transfers.get(transfer_id)
        if rec is None or rec.blocks is not None or rec.peer is None:
            return []
        failure = FailureReason.REJECTED
        why = f"sender refused the registration: {detail}"
        del self._transfers[transfer_id]
        reply = Failed(transfer_id, failure, why)
        self._bury(now, transfer_id, rec.peer, reply, (failure, why))
        return self._send(rec.peer, reply)

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

    def shutdown(self, now: float, reason: FailureReason, detail: str) -> list[Effect]:
        """End every transfer at once, as `reason`, and forget every peer.

        Only for a runtime whose data plane can no longer read our memory (its transport
        is closed): a write still in flight would otherwise read blocks handed back here.
        A runtime that can still drain aborts its transfers first (`abort`)."""
        now = self._clock.advance(now)
        out: list[Effect] = []
        for rec in list(self._transfers.values()):
            if rec.blocks is not None:
                if rec.state is SenderState.ENDING and rec.reason is not None:
                    why, what = rec.reason, rec.detail
                else:
                    why, what = reason, detail
                out.append(TransferEnded(rec.transfer_id, "sender", why, what, rec.blocks))
        self._transfers.clear()
        self._writes.clear()
        self._peers.clear()
        return out

    # ----- handshakes back, peer and transport events

    def handshake_done(self, now: float, address: PeerAddress, info: PeerInfo) -> list[Effect]:
        """The side channel at `address` answered with `info`.

        An agent vouched for there before and not named now restarted (PEER_RESTARTED).
        An agent waiting there (its messages unread in its inbox) is believed if it is
        the one named, and its messages are read; any other is an impostor, and its
        messages are dropped and counted. A believed one whose engine another address
        was vouched for first waits until that address is looked up again. A believed
        one with an incompatible cache is refused (INCOMPATIBLE_PEER); else it is ready
        for writes."""
        now = self._clock.advance(now)
        out = self._restarted(now, address, info)
        problem = self._compat.problem(info.compat)
        for p in list(self._peers.values()):
            if p.rival is None or p.rival[0] != address:
                continue
            if info.agent == p.rival[1]:
                detail = (
                    f"agent {p.agent} claims engine {p.engine_id}, which its side channel "
                    f"at {address} still serves as agent {info.agent}"
                )
                # Its own side channel named it, so the runtime loaded it: unload it.
                out += self._refuse(now, p, "impostor", detail, loaded=True)
            else:  # that address now serves another agent: the one it vouched for is gone
                p.rival = None
                out += self._verified(now, p)
        for p in [p for p in self._peers.values() if p.address == address and not p.verified]:
            if p.rival is not None:
                continue
            if p.agent != info.agent:
                detail = f"the side channel at {address} serves agent {info.agent}, not {p.agent}"
                out += self._refuse(now, p, "impostor", detail)
                continue
            p.engine_id, p.incarnation = info.engine_id, info.incarnation
            rival = next(
                (
                    q
                    for q in self._peers.values()
                    if q.verified
                    and q.engine_id == info.engine_id
                    and q.address is not None
                    and q.address != address
                ),
                None,
            )
            if problem is None and rival is not None and rival.address is not None:
                # Two addresses claim one engine: the one that vouched first is asked
                # again, and believed if it still serves its agent.
                p.rival = (rival.address, rival.agent)
                out.append(Handshake(rival.address, rival.agent, revalidate=True))
                continue
            if problem is not None:
                out += self._incompatible(now, p, address, info, problem)
            else:
                out += self._verified(now, p)
        return out

    def handshake_failed(
        self, now: float, address: PeerAddress, reason: FailureReason, detail: str
    ) -> list[Effect]:
        """The lookup of `address` failed: the agents waiting for it are not believed
        (their messages are dropped and counted; nothing was bound to them). An agent
        waiting for a second look at a rival's address is believed: that address no
        longer vouches for the rival."""
        now = self._clock.advance(now)
        out: list[Effect] = []
        for p in list(self._peers.values()):
            if p.rival is not None and p.rival[0] == address:
                p.rival = None
                out += self._verified(now, p)
        for p in [p for p in self._peers.values() if p.address == address and not p.verified]:
            if p.rival is None:
                why = f"the side channel at {address} could not vouch for it: {detail}"
                out += self._refuse(now, p, "unverified", why)
        return out

    def _refuse(
        self, now: float, p: _Peer, reason: str, detail: str, *, loaded: bool = False
    ) -> list[Effect]:
        """`p` is not who its messages said: drop them unread, and forget it (nothing
        was bound to it). `DropPeer` only if `loaded` (a side channel named this very
        agent, so the runtime loaded it): else the runtime never loaded that name, and
        the name may be a real peer's, borrowed, which must stay loaded."""
        self._drop(reason, len(p.inbox))
        p.inbox.clear()
        if loaded:
            return self.peer_lost(now, p.agent, FailureReason.UNKNOWN_PEER, detail)
        del self._peers[p.agent]
        return []

    def _read_inbox(self, now: float, p: _Peer) -> list[Effect]:
        """Read what a peer just vouched for sent meanwhile, in order; what waited longer
        than `liveness_timeout_s` is dropped (a live receiver sends its Registers again
        every heartbeat interval until we list them, so nothing is lost, and a message
        that old may speak for a transfer its sender gave up since)."""
        p.verified = True
        out: list[Effect] = []
        inbox, p.inbox = p.inbox, []
        for at, m in inbox:
            if self._too_old_to_read(now, at):
                self.ignored_messages += 1
            else:
                out += self.handle(now, p.agent, m)
        return out

    def _too_old_to_read(self, now: float, arrived: float) -> bool:
        return now - arrived > self._timing.liveness_timeout_s

    def _verified(self, now: float, p: _Peer) -> list[Effect]:
        """The side channel vouched for `p`: read what it sent meanwhile, then write."""
        out = self._read_inbox(now, p)
        if p.agent in self._peers:
            out += self._peer_ready(now, p)
        return out

    def _incompatible(
        self, now: float, p: _Peer, address: PeerAddress, info: PeerInfo, problem: str
    ) -> list[Effect]:
        # Nothing was written (writes wait for the handshake): read what it sent (writes
        # still wait), then say why with a Failed per transfer, so the receiver gives its
        # blocks back now, not at its deadline.
        out = self._read_inbox(now, p)
        failure = FailureReason.INCOMPATIBLE_PEER
        view = f"sender refused our KV cache: {self._compat.their_view(info.compat)}"
        for rec in [r for r in self._transfers.values() if r.peer == p.agent]:
            out.append(SendMessage(p.agent, Failed(rec.transfer_id, failure, view)))
        detail = f"receiver at {address}: {problem}"
        return out + self.peer_lost(now, p.agent, failure, detail)

    def _peer_ready(self, now: float, p: _Peer) -> list[Effect]:
        p.ready = True
        p.last_heard = now
        out: list[Effect] = [SendMessage(p.agent, m) for m in p.outbox]
        p.outbox.clear()
        # At once, not at the next interval: its echo bounds the receiver's clock, and
        # no write starts before that (first contact only; the bound is kept).
        out += self._heartbeat(now, p, force=True)
        out += self._issue_for_peer(now, p.agent)
        return out

    def _issue_for_peer(self, now: float, peer: str) -> list[Effect]:
        out: list[Effect] = []
        for rec in list(self._transfers.values()):
            if rec.peer == peer and rec.state is SenderState.WRITING:
                out += self._issue_writes(now, rec)
        return out

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
        # The data plane's word on why: a remote disconnect is the peer gone, whichever
        # call of the data plane saw it; anything else is a failed write.
        failure = (
            FailureReason.PEER_GONE
            if reason is FailureReason.PEER_GONE
            else FailureReason.WRITE_ERROR
        )
        return self._fail(now, rec, failure, detail, Failed(rec.transfer_id, failure, detail))

    # ----- messages (routed here by PushProtocol)

    def handle(self, now: float, peer: str, message: Message) -> list[Effect]:
        """A message from agent `peer`, as the data plane attributes it (see "Who sent
        it"): from an agent no side channel has vouched for yet it is kept unread until
        one does (a Register or Reject names the address to ask), from any other agent
        it is dropped and counted; one that claims an engine other than the one its
        agent was vouched for is dropped and counted too."""
        now = self._clock.advance(now)
        p = self._peers.get(peer)
        if p is None:
            address = _named_address(message)
            if address is not None:
                return self._note_peer(now, peer, address, message)
            if isinstance(message, Cancel):
                # Counted, and still remembered against that agent's own Register: a
                # receiver's Cancel may overtake (or outlive) its first Register.
                self._remember_cancel(now, peer, message.transfer_id)
            return self._drop("unknown_agent")
        if not p.verified:
            if len(p.inbox) >= _MAX_UNREAD:
                return self._drop("unread_overflow")
            p.inbox.append((now, message))
            return []
        if not _claims(p, message):
            return self._drop("wrong_engine")
        p.last_heard = now
        match message:
            case Register():
                return self._on_register(now, peer, message)
            case Cancel(transfer_id=tid, reason=reason, detail=detail):
                return self._on_cancel(now, peer, tid, reason, detail)
            case Reject(transfer_id=tid, detail=detail, reason=reason):
                return self._on_reject(now, peer, tid, detail, reason)
            case Heartbeat(role="receiver"):
                return self._on_heartbeat(now, peer, message)
            case _:
                self.ignored_messages += 1
                return []

    def _on_register(self, now: float, peer: str, msg: Register) -> list[Effect]:
        tid = msg.transfer_id
        out: list[Effect] = []
        if self._early_cancels.pop((peer, tid), None) is not None:
            return self._cancelled_before_register(now, peer, tid)
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
        granted = self._granted(msg.sent_at)
        rec = self._transfers.get(tid)
        if rec is not None and rec.register is not None:
            if rec.peer == peer:
                rec.lease_until_theirs = max(rec.lease_until_theirs, granted)
                return out  # a duplicate
            return out + self._send(peer, self._id_taken(tid))
        stale = self._stale_register(now, peer, granted)
        if rec is None:
            rec = _Outgoing(
                tid, SenderState.REGISTERED, deadline=now + self._timing.transfer_deadline_s
            )
            self._transfers[tid] = rec
        rec.register = msg
        rec.peer = peer
        rec.lease_until_theirs = granted
        if rec.blocks is not None:
            rec.state = SenderState.WRITING
        if stale is not None:
            # It waited somewhere (our inbox, while we were stopped) past its lease, or
            # our bound on the receiver's clock is loose: nothing is written for it unless
            # a fresh bound, or the receiver's answer listing it, shows the lease holds.
            return out + self._lapsed(now, rec, stale, register=True)
        if rec.blocks is None:
            return out
        return out + self._start(now, rec)

    def _granted(self, sent_at: float | None) -> float:
        """Until when (receiver's clock) a message sent at `sent_at` renews a lease."""
        return float("-inf") if sent_at is None else sent_at + self._timing.lease_s

    def _stale_register(self, now: float, peer: str, granted: float) -> str | None:
        p = self._peers.get(peer)
        if p is None or p.skew_lb is None or now < granted + p.skew_lb:
            return None
        age = now - p.skew_lb - (granted - self._timing.lease_s)
        return (
            f"Register from {peer} is at least {age:.3f}s old on the receiver's clock, past "
            f"its {self._timing.lease_s}s lease: refused, nothing written"
        )

    def _note_peer(self, now: float, peer: str, address: PeerAddress, msg: Message) -> list[Effect]:
        """A first message from `peer`, naming the side channel at `address`: keep it
        unread and ask that side channel who it serves (`handshake_done`).

        What the message claims is not believed: nothing is bound to `peer` until the
        side channel names it, and a new incarnation of a known engine is recognised only
        when the side channel that vouched for the old one says so."""
        engine = msg.receiver_engine_id if isinstance(msg, Register | Reject) else ""
        self._peers[peer] = _Peer(
            peer,
            engine,
            last_heard=now,
            ready=False,
            address=address,
            verified=False,
            inbox=[(now, msg)],
        )
        return [Handshake(address, peer)]

    def _remember_cancel(self, now: float, peer: str, tid: str) -> None:
        if len(self._early_cancels) < _MAX_EARLY_CANCELS:
            self._early_cancels.pop((peer, tid), None)  # insertion order = expiry order
            self._early_cancels[(peer, tid)] = now + self._tombstone_s

    def _cancelled_before_register(self, now: float, peer: str, tid: str) -> list[Effect]:
        """`peer` cancelled `tid` before its Register for it came: the transfer ends
        CANCELLED for that receiver (nothing was written), and it gets its CancelAck."""
        why = "receiver cancelled before its Register arrived"
        reason = FailureReason.CANCELLED
        rec = self._transfers.get(tid)
        tomb = self._tombstones.get(tid)
        if rec is not None and rec.register is None and rec.blocks is not None:
            rec.peer = peer
            return self._fail(now, rec, reason, why, CancelAck(tid))
        if rec is None and tomb is None:
            self._bury(now, tid, peer, CancelAck(tid), (reason, why))
            return self._send(peer, CancelAck(tid))
        if tomb is not None and tomb.peer in (None, peer):
            tomb.peer = peer
            return self._send(peer, CancelAck(tid))
        # The id is another receiver's: this one's Register never bound anything.
        return self._send(peer, CancelAck(tid))

    def _on_cancel(
        self, now: float, peer: str, tid: str, reason: FailureReason, detail: str
    ) -> list[Effect]:
        rec = self._transfers.get(tid)
        why = f"receiver cancelled ({reason.value}): {detail}"
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
        if tomb is not None and tomb.peer == peer:
            return self._send(peer, CancelAck(tid))
        if rec is None or rec.register is None:
            # The Cancel overtook its Register (or the Register was lost): it ends that
            # receiver's Register for the id when it comes, nobody else's. (Its blocks
            # stay fenced on its side; ours, if submitted, wait for that Register or the
            # deadline: an unregistered transfer names no receiver that could end it.)
            self._remember_cancel(now, peer, tid)
            return self._send(peer, CancelAck(tid))
        return self._drop("not_counterpart")  # the transfer is another receiver's

    def _on_reject(
        self, now: float, peer: str, tid: str, detail: str, reason: FailureReason
    ) -> list[Effect]:
        rec = self._transfers.get(tid)
        failure: FailureReason
        if reason is FailureReason.INCOMPATIBLE_PEER:
            failure = reason
            why = f"receiver {peer} refused our KV cache: {detail}"
        else:
            failure = FailureReason.REJECTED
            why = f"receiver rejected the request: {detail}"
        if rec is None:
            if tid not in self._tombstones:
                self._bury(now, tid, peer, None, (failure, why))
            return []
        if rec.register is not None and rec.peer != peer:
            return self._drop("not_counterpart")
        if rec.state is SenderState.ENDING:
            return []
        if rec.blocks is None:
            del self._transfers[tid]
            self._bury(now, tid, peer, None, (failure, why))
            return []
        return self._fail(now, rec, failure, why, Failed(tid, failure, why))

    def _on_heartbeat(self, now: float, peer: str, hb: Heartbeat) -> list[Effect]:
        out: list[Effect] = []
        p = self._peers.get(peer)
        first_bound = False
        if (
            p is not None
            and hb.echo is not None
            and hb.sent_at is not None
            and p.skew_echo < hb.echo <= now  # newer than the one in use, and ours
        ):
            first_bound = p.skew_lb is None
            # The newest round trip, not the tightest ever (clocks of two hosts drift);
            # an old echo repeated later (after an idle spell) is no newer, so ignored.
            p.skew_echo = hb.echo
            p.skew_lb = hb.echo - hb.sent_at
        granted = self._granted(hb.sent_at)
        for tid in hb.transfer_ids:
            rec = self._transfers.get(tid)
            if rec is not None and rec.peer == peer:
                if rec.state is not SenderState.ENDING:
                    rec.lease_until_theirs = max(rec.lease_until_theirs, granted)
                continue
            tomb = self._tombstones.get(tid)
            if tomb is not None and tomb.peer == peer and tomb.reply is not None:
                out += self._send(peer, tomb.reply)  # it missed our Done/Failed: again
        if first_bound and p is not None and p.ready:
            out += self._issue_for_peer(now, peer)  # writes waited for the bound
        if p is not None:
            out += self._settle_rechecks(now, p)
        return out

    def _lapsed(
        self, now: float, rec: _Outgoing, detail: str, *, register: bool = False
    ) -> list[Effect]:
        """`rec`'s lease looks over: fail it, unless our bound on the receiver's clock
        may be loose and a fresh one could show it holds.

        The bound comes from the newest round trip, and a round trip that waited (the
        receiver starved, a message queued) leaves it too small by that wait. With no
        transfers in flight nothing measures it again, so every later Register would look
        stale, for good. So before failing on a bound measured earlier, we send the
        receiver a heartbeat, which it answers at once with a fresh echo (and the ids it
        still waits for, which renew their leases), and decide on that: nothing is
        written meanwhile, and silence ends it as any silence does."""
        p = self._peers.get(rec.peer) if rec.peer is not None else None
        if rec.recheck is None and p is not None and p.ready and p.skew_lb is not None:
            rec.recheck = (now, detail, register)
            self._rechecking[rec.transfer_id] = None
            return self._heartbeat(now, p, force=True)
        if rec.recheck is not None and (p is None or p.skew_echo < rec.recheck[0]):
            return []  # the answer is on its way
        if rec.recheck is not None:
            _, detail, register = rec.recheck
        if register:
            self.stale_registers += 1
        return self._timeout(now, rec, FailureReason.PEER_TIMEOUT, detail)

    def _settle_rechecks(self, now: float, p: _Peer) -> list[Effect]:
        """A bound measured after a recheck was asked for: decide each that waited on it
        (only those: this runs on every heartbeat from a receiver)."""
        out: list[Effect] = []
        for tid in list(self._rechecking):
            rec = self._transfers.get(tid)
            if rec is None or rec.recheck is None:
                del self._rechecking[tid]  # it ended meanwhile
                continue
            if rec.peer != p.agent or p.skew_echo < rec.recheck[0]:
                continue
            del self._rechecking[tid]
            if rec.state is SenderState.ENDING:
                rec.recheck = None
            elif self._lease_expired(now, rec):
                out += self._lapsed(now, rec, rec.recheck[1])
            else:
                rec.recheck = None  # the lease holds after all
                if rec.state is SenderState.WRITING:
                    out += (
                        self._start(now, rec)
                        if not rec.issued_layers
                        else self._issue_writes(now, rec)
                    )
                    if self._transfers.get(rec.transfer_id) is rec:
                        out += self._maybe_done(now, rec)  # its writes landed meanwhile
        return out

    # ----- time

    def tick(self, now: float) -> list[Effect]:
        now = self._clock.advance(now)
        out: list[Effect] = []
        t = self._timing
        silent: dict[str, str] = {}
        for p in self._peers.values():
            if now - p.last_heard >= t.liveness_timeout_s:
                silent[p.agent] = f"receiver {p.agent} silent for {now - p.last_heard:.3f}s"
        for rec in list(self._transfers.values()):
            if rec.state is SenderState.ENDING:
                continue  # waits for its writes: only the data plane ends a write
            if rec.peer is not None and rec.peer in silent:
                # Silent is not dead: fail, but only once its writes reported.
                out += self._timeout(now, rec, FailureReason.PEER_TIMEOUT, silent[rec.peer])
            elif now >= rec.deadline:
                detail = f"not finished within {t.transfer_deadline_s}s"
                out += self._timeout(now, rec, FailureReason.DEADLINE_EXCEEDED, detail)
            elif self._lease_expired(now, rec):
                detail = f"lease of {t.lease_s}s not renewed by receiver {rec.peer}"
                out += self._lapsed(now, rec, detail)
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
        early = self._early_cancels
        while early:
            key = next(iter(early))
            if now < early[key]:
                break
            del early[key]
        for p in self._peers.values():
            out += self._heartbeat(now, p)
        return out

    def _lease_expired(self, now: float, rec: _Outgoing) -> bool:
        """True once the lease has certainly run out on the receiver's clock."""
        if rec.peer is None or rec.register is None:
            return False
        p = self._peers.get(rec.peer)
        if p is None or p.skew_lb is None:
            return False  # no bound yet: nothing is written either (`_issue_writes`)
        return now >= rec.lease_until_theirs + p.skew_lb

    def next_deadline(self) -> float | None:
        """When `tick` next has something to do; None while nothing is in flight."""
        times: list[float] = []
        live: set[str] = set()
        for rec in self._transfers.values():
            if rec.state is SenderState.ENDING:
                continue
            times.append(rec.deadline)
            if rec.peer is not None:
                live.add(rec.peer)
                p = self._peers.get(rec.peer)
                if (
                    p is not None
                    and p.skew_lb is not None
                    and rec.register is not None
                    and rec.recheck is None  # it waits for the receiver's answer instead
                ):
                    times.append(rec.lease_until_theirs + p.skew_lb)
        for agent in live:
            p = self._peers.get(agent)
            if p is not None:
                times.append(p.last_heard + self._timing.liveness_timeout_s)
                if p.ready:
                    times.append(p.last_heartbeat_sent + self._timing.heartbeat_interval_s)
        if self._tombstones and not times:
            times.append(next(iter(self._tombstones.values())).expires)
        return min(times) if times else None

    def _timeout(
        self, now: float, rec: _Outgoing, reason: FailureReason, detail: str
    ) -> list[Effect]:
        if rec.blocks is None:  # a registration the engine never submitted (yet)
            del self._transfers[rec.transfer_id]
            failed = Failed(rec.transfer_id, reason, detail)
            self._bury(now, rec.transfer_id, rec.peer, failed, (reason, detail))
            return self._send(rec.peer, failed) if rec.peer else []
        return self._fail(now, rec, reason, detail, Failed(rec.transfer_id, reason, detail))

    def _heartbeat(self, now: float, p: _Peer, *, force: bool = False) -> list[Effect]:
        if not p.ready:
            return []
        due = now >= p.last_heartbeat_sent + self._timing.heartbeat_interval_s
        if not (force or due):
            return []
        ids = tuple(t for t, r in self._transfers.items() if r.peer == p.agent)
        if not ids and not force:
            return []
        p.last_heartbeat_sent = now
        hb = Heartbeat("sender", self._me.engine_id, self._me.incarnation, ids, sent_at=now)
        return [SendMessage(p.agent, hb)]

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
            failure = FailureReason.BLOCK_MISMATCH
            return self._fail(now, rec, failure, detail, Failed(rec.transfer_id, failure, detail))
        return self._issue_writes(now, rec)

    def _issue_writes(self, now: float, rec: _Outgoing) -> list[Effect]:
        """Write the layers that became ready, if the receiver certainly still expects
        them: its handshake is done, its clock is bounded and the lease holds."""
        assert rec.blocks is not None and rec.register is not None and rec.peer is not None
        if rec.recheck is not None:
            return []  # its lease looked over: `_settle_rechecks` decides, then issues
        p = self._peers.get(rec.peer)
        if p is None or not p.ready:
            return []  # its handshake is not done: `_peer_ready` issues these
        if not rec.register.block_ids:
            return self._maybe_done(now, rec)  # a full prefix hit: nothing to write
        new = rec.ready_layers - rec.issued_layers
        if not new:
            return []
        if p.skew_lb is None:
            return []  # the first echo is on its way; it issues these (`_on_heartbeat`)
        if now >= rec.lease_until_theirs + p.skew_lb:
            detail = (
                f"lease of {self._timing.lease_s}s from receiver {rec.peer} ran out (on its "
                "clock) before the write could start"
            )
            return self._lapsed(now, rec, detail)
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
        if rec.inflight or not written_all or rec.recheck is not None:
            return []  # (a lease being rechecked: `_settle_rechecks` comes back here)
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
        """End as failed once no write is in flight; `reply` tells the receiver.

        No time bound on the drain: a write that has not reported may still read our
        blocks, so they stay held until the data plane says (`write_done`/`write_failed`,
        or `peer_lost`)."""
        rec.state = SenderState.ENDING
        rec.reason, rec.detail, rec.reply = reason, detail, reply
        if rec.inflight:
            return []
        return self._end(now, rec)

    def _end(self, now: float, rec: _Outgoing) -> list[Effect]:
        assert rec.reason is not None and rec.blocks is not None and not rec.inflight
        del self._transfers[rec.transfer_id]
        self._bury(now, rec.transfer_id, rec.peer, rec.reply)
        out: list[Effect] = []
        if rec.peer is not None and rec.reply is not None:
            out += self._send(rec.peer, rec.reply)
        out.append(TransferEnded(rec.transfer_id, "sender", rec.reason, rec.detail, rec.blocks))
        return out

    def _abandon(
        self, now: float, rec: _Outgoing, reason: FailureReason, detail: str
    ) -> list[Effect]:
        """The peer is certainly gone: end at once, tell nobody; its write events are
        ignored (a write to a process that is gone lands nowhere)."""
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
        keep = self._tombstone_s
        self._tombstones.pop(tid, None)  # keep insertion order = expiry order
        self._tombstones[tid] = _Tombstone(peer, reply, now + keep, pending_failure)

    @staticmethod
    def _id_taken(tid: str) -> Failed:
        detail = f"transfer id {tid!r} is already in use by another receiver"
        return Failed(tid, FailureReason.MALFORMED_MESSAGE, detail)
