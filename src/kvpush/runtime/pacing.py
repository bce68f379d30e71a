"""When the runtime's thread runs its next pass (`Pacer`), and the timer slack it runs
with (`tighten_timer_slack`).

NIXL progresses only when it is polled and cannot wake a waiting thread, so the thread
paces its polls: the idle interval with nothing in flight; right after data-plane
activity the shortest wait, for `spin_s`; else a back-off that doubles up to
`max_backoff_s`. While an engine drives the runtime in-step (its `poll()`, once per
step), the thread stands by and wakes for commands only.

The pacing is written by every pass, on whichever thread drives, and read by the
runtime's thread (racily, harmlessly: it only decides how long to sleep) and by an
engine thread deciding whether to wake it.
"""

from __future__ import annotations

import ctypes
import time

__all__ = ["Pacer", "tighten_timer_slack"]

_SPIN_WAIT_S = 20e-6
# Linux rounds every timed wait of a thread up by its timer slack (50 us by default), and
# each write here costs about three alternating polls (receiver, sender, receiver), each
# after such a wait (figures: docs/benchmarks.md, "Third pass"). The runtime's thread
# asks for 5 us; it only waits that short right after activity.
_TIMER_SLACK_NS = 5_000
_PR_SET_TIMERSLACK = 29
# An engine that calls poll() drives the runtime itself, once per step: for this long
# after its last poll() the thread does not poll (it still takes commands at once), so
# that inside a busy engine it does not wait for the GIL, and take it, for nothing.
_STANDBY_AFTER_ENGINE_POLL_S = 0.01


def tighten_timer_slack() -> bool:
    """Set the calling thread's timer slack to `_TIMER_SLACK_NS` (Linux); False where the
    call is not available. Affects this thread only."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_TIMERSLACK, _TIMER_SLACK_NS, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


class Pacer:
    """The spin/back-off schedule of one runtime, and whether its thread stands by."""

    def __init__(self, *, idle_poll_s: float, max_backoff_s: float, spin_s: float) -> None:
        self._idle_poll_s = idle_poll_s
        self._max_backoff_s = max_backoff_s
        self._spin_s = spin_s
        self.busy = False  # anything in flight after the last pass
        self._spin_until = 0.0
        self._backoff = 0.0
        self._thread_sleeps_until = float("inf")
        self._engine_polled_at = float("-inf")  # the last poll() that drove a pass

    def poll_delay(self) -> float:
        """How long the next wait before a pass may be: the idle interval with nothing in
        flight; right after data-plane activity the shortest wait, for `spin_s`; else
        the back-off. Never zero while in flight: a wait drops the GIL, so the engine's
        threads (woken by a result) are not held off for the interpreter's 5 ms switch
        interval."""
        if not self.busy:
            return self._idle_poll_s
        if self._spin_until and time.monotonic() < self._spin_until:
            return _SPIN_WAIT_S
        return self._backoff

    def thread_waits(self) -> float:
        """The runtime's thread is about to wait for commands: for how long. While the
        engine polls it waits for commands only, or until the engine stopped polling."""
        timeout = self.poll_delay()
        now = time.monotonic()
        standby = self._engine_polled_at + _STANDBY_AFTER_ENGINE_POLL_S - now
        timeout = max(timeout, standby)
        self._thread_sleeps_until = now + timeout
        return timeout

    def thread_woke(self) -> None:
        self._thread_sleeps_until = float("-inf")

    def passed(self, *, activity: bool, commands: bool, busy: bool) -> None:
        """A pass ended: it saw data-plane `activity` (events in, writes or messages
        out), ran engine `commands`, and left something in flight (`busy`)."""
        if activity:
            # Poll at the shortest interval for a moment, since NIXL progresses only
            # when we poll and the answer (WriteDone, the peer's next message) follows
            # quickly. Engine commands alone (statistics, a send waiting for its
            # receiver) do not spin, so an in-flight but quiet endpoint still backs off.
            self._spin_until = time.monotonic() + self._spin_s
            self._backoff = 0.0
        elif commands:
            self._backoff = 0.0
        else:
            self._backoff = min(max(self._backoff * 2, 50e-6), self._max_backoff_s)
        self.busy = busy

    def engine_polled(self) -> None:
        """An engine's poll() drove a pass: the thread stands by for a while."""
        self._engine_polled_at = time.monotonic()

    def thread_should_wake(self) -> bool:
        """After an in-step pass: work is left in flight while the thread sleeps long (it
        slept with nothing in flight), so it should be woken to pace the polls from now
        on (or, after an engine's poll(), once the engine stops polling)."""
        return (
            self.busy
            and self._thread_sleeps_until
            > max(time.monotonic(), self._engine_polled_at + _STANDBY_AFTER_ENGINE_POLL_S)
            + self._max_backoff_s
        )
