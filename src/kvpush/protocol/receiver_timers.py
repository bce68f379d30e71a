"""The receiver's timers (the rules are in `kvpush.protocol.state`, "The fencing rules"
and "Leases measured on the receiver's clock"): a sender gone silent, a transfer past
its deadline, a fence that ran out, a Cancel to send again, the ended ids to forget, and
when `tick` next has something to do.

`ReceiverTimers` is an object `ReceiverProtocol` owns. It answers with what is due
(`silent`, then `due`) and ends nothing: the receiver fences or ends the transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.config import TimingConfig
from kvpush.protocol._common import ReceiverState, _Incoming, _Peer
from kvpush.protocol.claims import Claims
from kvpush.protocol.lookups import Lookups


@dataclass(frozen=True, slots=True)
class Silent:
    """Sender `agent` was silent past the liveness timeout (`detail` says how long): its
    transfers `waiting` for their blocks fence, and its cached handshake is not trusted
    for a new transfer."""

    agent: str
    detail: str
    waiting: tuple[_Incoming, ...]


@dataclass(frozen=True, slots=True)
class Overdue:
    """`rec` passed its deadline; `handshaking`: before its Register went out."""

    rec: _Incoming
    detail: str
    handshaking: bool


@dataclass(frozen=True, slots=True)
class FenceOver:
    """`rec`'s fence ran out: it ends as it was fenced."""

    rec: _Incoming


@dataclass(frozen=True, slots=True)
class CancelAgain:
    """`rec` is fenced and its sender has not confirmed: our Cancel goes again."""

    rec: _Incoming


class ReceiverTimers:
    """The timers of one receiver, over its transfers, peers, claims, book and ended ids
    (all the receiver's, read here; only the ended ids are forgotten here)."""

    def __init__(
        self,
        timing: TimingConfig,
        transfers: dict[str, _Incoming],
        peers: dict[str, _Peer],
        claims: Claims,
        book: Lookups,
        ended: dict[str, float],
    ) -> None:
        self._timing = timing
        self._transfers = transfers
        self._peers = peers
        self._claims = claims
        self._book = book
        self._ended = ended  # transfer id -> forget after, oldest first

    def silent(self, now: float) -> list[Silent]:
        """The senders with transfers here that were silent past the liveness timeout."""
        out: list[Silent] = []
        for p in list(self._peers.values()):
            live = [r for r in self._transfers.values() if r.peer == p.agent]
            if live and now - p.last_heard >= self._timing.liveness_timeout_s:
                detail = f"sender {p.agent} silent for {now - p.last_heard:.3f}s"
                waiting = tuple(r for r in live if r.state is ReceiverState.WAITING)
                out.append(Silent(p.agent, detail, waiting))
        return out

    def due(self, now: float) -> list[Overdue | FenceOver | CancelAgain]:
        """The transfers whose deadline, fence or Cancel interval came by `now`."""
        t = self._timing
        out: list[Overdue | FenceOver | CancelAgain] = []
        for rec in list(self._transfers.values()):
            if rec.state is not ReceiverState.FENCING and now >= rec.deadline:
                detail = f"not finished within {t.transfer_deadline_s}s"
                handshaking = rec.state is ReceiverState.HANDSHAKING
                if handshaking:
                    detail += f" (the handshake with {rec.address} did not finish)"
                out.append(Overdue(rec, detail, handshaking))
            elif rec.state is ReceiverState.FENCING:
                assert rec.reason is not None
                if now >= rec.fence_until:
                    out.append(FenceOver(rec))
                elif (
                    rec.peer in self._peers
                    and now >= rec.cancel_sent_at + t.heartbeat_interval_s
                    and rec.peer is not None
                ):
                    out.append(CancelAgain(rec))
        return out

    def forget_ended(self, now: float) -> None:
        """Forget the ended ids whose time ran out (oldest first, as the sender's
        tombstones): a new transfer may use them again."""
        ended = self._ended
        while ended:
            oldest = next(iter(ended))
            if now < ended[oldest]:
                break
            del ended[oldest]

    def next_deadline(self) -> float | None:
        """When `tick` next has something to do; None: nothing is in flight."""
        t = self._timing
        times: list[float] = []
        for rec in self._transfers.values():
            if rec.state is ReceiverState.HANDSHAKING:
                times.append(rec.deadline)
            elif rec.state is ReceiverState.WAITING:
                times += [rec.deadline, rec.register_sent_at + t.heartbeat_interval_s]
            else:
                times += [rec.fence_until, rec.cancel_sent_at + t.heartbeat_interval_s]
        for p in self._peers.values():
            if any(r.peer == p.agent for r in self._transfers.values()):
                times.append(p.last_heard + t.liveness_timeout_s)
                times.append(p.last_heartbeat_sent + t.heartbeat_interval_s)
            elif self._claims and self._claims.from_agent(p.agent, self._book):
                times.append(p.last_heartbeat_sent + t.heartbeat_interval_s)
        if self._claims:
            times.append(self._claims.earliest())
        if self._ended and not times:
            times.append(next(iter(self._ended.values())))
        return min(times) if times else None
