"""The vLLM connector's worker side for a hybrid model (vLLM's hybrid KV-cache manager:
a sliding-window group and a full-attention group), TP 1 into TP 1, without vLLM, over
the loopback transport: real workers, runtimes and side channels.

Each engine's KV cache is laid out as vLLM-CPU lays a hybrid model's: one backing
tensor of `SLOTS` layer slots, and layer i of every group one view of slot i (vLLM's
probe of a Llama with `layer_types` [sliding, full] handed both layers the same view).
A block belongs to one group at a time; block 0 is vLLM's null block. Block ids per
group come from the scheduler's own functions (`kvpush.integrations.vllm.groups`), so
what moves is what the connector would move: a sliding-window group only the blocks its
window still holds. After the transfer every moved block holds the prefill's bytes, in
every slot, and every other block of the decode (the null block, the skipped and
prefix-hit positions, blocks of no request) is untouched.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack

import msgspec
import pytest
import torch

from helpers.vllm_worker import EngineRanks, RecordingStats, worker_config
from kvpush.geometry import CacheGeometry, KVCacheGroup, Region
from kvpush.integrations.vllm.groups import moved_span, received_blocks, sent_blocks
from kvpush.integrations.vllm.plan import Receive, Send, StepPlan, StepResults
from kvpush.integrations.vllm.worker import WorkerSide
from kvpush.topology import rank_heads
from kvpush.transports.loopback import LoopbackFabric

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
SLOTS, BLOCKS, HEADS, TOKENS, C = 2, 24, 2, 16, 32  # C = head_size + head_size_v
WINDOW = 24  # tokens
GROUPS = (
    KVCacheGroup("sliding_window", TOKENS, sliding_window=WINDOW),
    KVCacheGroup("full_attention", TOKENS),
)
# vLLM's layer order: layer 2k is sliding-window (group 0), 2k + 1 full (group 1), and
# layers 2k and 2k + 1 share slot k.
LAYERS = {f"model.layers.{i}.self_attn.attn": i // 2 for i in range(2 * SLOTS)}
NUM_TOKENS = 70  # 5 blocks; the window's first token is 70 - 24 + 1 = 47, in block 2


class Engine:
    """One vLLM engine of a hybrid model: its ranks' workers and caches (each rank the
    heads it holds of the engine's `model`), and the scheduler's side channel."""

    def __init__(
        self,
        stack: ExitStack,
        fabric: LoopbackFabric,
        name: str,
        role: str,
        *,
        seed: int,
        tp: int = 1,
        groups: tuple[KVCacheGroup, ...] = GROUPS,
    ) -> None:
        self.tp = tp
        engine = EngineRanks(stack, fabric)
        self.ranks, self.server = engine.ranks, engine.server
        config = worker_config(
            name, role, engine.port, total_kv_heads=HEADS, block_size_tokens=TOKENS, tp_size=tp
        )

        # The model's KV, [slots, blocks, heads, tokens, C], every byte random; each
        # rank's cache holds its heads of it.
        self.model = torch.empty((SLOTS, BLOCKS, HEADS, TOKENS, C), dtype=torch.bfloat16)
        flat = self.model.view(torch.uint8).reshape(-1)
        gen = torch.Generator().manual_seed(seed)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
        self.workers: list[WorkerSide[RecordingStats]] = []
        self.caches: list[torch.Tensor] = []
        for rank in range(tp):
            held = rank_heads(rank, tp, HEADS, False)
            cache = self.model[:, :, held.first_head : held.stop].clone()
            layers = {name: cache[slot] for name, slot in LAYERS.items()}
            self.workers.append(engine.start_rank(config, rank, layers, groups=groups))
            self.caches.append(cache)
        self.ended = [StepResults() for _ in range(tp)]
        self.reports: list[dict[str, int]] = [{} for _ in range(tp)]
        self.details: list[str] = []
        self.bytes: list[dict[str, int]] = [{} for _ in range(tp)]

    def step(self, plan: StepPlan | None = None) -> None:
        plan = plan or StepPlan(idle=True)
        for rank, worker in enumerate(self.workers):
            worker.start_step(plan)
            worker.step_saved(plan)
            self.collect(rank)

    def collect(self, rank: int) -> None:
        out = self.workers[rank].transfer_results()
        ended = self.ended[rank]
        ended.finished_recving |= out.finished_recving
        ended.failed_recving |= out.failed_recving
        ended.finished_sending |= out.finished_sending
        for rid in out.finished_recving | out.finished_sending:
            self.reports[rank][rid] = self.reports[rank].get(rid, 0) + 1
        stats = self.workers[rank].take_stats()
        if stats is not None:
            self.details += stats.details
            for side, n in stats.bytes.items():
                self.bytes[rank][side] = self.bytes[rank].get(side, 0) + n

    def all_ended(self, rid: str) -> bool:
        return all(rid in e.finished_recving | e.finished_sending for e in self.ended)

    @property
    def failed(self) -> set[str]:
        return {rid for e in self.ended for rid in e.failed_recving}


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


def pair(
    stack: ExitStack,
    decode_groups: tuple[KVCacheGroup, ...] = GROUPS,
    *,
    p_tp: int = 1,
    d_tp: int = 1,
) -> tuple[Engine, Engine]:
    fabric = LoopbackFabric()
    prefill = Engine(stack, fabric, "prefill", "sender", seed=1, tp=p_tp)
    decode = Engine(stack, fabric, "decode", "receiver", seed=2, tp=d_tp, groups=decode_groups)
    return prefill, decode


# A request's block ids per group, as vLLM hands them: the sliding-window group's
# positions before the window hold the null block (0); the groups share the pool.
PREFILL_IDS = ([0, 0, 3, 4, 9], [1, 2, 5, 6, 7])
DECODE_IDS = ([0, 0, 12, 17, 15], [11, 13, 14, 16, 18])


def plans(
    prefill: Engine, local_hit_tokens: int, *, layerwise: bool = False, decode_tp: int = 1
) -> tuple[StepPlan, StepPlan]:
    """The decode's Receive and the prefill's Send for one request, as the scheduler
    builds them."""
    got = received_blocks(GROUPS, DECODE_IDS, NUM_TOKENS, local_hit_tokens)
    sent = sent_blocks(GROUPS, PREFILL_IDS, NUM_TOKENS)
    receive = Receive(
        "req-d",
        "t1",
        HOST,
        prefill.server.port,
        got[0].blocks,
        got[0].sender_offset,
        prefill.tp,
        decode_tp,
        more_groups=got[1:],
    )
    send = Send(
        "req-p", "t1", sent[0], layerwise=layerwise, decode_tp_size=decode_tp, more_groups=sent[1:]
    )
    return StepPlan(receives=[receive]), StepPlan(sends=[send])


def run_until_ended(prefill: Engine, decode: Engine) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if prefill.all_ended("req-p") and decode.all_ended("req-d"):
            return
        prefill.step()
        decode.step()
        time.sleep(0.002)
    raise AssertionError(f"not ended: prefill {prefill.ended}, decode {decode.ended}")


def check_moved(
    prefill: Engine, decode: Engine, before: list[torch.Tensor], local_hit_tokens: int
) -> None:
    """On every decode rank, exactly the blocks each group moves hold the prefill model's
    bytes of that rank's heads; nothing else changed; each rank reported once."""
    assert decode.failed == set(), decode.details
    assert prefill.reports == [{"req-p": 1}] * prefill.tp
    assert decode.reports == [{"req-d": 1}] * decode.tp
    for rank, cache in enumerate(decode.caches):
        held = rank_heads(rank, decode.tp, HEADS, False)
        changed: set[int] = set()
        for group, theirs, ours in zip(GROUPS, PREFILL_IDS, DECODE_IDS, strict=True):
            first, stop = moved_span(group, NUM_TOKENS)
            start = max(first, local_hit_tokens // TOKENS)
            for position in range(start, stop):
                got = cache[:, ours[position]].view(torch.uint8)
                want = prefill.model[:, theirs[position], held.first_head : held.stop]
                assert torch.equal(got, want.view(torch.uint8)), (
                    f"decode rank {rank}, {group.kind} position {position}: block "
                    f"{ours[position]} is not the prefill's block {theirs[position]} of its "
                    f"heads in every slot"
                )
                changed.add(ours[position])
        # What the worker counts as received: the bytes of its blocks that moved, in
        # every group (each group's part moves whole blocks of the rank's heads).
        block_bytes = cache[:, 0].numel() * cache.element_size()
        assert decode.bytes[rank].get("receiver") == len(changed) * block_bytes, (
            f"decode rank {rank} counted {decode.bytes[rank]} received, "
            f"{len(changed)} blocks of {block_bytes} bytes moved"
        )
        untouched = [b for b in range(BLOCKS) if b not in changed]
        assert 0 in untouched, "the null block must never receive"
        assert torch.equal(
            cache[:, untouched].view(torch.uint8), before[rank][:, untouched].view(torch.uint8)
        ), f"decode rank {rank}: a block outside what moves changed"


def test_moved_span_is_the_window_vllm_keeps() -> None:
    """A sliding window moves from the block holding token `n - window + 1` (vLLM frees
    the blocks before it on both engines) to the last; full attention every block."""
    sw, full = GROUPS
    assert moved_span(full, NUM_TOKENS) == (0, 5)
    assert moved_span(sw, NUM_TOKENS) == (2, 5)  # token 47 is in block 2
    assert moved_span(sw, 24) == (0, 2)  # the window holds the whole prompt
    assert moved_span(sw, 25) == (0, 2)  # token 1 is still in block 0
    assert moved_span(sw, 40) == (1, 3)  # token 17: block 0 is freed
    # vLLM's own probe (Llama, window 48, 32-token blocks): 105 tokens kept blocks 1..3
    # ([0, 2, 3, 4]), 114 tokens blocks 2..3 ([0, 0, 3, 8]).
    probe = KVCacheGroup("sliding_window", 32, sliding_window=48)
    assert moved_span(probe, 105) == (1, 4)
    assert moved_span(probe, 114) == (2, 4)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_each_group_moves_its_own_blocks_and_a_window_only_what_it_holds(
    stack: ExitStack, layerwise: bool
) -> None:
    """No decode prefix hit: the full-attention group moves all 5 blocks, the
    sliding-window group the 3 its window holds; the null block and the skipped
    positions stay as they were."""
    prefill, decode = pair(stack)
    before = [c.clone() for c in decode.caches]
    receive, send = plans(prefill, 0, layerwise=layerwise)
    decode.step(receive)
    prefill.step(send)
    run_until_ended(prefill, decode)
    check_moved(prefill, decode, before, 0)


@pytest.mark.parametrize("hit_blocks", [1, 3], ids=["hit-before-window", "hit-in-window"])
def test_a_decode_prefix_hit_is_counted_per_group(stack: ExitStack, hit_blocks: int) -> None:
    """The decode had `hit_blocks` blocks in its own prefix cache: the full group receives
    from there; the window from there or its first block, whichever is later, with the
    offset into what the prefill sends for that group."""
    prefill, decode = pair(stack)
    before = [c.clone() for c in decode.caches]
    receive, send = plans(prefill, hit_blocks * TOKENS)
    decode.step(receive)
    prefill.step(send)
    run_until_ended(prefill, decode)
    check_moved(prefill, decode, before, hit_blocks * TOKENS)


def test_a_slot_is_announced_only_once_every_groups_layer_in_it_is_computed(
    stack: ExitStack,
) -> None:
    """Layer-wise push: slot 1 holds layers 2 (sliding window) and 3 (full). With layers
    0, 1 and 2 computed, slot 1 is not ready (the full group's blocks in it are not
    written yet), so the transfer cannot end; it ends once layer 3 is computed."""
    prefill, decode = pair(stack)
    receive, send = plans(prefill, 0, layerwise=True)
    decode.step(receive)
    worker, cache = prefill.workers[0], prefill.caches[0]
    worker.start_step(send)
    names = list(LAYERS)
    for name in names[:3]:
        worker.layer_saved(send, name, cache[LAYERS[name]])
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        prefill.collect(0)
        decode.step()
        time.sleep(0.01)
    assert decode.ended[0].finished_recving == set(), (
        "the transfer ended before layer 3, which shares slot 1 with layer 2, was computed"
    )
    worker.layer_saved(send, names[3], cache[LAYERS[names[3]]])
    run_until_ended(prefill, decode)
    check_moved(prefill, decode, [c.clone() for c in decode.caches], 0)


def test_engines_whose_groups_differ_are_refused(stack: ExitStack) -> None:
    """A decode whose sliding window is another size is another model: its handshake
    with the prefill is refused (the geometries' compatibility hashes differ), and the
    request fails, saying what differs: the groups' kinds, block sizes and windows."""
    other = (KVCacheGroup("sliding_window", TOKENS, sliding_window=32), GROUPS[1])
    prefill, decode = pair(stack, decode_groups=other)
    receive, _ = plans(prefill, 0)
    decode.step(receive)
    deadline = time.monotonic() + 30
    while not decode.all_ended("req-d"):
        assert time.monotonic() < deadline, "the decode did not fail the request"
        decode.step()
        time.sleep(0.002)
    assert decode.failed == {"req-d"}
    assert decode.reports == [{"req-d": 1}]
    # The decode's refusal names what differs, theirs (the prefill's) and ours.
    differs = (
        "differs in kv_cache_groups: theirs [('sliding_window', 16, 24), "
        "('full_attention', 16, None)], ours [('sliding_window', 16, 32), "
        "('full_attention', 16, None)]"
    )
    assert any(differs in d for d in decode.details), decode.details


def test_a_one_group_model_keeps_its_compatibility_hash() -> None:
    """Geometries without groups hash as before groups existed (a one-group engine of
    this version and one of the last agree); a hybrid model's groups are compared."""
    region = Region("l0.kv", 0, 4096, 512, 512, 8)
    plain = CacheGeometry("vllm_packed/BHNC", 16, "bfloat16", (region,))
    assert "kv_cache_groups" not in plain.compat_fields()
    hybrid = msgspec.structs.replace(plain, groups=GROUPS)
    assert hybrid.compat_hash() != plain.compat_hash()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (2, 2)], ids=str)
def test_groups_across_tensor_parallel_sizes(stack: ExitStack, p_tp: int, d_tp: int) -> None:
    """Groups split each rank pair's part once more: at TP 2 into 1 the decode rank takes
    one head from each prefill rank in each group, at 1 into 2 the prefill rank writes
    one head into each decode rank, every moved block in every slot."""
    prefill, decode = pair(stack, p_tp=p_tp, d_tp=d_tp)
    before = [c.clone() for c in decode.caches]
    receive, send = plans(prefill, TOKENS, decode_tp=d_tp)
    decode.step(receive)
    prefill.step(send)
    run_until_ended(prefill, decode)
    check_moved(prefill, decode, before, TOKENS)


def test_a_receive_planned_for_other_groups_is_refused_at_once_on_both_sides(
    stack: ExitStack,
) -> None:
    """A decode plan that names one group where the ranks registered two (a scheduler
    and a worker that disagree) fails the request at once, saying so, and refuses every
    group's part of the prefill's, which ends at once instead of at its deadline."""
    prefill, decode = pair(stack)
    receive, send = plans(prefill, 0)
    one_group = StepPlan(
        receives=[
            Receive("req-d", "t1", HOST, prefill.server.port, (12, 17, 15), 0, 1, 1),
        ]
    )
    prefill.step(send)
    started = time.monotonic()
    decode.step(one_group)
    assert decode.failed == {"req-d"} and decode.reports == [{"req-d": 1}]
    assert decode.details == [
        "transfer t1 names the blocks of 1 KV-cache group(s), but this rank registered 2"
    ]
    while not prefill.all_ended("req-p"):
        assert time.monotonic() - started < 20, f"the prefill was not told: {prefill.ended}"
        prefill.step()
        decode.step()
        time.sleep(0.002)
    assert prefill.reports == [{"req-p": 1}]
    assert receive.receives[0].more_groups, "the real plan names the second group"
