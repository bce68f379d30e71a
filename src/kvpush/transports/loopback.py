"""An in-process data plane: several endpoints in one process, with faults on demand.

Theory of operation. A `LoopbackFabric` is the "network": it knows every endpoint by
agent name and carries messages between them. A `LoopbackTransport` is one endpoint; like
`NixlTransport` it is driven by one thread, and all progress happens in `poll()`:

- `write_blocks` only queues the write. The owner's next `poll()` copies the bytes with
  `ctypes.memmove` from our registered memory into the peer's registered memory (the
  addresses of the peer's `CacheGeometry`, checked at `add_peer` to lie inside memory the
  peer registered), then hands the notification to the fabric, then reports `WriteDone`.
  So a notification can never overtake its data, exactly as with a NIXL WRITE.
- Messages (notifications and `send_message`) go into the receiver's inbox in send order;
  the receiver's `poll()` takes those that are due.
- The fabric is shared between threads (each endpoint may be owned by a different
  thread); one lock guards its state. Bytes are copied outside the lock.

Faults are injected through the fabric, per directed link (src -> dst), and apply to the
next `count` messages that match: `drop`, `duplicate`, `delay` (held for `delay_s` of the
fabric's clock, or until `release_delayed()`), `reorder` (held until the next message on
that link has been delivered). `fail_writes` makes the next writes on a link fail (after
copying part of the blocks, if `partial`). `kill` makes an endpoint vanish as a `kill -9`
would: nothing it queued goes out, writes and messages to it are reported PEER_GONE.
`partition`/`heal` cut and restore a pair of endpoints both ways.

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
import enum
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence

from kvpush.errors import ClosedError, FailureReason, LocalProtocolError, TransportError
from kvpush.geometry import CacheGeometry, Region, ScratchRegion
from kvpush.transports._checks import (
    check_region_fits,
    check_scratch_registration,
    validate_scratch_write,
    validate_write,
)
from kvpush.transports.base import (
    MessageReceived,
    PeerLost,
    Transport,
    TransportEvent,
    WriteDone,
    WriteFailed,
)

_METADATA_PREFIX = b"kvpush-loopback/1 "


class Fault(enum.Enum):
    DROP = "drop"
    DUPLICATE = "duplicate"
    DELAY = "delay"
    REORDER = "reorder"


@dataclasses.dataclass(slots=True)
class _FaultRule:
    fault: Fault
    remaining: int
    match: Callable[[bytes], bool] | None
    delay_s: float


@dataclasses.dataclass(slots=True)
class _WriteFaultRule:
    remaining: int
    partial: bool
    reason: FailureReason


@dataclasses.dataclass(slots=True)
class _Envelope:
    src: str
    payload: bytes
    due: float | None  # None: deliverable now; inf: held until released


@dataclasses.dataclass(slots=True)
class _Endpoint:
    name: str
    incarnation: str
    geometry: CacheGeometry | None = None
    scratch: ScratchRegion | None = None
    alive: bool = True
    inbox: deque[_Envelope] = dataclasses.field(default_factory=deque)
    # Events the fabric queues for this endpoint (PeerLost on announced kills).
    fabric_events: list[TransportEvent] = dataclasses.field(default_factory=list)
    added_peers: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(frozen=True, slots=True)
class FabricStatistics:
    messages_sent: int
    messages_delivered: int
    messages_dropped: int
    messages_duplicated: int
    messages_held: int
    writes_done: int
    writes_failed: int
    bytes_written: int


class LoopbackFabric:
    """The in-process network joining `LoopbackTransport`s. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._endpoints: dict[str, _Endpoint] = {}
        self._faults: dict[tuple[str, str], list[_FaultRule]] = {}
        self._write_faults: dict[tuple[str, str], list[_WriteFaultRule]] = {}
        self._partitions: set[frozenset[str]] = set()
        # Messages held by REORDER, per link, released after the next delivery on it.
        self._reorder_held: dict[tuple[str, str], list[_Envelope]] = {}
        self._sent = self._delivered = self._dropped = self._duplicated = 0
        self._writes_done = self._writes_failed = self._bytes_written = 0

    # ----------------------------------------------------------------- fault injection
    def inject(
        self,
        src: str,
        dst: str,
        fault: Fault,
        count: int = 1,
        *,
        match: Callable[[bytes], bool] | None = None,
        delay_s: float = float("inf"),
    ) -> None:
        """Apply `fault` to the next `count` messages from `src` to `dst` that `match`.

        Write notifications are messages too. `delay_s` is for DELAY: how long (by the
        fabric's clock) the message is held; the default holds it until `release_delayed`.
        """
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        if delay_s < 0:
            raise ValueError(f"delay_s must not be negative, got {delay_s}")
        with self._lock:
            self._faults.setdefault((src, dst), []).append(_FaultRule(fault, count, match, delay_s))

    def drop(self, src: str, dst: str, count: int = 1) -> None:
        self.inject(src, dst, Fault.DROP, count)

    def duplicate(self, src: str, dst: str, count: int = 1) -> None:
        self.inject(src, dst, Fault.DUPLICATE, count)

    def delay(self, src: str, dst: str, delay_s: float = float("inf"), count: int = 1) -> None:
        self.inject(src, dst, Fault.DELAY, count, delay_s=delay_s)

    def reorder(self, src: str, dst: str, count: int = 1) -> None:
        self.inject(src, dst, Fault.REORDER, count)

    def fail_writes(
        self,
        src: str,
        dst: str,
        count: int = 1,
        partial: bool = True,
        reason: FailureReason = FailureReason.WRITE_ERROR,
    ) -> None:
        """Make the next `count` writes from `src` to `dst` fail (after copying about half
        of their blocks when `partial`); their notifications are never sent."""
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        with self._lock:
            self._write_faults.setdefault((src, dst), []).append(
                _WriteFaultRule(count, partial, reason)
            )

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()
            self._write_faults.clear()

    def kill(self, name: str, announce: bool = False) -> None:
        """The endpoint vanishes as under `kill -9`: its queued writes and messages never
        leave, its inbox is lost, writes to it fail with PEER_GONE."""
        with self._lock:
            ep = self._endpoint(name)
            ep.alive = False
            ep.inbox.clear()
            if announce:
                for other in self._endpoints.values():
                    if other.alive and name in other.added_peers:
                        other.fabric_events.append(
                            PeerLost(name, FailureReason.PEER_GONE, f"{name} was killed")
                        )

    def partition(self, a: str, b: str) -> None:
        """Cut `a` and `b` apart both ways: messages are lost, writes fail with PEER_GONE."""
        with self._lock:
            self._partitions.add(frozenset((a, b)))

    def heal(self, a: str, b: str) -> None:
        with self._lock:
            self._partitions.discard(frozenset((a, b)))

    def release_delayed(self, src: str | None = None, dst: str | None = None) -> int:
        """Make every held message (DELAY or REORDER) on matching links deliverable now,
        in the order it was sent. Returns how many were released."""
        released = 0
        with self._lock:
            for ep in self._endpoints.values():
                if dst is not None and ep.name != dst:
                    continue
                for env in ep.inbox:
                    if env.due is not None and (src is None or env.src == src):
                        env.due = None
                        released += 1
            for (s, d), held in list(self._reorder_held.items()):
                if (src is None or s == src) and (dst is None or d == dst):
                    target = self._endpoints.get(d)
                    for env in held:
                        if target is not None and target.alive:
                            target.inbox.append(env)
                            released += 1
                    del self._reorder_held[(s, d)]
        return released

    def statistics(self) -> FabricStatistics:
        with self._lock:
            held = sum(len(v) for v in self._reorder_held.values()) + sum(
                1 for ep in self._endpoints.values() for env in ep.inbox if env.due is not None
            )
            return FabricStatistics(
                messages_sent=self._sent,
                messages_delivered=self._delivered,
                messages_dropped=self._dropped,
                messages_duplicated=self._duplicated,
                messages_held=held,
                writes_done=self._writes_done,
                writes_failed=self._writes_failed,
                bytes_written=self._bytes_written,
            )

    def endpoints(self) -> list[str]:
        """Names of the endpoints that are alive."""
        with self._lock:
            return [ep.name for ep in self._endpoints.values() if ep.alive]

    # ------------------------------------------------------------ used by the endpoints
    def _endpoint(self, name: str) -> _Endpoint:
        try:
            return self._endpoints[name]
        except KeyError:
            raise TransportError(
                FailureReason.UNKNOWN_PEER, f"no loopback endpoint named {name!r}"
            ) from None

    def _attach(self, name: str) -> _Endpoint:
        with self._lock:
            if name in self._endpoints:
                raise LocalProtocolError(
                    f"loopback endpoint name {name!r} is already taken: agent names are "
                    "unique per process incarnation, never reused"
                )
            ep = _Endpoint(name=name, incarnation=uuid.uuid4().hex)
            self._endpoints[name] = ep
            return ep

    def _detach(self, name: str) -> None:
        with self._lock:
            ep = self._endpoints.get(name)
            if ep is not None:
                ep.alive = False
                ep.inbox.clear()

    def _set_geometry(self, name: str, geometry: CacheGeometry) -> None:
        with self._lock:
            self._endpoint(name).geometry = geometry

    def _set_scratch(self, name: str, scratch: ScratchRegion) -> None:
        with self._lock:
            self._endpoint(name).scratch = scratch

    def _lookup_for_handshake(self, name: str) -> _Endpoint | None:
        with self._lock:
            ep = self._endpoints.get(name)
            return ep if ep is not None and ep.alive else None

    def _note_added(self, name: str, peer: str, added: bool) -> None:
        with self._lock:
            ep = self._endpoints.get(name)
            if ep is not None:
                if added:
                    ep.added_peers.add(peer)
                else:
                    ep.added_peers.discard(peer)

    def _reachable(self, src: str, dst: str, incarnation: str) -> str | None:
        """None if a write from `src` may land in `dst` now, else why not. Caller holds lock."""
        ep = self._endpoints.get(dst)
        if ep is None or not ep.alive or ep.incarnation != incarnation:
            return f"peer {dst} is gone"
        if frozenset((src, dst)) in self._partitions:
            return f"{src} and {dst} are partitioned"
        return None

    def _alive(self, name: str) -> bool:
        with self._lock:
            ep = self._endpoints.get(name)
            return ep is not None and ep.alive

    def _begin_write(
        self, src: str, dst: str, incarnation: str
    ) -> tuple[str | None, _WriteFaultRule | None]:
        with self._lock:
            src_ep = self._endpoints.get(src)
            if src_ep is None or not src_ep.alive:
                return "sender is dead", None
            why = self._reachable(src, dst, incarnation)
            if why is not None:
                return why, None
            rules = self._write_faults.get((src, dst))
            if rules:
                rule = rules[0]
                rule.remaining -= 1
                if rule.remaining == 0:
                    rules.pop(0)
                return None, rule
            return None, None

    def _finish_write(
        self, src: str, dst: str, incarnation: str, nbytes: int, notification: bytes | None
    ) -> str | None:
        """Account for a copied write and send its notification, atomically with the check
        that the peer is still there (so a notification never reaches a new incarnation)."""
        with self._lock:
            why = self._reachable(src, dst, incarnation)
            if why is not None:
                self._writes_failed += 1
                return why
            self._writes_done += 1
            self._bytes_written += nbytes
            if notification is not None:
                self._send_locked(src, dst, notification)
            return None

    def _count_failed_write(self) -> None:
        with self._lock:
            self._writes_failed += 1

    def _send(self, src: str, dst: str, incarnation: str, payload: bytes) -> str | None:
        """Send a message to the `incarnation` of `dst` we added. Returns why not, when
        that process is gone (killed, closed or restarted): the sender's data plane sees
        the closed connection, as UCX does. A partition loses the message silently."""
        with self._lock:
            src_ep = self._endpoints.get(src)
            target = self._endpoints.get(dst)
            cut = frozenset((src, dst)) in self._partitions
            if (
                not cut
                and src_ep is not None
                and src_ep.alive
                and (target is None or not target.alive or target.incarnation != incarnation)
            ):
                self._sent += 1
                self._dropped += 1
                return f"peer {dst} is gone"
            self._send_locked(src, dst, payload)
            return None

    def _send_locked(self, src: str, dst: str, payload: bytes) -> None:
        self._sent += 1
        src_ep = self._endpoints.get(src)
        target = self._endpoints.get(dst)
        if (
            src_ep is None
            or not src_ep.alive
            or target is None
            or not target.alive
            or frozenset((src, dst)) in self._partitions
        ):
            self._dropped += 1
            return
        link = (src, dst)
        fault: _FaultRule | None = None
        for rule in self._faults.get(link, []):
            if rule.match is None or rule.match(payload):
                fault = rule
                break
        if fault is not None:
            fault.remaining -= 1
            if fault.remaining == 0:
                self._faults[link].remove(fault)
        kind = fault.fault if fault is not None else None
        if kind is Fault.DROP:
            self._dropped += 1
            return
        if kind is Fault.REORDER:
            self._reorder_held.setdefault(link, []).append(_Envelope(src, payload, None))
            return
        if kind is Fault.DELAY:
            assert fault is not None
            due = self._clock() + fault.delay_s
            target.inbox.append(_Envelope(src, payload, due))
            return
        target.inbox.append(_Envelope(src, payload, None))
        if kind is Fault.DUPLICATE:
            self._duplicated += 1
            target.inbox.append(_Envelope(src, payload, None))
        # A message held for reordering goes right after the next one on its link.
        held = self._reorder_held.pop(link, None)
        if held:
            target.inbox.extend(held)

    def _receive(self, name: str) -> list[TransportEvent]:
        with self._lock:
            ep = self._endpoints.get(name)
            if ep is None or not ep.alive:
                return []
            events: list[TransportEvent] = list(ep.fabric_events)
            ep.fabric_events.clear()
            now = self._clock()
            kept: deque[_Envelope] = deque()
            for env in ep.inbox:
                if env.due is None or env.due <= now:
                    events.append(MessageReceived(env.src, env.payload))
                    self._delivered += 1
                else:
                    kept.append(env)
            ep.inbox = kept
            return events


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
        self._ep: _Endpoint | None = None
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

    def _check_open(self) -> _Endpoint:
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

    def _perform_scratch(self, w: _PendingScratch, fault: _WriteFaultRule | None) -> TransportEvent:
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
