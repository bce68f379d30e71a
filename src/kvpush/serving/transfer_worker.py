"""What the prefill and decode roles share: the engine worker that polls a `PushRuntime`
on the engine thread, and the id both legs of a request know its transfer by.

The runtime's contract is that its results are taken by the engine, once: `_pump` takes
them on the engine thread before every step and hands each to `_transfer_ended`, which
each role implements.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpush.serving.engine import Engine
from kvpush.serving.metrics import Registry, RegistryTransferMetrics
from kvpush.serving.worker import AdmissionConfig, EngineWorker
from kvpush.transfer_metrics import record_ended

if TYPE_CHECKING:
    from kvpush.runtime import PushRuntime, TransferResult

# While a transfer is in flight and the engine is otherwise idle, the engine thread
# sleeps on its command queue this long between polls of the runtime: short against a
# transfer (a few ms), long enough that the sleeping thread leaves the GIL to the
# runtime's thread.
_TRANSFER_POLL_S = 0.001


def prompt_fingerprint(prompt_token_ids: Sequence[int]) -> str:
    """A short digest of a prompt's token ids: both legs of a transfer must agree on it."""
    digest = hashlib.sha256(array("q", prompt_token_ids).tobytes())
    return digest.hexdigest()[:16]


def runtime_transfer_id(transfer_id: str, prompt_token_ids: Sequence[int]) -> str:
    """The id the runtime knows a transfer by: the client's id bound to the prompt's
    fingerprint. Two legs that share a `transfer_id` but not a prompt can never be paired,
    so a mismatch fails (and is named) instead of decoding from another prompt's KV."""
    return f"{transfer_id}#{prompt_fingerprint(prompt_token_ids)}"


class TransferWorker(EngineWorker):
    """An engine worker that also drives a transfer role: it polls the runtime while a
    transfer of its own is in flight and hands each ended transfer to the role."""

    def __init__(
        self,
        engine: Engine,
        runtime: PushRuntime,
        registry: Registry,
        *,
        admission: AdmissionConfig | None = None,
    ) -> None:
        super().__init__(engine, admission=admission)
        self.runtime = runtime
        self.registry = registry
        self._transfer_metrics = RegistryTransferMetrics(registry)

    def _idle_wait(self) -> float:
        return _TRANSFER_POLL_S if self._has_pending() else super()._idle_wait()

    def _has_pending(self) -> bool:
        """Whether a transfer of ours is in flight (its end comes from `runtime.poll()`)."""
        raise NotImplementedError

    def _pump(self) -> None:
        for result in self.runtime.poll():
            self._stalled = False  # blocks may have come back
            self._transfer_ended(result)

    def _transfer_ended(self, result: TransferResult) -> None:
        raise NotImplementedError

    def _count(self, result: TransferResult, started: float) -> None:
        record_ended(
            self._transfer_metrics,
            result,
            seconds=time.monotonic() - started,
            bytes_per_block=self.engine.kv_cache.bytes_per_block,
        )
