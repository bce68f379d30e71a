"""A worker rank's books of requests: on each side, the requests whose parts have not all
ended (`kvpush.protocol.parts.RequestParts`, the one rule that turns parts into a
request's result), when each was opened, and the requests that ended at the call,
reported with the next results; and vLLM's view of a request's one result
(`report`). `RequestBooks` answers and runs nothing: the worker opens and aborts parts
on its runtime as the answers say.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpush.integrations.vllm.plan import StepResults
from kvpush.protocol.parts import RequestEnded, RequestParts

if TYPE_CHECKING:
    from kvpush.protocol import Side
    from kvpush.runtime import TransferResult


@dataclass(frozen=True, slots=True)
class PartEnded:
    """What one part's end means for its request: the request's id and how long ago it
    was opened, how many parts it has, the parts to abort now (the first failure ends
    the others) and, once every part ended, the request's result."""

    request_id: str | None
    seconds: float
    parts: int
    abort: tuple[str, ...]
    request: RequestEnded | None


class RequestBooks:
    """Both sides' books of one worker rank."""

    def __init__(self) -> None:
        self._books: dict[Side, RequestParts] = {
            "receiver": RequestParts("receiver"),
            "sender": RequestParts("sender"),
        }
        self._opened_at: dict[tuple[Side, str], float] = {}
        self._at_once: list[RequestEnded] = []

    def __bool__(self) -> bool:
        """Whether a request of either side has a part still open."""
        return any(self._books.values())

    def open_parts(self, side: Side, transfer_id: str) -> tuple[str, ...]:
        return self._books[side].open_parts(transfer_id)

    def holds(self, side: Side, transfer_id: str) -> bool:
        """Whether a request of `side` has parts of `transfer_id` open."""
        return bool(self._books[side].num_parts(transfer_id))

    def holds_part(self, side: Side, part_id: str) -> bool:
        """Whether a request of `side` has the part `part_id` open."""
        return self._books[side].transfer_of(part_id) is not None

    def sending(self) -> list[str]:
        """The transfer ids of the sends open now."""
        return [tid for side, tid in self._opened_at if side == "sender"]

    def taken(self, side: Side, transfer_id: str, part_ids: Iterable[str]) -> str | None:
        """Why a request of `side` may not open `transfer_id` (or these parts of it):
        another request of ours holds it. Two requests that name one transfer (a router
        that reused an `X-Request-Id` for the same prompt) must not share its parts,
        nor its result. None: it may."""
        book = self._books[side]
        if not book.num_parts(transfer_id) and all(
            book.transfer_of(pid) is None for pid in part_ids
        ):
            return None
        return (
            f"transfer {transfer_id} is in flight already for another request on this "
            f"{side}: a transfer id names one request (a router that reuses a request "
            "id for the same prompt gets the second refused)"
        )

    def opened(
        self,
        side: Side,
        request_id: str,
        transfer_id: str,
        started: list[str],
        refused: str | None,
        now: float,
    ) -> tuple[str, ...] | None:
        """A request opened `started` (its other parts were `refused` at the call, if
        so, saying why): the parts to abort now, or None if the request ended at once
        (no part started, or one was refused: `RequestParts.open`)."""
        outcome = self._books[side].open(request_id, transfer_id, started, refused)
        if outcome.ended is not None:
            self._at_once.append(outcome.ended)
            return None
        self._opened_at[(side, transfer_id)] = now
        return tuple(outcome.abort)

    def end_at_once(self, side: Side, request_id: str, detail: str) -> None:
        """A request with no part to open: it fails (it ends, on a sender) at once."""
        self._at_once.append(self._books[side].ended_at_once(request_id, detail))

    def take_ended_at_once(self) -> list[RequestEnded]:
        """The requests that ended at the call since the last time, once each."""
        out, self._at_once = self._at_once, []
        return out

    def part_ended(self, result: TransferResult, now: float) -> PartEnded | None:
        """A part's result (None: not a part of ours)."""
        book = self._books[result.side]
        tid = book.transfer_of(result.transfer_id)
        if tid is None:
            return None
        opened = self._opened_at[(result.side, tid)]
        parts = book.num_parts(tid)
        rid = book.request_of(result.transfer_id)
        outcome = book.part_ended(result.transfer_id, result.reason, result.detail)
        if outcome.ended is not None:
            del self._opened_at[(result.side, tid)]
        return PartEnded(rid, now - opened, parts, tuple(outcome.abort), outcome.ended)


def report(request: RequestEnded, out: StepResults) -> None:
    """vLLM's view of a request's one result: a send ended either way frees the
    prefill's blocks; a receive that failed is also in `failed_recving`."""
    if request.side == "sender":
        out.finished_sending.add(request.request_id)
        return
    out.finished_recving.add(request.request_id)
    if not request.ok:
        out.failed_recving.add(request.request_id)
