"""A rank, and a node of ranks behind one side channel: how every caller builds kvpush.

A `Rank` is one rank's transport, peer directory and `PushRuntime`, wired one way: the
agent is named after the engine, the rank and the incarnation; the directory proves the
token and refuses a peer whose cache differs from ours before any handshake; the runtime
publishes its metadata once started. A `Node` is one side channel (`MetadataServer`) and
the ranks it serves: `start()` binds the side channel first (port 0 lets the OS pick, and
a rank's identity carries the port), then starts each rank and publishes its metadata.

vLLM's worker processes use a `Rank` alone: there the side channel belongs to vLLM's
scheduler process, which serves every rank from the metadata the workers hand it.

The transport is a constructor argument (`transport_factory`, from agent name to
`Transport`): NIXL by default, imported only when a rank starts; tests pass
`LoopbackTransport` on one `LoopbackFabric`. Nothing here starts a thread, opens a socket
or reads the environment in `__init__`; `start()` does, `close()` joins (with a timeout)
and is safe after a failed or partial start, and both work as a context manager.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvpush.config import SideChannelConfig
from kvpush.errors import ClosedError, ConfigError, LocalProtocolError, SideChannelError
from kvpush.geometry import CacheGeometry
from kvpush.runtime import (
    PushRuntime,
    RuntimeIdentity,
    RuntimeService,
    RuntimeSettings,
    SideChannelPeerDirectory,
)
from kvpush.sidechannel import (
    ControlHandler,
    MetadataServer,
    PeerMetadata,
    SideChannelStats,
)
from kvpush.transports.base import Transport

__all__ = [
    "Node",
    "NodeHealth",
    "NodeIdentity",
    "NodeService",
    "Rank",
    "RankSettings",
    "TransportFactory",
    "agent_name",
    "nixl_transport",
]

log = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0

# From the agent name a rank gets to its transport, not started yet.
TransportFactory = Callable[[str], Transport]


def nixl_transport(agent_name: str) -> Transport:
    """The default transport: a NIXL agent (NIXL is imported here, not before)."""
    from kvpush.transports.nixl import NixlTransport

    return NixlTransport(agent_name)


def agent_name(engine_id: str, rank: int, incarnation: str) -> str:
    """A rank's agent name: unique per engine, rank and incarnation."""
    return f"{engine_id}-r{rank}-{incarnation[:8]}"


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    """Who an engine is, for every rank it runs. `host` is the side channel's host as
    peers reach it (sent to senders in `Register`, so they can handshake back)."""

    engine_id: str
    role: str = "both"  # "sender" | "receiver" | "both"
    host: str = "127.0.0.1"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSettings(RuntimeSettings):
    """How a rank runs: its runtime's settings (`RuntimeSettings`, handed to the
    `PushRuntime` whole; the token is also proven by the side channel and its clients),
    and how the rank looks its peers up: how long one side-channel lookup may take."""

    lookup_timeout_ms: int = 2000
    # The runtime compares every peer's cache with ours on every handshake; this also
    # refuses a mismatch earlier, in the side-channel client (its detail names theirs).
    check_compat_in_lookup: bool = True


class NodeService:
    """A tool's part in a node, given at assembly (`Node(services=...)`), as the bench's
    request kinds are given (`control=`): request kinds of its own on the node's side
    channel, and for each rank a `RuntimeService` on that rank's runtime. The node only
    routes them; it knows nothing of what the tool does."""

    def control(self) -> Mapping[bytes, ControlHandler]:
        """Request kinds to serve on the node's side channel, with their handlers."""
        return {}

    def for_rank(self, rank: int) -> RuntimeService | None:
        """Rank `rank`'s service (the node asks once per rank, in order, as it builds
        the rank), or None."""
        return None


class Rank:
    """One rank: its transport (from `transport_factory`), directory and `PushRuntime`.

    `port` is the port of the side channel that serves this rank's metadata (the
    runtime tells senders to handshake back there). `incarnation` is new for each
    `Rank` unless given (a node's ranks share the node's)."""

    def __init__(
        self,
        geometry: CacheGeometry,
        identity: NodeIdentity,
        *,
        port: int,
        rank: int = 0,
        incarnation: str | None = None,
        settings: RankSettings | None = None,
        transport_factory: TransportFactory = nixl_transport,
        services: Sequence[RuntimeService] = (),
    ) -> None:
        self._geometry = geometry
        self._settings = settings or RankSettings()
        self._transport_factory = transport_factory
        self._services = tuple(services)
        self._identity = RuntimeIdentity(
            engine_id=identity.engine_id,
            incarnation=incarnation or uuid.uuid4().hex,
            host=identity.host,
            port=port,
            rank=rank,
            role=identity.role,
        )
        self._runtime: PushRuntime | None = None
        self._transport: Transport | None = None
        self._closed = False

    @property
    def identity(self) -> RuntimeIdentity:
        return self._identity

    @property
    def geometry(self) -> CacheGeometry:
        return self._geometry

    @property
    def runtime(self) -> PushRuntime:
        """The rank's runtime; built by `start()`."""
        if self._runtime is None:
            raise LocalProtocolError("Rank.runtime: call start() first")
        return self._runtime

    @property
    def transport(self) -> Transport:
        """The transport the factory built for this rank; built by `start()`."""
        if self._transport is None:
            raise LocalProtocolError("Rank.transport: call start() first")
        return self._transport

    @property
    def failure(self) -> str | None:
        """None while the runtime can serve; else why not ("not started" before start)."""
        if self._runtime is None:
            return "not started"
        return self._runtime.failure

    def metadata(self) -> PeerMetadata:
        """What the side channel publishes for this rank (after `start()`)."""
        return self.runtime.local_metadata()

    def start(self) -> None:
        if self._closed:
            raise ClosedError("this Rank was closed; create a new one")
        if self._runtime is not None:
            raise LocalProtocolError("Rank.start() called twice")
        ident, settings = self._identity, self._settings
        self._transport = self._transport_factory(
            agent_name(ident.engine_id, ident.rank, ident.incarnation)
        )
        self._runtime = PushRuntime(
            self._transport,
            self._geometry,
            ident,
            SideChannelPeerDirectory(
                timeout_ms=settings.lookup_timeout_ms,
                token=settings.token,
                expect_geometry=self._geometry if settings.check_compat_in_lookup else None,
            ),
            settings,
            services=self._services,
        )
        self._runtime.start()

    def close(self, timeout: float = _JOIN_TIMEOUT_S) -> None:
        """Close the runtime (which joins its threads and closes the transport, started
        or not). Idempotent; safe before and after a failed start."""
        if self._closed:
            return
        self._closed = True
        if self._runtime is not None:
            self._runtime.close(timeout)
        elif self._transport is not None:
            self._transport.close()

    def __enter__(self) -> Rank:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class NodeHealth:
    """A snapshot of a node: its side channel and each rank's runtime."""

    started: bool
    side_channel_port: int | None  # None until bound
    side_channel_healthy: bool
    side_channel_failure: str | None  # why its thread stopped on its own
    side_channel: SideChannelStats
    # Per rank: None while it can serve, else why not (`PushRuntime.failure`).
    runtime_failures: tuple[str | None, ...]

    @property
    def runtime_failure(self) -> str | None:
        """The first rank's failure, or "not started" before any rank runs."""
        if not self.runtime_failures:
            return "not started"
        return next((f for f in self.runtime_failures if f is not None), None)

    @property
    def healthy(self) -> bool:
        return self.side_channel_healthy and self.runtime_failure is None


class Node:
    """One side channel and the ranks it serves: rank r runs on `geometries[r]`.

    `bind_host` is the address the side channel binds (default: `identity.host`, which
    is what peers are told). `control` is passed to the `MetadataServer` (its extra
    request kinds), with those of the `services` the node is given (`NodeService`): a
    kind is served by one of them only. `close()` stops the side channel first, so no
    request reaches a closing runtime, then closes every rank."""

    def __init__(
        self,
        geometries: Sequence[CacheGeometry],
        identity: NodeIdentity,
        *,
        port: int = 0,
        bind_host: str | None = None,
        incarnation: str | None = None,
        settings: RankSettings | None = None,
        transport_factory: TransportFactory = nixl_transport,
        control: Mapping[bytes, ControlHandler] | None = None,
        services: Sequence[NodeService] = (),
    ) -> None:
        kinds: dict[bytes, ControlHandler] = dict(control or {})
        for service in services:
            for kind, handler in service.control().items():
                if kind in kinds:
                    raise ConfigError(f"request kind {kind!r} is served twice on this node")
                kinds[kind] = handler
        self._services = tuple(services)
        self._geometries = list(geometries)
        self._identity = identity
        self._settings = settings or RankSettings()
        self._transport_factory = transport_factory
        self._incarnation = incarnation or uuid.uuid4().hex
        self._published: dict[int, PeerMetadata] = {}
        self._server = MetadataServer(
            bind_host if bind_host is not None else identity.host,
            port,
            SideChannelConfig(token=self._settings.token),
            self._published,
            control=kinds,
        )
        self._ranks: list[Rank] = []
        self._started = False
        self._closed = False

    @property
    def identity(self) -> NodeIdentity:
        return self._identity

    @property
    def incarnation(self) -> str:
        return self._incarnation

    @property
    def port(self) -> int:
        """The side channel's bound port (after `start()`)."""
        return self._server.port

    @property
    def ranks(self) -> list[Rank]:
        """The ranks started so far, by rank."""
        return list(self._ranks)

    def rank(self, rank: int = 0) -> Rank:
        return self._ranks[rank]

    @property
    def runtime(self) -> PushRuntime:
        """Rank 0's runtime (a node of one rank has only that)."""
        if not self._ranks:
            raise LocalProtocolError("Node.runtime: call start() first")
        return self._ranks[0].runtime

    def start(self) -> None:
        """Bind the side channel, start every rank, publish each one's metadata. On an
        error everything started is closed again before it is raised."""
        if self._closed:
            raise ClosedError("this Node was closed; create a new one")
        if self._started:
            raise LocalProtocolError("Node.start() called twice")
        self._started = True
        try:
            self._server.start()
            for r, geometry in enumerate(self._geometries):
                rank = Rank(
                    geometry,
                    self._identity,
                    port=self._server.port,
                    rank=r,
                    incarnation=self._incarnation,
                    settings=self._settings,
                    transport_factory=self._transport_factory,
                    services=[
                        s for service in self._services if (s := service.for_rank(r)) is not None
                    ],
                )
                self._ranks.append(rank)
                rank.start()
                self._published[r] = rank.metadata()
        except BaseException:
            self.close()
            raise

    def close(self, timeout: float = _JOIN_TIMEOUT_S) -> None:
        """Stop the side channel, then close every rank. Idempotent; safe after a failed
        start. The first error met is raised once everything was closed."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        try:
            self._server.close()
        except BaseException as exc:
            errors.append(exc)
        for rank in self._ranks:
            try:
                rank.close(timeout)
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> Node:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def health(self) -> NodeHealth:
        server = self._server
        try:
            port: int | None = server.port
        except SideChannelError:  # not bound (yet)
            port = None
        return NodeHealth(
            started=self._started,
            side_channel_port=port,
            side_channel_healthy=server.healthy,
            side_channel_failure=server.failure,
            side_channel=server.statistics(),
            runtime_failures=tuple(r.failure for r in self._ranks),
        )
