"""A rank built from the runtime's own parts, over the loopback data plane.

Products build ranks with `kvpush.node`; the runtime tests build them here, by hand, so
that they can hand the runtime what a `Node` does not expose (a gated peer directory,
runtime options such as a compatibility policy) and test `PushRuntime`'s own contract."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import msgspec

from kvpush.config import SideChannelConfig, TimingConfig
from kvpush.runtime import (
    PeerAddress,
    PeerDirectory,
    PushRuntime,
    RuntimeIdentity,
    RuntimeSettings,
    SideChannelPeerDirectory,
)
from kvpush.sidechannel import MetadataServer, PeerMetadata
from kvpush.transports.loopback import LoopbackFabric, LoopbackTransport
from transport_conformance import KVBuffers, make_kv

LOOKUP_TIMEOUT_MS = 1000
# Short liveness and lease, so that a silent peer ends its transfers in seconds.
TIMING = TimingConfig(heartbeat_interval_s=0.2, liveness_timeout_s=2.0, lease_s=3.0)


class Engine:
    """One rank set up as `kvpush.node.Node` does it: the side channel first, on a port
    the OS picks; the runtime told that port; its metadata published once it started.

    Both are entered on `stack`, so they close with it. The peer directory is a
    `SideChannelPeerDirectory` with this rank's token (one that expects the peer's
    compatibility hash when `expect_compat_hash`) unless `directory` is given; the
    cache holds random bytes seeded by the name; `runtime_options` go to its
    `RuntimeSettings`, beside `timing` (the runtime gets no token here).
    """

    def __init__(
        self,
        stack: ExitStack,
        fabric: LoopbackFabric,
        name: str,
        host: str = "127.0.0.1",
        *,
        timing: TimingConfig = TIMING,
        transport: LoopbackTransport | None = None,
        directory: PeerDirectory | None = None,
        token: str | None = None,
        expect_compat_hash: bool = False,
        num_layers: int = 2,
        num_blocks: int = 8,
        block_bytes: int = 128,
        dtype: str | None = None,
        **runtime_options: Any,
    ) -> None:
        self.kv: KVBuffers = make_kv(
            num_layers=num_layers, num_blocks=num_blocks, block_bytes=block_bytes
        )
        self.kv.fill_random(len(name) * 7 + ord(name[-1]))
        geometry = self.kv.geometry
        if dtype is not None:
            geometry = msgspec.structs.replace(geometry, dtype=dtype)
        ranks: dict[int, PeerMetadata] = {}  # rank 0 is published once the runtime started
        server = stack.enter_context(MetadataServer(host, 0, SideChannelConfig(token=token), ranks))
        self.address = PeerAddress(host, server.port)
        if directory is None:
            directory = SideChannelPeerDirectory(
                timeout_ms=LOOKUP_TIMEOUT_MS,
                token=token,
                expect_compat_hash=geometry.compat_hash() if expect_compat_hash else None,
            )
        self.runtime: PushRuntime = stack.enter_context(
            PushRuntime(
                transport or LoopbackTransport(fabric, name),
                geometry,
                RuntimeIdentity(f"engine-{name}", "1", host, server.port),
                directory,
                RuntimeSettings(timing=timing, **runtime_options),
            )
        )
        ranks[0] = self.runtime.local_metadata()
