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


# How vLLM's NIXL connector metrics (`vllm:nixl_num_failed_transfers`,
# `vllm:nixl_num_kv_expired_reqs`) count a transfer that failed.
NIXL_FAILED = "failed"
NIXL_EXPIRED = "expired"
# Ended by a decision of the engines, not by the data plane or a peer: the engine's
# abort, its own shutdown, a decode that refused the transfer (it needed nothing, its
# prefix cache holding every block; or it cannot take it, which it counts itself).
_NOT_FAILURES = frozenset({FailureReason.CANCELLED, FailureReason.SHUTDOWN, FailureReason.REJECTED})
# A sender that held its blocks for a receiver which did not take them in time: vLLM's
# "KV expired" (the prefill's lease on its blocks ran out, the decode never read them).
_EXPIRED = frozenset({FailureReason.DEADLINE_EXCEEDED, FailureReason.PEER_TIMEOUT})


def nixl_failure(side: str, reason: FailureReason | None) -> str | None:
    """How a failed transfer on `side` counts in vLLM's NIXL metrics: `NIXL_EXPIRED` (a
    sender whose receiver did not take its blocks before its deadline or lease ran out,
    or went silent), `NIXL_FAILED` (anything else the data plane, a peer or the
    protocol ended), or None (finished, or ended by the engines' own decision: cancelled,
    shut down, rejected)."""
    if reason is None or reason in _NOT_FAILURES:
        return None
    if side == "sender" and reason in _EXPIRED:
        return NIXL_EXPIRED
    return NIXL_FAILED


__all__ = [
    "FAILED",
    "FINISHED",
    "NIXL_EXPIRED",
    "NIXL_FAILED",
    "TransferMetricsSink",
    "nixl_failure",
    "outcome_of",
    "record_ended",
    "record_failed_at_once",
]
