"""The vLLM connector's worker side across engines of different tensor parallelism,
without vLLM, over the loopback transport: every rank its own `WorkerSide`, runtime and
KV cache, each engine one real side channel serving all its ranks.

The model's KV is made once per engine (every byte random, per layer, block and head);
each rank's cache holds the heads that rank holds (`kvpush.topology.rank_heads`), in
vLLM's packed per-layer layout (`[blocks, heads, tokens, K|V]`, heads outermost in a
block). After a transfer, every decode rank's blocks must hold exactly the prefill
model's bytes of its own heads: every part landed, in the right place, nothing else
was touched. Then the ways a request of several parts ends: one part failing fails the
request once, after every part ended; a transfer split for another decode TP is refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
import torch

from helpers.vllm_worker import EngineRanks, RecordingStats, run_until_ended, worker_config
from kvpush.geometry import KVCacheGroup, sub_block_ids
from kvpush.integrations.vllm.groups import in_sender_blocks, received_blocks
from kvpush.integrations.vllm.plan import (
    GroupBlocks,
    Receive,
    Refuse,
    Send,
    StepPlan,
    StepResults,
)
from kvpush.integrations.vllm.worker import WorkerSide
from kvpush.topology import UnsupportedShape, rank_heads
from kvpush.transports.loopback import LoopbackFabric

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
BLOCKS, LAYERS, TOKENS, C = 8, 2, 16, 32  # C = head_size + head_size_v


def model_kv(
    seed: int, total_heads: int, tokens: int = TOKENS, kv_first: bool = False
) -> torch.Tensor:
    """The model's whole KV cache, random bytes: [layers, blocks, heads, tokens, C] in
    vLLM-CPU's packed layout, or [layers, 2, blocks, heads, tokens, C / 2] with K and V
    tensors of their own (`kv_first`, as vLLM's GPU attention backends hand them)."""
    shape = (LAYERS, BLOCKS, total_heads, tokens, C)
    if kv_first:
        shape = (LAYERS, 2, BLOCKS, total_heads, tokens, C // 2)
    kv = torch.empty(shape, dtype=torch.bfloat16)
    flat = kv.view(torch.uint8).reshape(-1)
    gen = torch.Generator().manual_seed(seed)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
    return kv


class Engine:
    """One vLLM engine: its ranks' workers and caches, and the scheduler's side channel."""

    def __init__(
        self,
        stack: ExitStack,
        fabric: LoopbackFabric,
        name: str,
        role: str,
        *,
        tp: int,
        total_heads: int,
        seed: int,
        mla: bool = False,
        tokens: int = TOKENS,
        kv_first: bool = False,
    ) -> None:
        self.tp = tp
        self.head_axis = 3 if kv_first else 2
        engine = EngineRanks(stack, fabric)
        self.ranks, self.server = engine.ranks, engine.server
        config = worker_config(
            name,
            role,
            engine.port,
            total_kv_heads=total_heads,
            block_size_tokens=tokens,
            tp_size=tp,
            use_mla=mla,
        )
        self.mla = mla
        self.model = model_kv(seed, total_heads, tokens, kv_first)
        self.workers: list[WorkerSide[RecordingStats]] = []
        self.caches: list[torch.Tensor] = []
        for rank in range(tp):
            held = rank_heads(rank, tp, total_heads, mla)
            cache = self.model.narrow(self.head_axis, held.first_head, held.num_heads).clone()
            # MLA's cache is vLLM's [blocks, tokens, latent] per layer: no head axis.
            layers = {
                f"model.layers.{i}.self_attn.attn": cache[i, :, 0] if mla else cache[i]
                for i in range(LAYERS)
            }
            self.workers.append(engine.start_rank(config, rank, layers))
            self.caches.append(cache)
        self.ended = [StepResults() for _ in range(tp)]
        # How often each rank reported each request: exactly once is the contract.
        self.reports: list[dict[str, int]] = [{} for _ in range(tp)]

    def step(self, plans: list[StepPlan] | StepPlan | None = None) -> None:
        """One engine step on every rank: the plan (one for all, or one per rank)."""
        for rank, worker in enumerate(self.workers):
            plan = plans[rank] if isinstance(plans, list) else plans or StepPlan(idle=True)
            worker.start_step(plan)
            worker.step_saved(plan)
            out = worker.transfer_results()
            ended = self.ended[rank]
            ended.finished_recving |= out.finished_recving
            ended.failed_recving |= out.failed_recving
            ended.finished_sending |= out.finished_sending
            for rid in out.finished_recving | out.finished_sending:
                self.reports[rank][rid] = self.reports[rank].get(rid, 0) + 1

    def heads_of(self, rank: int, model: torch.Tensor, block: int) -> torch.Tensor:
        """The bytes rank `rank` of this engine should hold for `block` of `model`."""
        held = rank_heads(rank, self.tp, model.shape[self.head_axis], self.mla)
        blocks = self.head_axis - 1
        return model.select(blocks, block).narrow(blocks, held.first_head, held.num_heads)

    def blocks(self, cache: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """Blocks `ids` of one rank's cache, as raw bytes."""
        index = torch.tensor(ids)
        return cache.index_select(self.head_axis - 1, index).view(torch.uint8)


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


def pair(
    stack: ExitStack, p_tp: int, d_tp: int, heads: int, *, mla: bool = False, kv_first: bool = False
) -> tuple[Engine, Engine]:
    fabric = LoopbackFabric()
    shape = {"total_heads": heads, "mla": mla, "kv_first": kv_first}
    prefill = Engine(stack, fabric, "prefill", "sender", tp=p_tp, seed=1, **shape)
    decode = Engine(stack, fabric, "decode", "receiver", tp=d_tp, seed=2, **shape)
    return prefill, decode


def receive(
    prefill: Engine, decode: Engine, tid: str, blocks: tuple[int, ...], *, named: bool = True
) -> StepPlan:
    """The decode's plan; `named`: the params name the decode TP the prefill split the
    transfer for (kvpush proxy's), else only the prefill's TP (vLLM's push dialect)."""
    split_for = decode.tp if named else None
    return StepPlan(
        receives=[
            Receive("req-d", tid, HOST, prefill.server.port, blocks, 0, prefill.tp, split_for)
        ]
    )


SHAPES = [
    # (prefill TP, decode TP, KV heads)
    (2, 1, 4),  # two parts into each decode rank
    (1, 2, 4),  # one prefill rank into two decode ranks
    (4, 2, 4),
    (2, 4, 4),
    (4, 1, 8),
    (1, 4, 8),
    (4, 1, 2),  # prefill TP above the head count: ranks 1 and 3 hold copies, move nothing
    (1, 4, 2),  # decode TP above the head count: ranks share a head each
    (2, 2, 4),  # rank to rank, as before
]


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "heads"), SHAPES, ids=[f"tp{p}-to-tp{d}-{h}heads" for p, d, h in SHAPES]
)
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_every_decode_rank_holds_exactly_the_prefill_models_bytes_of_its_heads(
    stack: ExitStack, p_tp: int, d_tp: int, heads: int, layerwise: bool
) -> None:
    check_every_decode_rank(pair(stack, p_tp, d_tp, heads), layerwise)


UNNAMED_SHAPES = [(2, 1, 4), (1, 2, 4), (4, 2, 4), (2, 4, 4), (1, 4, 2), (2, 2, 4), (1, 1, 2)]


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "heads"),
    UNNAMED_SHAPES,
    ids=[f"tp{p}-to-tp{d}-{h}heads" for p, d, h in UNNAMED_SHAPES],
)
@pytest.mark.parametrize("prefill_first", [True, False], ids=["legs-in-turn", "decode-first"])
def test_a_prefill_told_nothing_of_the_decode_learns_its_tp_from_the_registrations(
    stack: ExitStack, p_tp: int, d_tp: int, heads: int, prefill_first: bool
) -> None:
    """Behind a router that speaks vLLM's push dialect, neither leg names the decode's
    TP: the decode registers the parts of its own TP, whose ids say it, and each
    prefill rank offers its parts once one of them registered (or had already)."""
    check_every_decode_rank(
        pair(stack, p_tp, d_tp, heads), layerwise=True, named=False, prefill_first=prefill_first
    )


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (2, 2)], ids=str)
def test_a_refusal_of_an_unnamed_split_frees_the_prefill_at_once(
    stack: ExitStack, p_tp: int, d_tp: int
) -> None:
    """A decode that refuses a transfer whose split nobody named (its prefix cache held
    the whole prompt) tells each prefill rank, which ends its send at once, blocks
    freed, long before the transfer deadline."""
    prefill, decode = pair(stack, p_tp, d_tp, 4)
    prefill.step(StepPlan(sends=[Send("req-p", "tr", (1, 2))]))
    started = time.monotonic()
    refuse = Refuse("tr", HOST, prefill.server.port, "every block cached", prefill.tp, None)
    decode.step(StepPlan(refusals=[refuse]))
    while not all("req-p" in e.finished_sending for e in prefill.ended):
        assert time.monotonic() - started < 20, f"the prefill was not told: {prefill.ended}"
        prefill.step()
        decode.step()
        time.sleep(0.002)
    for rank, reports in enumerate(prefill.reports):
        assert reports == {"req-p": 1}, f"prefill rank {rank} reported {reports}"


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (4, 2), (2, 2)], ids=str)
def test_mla_every_decode_rank_holds_the_whole_latent_from_one_prefill_rank(
    stack: ExitStack, p_tp: int, d_tp: int
) -> None:
    """MLA: every rank holds the whole latent cache (one "head", replicated); each
    decode rank takes it whole from prefill rank `d * P // D`, the other prefill ranks'
    parts move nothing, and still end."""
    prefill, decode = pair(stack, p_tp, d_tp, 1, mla=True)
    for cache in prefill.caches:
        assert torch.equal(cache.view(torch.uint8), prefill.model.view(torch.uint8))
    check_every_decode_rank((prefill, decode), layerwise=False)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)], ids=str)
def test_k_and_v_tensors_of_their_own_are_cut_to_heads_too(
    stack: ExitStack, p_tp: int, d_tp: int
) -> None:
    """K and V tensors of their own per layer, heads outermost in a block
    (`[2, blocks, heads, tokens, head_size]`: vLLM's GPU backends in HND): each region a
    K or V tensor, its blocks cut to the planned heads as in the packed layout."""
    check_every_decode_rank(pair(stack, p_tp, d_tp, 4, kv_first=True), layerwise=False)


def check_every_decode_rank(
    engines: tuple[Engine, Engine],
    layerwise: bool,
    *,
    named: bool = True,
    prefill_first: bool = False,
) -> None:
    """`named`: both sides are told both TP sizes (kvpush proxy); else neither is told
    the decode's (a router that speaks vLLM's push dialect). `prefill_first`: the
    prefill offers before the decode registers (legs in turn), else after."""
    prefill, decode = engines
    d_tp = decode.tp
    before = [cache.clone() for cache in decode.caches]
    split = d_tp if named else None
    send = Send("req-p", "t1", (1, 2, 3), layerwise=layerwise, decode_tp_size=split)
    if prefill_first:
        prefill.step(StepPlan(sends=[send]))
    decode.step(receive(prefill, decode, "t1", (5, 6, 7), named=named))
    if not prefill_first:
        prefill.step(StepPlan(sends=[send]))
    run_until_ended(prefill, decode)
    for rank in range(d_tp):
        assert decode.ended[rank].failed_recving == set(), f"decode rank {rank} failed"
        cache = decode.caches[rank]
        for ours, theirs in zip((5, 6, 7), (1, 2, 3), strict=True):
            want = decode.heads_of(rank, prefill.model, theirs).unsqueeze(decode.head_axis - 1)
            assert torch.equal(decode.blocks(cache, [ours]), want.view(torch.uint8)), (
                f"decode rank {rank} block {ours} is not the prefill's block {theirs} of its heads"
            )
        untouched = [b for b in range(BLOCKS) if b not in (5, 6, 7)]
        assert torch.equal(
            decode.blocks(cache, untouched), decode.blocks(before[rank], untouched)
        ), f"decode rank {rank}: a block outside the request changed"
    for engine in (prefill, decode):
        for rank, reports in enumerate(engine.reports):
            assert reports == {"req-p" if engine is prefill else "req-d": 1}, (
                f"rank {rank} reported {reports}: expected the request once"
            )


BLOCK_SHAPES = [
    # (prefill TP, decode TP, KV heads, decode blocks per prefill block)
    (1, 1, 1, 2),
    (1, 1, 2, 4),  # a run per head
    (2, 2, 2, 2),  # one head per rank
    (2, 1, 4, 2),  # two parts into each decode block: the heads of each prefill rank
    (2, 1, 1, 2),  # prefill TP above the head count: rank 1's copy moves nothing
]


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "heads", "ratio"),
    BLOCK_SHAPES,
    ids=[f"tp{p}-to-tp{d}-{h}heads-x{r}" for p, d, h, r in BLOCK_SHAPES],
)
def test_decode_blocks_a_whole_multiple_of_the_prefills_take_each_prefill_block_in_place(
    stack: ExitStack, p_tp: int, d_tp: int, heads: int, ratio: int
) -> None:
    """The decode's blocks `ratio` times the prefill's (16 tokens), K and V tensors of
    their own per layer (`[2, blocks, heads, tokens, head_size]`, as vLLM's GPU backends
    hand them): the decode registers the parts of its blocks (`sub_block_ids`), and
    each prefill block lands whole, every head's K and V, in its part of the decode
    block, in token order; the rest of the last decode block, and every other block,
    stay as they were."""
    fabric = LoopbackFabric()
    shape = {"total_heads": heads, "kv_first": True}
    prefill = Engine(stack, fabric, "prefill", "sender", tp=p_tp, seed=1, **shape)
    decode = Engine(
        stack, fabric, "decode", "receiver", tp=d_tp, seed=2, tokens=TOKENS * ratio, **shape
    )
    sent = (1, 2, 3, 7, 0)  # five prefill blocks: the last decode block partly filled
    ours = (5, 6, 2)[: -(-len(sent) // ratio)]
    parts = sub_block_ids(ours, ratio, len(sent))
    before = [cache.clone() for cache in decode.caches]
    receive = Receive(
        "req-d", "tb", HOST, prefill.server.port, parts, 0, p_tp, d_tp, sender_block_tokens=TOKENS
    )
    decode.step(StepPlan(receives=[receive]))
    prefill.step(StepPlan(sends=[Send("req-p", "tb", sent, decode_tp_size=d_tp)]))
    run_until_ended(prefill, decode)
    for rank in range(d_tp):
        assert decode.ended[rank].failed_recving == set(), f"decode rank {rank} failed"
        want = before[rank].clone()  # [layers, 2, blocks, heads, tokens, head_size]
        held = rank_heads(rank, d_tp, heads, False)
        for i, block in enumerate(sent):
            at = (i % ratio) * TOKENS
            want[:, :, ours[i // ratio], :, at : at + TOKENS] = prefill.model[
                :, :, block, held.first_head : held.stop
            ]
        assert torch.equal(decode.caches[rank].view(torch.uint8), want.view(torch.uint8)), (
            f"decode rank {rank}: not each prefill block in its part, or more written"
        )


def test_vllm_cpus_packed_layout_of_other_block_sizes_is_refused_naming_why(
    stack: ExitStack, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM-CPU's attention keeps a block's K transposed, so a smaller block's tokens are
    no run of a larger one: the decode's handshake refuses the pair, the request fails
    at once, naming the layout and what is expected; nothing is written."""
    fabric = LoopbackFabric()
    prefill = Engine(stack, fabric, "prefill", "sender", tp=1, total_heads=2, seed=1)
    decode = Engine(
        stack, fabric, "decode", "receiver", tp=1, total_heads=2, seed=2, tokens=2 * TOKENS
    )
    before = decode.caches[0].clone()
    receive = Receive(
        "req-d", "tc", HOST, prefill.server.port, (10, 11), 0, 1, 1, sender_block_tokens=TOKENS
    )
    decode.step(StepPlan(receives=[receive]))
    prefill.step(StepPlan(sends=[Send("req-p", "tc", (1, 2), decode_tp_size=1)]))
    deadline = time.monotonic() + 20
    while "req-d" not in decode.ended[0].finished_recving:
        assert time.monotonic() < deadline, "the decode did not fail the request at once"
        prefill.step()
        decode.step()
        time.sleep(0.002)
    assert decode.ended[0].failed_recving == {"req-d"}
    assert "vLLM-CPU's attention keeps each head's K of a block transposed" in caplog.text
    assert torch.equal(decode.caches[0].view(torch.uint8), before.view(torch.uint8))
    prefill.step(StepPlan(aborts=["tc"]))
    while "req-p" not in prefill.ended[0].finished_sending:
        assert time.monotonic() < deadline, "the prefill's aborted send did not end"
        prefill.step()
        time.sleep(0.002)


def test_the_decode_counts_its_blocks_in_the_prefills_as_many_as_the_prefill_sends() -> None:
    """What the decode's scheduler registers (`in_sender_blocks`): a 100-token prompt in
    16-token prefill blocks (7 of them) into 32-token decode blocks (4): the parts of
    each decode block after its prefix hit, one per prefill block, the offset in
    prefill blocks; the prefill's sizes that are no whole fraction of the decode's, or
    a hybrid model's, refused naming both sizes."""
    full = (KVCacheGroup("full_attention", 32),)
    decode_ids = [[9, 4, 6, 2]]
    got = received_blocks(full, decode_ids, 100, 0)
    assert in_sender_blocks(full, got, 100, 32, 16) == (GroupBlocks((18, 19, 8, 9, 12, 13, 4), 0),)
    hit = received_blocks(full, decode_ids, 100, 64)  # two decode blocks cached
    assert in_sender_blocks(full, hit, 100, 32, 16) == (GroupBlocks((12, 13, 4), 4),)
    assert in_sender_blocks(full, got, 100, 32, 32) is got
    with pytest.raises(UnsupportedShape) as caught:
        in_sender_blocks(full, got, 100, 32, 64)
    assert str(caught.value) == (
        "the prefill's blocks hold 64 tokens, the decode's 32: expected the decode's block "
        "size to be a whole multiple of the prefill's (--block-size 64 on the decode, say)"
    )
    with pytest.raises(UnsupportedShape, match=r"--block-size 48 on the decode"):
        in_sender_blocks(full, got, 100, 32, 24)
    # A Mamba group's block size is vLLM's for states, not the engine's: one block size.
    mamba = (KVCacheGroup("mamba", 1024, state="s"), KVCacheGroup("full_attention", 32))
    state = received_blocks(mamba, [[3], [9, 4, 6, 2]], 100, 0)
    assert in_sender_blocks(mamba, state, 100, 32, 32) is state
    hybrid = (*full, KVCacheGroup("sliding_window", 32, 64))
    two = received_blocks(hybrid, [[9, 4, 6, 2], [0, 0, 6, 2]], 100, 0)
    with pytest.raises(UnsupportedShape, match=r"sliding window of 64 tokens count in"):
        in_sender_blocks(hybrid, two, 100, 32, 16)


def test_a_receive_counted_in_blocks_larger_than_the_decodes_fails_at_once(
    stack: ExitStack,
) -> None:
    """A decode told the prefill's blocks are larger than its own (the prefill's answer,
    or a router, says 32 tokens; the decode's are 16): its runtime refuses to register
    parts of blocks it does not have, and the request fails at once, nothing written."""
    fabric = LoopbackFabric()
    prefill = Engine(stack, fabric, "prefill", "sender", tp=1, total_heads=2, seed=1)
    decode = Engine(stack, fabric, "decode", "receiver", tp=1, total_heads=2, seed=2)
    before = decode.caches[0].clone()
    receive = Receive(
        "req-d", "tc", HOST, prefill.server.port, (5,), 0, 1, 1, sender_block_tokens=32
    )
    decode.step(StepPlan(receives=[receive]))
    assert decode.ended[0].failed_recving == {"req-d"}
    stats = decode.workers[0].take_stats()
    assert stats is not None
    [why] = stats.failed_at_once
    assert "sender_block_tokens 32 does not divide our 16-token blocks" in why
    assert torch.equal(decode.caches[0].view(torch.uint8), before.view(torch.uint8))


def test_one_part_failing_fails_the_request_once_after_every_part_ended(
    stack: ExitStack,
) -> None:
    """TP 2 -> TP 1: prefill rank 1's request ends without its KV (cancelled) while
    rank 0 sends: the decode rank's part from rank 1 fails, the part from rank 0 is
    aborted at once, and the request is reported once, failed, when both ended."""
    prefill, decode = pair(stack, 2, 1, 4)
    decode.step(receive(prefill, decode, "t2", (5, 6)))
    send = Send("req-p", "t2", (1, 2), decode_tp_size=1)
    cancel = Send("req-p", "t2", (1, 2), cancel=True, decode_tp_size=1)
    prefill.step([StepPlan(sends=[send]), StepPlan(sends=[cancel])])
    run_until_ended(prefill, decode)
    assert decode.ended[0].failed_recving == {"req-d"}
    assert decode.reports == [{"req-d": 1}]
    assert prefill.reports == [{"req-p": 1}, {"req-p": 1}]


def test_a_request_is_reported_only_once_its_last_part_ended(stack: ExitStack) -> None:
    """TP 2 -> TP 1: prefill rank 0 sends at once, rank 1 only later. The decode rank's
    part from rank 0 ends first; the request is not reported then (its other heads have
    not arrived), but once the part from rank 1 ended, once, with every head in place."""
    prefill, decode = pair(stack, 2, 1, 4)
    decode.step(receive(prefill, decode, "t4", (5, 6)))
    send = Send("req-p", "t4", (1, 2), decode_tp_size=1)
    prefill.step([StepPlan(sends=[send]), StepPlan()])
    ended: list[str] = []
    deadline = time.monotonic() + 30
    while "t4#0>0/1" not in ended:
        assert time.monotonic() < deadline, f"part 0>0 did not end: {ended}"
        prefill.step()
        decode.step()
        stats = decode.workers[0].take_stats()
        ended += stats.parts_ended if stats is not None else []
        time.sleep(0.002)
    assert "req-d" not in decode.ended[0].finished_recving, (
        "the request was reported when only its part from prefill rank 0 had ended"
    )
    prefill.step([StepPlan(), StepPlan(sends=[send])])
    run_until_ended(prefill, decode)
    assert decode.ended[0].failed_recving == set() and decode.reports == [{"req-d": 1}]
    for ours, theirs in zip((5, 6), (1, 2), strict=True):
        want = decode.heads_of(0, prefill.model, theirs)
        assert torch.equal(decode.caches[0][:, ours].view(torch.uint8), want.view(torch.uint8))


def test_a_transfer_split_for_another_decode_tp_is_refused_at_once_on_both_sides(
    stack: ExitStack,
) -> None:
    """The prefill (TP 2) split the transfer for a decode at TP 1 (the proxy did not name
    the decode's TP), but the decode runs TP 2: the decode fails the request at once,
    naming both TPs and what to set, and refuses the prefill's parts, which end at once
    instead of at their deadline, freeing the prefill's blocks."""
    prefill, decode = pair(stack, 2, 2, 4)
    plan = StepPlan(receives=[Receive("req-d", "t3", HOST, prefill.server.port, (5,), 0, 2, 1)])
    prefill.step(StepPlan(sends=[Send("req-p", "t3", (1,), decode_tp_size=1)]))
    started = time.monotonic()
    decode.step(plan)
    assert [e.failed_recving for e in decode.ended] == [{"req-d"}, {"req-d"}]
    stats = decode.workers[0].take_stats()
    assert stats is not None
    assert stats.failed_at_once == [
        "the prefill (TP 2) split transfer t3 for a decode at TP 1, but this decode runs "
        "TP 2: expected the prefill leg's kv_transfer_params to name it (decode_tp_size: 2; "
        "kvpush proxy reads it from --decode-side-channel; or name none, and the prefill "
        "learns it from this decode's registration)"
    ]
    while not all("req-p" in e.finished_sending for e in prefill.ended):
        # Well inside its 60 s deadline, which is what it would wait untold.
        assert time.monotonic() - started < 20, f"the prefill was not told: {prefill.ended}"
        prefill.step()
        decode.step()
        time.sleep(0.002)
