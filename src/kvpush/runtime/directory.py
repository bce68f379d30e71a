"""The peer directory port (how a runtime finds a peer's side-channel metadata), its two
adapters, and the worker that runs lookups off the runtime's own thread."""

from __future__ import annotations

import abc
import logging
import queue
import threading
from collections.abc import Callable

from kvpush.errors import (
    AuthenticationRefused,
    FailureReason,
    IncompatiblePeer,
    PeerUnreachable,
    TransportError,
    UnknownRank,
)
from kvpush.protocol import PeerAddress
from kvpush.sidechannel import PeerMetadata, fetch_metadata

__all__ = [
    "InMemoryPeerDirectory",
    "LookupWorker",
    "PeerDirectory",
    "SideChannelPeerDirectory",
    "handshake_reason",
]

log = logging.getLogger(__name__)


class PeerDirectory(abc.ABC):
    """How the runtime finds a peer's metadata. Called on the lookup worker only."""

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
    side-channel client."""

    def __init__(
        self,
        *,
        timeout_ms: int = 2000,
        token: str | None = None,
        expect_compat_hash: str | None = None,
    ) -> None:
        self._timeout_ms = timeout_ms
        self._token = token
        self._expect = expect_compat_hash

    def lookup(self, host: str, port: int, rank: int) -> PeerMetadata:
        return fetch_metadata(
            host,
            port,
            rank,
            timeout_ms=self._timeout_ms,
            token=self._token,
            expect_compat_hash=self._expect,
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


LookupDone = Callable[[PeerAddress, PeerMetadata | None, BaseException | None], None]


class LookupWorker:
    """Runs `PeerDirectory.lookup` for one address at a time on its own thread and hands
    each outcome to `done` (which posts it to the runtime's thread). Started by
    `start()`, joined by `close()`; the caller asks for each address once at a time."""

    def __init__(self, directory: PeerDirectory, done: LookupDone, name: str) -> None:
        self._directory = directory
        self._done = done
        self._name = name
        self._jobs: queue.SimpleQueue[PeerAddress | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def submit(self, address: PeerAddress) -> None:
        self._jobs.put(address)

    def close(self, timeout: float) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            address = self._jobs.get()
            if address is None:
                return
            try:
                meta = self._directory.lookup(address.host, address.port, address.rank)
            except BaseException as exc:  # every outcome goes back to the runtime's thread
                self._done(address, None, exc)
            else:
                self._done(address, meta, None)
