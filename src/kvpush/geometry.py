"""The shape of a registered KV cache, as kvpush and its peers see it.

`kvcache.register_kv_cache` derives a `CacheGeometry` from an engine's torch tensors;
the side channel publishes it; transports register and address memory from it. These
are plain, frozen msgspec structs so they travel on the wire unchanged.

Block `b` of region `r` occupies bytes `[r.base_addr + b * r.block_stride,
r.base_addr + b * r.block_stride + r.block_bytes)` in `r.device` memory. A region is one
tensor (or one half of a K/V-combined tensor) of one layer; the same block id names the
same token slots in every region.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import msgspec

from kvpush.topology import EngineShape, UnsupportedShape, plan_transfer

# Bumped whenever the meaning of any wire message or the geometry changes.
# 2: leases are measured on the receiver's clock (Register/Heartbeat `sent_at`, `echo`);
# a version-1 sender would grant leases by arrival time, which a stall makes unsafe.
# 3: every data-plane message begins with the receiving rank's message key (published in
# its metadata), and a Reject names its receiver; a version-2 peer's messages would all
# be dropped unread, so the side channel refuses the pair instead, saying why.
# 4: the side channel's token is proven both ways (HMAC over a nonce) instead of sent in
# clear (`kvpush.sidechannel.wire`); a version-3 peer's request is refused, saying why.
# 5: the geometry may say how its blocks hold KV heads (`KVHeads`), and compatibility
# compares bytes per head, not per block; a version-4 peer would refuse (or, worse, write
# whole blocks into) a decode rank of another tensor-parallel size.
PROTOCOL_VERSION = 5

# Layouts in which a block holds its KV heads one after another, each head one run of
# bytes (`[H, N, C]` per block): where a rank can take a slice of another rank's heads.
HEAD_SLICEABLE_LAYOUTS = ("vllm_packed/BHNC",)


class Region(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    name: str  # e.g. "model.layers.0.k"
    layer: int  # index of the layer this region belongs to (for layer-wise push)
    base_addr: int
    block_bytes: int
    block_stride: int
    num_blocks: int
    device: str = "cpu"  # "cpu" or "cuda:N"


class KVHeads(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """How a rank's blocks hold the model's KV heads, for engines whose tensor-parallel
    ranks split them (`kvpush.topology` has the rules). Every region's block holds
    `per_rank` heads, each `Region.block_bytes // per_rank` bytes long."""

    total: int  # KV heads of the model
    per_rank: int  # heads in one block of every region of this rank
    tp_size: int
    tp_rank: int
    replicated: bool = False  # every rank holds every head (MLA's latent cache)

    def compat(self) -> dict[str, object]:
        """What two engines of one model share, whatever their tensor parallelism."""
        return {"total": self.total, "replicated": self.replicated}


class KVCacheGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """One KV-cache group of a hybrid model (vLLM's hybrid KV-cache manager): layers
    whose blocks one block table addresses. Every group's blocks come from one pool and
    lie in the same regions (the layers of different groups share the memory), so a
    block id names bytes of one group only, and moving a group is moving its block ids.
    `kind`: "full_attention" (every token's KV is kept), "sliding_window" (only the
    last `sliding_window` tokens are attended: `kvpush.integrations.vllm.groups` says
    which blocks move) or "mamba" (a recurrent state: one block per request holds it,
    `state` saying its tensors on this rank; its bytes are the start of a block of the
    region it shares, which moves whole)."""

    kind: str
    block_size_tokens: int
    sliding_window: int | None = None  # tokens, for "sliding_window"
    state: str | None = None  # for "mamba": its tensors' shapes and dtypes, per rank

    def describe(self) -> str:
        if self.kind == "sliding_window":
            return f"sliding window of {self.sliding_window} tokens"
        if self.kind == "mamba":
            return f"mamba state ({self.state})"
        return self.kind.replace("_", " ")

    def compat(self) -> tuple[object, ...]:
        """What a peer's group must have alike (a state's tensors only where there is one,
        so that attention groups keep their hash)."""
        fields: tuple[object, ...] = (self.kind, self.block_size_tokens, self.sliding_window)
        return fields if self.state is None else (*fields, self.state)


class CacheGeometry(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    layout: str  # e.g. "kv_separate/NHD" (kvcache.KVLayout names the legal values)
    block_size_tokens: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    regions: tuple[Region, ...]
    mode: str = "push"
    # None: blocks are moved whole, rank r to rank r, and must be equal in bytes.
    heads: KVHeads | None = None
    # The KV-cache groups whose block ids share these regions, in the engine's order;
    # empty: one full-attention group (every block id of a request moves).
    groups: tuple[KVCacheGroup, ...] = ()

    @property
    def num_blocks(self) -> int:
        return self.regions[0].num_blocks if self.regions else 0

    @property
    def num_layers(self) -> int:
        return len({r.layer for r in self.regions})

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id stands for, over all regions."""
        return sum(r.block_bytes for r in self.regions)

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    def region_unit_bytes(self, region: Region) -> int:
        """The bytes of `region`'s block that must agree with a peer's: one head's where
        the geometry knows its heads (ranks of other TP sizes hold other counts), else
        the whole block's."""
        if self.heads is None:
            return region.block_bytes
        return region.block_bytes // max(1, self.heads.per_rank)

    def compat_fields(self) -> dict[str, object]:
        """What two peers must agree on; addresses, block counts and (where the geometry
        knows its heads) tensor-parallel sizes may differ. Regions are compared by the
        bytes of one head per block then, with `kv_heads` the model's head count; a
        hybrid model's KV-cache groups by kind, block size and window."""
        fields: dict[str, object] = {
            "protocol_version": PROTOCOL_VERSION,
            "layout": self.layout,
            "block_size_tokens": self.block_size_tokens,
            "dtype": self.dtype,
            "mode": self.mode,
            "kv_heads": None if self.heads is None else self.heads.compat(),
            "regions": [(r.name, r.layer, self.region_unit_bytes(r)) for r in self.regions],
        }
        if self.groups:
            # Only where there are groups, so that one-group engines keep their hash.
            fields["kv_cache_groups"] = [g.compat() for g in self.groups]
        return fields

    def compat_hash(self) -> str:
        encoded = msgspec.json.encode(self.compat_fields())
        return hashlib.sha256(encoded).hexdigest()[:32]


class ScratchRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A small buffer a rank registers beside its KV cache, for `kvpush doctor`'s test
    writes only: bytes `[base_addr, base_addr + nbytes)` in `device` memory. It is never
    part of the cache, and a peer refuses one that overlaps any KV region
    (`overlapping_region`)."""

    base_addr: int
    nbytes: int
    device: str = "cpu"

    def overlapping_region(self, geometry: CacheGeometry) -> Region | None:
        """The first KV region of `geometry` this buffer shares a byte with, if any."""
        lo, hi = self.base_addr, self.base_addr + self.nbytes
        for r in geometry.regions:
            if r.num_blocks <= 0:
                continue
            r_hi = r.base_addr + (r.num_blocks - 1) * r.block_stride + r.block_bytes
            if lo < r_hi and r.base_addr < hi:
                return r
        return None


def describe_compat_differences(
    theirs: Mapping[str, object], ours: Mapping[str, object]
) -> list[str]:
    """What differs between two `CacheGeometry.compat_fields()`, one phrase per field,
    each naming theirs and ours (regions: the first region that differs)."""
    out: list[str] = []
    for key in sorted(set(ours) | set(theirs)):
        ours_value, their_value = ours.get(key), theirs.get(key)
        if their_value == ours_value:
            continue
        if key == "regions":
            out.append(_describe_region_difference(their_value, ours_value))
        else:
            out.append(f"{key}: theirs {their_value!r}, ours {ours_value!r}")
    return out


def _describe_region_difference(theirs: Any, ours: Any) -> str:
    theirs, ours = list(theirs or ()), list(ours or ())
    if len(theirs) != len(ours):
        return f"regions: theirs {len(theirs)}, ours {len(ours)}"
    for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        if tuple(a) != tuple(b):
            return (
                f"regions differ first at #{i}: theirs (name, layer, bytes per block or "
                f"per head per block) = "
                f"{tuple(a)}, ours {tuple(b)}"
            )
    return "regions differ"


def write_views(ours: CacheGeometry, theirs: CacheGeometry) -> tuple[CacheGeometry, CacheGeometry]:
    """What a write from our rank to theirs moves, as two geometries whose blocks are
    exactly those bytes: the heads of each of our blocks it reads, and where they land in
    each of theirs (`kvpush.topology`'s plan, with us the prefill). A transport writes
    whole blocks of these views, so it needs to know nothing of heads.

    Unchanged where the geometries do not know their heads (both, or compatibility
    refused the pair) or hold the same heads. A rank pair the plan gives no heads to
    gets views of empty blocks: its writes move nothing and still notify. Raises
    `UnsupportedShape` for a pair the plan cannot carry, or a layout in which a block's
    heads are not one run each."""
    a, b = ours.heads, theirs.heads
    if a is None or b is None or (a.tp_size, a.tp_rank) == (b.tp_size, b.tp_rank):
        return ours, theirs
    states = [g.describe() for g in (*ours.groups, *theirs.groups) if g.kind == "mamba"]
    if states:
        raise UnsupportedShape(
            f"TP {a.tp_size} rank {a.tp_rank} and TP {b.tp_size} rank {b.tp_rank} would "
            f"exchange parts of blocks, but this model's {states[0]} moves only whole, "
            f"between engines of one tensor-parallel size: expected prefill and decode at "
            f"one TP size"
        )
    if ours.layout not in HEAD_SLICEABLE_LAYOUTS:
        raise UnsupportedShape(
            f"TP {a.tp_size} rank {a.tp_rank} and TP {b.tp_size} rank {b.tp_rank} exchange "
            f"parts of blocks, which layout {ours.layout} does not hold as one run per head: "
            f"expected one of {', '.join(HEAD_SLICEABLE_LAYOUTS)} (ask vLLM for LBHNC)"
        )
    plan = plan_transfer(
        prefill=EngineShape(a.tp_size, ours.block_size_tokens),
        decode=EngineShape(b.tp_size, theirs.block_size_tokens),
        total_kv_heads=a.total,
        replicated_kv=a.replicated,
        bytes_per_head_per_block=1,
    )
    for s in plan.for_decode(b.tp_rank).sources:
        if s.prefill_rank == a.tp_rank:
            return (
                _head_view(ours, s.first_head_in_prefill_rank, s.num_heads),
                _head_view(theirs, s.first_head_in_decode_rank, s.num_heads),
            )
    return _head_view(ours, 0, 0), _head_view(theirs, 0, 0)


def _head_view(geometry: CacheGeometry, first: int, count: int) -> CacheGeometry:
    """`geometry` with each block cut down to heads `[first, first + count)` of it."""
    regions = []
    for r in geometry.regions:
        per_head = geometry.region_unit_bytes(r)
        regions.append(
            msgspec.structs.replace(
                r, base_addr=r.base_addr + first * per_head, block_bytes=count * per_head
            )
        )
    return msgspec.structs.replace(geometry, regions=tuple(regions), heads=None)
