"""What the sender remembers of transfers that are over, or never began: a tombstone per
ended id, and the Cancels that came before their Register (the rules are in
`kvpush.protocol.state`: "Only a transfer's own counterpart can end it", and
"Tombstones make late, duplicate and reordered messages harmless").

`Tombstones` is an object `SenderProtocol` owns. It remembers and forgets (`expire`),
and answers what it holds; it ends no transfer and sends nothing: a late message finds
its tombstone here, and the sender answers it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from kvpush.errors import FailureReason
from kvpush.protocol._common import _Tombstone
from kvpush.protocol.messages import Message

_K = TypeVar("_K")
_V = TypeVar("_V")

# How many early Cancels are remembered at once.
_MAX_EARLY_CANCELS = 65536


class Tombstones:
    """Ended ids and early Cancels, each remembered `keep_s` (the transfer deadline plus
    a lease: no message about the id can come later)."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._graves: dict[str, _Tombstone] = {}
        # (agent, transfer id) -> forget after: a Cancel from that agent for an id it had
        # not registered (yet). It ends that agent's Register for the id, nobody else's.
        self._early_cancels: dict[tuple[str, str], float] = {}

    def __bool__(self) -> bool:
        return bool(self._graves)

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._graves

    def get(self, transfer_id: str) -> _Tombstone | None:
        return self._graves.get(transfer_id)

    def bury(
        self,
        now: float,
        tid: str,
        peer: str | None,
        reply: Message | None,
        pending_failure: tuple[FailureReason, str] | None = None,
    ) -> None:
        """`tid` ended: `reply` answers `peer`'s late messages; `pending_failure`, for an id
        the engine has not submitted, is what its `submit` ends with."""
        self._graves.pop(tid, None)  # keep insertion order = expiry order
        self._graves[tid] = _Tombstone(peer, reply, now + self.keep_s, pending_failure)

    def unbury(self, tid: str) -> None:
        """Forget `tid`'s tombstone at once (only a mutation of the checker does)."""
        del self._graves[tid]

    def rejected(self, prefixes: tuple[str, ...]) -> list[str]:
        """Ids starting with one of `prefixes` that ended before the engine submitted them
        (a receiver rejected or cancelled them first)."""
        return [
            t
            for t, tomb in self._graves.items()
            if tomb.pending_failure is not None and t.startswith(prefixes)
        ]

    def first_expiry(self) -> float | None:
        """When the oldest tombstone is forgotten; None: there is none."""
        return next(iter(self._graves.values())).expires if self._graves else None

    def remember_cancel(self, now: float, peer: str, tid: str) -> None:
        """`peer` cancelled `tid` before its Register for it came (or it was held)."""
        if len(self._early_cancels) < _MAX_EARLY_CANCELS:
            self._early_cancels.pop((peer, tid), None)  # insertion order = expiry order
            self._early_cancels[(peer, tid)] = now + self.keep_s

    def take_cancel(self, peer: str, tid: str) -> bool:
        """Whether `peer` cancelled `tid` before this Register of it (forgotten now)."""
        return self._early_cancels.pop((peer, tid), None) is not None

    def expire(self, now: float) -> None:
        """Forget the tombstones and early Cancels whose time ran out by `now`."""
        _forget_expired(self._graves, now, lambda tomb: tomb.expires)
        _forget_expired(self._early_cancels, now, lambda until: until)


def _forget_expired(table: dict[_K, _V], now: float, expires: Callable[[_V], float]) -> None:
    """Forget the entries of `table` that expired by `now`, oldest first: every entry
    lives the same time and `now` never goes back, so insertion order is expiry order
    (re-inserted when renewed). Scanning them all each tick cost O(transfers of the last
    minute) and, at thousands of transfers a second, most of the runtime thread's time."""
    while table:
        oldest = next(iter(table))
        if now < expires(table[oldest]):
            break
        del table[oldest]
