"""The driver's command queue under its two takers (`kvpush.runtime.commands.CommandQueue`):
the runtime's thread waiting with a timeout, an engine thread taking in-step. Real
threads, the GIL held between the engine's takes as a step holds it."""

from __future__ import annotations

import random
import threading
import time

import pytest

from kvpush.runtime.commands import CommandQueue, Wake

pytestmark = pytest.mark.timeout(60)

HAMMER_S = 3.0
TIMEOUT_S = 0.005
# A timed take that overran by this much waited for a put, not for its timeout.
OVERRUN_S = 1.0


def test_a_timed_take_returns_by_its_timeout_while_an_engine_thread_takes_in_step() -> None:
    """The engine thread puts a wake-up, takes it back in its next pass before the
    runtime's thread runs, then computes with the GIL held. With `queue.SimpleQueue`
    the runtime's timed take, woken for the item it then found gone, waited until the
    next put: its first take hung at once. Here every timed take ends by its timeout
    (give or take the GIL), and every command is taken exactly once."""
    q = CommandQueue()
    stop = threading.Event()
    longest = [0.0]
    counts = {"put": 0, "runtime": 0, "engine": 0, "takes": 0}
    work = list(range(300_000))
    random.Random(0).shuffle(work)

    def runtime_thread() -> None:
        while not stop.is_set():
            start = time.monotonic()
            counts["runtime"] += len(q.take(TIMEOUT_S))
            longest[0] = max(longest[0], time.monotonic() - start)
            counts["takes"] += 1

    def engine_thread() -> None:
        rng = random.Random(1)
        while not stop.is_set():
            time.sleep(rng.random() * 0.006)
            q.put(Wake())
            counts["put"] += 1
            counts["engine"] += len(q.take())
            sorted(work[: rng.randrange(1, 60_000)])  # a step's compute, GIL held

    threads = [threading.Thread(target=f) for f in (runtime_thread, engine_thread)]
    for t in threads:
        t.start()
    watched_until = time.monotonic() + HAMMER_S
    try:
        while time.monotonic() < watched_until and longest[0] < OVERRUN_S:
            time.sleep(0.05)
    finally:
        stop.set()
        q.put(Wake())  # whatever the runtime's thread waits in, it returns
        for t in threads:
            t.join(10)
    assert not any(t.is_alive() for t in threads), "a taker is stuck"
    assert longest[0] < OVERRUN_S, (
        f"a take with a {TIMEOUT_S} s timeout waited {longest[0]:.2f} s "
        f"({counts['takes']} takes, {counts['put']} puts)"
    )
    left = len(q.take())
    assert counts["runtime"] + counts["engine"] + left == counts["put"] + 1, counts
    assert counts["takes"] > 100 and counts["put"] > 100, counts


def test_a_take_waits_for_a_put_and_drains_in_order() -> None:
    q = CommandQueue()
    assert q.take() == [] and q.take(0.01) == []
    got: list[list[object]] = []
    taker = threading.Thread(target=lambda: got.append(list(q.take(10.0))))
    taker.start()
    first, second = Wake(), Wake()
    q.put(first)
    taker.join(5)
    assert not taker.is_alive() and got and got[0][0] is first
    q.put(second)
    q.put(first)
    assert q.take() == [second, first]
