"""A request made of several transfers: one result, once.

Where a prefill and a decode run different tensor-parallel sizes, one request's KV
crosses several pairs of ranks (`kvpush.topology.transfer_parts`), each pair a transfer
of its own (a *part*) with every guarantee of the protocol: it ends exactly once, and
only when kvpush no longer touches its blocks. The engine, though, knows the request:
its blocks are shared by every part that touches them on a rank (a decode rank's block
holds the heads of two prefill ranks; a prefill rank's block is read by the parts for
two decode ranks), and it hands them back when the request is reported. `RequestParts`
turns the ends of the parts into the request's one result, by these rules:

- A request ends once every part it opened has ended: finished when all of them
  finished, failed when any failed (the first failure names the reason).
- The first part that fails asks for every other part still open to be aborted at once
  (they can no longer make the request whole); the request still waits for them to end,
  since each part's end is the protocol's word that nothing of it touches the blocks
  any more. So no part writes into a decode block after its request's result, and no
  prefill block is handed back while a write of any part still reads it.
- A part the runtime refused at the call never started: the request fails, the parts
  already started are aborted, and it ends when they have (at once if none had).

Pure, like the rest of this package: no I/O, no clock. The caller aborts the parts a
`PartsOutcome` names and reports the `RequestEnded` it carries, if any.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpush.errors import FailureReason, LocalProtocolError
from kvpush.protocol._common import Side


@dataclass(frozen=True, slots=True)
class RequestEnded:
    """The request's one result on this side: every part of it has ended."""

    request_id: str
    transfer_id: str  # the request's transfer (its parts' ids are derived from it)
    side: Side
    reason: FailureReason | None  # None: every part finished
    detail: str
    num_parts: int

    @property
    def ok(self) -> bool:
        return self.reason is None


@dataclass(frozen=True, slots=True)
class PartsOutcome:
    """What the end of a part (or the opening of a request) asks of the caller."""

    abort: tuple[str, ...] = ()  # parts to abort now: the request failed
    ended: RequestEnded | None = None  # the request's result, to report now


@dataclass(slots=True)
class _Open:
    request_id: str
    transfer_id: str
    open_parts: list[str]  # started and not ended yet, in the order they started
    num_parts: int
    reason: FailureReason | None = None  # the first failure, if any
    detail: str = ""


class RequestParts:
    """The open requests of one side (sender or receiver) of one rank."""

    def __init__(self, side: Side) -> None:
        self.side: Side = side
        self._requests: dict[str, _Open] = {}  # transfer id -> its request
        self._part_of: dict[str, str] = {}  # part id -> the transfer id it is part of

    def open(
        self,
        request_id: str,
        transfer_id: str,
        started: Sequence[str],
        refused: str | None = None,
    ) -> PartsOutcome:
        """A request whose parts `started` were handed to the runtime; `refused`: why
        the runtime refused the next one at the call (the rest were not tried)."""
        if transfer_id in self._requests:
            raise LocalProtocolError(f"transfer {transfer_id} is open already ({self.side})")
        taken = [p for p in started if p in self._part_of]
        if taken or len(set(started)) != len(started):
            raise LocalProtocolError(
                f"transfer {transfer_id}: parts {sorted(set(taken)) or list(started)} are "
                f"open already or named twice ({self.side})"
            )
        request = _Open(
            request_id, transfer_id, list(started), len(started) + (refused is not None)
        )
        if refused is not None:
            request.reason, request.detail = FailureReason.LOCAL_ERROR, refused
        if not started:
            if self.side == "sender" and refused is None:
                # Nothing of this rank's blocks goes anywhere: sent, at once.
                return PartsOutcome(ended=self._result(request, None, ""))
            detail = refused if refused is not None else "no part to move on this rank"
            return PartsOutcome(ended=self._result(request, FailureReason.LOCAL_ERROR, detail))
        self._requests[transfer_id] = request
        for part in started:
            self._part_of[part] = transfer_id
        abort = tuple(started) if refused is not None else ()
        return PartsOutcome(abort=abort)

    def part_ended(self, part_id: str, reason: FailureReason | None, detail: str) -> PartsOutcome:
        """Part `part_id` ended (the runtime's result, exactly once per part). A part
        this object never opened is not ours: nothing to do."""
        tid = self._part_of.pop(part_id, None)
        if tid is None:
            return PartsOutcome()
        request = self._requests[tid]
        request.open_parts.remove(part_id)
        abort: tuple[str, ...] = ()
        if reason is not None and request.reason is None:
            request.reason, request.detail = reason, f"part {part_id}: {detail}"
            abort = tuple(request.open_parts)  # they cannot make the request whole now
        if request.open_parts:
            return PartsOutcome(abort=abort)
        del self._requests[tid]
        return PartsOutcome(
            abort=abort, ended=self._result(request, request.reason, request.detail)
        )

    def ended_at_once(self, request_id: str, detail: str) -> RequestEnded:
        """A request that cannot open any part (its params are unusable, or it was
        split for another shape): it fails at once, `detail` saying why."""
        request = _Open(request_id, "", [], 0)
        return self._result(request, FailureReason.LOCAL_ERROR, detail)

    def transfer_of(self, part_id: str) -> str | None:
        """The transfer id whose request an open part belongs to, if it is ours."""
        return self._part_of.get(part_id)

    def num_parts(self, transfer_id: str) -> int:
        """How many parts the open request of `transfer_id` was opened with (0: none)."""
        request = self._requests.get(transfer_id)
        return 0 if request is None else request.num_parts

    def request_of(self, part_id: str) -> str | None:
        """The request id of an open part, if it is one of ours."""
        tid = self._part_of.get(part_id)
        return None if tid is None else self._requests[tid].request_id

    def open_parts(self, transfer_id: str) -> tuple[str, ...]:
        """The parts of `transfer_id` not ended yet (none if it is not open)."""
        request = self._requests.get(transfer_id)
        return () if request is None else tuple(request.open_parts)

    def __len__(self) -> int:
        return len(self._requests)

    def _result(self, request: _Open, reason: FailureReason | None, detail: str) -> RequestEnded:
        return RequestEnded(
            request.request_id, request.transfer_id, self.side, reason, detail, request.num_parts
        )
