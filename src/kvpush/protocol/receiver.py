"""The receiving side's state machine (`ReceiverProtocol`). The theory of operation,
every rule this file follows, is in `kvpush.protocol.state`.

Two tables it owns live beside it, each answering what it holds and deciding nothing:
`claims.Claims`, the requests held before there are blocks for them, and
`lookups.Lookups`, the senders' side channels being looked up or known. Its timers are
an object it owns too, `receiver_timers.ReceiverTimers`, which answers what is due
(a sender silent, a deadline passed, a fence over, a Cancel to repeat) and when `tick`
next has work; the receiver fences or ends the transfer."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

import msgspec

from kvpush.config import STRICT_COMPATIBILITY, CompatibilityPolicy, TimingConfig
from kvpush.errors import (
    FailureReason,
    LocalProtocolError,
)
from kvpush.protocol._common import (
    REVALIDATE_AFTER_S,
    Effect,
    LocalIdentity,
    PeerAddress,
    PeerInfo,
    ReceiverState,
    SendMessage,
    TransferEnded,
    _check_blocks,
    _Clock,
    _Compatibility,
    _Incoming,
    _Peer,
    _Side,
)
from kvpush.protocol.claims import Claims
from kvpush.protocol.lookups import Lookup, Lookups
from kvpush.protocol.messages import (
    Cancel,
    CancelAck,
    Done,
    Failed,
    Heartbeat,
    Message,
)
from kvpush.protocol.receiver_messages import heartbeats_from, register_for, reject_from
from kvpush.protocol.receiver_timers import CancelAgain, FenceOver, Overdue, ReceiverTimers

__all__ = ["ReceiverProtocol", "ReceiverState"]


class ReceiverProtocol(_Side["_Incoming"]):
    """The receiving side of every transfer of one rank. See the module docstring."""

    def __init__(
        self,
        identity: LocalIdentity,
        timing: TimingConfig,
        compat: Mapping[str, object],
        *,
        compatibility: CompatibilityPolicy = STRICT_COMPATIBILITY,
        revalidate_after_s: float = REVALIDATE_AFTER_S,
    ) -> None:
        if revalidate_after_s < 0:
            raise LocalProtocolError(f"revalidate_after_s must be >= 0, got {revalidate_after_s}")
        self._me = identity
        self._timing = timing
        self._compat = _Compatibility(compat, compatibility)
        self._clock = _Clock()
        self._transfers: dict[str, _Incoming] = {}
        self._ended: dict[str, float] = {}  # transfer id -> forget after
        self._peers: dict[str, _Peer] = {}
        self._book = Lookups(revalidate_after_s)  # our senders' side channels
        self._claims = Claims()
        self._timers = ReceiverTimers(
            timing, self._transfers, self._peers, self._claims, self._book, self._ended
        )
        self.ignored_messages = 0
        self.forged = collections.Counter()

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

    def claimed(self) -> list[str]:
        """The ids we claim (`claim`) and have not expected, rejected or dropped yet."""
        return self._claims.ids()

    def known_peers(self) -> int:
        """Side-channel addresses with a usable (compatible) handshake result cached."""
        return self._book.known_count()

    # ----- engine calls

    def expect(
        self,
        now: float,
        transfer_id: str,
        sender: PeerAddress,
        blocks: Sequence[int],
        *,
        sender_offset: int = 0,
        sender_block_tokens: int | None = None,
    ) -> list[Effect]:
        """Expect `transfer_id` from the sender whose side channel is `sender` into our
        `blocks`; `blocks[i]` receives the sender's block `sender_offset + i`.
        `sender_block_tokens`: the sender's block size our ids count in (None: ours; where
        ours is `k` times larger, `blocks` are parts of our blocks, `sub_block_ids`).

        Registers at once from a cached handshake of `sender` (heard from within
        `revalidate_after_s`), else asks for a `Handshake` of `sender` first (one per
        address, however many transfers wait for it). The deadline runs from here."""
        now = self._clock.advance(now)
        ours = _check_blocks(blocks, "expect", transfer_id)
        if not isinstance(transfer_id, str) or not transfer_id:
            raise LocalProtocolError("transfer id must be a non-empty string")
        if isinstance(sender_offset, bool) or not isinstance(sender_offset, int):
            raise LocalProtocolError(f"sender_offset must be an int, got {sender_offset!r}")
        if sender_offset < 0:
            raise LocalProtocolError(f"sender_offset must be >= 0, got {sender_offset}")
        if transfer_id in self._transfers:
            raise LocalProtocolError(f"transfer id {transfer_id!r} is in flight already")
        self._claims.drop(transfer_id)  # the Register speaks for it from now on
        if transfer_id in self._ended:
            # The engine cannot know how long ended ids are remembered: an outcome.
            detail = (
                f"transfer id {transfer_id!r} was already used by a transfer that ended less "
                f"than {self._timing.transfer_deadline_s + self.fence_s}s ago: use a new id "
                "per transfer"
            )
            return [TransferEnded(transfer_id, "receiver", FailureReason.LOCAL_ERROR, detail, ours)]
        rec = _Incoming(
            transfer_id,
            sender,
            ours,
            sender_offset,
            deadline=now + self._timing.transfer_deadline_s,
            sender_block_tokens=(
                self._compat.block_tokens if sender_block_tokens is None else sender_block_tokens
            ),
        )
        self._transfers[transfer_id] = rec
        info = self._book.fresh_info(now, sender)
        if info is not None:
            rec.from_cache = True
            return self._register(now, rec, info)
        return self._await_lookup(sender, transfer_id)

    def claim(self, now: float, transfer_id: str, sender: PeerAddress) -> list[Effect]:
        """We hold `transfer_id`'s request, queued, without blocks for it yet: keep the
        sender whose side channel is `sender` from giving its transfer up meanwhile.

        Every heartbeat to that sender lists it (`Heartbeat.claimed`, naming our side
        channel), once its side channel was looked up (a `Handshake` first if it is not
        known), until `expect` (its Register speaks for it then), `reject` or `abort` of
        the id, or `transfer_deadline_s` after the claim. Nothing is reported for a claim,
        and no blocks are held. A sender that hears no claim nor Register for
        `claim_window_s` gives its transfer up (`TimingConfig.claim_window_s`)."""
        now = self._clock.advance(now)
        if not isinstance(transfer_id, str) or not transfer_id:
            raise LocalProtocolError("transfer id must be a non-empty string")
        if transfer_id in self._transfers or transfer_id in self._claims:
            return []
        self._claims.add(transfer_id, sender, now + self._timing.transfer_deadline_s)
        info = self._book.info(sender)
        if info is not None:
            return self._heartbeat(now, self._peer_of(now, sender, info))
        return self._book.start(sender)[1]

    def release_claims(self, now: float, detail: str) -> list[Effect]:
        """Drop every claim, telling each sender whose side channel we know with a
        Reject, so that it hands its blocks back now (a receiver that is stopping and
        will never serve those requests). Nothing is reported: claims hold nothing."""
        self._clock.advance(now)
        out: list[Effect] = []
        for tid, address in self._claims.items():
            info = self._book.info(address)
            if info is not None:
                out.append(SendMessage(info.agent, reject_from(self._me, tid, detail)))
        self._claims.clear()
        return out

    def _peer_of(self, now: float, address: PeerAddress, info: PeerInfo) -> _Peer:
        p = self._peers.get(info.agent)
        if p is None:
            p = self._peers[info.agent] = _Peer(
                info.agent,
                info.engine_id,
                last_heard=now,
                incarnation=info.incarnation,
                address=address,
            )
        return p

    def reject(
        self, now: float, transfer_id: str, sender: PeerAddress, detail: str
    ) -> list[Effect]:
        """Refuse a request before allocating: the sender frees its blocks at once.

        Reported here too, at once: a `TransferEnded` on the receiver side with reason
        REJECTED, our `detail` and no blocks (nothing was allocated), so the engine has
        a record of every id it refused; unless the id is in flight here, whose own
        result is its record (the Reject still goes). The id stays free for a later
        `expect`: a refused request may come again. The Reject goes once `sender` is
        known (a lookup of it goes first if it is not)."""
        self._clock.advance(now)
        self._claims.drop(transfer_id)
        why = f"rejected by this engine: {detail}" if detail else "rejected by this engine"
        ended: list[Effect] = []
        if transfer_id not in self._transfers:
            ended.append(TransferEnded(transfer_id, "receiver", FailureReason.REJECTED, why, ()))
        info = self._book.info(sender)
        if info is not None:
            return [SendMessage(info.agent, reject_from(self._me, transfer_id, detail)), *ended]
        lookup, out = self._book.start(sender)
        lookup.rejects.append((transfer_id, detail))
        return out + ended

    def abort(
        self,
        now: float,
        transfer_id: str,
        reason: FailureReason = FailureReason.CANCELLED,
        detail: str = "aborted by the receiving engine",
    ) -> list[Effect]:
        now = self._clock.advance(now)
        self._claims.drop(transfer_id)
        rec = self._transfers.get(transfer_id)
        if rec is None or rec.state is ReceiverState.FENCING:
            return []
        if rec.state is ReceiverState.HANDSHAKING:
            # Nothing registered, nothing can be written: ours again at once. The sender
            # hears a Reject once the lookup is done, so it frees its blocks too.
            why = f"{detail} before the handshake with {rec.address} finished"
            return self._end_handshaking(now, rec, reason, why)
        return self._fence(now, rec, reason, detail)

    def _end_handshaking(
        self, now: float, rec: _Incoming, reason: FailureReason, detail: str
    ) -> list[Effect]:
        lookup = self._book.pending(rec.address)
        if lookup is not None:
            lookup.transfers.remove(rec.transfer_id)
            lookup.rejects.append((rec.transfer_id, detail))
        return self._end(now, rec, reason, detail)

    def abort_with_peer(
        self, now: float, transfer_id: str, peer: str, reason: FailureReason, detail: str
    ) -> list[Effect]:
        rec = self._transfers.get(transfer_id)
        if rec is None or rec.peer != peer:
            return []
        return self.abort(now, transfer_id, reason, detail)

    def withdraw(self, now: float, transfer_id: str, peer: str) -> list[Effect] | None:
        """Take back a first Register, sent from a cached handshake, that certainly
        reached no live sender, and look its address up again (once).

        The caller knows the Register's own send failed: the data plane lost `peer` in
        the same pass that sent it (a sender restarted at the same address faster than
        `revalidate_after_s`). Withdrawn only if nothing at all was heard from the peer
        since the Register went out and the transfer is still waiting: then no byte of
        it can have been written. Returns None, changing nothing, otherwise (the caller
        then ends it as usual, `peer_lost`); else the effects of looking it up again.
        Nothing is reported for the withdrawn attempt."""
        now = self._clock.advance(now)
        rec = self._transfers.get(transfer_id)
        if (
            rec is None
            or rec.peer != peer
            or not rec.first_attempt
            or not rec.from_cache
            or rec.state is not ReceiverState.WAITING
        ):
            return None
        p = self._peers.get(peer)
        if p is None or p.messages_heard != rec.heard_before:
            return None
        rec.first_attempt = False
        rec.state = ReceiverState.HANDSHAKING
        rec.peer = rec.register = None
        rec.from_cache = False
        self._book.forget(peer)  # that cached handshake is what was stale
        return self._await_lookup(rec.address, transfer_id)

    def shutdown(self, now: float, reason: FailureReason, detail: str) -> list[Effect]:
        """End every transfer at once, as `reason`. Only for a runtime whose data plane
        can no longer write into our memory (its transport is closed)."""
        now = self._clock.advance(now)
        out: list[Effect] = []
        for rec in list(self._transfers.values()):
            if rec.state is ReceiverState.FENCING and rec.reason is not None:
                out += self._end(now, rec, rec.reason, rec.detail)
            else:
                out += self._end(now, rec, reason, detail)
        self._book.clear()
        self._peers.clear()
        self._claims.clear()
        return out

    # ----- handshakes

    def handshake_done(self, now: float, address: PeerAddress, info: PeerInfo) -> list[Effect]:
        """The side channel at `address` answered with `info`: the transfers waiting for it
        register (if its cache is compatible with ours) or fail (INCOMPATIBLE_PEER, the
        detail naming each field that differs). A new incarnation of an engine we know
        ends what was in flight with the old one (PEER_RESTARTED)."""
        now = self._clock.advance(now)
        lookup = self._book.take(address) or Lookup()
        if info.engine_id == self._me.engine_id and info.incarnation == self._me.incarnation:
            return self._lookup_failed(
                now, address, lookup, FailureReason.LOCAL_ERROR, "that address is our own"
            )
        problem = self._compat.problem(info.compat)
        if problem is not None:
            self._claims.drop_address(address)  # its expect fails as incompatible
            self._book.drop(address)
            # Tell the sender, so that it frees its blocks now, not at its deadline:
            # nothing was registered, so a Reject is the whole truth.
            view = self._compat.their_view(info.compat)
            waiting = [
                tid
                for tid in lookup.transfers
                if (rec := self._transfers.get(tid)) is not None
                and rec.state is ReceiverState.HANDSHAKING
            ]
            out = self._lookup_failed(
                now, address, lookup, FailureReason.INCOMPATIBLE_PEER, problem
            )
            for tid in [*waiting, *(t for t, _ in lookup.rejects)]:
                reject = reject_from(self._me, tid, view, FailureReason.INCOMPATIBLE_PEER)
                out.append(SendMessage(info.agent, reject))
            return out
        out = self._restarted(now, address, info)
        self._book.remember(address, info, now)
        for tid, detail in lookup.rejects:
            out.append(SendMessage(info.agent, reject_from(self._me, tid, detail)))
        for tid in lookup.transfers:
            rec = self._transfers.get(tid)
            if rec is not None and rec.state is ReceiverState.HANDSHAKING:
                out += self._register(now, rec, info)
        if self._claims.at(address):
            out += self._heartbeat(now, self._peer_of(now, address, info))
        return out

    def handshake_failed(
        self, now: float, address: PeerAddress, reason: FailureReason, detail: str
    ) -> list[Effect]:
        """The lookup of `address` failed: the transfers waiting for it fail with `reason`
        (nothing was registered, so nothing can be written)."""
        now = self._clock.advance(now)
        lookup = self._book.take(address)
        if lookup is None:
            return []
        self._book.drop(address)
        self._claims.drop_address(address)  # unreachable: its expect finds out again
        return self._lookup_failed(now, address, lookup, reason, detail)

    def _lookup_failed(
        self,
        now: float,
        address: PeerAddress,
        lookup: Lookup,
        reason: FailureReason,
        detail: str,
    ) -> list[Effect]:
        out: list[Effect] = []
        why = f"handshake with {address} failed: {detail}"
        for tid in lookup.transfers:
            rec = self._transfers.get(tid)
            if rec is not None and rec.state is ReceiverState.HANDSHAKING:
                out += self._end(now, rec, reason, why)
        return out  # rejects: nobody to tell; the sender's own deadline frees it

    def _await_lookup(self, address: PeerAddress, transfer_id: str) -> list[Effect]:
        lookup, out = self._book.start(address)
        lookup.transfers.append(transfer_id)
        return out

    def _register(self, now: float, rec: _Incoming, info: PeerInfo) -> list[Effect]:
        peer = info.agent
        if peer in self._peers and not any(r.peer == peer for r in self._transfers.values()):
            self._peers[peer].last_heard = now  # idle until now: its silence says nothing
        p = self._peer_of(now, rec.address, info)
        rec.register = register_for(self._me, rec, now)
        rec.peer = peer
        rec.state = ReceiverState.WAITING
        rec.register_sent_at = now
        rec.heard_before = p.messages_heard
        return [SendMessage(peer, rec.register)]

    # ----- events

    def _end_with_lost_peer(
        self, now: float, rec: _Incoming, reason: FailureReason, detail: str
    ) -> list[Effect]:
        return self._end(now, rec, reason, detail)

    def handle(self, now: float, peer: str, message: Message) -> list[Effect]:
        """A message from agent `peer`, as the data plane attributes it. Our senders are
        agents we looked up ourselves (`handshake_done`): a message from any other agent,
        one that claims another engine than its agent's side channel said, or one about
        a transfer of another sender is dropped and counted, never acted on."""
        now = self._clock.advance(now)
        p = self._peers.get(peer)
        if p is None:
            return self._drop("unknown_agent")
        if isinstance(message, Heartbeat) and (message.engine_id, message.incarnation) != (
            p.engine_id,
            p.incarnation,
        ):
            return self._drop("wrong_engine")
        p.last_heard = now
        self.heard_from(peer, now)
        match message:
            case Heartbeat(role="sender", transfer_ids=ids, sent_at=sent_at):
                p.known_by_them = frozenset(ids)
                if sent_at is not None and (p.echo is None or sent_at > p.echo):
                    p.echo = sent_at
                # Answer at once: the echo is what lets the sender write (first contact)
                # and keeps its bound on our clock tight.
                return self._resend_registers(now, peer) + self._heartbeat(now, p)
            case Done(transfer_id=tid) | Failed(transfer_id=tid) | CancelAck(transfer_id=tid):
                rec = self._transfers.get(tid)
                if rec is None:
                    self.ignored_messages += 1  # late (a resend for what already ended)
                    return []
                if rec.peer != peer:
                    return self._drop("not_counterpart")
                return self._on_sender_final(now, rec, message)
            case _:
                self.ignored_messages += 1
                return []

    def heard_from(self, peer: str, now: float | None = None) -> None:
        """`peer` sent us something (for either machine, decodable or not): it was alive
        after our Registers to it went out, so none of them can be withdrawn, and its
        cached handshake is still good."""
        p = self._peers.get(peer)
        if p is None:
            return  # not one of our senders: it proves nothing about them
        p.messages_heard += 1
        if now is not None:
            self._book.heard(peer, now)

    def _on_sender_final(self, now: float, rec: _Incoming, message: Message) -> list[Effect]:
        # Each of these promises that no write for the transfer is or will be in flight.
        if rec.state is ReceiverState.FENCING:
            assert rec.reason is not None
            return self._end(now, rec, rec.reason, rec.detail)
        match message:
            case Done(num_blocks=n) if n == len(rec.blocks):
                return self._end(now, rec, None, "")
            case Done(num_blocks=n):
                detail = f"sender {rec.peer} wrote {n} blocks, we registered {len(rec.blocks)}"
                return self._end(now, rec, FailureReason.BLOCK_MISMATCH, detail)
            case Failed(reason=reason, detail=detail):
                return self._end(now, rec, reason, f"sender {rec.peer} failed: {detail}")
            case _:
                detail = f"sender {rec.peer} acknowledged a cancel we never sent"
                return self._end(now, rec, FailureReason.MALFORMED_MESSAGE, detail)

    def tick(self, now: float) -> list[Effect]:
        """Whatever is due by `now` (`ReceiverTimers`): silent senders, deadlines, fences
        and Cancels; then forgetting ended ids, claims, Registers to resend, heartbeats."""
        now = self._clock.advance(now)
        t = self._timing
        out: list[Effect] = []
        for silent in self._timers.silent(now):
            for rec in silent.waiting:
                out += self._fence(now, rec, FailureReason.PEER_TIMEOUT, silent.detail)
            # Silent is not dead: it stays loaded (our Cancels keep going to it, and a
            # send the data plane cannot deliver proves it gone), but its cached
            # handshake is not trusted for a new transfer.
            self._book.forget(silent.agent)
        for due in self._timers.due(now):
            match due:
                case Overdue(rec=rec, detail=detail, handshaking=True):
                    out += self._end_handshaking(now, rec, FailureReason.DEADLINE_EXCEEDED, detail)
                case Overdue(rec=rec, detail=detail):
                    out += self._fence(now, rec, FailureReason.DEADLINE_EXCEEDED, detail)
                case FenceOver(rec=rec):
                    assert rec.reason is not None
                    out += self._end(now, rec, rec.reason, rec.detail)
                case CancelAgain(rec=rec):
                    rec.cancel_sent_at = now
                    out += self._cancel(now, rec)
        self._timers.forget_ended(now)
        out += self._tick_claims(now)
        for p in self._peers.values():
            out += self._resend_registers(now, p.agent)
            if now >= p.last_heartbeat_sent + t.heartbeat_interval_s:
                out += self._heartbeat(now, p, only_if_live=True)
        return out

    def _tick_claims(self, now: float) -> list[Effect]:
        """Claims past their time are dropped; one whose sender is not known (its peer
        was lost, or its cached handshake forgotten) has it looked up again."""
        out: list[Effect] = []
        self._claims.expire(now)
        for address in self._claims.addresses():
            info = self._book.info(address)
            if info is not None:
                self._peer_of(now, address, info)
            else:
                out += self._book.start(address)[1]
        return out

    def _heartbeat(self, now: float, p: _Peer, *, only_if_live: bool = False) -> list[Effect]:
        live = [r for r in self._transfers.values() if r.peer == p.agent]
        claimed = self._claims.from_agent(p.agent, self._book) if self._claims else []
        if only_if_live and not live and not claimed:
            return []
        p.last_heartbeat_sent = now
        ids = tuple(r.transfer_id for r in live if r.state is ReceiverState.WAITING)
        return [
            SendMessage(p.agent, hb) for hb in heartbeats_from(self._me, ids, claimed, now, p.echo)
        ]

    def next_deadline(self) -> float | None:
        return self._timers.next_deadline()

    # ----- transitions

    def _resend_registers(self, now: float, peer: str) -> list[Effect]:
        """Registrations the sender does not list (lost, or not there yet) go again,
        stamped with the time they go: a resend renews the lease it asks for.

        Never past the transfer's deadline (a receiver that was stopped reads its inbox
        before it ticks): the sender forgets an id it gave up `deadline + lease` after,
        so a Register sent later could reach a sender to which the id is new, and which
        writes, while its earlier `Failed` for that id ends the transfer here."""
        p = self._peers.get(peer)
        if p is None:
            return []
        known = p.known_by_them or frozenset()
        out: list[Effect] = []
        for rec in self._transfers.values():
            if (
                rec.peer == peer
                and rec.register is not None
                and rec.state is ReceiverState.WAITING
                and rec.transfer_id not in known
                and now >= rec.register_sent_at + self._timing.heartbeat_interval_s
                and now < rec.deadline
            ):
                rec.register_sent_at = now
                rec.register = msgspec.structs.replace(rec.register, sent_at=now)
                out.append(SendMessage(peer, rec.register))
        return out

    def _fence(
        self, now: float, rec: _Incoming, reason: FailureReason, detail: str
    ) -> list[Effect]:
        # We renewed its lease last at or before `now`, so the sender starts no write
        # after `now + lease_s` on our clock: after the fence only writes it had already
        # issued could land, and the margin is for them.
        rec.state = ReceiverState.FENCING
        rec.reason, rec.detail = reason, detail
        rec.fence_until = now + self.fence_s
        rec.cancel_sent_at = now
        return self._cancel(now, rec)

    def _cancel(self, now: float, rec: _Incoming) -> list[Effect]:
        """Our Cancel for a fenced transfer; and, while the sender has not shown that it
        has our Register, that Register again after it, unchanged (the lease it asks for
        is not renewed): a sender takes a Cancel only for a transfer that the same agent
        registered, so one whose Register was lost must get it to hear the Cancel (it
        then ends the transfer without writing)."""
        p = self._peers.get(rec.peer) if rec.peer is not None else None
        if p is None or rec.reason is None:
            return []
        out: list[Effect] = [SendMessage(p.agent, Cancel(rec.transfer_id, rec.reason, rec.detail))]
        unconfirmed = p.known_by_them is None or rec.transfer_id not in p.known_by_them
        if rec.register is not None and unconfirmed and now < rec.deadline:
            out.append(SendMessage(p.agent, rec.register))
        return out

    def _end(
        self, now: float, rec: _Incoming, reason: FailureReason | None, detail: str
    ) -> list[Effect]:
        del self._transfers[rec.transfer_id]
        self._ended.pop(rec.transfer_id, None)  # keep insertion order = expiry order
        self._ended[rec.transfer_id] = now + self._timing.transfer_deadline_s + self.fence_s
        moved = len(rec.blocks) if reason is None else 0
        return [TransferEnded(rec.transfer_id, "receiver", reason, detail, rec.blocks, moved)]
