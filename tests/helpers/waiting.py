"""Bounded waits: for a condition, and for a runtime's transfer results."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # scripts that tests spawn use wait_until without loading the runtime
    from kvpush.runtime import PushRuntime, TransferResult


def wait_until(
    check: Callable[[], bool], timeout: float = 10.0, what: str = "the condition"
) -> None:
    """Return once `check()` holds; fail the test if it did not within `timeout` s.

    Checks every 5 ms at first, then less often (up to every 50 ms), so that a check
    that asks another process is not run in a tight loop."""
    deadline = time.monotonic() + timeout
    pause = 0.005
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def wait_results(rt: PushRuntime, n: int = 1, timeout: float = 10.0) -> list[TransferResult]:
    """Exactly the next `n` results of `rt`, waited for at most `timeout` s in all."""
    out: list[TransferResult] = []
    end = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        out += rt.wait(timeout=max(0.0, end - time.monotonic()))
    assert len(out) == n, f"expected {n} results, got {out}"
    return out
