"""What the prefill and decode roles share: the id both legs of a request know its
transfer by, how often the engine thread polls the runtime while a transfer is in flight,
and how an ended transfer is counted.

The runtime's contract is that its results are taken by the engine, once: each role's
`before_step` takes them on the engine thread before every step.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpush.serving.engine import Engine
from kvpush.transfer_metrics import TransferMetricsSink, record_ended

if TYPE_CHECKING:
    from kvpush.runtime import TransferResult

# While a transfer is in flight and the engine is otherwise idle, the engine thread
# sleeps on its command queue this long between polls of the runtime: short against a
# transfer (a few ms), long enough that the sleeping thread leaves the GIL to the
# runtime's thread.
TRANSFER_POLL_S = 0.001


def prompt_fingerprint(prompt_token_ids: Sequence[int]) -> str:
    """A short digest of a prompt's token ids: both legs of a transfer must agree on it."""
    digest = hashlib.sha256(array("q", prompt_token_ids).tobytes())
    return digest.hexdigest()[:16]


def runtime_transfer_id(transfer_id: str, prompt_token_ids: Sequence[int]) -> str:
    """The id the runtime knows a transfer by: the client's id bound to the prompt's
    fingerprint. Two legs that share a `transfer_id` but not a prompt can never be paired,
    so a mismatch fails (and is named) instead of decoding from another prompt's KV."""
    return f"{transfer_id}#{prompt_fingerprint(prompt_token_ids)}"


def count_ended(
    metrics: TransferMetricsSink, engine: Engine, result: TransferResult, started: float
) -> None:
    """Count a transfer the runtime reported ended, `started` (monotonic) when taken."""
    record_ended(
        metrics,
        result,
        seconds=time.monotonic() - started,
        bytes_per_block=engine.kv_cache.bytes_per_block,
    )
