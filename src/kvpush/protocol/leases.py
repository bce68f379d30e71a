"""The sender's leases, measured on the receiver's clock, and its timers (the rules are in
`kvpush.protocol.state`, "Leases measured on the receiver's clock").

`SenderLeases` is a part of `SenderProtocol`: the bound on the receiver's clock that a
receiver heartbeat's echo gives, the lease each Register and heartbeat grants, the
recheck of a lease that looks over on a bound measured earlier, the heartbeats we send,
and `tick`/`next_deadline` (silence, deadline, lease expiry, forgetting tombstones). What
ends here ends through `SenderProtocol`'s one exit (`_end_transfer`, via `_fail` once
writes drained).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpush.config import TimingConfig
from kvpush.errors import FailureReason
from kvpush.protocol._common import (
    Effect,
    LocalIdentity,
    SenderState,
    SendMessage,
    _Outgoing,
    _Peer,
    _Side,
    _Tombstone,
)
from kvpush.protocol.messages import (
    Failed,
    Heartbeat,
    Message,
)


class SenderLeases(_Side[_Outgoing]):
    """Leases, heartbeats and timers of the sending side; `SenderProtocol` holds the
    state (the transfers, their tombstones, the peers' clock bounds)."""

    _me: LocalIdentity
    _timing: TimingConfig
    _tombstones: dict[str, _Tombstone]
    _early_cancels: dict[tuple[str, str], float]
    _rechecking: dict[str, None]
    stale_registers: int

    if TYPE_CHECKING:
        # The transitions these hand on to, in `SenderProtocol`.
        def _start(self, now: float, rec: _Outgoing) -> list[Effect]: ...
        def _issue_writes(self, now: float, rec: _Outgoing) -> list[Effect]: ...
        def _issue_for_peer(self, now: float, peer: str) -> list[Effect]: ...
        def _maybe_done(self, now: float, rec: _Outgoing) -> list[Effect]: ...
        def _fail(
            self, now: float, rec: _Outgoing, reason: FailureReason, detail: str, reply: Message
        ) -> list[Effect]: ...
        def _end_transfer(
            self,
            now: float,
            rec: _Outgoing,
            reason: FailureReason | None,
            detail: str,
            reply: Message | None,
            *,
            tell: bool = True,
        ) -> list[Effect]: ...
        def _send(self, peer: str, message: Message) -> list[Effect]: ...
        def _is_for(self, rec: _Outgoing, peer: str) -> bool: ...

    # ----- leases

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
            p.skew_round_trip = now - hb.echo
        granted = self._granted(hb.sent_at)
        window = self._timing.claim_window_s
        for tid in hb.claimed:
            rec = self._transfers.get(tid)
            if (
                window is not None
                and rec is not None
                and rec.register is None
                and rec.blocks is not None
                and rec.state is not SenderState.ENDING
                and self._is_for(rec, peer)
            ):
                rec.claim_until = max(rec.claim_until, now + window)
                rec.claimer = peer
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
            elif rec.register is None and now >= rec.claim_until:
                detail = (
                    f"no receiver registered or claimed it for {t.claim_window_s}s "
                    "(its receiver died before registering, or never got the request)"
                )
                out += self._timeout(now, rec, FailureReason.PEER_TIMEOUT, detail)
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
            if rec.register is None and rec.claim_until != float("inf"):
                times.append(rec.claim_until)
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
        failed = Failed(rec.transfer_id, reason, detail)
        if rec.blocks is None:  # a registration the engine never submitted (yet)
            return self._end_transfer(now, rec, reason, detail, failed)
        return self._fail(now, rec, reason, detail, failed)

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
