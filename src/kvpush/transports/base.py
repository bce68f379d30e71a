"""The transport port: what the runtime needs from a data plane, and nothing more.

Two implementations ship with kvpush: `LoopbackTransport` (in-process, really copies
bytes, injects faults) and `NixlTransport` (NIXL over UCX, between processes and hosts).
Both pass the same conformance suite (tests/transport_conformance.py).

Threading: a transport is driven by exactly one thread, the runtime's. No method may be
called from two threads, and none blocks on the network for longer than a bounded
handshake (`add_peer`). Progress happens inside `poll()`.

Peers are named by agent name, which changes with every incarnation of a process: a
restarted peer is a new peer, and the old name is removed, never reused.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpush.errors import FailureReason
from kvpush.geometry import CacheGeometry, ScratchRegion


@dataclass(frozen=True, slots=True)
class MessageReceived:
    """A control message (or a write's completion notification) from a peer."""

    peer: str
    payload: bytes


@dataclass(frozen=True, slots=True)
class WriteDone:
    """All blocks of write `write_id` landed; its notification, if any, was sent after them.

    What the data plane did for it, as it did it: `nbytes` moved, in `descriptors`
    contiguous copies (NIXL's descriptors after it merged neighbours; 0 for a write that
    moved nothing). Events are told apart by `write_id` alone: these do not compare."""

    write_id: int
    nbytes: int = field(default=0, compare=False)
    descriptors: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class WriteFailed:
    """Write `write_id` failed: some blocks may be partly written; no notification was sent."""

    write_id: int
    reason: FailureReason
    detail: str


@dataclass(frozen=True, slots=True)
class PeerLost:
    """The data plane saw the peer go away (disconnect, removed agent)."""

    peer: str
    reason: FailureReason
    detail: str


TransportEvent = MessageReceived | WriteDone | WriteFailed | PeerLost


class Transport(abc.ABC):
    """One endpoint of the data plane (one NIXL agent)."""

    @property
    @abc.abstractmethod
    def agent_name(self) -> str:
        """Our name on the data plane; unique per process incarnation."""

    @abc.abstractmethod
    def start(self) -> None:
        """Create the agent. Nothing happens in `__init__`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every handle and registration. Idempotent."""

    @abc.abstractmethod
    def register_memory(self, geometry: CacheGeometry) -> None:
        """Register our KV regions, once, before `metadata()` is published."""

    @abc.abstractmethod
    def register_scratch(self, scratch: ScratchRegion) -> None:
        """Register a scratch buffer (never a KV block) for `write_scratch`, once, after
        `register_memory` and before `metadata()` is published."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """What a peer passes to its `add_peer` to reach us (NIXL agent metadata)."""

    @abc.abstractmethod
    def add_peer(
        self,
        peer: str,
        metadata: bytes,
        geometry: CacheGeometry,
        *,
        messages_only: bool = False,
        ours: CacheGeometry | None = None,
    ) -> None:
        """Load a peer and prepare descriptors for its regions, once per incarnation.

        `geometry` says where writes to the peer land, `ours` what they read (None: our
        registered cache): where ranks of different tensor parallelism exchange parts
        of blocks, both are views whose blocks are exactly those bytes
        (`kvpush.geometry.write_views`), inside the memory each side registered. Blocks
        of 0 bytes (a rank pair that shares no heads) move nothing; their writes still
        notify.

        `messages_only`: load it only to send it control messages, because the protocol
        refused its cache (so that it hears why at once); nothing is prepared for writes,
        `write_blocks` to it raises UNKNOWN_PEER, and its geometry is not checked.
        Raises `TransportError` (HANDSHAKE_FAILED) when the metadata cannot be loaded.
        """

    @abc.abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a peer and release what was prepared for it. Unknown peers are ignored."""

    @abc.abstractmethod
    def has_peer(self, peer: str) -> bool: ...

    @abc.abstractmethod
    def write_blocks(
        self,
        peer: str,
        write_id: int,
        our_blocks: Sequence[int],
        their_blocks: Sequence[int],
        notification: bytes | None,
        regions: Sequence[int] | None = None,
    ) -> None:
        """Start copying `our_blocks[i]` to `their_blocks[i]` in every region (or only in
        the regions whose indices are given, for layer-wise push).

        Returns at once. `poll()` later yields `WriteDone(write_id)` or
        `WriteFailed(write_id, ...)`. If `notification` is given, the peer receives it as a
        `MessageReceived` only after every byte of the write has landed, and never if the
        write failed. Raises `TransportError` when the write cannot even be started
        (unknown peer: UNKNOWN_PEER; bad block id: LOCAL_ERROR).
        """

    @abc.abstractmethod
    def write_scratch(self, peer: str, write_id: int, nbytes: int, theirs: ScratchRegion) -> None:
        """Start copying the first `nbytes` of our scratch buffer to the first `nbytes` of
        `theirs`, the peer's (from its published metadata): a test of the data plane that
        touches no KV block (`kvpush.runtime.services`).

        The peer must have been added, for messages only or not. Completes as a block
        write does (`WriteDone`/`WriteFailed` from `poll()`), with no notification.
        Raises `TransportError` when it cannot be started: unknown peer (UNKNOWN_PEER), no
        scratch buffer here or `nbytes` outside either buffer (LOCAL_ERROR)."""

    def description(self) -> dict[str, str]:
        """What this data plane is and how it is configured, for reports."""
        return {"transport": type(self).__name__}

    @abc.abstractmethod
    def send_message(self, peer: str, payload: bytes) -> None:
        """Send a small control message. Fire and forget: loss shows up as peer silence.

        The peer must have been added (`add_peer`), as with NIXL notifications.
        """

    @abc.abstractmethod
    def poll(self) -> list[TransportEvent]:
        """Make progress and return what happened since the last call. Never blocks."""
