"""Which prefill rank writes which heads of a block into which decode rank.

A prefill engine and a decode engine of one model may run with different tensor
parallelism (TP) and block sizes. `plan_transfer` turns the two shapes into a
`TransferPlan`: for every decode rank, the prefill ranks it receives from and, for each,
the head slice it takes, as bytes within a prefill block and where they land in a decode
block; for every prefill rank, the same slices grouped by the decode ranks it writes to.
Both views hold the very same `HeadSlice` objects, so they cannot disagree. Pure: no I/O.

The rules are vLLM's (`TransferTopology` and `compute_tp_mapping` of its NIXL
connectors), so a deployment vLLM runs is a deployment kvpush plans:

- An engine at TP `t` over `K` KV heads splits them when `t` divides `K` (each rank holds
  `K // t` consecutive heads) and replicates them when `K` divides `t` (rank `r` holds
  head `r * K // t`, shared by `t // K` ranks). Any other pair is not a vLLM shape.
- A model whose KV is not split by heads at all (MLA's latent cache: `replicated_kv`)
  has every head on every rank.
- The larger TP must be a whole multiple of the smaller.
- A decode rank takes its heads from the prefill ranks of its group: the one prefill rank
  `d * P // D` when the decode has at least as many ranks (`D >= P`), else the `P // D`
  ranks `d * P // D ...`; a head that several of them hold (prefill TP above the head
  count) is taken from the first only (GQA de-duplication). An MLA decode rank takes the
  whole block from `d * P // D`. Every decode rank gets each of its heads exactly once; a
  prefill rank whose heads all come from another writes nothing (`PrefillRankPlan.targets`
  is empty), and one whose heads several decode ranks hold writes to each of them.
- A decode block holds `ratio` prefill blocks when its block size is `ratio` times the
  prefill's; sizes that are not whole multiples are refused.

Bytes assume the layout vLLM is asked for when TPs may differ (`LBHNC`: heads outermost
within a block), where a prefill rank's block is its heads one after another, each
`bytes_per_head_per_block` long, so any run of its heads is one contiguous byte range.
In the decode block a head is `ratio` times longer; the prefill block `j` of a decode
block fills the `j`-th part of each head, so a slice of several heads lands as one run
only when `ratio` is 1 (`HeadSlice.destination_runs` coalesces what it can).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.errors import ConfigError


class UnsupportedShape(ConfigError):
    """A prefill and a decode shape that kvpush cannot pair (or one that is not a shape
    vLLM runs): the message names both shapes and what was expected."""


@dataclass(frozen=True, slots=True)
class EngineShape:
    """One engine's side of a deployment: its tensor-parallel size and block size."""

    tp_size: int
    block_size_tokens: int

    def describe(self, role: str, total_kv_heads: int, replicated_kv: bool) -> str:
        kv = "replicated KV (MLA)" if replicated_kv else f"{total_kv_heads} KV heads"
        return f"{role} TP {self.tp_size} ({kv}, {self.block_size_tokens}-token blocks)"


@dataclass(frozen=True, slots=True, order=True)
class ByteRange:
    """Bytes `[start, stop)` from the start of one block of one region."""

    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start

    def shifted(self, by: int) -> ByteRange:
        return ByteRange(self.start + by, self.stop + by)


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """Heads `[first_head, first_head + num_heads)` of the model (global KV head
    indices), written by `prefill_rank` into `decode_rank`.

    `first_head_in_prefill_rank` and `first_head_in_decode_rank` say where the slice
    starts among the heads each rank holds; `source_bytes` is the slice within one
    prefill block, `destination_runs` where the first prefill block of a decode block
    lands (`destination_runs_for` the others).
    """

    prefill_rank: int
    decode_rank: int
    first_head: int
    num_heads: int
    first_head_in_prefill_rank: int
    first_head_in_decode_rank: int
    source_bytes: ByteRange
    destination_runs: tuple[ByteRange, ...]
    # Bytes of one head in one prefill block: how far apart the prefill blocks that
    # share a decode block land within each head.
    prefill_bytes_per_head: int

    @property
    def nbytes(self) -> int:
        """Bytes this slice moves per prefill block."""
        return self.source_bytes.length

    def destination_runs_for(self, sub_block: int) -> tuple[ByteRange, ...]:
        """Where prefill block `sub_block` of a decode block (0 ..ratio-1) lands."""
        offset = sub_block * self.prefill_bytes_per_head
        return tuple(run.shifted(offset) for run in self.destination_runs)


@dataclass(frozen=True, slots=True)
class RankHeads:
    """The KV heads one rank holds: `[first_head, first_head + num_heads)`."""

    first_head: int
    num_heads: int

    @property
    def stop(self) -> int:
        return self.first_head + self.num_heads

    def __contains__(self, head: object) -> bool:
        return isinstance(head, int) and self.first_head <= head < self.stop


@dataclass(frozen=True, slots=True)
class DecodeRankPlan:
    """What one decode rank receives: `sources`, ordered by where they land."""

    decode_rank: int
    heads: RankHeads
    sources: tuple[HeadSlice, ...]

    @property
    def source_ranks(self) -> tuple[int, ...]:
        """The prefill ranks it receives from, each once: how many parts it waits for."""
        return tuple(s.prefill_rank for s in self.sources)


@dataclass(frozen=True, slots=True)
class PrefillRankPlan:
    """What one prefill rank writes: `targets`, ordered by decode rank."""

    prefill_rank: int
    heads: RankHeads
    targets: tuple[HeadSlice, ...]

    @property
    def target_ranks(self) -> tuple[int, ...]:
        """The decode ranks it writes to, each once (none: its heads come from others)."""
        return tuple(t.decode_rank for t in self.targets)


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Every slice of a block between a prefill and a decode engine, from both sides."""

    prefill: EngineShape
    decode: EngineShape
    total_kv_heads: int
    replicated_kv: bool
    bytes_per_head_per_block: int  # one head in one prefill block, one region
    decode_ranks: tuple[DecodeRankPlan, ...]
    prefill_ranks: tuple[PrefillRankPlan, ...]

    @property
    def prefill_blocks_per_decode_block(self) -> int:
        return self.decode.block_size_tokens // self.prefill.block_size_tokens

    @property
    def is_rank_to_rank(self) -> bool:
        """Rank r to rank r, whole blocks: what kvpush moved before shapes could differ."""
        return (
            self.prefill.tp_size == self.decode.tp_size
            and self.prefill_blocks_per_decode_block == 1
        )

    def decode_position(self, prefill_block_index: int) -> tuple[int, int]:
        """Where a request's `prefill_block_index`-th block lands: the index of the
        request's decode block, and which of its prefill-sized parts (`sub_block`)."""
        return divmod(prefill_block_index, self.prefill_blocks_per_decode_block)

    def for_decode(self, rank: int) -> DecodeRankPlan:
        return self.decode_ranks[rank]

    def for_prefill(self, rank: int) -> PrefillRankPlan:
        return self.prefill_ranks[rank]

    @property
    def slices(self) -> tuple[HeadSlice, ...]:
        return tuple(s for d in self.decode_ranks for s in d.sources)


def rank_heads(rank: int, tp_size: int, total_kv_heads: int, replicated_kv: bool) -> RankHeads:
    """The heads rank `rank` of an engine at `tp_size` holds (the shape must be valid)."""
    if replicated_kv:
        return RankHeads(0, total_kv_heads)
    if tp_size <= total_kv_heads:
        per_rank = total_kv_heads // tp_size
        return RankHeads(rank * per_rank, per_rank)
    return RankHeads(rank * total_kv_heads // tp_size, 1)


def plan_transfer(
    *,
    prefill: EngineShape,
    decode: EngineShape,
    total_kv_heads: int,
    replicated_kv: bool,
    bytes_per_head_per_block: int,
) -> TransferPlan:
    """The plan for one model between `prefill` and `decode`; `UnsupportedShape` if the
    pair cannot be carried. `bytes_per_head_per_block` is one head's bytes in one block of
    one prefill region (block size x head size x dtype size)."""
    _check_shapes(prefill, decode, total_kv_heads, replicated_kv, bytes_per_head_per_block)
    ratio = decode.block_size_tokens // prefill.block_size_tokens
    p_tp, d_tp = prefill.tp_size, decode.tp_size
    held = [rank_heads(p, p_tp, total_kv_heads, replicated_kv) for p in range(p_tp)]
    decode_plans: list[DecodeRankPlan] = []
    for d in range(d_tp):
        wanted = rank_heads(d, d_tp, total_kv_heads, replicated_kv)
        if replicated_kv:
            candidates = [d * p_tp // d_tp]  # the whole (replicated) block from one rank
        elif d_tp >= p_tp:
            candidates = [d * p_tp // d_tp]
        else:
            group = p_tp // d_tp
            candidates = list(range(d * group, (d + 1) * group))
        sources: list[HeadSlice] = []
        next_head = wanted.first_head  # heads before it are taken (de-duplication)
        for p in candidates:
            theirs = held[p]
            first = max(next_head, theirs.first_head)
            stop = min(wanted.stop, theirs.stop)
            if first >= stop:
                continue
            sources.append(
                _slice(p, d, first, stop - first, theirs, wanted, bytes_per_head_per_block, ratio)
            )
            next_head = stop
        if next_head != wanted.stop:  # the rules above make this unreachable
            raise AssertionError(
                f"decode rank {d} of {d_tp} would miss heads {next_head}..{wanted.stop - 1} "
                f"(prefill TP {p_tp}, {total_kv_heads} KV heads)"
            )
        decode_plans.append(DecodeRankPlan(d, wanted, tuple(sources)))
    prefill_plans = tuple(
        PrefillRankPlan(
            p,
            held[p],
            tuple(s for plan in decode_plans for s in plan.sources if s.prefill_rank == p),
        )
        for p in range(p_tp)
    )
    return TransferPlan(
        prefill=prefill,
        decode=decode,
        total_kv_heads=total_kv_heads,
        replicated_kv=replicated_kv,
        bytes_per_head_per_block=bytes_per_head_per_block,
        decode_ranks=tuple(decode_plans),
        prefill_ranks=prefill_plans,
    )


def _slice(
    prefill_rank: int,
    decode_rank: int,
    first_head: int,
    num_heads: int,
    theirs: RankHeads,
    ours: RankHeads,
    head_bytes: int,
    ratio: int,
) -> HeadSlice:
    in_prefill = first_head - theirs.first_head
    in_decode = first_head - ours.first_head
    decode_head_bytes = head_bytes * ratio
    runs: tuple[ByteRange, ...]
    if ratio == 1:
        runs = (ByteRange(in_decode * head_bytes, (in_decode + num_heads) * head_bytes),)
    else:
        # Each head of the decode block is `ratio` prefill blocks long: one run per head.
        runs = tuple(
            ByteRange(h * decode_head_bytes, h * decode_head_bytes + head_bytes)
            for h in range(in_decode, in_decode + num_heads)
        )
    return HeadSlice(
        prefill_rank=prefill_rank,
        decode_rank=decode_rank,
        first_head=first_head,
        num_heads=num_heads,
        first_head_in_prefill_rank=in_prefill,
        first_head_in_decode_rank=in_decode,
        source_bytes=ByteRange(in_prefill * head_bytes, (in_prefill + num_heads) * head_bytes),
        destination_runs=runs,
        prefill_bytes_per_head=head_bytes,
    )


def _check_shapes(
    prefill: EngineShape,
    decode: EngineShape,
    total_kv_heads: int,
    replicated_kv: bool,
    bytes_per_head_per_block: int,
) -> None:
    def both() -> str:
        return (
            f"{prefill.describe('prefill', total_kv_heads, replicated_kv)} and "
            f"{decode.describe('decode', total_kv_heads, replicated_kv)}"
        )

    if total_kv_heads < 1 or bytes_per_head_per_block < 1:
        raise UnsupportedShape(
            f"{both()}: expected at least one KV head and one byte per head per block, got "
            f"{total_kv_heads} heads of {bytes_per_head_per_block} bytes"
        )
    for role, shape in (("prefill", prefill), ("decode", decode)):
        if shape.tp_size < 1 or shape.block_size_tokens < 1:
            raise UnsupportedShape(
                f"{both()}: the {role}'s TP size and block size must be at least 1"
            )
        if not replicated_kv and (
            total_kv_heads % shape.tp_size != 0 and shape.tp_size % total_kv_heads != 0
        ):
            raise UnsupportedShape(
                f"{both()}: the {role}'s TP {shape.tp_size} neither divides nor is a "
                f"multiple of the {total_kv_heads} KV heads, so its ranks cannot hold whole "
                f"heads (vLLM runs no such engine)"
            )
    small, large = sorted((prefill.tp_size, decode.tp_size))
    if large % small != 0:
        raise UnsupportedShape(
            f"{both()}: expected the larger TP size to be a whole multiple of the smaller "
            f"({large} is not a multiple of {small}), as vLLM's NIXL connectors require"
        )
    if decode.block_size_tokens % prefill.block_size_tokens != 0:
        raise UnsupportedShape(
            f"{both()}: the decode's block size ({decode.block_size_tokens} tokens) must be "
            f"a whole multiple of the prefill's ({prefill.block_size_tokens} tokens)"
        )


def rank_pairs(prefill_tp: int, decode_tp: int) -> tuple[tuple[int, int], ...]:
    """Every (prefill rank, decode rank) pair that carries a part of each request:
    each prefill rank to the decode rank of its group (`d = p * D // P`) when the decode
    has no more ranks, else each decode rank from its one source (`p = d * P // D`). A
    pair whose heads the plan takes from another rank (GQA de-duplication) still carries
    its part, of no bytes, so that both ranks hear the request end. Sizes that are not
    whole multiples of each other are refused by `plan_transfer`, not here."""
    if prefill_tp >= decode_tp:
        return tuple((p, p * decode_tp // prefill_tp) for p in range(prefill_tp))
    return tuple((d * prefill_tp // decode_tp, d) for d in range(decode_tp))


def part_id(
    transfer_id: str, prefill_rank: int, decode_rank: int, *, rank_to_rank: bool, decode_tp: int
) -> str:
    """The transfer id of one rank pair's part of `transfer_id`, the same on both
    sides: the id itself where every rank pairs with the rank of its number (equal TP),
    else the id with both ranks and the decode's TP size (`xfer-1#0>1/2`: prefill rank
    0 into decode rank 1 of 2). The decode's TP size is in the id so that a prefill
    that was not told it learns it from the first registration (`decode_tp_named`)."""
    if rank_to_rank:
        return transfer_id
    return f"{transfer_id}#{prefill_rank}>{decode_rank}/{decode_tp}"


def stage_part_id(part: str, stage: int, stages: int) -> str:
    """The id of pipeline stage `stage`'s share of a rank pair's part `part` (`part_id`),
    where the prefill runs `stages` pipeline stages, each sending its own layers: the
    part itself without stages (ids are what they were), else `part` and `|pp1/2`
    (stage 1 of 2). The same on both sides: the decode registers one per stage."""
    return part if stages == 1 else f"{part}{STAGE_MARK}{stage}/{stages}"


# What begins a pipeline stage's suffix in a part's id (`stage_part_id`).
STAGE_MARK = "|pp"


def decode_tp_named(part: str, transfer_id: str, prefill_tp: int) -> int | None:
    """The decode TP size that `part`, an id a receiver registered for, says it split
    `transfer_id` for: `prefill_tp` for the id itself (rank to rank), the size after
    the `/` of a rank pair's part; a pipeline stage's suffix (`|pp1/2`) and a KV-cache
    group's (`@g1`) are ignored. None if `part` is no part of `transfer_id`, or names
    no usable size."""
    if not part.startswith(transfer_id):
        return None
    rest = part[len(transfer_id) :].split("@g", 1)[0].split(STAGE_MARK, 1)[0]
    if rest == "":
        return prefill_tp
    if not rest.startswith("#"):
        return None
    ranks, _, size = rest[1:].partition("/")
    if ">" not in ranks or not size.isascii() or not size.isdigit():
        return None
    decode_tp = int(size)
    return decode_tp if 0 < decode_tp <= 4096 else None


def transfer_parts(
    transfer_id: str, prefill_tp: int, decode_tp: int
) -> tuple[tuple[int, int, str], ...]:
    """Every part of `transfer_id` between the two TP sizes: (prefill rank, decode rank,
    the part's transfer id), one per `rank_pairs` pair."""
    same = prefill_tp == decode_tp
    return tuple(
        (p, d, part_id(transfer_id, p, d, rank_to_rank=same, decode_tp=decode_tp))
        for p, d in rank_pairs(prefill_tp, decode_tp)
    )
