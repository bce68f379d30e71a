"""Fakes handed to real objects through their constructors: a clock, a data plane that
crashes on demand, one whose writes stay in flight until the test lets them go, a peer
directory behind a slow network."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from kvpush.errors import PeerUnreachable, UnknownRank
from kvpush.runtime import PeerDirectory
from kvpush.sidechannel import PeerMetadata
from kvpush.transports.base import TransportEvent
from kvpush.transports.loopback import LoopbackFabric, LoopbackTransport


class FakeClock:
    """A clock that moves only when the test says; safe to read from any thread."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, dt: float) -> None:
        with self._lock:
            self._now += dt


class CrashingTransport(LoopbackTransport):
    """A loopback endpoint whose poll() raises `error` once the test sets `crash`: the
    thread that polls it dies of it."""

    def __init__(
        self,
        fabric: LoopbackFabric,
        name: str,
        error: Exception | None = None,
    ) -> None:
        super().__init__(fabric, name)
        self.crash = threading.Event()
        self.error = error or RuntimeError("boom in the data plane")

    def poll(self) -> list[TransportEvent]:
        if self.crash.is_set():
            raise self.error
        return super().poll()


_Ids = Sequence[int] | None


class HeldWritesTransport(LoopbackTransport):
    """A loopback endpoint whose writes do not start until the test lets them: a write
    the data plane has taken but not yet reported (a stalled peer, a slow NIC)."""

    def __init__(self, fabric: LoopbackFabric, name: str) -> None:
        super().__init__(fabric, name)
        self._lock = threading.Lock()
        self._held: list[tuple[str, int, Sequence[int], Sequence[int], bytes | None, _Ids]] = []
        self._release = threading.Event()
        # Called as close() begins: what the engine could see then (the test sets it).
        self.on_close: Callable[[], object] = lambda: None
        self.seen_at_close: object = None

    def write_blocks(
        self,
        peer: str,
        write_id: int,
        our_blocks: Sequence[int],
        their_blocks: Sequence[int],
        notification: bytes | None,
        regions: Sequence[int] | None = None,
    ) -> None:
        with self._lock:
            self._held.append((peer, write_id, our_blocks, their_blocks, notification, regions))

    def held(self) -> int:
        """How many writes wait to start."""
        with self._lock:
            return len(self._held)

    def release(self) -> None:
        """Let every held write, and every later one, start (at the next poll)."""
        self._release.set()

    def poll(self) -> list[TransportEvent]:
        if self._release.is_set():  # on the runtime's thread, as every transport call
            with self._lock:
                held, self._held = self._held, []
            for args in held:
                super().write_blocks(*args)
        return super().poll()

    def close(self) -> None:
        self.seen_at_close = self.on_close()
        super().close()


class GatedDirectory(PeerDirectory):
    """A peer directory behind a slow network, lookup by lookup.

    Lookups of the ports in `slow` (of every port while `slow` is None) block until the
    test sets `gate`; then lookups of the ports in `failing` raise `PeerUnreachable`, and
    the rest go to `inner`, or without one are answered "no such rank" (an answer, not a
    failure). `calls` lists the port of every lookup, in the order they came."""

    def __init__(self, inner: PeerDirectory | None = None, *, slow: set[int] | None = None) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.slow = slow
        self.failing: set[int] = set()
        self.calls: list[int] = []
        self._lock = threading.Lock()

    def lookup(self, host: str, port: int, rank: int) -> PeerMetadata:
        with self._lock:
            self.calls.append(port)
        if self.slow is None or port in self.slow:
            self.gate.wait(30)
        if port in self.failing:
            raise PeerUnreachable(f"nobody at {host}:{port}")
        if self.inner is not None:
            return self.inner.lookup(host, port, rank)
        raise UnknownRank(f"answered: {host}:{port} has no rank {rank}")
