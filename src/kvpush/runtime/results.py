"""What the engine gets back from a runtime (`ResultQueue`): every transfer it handed in
is live until the protocol's result for it arrives, once; results wait here until
`poll()`/`wait()` takes them. The driver's thread reports into it (`report`, through
the driver's `Sink`); engine threads read it, all under the runtime's one engine-facing
lock, which `PushRuntime` also holds for its own lifecycle flags."""

from __future__ import annotations

import collections
import logging
import threading

from kvpush.errors import FailureReason
from kvpush.protocol import Side, TransferEnded, ended_unreported
from kvpush.runtime.values import TransferResult, WritesMeasured

__all__ = ["ResultQueue"]

log = logging.getLogger(__name__)


class ResultQueue:
    """The transfers in flight (by side and id), the results not taken yet, and the
    counts of what ended. Methods named `*_locked` expect `lock` held; the others take
    it. `changed` is notified whenever a result arrives (and by the runtime when it
    stops)."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.changed = threading.Condition(lock)
        # Handed in (send, receive, an unmatched reject) and not yet reported.
        self.live: set[tuple[Side, str]] = set()
        self._results: collections.deque[TransferResult] = collections.deque()
        self._queued_sending: set[str] = set()  # sender-side results not yet taken
        self._finished = 0
        self._failed = 0
        self._failures: collections.Counter[str] = collections.Counter()
        self._duplicates = 0

    def sending_locked(self, transfer_id: str) -> bool:
        """Sent and not ended, or ended with its result not taken yet."""
        return ("sender", transfer_id) in self.live or transfer_id in self._queued_sending

    def waiting_locked(self) -> bool:
        """Results are waiting to be taken."""
        return bool(self._results)

    def take_locked(self) -> list[TransferResult]:
        out = list(self._results)
        self._results.clear()
        self._queued_sending.clear()
        return out

    def report(self, result: TransferEnded, writes: WritesMeasured | None = None) -> None:
        """The protocol ended a transfer (on the driver's thread): queue its result."""
        key = (result.side, result.transfer_id)
        with self.changed:
            if key not in self.live:
                self._duplicates += 1
                log.error("suppressed a second result for %s: %s", key, result)
                return
            self.live.discard(key)
            self._results.append(TransferResult.of(result, writes))
            if result.side == "sender":
                self._queued_sending.add(result.transfer_id)
            if result.reason is None:
                self._finished += 1
            else:
                self._failed += 1
                self._failures[result.reason.value] += 1
            self.changed.notify_all()

    def counters(self) -> dict[str, object]:
        """The queue's part of a statistics snapshot."""
        with self.lock:
            return {
                "finished": self._finished,
                "failed": self._failed,
                "failures": dict(self._failures),
                "results_queued": len(self._results),
                "duplicate_reports": self._duplicates,
            }

    def fail_remaining(self, reason: FailureReason, detail: str) -> None:
        """The runtime's thread ended: whatever is still live, the protocol did not end
        (see `ended_unreported`); it ends here, as `reason`."""
        with self.lock:
            live = sorted(self.live)
        for side, tid in live:
            self.report(ended_unreported(tid, side, reason, detail))
        with self.changed:
            self.changed.notify_all()
