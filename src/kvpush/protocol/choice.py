"""Which receiver a sender transfer goes to (the rules are in `kvpush.protocol.state`,
"Who sent it" and "Claims"): the decode server the engine names at `submit`, the
Registers held until then, and the receivers' claims on a transfer nobody registered
for yet.

`ReceiverChoice` is an object `SenderProtocol` owns. It answers (may this agent take
the transfer, which Registers were held, whom a claim came from, what a refused
receiver is told) and keeps the fields of a transfer that say so (`receiver`, `held`,
`claim_until`, `claimer`), and the ids claimed before the engine submitted them
(`early`); it registers nothing and ends nothing: the sender acts.
"""

from __future__ import annotations

from kvpush.config import TimingConfig
from kvpush.errors import FailureReason
from kvpush.protocol._common import PeerAddress, SenderState, _Outgoing, _Peer
from kvpush.protocol.messages import Failed, Register

# Registers from other receivers held per transfer until its submit (see `_Outgoing.held`).
_MAX_HELD_REGISTERS = 4
# How many ids claimed before their submit are remembered at once.
_MAX_EARLY_CLAIMS = 65536


class ReceiverChoice:
    """The receivers a sender's transfers may go to. It reads the sender's peers (where
    each was vouched for) and writes only a transfer's choice fields."""

    def __init__(self, timing: TimingConfig, peers: dict[str, _Peer]) -> None:
        self._timing = timing
        self._peers = peers  # the sender's
        # Transfer id -> forget after: ids a receiver's heartbeat claimed before the
        # engine submitted them, renewed by each such heartbeat (insertion order is
        # expiry order: every entry lives one liveness timeout).
        self._early: dict[str, float] = {}

    def submitted(self, now: float, rec: _Outgoing, receiver: PeerAddress | None) -> None:
        """The engine submitted `rec`, naming `receiver` (None: any); a claim window opens,
        and a claim of it from before no longer counts as early: its claims keep it now."""
        self._early.pop(rec.transfer_id, None)
        if receiver is not None:
            rec.receiver = _server(receiver)
        if self._timing.claim_window_s is not None:
            rec.claim_until = now + self._timing.claim_window_s

    def is_for(self, rec: _Outgoing, peer: str) -> bool:
        """Whether `peer` is a receiver `rec` may go to (the one named at submit)."""
        if rec.receiver is None:
            return True
        p = self._peers.get(peer)
        return p is not None and p.address is not None and _server(p.address) == rec.receiver

    @staticmethod
    def refusal(peer: str, rec: _Outgoing) -> Failed:
        """What a receiver that is not the one named at submit is told."""
        assert rec.receiver is not None
        host, port = rec.receiver
        detail = (
            f"transfer {rec.transfer_id!r} is for the decode server whose side channel is "
            f"{PeerAddress(host, port)} (named by its sender), not receiver {peer}"
        )
        return Failed(rec.transfer_id, FailureReason.MALFORMED_MESSAGE, detail)

    def unbind_unnamed(self, rec: _Outgoing) -> str | None:
        """At submit: the receiver bound before it, unbound unless it is the one named
        (returned: it is to be refused); None: it stays, or there is none."""
        if rec.register is None or rec.peer is None or self.is_for(rec, rec.peer):
            return None
        peer = rec.peer
        rec.register, rec.peer = None, None
        rec.lease_until_theirs = float("-inf")
        rec.state = SenderState.AWAITING_REGISTER
        return peer

    @staticmethod
    def take_held(rec: _Outgoing) -> list[tuple[str, Register]]:
        """The Registers held until submit, in the order they came (no longer held)."""
        held, rec.held = rec.held, []
        return held

    @staticmethod
    def hold(rec: _Outgoing, peer: str, msg: Register) -> bool:
        """Hold `peer`'s Register for `rec`, not submitted yet and registered by another
        receiver, until submit names the one (a second copy is not held again). False:
        no room; the id is taken for `peer`."""
        if len(rec.held) >= _MAX_HELD_REGISTERS:
            return False
        if all(p != peer for p, _ in rec.held):
            rec.held.append((peer, msg))
        return True

    @staticmethod
    def withdraw_held(rec: _Outgoing | None, peer: str) -> bool:
        """`peer` cancelled: its held Register for `rec` is dropped (False: none held)."""
        if rec is None or all(p != peer for p, _ in rec.held):
            return False
        rec.held = [(p, m) for p, m in rec.held if p != peer]
        return True

    def claimed(self, now: float, rec: _Outgoing | None, peer: str) -> None:
        """`peer`'s heartbeat claims `rec`: a submitted transfer nobody registered for,
        and that `peer` may take, keeps its claim window open, with `peer` as claimer."""
        window = self._timing.claim_window_s
        if (
            window is not None
            and rec is not None
            and rec.register is None
            and rec.blocks is not None
            and rec.state is not SenderState.ENDING
            and self.is_for(rec, peer)
        ):
            rec.claim_until = max(rec.claim_until, now + window)
            rec.claimer = peer

    def claimed_early(self, now: float, tid: str) -> None:
        """A believed receiver's heartbeat claims `tid`, which the engine has not
        submitted (nor ended): remembered a liveness timeout, so that an engine that
        learns the receiver's shape from the part ids it names (`early`) can split and
        submit it. It keeps nothing alive: there is nothing to keep yet."""
        if tid in self._early or len(self._early) < _MAX_EARLY_CLAIMS:
            self._early.pop(tid, None)  # insertion order = expiry order
            self._early[tid] = now + self._timing.liveness_timeout_s

    def early(self, prefixes: tuple[str, ...]) -> list[str]:
        """The ids starting with one of `prefixes` claimed before their submit, and
        remembered still."""
        return [t for t in self._early if t.startswith(prefixes)]

    def expire(self, now: float) -> None:
        """Forget the early claims no heartbeat renewed for a liveness timeout."""
        early = self._early
        while early:
            oldest = next(iter(early))
            if now < early[oldest]:
                break
            del early[oldest]

    @staticmethod
    def claimed_by(transfers: dict[str, _Outgoing], peer: str) -> list[_Outgoing]:
        """The transfers nobody registered for whose last claim came from `peer`."""
        return [
            rec
            for rec in transfers.values()
            if rec.claimer == peer and rec.register is None and rec.state is not SenderState.ENDING
        ]


def _server(address: PeerAddress) -> tuple[str, int]:
    """A decode server as a transfer names it: its side channel's host (as spelt,
    without brackets, in lower case) and port; the rank is not part of it."""
    return address.host.strip("[]").lower(), address.port
