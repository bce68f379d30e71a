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
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

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
# 6: where the geometry knows its heads, block sizes may differ by a whole multiple
# (regions are compared per head per token) and a Register names the block size its ids
# are in (`Register.sender_block_tokens`); a version-5 peer would take those ids for its
# own blocks.
PROTOCOL_VERSION = 6

# Layouts in which a block holds its KV heads one after another, each head one run of
# bytes (`[H, N, C]` per block): where a rank can take a slice of another rank's heads.
HEAD_SLICEABLE_LAYOUTS = (
    "vllm_packed/BHNC",
    "kv_separate/HND",
    "kv_first/HND",
    "blocks_first/HND",
)
# vLLM's packed per-layer caches (`kvpush.integrations.vllm.kvcache`): `[B, H, N, C]`,
# MLA's latent (a token's C in one run), or vLLM-CPU's attention, whose kernels keep in
# a head's `N x C` what they choose (K transposed, then V; AMX tiles): its heads move
# whole, never a range of their tokens.
PACKED_PREFIX = "vllm_packed/"


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


class PipelineStage(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """Which stage of a pipeline-parallel engine a rank's cache belongs to: the stage
    holds a contiguous slice of the model's layers, its regions named by the model's
    layer names. A peer without stages holds every layer: the stage's regions must be a
    subset of its regions, matched by name, each alike, and the peer must hold as many
    regions as the stages together (`model_regions`), so that every one of its layers
    is some stage's to write (`regions_not_carried`); a write moves the stage's regions
    into theirs of the same name (`write_plan`)."""

    size: int  # the engine's pipeline-parallel size
    rank: int  # this stage's pipeline rank, 0 .. size - 1
    # The regions of every stage together: the whole model's, one per layer (an engine
    # registers a stage only where each of its layers holds one KV cache).
    model_regions: int


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
    # The pipeline stage this rank is of; None: the engine holds every layer.
    stage: PipelineStage | None = None

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
        """The bytes of `region` that must agree with a peer's: one head's for one token
        where the geometry knows its heads (ranks of other TP sizes hold other counts,
        engines of other block sizes other tokens per block), else a whole block's."""
        if self.heads is None:
            return region.block_bytes
        return region.block_bytes // max(1, self.heads.per_rank) // max(1, self.block_size_tokens)

    def compat_fields(self) -> dict[str, object]:
        """What two peers must agree on; addresses, block counts and (where the geometry
        knows its heads) tensor-parallel sizes and block sizes may differ
        (`block_sizes_may_differ`; `write_plan` says which pairs carry). Regions are
        compared by the bytes of one head per token then, with `kv_heads` the model's
        head count; a hybrid model's KV-cache groups by kind, block size and window."""
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
        if self.stage is not None:
            # Only where there are stages (engines without keep their hash): the
            # regions are then a slice of a whole model's (`regions_not_carried`).
            fields["pipeline"] = {
                "size": self.stage.size,
                "rank": self.stage.rank,
                "model_regions": self.stage.model_regions,
            }
        return fields

    def compat_hash(self) -> str:
        """A digest of what must be equal: `compat_fields()`, but for the block size
        where it may differ (`block_sizes_may_differ`: `write_plan` judges it)."""
        fields = self.compat_fields()
        if self.heads is not None:
            del fields["block_size_tokens"]
        encoded = msgspec.json.encode(fields)
        return hashlib.sha256(encoded).hexdigest()[:32]


class ScratchRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A small buffer a rank registers beside its KV cache, for test writes of the data
    plane only (`kvpush.runtime.services`): bytes `[base_addr, base_addr + nbytes)` in
    `device` memory. It is never part of the cache, and a peer refuses one that overlaps
    any KV region (`overlapping_region`)."""

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


def block_sizes_may_differ(a: Mapping[str, object], b: Mapping[str, object]) -> bool:
    """Whether two peers' `compat_fields()` leave their block sizes to `write_plan`:
    where both know their heads (vLLM engines), whose regions are then compared per
    token. Elsewhere blocks move whole and must be equal."""
    return a.get("kv_heads") is not None and b.get("kv_heads") is not None


def _one_stage(
    a: Mapping[str, object], b: Mapping[str, object]
) -> tuple[Mapping[str, object], Mapping[str, object]] | None:
    """(the stage's, the whole model's) where exactly one of two peers' compat fields is
    a pipeline stage's (`PipelineStage`); None otherwise (both whole, or both stages:
    then every field, regions and stage included, must be equal)."""
    if ("pipeline" in a) == ("pipeline" in b):
        return None
    return (a, b) if "pipeline" in a else (b, a)


def regions_not_carried(stage: Mapping[str, object], whole: Mapping[str, object]) -> list[str]:
    """What keeps a pipeline stage's regions (`compat_fields()["regions"]`: name, number,
    bytes) from being written into a whole model's, one phrase per region: a region
    whose name the whole model lacks, or whose bytes (per block, or per head per token)
    differ; and a whole model of another number of regions than the stages hold
    together, whose layers no stage holds would never be written. Regions are matched
    by name only: a stage numbers its own layers from 0."""
    rows = _region_rows(whole.get("regions"))
    theirs = {str(r[0]): r[2] for r in rows}
    out: list[str] = []
    pipeline = stage.get("pipeline")
    model_regions = pipeline.get("model_regions") if isinstance(pipeline, Mapping) else None
    if model_regions != len(rows):
        out.append(
            f"the whole model's {len(rows)} regions against the stages' {model_regions} "
            "together (a layer no stage holds would never be written)"
        )
    for row in _region_rows(stage.get("regions")):
        name, size = str(row[0]), row[2]
        if name not in theirs:
            out.append(f"{name} (none of that name)")
        elif theirs[name] != size:
            out.append(f"{name} ({size} bytes per unit, theirs {theirs[name]})")
    return out


def _region_rows(value: object) -> list[Sequence[object]]:
    rows = value if isinstance(value, (list, tuple)) else ()
    return [r for r in rows if isinstance(r, (list, tuple)) and len(r) == 3]


def differing_compat_fields(a: Mapping[str, object], b: Mapping[str, object]) -> list[str]:
    """The `CacheGeometry.compat_fields()` keys whose values differ, sorted; the block
    size only where it must be equal (`block_sizes_may_differ`). Where exactly one peer
    is a pipeline stage, its regions need only be a name-matched subset of the other's
    (`regions_not_carried`), and the stage itself is no difference."""
    sizes_may_differ = block_sizes_may_differ(a, b)
    staged = _one_stage(a, b)
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key) or (key == "block_size_tokens" and sizes_may_differ):
            continue
        if staged is not None and key == "pipeline":
            continue
        if staged is not None and key == "regions" and not regions_not_carried(*staged):
            continue
        out.append(key)
    return out


def describe_compat_differences(
    theirs: Mapping[str, object], ours: Mapping[str, object]
) -> list[str]:
    """What differs between two `CacheGeometry.compat_fields()`, one phrase per field
    (`differing_compat_fields`), each naming theirs and ours (regions: the first region
    that differs)."""
    out: list[str] = []
    for key in differing_compat_fields(theirs, ours):
        ours_value, their_value = ours.get(key), theirs.get(key)
        staged = _one_stage(theirs, ours)
        if key == "regions" and staged is not None:
            stage_is = "theirs" if staged[0] is theirs else "ours"
            other_is = "ours" if stage_is == "theirs" else "theirs"
            pipeline = staged[0].get("pipeline")
            stage = (
                f"{pipeline.get('rank')} of {pipeline.get('size')}"
                if isinstance(pipeline, Mapping)
                else repr(pipeline)
            )
            missing = regions_not_carried(*staged)
            more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            whole = len(_region_rows(staged[1].get("regions")))
            out.append(
                f"regions: {stage_is} are pipeline stage {stage}'s, which must each be one "
                f"of {other_is} (a whole model's {whole} regions) by name, with equal bytes; "
                f"not carried: {', '.join(missing[:4])}{more}"
            )
        elif key == "regions":
            out.append(_describe_region_difference(their_value, ours_value))
        else:
            out.append(f"{key}: theirs {their_value!r}, ours {ours_value!r}")
    return out


def _describe_region_difference(theirs: Any, ours: Any) -> str:
    theirs, ours = list(theirs or ()), list(ours or ())
    if len(theirs) != len(ours):
        # Name what one side has and the other lacks (a draft model's layers, say:
        # vLLM registers them beside the target's), a few of each.
        their_names = [str(r[0]) for r in theirs]
        our_names = [str(r[0]) for r in ours]
        said = f"regions: theirs {len(theirs)}, ours {len(ours)}"
        for side, names, other in (
            ("theirs", their_names, our_names),
            ("ours", our_names, their_names),
        ):
            only = [n for n in names if n not in set(other)]
            if only:
                more = f" and {len(only) - 4} more" if len(only) > 4 else ""
                said += f"; only {side}: {', '.join(only[:4])}{more}"
        return said
    for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        if tuple(a) != tuple(b):
            return (
                f"regions differ first at #{i}: theirs (name, layer, bytes per block or "
                f"per head per token) = "
                f"{tuple(a)}, ours {tuple(b)}"
            )
    return "regions differ"


class BlockParts(NamedTuple):
    """How one side's block ids become its view's, where block sizes differ
    (`write_plan`): each block holds `planes_per_block` runs (a head's tokens where heads
    are outermost, one where tokens are), each `ratio` parts of the smaller side's block
    size, back to back; a write takes `planes` of each part."""

    planes_per_block: int
    ratio: int
    planes: tuple[int, ...]

    def view_ids(self, ids: Sequence[int]) -> tuple[int, ...]:
        """The view blocks of ids in the smaller side's blocks (`sub_block_ids`)."""
        r, per_block = self.ratio, self.planes_per_block * self.ratio
        return tuple(p // r * per_block + q * r + p % r for p in ids for q in self.planes)


class WritePlan(NamedTuple):
    """`write_plan`'s answer: the two views, and where block sizes differ, how each
    side's ids become its view's (None: as they are)."""

    ours: CacheGeometry
    theirs: CacheGeometry
    our_ids: BlockParts | None = None
    their_ids: BlockParts | None = None


def write_views(ours: CacheGeometry, theirs: CacheGeometry) -> tuple[CacheGeometry, CacheGeometry]:
    """The two views of `write_plan`, for pairs whose ids need no mapping (one block
    size) or callers that only check that a pair can be carried."""
    plan = write_plan(ours, theirs)
    return plan.ours, plan.theirs


def write_plan(ours: CacheGeometry, theirs: CacheGeometry) -> WritePlan:
    """What a write from our rank to theirs moves, as two geometries whose blocks are
    exactly those bytes: the heads of each of our blocks it reads, and where they land in
    each of theirs (`kvpush.topology`'s plan, with us the prefill). A transport writes
    whole blocks of these views, so it needs to know nothing of heads or block sizes.

    Where one side's blocks are `k` times the other's, both views are of runs of the
    smaller size: a block is cut into its runs (`BlockParts`: one per head where heads
    are outermost, one where tokens are), each of `k` parts on the larger side, and a
    write maps each side's ids to its runs. Ids on the larger side count its parts
    (`sub_block_ids`), so a block of the smaller side moves whole into (or from) one
    part of one of the larger's.

    Unchanged where the geometries do not know their heads (both, or compatibility
    refused the pair) or hold the same heads in blocks of one size. A rank pair the plan
    gives no heads to gets views of empty blocks (or maps its ids to none): its writes
    move nothing and still notify. Raises `UnsupportedShape` for a pair the plan cannot
    carry, or a layout in which a block's heads (or runs) are not one run each.

    Where one side is a pipeline stage (`PipelineStage`) and the other holds every
    layer, the whole side's view holds only the stage's regions, matched by name, in
    the stage's order (the stage's view is its own regions): a write moves each of the
    stage's layers into the layer of that name."""
    ours, theirs = _by_name(ours, theirs)
    a, b = ours.heads, theirs.heads
    if a is None or b is None:
        return WritePlan(ours, theirs)
    same_heads = (a.tp_size, a.tp_rank) == (b.tp_size, b.tp_rank)
    ratio = _block_ratio(ours, theirs)
    if same_heads and ratio == 1:
        return WritePlan(ours, theirs)
    shape = (
        f"TP {a.tp_size} rank {a.tp_rank} ({ours.block_size_tokens}-token blocks) and "
        f"TP {b.tp_size} rank {b.tp_rank} ({theirs.block_size_tokens}-token blocks)"
    )
    states = [g.describe() for g in (*ours.groups, *theirs.groups) if g.kind == "mamba"]
    if states and not same_heads:
        raise UnsupportedShape(
            f"{shape} would exchange parts of blocks, but this model's {states[0]} moves "
            f"only whole, between engines of one tensor-parallel size: expected prefill and "
            f"decode at one TP size"
        )
    if ratio != 1:
        others = [
            g.describe() for g in (*ours.groups, *theirs.groups) if g.kind != "full_attention"
        ]
        if others:
            raise UnsupportedShape(
                f"{shape}: this model's {others[0]} counts its blocks in the engine's block "
                f"size, so it moves only between engines of one block size: expected both "
                f"at one --block-size"
            )
    if not same_heads and ours.layout not in HEAD_SLICEABLE_LAYOUTS:
        raise UnsupportedShape(
            f"{shape} exchange parts of blocks, which layout {ours.layout} does not hold as "
            f"one run per head: expected one of {', '.join(HEAD_SLICEABLE_LAYOUTS)} (ask "
            f"vLLM for LBHNC)"
        )
    first_ours, first_theirs, count = 0, 0, a.per_rank
    if not same_heads:
        plan = plan_transfer(
            prefill=EngineShape(a.tp_size, 1),
            decode=EngineShape(b.tp_size, 1),
            total_kv_heads=a.total,
            replicated_kv=a.replicated,
            bytes_per_head_per_block=1,
        )
        # Only which heads pair: the block sizes are this function's to judge (a
        # plan refuses a decode block smaller than the prefill's; these views serve
        # either direction), so the plan is asked at one token a block.
        first_ours, first_theirs, count = 0, 0, 0
        for s in plan.for_decode(b.tp_rank).sources:
            if s.prefill_rank == a.tp_rank:
                first_ours, first_theirs = s.first_head_in_prefill_rank, s.first_head_in_decode_rank
                count = s.num_heads
    if ratio == 1:
        return WritePlan(
            _head_view(ours, first_ours, count), _head_view(theirs, first_theirs, count)
        )
    tokens = min(ours.block_size_tokens, theirs.block_size_tokens)
    our_view, our_ids = _parts_view(ours, first_ours, count, tokens, shape)
    their_view, their_ids = _parts_view(theirs, first_theirs, count, tokens, shape)
    return WritePlan(our_view, their_view, our_ids, their_ids)


def _by_name(ours: CacheGeometry, theirs: CacheGeometry) -> tuple[CacheGeometry, CacheGeometry]:
    """Both geometries as `write_plan` pairs their regions: unchanged unless exactly one
    is a pipeline stage, whose regions the other's view is cut to, by name."""
    if (ours.stage is None) == (theirs.stage is None):
        return ours, theirs
    stage, whole = (ours, theirs) if ours.stage is not None else (theirs, ours)
    assert stage.stage is not None
    if len(whole.regions) != stage.stage.model_regions:
        raise UnsupportedShape(
            f"pipeline stage {stage.stage.rank} of {stage.stage.size}: the whole model's "
            f"{len(whole.regions)} regions against the stages' {stage.stage.model_regions} "
            "together (a layer no stage holds would never be written): expected as many"
        )
    by_name = {r.name: r for r in whole.regions}
    missing = [r.name for r in stage.regions if r.name not in by_name]
    if missing:
        raise UnsupportedShape(
            f"pipeline stage {stage.stage} holds regions {', '.join(missing[:4])} that the "
            f"peer, which holds every layer, does not ({len(whole.regions)} regions): "
            "expected each of the stage's regions among the peer's, by name"
        )
    view = msgspec.structs.replace(whole, regions=tuple(by_name[r.name] for r in stage.regions))
    return (ours, view) if stage is ours else (view, theirs)


def _block_ratio(ours: CacheGeometry, theirs: CacheGeometry) -> int:
    """How many blocks of the smaller side one block of the larger holds."""
    small, large = sorted((ours.block_size_tokens, theirs.block_size_tokens))
    if small < 1 or large % small:
        raise UnsupportedShape(
            f"block sizes {ours.block_size_tokens} and {theirs.block_size_tokens} tokens: "
            f"expected one to be a whole multiple of the other"
        )
    return large // small


def sub_block_ids(blocks: Sequence[int], ratio: int, count: int) -> tuple[int, ...]:
    """The first `count` view blocks of `blocks` where each holds `ratio` blocks of a
    peer's smaller size (`write_plan`): block `b`'s parts are `b * ratio + i`, in token
    order. `count` must not exceed `len(blocks) * ratio`."""
    if ratio == 1:
        return tuple(blocks[:count])
    if count > len(blocks) * ratio:
        raise ValueError(f"{count} parts asked of {len(blocks)} blocks of {ratio} parts each")
    return tuple(b * ratio + i for b in blocks for i in range(ratio))[:count]


def _head_view(geometry: CacheGeometry, first: int, count: int) -> CacheGeometry:
    """`geometry` with each block cut down to heads `[first, first + count)` of it."""
    regions = []
    for r in geometry.regions:
        head = geometry.region_unit_bytes(r) * geometry.block_size_tokens
        regions.append(
            msgspec.structs.replace(
                r, base_addr=r.base_addr + first * head, block_bytes=count * head
            )
        )
    return msgspec.structs.replace(geometry, regions=tuple(regions), heads=None)


def _parts_view(
    geometry: CacheGeometry, first: int, count: int, tokens: int, shape: str
) -> tuple[CacheGeometry, BlockParts]:
    """`geometry` as runs of `tokens` tokens (`BlockParts`), heads `[first, first +
    count)` of each block taken."""
    assert geometry.heads is not None
    held, ratio = geometry.heads.per_rank, geometry.block_size_tokens // tokens
    order = geometry.layout.rsplit("/", 1)[-1]
    whole: tuple[int, ...] = (0,) if count else ()
    planes: tuple[int, ...]
    # Per layout: the runs a block holds, those the heads are, and how many heads' bytes
    # for one token a run holds (`region_unit_bytes` each).
    if geometry.heads.replicated:  # MLA's latent: one run of tokens
        planes_per_block, planes, per_token = 1, whole, held
    elif geometry.layout.startswith(PACKED_PREFIX):
        # vLLM-CPU's attention: its kernels keep a head's K of a block transposed
        # ([head_size, tokens]) with its V after it, or in AMX tiles.
        raise UnsupportedShape(
            f"{shape}: vLLM-CPU's attention keeps each head's K of a block transposed (its "
            f"head_size rows each hold every token: `cpu_attn_reshape_and_cache`) and its V "
            f"after it, so the {tokens} tokens of a smaller block are no run of a "
            f"{geometry.block_size_tokens}-token block (layout {geometry.layout}): expected "
            f"one block size on both engines with this layout (K and V tensors of their "
            f"own, as vLLM's GPU backends hand them, or MLA's latent carry larger blocks)"
        )
    elif order == "HND":
        planes_per_block, planes, per_token = held, tuple(range(first, first + count)), 1
    elif order == "NHD" and count in (0, held):
        planes_per_block, planes, per_token = 1, whole, held
    else:
        raise UnsupportedShape(
            f"{shape}: heads {first}..{first + count - 1} of the {held} of a "
            f"{geometry.block_size_tokens}-token block (layout {geometry.layout}) are no "
            f"whole runs of {tokens} tokens: expected heads outermost in a block (HND) or "
            f"a rank's every head"
        )
    regions = []
    for r in geometry.regions:
        run = geometry.region_unit_bytes(r) * per_token * tokens
        if r.block_stride != r.block_bytes or run * planes_per_block * ratio != r.block_bytes:
            raise UnsupportedShape(
                f"{shape}: region {r.name}'s blocks ({r.block_bytes} bytes, "
                f"{r.block_stride} apart) are not {planes_per_block * ratio} runs of "
                f"{run} bytes back to back: expected blocks of one run of heads each, with "
                f"no gap between blocks"
            )
        regions.append(
            msgspec.structs.replace(
                r,
                block_bytes=run,
                block_stride=run,
                num_blocks=r.num_blocks * planes_per_block * ratio,
            )
        )
    view = msgspec.structs.replace(
        geometry, regions=tuple(regions), heads=None, block_size_tokens=tokens
    )
    return view, BlockParts(planes_per_block, ratio, planes)
