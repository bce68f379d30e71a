"""What one NIXL endpoint has registered with its agent: our KV cache and a scratch
buffer (memory), and each peer it loaded with its prepared descriptor lists; all of it
released once, when the endpoint closes (`release`).

`Registry` is an object `NixlTransport` owns. It holds no agent: each call is given the
live one, so the endpoint's lifecycle (start, close) stays in one place. It posts no
write and polls nothing; removing a peer returns the peer, and the endpoint fails the
writes in flight to it (`nixl_ledger.Ledger.fail_peer`) before its lists are released.
"""

from __future__ import annotations

from typing import Any

from kvpush.errors import FailureReason, LocalProtocolError, TransportError
from kvpush.geometry import CacheGeometry, ScratchRegion
from kvpush.transports._checks import check_scratch_registration
from kvpush.transports.nixl_calls import quietly, release_quietly
from kvpush.transports.nixl_memory import (
    LocalMemory,
    NixlPeer,
    prepare_peer,
    register_local,
    scratch_memory_type,
)


class Registry:
    """Our registered memory and the peers loaded into one agent."""

    def __init__(self, name: str, backend: str) -> None:
        self._name = name
        self._backend = backend
        self.local: LocalMemory | None = None  # our KV cache, once registered
        self.scratch: ScratchRegion | None = None
        self.peers: dict[str, NixlPeer] = {}
        self._registered: list[Any] = []  # NIXL's registration handles, deregistered at close

    # ----- memory

    def register_memory(self, agent: Any, geometry: CacheGeometry) -> None:
        if self.local is not None:
            raise LocalProtocolError(
                f"NIXL endpoint {self._name}: memory is registered once; it already is"
            )
        self.local = register_local(agent, self._backend, geometry, self._registered)

    def register_scratch(self, agent: Any, scratch: ScratchRegion) -> None:
        geometry = None if self.local is None else self.local.geometry
        check_scratch_registration(f"NIXL endpoint {self._name}", geometry, self.scratch)
        mem_type, device = scratch_memory_type(scratch)
        try:
            reg = agent.register_memory(
                [(scratch.base_addr, scratch.nbytes, device, "")], mem_type, [self._backend]
            )
        except Exception as exc:
            raise TransportError(
                FailureReason.LOCAL_ERROR,
                f"NIXL could not register the {scratch.nbytes}-byte scratch buffer: {exc!r}",
            ) from exc
        self._registered.append(reg)
        self.scratch = scratch

    def registered_local(self, call: str) -> LocalMemory:
        """Our KV cache, for a `call` that needs it registered first."""
        if self.local is None:
            raise LocalProtocolError(f"NIXL endpoint {self._name}: register_memory() before {call}")
        return self.local

    # ----- peers

    def add_peer(
        self,
        agent: Any,
        peer: str,
        metadata: bytes,
        geometry: CacheGeometry,
        messages_only: bool,
        ours: CacheGeometry | None,
    ) -> None:
        """Load `peer`'s agent from its `metadata` and prepare its descriptor lists (none
                where it is `messages_only`). The caller checked that its regions fit ours
        (`check_region_fits`) and removed an earlier `peer` first."""
        local = self.registered_local("add_peer()")
        assert peer not in self.peers
        try:
            loaded = agent.add_remote_agent(bytes(metadata))
        except Exception as exc:
            raise TransportError(
                FailureReason.HANDSHAKE_FAILED,
                f"NIXL could not load the agent metadata for {peer}: {exc!r}",
            ) from exc
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != peer:
            if loaded_name not in self.peers:
                quietly(agent.remove_remote_agent, loaded_name)
            raise TransportError(
                FailureReason.HANDSHAKE_FAILED,
                f"metadata names agent {loaded_name!r}, expected {peer!r}",
            )
        if messages_only:
            self.peers[peer] = NixlPeer(peer, geometry, None, None)
            return
        self.peers[peer] = prepare_peer(agent, self._backend, local, peer, geometry, ours)

    def take_peer(self, peer: str) -> NixlPeer | None:
        """Forget `peer` (None: not loaded); `release_peer` gives its lists back."""
        return self.peers.pop(peer, None)

    @staticmethod
    def release_peer(agent: Any, state: NixlPeer) -> None:
        """Release a taken peer's lists and unload its agent (`agent` None: closed)."""
        for dlist in (state.dlist, state.source_dlist):
            if dlist is not None:
                release_quietly(dlist)
        if agent is not None:
            quietly(agent.remove_remote_agent, state.name)

    # ----- close

    def release(self, agent: Any) -> None:
        """The endpoint closes: every peer, list and registration goes back to `agent`."""
        for peer in list(self.peers.values()):
            if peer.dlist is not None:
                release_quietly(peer.dlist)
            quietly(agent.remove_remote_agent, peer.name)
        self.peers.clear()
        if self.local is not None and self.local.dlist is not None:
            release_quietly(self.local.dlist)
            self.local.dlist = None
        for reg in self._registered:
            quietly(agent.deregister_memory, reg)
        self._registered.clear()
