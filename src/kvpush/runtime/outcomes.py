"""Where the driver's outcomes go (`Sink`), and what a sending transfer's writes measured
on the way there (`WriteLedger`).

The driver builds no result: every one is a `TransferEnded` from the protocol, handed to
`Sink.report` with its `WritesMeasured` if it wrote. The ledger times each
`write_blocks` call (posting) and each write's end as a poll saw it (the data plane
busy), per transfer id; a write is charged to the tally of the transfer that posted it,
so one ending after its transfer did (the peer gone) counts into no later transfer of
that id. Touched only by whoever holds the driver's pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpush.errors import FailureReason
from kvpush.protocol import TransferEnded
from kvpush.runtime.values import WritesMeasured

__all__ = ["Sink", "WriteLedger"]


@dataclass(frozen=True, slots=True)
class Sink:
    """Where the driver's outcomes go (the facade's result queue and counters): each
    result with what its writes measured, if it wrote."""

    report: Callable[[TransferEnded, WritesMeasured | None], None]
    counters: Callable[[], dict[str, object]]  # the facade's part of a statistics snapshot
    # Last resort after the thread stopped: fail whatever the engine still waits for
    # (only if the protocol could not end it, its state broken by a crash).
    fail_remaining: Callable[[FailureReason, str], None]


@dataclass(slots=True)
class _WriteTally:
    """One sending transfer's writes so far, for its `WritesMeasured`."""

    writes: int = 0
    descriptors: int = 0
    nbytes: int = 0
    post_s: float = 0.0
    busy_s: float = 0.0
    in_flight: int = 0
    busy_since: float = 0.0

    def posted(self, began: float, returned: float) -> None:
        """A write was handed to the data plane between `began` and `returned`."""
        self.writes += 1
        self.post_s += returned - began
        if not self.in_flight:
            self.busy_since = began
        self.in_flight += 1

    def ended(self, at: float, nbytes: int = 0, descriptors: int = 0) -> None:
        """One of its writes was seen to end at `at` (what it moved, if it completed)."""
        self.nbytes += nbytes
        self.descriptors += descriptors
        self.in_flight -= 1
        if not self.in_flight:
            self.busy_s += at - self.busy_since

    def measured(self) -> WritesMeasured:
        return WritesMeasured(self.writes, self.descriptors, self.nbytes, self.post_s, self.busy_s)


class WriteLedger:
    """The protocol's writes in flight (by write id), the bytes the completed ones
    moved, and each sending transfer's tally until its result is reported."""

    def __init__(self) -> None:
        self._nbytes: dict[int, int] = {}  # write id -> bytes it moves, while in flight
        self._tallies: dict[str, _WriteTally] = {}  # transfer id -> its writes so far
        self._tally_of: dict[int, _WriteTally] = {}  # write id -> the tally it counts in
        self.bytes_written = 0

    @property
    def in_flight(self) -> bool:
        return bool(self._nbytes)

    def posted(
        self, transfer_id: str, write_id: int, nbytes: int, began: float, returned: float
    ) -> None:
        """`write_blocks` accepted write `write_id` of `transfer_id` (`nbytes` of ours),
        called at `began` and returned at `returned` (`time.perf_counter()`)."""
        tally = self._tallies.get(transfer_id)
        if tally is None:
            tally = self._tallies[transfer_id] = _WriteTally()
        tally.posted(began, returned)
        self._tally_of[write_id] = tally
        self._nbytes[write_id] = nbytes

    def done(self, write_id: int, nbytes: int, descriptors: int) -> None:
        """The data plane reported the write complete (what it moved, as it counted)."""
        self.bytes_written += self._nbytes.pop(write_id, 0)
        self._ended(write_id, nbytes, descriptors)

    def failed(self, write_id: int) -> None:
        self._nbytes.pop(write_id, None)
        self._ended(write_id)

    def measured(self, transfer_id: str) -> WritesMeasured | None:
        """A sending transfer ended: what its writes measured (None if it wrote none)."""
        tally = self._tallies.pop(transfer_id, None)
        return None if tally is None else tally.measured()

    def _ended(self, write_id: int, nbytes: int = 0, descriptors: int = 0) -> None:
        tally = self._tally_of.pop(write_id, None)
        if tally is not None:
            tally.ended(time.perf_counter(), nbytes, descriptors)
