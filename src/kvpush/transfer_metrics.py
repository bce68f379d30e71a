"""How an ended transfer is counted: the one rule every layer that reports transfers uses.

A transfer that ended is counted once by side (`sender`/`receiver`), outcome (`finished`
or `failed`) and failure reason (`""` when it finished); only a finished one adds its
bytes and its duration. Where the counts go is the caller's: a `TransferMetricsSink`
(the serving stack's Prometheus registry, the vLLM connector's per-interval stats).
"""

from __future__ import annotations

from typing import Protocol

from kvpush.errors import FailureReason
from kvpush.protocol import TransferEnded

FINISHED = "finished"
FAILED = "failed"


class TransferMetricsSink(Protocol):
    """Where transfer metrics go."""

    def count_ended(self, side: str, outcome: str, reason: str) -> None: ...

    def add_bytes(self, side: str, nbytes: int) -> None: ...

    def observe_seconds(self, side: str, seconds: float) -> None: ...


def outcome_of(result: TransferEnded) -> tuple[str, str]:
    """`(outcome, reason)` labels of an ended transfer."""
    if result.ok:
        return FINISHED, ""
    reason = result.reason.value if result.reason is not None else ""
    return FAILED, reason


def record_ended(
    sink: TransferMetricsSink, result: TransferEnded, *, seconds: float, bytes_per_block: int
) -> None:
    """Count `result`; a finished transfer also adds the bytes it moved (its
    `blocks_moved`, not the blocks it held: a prefix-cache hit moves fewer) and the
    `seconds` it took."""
    outcome, reason = outcome_of(result)
    sink.count_ended(result.side, outcome, reason)
    if result.ok:
        sink.add_bytes(result.side, result.blocks_moved * bytes_per_block)
        sink.observe_seconds(result.side, seconds)


def record_failed_at_once(sink: TransferMetricsSink, side: str) -> None:
    """Count a transfer that failed before the runtime took it (unusable params, say)."""
    sink.count_ended(side, FAILED, FailureReason.LOCAL_ERROR.value)


__all__ = [
    "FAILED",
    "FINISHED",
    "TransferMetricsSink",
    "outcome_of",
    "record_ended",
    "record_failed_at_once",
]
