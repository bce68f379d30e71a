"""Bounded waits: for a condition, and for a runtime's transfer results."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvpush.runtime import PushRuntime, TransferResult


def wait_until(
    check: Callable[[], bool], timeout: float = 10.0, what: str = "the condition"
) -> None:
    """Return once `check()` holds; fail the test if it did not within `timeout` s."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def wait_results(rt: PushRuntime, n: int = 1, timeout: float = 10.0) -> list[TransferResult]:
    """Exactly the next `n` results of `rt`, waited for at most `timeout` s in all."""
    out: list[TransferResult] = []
    end = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        out += rt.wait(timeout=max(0.0, end - time.monotonic()))
    assert len(out) == n, f"expected {n} results, got {out}"
    return out
