"""The sender's leases, measured on the receiver's clock, and its timers (the rules are in
`kvpush.protocol.state`, "Leases measured on the receiver's clock").

`SenderLeases` is an object `SenderProtocol` owns: the bound on each receiver's clock
that a receiver heartbeat's echo gives, the lease each Register and heartbeat grants,
the recheck of a lease that looks over on a bound measured earlier, the heartbeats we
send, and the timers (`due`, `next_deadline`).

It answers, and never ends a transfer: a lease that ran out is a `Lapsed` verdict, a
timer that fired is a `Due` one (a receiver gone silent, a deadline passed, a claim
window closed, a lease expired), and `SenderProtocol` ends the transfer
(`_end_transfer`, via `_fail` once writes drained).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.config import TimingConfig
from kvpush.errors import FailureReason
from kvpush.protocol._common import (
    Effect,
    LocalIdentity,
    PeerClock,
    SenderState,
    SendMessage,
    _Outgoing,
    _Peer,
)
from kvpush.protocol.messages import Heartbeat
from kvpush.protocol.tombstones import Tombstones


@dataclass(frozen=True, slots=True)
class Lapsed:
    """The lease has run out: the transfer fails (PEER_TIMEOUT) with `detail`.
    `register`: it was a Register's, refused as stale (`stale_registers`)."""

    detail: str
    register: bool


@dataclass(frozen=True, slots=True)
class Due:
    """A timer of `rec` fired: it fails with `reason` and `detail`. `lease`: its lease
    looks over, which `SenderProtocol._lapsed` decides (it may ask for a fresh bound)."""

    rec: _Outgoing
    reason: FailureReason
    detail: str
    lease: bool = False


class SenderLeases:
    """Leases, heartbeats and timers of the sending side. Its state is its own set of
    transfers whose lease is being rechecked, and the clock fields of the sender's peer
    records (`skew_*`, `last_heartbeat_sent`); it reads the sender's transfers and
    tombstones, and writes only their lease fields (`lease_until_theirs`, `recheck`)."""

    def __init__(
        self,
        me: LocalIdentity,
        timing: TimingConfig,
        transfers: dict[str, _Outgoing],
        peers: dict[str, _Peer],
        tombstones: Tombstones,
    ) -> None:
        self._me = me
        self._timing = timing
        self._transfers = transfers  # the sender's, as the next three
        self._peers = peers
        self._tombstones = tombstones
        # Ids whose `recheck` waits for a fresh echo, in order (a dict: deterministic).
        self._rechecking: dict[str, None] = {}

    # ----- leases

    def granted(self, sent_at: float | None) -> float:
        """Until when (receiver's clock) a message sent at `sent_at` renews a lease."""
        return float("-inf") if sent_at is None else sent_at + self._timing.lease_s

    def stale_register(self, now: float, peer: str, granted: float) -> str | None:
        """Why a Register from `peer` granting a lease until `granted` is stale (its lease
        certainly ran out already); None: it is not."""
        p = self._peers.get(peer)
        if p is None or p.skew_lb is None or now < granted + p.skew_lb:
            return None
        age = now - p.skew_lb - (granted - self._timing.lease_s)
        return (
            f"Register from {peer} is at least {age:.3f}s old on the receiver's clock, past "
            f"its {self._timing.lease_s}s lease: refused, nothing written"
        )

    def heard(self, now: float, p: _Peer, hb: Heartbeat) -> bool:
        """A heartbeat from receiver `p`: its echo bounds `p`'s clock, and it renews the
        leases of the transfers with `p` it lists. True: the first bound on `p`'s clock
        (writes waited for it)."""
        first_bound = False
        if (
            hb.echo is not None
            and hb.sent_at is not None
            and p.skew_echo < hb.echo <= now  # newer than the one in use, and ours
        ):
            first_bound = p.skew_lb is None
            # The newest round trip, not the tightest ever (clocks of two hosts drift);
            # an old echo repeated later (after an idle spell) is no newer, so ignored.
            p.skew_echo = hb.echo
            p.skew_lb = hb.echo - hb.sent_at
            p.skew_round_trip = now - hb.echo
        granted = self.granted(hb.sent_at)
        for tid in hb.transfer_ids:
            rec = self._transfers.get(tid)
            if rec is not None and rec.peer == p.agent and rec.state is not SenderState.ENDING:
                rec.lease_until_theirs = max(rec.lease_until_theirs, granted)
        return first_bound

    def expires_at(self, rec: _Outgoing) -> float | None:
        """When, on our clock, `rec`'s lease certainly runs out; None while it has no
        receiver or the receiver's clock is not bounded yet."""
        p = self._peers.get(rec.peer) if rec.peer is not None else None
        if p is None or p.skew_lb is None:
            return None
        return rec.lease_until_theirs + p.skew_lb

    def expired(self, now: float, rec: _Outgoing) -> bool:
        """True once the lease has certainly run out on the receiver's clock."""
        if rec.register is None:
            return False
        until = self.expires_at(rec)  # None: no bound yet, and nothing is written either
        return until is not None and now >= until

    def lapsed(
        self, now: float, rec: _Outgoing, detail: str, register: bool
    ) -> list[Effect] | Lapsed:
        """`rec`'s lease looks over: `Lapsed`, unless our bound on the receiver's clock
        may be loose and a fresh one could show it holds: then the heartbeat that asks
        for one (nothing: it was asked for already), and nothing is written meanwhile.

        The bound comes from the newest round trip, and a round trip that waited (the
        receiver starved, a message queued) leaves it too small by that wait. With no
        transfers in flight nothing measures it again, so every later Register would look
        stale, for good. So before failing on a bound measured earlier, we send the
        receiver a heartbeat, which it answers at once with a fresh echo (and the ids it
        still waits for, which renew their leases), and decide on that (`settled`):
        silence meanwhile ends it as any silence does."""
        p = self._peers.get(rec.peer) if rec.peer is not None else None
        if rec.recheck is None and p is not None and p.ready and p.skew_lb is not None:
            rec.recheck = (now, detail, register)
            self._rechecking[rec.transfer_id] = None
            return self.heartbeat(now, p, force=True)
        if rec.recheck is not None and (p is None or p.skew_echo < rec.recheck[0]):
            return []  # the answer is on its way
        if rec.recheck is not None:
            _, detail, register = rec.recheck
        return Lapsed(detail, register)

    def settled(self, now: float, p: _Peer) -> list[tuple[_Outgoing, Lapsed | None]]:
        """A bound on `p`'s clock measured after a recheck was asked for: the transfers
        that waited on it (only those: this runs on every heartbeat from a receiver),
        each with its verdict: `Lapsed`, or None: the lease holds after all (its recheck
        is over). One that is ending meanwhile is only cleared."""
        out: list[tuple[_Outgoing, Lapsed | None]] = []
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
            elif self.expired(now, rec):
                _, detail, register = rec.recheck
                out.append((rec, Lapsed(detail, register)))
            else:
                rec.recheck = None
                out.append((rec, None))
        return out

    def stop_recheck(self, rec: _Outgoing) -> None:
        """`rec` is no longer bound to the receiver whose lease was being rechecked."""
        rec.recheck = None
        self._rechecking.pop(rec.transfer_id, None)

    def clock_bounds(self) -> dict[str, PeerClock]:
        """Per receiver agent whose clock is bounded (a heartbeat round trip came back
        since its handshake): the bound, and how wide it is."""
        return {
            p.agent: PeerClock(p.skew_lb, p.skew_round_trip, p.skew_echo + p.skew_round_trip)
            for p in self._peers.values()
            if p.skew_lb is not None
        }

    # ----- time

    def due(self, now: float) -> list[Due]:
        """What `tick` must end now: transfers whose receiver went silent (silent is not
        dead: they fail, but only once their writes reported), whose deadline passed,
        that no receiver registered or claimed within the claim window, or whose lease
        looks over. Transfers already ending wait for their writes: only the data plane
        ends a write."""
        t = self._timing
        silent: dict[str, str] = {}
        for p in self._peers.values():
            if now - p.last_heard >= t.liveness_timeout_s:
                silent[p.agent] = f"receiver {p.agent} silent for {now - p.last_heard:.3f}s"
        out: list[Due] = []
        for rec in self._transfers.values():
            if rec.state is SenderState.ENDING:
                continue
            if rec.peer is not None and rec.peer in silent:
                out.append(Due(rec, FailureReason.PEER_TIMEOUT, silent[rec.peer]))
            elif now >= rec.deadline:
                detail = f"not finished within {t.transfer_deadline_s}s"
                out.append(Due(rec, FailureReason.DEADLINE_EXCEEDED, detail))
            elif rec.register is None and now >= rec.claim_until:
                detail = (
                    f"no receiver registered or claimed it for {t.claim_window_s}s "
                    "(its receiver died before registering, or never got the request)"
                )
                out.append(Due(rec, FailureReason.PEER_TIMEOUT, detail))
            elif self.expired(now, rec):
                detail = f"lease of {t.lease_s}s not renewed by receiver {rec.peer}"
                out.append(Due(rec, FailureReason.PEER_TIMEOUT, detail, lease=True))
        return out

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
        first_expiry = self._tombstones.first_expiry()
        if first_expiry is not None and not times:
            times.append(first_expiry)
        return min(times) if times else None

    def heartbeat(self, now: float, p: _Peer, *, force: bool = False) -> list[Effect]:
        """Our heartbeat to receiver `p` when one is due (or `force`d), listing the
        transfers we hold with it: it renews nothing of ours, but its echo bounds `p`'s
        clock and its list tells `p` which of its transfers we still hold."""
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
