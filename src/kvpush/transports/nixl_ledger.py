"""What a NIXL endpoint posted and what became of it: the writes in flight (each with
its NIXL handle, released exactly once), the events owed to the endpoint's owner at its
next `poll()`, and the counts `statistics()` reports.

The ledger makes no NIXL call but to check and release a write's handle; the endpoint
posts, and tells the ledger what happened.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kvpush.errors import FailureReason
from kvpush.transports.base import TransportEvent, WriteDone, WriteFailed
from kvpush.transports.nixl_calls import WriteCalls, release_quietly


@dataclasses.dataclass(slots=True)
class InFlight:
    """A write NIXL accepted, until `poll()` sees it end."""

    write_id: int
    peer: str
    handle: Any  # nixl_xfer_handle
    nbytes: int = 0  # what it moves, and in how many descriptors (`WriteDone`)
    descriptors: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class NixlStatistics:
    writes_posted: int
    writes_done: int
    writes_failed: int
    writes_in_flight: int
    bytes_posted: int
    descriptors_posted: int  # after merging contiguous blocks
    last_write_descriptors: int
    last_write_block_descriptors: int  # before merging: blocks x regions
    messages_sent: int
    messages_received: int


class Ledger:
    """The writes in flight, the events not yet polled and the counts of one endpoint."""

    def __init__(self) -> None:
        self.in_flight: dict[int, InFlight] = {}
        self.events: list[TransportEvent] = []
        self.posted = self.done = self.failed = 0
        self.bytes_posted = self.descriptors_posted = 0
        self.last_descriptors = self.last_block_descriptors = 0
        self.messages_sent = self.messages_received = 0

    def __contains__(self, write_id: int) -> bool:
        return write_id in self.in_flight

    def track(self, write_id: int, peer: str, handle: Any, nbytes: int, descriptors: int) -> None:
        """A write NIXL accepted: in flight until `check` sees it end."""
        self.in_flight[write_id] = InFlight(write_id, peer, handle, nbytes, descriptors)

    def done_at_once(self, write_id: int) -> None:
        """A write that moves nothing: posted and done at once."""
        self.posted += 1
        self.done += 1
        self.events.append(WriteDone(write_id))

    def fail(self, write_id: int, reason: FailureReason, detail: str) -> None:
        """A write that failed before it was in flight."""
        self.failed += 1
        self.events.append(WriteFailed(write_id, reason, detail))

    def fail_peer(self, peer: str) -> None:
        """Every write in flight to `peer`, which was removed, fails."""
        for write_id, w in list(self.in_flight.items()):
            if w.peer == peer:
                release_quietly(w.handle)
                del self.in_flight[write_id]
                self.fail(write_id, FailureReason.PEER_GONE, f"peer {peer} was removed")

    def take_events(self) -> list[TransportEvent]:
        events = self.events
        self.events = []
        return events

    def check(
        self,
        calls: WriteCalls,
        reason_of: Callable[[BaseException], FailureReason],
        events: list[TransportEvent],
    ) -> None:
        """Ask NIXL how each write in flight is doing; those that ended go into `events`."""
        for write_id, w in list(self.in_flight.items()):
            try:
                state = calls.state(w.handle)
                detail = "NIXL reported the write failed"
            except Exception as exc:
                state = "ERR"
                detail = f"NIXL reported the write failed: {exc!r}"
                reason = reason_of(exc)
            else:
                reason = FailureReason.WRITE_ERROR
            if state == "PROC":
                continue
            del self.in_flight[write_id]
            release_quietly(w.handle)
            if state == "DONE":
                self.done += 1
                events.append(WriteDone(write_id, w.nbytes, w.descriptors))
            else:
                self.failed += 1
                events.append(WriteFailed(write_id, reason, f"write to {w.peer}: {detail}"))

    def release_in_flight(self) -> None:
        """The endpoint closes: every handle in flight is released, none reported."""
        for w in self.in_flight.values():
            release_quietly(w.handle)
        self.in_flight.clear()

    def statistics(self) -> NixlStatistics:
        return NixlStatistics(
            writes_posted=self.posted,
            writes_done=self.done,
            writes_failed=self.failed,
            writes_in_flight=len(self.in_flight),
            bytes_posted=self.bytes_posted,
            descriptors_posted=self.descriptors_posted,
            last_write_descriptors=self.last_descriptors,
            last_write_block_descriptors=self.last_block_descriptors,
            messages_sent=self.messages_sent,
            messages_received=self.messages_received,
        )
