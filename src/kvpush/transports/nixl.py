"""The NIXL data plane: one NIXL agent (UCX backend) per endpoint.

Theory of operation.

- One agent, driven by one thread at a time (the runtime's lock). NIXL's listener is
  off (metadata travels over kvpush's side channel: `metadata()` is
  `get_agent_metadata()`, `add_peer` is `add_remote_agent`). By default NIXL's
  progress thread is off too, and all progress happens when the owner calls `poll()`:
  checking transfer states and fetching notifications is what drives UCX. An idle
  endpoint therefore costs nothing, but a peer that writes to us only progresses as
  fast as both sides poll. On one host UCX runs over TCP (its shared-memory transports
  cannot detect a dead peer), so a WRITE completes only after a round trip with the
  peer's worker, and its notification goes out only then: three alternating polls,
  receiver, sender, receiver, per write (measured: `scripts/nixl-flush-ack`).
- `progress_thread_wait_ms=N` turns NIXL's UCX progress thread on, waiting in poll()
  on UCX's event fd with an N ms timeout (NIXL's Python API would make that wait 0, a
  spin of a whole core: `_nixl_import.NixlModule.make_agent`). The data plane then
  moves on its own and `poll()` only collects what happened: inside a busy engine
  (GIL-bound polls) a 1-block transfer's latency fell ~3x; but large transfers cost
  2-4x the sender CPU per GB (UCX's worker lock shared by two threads; measured on 2
  cores, docs/benchmarks.md), so it is off by default.
- Memory is registered once per region (the span of its blocks). At registration we
  prepare our local descriptor list, one descriptor per (region, block), index
  `region * num_blocks + block`; at `add_peer` the same for the peer's regions. A write
  selects indices from both prepared lists (`make_prepped_xfer`): nothing is rebuilt per
  write, and no byte of the KV cache is copied on the way. NIXL merges descriptors that
  are contiguous on both sides (measured: a 256 MiB Llama-3.1-8B-shaped write of 8192
  per-block descriptors goes out as 64, one per region, and runs ~1.4x faster than
  unmerged), so runs of consecutive blocks cost one descriptor each.
- Completion rides on the WRITE as its NIXL notification, so the peer sees it only after
  the data. Control messages are standalone notifications (`send_notif`).
- NIXL errors are translated here, once: a remote disconnect is PEER_GONE, any other
  failure of a posted write is WRITE_ERROR, a metadata that cannot be loaded is
  HANDSHAKE_FAILED. NIXL sends no notification for a failed WRITE; the runtime tells the
  peer itself.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpush.errors import ClosedError, FailureReason, LocalProtocolError, TransportError
from kvpush.geometry import CacheGeometry, Region, ScratchRegion
from kvpush.transports._checks import (
    check_region_fits,
    check_scratch_registration,
    validate_scratch_write,
    validate_write,
)
from kvpush.transports._nixl_import import NixlModule, load_nixl
from kvpush.transports.base import (
    MessageReceived,
    PeerLost,
    Transport,
    TransportEvent,
    WriteDone,
    WriteFailed,
)

logger = logging.getLogger(__name__)

_LOCAL = "NIXL_INIT_AGENT"


def region_memory_type(region: Region) -> tuple[str, int]:
    """NIXL memory type and device id of a region: DRAM for "cpu", VRAM for "cuda:N"."""
    if region.device == "cpu":
        return "DRAM", 0
    if region.device == "cuda" or region.device.startswith("cuda:"):
        _, _, index = region.device.partition(":")
        return "VRAM", int(index or 0)
    raise TransportError(
        FailureReason.LOCAL_ERROR,
        f"region {region.name} is on device {region.device!r}; expected 'cpu' or 'cuda:N'",
    )


def geometry_memory_type(geometry: CacheGeometry) -> str:
    types = {region_memory_type(r)[0] for r in geometry.regions}
    if len(types) > 1:
        raise TransportError(
            FailureReason.LOCAL_ERROR,
            "every KV region must be in one kind of memory (all cpu or all cuda); "
            f"got {sorted(types)}",
        )
    return types.pop() if types else "DRAM"


def block_descriptors(geometry: CacheGeometry) -> npt.NDArray[np.uint64]:
    """One (address, length, device) row per (region, block), row `r * num_blocks + b`."""
    nb = geometry.num_blocks
    out = np.zeros((len(geometry.regions) * nb, 3), dtype=np.uint64)
    blocks = np.arange(nb, dtype=np.uint64)
    for r, region in enumerate(geometry.regions):
        rows = slice(r * nb, (r + 1) * nb)
        out[rows, 0] = np.uint64(region.base_addr) + blocks * np.uint64(region.block_stride)
        out[rows, 1] = region.block_bytes
        out[rows, 2] = region_memory_type(region)[1]
    return out


def merged_descriptor_count(
    ours: npt.NDArray[np.uint64],
    theirs: npt.NDArray[np.uint64],
    our_index: npt.NDArray[np.int32],
    their_index: npt.NDArray[np.int32],
) -> int:
    """How many descriptors a write becomes once neighbours contiguous on both sides merge."""
    if len(our_index) == 0:
        return 0
    src = ours[our_index]
    dst = theirs[their_index]
    src_next = src[:-1, 0] + src[:-1, 1] == src[1:, 0]
    dst_next = dst[:-1, 0] + dst[:-1, 1] == dst[1:, 0]
    return int(len(our_index) - np.count_nonzero(src_next & dst_next))


@dataclasses.dataclass(slots=True)
class _Peer:
    name: str
    geometry: CacheGeometry
    descriptors: npt.NDArray[np.uint64] | None  # None: loaded for messages only
    dlist: Any  # NIXL prepared descriptor list for the peer's blocks, or None
    # The write plan of one block: row of (region r, block 0) in `dlist`, per region;
    # block b's rows are this + b.
    region_rows: npt.NDArray[np.int32] = dataclasses.field(
        default_factory=lambda: np.zeros(0, dtype=np.int32)
    )
    # What writes to it read, where that is a view of our cache (parts of blocks, for a
    # rank of another TP size): its own descriptors and prepared list; None: the cache's.
    source_descriptors: npt.NDArray[np.uint64] | None = None
    source_dlist: Any = None
    # That view's geometry, and the rows of (region r, block 0) in its list (None: ours);
    # a view of blocks of another size has more blocks than our cache.
    source: CacheGeometry | None = None
    source_rows: npt.NDArray[np.int32] | None = None
    # Bytes each region's block moves (the view's), and their sum; empty: messages only.
    region_bytes: tuple[int, ...] = ()
    bytes_per_block: int = 0

    @property
    def moves_nothing(self) -> bool:
        """Its blocks are 0 bytes: the rank pair shares no heads."""
        return bool(self.region_bytes) and not any(self.region_bytes)


class _WriteCalls:
    """NIXL's three per-write calls (make, post, check), bound once per agent.

    `nixl_agent`'s methods of the same names rebuild the backend list, look the
    operation up and map the status per call: about 1 us each, on every write and every
    check of a write in flight. Here the bindings' own methods are called with what
    those wrappers would pass (handles stay NIXL's `nixl_xfer_handle`, released the
    same way). A NIXL whose Python API lacks any of these falls back to the API."""

    def __init__(self, nixl: NixlModule, agent: Any, backend: str, merge: bool) -> None:
        self._agent = agent
        self._backend = backend
        self._skip_merge = not merge
        try:
            raw = agent.agent
            bindings = nixl.api.nixlBind
            self._handle_type = nixl.api.nixl_xfer_handle
            self._make_raw = raw.makeXferReq
            self._post_raw = raw.postXferReq
            self._status_raw = raw.getXferStatus
            self._op = agent.nixl_ops["WRITE"]
            self._backends = [agent.backends[backend]]
            self._states = {bindings.NIXL_SUCCESS: "DONE", bindings.NIXL_IN_PROG: "PROC"}
            self._raw = raw
            self.bound = True
        except (AttributeError, KeyError, TypeError):
            self.bound = False

    def make(self, ours: Any, our_index: Any, theirs: Any, their_index: Any, notif: bytes) -> Any:
        if not self.bound:
            return self._agent.make_prepped_xfer(
                "WRITE",
                ours,
                our_index,
                theirs,
                their_index,
                notif,
                [self._backend],
                skip_desc_merge=self._skip_merge,
            )
        value = self._make_raw(
            self._op,
            ours._handle,
            our_index,
            theirs._handle,
            their_index,
            notif,
            self._backends,
            self._skip_merge,
        )
        return self._handle_type(self._raw, value)

    def post(self, handle: Any, notif: bytes) -> str:
        if not self.bound:
            return str(self._agent.transfer(handle, notif))
        return self._states.get(self._post_raw(handle._handle, notif), "ERR")

    def state(self, handle: Any) -> str:
        if not self.bound:
            return str(self._agent.check_xfer_state(handle))
        return self._states.get(self._status_raw(handle._handle), "ERR")


@dataclasses.dataclass(slots=True)
class _InFlight:
    write_id: int
    peer: str
    handle: Any  # nixl_xfer_handle
    nbytes: int = 0  # what it moves, and in how many descriptors (`WriteDone`)
    descriptors: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class NixlStatistics:
    writes_posted: int
    writes_done: int
    writes_failed: int
    writes_in_flight: int
    bytes_posted: int
    descriptors_posted: int  # after merging contiguous blocks
    last_write_descriptors: int
    last_write_block_descriptors: int  # before merging: blocks x regions
    messages_sent: int
    messages_received: int


class NixlTransport(Transport):
    """One NIXL agent with the UCX backend. See the module docstring."""

    def __init__(
        self,
        name: str,
        *,
        backend: str = "UCX",
        merge_descriptors: bool = True,
        num_threads: int = 0,
        progress_thread_wait_ms: int = 0,
    ) -> None:
        if not name:
            raise ValueError("a NIXL endpoint needs a non-empty agent name")
        if progress_thread_wait_ms < 0:
            raise ValueError(
                f"progress_thread_wait_ms must be >= 0 (0: no progress thread), "
                f"got {progress_thread_wait_ms}"
            )
        self._progress_wait_ms = progress_thread_wait_ms
        self._name = name
        self._backend = backend
        self._merge = merge_descriptors
        self._num_threads = num_threads
        self._nixl: NixlModule | None = None
        self._calls: _WriteCalls | None = None
        self._agent: Any = None
        self._closed = False
        self._geometry: CacheGeometry | None = None
        self._mem_type = "DRAM"
        self._registered: list[Any] = []
        self._our_descriptors: npt.NDArray[np.uint64] = np.zeros((0, 3), dtype=np.uint64)
        self._our_dlist: Any = None
        self._backends = [backend]
        self._region_bytes: tuple[int, ...] = ()
        self._num_blocks = 0
        self._region_rows: npt.NDArray[np.int32] = np.zeros(0, dtype=np.int32)
        self._regions_adjacent = False
        self._scratch: ScratchRegion | None = None
        self._peers: dict[str, _Peer] = {}
        self._in_flight: dict[int, _InFlight] = {}
        self._events: list[TransportEvent] = []
        self._writes_posted = self._writes_done = self._writes_failed = 0
        self._bytes_posted = self._descriptors_posted = 0
        self._last_descriptors = self._last_block_descriptors = 0
        self._messages_sent = self._messages_received = 0

    # ----------------------------------------------------------------- lifecycle
    @property
    def agent_name(self) -> str:
        return self._name

    def start(self) -> None:
        if self._closed:
            raise ClosedError(f"NIXL endpoint {self._name} was closed")
        if self._agent is not None:
            return
        nixl = load_nixl()
        config = nixl.nixl_agent_config(
            enable_prog_thread=self._progress_wait_ms > 0,
            enable_listen_thread=False,
            backends=[self._backend],
            num_threads=self._num_threads,
        )
        try:
            agent = nixl.make_agent(self._name, config, self._progress_wait_ms * 1000)
        except Exception as exc:
            raise TransportError(
                FailureReason.LOCAL_ERROR, f"cannot create NIXL agent {self._name}: {exc!r}"
            ) from exc
        if self._backend not in agent.backends:
            raise TransportError(
                FailureReason.LOCAL_ERROR,
                f"NIXL backend {self._backend} is not available here (have "
                f"{sorted(agent.backends)}; plugins {agent.plugin_list})",
            )
        self._nixl = nixl
        self._agent = agent
        self._calls = _WriteCalls(nixl, agent, self._backend, self._merge)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        agent, self._agent = self._agent, None
        self._calls = None  # holds the agent too: `del agent` below must be the last one
        if agent is None:
            return
        for w in self._in_flight.values():
            _release_quietly(w.handle)
        self._in_flight.clear()
        for peer in list(self._peers.values()):
            if peer.dlist is not None:
                _release_quietly(peer.dlist)
            _quietly(agent.remove_remote_agent, peer.name)
        self._peers.clear()
        if self._our_dlist is not None:
            _release_quietly(self._our_dlist)
            self._our_dlist = None
        for reg in self._registered:
            _quietly(agent.deregister_memory, reg)
        self._registered.clear()
        self._events.clear()
        del agent  # the last reference: NIXL tears the agent down here

    def _live_agent(self) -> Any:
        if self._closed:
            raise ClosedError(f"NIXL endpoint {self._name} was closed")
        if self._agent is None:
            raise LocalProtocolError(f"NIXL endpoint {self._name}: call start() first")
        return self._agent

    # ---------------------------------------------------------------- memory, peers
    def register_memory(self, geometry: CacheGeometry) -> None:
        agent = self._live_agent()
        if self._geometry is not None:
            raise LocalProtocolError(
                f"NIXL endpoint {self._name}: memory is registered once; it already is"
            )
        mem_type = geometry_memory_type(geometry)
        spans = [
            (
                r.base_addr,
                (r.num_blocks - 1) * r.block_stride + r.block_bytes,
                region_memory_type(r)[1],
                "",
            )
            for r in geometry.regions
            if r.num_blocks > 0
        ]
        descriptors = block_descriptors(geometry)
        try:
            if spans:
                self._registered.append(agent.register_memory(spans, mem_type, [self._backend]))
            dlist = agent.prep_xfer_dlist(_LOCAL, descriptors, mem_type, [self._backend])
        except Exception as exc:
            for reg in self._registered:
                _quietly(agent.deregister_memory, reg)
            self._registered.clear()
            raise TransportError(
                FailureReason.LOCAL_ERROR,
                f"NIXL could not register {len(spans)} {mem_type} regions: {exc!r}",
            ) from exc
        self._geometry = geometry
        self._mem_type = mem_type
        self._our_descriptors = descriptors
        self._our_dlist = dlist
        self._num_blocks = geometry.num_blocks
        self._region_rows = np.arange(len(geometry.regions), dtype=np.int32) * np.int32(
            geometry.num_blocks
        )
        self._region_bytes = tuple(r.block_bytes for r in geometry.regions)
        # Whether one block's descriptors could ever merge across regions: only if the
        # spans of two regions touch or interleave (K and V in one tensor, say). Separate
        # allocations never do, and a one-block write then skips the merge count.
        extents = sorted(
            (r.base_addr, r.base_addr + (r.num_blocks - 1) * r.block_stride + r.block_bytes)
            for r in geometry.regions
            if r.num_blocks > 0
        )
        self._regions_adjacent = any(b[0] <= a[1] for a, b in itertools.pairwise(extents))

    def register_scratch(self, scratch: ScratchRegion) -> None:
        agent = self._live_agent()
        check_scratch_registration(f"NIXL endpoint {self._name}", self._geometry, self._scratch)
        mem_type, device = _scratch_memory_type(scratch)
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
        self._scratch = scratch

    def metadata(self) -> bytes:
        agent = self._live_agent()
        if self._geometry is None:
            raise LocalProtocolError(
                f"NIXL endpoint {self._name}: register_memory() before metadata()"
            )
        return bytes(agent.get_agent_metadata())

    def add_peer(
        self,
        peer: str,
        metadata: bytes,
        geometry: CacheGeometry,
        *,
        messages_only: bool = False,
        ours: CacheGeometry | None = None,
    ) -> None:
        agent = self._live_agent()
        if self._geometry is None:
            raise LocalProtocolError(
                f"NIXL endpoint {self._name}: register_memory() before add_peer()"
            )
        source = self._geometry if ours is None else ours
        if not messages_only:
            check_region_fits(source, geometry, peer)
        if peer in self._peers:
            self.remove_peer(peer)
        try:
            loaded = agent.add_remote_agent(bytes(metadata))
        except Exception as exc:
            raise TransportError(
                FailureReason.HANDSHAKE_FAILED,
                f"NIXL could not load the agent metadata for {peer}: {exc!r}",
            ) from exc
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != peer:
            if loaded_name not in self._peers:
                _quietly(agent.remove_remote_agent, loaded_name)
            raise TransportError(
                FailureReason.HANDSHAKE_FAILED,
                f"metadata names agent {loaded_name!r}, expected {peer!r}",
            )
        if messages_only:
            self._peers[peer] = _Peer(peer, geometry, None, None)
            return
        rows = np.arange(len(geometry.regions), dtype=np.int32) * np.int32(geometry.num_blocks)
        region_bytes = tuple(r.block_bytes for r in source.regions)
        if region_bytes and not any(region_bytes):
            # A rank pair that shares no heads: nothing to describe, writes only notify.
            self._peers[peer] = _Peer(
                peer, geometry, np.zeros((0, 3), np.uint64), None, rows, region_bytes=region_bytes
            )
            return
        descriptors = block_descriptors(geometry)
        try:
            their_type = geometry_memory_type(geometry)
            dlist = agent.prep_xfer_dlist(peer, descriptors, their_type, [self._backend])
        except Exception as exc:
            _quietly(agent.remove_remote_agent, peer)
            raise TransportError(
                FailureReason.HANDSHAKE_FAILED,
                f"the regions {peer} published are not memory it registered with NIXL: {exc!r}",
            ) from exc
        state = _Peer(
            peer,
            geometry,
            descriptors,
            dlist,
            rows,
            region_bytes=region_bytes,
            bytes_per_block=sum(region_bytes),
        )
        if ours is not None:
            state.source = ours
            state.source_rows = np.arange(len(ours.regions), dtype=np.int32) * np.int32(
                ours.num_blocks
            )
            state.source_descriptors = block_descriptors(ours)
            try:
                state.source_dlist = agent.prep_xfer_dlist(
                    _LOCAL, state.source_descriptors, self._mem_type, [self._backend]
                )
            except Exception as exc:
                _release_quietly(dlist)
                _quietly(agent.remove_remote_agent, peer)
                raise TransportError(
                    FailureReason.LOCAL_ERROR,
                    f"the part of our blocks we would write to {peer} is not memory we "
                    f"registered with NIXL: {exc!r}",
                ) from exc
        self._peers[peer] = state

    def remove_peer(self, peer: str) -> None:
        state = self._peers.pop(peer, None)
        if state is None:
            return
        for write_id, w in list(self._in_flight.items()):
            if w.peer == peer:
                _release_quietly(w.handle)
                del self._in_flight[write_id]
                self._writes_failed += 1
                self._events.append(
                    WriteFailed(write_id, FailureReason.PEER_GONE, f"peer {peer} was removed")
                )
        for dlist in (state.dlist, state.source_dlist):
            if dlist is not None:
                _release_quietly(dlist)
        if self._agent is not None:
            _quietly(self._agent.remove_remote_agent, peer)

    def has_peer(self, peer: str) -> bool:
        return peer in self._peers

    # --------------------------------------------------------------------- writes
    def write_blocks(
        self,
        peer: str,
        write_id: int,
        our_blocks: Sequence[int],
        their_blocks: Sequence[int],
        notification: bytes | None,
        regions: Sequence[int] | None = None,
    ) -> None:
        self._live_agent()
        target = self._peers.get(peer)
        if target is None or self._geometry is None:
            raise TransportError(
                FailureReason.UNKNOWN_PEER, f"write to {peer}: peer was not added (add_peer)"
            )
        if target.moves_nothing:
            # The rank pair shares no heads: the write moves nothing, and still notifies.
            validate_write(
                target.source or self._geometry,
                target.geometry,
                peer,
                our_blocks,
                their_blocks,
                regions,
                notification,
            )
            if notification is not None:
                self._send_notif(peer, bytes(notification))
            self._writes_posted += 1
            self._writes_done += 1
            self._events.append(WriteDone(write_id))
            return
        if target.dlist is None or target.descriptors is None:
            raise TransportError(
                FailureReason.UNKNOWN_PEER,
                f"write to {peer}: peer was added for messages only (its cache is incompatible)",
            )
        if write_id in self._in_flight:
            raise TransportError(
                FailureReason.LOCAL_ERROR, f"write id {write_id} is already in flight"
            )
        source = target.source or self._geometry
        if (
            regions is None
            and notification
            and len(our_blocks) == 1 == len(their_blocks)
            and type(ob := our_blocks[0]) is int
            and type(tb := their_blocks[0]) is int
            and 0 <= ob < source.num_blocks
            and 0 <= tb < target.geometry.num_blocks
            and len(self._region_rows)
        ):
            # The common small write, checked as validate_write would pass it: one
            # block, every region, a notification; its descriptor rows from the plans.
            source_rows = self._region_rows if target.source_rows is None else target.source_rows
            rows, their_rows = source_rows + ob, target.region_rows + tb
            self._post(target, write_id, rows, their_rows, bytes(notification), 1)
            return
        region_ids = validate_write(
            source, target.geometry, peer, our_blocks, their_blocks, regions, notification
        )
        notif = b"" if notification is None else bytes(notification)
        if not our_blocks or not region_ids:
            # Nothing to move; NIXL refuses empty transfers. The notification still goes.
            if notification is not None:
                self._send_notif(peer, notif)
            self._writes_posted += 1
            self._writes_done += 1
            self._events.append(WriteDone(write_id))
            return
        # Descriptor row of (region r, block b) is r * num_blocks + b on each side.
        nb, their_nb = source.num_blocks, target.geometry.num_blocks
        region_arr = np.asarray(region_ids, dtype=np.int64)[:, None]
        our_index = (
            (region_arr * nb + np.asarray(our_blocks, dtype=np.int64)).astype(np.int32).ravel()
        )
        their_index = (
            (region_arr * their_nb + np.asarray(their_blocks, dtype=np.int64))
            .astype(np.int32)
            .ravel()
        )
        self._post(target, write_id, our_index, their_index, notif, len(our_blocks))

    def _post(
        self,
        target: _Peer,
        write_id: int,
        our_index: npt.NDArray[np.int32],
        their_index: npt.NDArray[np.int32],
        notif: bytes,
        num_blocks: int,
    ) -> None:
        """Make and post one checked write of `num_blocks` blocks: the descriptor rows
        given on each side, the same regions of each block."""
        calls = self._calls
        assert calls is not None  # set with the agent
        try:
            ours = self._our_dlist if target.source_dlist is None else target.source_dlist
            handle = calls.make(ours, our_index, target.dlist, their_index, notif)
        except Exception as exc:
            # The arguments were checked above: what fails here is the data plane.
            self._writes_posted += 1
            self._not_prepared(write_id, exc)
            return
        try:
            state = calls.post(handle, notif)
        except Exception as exc:
            _release_quietly(handle)
            reason = self._reason(exc)
            self._writes_posted += 1
            self._writes_failed += 1
            self._events.append(WriteFailed(write_id, reason, f"NIXL refused the write: {exc!r}"))
            return
        self._writes_posted += 1
        rb = target.region_bytes
        nb = self._num_blocks if target.source is None else target.source.num_blocks
        if len(our_index) == len(rb) * num_blocks:
            nbytes = target.bytes_per_block * num_blocks
        else:
            nbytes = sum(rb[int(i) // nb] for i in our_index)
        self._bytes_posted += nbytes
        self._last_block_descriptors = len(our_index)
        # Descriptors of one block are in separate allocations unless regions touch: a
        # one-block write merges nothing then, and skips the count.
        merged = len(our_index)
        if self._merge and (num_blocks > 1 or self._regions_adjacent):
            assert target.descriptors is not None
            source = (
                self._our_descriptors
                if target.source_descriptors is None
                else target.source_descriptors
            )
            merged = merged_descriptor_count(source, target.descriptors, our_index, their_index)
        self._last_descriptors = merged
        self._descriptors_posted += merged
        if state == "ERR":
            _release_quietly(handle)
            self._writes_failed += 1
            self._events.append(
                WriteFailed(write_id, FailureReason.WRITE_ERROR, "NIXL failed to post the write")
            )
            return
        self._in_flight[write_id] = _InFlight(write_id, target.name, handle, nbytes, merged)

    def write_scratch(self, peer: str, write_id: int, nbytes: int, theirs: ScratchRegion) -> None:
        agent = self._live_agent()
        if peer not in self._peers:
            raise TransportError(
                FailureReason.UNKNOWN_PEER,
                f"scratch write to {peer}: peer was not added (add_peer)",
            )
        validate_scratch_write(self._scratch, theirs, peer, nbytes)
        assert self._scratch is not None  # checked above
        if write_id in self._in_flight:
            raise TransportError(
                FailureReason.LOCAL_ERROR, f"write id {write_id} is already in flight"
            )
        our_type, our_device = _scratch_memory_type(self._scratch)
        their_type, their_device = _scratch_memory_type(theirs)
        self._writes_posted += 1
        try:
            # Not prepared ahead: a test write is rare, and its size is the caller's.
            handle = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs([(self._scratch.base_addr, nbytes, our_device)], our_type),
                agent.get_xfer_descs([(theirs.base_addr, nbytes, their_device)], their_type),
                peer,
                b"",
                [self._backend],
            )
        except Exception as exc:
            self._not_prepared(write_id, exc)
            return
        try:
            state = str(agent.transfer(handle))
        except Exception as exc:
            state, detail = "ERR", f"NIXL refused the write: {exc!r}"
        else:
            detail = "NIXL failed to post the write"
        if state == "ERR":
            _release_quietly(handle)
            self._writes_failed += 1
            self._events.append(WriteFailed(write_id, FailureReason.WRITE_ERROR, detail))
            return
        self._bytes_posted += nbytes
        self._in_flight[write_id] = _InFlight(write_id, peer, handle, nbytes, 1)

    def _not_prepared(self, write_id: int, exc: BaseException) -> None:
        """NIXL could not prepare a write (counted as posted already): it fails."""
        self._writes_failed += 1
        self._events.append(
            WriteFailed(write_id, self._reason(exc), f"NIXL could not prepare the write: {exc!r}")
        )

    def description(self) -> dict[str, str]:
        out = {"transport": f"NIXL with the {self._backend} backend"}
        if self._backend == "UCX":
            # Only what is set: where neither is, UCX picks among every transport it has.
            out.update(
                {k: os.environ[k] for k in ("UCX_TLS", "UCX_NET_DEVICES") if k in os.environ}
            )
        out["memory"] = self._mem_type
        return out

    def send_message(self, peer: str, payload: bytes) -> None:
        self._live_agent()
        if peer not in self._peers:
            raise TransportError(
                FailureReason.UNKNOWN_PEER, f"message to {peer}: peer was not added (add_peer)"
            )
        self._send_notif(peer, bytes(payload))

    def _send_notif(self, peer: str, payload: bytes) -> None:
        try:
            self._agent.send_notif(peer, payload)
        except Exception as exc:
            # Fire and forget: a lost message shows up as silence; a dead peer as PeerLost.
            reason = self._reason(exc)
            self._events.append(PeerLost(peer, reason, f"NIXL could not notify {peer}: {exc!r}"))
            return
        self._messages_sent += 1

    # ----------------------------------------------------------------------- poll
    def poll(self) -> list[TransportEvent]:
        agent = self._live_agent()
        events = self._events
        self._events = []
        calls = self._calls
        assert calls is not None  # set with the agent
        for write_id, w in list(self._in_flight.items()):
            try:
                state = calls.state(w.handle)
                detail = "NIXL reported the write failed"
            except Exception as exc:
                state = "ERR"
                detail = f"NIXL reported the write failed: {exc!r}"
                reason = self._reason(exc)
            else:
                reason = FailureReason.WRITE_ERROR
            if state == "PROC":
                continue
            del self._in_flight[write_id]
            _release_quietly(w.handle)
            if state == "DONE":
                self._writes_done += 1
                events.append(WriteDone(write_id, w.nbytes, w.descriptors))
            else:
                self._writes_failed += 1
                events.append(WriteFailed(write_id, reason, f"write to {w.peer}: {detail}"))
        try:
            notifs = agent.get_new_notifs()
        except Exception as exc:
            raise self._translate(exc, self._name, "fetch notifications") from exc
        for sender, payloads in notifs.items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            for payload in payloads:
                self._messages_received += 1
                events.append(MessageReceived(name, bytes(payload)))
        return events

    def statistics(self) -> NixlStatistics:
        return NixlStatistics(
            writes_posted=self._writes_posted,
            writes_done=self._writes_done,
            writes_failed=self._writes_failed,
            writes_in_flight=len(self._in_flight),
            bytes_posted=self._bytes_posted,
            descriptors_posted=self._descriptors_posted,
            last_write_descriptors=self._last_descriptors,
            last_write_block_descriptors=self._last_block_descriptors,
            messages_sent=self._messages_sent,
            messages_received=self._messages_received,
        )

    # --------------------------------------------------------------- error mapping
    def _reason(self, exc: BaseException) -> FailureReason:
        if self._nixl is not None and isinstance(exc, self._nixl.remote_disconnect_error):
            return FailureReason.PEER_GONE
        return FailureReason.WRITE_ERROR

    def _translate(self, exc: BaseException, peer: str, what: str) -> TransportError:
        return TransportError(self._reason(exc), f"NIXL could not {what} ({peer}): {exc!r}")


def _scratch_memory_type(scratch: ScratchRegion) -> tuple[str, int]:
    return region_memory_type(Region("scratch", 0, scratch.base_addr, 0, 0, 0, scratch.device))


def _release_quietly(handle: Any) -> None:
    """Release a NIXL handle; a handle that cannot be released is NIXL's to reclaim."""
    try:
        handle.release()
    except Exception as exc:
        logger.debug("NIXL handle %r not released: %r", handle, exc)


def _quietly(call: Any, *args: Any) -> None:
    try:
        call(*args)
    except Exception as exc:
        logger.debug("NIXL cleanup %r%r failed: %r", call, args, exc)
