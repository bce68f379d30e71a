"""A thread's mailbox: items put by any thread, taken by one thread that waits for them
with a timeout (its next poll or step is due then), and by others that never wait.

Not `queue.SimpleQueue`, whose timed `get` can wait past its timeout until the next put:
once its deadline passes while it is being woken or retried, it recomputes the timeout
as a negative number, which CPython (3.11 to 3.13 at least) takes as "wait forever".
Measured here on 3.11.7 (a put taken without waiting, then a 20 us `get` with a put due
50 ms later, 40,000 times): 5 waits lasted until that put. With a second taker the
window is wide: woken for an item the other thread took first, it recomputes at once.
In kvpush the runtime's thread waits 20 us between NIXL polls right after activity, so it
hit the window within seconds of load and then slept until some command came: in vLLM the
heartbeats and the peers' writes into the rank stopped ("sender silent" on live pairs),
and in `kvpush bench` every transfer waited for the engine's own 0.2 s waits, 400 ms in
all. `threading.Lock.acquire(timeout=...)` checks for exactly that negative timeout, and
is the signal here: released (set) by a put, acquired (taken) by the waiting thread; the
same 40,000 waits never lasted past 10 ms.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Generic, TypeVar

__all__ = ["Mailbox"]

T = TypeVar("T")


class Mailbox(Generic[T]):
    """Items in the order put. `take(timeout)` is for the one thread that waits; any
    thread may `take()` without waiting. A signal whose item another thread took is left
    over: it ends the waiting thread's next wait early, once."""

    _TAKE_AT_MOST = 1024

    def __init__(self) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._signal = threading.Lock()
        self._signal.acquire()  # held: nothing put since the last wait

    def put(self, item: T) -> None:
        self._items.append(item)
        # After the item: a woken taker finds it there. Already released: a signal is
        # pending, and one is enough.
        with contextlib.suppress(RuntimeError):
            self._signal.release()

    def take(self, timeout: float = 0.0) -> list[T]:
        """What is there (up to `_TAKE_AT_MOST`, oldest first); with a `timeout`, on the
        one thread that waits, and nothing there, wait up to `timeout` seconds for a put
        first. Never waits longer, whoever else takes."""
        items = self._items
        if timeout > 0:
            if not items:
                self._signal.acquire(timeout=timeout)
            # A signal left from puts whose items are taken now goes first: a put from
            # here on signals the next wait, whose item this take or that one finds.
            self._signal.acquire(blocking=False)
        out: list[T] = []
        while items and len(out) < self._TAKE_AT_MOST:
            try:
                out.append(items.popleft())
            except IndexError:  # another taker emptied it since
                break
        return out
