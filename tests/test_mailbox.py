"""`kvpush.mailbox.Mailbox`: what the runtime's thread and serving's engine thread wait on.
Real threads; the last test is the wait that `queue.SimpleQueue` got wrong."""

from __future__ import annotations

import threading
import time

from kvpush.mailbox import Mailbox
from kvpush.runtime.commands import CommandQueue, Wake


def test_items_come_out_in_the_order_put_and_a_take_without_timeout_never_waits() -> None:
    box: Mailbox[int] = Mailbox()
    assert box.take() == []
    for i in range(5):
        box.put(i)
    assert box.take(timeout=30.0) == [0, 1, 2, 3, 4]  # there already: no wait
    assert box.take() == []


def test_a_put_from_another_thread_ends_the_wait() -> None:
    box: Mailbox[str] = Mailbox()
    timer = threading.Timer(0.1, box.put, args=("hello",))
    start = time.monotonic()
    timer.start()
    got = box.take(timeout=60.0)
    waited = time.monotonic() - start
    timer.join()
    assert got == ["hello"]
    assert waited < 30.0, f"woken {waited:.1f} s after the put, of a 60 s timeout"


def test_with_nothing_put_the_wait_ends_at_its_timeout() -> None:
    box: Mailbox[int] = Mailbox()
    start = time.monotonic()
    assert box.take(timeout=0.2) == []
    waited = time.monotonic() - start
    assert 0.2 <= waited < 10.0, waited


def test_a_signal_whose_item_another_thread_took_ends_the_next_wait_once() -> None:
    """The engine thread takes what the runtime's thread was woken for: the runtime's
    next wait ends early, once, and the one after waits its timeout."""
    box: Mailbox[int] = Mailbox()
    box.put(1)
    assert box.take() == [1]  # another taker, that never waits
    start = time.monotonic()
    assert box.take(timeout=30.0) == []
    assert time.monotonic() - start < 10.0
    start = time.monotonic()
    assert box.take(timeout=0.2) == []
    assert time.monotonic() - start >= 0.2


def test_a_short_wait_never_lasts_until_a_later_put() -> None:
    """The runtime's thread waits 20 us between NIXL polls right after activity. A wait
    of `queue.SimpleQueue` that was preempted past its deadline waited for the next put
    instead: here, on CPython 3.11.7, in 5 of 40,000 tries, for a put a timer thread
    made 50 ms later. Each try: a command put and taken by the waiting thread (so the
    signal is spent), a timer thread started to put another in 5 s (starting it is what
    preempts), then a 20 us wait. A wait that returns the timer's command after 4.5 s
    slept until that put; a loaded host can make a wait late, but not return a command
    nobody put before its end."""
    slept_until_the_put = []
    for _ in range(20_000):
        box = CommandQueue()
        box.put(Wake())
        assert len(box.take(timeout=1.0)) == 1
        timer = threading.Timer(5.0, box.put, args=(Wake(),))
        timer.start()
        start = time.monotonic()
        got = box.take(timeout=20e-6)
        waited = time.monotonic() - start
        timer.cancel()
        timer.join()
        if got and waited >= 4.5:
            slept_until_the_put.append(waited)
    assert not slept_until_the_put, (
        f"20 us waits that lasted until a put 5 s later: {slept_until_the_put}"
    )
