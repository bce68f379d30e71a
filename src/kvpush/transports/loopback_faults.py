"""The faults a `LoopbackFabric` injects, as an object that answers what happens next.

A test asks the fabric for faults per directed link (src -> dst); they apply to the next
`count` messages that match: `drop`, `duplicate`, `delay` (held for `delay_s` of the
fabric's clock, or until `release_delayed()`), `reorder` (held until the next message on
that link has been delivered). `fail_writes` makes the next writes on a link fail (after
copying part of the blocks, if `partial`). `partition`/`heal` cut and restore a pair of
endpoints both ways.

`FaultPlan` keeps those rules, the cuts and the messages held for reordering. It owns no
endpoint, inbox or lock: the fabric asks it, under the fabric's lock, for the fault that
applies to the next message or write on a link (which uses up one of that rule's count),
and acts on the answer itself.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Generic, TypeVar

from kvpush.errors import FailureReason

Link = tuple[str, str]
# A message held for reordering, as the fabric carries it.
Held = TypeVar("Held")


class Fault(enum.Enum):
    DROP = "drop"
    DUPLICATE = "duplicate"
    DELAY = "delay"
    REORDER = "reorder"


@dataclasses.dataclass(slots=True)
class MessageFault:
    fault: Fault
    remaining: int
    match: Callable[[bytes], bool] | None
    delay_s: float


@dataclasses.dataclass(slots=True)
class WriteFault:
    remaining: int
    partial: bool
    reason: FailureReason


class FaultPlan(Generic[Held]):
    """The injected faults, per link; not thread-safe (the fabric's lock guards it)."""

    def __init__(self) -> None:
        self._messages: dict[Link, list[MessageFault]] = {}
        self._writes: dict[Link, list[WriteFault]] = {}
        self._cuts: set[frozenset[str]] = set()
        self._reordered: dict[Link, list[Held]] = {}

    def add_message_fault(
        self,
        src: str,
        dst: str,
        fault: Fault,
        count: int,
        match: Callable[[bytes], bool] | None,
        delay_s: float,
    ) -> None:
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        if delay_s < 0:
            raise ValueError(f"delay_s must not be negative, got {delay_s}")
        self._messages.setdefault((src, dst), []).append(MessageFault(fault, count, match, delay_s))

    def add_write_fault(
        self, src: str, dst: str, count: int, partial: bool, reason: FailureReason
    ) -> None:
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        self._writes.setdefault((src, dst), []).append(WriteFault(count, partial, reason))

    def clear(self) -> None:
        """Forget the message and write rules (not the cuts, nor what is held)."""
        self._messages.clear()
        self._writes.clear()

    def cut(self, a: str, b: str) -> None:
        self._cuts.add(frozenset((a, b)))

    def heal(self, a: str, b: str) -> None:
        self._cuts.discard(frozenset((a, b)))

    def is_cut(self, a: str, b: str) -> bool:
        return frozenset((a, b)) in self._cuts

    def message_fault(self, link: Link, payload: bytes) -> MessageFault | None:
        """The fault for this message on `link`, if a rule matches it: the first rule that
        does, one of whose count this message uses up."""
        rules = self._messages.get(link, [])
        for rule in rules:
            if rule.match is None or rule.match(payload):
                rule.remaining -= 1
                if rule.remaining == 0:
                    rules.remove(rule)
                return rule
        return None

    def write_fault(self, link: Link) -> WriteFault | None:
        """The failure for the next write on `link`, if one was asked for."""
        rules = self._writes.get(link)
        if not rules:
            return None
        rule = rules[0]
        rule.remaining -= 1
        if rule.remaining == 0:
            rules.pop(0)
        return rule

    def hold_for_reorder(self, link: Link, message: Held) -> None:
        self._reordered.setdefault(link, []).append(message)

    def after_delivery(self, link: Link) -> list[Held]:
        """What was held for reordering on `link`: it goes right after the message just
        delivered on it."""
        return self._reordered.pop(link, [])

    def release_reordered(self, src: str | None, dst: str | None) -> list[tuple[Link, list[Held]]]:
        """Every message held for reordering on links that match (None matches any)."""
        links = [
            link
            for link in self._reordered
            if (src is None or link[0] == src) and (dst is None or link[1] == dst)
        ]
        return [(link, self._reordered.pop(link)) for link in links]

    def held_count(self) -> int:
        return sum(len(v) for v in self._reordered.values())
