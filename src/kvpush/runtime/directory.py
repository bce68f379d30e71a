"""The peer directory port (how a runtime finds a peer's side-channel metadata), its two
adapters, and the worker that runs lookups off the runtime's own thread."""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Callable

from kvpush.errors import (
    AuthenticationRefused,
    FailureReason,
    IncompatiblePeer,
    PeerUnreachable,
    TransportError,
    UnknownRank,
)
from kvpush.geometry import CacheGeometry
from kvpush.protocol import PeerAddress
from kvpush.sidechannel import PeerMetadata, fetch_metadata

__all__ = [
    "InMemoryPeerDirectory",
    "LookupPool",
    "PeerDirectory",
    "SideChannelPeerDirectory",
    "handshake_reason",
]

log = logging.getLogger(__name__)


class PeerDirectory(abc.ABC):
    """How the runtime finds a peer's metadata. Called on the lookup pool's threads,
    for different addresses at once: implementations must be thread-safe."""

    @abc.abstractmethod
    def lookup(self, host: str, port: int, rank: int) -> PeerMetadata:
        """Raise a `SideChannelError` subclass when the peer cannot be used."""


class InMemoryPeerDirectory(PeerDirectory):
    """Metadata published in-process (tests, one-process demos). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, int, int], PeerMetadata] = {}

    def publish(self, address: PeerAddress, metadata: PeerMetadata) -> None:
        with self._lock:
            self._entries[(address.host, address.port, address.rank)] = metadata

    def withdraw(self, address: PeerAddress) -> None:
        with self._lock:
            self._entries.pop((address.host, address.port, address.rank), None)

    def lookup(self, host: str, port: int, rank: int) -> PeerMetadata:
        with self._lock:
            meta = self._entries.get((host, port, rank))
            known_ports = {(h, p) for h, p, _ in self._entries}
        if meta is None:
            if (host, port) in known_ports:
                raise UnknownRank(f"{host}:{port} serves no metadata for rank {rank}")
            raise PeerUnreachable(f"no peer published at {host}:{port}")
        return meta


class SideChannelPeerDirectory(PeerDirectory):
    """Asks the peer's side channel (`kvpush.sidechannel.fetch_metadata`).

    The runtime compares every peer's cache with its own on every handshake whatever
    is passed here; `expect_compat_hash` only refuses a mismatch earlier, in the
    side-channel client, and `expect_geometry` (our own) does too, naming every field
    that differs."""

    def __init__(
        self,
        *,
        timeout_ms: int = 2000,
        token: str | None = None,
        expect_compat_hash: str | None = None,
        expect_geometry: CacheGeometry | None = None,
    ) -> None:
        self._timeout_ms = timeout_ms
        self._token = token
        self._expect = expect_compat_hash
        self._expect_geometry = expect_geometry

    def lookup(self, host: str, port: int, rank: int) -> PeerMetadata:
        return fetch_metadata(
            host,
            port,
            rank,
            timeout_ms=self._timeout_ms,
            token=self._token,
            expect_compat_hash=self._expect,
            expect_geometry=self._expect_geometry,
        )


def handshake_reason(exc: BaseException) -> FailureReason:
    """The failure reason for a lookup that raised `exc`."""
    if isinstance(exc, AuthenticationRefused):
        return FailureReason.HANDSHAKE_REFUSED
    if isinstance(exc, IncompatiblePeer):
        return FailureReason.INCOMPATIBLE_PEER
    if isinstance(exc, TransportError):
        return exc.reason
    return FailureReason.HANDSHAKE_FAILED


# A refusal is an answer: the peer's side channel is up and quick, so it is neither
# backed off nor held to the suspects' share (a rank coming up answers UnknownRank first).
_ANSWERS = (UnknownRank, AuthenticationRefused, IncompatiblePeer)

LookupDone = Callable[[PeerAddress, PeerMetadata | None, BaseException | None], None]


class LookupPool:
    """Runs `PeerDirectory.lookup` on a small pool of threads, different addresses in
    parallel, and hands each outcome to `done` (which posts it to the runtime's thread).

    Why a pool: a lookup blocks for up to the directory's time-out, so one thread would
    charge every slow (black-holed, unreachable) address to all the lookups queued behind
    it. Addresses fall in three classes, served in this order: *known* (its last lookup
    answered, a refusal such as `UnknownRank` included), *new* (never looked up),
    *suspect* (its last lookup got no answer: unreachable, timed out, garbled). Suspect
    lookups occupy at most half of the workers, and new plus suspect ones at most three
    quarters, so a peer that answered before is never queued behind strangers, however
    many of them black-hole their lookups. (A brand-new healthy peer can still wait one
    time-out when more than three quarters of the workers are busy with brand-new
    addresses that never answer.) An unanswered address is looked up again no sooner than
    its back-off (doubling from `backoff_s` to `max_backoff_s`, cleared by a success); a
    transfer waiting for it meanwhile stays in its handshake, bounded by its own
    deadline, which runs from the engine's call.

    Threads are started on demand (by the runtime's thread, in `submit`) up to
    `max_workers`, and all joined by `close()`. The caller asks for each address once at
    a time."""

    def __init__(
        self,
        directory: PeerDirectory,
        done: LookupDone,
        name: str,
        *,
        max_workers: int = 16,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_workers < 2:
            raise ValueError(f"max_workers must be >= 2, got {max_workers}")
        self._directory = directory
        self._done = done
        self._name = name
        self._max_workers = max_workers
        self._max_suspect = max_workers // 2
        self._max_unproven = max_workers - max_workers // 4  # new + suspect
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._clock = clock
        self._cv = threading.Condition()
        # Guarded by _cv.
        self._pending: list[PeerAddress] = []  # FIFO
        self._failed: dict[PeerAddress, tuple[float, float]] = {}  # -> (retry at, back-off)
        self._known: set[PeerAddress] = set()  # last lookup answered
        self._running_suspect = 0
        self._running_unproven = 0  # new + suspect
        self._idle = 0
        self._threads: list[threading.Thread] = []
        self._started = False
        self._closed = False

    def start(self) -> None:
        with self._cv:
            self._started = True

    def submit(self, address: PeerAddress) -> None:
        with self._cv:
            if self._closed or not self._started:
                return
            self._pending.append(address)
            # Grow while jobs outnumber idle workers (a burst is submitted before any
            # idle worker wakes up to take its share).
            if len(self._pending) > self._idle and len(self._threads) < self._max_workers:
                t = threading.Thread(
                    target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(t)
                t.start()
            self._cv.notify()

    def close(self, timeout: float) -> None:
        with self._cv:
            self._closed = True
            threads = list(self._threads)
            self._cv.notify_all()
        end = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))

    def _next_job(self) -> tuple[PeerAddress | None, float | None]:
        """The job to run now (known, then new, then suspect; FIFO within each), else
        how long until a backed-off one is due (None: until something changes)."""
        now = self._clock()
        wait: float | None = None
        new_pick: int | None = None
        suspect_pick: int | None = None
        unproven_ok = self._running_unproven < self._max_unproven
        for i, address in enumerate(self._pending):
            if address in self._known:
                return self._pending.pop(i), None
            failed = self._failed.get(address)
            if failed is None:
                if new_pick is None and unproven_ok:
                    new_pick = i
            elif failed[0] > now:
                wait = failed[0] - now if wait is None else min(wait, failed[0] - now)
            elif suspect_pick is None and unproven_ok and self._running_suspect < self._max_suspect:
                suspect_pick = i
        pick = new_pick if new_pick is not None else suspect_pick
        if pick is not None:
            return self._pending.pop(pick), None
        return None, wait

    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._closed:
                        return
                    address, wait = self._next_job()
                    if address is not None:
                        break
                    self._idle += 1
                    self._cv.wait(wait)
                    self._idle -= 1
                suspect = address in self._failed
                unproven = address not in self._known
                self._running_suspect += suspect
                self._running_unproven += unproven
            meta: PeerMetadata | None = None
            error: BaseException | None = None
            try:
                meta = self._directory.lookup(address.host, address.port, address.rank)
            except BaseException as exc:  # every outcome goes back to the runtime's thread
                error = exc
            with self._cv:
                self._running_suspect -= suspect
                self._running_unproven -= unproven
                if error is None or isinstance(error, _ANSWERS):
                    self._failed.pop(address, None)
                    self._known.add(address)
                else:
                    self._known.discard(address)
                    last = self._failed.get(address)
                    backoff = (
                        self._backoff_s if last is None else min(last[1] * 2, self._max_backoff_s)
                    )
                    self._failed[address] = (self._clock() + backoff, backoff)
                self._cv.notify_all()  # a suspect slot or a back-off may have freed a job
            self._done(address, meta, error)
