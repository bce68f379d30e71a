"""Services: work that a tool runs on a rank's runtime, beside the protocol's transfers.

A service is given to a `PushRuntime` at assembly (`services=`, or a `Node`'s services,
which hand one to each rank); the runtime never names the tool. It hands each service a
`ServiceHost`, its narrow view of the rank, when the runtime starts (before the rank's
metadata is published, so a scratch buffer it offers is published with it), and closes
it after the runtime's thread ended.

On the runtime's thread (whichever thread drives the transport), a service may write
from a scratch buffer it offered (`Transport.write_scratch`) under write ids it took from
`ServiceHost.write_id`, whose ends come back to `write_ended`; while it is `busy` the
thread polls at its busy pace and calls `tick` after each poll. From any other thread it
only asks for a call on the runtime's thread (`ServiceHost.run`). A peer it writes to is
lent to it (`lend_peer`, `return_peer`): loaded as a handshake would load it, and left to
the protocol if the protocol took it meanwhile.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

from kvpush.geometry import CacheGeometry, ScratchRegion
from kvpush.runtime.directory import PeerDirectory
from kvpush.sidechannel import PeerMetadata
from kvpush.transports.base import Transport

__all__ = ["RuntimeService", "ServiceHost"]


@dataclass(frozen=True, slots=True)
class ServiceHost:
    """What a service may use of its rank. `run`, `failure` and `scratch` may be called
    from any thread; the rest only on the runtime's thread, but for `offer_scratch`,
    which only `RuntimeService.start` may call."""

    transport: Transport
    geometry: CacheGeometry
    directory: PeerDirectory
    clock: Callable[[], float]  # the runtime's
    # Run this on the runtime's thread, at its next pass (never on the caller's).
    run: Callable[[Callable[[], None]], None]
    # A fresh write id (below zero: never one of the protocol's), whose WriteDone or
    # WriteFailed goes to this service's `write_ended`.
    write_id: Callable[[], int]
    # Load a peer that was looked up, as a handshake would (for messages only if its
    # cache is not ours), unless it is loaded; raises `KVPushError` if it cannot be.
    lend_peer: Callable[[PeerMetadata], None]
    # Let go of a lent peer, unless the protocol took it since.
    return_peer: Callable[[str], None]
    # Register a scratch buffer (never a KV block) with the transport and publish it with
    # the rank's metadata. Once per rank.
    offer_scratch: Callable[[ScratchRegion], None]
    # None while the runtime runs; else why not ("not started" before it did).
    failure: Callable[[], str | None]


class RuntimeService(abc.ABC):
    """A service on one rank's runtime; see the module docstring for its threads."""

    @abc.abstractmethod
    def start(self, host: ServiceHost) -> None:
        """The runtime starts: the transport holds our KV cache, the rank's metadata is
        not published yet. Start what the service owns (its threads: joined by `close`)."""

    @abc.abstractmethod
    def close(self, timeout: float) -> None:
        """The runtime's thread ended and the transport is closed: join what `start`
        started, within `timeout`. Safe without a `start`, and twice."""

    @property
    def busy(self) -> bool:
        """Work is in flight: the runtime polls at its busy pace and calls `tick`."""
        return False

    def tick(self) -> None:  # noqa: B027 (a service without deadlines needs none)
        """On the runtime's thread, after each poll while `busy`: deadlines."""

    def write_ended(self, write_id: int, error: str | None) -> None:  # noqa: B027
        """On the runtime's thread: write `write_id` (from `ServiceHost.write_id`)
        completed (`error` None) or failed (why)."""
