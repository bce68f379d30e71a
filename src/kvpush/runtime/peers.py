"""The peers a runtime's transport holds, and how they got there: side-channel lookups
(on a `LookupPool`'s threads) that end in a handshake, and peers lent to services.

`Peers` answers with the protocol's effects (`handshake_done`, `handshake_failed`) for
the driver to carry out; it calls nothing back. A compatible peer is loaded for writes,
with the views that turn block ids into the data plane's where block sizes differ
(`id_map`); an incompatible one for messages only, never written to, but told at once
why its transfers fail, so that it frees its blocks now. Touched only by whoever holds
the driver's pass, but for the lookup pool's threads, which only queue their results.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvpush.errors import FailureReason, KVPushError
from kvpush.geometry import BlockParts, CacheGeometry, WritePlan, write_plan, write_views
from kvpush.protocol import Effect, Handshake, PeerAddress, PeerInfo, PushProtocol
from kvpush.runtime.commands import LookupResult
from kvpush.runtime.directory import LookupPool, PeerDirectory, handshake_reason
from kvpush.sidechannel import PeerMetadata
from kvpush.topology import UnsupportedShape
from kvpush.transports.base import Transport

__all__ = ["Peers"]

log = logging.getLogger(__name__)


class Peers:
    """Lookups in flight, what each peer's handshake said, the id maps of peers whose
    block sizes differ from ours, and the peers lent to services."""

    def __init__(
        self,
        transport: Transport,
        geometry: CacheGeometry,
        protocol: PushProtocol,
        directory: PeerDirectory,
        looked_up: Callable[[LookupResult], None],
    ) -> None:
        self._transport = transport
        self._geometry = geometry
        self._protocol = protocol
        # The pool's threads only hand each result to `looked_up` (the driver queues it).
        self._pool = LookupPool(
            directory,
            lambda a, m, e: looked_up(LookupResult(a, m, e)),
            name=f"kvpush-handshake-{transport.agent_name}",
        )
        self._lookups: set[PeerAddress] = set()  # addresses being looked up
        self._infos: dict[str, PeerInfo] = {}  # agent -> what its handshake said
        # agent -> how our ids and its ids become the views' where block sizes differ
        self._id_maps: dict[str, tuple[BlockParts | None, BlockParts | None]] = {}
        self._lent: set[str] = set()  # lent to a service, not (yet) the protocol's

    def start(self) -> None:
        self._pool.start()

    def close(self, timeout: float) -> None:
        self._pool.close(timeout)

    @property
    def lookups_in_flight(self) -> int:
        return len(self._lookups)

    def id_map(self, agent: str) -> tuple[BlockParts | None, BlockParts | None] | None:
        """How our ids and `agent`'s become the views' (`BlockParts`), where block sizes
        differ; None where they do not."""
        return self._id_maps.get(agent)

    def lookup(self, now: float, hs: Handshake) -> list[Effect]:
        """The protocol asked for a handshake with `hs.address`."""
        info = self._infos.get(hs.peer) if hs.peer is not None and not hs.revalidate else None
        if info is not None and self._transport.has_peer(info.agent):
            # The sender handshaking back to an agent our receiver side looked up
            # already, and just heard from: that lookup answers this one too.
            return self._protocol.handshake_done(now, hs.address, info)
        if hs.address not in self._lookups:
            self._lookups.add(hs.address)
            self._pool.submit(hs.address)
        return []

    def looked_up(self, now: float, result: LookupResult) -> list[Effect]:
        """A lookup ended: load the peer it found (unless it is us), and say how the
        handshake ended."""
        address = result.address
        self._lookups.discard(address)
        meta, error = result.metadata, result.error
        if meta is None:
            reason = handshake_reason(error) if error is not None else FailureReason.LOCAL_ERROR
            return self._protocol.handshake_failed(now, address, reason, f"{error}")
        info = PeerInfo(
            meta.agent_name,
            meta.engine_id,
            meta.incarnation,
            meta.geometry.compat_fields(),
            meta.message_key,
        )
        ours = meta.agent_name == self._transport.agent_name
        compatible = self._protocol.incompatibility(info.compat) is None
        views = WritePlan(self._geometry, meta.geometry)
        if compatible and not ours:
            try:
                views = write_plan(self._geometry, meta.geometry)
            except UnsupportedShape as exc:
                reason = FailureReason.INCOMPATIBLE_PEER
                return self._protocol.handshake_failed(now, address, reason, str(exc))
        if not ours:
            # An incompatible peer is loaded for messages only: never written to, but
            # told at once why its transfers fail, so it frees its blocks now.
            try:
                if not self._transport.has_peer(meta.agent_name):
                    self._transport.add_peer(
                        meta.agent_name,
                        meta.agent_metadata,
                        views[1],
                        messages_only=not compatible,
                        ours=None if views[0] is self._geometry else views[0],
                    )
            except KVPushError as exc:
                if compatible:
                    reason = handshake_reason(exc)
                    return self._protocol.handshake_failed(now, address, reason, str(exc))
                log.info("could not load incompatible peer %s to tell it: %s", address, exc)
            if compatible:
                self._infos[meta.agent_name] = info
                if views.our_ids is not None or views.their_ids is not None:
                    self._id_maps[meta.agent_name] = (views.our_ids, views.their_ids)
            self._lent.discard(meta.agent_name)  # the protocol's from now on
        return self._protocol.handshake_done(now, address, info)

    def drop(self, agent: str) -> None:
        """The protocol dropped `agent` (`DropPeer`): unload it, forget its handshake."""
        self._transport.remove_peer(agent)
        self._infos.pop(agent, None)
        self._id_maps.pop(agent, None)

    def lend(self, meta: PeerMetadata) -> None:
        """Load a service's peer as `looked_up` would (for messages only if its cache is
        not ours), unless it is loaded already."""
        if self._transport.has_peer(meta.agent_name):
            return
        compat = meta.geometry.compat_fields()
        messages_only = self._protocol.incompatibility(compat) is not None
        views = (self._geometry, meta.geometry)
        if not messages_only:
            try:
                views = write_views(self._geometry, meta.geometry)
            except UnsupportedShape:
                messages_only = True  # the protocol never writes to it either
        self._transport.add_peer(
            meta.agent_name,
            meta.agent_metadata,
            views[1],
            messages_only=messages_only,
            ours=None if views[0] is self._geometry else views[0],
        )
        self._lent.add(meta.agent_name)

    def give_back(self, agent: str) -> None:
        """A service is done with a lent peer: forget it, unless the protocol took it since."""
        if agent in self._lent:
            self._lent.discard(agent)
            self._transport.remove_peer(agent)
