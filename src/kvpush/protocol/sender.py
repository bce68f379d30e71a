"""The sending side's state machine (`SenderProtocol`). The theory of operation, every
rule this file follows, is in `kvpush.protocol.state`.

`SenderProtocol` owns objects, one concern each, that answer and never act:

* `kvpush.protocol.identity.SenderGate`: which agent a message may be read from
  (`admit`: admit, hold or drop; `answered`/`unanswered`: the side channel's verdict on
  the agents waiting for it);
* `kvpush.protocol.leases.SenderLeases`: leases on the receiver's clock, heartbeats, and
  the timers (`due`: what `tick` must end; `next_deadline`);
* `kvpush.protocol.tombstones.Tombstones`: the ids that ended, with the answer a late
  message about one gets, and the Cancels that came before their Register;
* `kvpush.protocol.writes.SenderWrites`: the write ledger (which writes are in flight,
  for which transfer) and what a transfer's next write carries;
* `kvpush.protocol.choice.ReceiverChoice`: which receiver a transfer may go to (the one
  named at submit, the Registers held until then, the receivers' claims).

This file acts on their verdicts: the engine's calls, the transitions on a believed
receiver's messages, the writes, and the one exit every transfer ends through
(`_end_transfer`). It is the sender's transition table and is kept whole, as h11 keeps
its transitions in one file: every transition may end a transfer, and so must reach
`_end_transfer`; a second class holding some of them would either call back into this
one or hand back a verdict per transition, two places to read each rule instead of one.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence

from kvpush.config import STRICT_COMPATIBILITY, CompatibilityPolicy, TimingConfig
from kvpush.errors import (
    FailureReason,
    LocalProtocolError,
)
from kvpush.geometry import PROTOCOL_VERSION
from kvpush.protocol._common import (
    Effect,
    LocalIdentity,
    PeerAddress,
    PeerClock,
    PeerInfo,
    SenderState,
    SendMessage,
    TransferEnded,
    _check_blocks,
    _Clock,
    _Compatibility,
    _Outgoing,
    _Peer,
    _Side,
)
from kvpush.protocol.choice import ReceiverChoice
from kvpush.protocol.identity import Believe, Drop, Hold, Refuse, SenderGate, Vouching
from kvpush.protocol.leases import Lapsed, SenderLeases
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
from kvpush.protocol.tombstones import Tombstones
from kvpush.protocol.writes import SenderWrites

__all__ = ["SenderProtocol", "SenderState"]


class SenderProtocol(_Side[_Outgoing]):
    """The sending side of every transfer of one rank. See the module docstring.

    Where a transfer ends: in `_end_transfer`, and nowhere else. Every path that ends
    one (finished, failed once its writes drained (`_fail`, `_end`), its receiver gone
    (`_abandon`), a registration never submitted, a `submit` of an id that already
    ended, `shutdown`) calls it, and it alone builds the `TransferEnded` the engine
    gets."""

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
        self._compat = _Compatibility(compat, compatibility)
        self._clock = _Clock()
        self._transfers: dict[str, _Outgoing] = {}
        self._tombstones = Tombstones(timing.transfer_deadline_s + timing.lease_s)
        self._peers: dict[str, _Peer] = {}
        self._writes = SenderWrites(num_layers, self._transfers)
        self.ignored_messages = 0
        self.stale_registers = 0  # Registers refused because their lease had run out
        # Registers refused because the transfer is for another receiver (`submit`).
        self.wrong_receivers = 0
        self.forged = collections.Counter()
        self._choice = ReceiverChoice(timing, self._peers)
        self._gate = SenderGate(self._peers, timing, self._compat)
        self._leases = SenderLeases(
            identity, timing, self._transfers, self._peers, self._tombstones
        )

    # ----- inspection (read-only; what statistics and tests read)

    def state_of(self, transfer_id: str) -> SenderState | None:
        rec = self._transfers.get(transfer_id)
        return rec.state if rec else None

    def held_blocks(self) -> dict[str, tuple[int, ...]]:
        return {t: r.blocks for t, r in self._transfers.items() if r.blocks is not None}

    def states(self) -> dict[str, SenderState]:
        return {t: r.state for t, r in self._transfers.items()}

    def spoken_before_submit(self, prefixes: Iterable[str]) -> list[str]:
        """Transfer ids starting with one of `prefixes` that a receiver registered for
        or rejected before the engine submitted them: what an engine that learns the
        receiver's shape from its registrations (`kvpush.topology.part_id`) reads."""
        wanted = tuple(prefixes)
        if not wanted:
            return []
        registered = [
            t
            for t, r in self._transfers.items()
            if r.blocks is None and r.register is not None and t.startswith(wanted)
        ]
        return registered + self._tombstones.rejected(wanted)

    def claimed_before_submit(self, prefixes: Iterable[str]) -> list[str]:
        """Transfer ids starting with one of `prefixes` that a receiver's heartbeats
        claim (it holds the request queued) and the engine has not submitted: as
        `spoken_before_submit`, what says the receiver's shape before it registers.
        Forgotten a liveness timeout after the last heartbeat that claimed it."""
        wanted = tuple(prefixes)
        return self._choice.early(wanted) if wanted else []

    def writes_in_flight(self) -> int:
        """Writes issued whose outcome the data plane has not reported yet."""
        return len(self._writes)

    def lease_expires_at(self, transfer_id: str) -> float | None:
        """When, on our clock, the transfer's lease certainly runs out; None while the
        receiver's clock is not bounded yet (or the transfer is unknown or unregistered)."""
        rec = self._transfers.get(transfer_id)
        return self._leases.expires_at(rec) if rec is not None else None

    def clock_bounds(self) -> dict[str, PeerClock]:
        """Per receiver agent whose clock our leases have bounded (a heartbeat round trip
        came back since its handshake): the bound, and how wide it is."""
        return self._leases.clock_bounds()

    def next_deadline(self) -> float | None:
        """When `tick` next has something to do; None while nothing is in flight."""
        return self._leases.next_deadline()

    # ----- engine calls

    def submit(
        self,
        now: float,
        transfer_id: str,
        blocks: Sequence[int],
        ready_layers: Iterable[int] | None = None,
        *,
        receiver: PeerAddress | None = None,
    ) -> list[Effect]:
        """Our blocks for `transfer_id`; `ready_layers=None`: all computed already.

        `receiver`: the decode server the transfer is for, by its side channel's host and
        port (its rank is not compared). A Register from a receiver that side channel did
        not vouch for is refused as the id being taken, and counted (`wrong_receivers`);
        the transfer waits for the named one. None: the first receiver to register takes
        it. Registers that came before submit are held until it says which is the one."""
        now = self._clock.advance(now)
        ours = _check_blocks(blocks, "submit", transfer_id)
        layers = self._writes.check_layers(transfer_id, ready_layers)
        rec = self._transfers.get(transfer_id)
        if rec is not None and rec.blocks is not None:
            raise LocalProtocolError(f"transfer {transfer_id!r} was already submitted")
        tomb = self._tombstones.get(transfer_id)
        if tomb is not None:
            # Ended before the engine handed it in: it ends at once (its tombstone stays).
            if tomb.pending_failure is None:
                # The engine cannot know how long ended ids are remembered: an outcome.
                reason, detail = (
                    FailureReason.LOCAL_ERROR,
                    (
                        f"transfer id {transfer_id!r} was already used by a transfer that ended "
                        f"less than {self._tombstones.keep_s}s ago: use a new id per transfer"
                    ),
                )
            else:
                (reason, detail), tomb.pending_failure = tomb.pending_failure, None
            ended = _Outgoing(transfer_id, SenderState.ENDING, now, blocks=ours)
            return self._end_transfer(now, ended, reason, detail, None, bury=False)
        if rec is None:
            rec = _Outgoing(
                transfer_id,
                SenderState.AWAITING_REGISTER,
                deadline=now + self._timing.transfer_deadline_s,
            )
            self._transfers[transfer_id] = rec
        rec.blocks = ours
        rec.ready_layers = layers
        self._choice.submitted(now, rec, receiver)
        out, started = self._choose_receiver(now, rec)
        if started or rec.register is None:
            return out
        rec.state = SenderState.WRITING
        return out + self._start(now, rec)

    def _refuse_receiver(self, peer: str, rec: _Outgoing) -> list[Effect]:
        self.wrong_receivers += 1
        return self._send(peer, self._choice.refusal(peer, rec))

    def _choose_receiver(self, now: float, rec: _Outgoing) -> tuple[list[Effect], bool]:
        """At submit: the receiver bound before it stays only if it is the one named;
        of the Registers held, the first from the named one takes the transfer (and
        starts it: True), the others are told the id is taken."""
        out: list[Effect] = []
        unnamed = self._choice.unbind_unnamed(rec)
        if unnamed is not None:
            out += self._refuse_receiver(unnamed, rec)
            self._leases.stop_recheck(rec)
        started = False
        for peer, msg in self._choice.take_held(rec):
            if rec.register is None and self._choice.is_for(rec, peer):
                out += self._on_register(now, peer, msg)
                started = rec.register is not None
            elif rec.receiver is not None and not self._choice.is_for(rec, peer):
                out += self._refuse_receiver(peer, rec)
            else:
                out += self._send(peer, self._id_taken(rec.transfer_id))
        return out, started

    def layers_ready(self, now: float, transfer_id: str, layers: Iterable[int]) -> list[Effect]:
        now = self._clock.advance(now)
        rec = self._transfers.get(transfer_id)
        new = self._writes.check_layers(transfer_id, layers)
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
        return self._end_transfer(now, rec, failure, why, Failed(transfer_id, failure, why))

    def abort_with_peer(
        self, now: float, transfer_id: str, peer: str, reason: FailureReason, detail: str
    ) -> list[Effect]:
        """Fail `transfer_id` if `peer` is its receiver (the safe way: drain, then tell)."""
        now = self._clock.advance(now)
        rec = self._transfers.get(transfer_id)
        if rec is None or rec.peer != peer or rec.state is SenderState.ENDING:
            return []
        if rec.blocks is None:
            return self._end_transfer(now, rec, reason, detail, None)
        return self._fail(now, rec, reason, detail, Failed(transfer_id, reason, detail))

    def shutdown(self, now: float, reason: FailureReason, detail: str) -> list[Effect]:
        """End every transfer at once, as `reason`, and forget every peer.

        Only for a runtime whose data plane can no longer read our memory (its transport
        is closed): a write still in flight would otherwise read blocks handed back here.
        A runtime that can still drain aborts its transfers first (`abort`)."""
        now = self._clock.advance(now)
        out: list[Effect] = []
        for rec in list(self._transfers.values()):
            if rec.state is SenderState.ENDING and rec.reason is not None:
                why, what = rec.reason, rec.detail
            else:
                why, what = reason, detail
            # No tombstone: nothing comes from a peer once the data plane is closed.
            out += self._end_transfer(now, rec, why, what, None, bury=False)
        self._writes.clear()
        self._peers.clear()
        return out

    def tick(self, now: float) -> list[Effect]:
        """Whatever is due by `now`: timers (`SenderLeases.due`), forgetting tombstones
        and early Cancels and claims, and heartbeats."""
        now = self._clock.advance(now)
        out: list[Effect] = []
        for due in self._leases.due(now):
            if due.lease:
                out += self._lapsed(now, due.rec, due.detail)
            else:
                out += self._timeout(now, due.rec, due.reason, due.detail)
        self._tombstones.expire(now)
        self._choice.expire(now)
        for p in self._peers.values():
            out += self._leases.heartbeat(now, p)
        return out

    # ----- a receiver believed (the gate let it through), and transport events

    def _peer_ready(self, now: float, p: _Peer) -> list[Effect]:
        p.ready = True
        p.last_heard = now
        out: list[Effect] = [SendMessage(p.agent, m) for m in p.outbox]
        p.outbox.clear()
        # At once, not at the next interval: its echo bounds the receiver's clock, and
        # no write starts before that (first contact only; the bound is kept).
        out += self._leases.heartbeat(now, p, force=True)
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

    def peer_lost(self, now: float, peer: str, reason: FailureReason, detail: str) -> list[Effect]:
        """`peer` is certainly gone: its transfers end now, and so do the unregistered
        ones it was the last to claim (it held their requests, and they died with it;
        nothing was written for them, so nothing to drain)."""
        now = self._clock.advance(now)
        known = peer in self._peers
        out = super().peer_lost(now, peer, reason, detail)
        if not known:
            return out
        why = f"the receiver that claimed it is gone ({detail})"
        for rec in self._choice.claimed_by(self._transfers, peer):
            out += self._timeout(now, rec, reason, why)
        return out

    def write_done(self, now: float, write_id: int) -> list[Effect]:
        now = self._clock.advance(now)
        rec = self._writes.landed(write_id)
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
        rec = self._writes.landed(write_id)
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
        agent was vouched for is dropped and counted too (the gate: `SenderGate.admit`).
        What passes the gate is a transition of its transfer."""
        now = self._clock.advance(now)
        match self._gate.admit(now, peer, message):
            case Hold(ask=ask):
                return [ask] if ask is not None else []
            case Drop(reason=reason):
                if reason == "unknown_agent" and isinstance(message, Cancel):
                    # Counted, and still remembered against that agent's own Register: a
                    # receiver's Cancel may overtake (or outlive) its first Register.
                    self._tombstones.remember_cancel(now, peer, message.transfer_id)
                return self._drop(reason)
        p = self._peers[peer]
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

    def handshake_done(self, now: float, address: PeerAddress, info: PeerInfo) -> list[Effect]:
        """The side channel at `address` answered with `info`: an agent vouched for there
        before and not named now restarted (PEER_RESTARTED); the gate decides on the
        agents waiting there (`SenderGate.answered`)."""
        now = self._clock.advance(now)
        out = self._restarted(now, address, info)
        return out + self._vouched(now, address, info, self._gate.answered(now, address, info))

    def handshake_failed(
        self, now: float, address: PeerAddress, reason: FailureReason, detail: str
    ) -> list[Effect]:
        """The lookup of `address` failed (`SenderGate.unanswered`)."""
        now = self._clock.advance(now)
        return self._vouched(now, address, None, self._gate.unanswered(now, address, detail))

    def _vouched(
        self, now: float, address: PeerAddress, info: PeerInfo | None, verdicts: list[Vouching]
    ) -> list[Effect]:
        """Act on the gate's verdicts, in order: a believed agent's messages are read, then
        it is ready for writes (or refused, if its cache is incompatible); a refused
        one's messages are counted, and, if the runtime loaded it, it is lost."""
        out: list[Effect] = []
        for verdict in verdicts:
            match verdict:
                case Believe(agent=agent, messages=messages, stale=stale, problem=problem):
                    self.ignored_messages += stale
                    for m in messages:
                        out += self.handle(now, agent, m)
                    if problem is not None and info is not None:
                        out += self._incompatible(now, agent, address, info, problem)
                    elif agent in self._peers:
                        out += self._peer_ready(now, self._peers[agent])
                case Refuse(agent=agent, reason=reason, detail=detail, dropped=dropped):
                    self._drop(reason, dropped)
                    if verdict.loaded:
                        out += self.peer_lost(now, agent, FailureReason.UNKNOWN_PEER, detail)
                case _:
                    out.append(verdict)  # a Handshake: ask a rival's side channel again
        return out

    def _incompatible(
        self, now: float, agent: str, address: PeerAddress, info: PeerInfo, problem: str
    ) -> list[Effect]:
        """A believed receiver whose KV cache is incompatible with ours: each of its
        transfers is told why (nothing was written: writes wait for the handshake), so it
        gives its blocks back now, not at its deadline; then it is lost."""
        failure = FailureReason.INCOMPATIBLE_PEER
        view = f"sender refused our KV cache: {self._compat.their_view(info.compat)}"
        out: list[Effect] = [
            SendMessage(agent, Failed(rec.transfer_id, failure, view))
            for rec in self._transfers.values()
            if rec.peer == agent
        ]
        return out + self.peer_lost(now, agent, failure, f"receiver at {address}: {problem}")

    def _on_heartbeat(self, now: float, peer: str, hb: Heartbeat) -> list[Effect]:
        """A believed receiver's heartbeat: its echo and the leases it renews
        (`SenderLeases.heard`), the submitted transfers it claims (their claim window
        moves on), our Done/Failed again for ended ones it still lists, then the writes
        that waited for a first bound and the rechecks it settles."""
        p = self._peers[peer]
        first_bound = self._leases.heard(now, p, hb)
        for tid in hb.claimed:
            rec = self._transfers.get(tid)
            self._choice.claimed(now, rec, peer)
            if rec is None and tid not in self._tombstones:
                self._choice.claimed_early(now, tid)  # `claimed_before_submit`
        out: list[Effect] = []
        for tid in hb.transfer_ids:
            rec, tomb = self._transfers.get(tid), self._tombstones.get(tid)
            if (rec is not None and rec.peer == peer) or tomb is None or tomb.peer != peer:
                continue
            if tomb.reply is not None:
                out += self._send(peer, tomb.reply)  # it missed our Done/Failed: again
        if first_bound and p.ready:
            out += self._issue_for_peer(now, peer)  # writes waited for the bound
        for rec, lapsed in self._leases.settled(now, p):
            if lapsed is not None:
                out += self._run_out(now, rec, lapsed)
            elif rec.state is SenderState.WRITING:  # the lease holds after all
                out += (
                    self._start(now, rec) if not rec.issued_layers else self._issue_writes(now, rec)
                )
                if self._transfers.get(rec.transfer_id) is rec:
                    out += self._maybe_done(now, rec)  # its writes landed meanwhile
        return out

    def _on_register(self, now: float, peer: str, msg: Register) -> list[Effect]:
        tid = msg.transfer_id
        out: list[Effect] = []
        if self._tombstones.take_cancel(peer, tid):
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
        granted = self._leases.granted(msg.sent_at)
        rec = self._transfers.get(tid)
        if rec is not None and rec.register is not None:
            if rec.peer == peer:
                rec.lease_until_theirs = max(rec.lease_until_theirs, granted)
                return out  # a duplicate
            if rec.blocks is None and self._choice.hold(rec, peer, msg):
                # Not submitted yet: which receiver the transfer is for is not known.
                return out
            return out + self._send(peer, self._id_taken(tid))
        if rec is not None and rec.blocks is not None and not self._choice.is_for(rec, peer):
            return out + self._refuse_receiver(peer, rec)
        stale = self._leases.stale_register(now, peer, granted)
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
            self._tombstones.bury(now, tid, peer, CancelAck(tid), (reason, why))
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
        why = f"receiver {peer} cancelled ({reason.value}): {detail}"
        if rec is not None and rec.peer == peer:
            if rec.blocks is None:  # registered, never submitted: nothing to drain
                return self._end_transfer(now, rec, FailureReason.CANCELLED, why, CancelAck(tid))
            if rec.state is SenderState.ENDING:
                rec.reply = CancelAck(tid)  # the ack must wait for the drain too
                return []
            return self._fail(now, rec, FailureReason.CANCELLED, why, CancelAck(tid))
        tomb = self._tombstones.get(tid)
        if tomb is not None and tomb.peer == peer:
            return self._send(peer, CancelAck(tid))
        if self._choice.withdraw_held(rec, peer):
            # A held Register withdrawn; a copy of it still on the way must not be held.
            self._tombstones.remember_cancel(now, peer, tid)
            return self._send(peer, CancelAck(tid))
        if rec is None or rec.register is None:
            # The Cancel overtook its Register (or the Register was lost): it ends that
            # receiver's Register for the id when it comes, nobody else's. (Its blocks
            # stay fenced on its side; ours, if submitted, wait for that Register or the
            # deadline: an unregistered transfer names no receiver that could end it.)
            self._tombstones.remember_cancel(now, peer, tid)
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
            why = f"receiver {peer} rejected the request: {detail}"
        if rec is None:
            if tid not in self._tombstones:
                self._tombstones.bury(now, tid, peer, None, (failure, why))
            return []
        if rec.register is not None and rec.peer != peer:
            return self._drop("not_counterpart")
        if rec.state is SenderState.ENDING:
            return []
        if rec.blocks is None:
            return self._end_transfer(now, rec, failure, why, None)
        return self._fail(now, rec, failure, why, Failed(tid, failure, why))

    # ----- transitions

    def _timeout(
        self, now: float, rec: _Outgoing, reason: FailureReason, detail: str
    ) -> list[Effect]:
        failed = Failed(rec.transfer_id, reason, detail)
        if rec.blocks is None:  # a registration the engine never submitted (yet)
            return self._end_transfer(now, rec, reason, detail, failed)
        return self._fail(now, rec, reason, detail, failed)

    def _lapsed(
        self, now: float, rec: _Outgoing, detail: str, *, register: bool = False
    ) -> list[Effect]:
        """`rec`'s lease looks over: it fails, unless the leases ask the receiver for a
        fresh bound on its clock first (`SenderLeases.lapsed`)."""
        verdict = self._leases.lapsed(now, rec, detail, register)
        return self._run_out(now, rec, verdict) if isinstance(verdict, Lapsed) else verdict

    def _run_out(self, now: float, rec: _Outgoing, lapsed: Lapsed) -> list[Effect]:
        if lapsed.register:
            self.stale_registers += 1
        return self._timeout(now, rec, FailureReason.PEER_TIMEOUT, lapsed.detail)

    def _start(self, now: float, rec: _Outgoing) -> list[Effect]:
        """Both sides known: check the mapping, then write (or finish on a full hit)."""
        assert rec.blocks is not None and rec.register is not None and rec.peer is not None
        detail = self._writes.mapping_problem(rec, self._compat.block_tokens)
        if detail is not None:
            failure = FailureReason.BLOCK_MISMATCH
            return self._fail(now, rec, failure, detail, Failed(rec.transfer_id, failure, detail))
        return self._issue_writes(now, rec)

    def _issue_writes(self, now: float, rec: _Outgoing) -> list[Effect]:
        """Write the layers that became ready, if the receiver certainly still expects
        them: its handshake is done, its clock is bounded and the lease holds."""
        assert rec.blocks is not None and rec.register is not None and rec.peer is not None
        if rec.recheck is not None:
            return []  # its lease looked over: `_on_heartbeat` settles it, then issues
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
        if self._leases.expired(now, rec):
            detail = (
                f"lease of {self._timing.lease_s}s from receiver {rec.peer} ran out (on its "
                "clock) before the write could start"
            )
            return self._lapsed(now, rec, detail)
        return [self._writes.issue(rec, new)]

    def _maybe_done(self, now: float, rec: _Outgoing) -> list[Effect]:
        assert rec.register is not None and rec.peer is not None and rec.blocks is not None
        if rec.inflight or not self._writes.all_written(rec) or rec.recheck is not None:
            return []  # (a lease being rechecked: `_on_heartbeat` comes back here)
        done = Done(rec.transfer_id, len(rec.register.block_ids))
        return self._end_transfer(now, rec, None, "", done)

    def _done_delivered(self, now: float, rec: _Outgoing) -> list[Effect]:
        """The write carrying our Done landed, so the receiver has its Done: the transfer
        finished, even if it was ending (an engine abort or a timeout that came too late
        to stop the write). Only a receiver that cancelled meanwhile ends it as failed:
        it is fencing and reports its own reason, so we report that one too."""
        assert rec.register is not None and rec.peer is not None and rec.blocks is not None
        done = Done(rec.transfer_id, len(rec.register.block_ids))
        if rec.state is SenderState.ENDING and isinstance(rec.reply, CancelAck):
            return self._end(now, rec)
        return self._end_transfer(now, rec, None, "", done, tell=False)  # it has it already

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
        """An ENDING transfer's writes drained: it ends as `_fail` decided."""
        assert rec.reason is not None and rec.blocks is not None and not rec.inflight
        return self._end_transfer(now, rec, rec.reason, rec.detail, rec.reply)

    def _abandon(
        self, now: float, rec: _Outgoing, reason: FailureReason, detail: str
    ) -> list[Effect]:
        """The peer is certainly gone: end at once, tell nobody; its write events are
        ignored (a write to a process that is gone lands nowhere)."""
        self._writes.forget(rec)
        if rec.state is SenderState.ENDING and rec.reason is not None:
            reason, detail = rec.reason, rec.detail
        return self._end_transfer(now, rec, reason, detail, None)

    def _end_transfer(
        self,
        now: float,
        rec: _Outgoing,
        reason: FailureReason | None,
        detail: str,
        reply: Message | None,
        *,
        tell: bool = True,
        bury: bool = True,
    ) -> list[Effect]:
        """The one way a sender transfer ends: it is forgotten, its tombstone keeps
        `reply` for late messages, the receiver is sent `reply` (if `tell`), and the
        engine is told with a `TransferEnded` (`reason` None: finished), built here only.

        The caller has made sure no write of it is in flight (or that its peer is gone,
        or the data plane closed, so none can land). A transfer the engine never
        submitted (registered only) is reported to nobody now: its tombstone keeps the
        failure, and the engine's `submit` of the id gets it. `bury=False`: no tombstone,
        for `shutdown` (no message comes once the data plane is closed) and for a `submit`
        of an id that already ended (its tombstone is there)."""
        tid = rec.transfer_id
        if self._transfers.get(tid) is rec:
            del self._transfers[tid]
        if bury:
            failure = (reason, detail) if rec.blocks is None and reason is not None else None
            assert rec.blocks is not None or failure is not None  # nothing finishes unsubmitted
            self._tombstones.bury(now, tid, rec.peer, reply, failure)
        out: list[Effect] = []
        if tell and rec.peer is not None and reply is not None:
            out += self._send(rec.peer, reply)
        if rec.blocks is not None:
            moved = len(rec.register.block_ids) if reason is None and rec.register else 0
            out.append(TransferEnded(tid, "sender", reason, detail, rec.blocks, moved))
        return out

    # ----- helpers

    def _send(self, peer: str, message: Message) -> list[Effect]:
        p = self._peers.get(peer)
        if p is None:
            return []
        if not p.ready:
            p.outbox.append(message)
            return []
        return [SendMessage(peer, message)]

    @staticmethod
    def _id_taken(tid: str) -> Failed:
        detail = f"transfer id {tid!r} is already in use by another receiver"
        return Failed(tid, FailureReason.MALFORMED_MESSAGE, detail)
