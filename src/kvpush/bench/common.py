"""What every mode's two halves share: their errors, the children's deadline check and the
sender's fill seed. `modes` and `kvpush_mode` both import it; it imports neither."""

from __future__ import annotations

import multiprocessing
import time

from kvpush.errors import KVPushError


class BenchFailed(KVPushError):
    """A benchmarked mode failed while running (not a skip: a real error)."""


class ModeUnavailable(KVPushError):
    """The mode cannot run on this host; the message says exactly why."""


SENDER_FILL_SEED = 7

_next_parent_check = 0.0


def check_deadline(deadline: float, what: str) -> None:
    """Fail past the deadline, or once the bench process is gone (checked every 0.2 s),
    so that a polling loop in an orphaned child stops at once."""
    global _next_parent_check
    now = time.monotonic()
    if now > deadline:
        raise BenchFailed(f"timed out: {what}")
    if now >= _next_parent_check:
        _next_parent_check = now + 0.2
        parent = multiprocessing.parent_process()
        if parent is not None and not parent.is_alive():
            raise BenchFailed(f"the bench process is gone: {what}")
