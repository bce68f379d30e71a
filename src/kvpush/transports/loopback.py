"""An in-process data plane: several endpoints in one process, with faults on demand.

Theory of operation. A `LoopbackFabric` (`loopback_fabric`) is the "network": it knows
every endpoint by agent name and carries messages between them. A `LoopbackTransport`
(here) is one endpoint; like `NixlTransport` it is driven by one thread, and all progress
happens in `poll()`:

- `write_blocks` only queues the write. The owner's next `poll()` copies the bytes with
  `ctypes.memmove` from our registered memory into the peer's registered memory (the
  addresses of the peer's `CacheGeometry`, checked at `add_peer` to lie inside memory the
  peer registered), then hands the notification to the fabric, then reports `WriteDone`.
  So a notification can never overtake its data, exactly as with a NIXL WRITE.
- Messages (notifications and `send_message`) go into the receiver's inbox in send order;
  the receiver's `poll()` takes those that are due.
- The fabric is shared between threads (each endpoint may be owned by a different
  thread); one lock guards its state. Bytes are copied outside the lock.

Faults are injected through the fabric, per directed link (src -> dst): drops, duplicates,
delays, reorders, failed writes and partitions (`loopback_faults`, which keeps them and
answers what happens to the next message or write). `kill` makes an endpoint vanish as a
`kill -9` would: nothing it queued goes out, writes and messages to it are reported
PEER_GONE.

Like NIXL, the loopback does not announce a dead peer by itself: peers learn it when they
next use it, as UCX sees the closed connection. A write to a process that is gone (killed,
closed, or restarted under the same name) fails with PEER_GONE; a message to it is not
delivered and the sender's next `poll()` yields `PeerLost(PEER_GONE)`, never an exception
at the call. A partitioned peer is silent, dead or alive: nothing is reported, messages
are lost (a host that fell off the network).
`kill(name, announce=True)` additionally queues a `PeerLost` at once for every endpoint
that had added it, for tests of that path.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections import deque
from collections.abc import Sequence

from kvpush.errors import ClosedError, FailureReason, LocalProtocolError, TransportError
from kvpush.geometry import CacheGeometry, Region, ScratchRegion
from kvpush.transports._checks import (
    check_region_fits,
    check_scratch_registration,
    validate_scratch_write,
    validate_write,
)
from kvpush.transports.base import (
    PeerLost,
    Transport,
    TransportEvent,
    WriteDone,
    WriteFailed,
)
from kvpush.transports.loopback_fabric import EndpointState, FabricStatistics, LoopbackFabric
from kvpush.transports.loopback_faults import Fault, WriteFault

# The fabric and its faults are imported from here by whoever builds a loopback data plane.
__all__ = ["FabricStatistics", "Fault", "LoopbackFabric", "LoopbackTransport"]

_METADATA_PREFIX = b"kvpush-loopback/1 "


@dataclasses.dataclass(slots=True)
class _Peer:
    name: str
    incarnation: str
    geometry: CacheGeometry
    source: CacheGeometry  # what writes to it read: our cache, or a view of it
    writable: bool = True  # False: added for messages only


@dataclasses.dataclass(slots=True)
class _PendingWrite:
    write_id: int
    peer: _Peer
    our_blocks: tuple[int, ...]
    their_blocks: tuple[int, ...]
    regions: tuple[int, ...]
    notification: bytes | None


@dataclasses.dataclass(slots=True)
class _PendingScratch:
    write_id: int
    peer: _Peer
    nbytes: int
    theirs: ScratchRegion


def _runs(our: Sequence[int], their: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group block pairs into runs (our_start, their_start, length) where both sides
    are consecutive; each run is one copy when the region's blocks are dense."""
    runs: list[tuple[int, int, int]] = []
    for o, t in zip(our, their, strict=True):
        if runs:
            o0, t0, n = runs[-1]
            if o == o0 + n and t == t0 + n:
                runs[-1] = (o0, t0, n + 1)
                continue
        runs.append((o, t, 1))
    return runs


def _copy_run(ours: Region, theirs: Region, run: tuple[int, int, int]) -> tuple[int, int]:
    """Copy one run of blocks of one region: (bytes copied, copies made)."""
    o, t, n = run
    size = ours.block_bytes
    if ours.block_stride == size and theirs.block_stride == size:
        ctypes.memmove(
            theirs.base_addr + t * theirs.block_stride,
            ours.base_addr + o * ours.block_stride,
            n * size,
        )
        return n * size, 1
    for i in range(n):
        ctypes.memmove(
            theirs.base_addr + (t + i) * theirs.block_stride,
            ours.base_addr + (o + i) * ours.block_stride,
            size,
        )
    return n * size, n


def _region_inside(region: Region, registered: CacheGeometry) -> bool:
    lo = region.base_addr
    hi = lo + (region.num_blocks - 1) * region.block_stride + region.block_bytes
    for r in registered.regions:
        rlo = r.base_addr
        rhi = rlo + (r.num_blocks - 1) * r.block_stride + r.block_bytes
        if rlo <= lo and hi <= rhi:
            return True
    return False


class LoopbackTransport(Transport):
    """One endpoint on a `LoopbackFabric`. Driven by one thread, like every transport."""

    def __init__(self, fabric: LoopbackFabric, name: str) -> None:
        if not name:
            raise ValueError("a loopback endpoint needs a non-empty agent name")
        self._fabric = fabric
        self._name = name
        self._ep: EndpointState | None = None
        self._closed = False
        self._geometry: CacheGeometry | None = None
        self._peers: dict[str, _Peer] = {}
        self._scratch: ScratchRegion | None = None
        self._pending: deque[_PendingWrite | _PendingScratch] = deque()
        self._write_ids: set[int] = set()
        self._events: list[TransportEvent] = []

    @property
    def agent_name(self) -> str:
        return self._name

    @property
    def fabric(self) -> LoopbackFabric:
        return self._fabric

    def start(self) -> None:
        if self._closed:
            raise ClosedError(f"loopback endpoint {self._name} was closed")
        if self._ep is None:
            self._ep = self._fabric._attach(self._name)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._ep is not None:
            self._fabric._detach(self._name)
        self._peers.clear()
        self._pending.clear()
        self._write_ids.clear()
        self._events.clear()

    def _check_open(self) -> EndpointState:
        if self._closed:
            raise ClosedError(f"loopback endpoint {self._name} was closed")
        if self._ep is None:
            raise LocalProtocolError(f"loopback endpoint {self._name}: call start() first")
        return self._ep

    def register_memory(self, geometry: CacheGeometry) -> None:
        self._check_open()
        if self._geometry is not None:
            raise LocalProtocolError(
                f"loopback endpoint {self._name}: memory is registered once; it already is"
            )
        for region in geometry.regions:
            if region.device != "cpu":
                raise TransportError(
                    FailureReason.LOCAL_ERROR,
                    f"the loopback transport copies CPU memory only; region {region.name} "
                    f"is on {region.device}",
                )
        self._geometry = geometry
        self._fabric._set_geometry(self._name, geometry)

    def register_scratch(self, scratch: ScratchRegion) -> None:
        self._check_open()
        check_scratch_registration(f"loopback endpoint {self._name}", self._geometry, self._scratch)
        if scratch.device != "cpu":
            raise TransportError(
                FailureReason.LOCAL_ERROR,
                f"the loopback transport copies CPU memory only; the scratch buffer is on "
                f"{scratch.device}",
            )
        self._scratch = scratch
        self._fabric._set_scratch(self._name, scratch)

    def metadata(self) -> bytes:
        ep = self._check_open()
        if self._geometry is None:
            raise LocalProtocolError(
                f"loopback endpoint {self._name}: register_memory() before metadata()"
            )
        return _METADATA_PREFIX + f"{self._name}\n{ep.incarnation}".encode()

    def add_peer(
        self,
        peer: str,
        metadata: bytes,
        geometry: CacheGeometry,
        *,
        messages_only: bool = False,
        ours: CacheGeometry | None = None,
    ) -> None:
        self._check_open()
        if self._geometry is None:
            raise LocalProtocolError(
                f"loopback endpoint {self._name}: register_memory() before add_peer()"
            )
        if not metadata.startswith(_METADATA_PREFIX):
            raise TransportError(
                FailureReason.HANDSHAKE_FAILED,
                f"metadata for {peer} is not loopback agent metadata "
                f"(expected it to start with {_METADATA_PREFIX!r})",
            )
        try:
            their_name, incarnation = metadata[len(_METADATA_PREFIX) :].decode().split("\n")
        except ValueError:
            raise TransportError(
                FailureReason.HANDSHAKE_FAILED, f"metadata for {peer} is malformed"
            ) from None
        if their_name != peer:
            raise TransportError(
                FailureReason.HANDSHAKE_FAILED,
                f"metadata names agent {their_name!r}, expected {peer!r}",
            )
        ep = self._fabric._lookup_for_handshake(peer)
        if ep is None or ep.incarnation != incarnation or ep.geometry is None:
            raise TransportError(
                FailureReason.HANDSHAKE_FAILED,
                f"agent {peer} is not reachable on the loopback fabric (gone or restarted)",
            )
        source = self._geometry if ours is None else ours
        if not messages_only:
            check_region_fits(source, geometry, peer)
            for region in source.regions:
                if not _region_inside(region, self._geometry):
                    raise TransportError(
                        FailureReason.LOCAL_ERROR,
                        f"region {region.name} of the view we would write to {peer} from is "
                        "not inside the memory we registered",
                    )
            for region in geometry.regions:
                if not _region_inside(region, ep.geometry):
                    raise TransportError(
                        FailureReason.HANDSHAKE_FAILED,
                        f"region {region.name} of {peer} is not inside memory {peer} registered",
                    )
        if peer in self._peers:
            self.remove_peer(peer)
        self._peers[peer] = _Peer(peer, incarnation, geometry, source, writable=not messages_only)
        self._fabric._note_added(self._name, peer, True)

    def remove_peer(self, peer: str) -> None:
        if self._peers.pop(peer, None) is None:
            return
        self._fabric._note_added(self._name, peer, False)
        kept: deque[_PendingWrite | _PendingScratch] = deque()
        for w in self._pending:
            if w.peer.name == peer:
                self._write_ids.discard(w.write_id)
                self._events.append(
                    WriteFailed(w.write_id, FailureReason.PEER_GONE, f"peer {peer} was removed")
                )
            else:
                kept.append(w)
        self._pending = kept

    def has_peer(self, peer: str) -> bool:
        return peer in self._peers

    def write_blocks(
        self,
        peer: str,
        write_id: int,
        our_blocks: Sequence[int],
        their_blocks: Sequence[int],
        notification: bytes | None,
        regions: Sequence[int] | None = None,
    ) -> None:
        self._check_open()
        assert self._geometry is not None or not self._peers
        target = self._peers.get(peer)
        if target is None or self._geometry is None:
            raise TransportError(
                FailureReason.UNKNOWN_PEER, f"write to {peer}: peer was not added (add_peer)"
            )
        if not target.writable:
            raise TransportError(
                FailureReason.UNKNOWN_PEER,
                f"write to {peer}: peer was added for messages only (its cache is incompatible)",
            )
        if write_id in self._write_ids:
            raise TransportError(
                FailureReason.LOCAL_ERROR, f"write id {write_id} is already in flight"
            )
        region_ids = validate_write(
            target.source, target.geometry, peer, our_blocks, their_blocks, regions, notification
        )
        self._write_ids.add(write_id)
        self._pending.append(
            _PendingWrite(
                write_id,
                target,
                tuple(our_blocks),
                tuple(their_blocks),
                region_ids,
                None if notification is None else bytes(notification),
            )
        )

    def write_scratch(self, peer: str, write_id: int, nbytes: int, theirs: ScratchRegion) -> None:
        self._check_open()
        target = self._peers.get(peer)
        if target is None:
            raise TransportError(
                FailureReason.UNKNOWN_PEER,
                f"scratch write to {peer}: peer was not added (add_peer)",
            )
        validate_scratch_write(self._scratch, theirs, peer, nbytes)
        if write_id in self._write_ids:
            raise TransportError(
                FailureReason.LOCAL_ERROR, f"write id {write_id} is already in flight"
            )
        self._write_ids.add(write_id)
        self._pending.append(_PendingScratch(write_id, target, nbytes, theirs))

    def send_message(self, peer: str, payload: bytes) -> None:
        self._check_open()
        if peer not in self._peers:
            raise TransportError(
                FailureReason.UNKNOWN_PEER, f"message to {peer}: peer was not added (add_peer)"
            )
        target = self._peers[peer]
        why = self._fabric._send(self._name, peer, target.incarnation, bytes(payload))
        if why is not None:
            # Reported on the next poll, never raised: NIXL reports it the same way.
            self._events.append(
                PeerLost(peer, FailureReason.PEER_GONE, f"message to {peer} not delivered: {why}")
            )

    def poll(self) -> list[TransportEvent]:
        self._check_open()
        if not self._fabric._alive(self._name):
            # Killed: a dead process makes no progress and hears nothing.
            return []
        events = self._events
        self._events = []
        while self._pending:
            events.append(self._perform(self._pending.popleft()))
        events.extend(self._fabric._receive(self._name))
        return events

    def _perform(self, w: _PendingWrite | _PendingScratch) -> TransportEvent:
        assert self._geometry is not None
        self._write_ids.discard(w.write_id)
        peer = w.peer
        why, fault = self._fabric._begin_write(self._name, peer.name, peer.incarnation)
        if why is not None:
            self._fabric._count_failed_write()
            return WriteFailed(w.write_id, FailureReason.PEER_GONE, why)
        if isinstance(w, _PendingScratch):
            return self._perform_scratch(w, fault)
        runs = _runs(w.our_blocks, w.their_blocks)
        if fault is not None and fault.partial:
            runs = _runs(
                w.our_blocks[: len(w.our_blocks) // 2], w.their_blocks[: len(w.their_blocks) // 2]
            )
        nbytes = copies = 0
        for r in w.regions:
            ours, theirs = peer.source.regions[r], peer.geometry.regions[r]
            for run in runs:
                moved, made = _copy_run(ours, theirs, run)
                nbytes += moved
                copies += made
        if fault is not None:
            self._fabric._count_failed_write()
            return WriteFailed(w.write_id, fault.reason, "injected write failure")
        why = self._fabric._finish_write(
            self._name, peer.name, peer.incarnation, nbytes, w.notification
        )
        if why is not None:
            return WriteFailed(w.write_id, FailureReason.PEER_GONE, why)
        return WriteDone(w.write_id, nbytes, copies)

    def _perform_scratch(self, w: _PendingScratch, fault: WriteFault | None) -> TransportEvent:
        peer = w.peer
        registered = self._fabric._lookup_for_handshake(peer.name)
        theirs = None if registered is None else registered.scratch
        hi = w.theirs.base_addr + w.nbytes
        if theirs is None or not (
            theirs.base_addr <= w.theirs.base_addr and hi <= theirs.base_addr + theirs.nbytes
        ):
            # What NIXL refuses too: memory the peer never registered.
            self._fabric._count_failed_write()
            return WriteFailed(
                w.write_id,
                FailureReason.WRITE_ERROR,
                f"scratch write to {peer.name}: not inside a buffer {peer.name} registered",
            )
        assert self._scratch is not None  # checked when the write was started
        nbytes = w.nbytes // 2 if fault is not None and fault.partial else w.nbytes
        ctypes.memmove(w.theirs.base_addr, self._scratch.base_addr, nbytes)
        if fault is not None:
            self._fabric._count_failed_write()
            return WriteFailed(w.write_id, fault.reason, "injected write failure")
        why = self._fabric._finish_write(self._name, peer.name, peer.incarnation, nbytes, None)
        if why is not None:
            return WriteFailed(w.write_id, FailureReason.PEER_GONE, why)
        return WriteDone(w.write_id, nbytes, 1)
