"""What NIXL knows of memory: our KV cache, registered once with its descriptor list
prepared, and each peer's blocks, prepared when it is added.

One descriptor per (region, block), row `region * num_blocks + block`, on each side: a
write selects rows from both prepared lists, so nothing is rebuilt per write. Nothing
here posts a write; `NixlTransport` does, from what is prepared here.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpush.errors import FailureReason, TransportError
from kvpush.geometry import CacheGeometry, Region, ScratchRegion
from kvpush.transports.nixl_calls import quietly, release_quietly

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


def scratch_memory_type(scratch: ScratchRegion) -> tuple[str, int]:
    return region_memory_type(Region("scratch", 0, scratch.base_addr, 0, 0, 0, scratch.device))


@dataclasses.dataclass(slots=True)
class LocalMemory:
    """Our KV cache as NIXL knows it, and the write plan of one of its blocks."""

    geometry: CacheGeometry
    mem_type: str
    descriptors: npt.NDArray[np.uint64]
    dlist: Any  # NIXL prepared descriptor list for our blocks; None once released
    # Row of (region r, block 0) in `dlist`, per region; block b's rows are this + b.
    region_rows: npt.NDArray[np.int32]
    region_bytes: tuple[int, ...]
    # Whether one block's descriptors could ever merge across regions: only if the
    # spans of two regions touch or interleave (K and V in one tensor, say). Separate
    # allocations never do, and a one-block write then skips the merge count.
    regions_adjacent: bool

    @property
    def num_blocks(self) -> int:
        return self.geometry.num_blocks


def register_local(
    agent: Any, backend: str, geometry: CacheGeometry, registered: list[Any]
) -> LocalMemory:
    """Register our regions (each the span of its blocks) with `agent` and prepare their
    descriptor list. Registrations go into `registered`; on failure, every one there is
    deregistered and the list cleared."""
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
            registered.append(agent.register_memory(spans, mem_type, [backend]))
        dlist = agent.prep_xfer_dlist(_LOCAL, descriptors, mem_type, [backend])
    except Exception as exc:
        for reg in registered:
            quietly(agent.deregister_memory, reg)
        registered.clear()
        raise TransportError(
            FailureReason.LOCAL_ERROR,
            f"NIXL could not register {len(spans)} {mem_type} regions: {exc!r}",
        ) from exc
    extents = sorted(
        (r.base_addr, r.base_addr + (r.num_blocks - 1) * r.block_stride + r.block_bytes)
        for r in geometry.regions
        if r.num_blocks > 0
    )
    return LocalMemory(
        geometry,
        mem_type,
        descriptors,
        dlist,
        np.arange(len(geometry.regions), dtype=np.int32) * np.int32(geometry.num_blocks),
        tuple(r.block_bytes for r in geometry.regions),
        any(b[0] <= a[1] for a, b in itertools.pairwise(extents)),
    )


@dataclasses.dataclass(slots=True)
class NixlPeer:
    """A peer NIXL loaded: its blocks' prepared list, and what writes to it read."""

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


def prepare_peer(
    agent: Any,
    backend: str,
    local: LocalMemory,
    peer: str,
    geometry: CacheGeometry,
    ours: CacheGeometry | None,
) -> NixlPeer:
    """Prepare the descriptor lists of writes to `peer`, whose agent is loaded already:
    its blocks (`geometry`) and, where writes read a view of our cache (`ours`), that
    view's. On failure the peer's agent is removed again and the error says which side's
    memory NIXL refused."""
    source = local.geometry if ours is None else ours
    rows = np.arange(len(geometry.regions), dtype=np.int32) * np.int32(geometry.num_blocks)
    region_bytes = tuple(r.block_bytes for r in source.regions)
    if region_bytes and not any(region_bytes):
        # A rank pair that shares no heads: nothing to describe, writes only notify.
        return NixlPeer(
            peer, geometry, np.zeros((0, 3), np.uint64), None, rows, region_bytes=region_bytes
        )
    descriptors = block_descriptors(geometry)
    try:
        their_type = geometry_memory_type(geometry)
        dlist = agent.prep_xfer_dlist(peer, descriptors, their_type, [backend])
    except Exception as exc:
        quietly(agent.remove_remote_agent, peer)
        raise TransportError(
            FailureReason.HANDSHAKE_FAILED,
            f"the regions {peer} published are not memory it registered with NIXL: {exc!r}",
        ) from exc
    state = NixlPeer(
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
        state.source_rows = np.arange(len(ours.regions), dtype=np.int32) * np.int32(ours.num_blocks)
        state.source_descriptors = block_descriptors(ours)
        try:
            state.source_dlist = agent.prep_xfer_dlist(
                _LOCAL, state.source_descriptors, local.mem_type, [backend]
            )
        except Exception as exc:
            release_quietly(dlist)
            quietly(agent.remove_remote_agent, peer)
            raise TransportError(
                FailureReason.LOCAL_ERROR,
                f"the part of our blocks we would write to {peer} is not memory we "
                f"registered with NIXL: {exc!r}",
            ) from exc
    return state
