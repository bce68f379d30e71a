"""fp8 KV caches through the connector's worker side (`WorkerSide`), without vLLM, over
the loopback transport (issue 36).

vLLM (`--kv-cache-dtype fp8`, `fp8_e4m3`, `fp8_e5m2`) stores every fp8 format in uint8
tensors and keeps the scales it quantized with on its attention layers, one
(k_scale, v_scale) per layer (vllm/utils/torch_utils.py STR_DTYPE_TO_TORCH_DTYPE; the
CPU backend reads `layer._k_scale_float`). The tensors alone cannot tell two such
caches apart, so the connector names the format and the scales in the compatibility
check (`kvcache.cache_dtype_name`): equal caches move byte for byte, and a decode whose
format or scales differ from the prefill's is refused before anything is written, the
reason naming both. The end-to-end proof with real vLLM servers is
`tests/test_vllm_e2e_fp8.py`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
import torch

from helpers.vllm_worker import EngineRanks, RecordingStats, worker_config
from kvpush.config import TimingConfig
from kvpush.errors import FailureReason
from kvpush.integrations.vllm.kvcache import cache_dtype_name
from kvpush.integrations.vllm.plan import Receive, Send, StepPlan, StepResults
from kvpush.transports.loopback import LoopbackFabric

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
BLOCKS, LAYERS, HEADS, TOKENS, C = 8, 2, 2, 16, 64  # C = head_size + head_size_v
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
UNIT = {name: (1.0, 1.0) for name in NAMES}


class Engine:
    """One engine's rank: a worker over uint8 caches (vLLM's fp8 storage) registered
    with this cache dtype and these per-layer scales, and its side channel."""

    def __init__(
        self,
        stack: ExitStack,
        fabric: LoopbackFabric,
        name: str,
        role: str,
        *,
        cache_dtype: str,
        scales: dict[str, tuple[float, float]],
        seed: int,
    ) -> None:
        engine = EngineRanks(stack, fabric)
        self.ranks, self.server = engine.ranks, engine.server
        config = worker_config(
            name,
            role,
            engine.port,
            total_kv_heads=HEADS,
            block_size_tokens=TOKENS,
            timing=TimingConfig(heartbeat_interval_s=0.2, liveness_timeout_s=5.0, lease_s=3.0),
        )
        storage = torch.randint(
            0,
            256,
            (LAYERS, BLOCKS, HEADS, TOKENS, C),
            dtype=torch.uint8,
            generator=torch.Generator().manual_seed(seed),
        )
        self.caches = {name: storage[i] for i, name in enumerate(NAMES)}
        self.worker = engine.start_rank(
            dataclasses.replace(config, cache_dtype=cache_dtype), 0, self.caches, scales=scales
        )
        self.ended = StepResults()
        self.stats = RecordingStats()

    def step(self, plan: StepPlan | None = None) -> None:
        plan = plan or StepPlan(idle=True)
        self.worker.start_step(plan)
        self.worker.step_saved(plan)
        out = self.worker.transfer_results()
        self.ended.finished_recving |= out.finished_recving
        self.ended.failed_recving |= out.failed_recving
        self.ended.finished_sending |= out.finished_sending
        taken = self.worker.take_stats()
        if taken is not None:
            self.stats.failed += taken.failed

    def block(self, layer: int, block: int) -> bytes:
        return bytes(self.caches[NAMES[layer]][block].contiguous().reshape(-1).numpy())


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


def _transfer(prefill: Engine, decode: Engine, *, refused: bool = False) -> None:
    """The decode registers blocks 5, 6 for the prefill's 3, 4; both step until each
    side reported its end (`refused`: the decode's only; the prefill holds its blocks
    until its transfer deadline, no receiver having registered)."""
    receive = Receive("req-d", "t-fp8", HOST, prefill.server.port, (5, 6), 0)
    decode.step(StepPlan(receives=[receive]))
    prefill.step(StepPlan(sends=[Send("req-p", "t-fp8", (3, 4), decode_tp_size=1)]))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        sent = refused or "req-p" in prefill.ended.finished_sending
        if sent and "req-d" in decode.ended.finished_recving:
            return
        prefill.step()
        decode.step()
        time.sleep(0.002)
    raise AssertionError(f"not ended: prefill {prefill.ended}, decode {decode.ended}")


def test_equal_fp8_caches_move_byte_for_byte(stack: ExitStack) -> None:
    fabric = LoopbackFabric()
    prefill = Engine(
        stack, fabric, "prefill", "sender", cache_dtype="fp8_e4m3", scales=UNIT, seed=1
    )
    decode = Engine(
        stack, fabric, "decode", "receiver", cache_dtype="fp8_e4m3", scales=UNIT, seed=2
    )
    _transfer(prefill, decode)
    assert decode.ended.failed_recving == set(), decode.stats.failed
    for layer in range(LAYERS):
        for ours, theirs in ((5, 3), (6, 4)):
            assert decode.block(layer, ours) == prefill.block(layer, theirs)


@pytest.mark.parametrize(
    ("decode_dtype", "decode_scales"),
    [
        ("fp8_e5m2", UNIT),
        ("fp8_e4m3", {NAMES[0]: (1.0, 1.0), NAMES[1]: (0.5, 1.0)}),
        ("auto", UNIT),
    ],
    ids=["e4m3-into-e5m2", "other-scales", "fp8-into-plain"],
)
def test_a_decode_of_another_cache_dtype_or_scales_is_refused_naming_both(
    stack: ExitStack, decode_dtype: str, decode_scales: dict[str, tuple[float, float]]
) -> None:
    """The prefill stores fp8_e4m3 with unit scales; the decode another format, other
    scales, or its tensors' own dtype (what `auto` is): its receive fails as an
    incompatible peer, the reason naming both caches, and not a byte of its blocks
    changed."""
    fabric = LoopbackFabric()
    prefill = Engine(
        stack, fabric, "prefill", "sender", cache_dtype="fp8_e4m3", scales=UNIT, seed=1
    )
    decode = Engine(
        stack,
        fabric,
        "decode",
        "receiver",
        cache_dtype=decode_dtype,
        scales=decode_scales,
        seed=2,
    )
    before = [decode.block(layer, b) for layer in range(LAYERS) for b in (5, 6)]
    _transfer(prefill, decode, refused=True)
    assert decode.ended.failed_recving == {"req-d"}
    [(reason, detail)] = decode.stats.failed
    assert reason is FailureReason.INCOMPATIBLE_PEER, detail
    # As the decode saw it: theirs the prefill's cache, ours its own.
    prefill_said = "uint8 holding fp8_e4m3 (k_scale 1.0, v_scale 1.0 in every layer)"
    decode_said = cache_dtype_name("uint8", decode_dtype, [decode_scales[n] for n in NAMES])
    assert f"dtype: theirs {prefill_said!r}, ours {decode_said!r}" in detail, detail
    assert decode_said != prefill_said
    assert [decode.block(layer, b) for layer in range(LAYERS) for b in (5, 6)] == before


def test_a_plain_cache_keeps_its_tensors_dtype_and_hash() -> None:
    """`auto` and the float cache dtypes are named by their tensors alone, as before
    fp8 was named, so engines without a quantized cache keep their compatibility hash."""
    for plain in ("auto", "float32", "bfloat16", "float16"):
        assert cache_dtype_name("float32", plain, [(1.0, 1.0)]) == "float32"
    assert cache_dtype_name("uint8", "fp8", []) == "uint8 holding fp8 (no per-layer scales)"
    other = cache_dtype_name("uint8", "fp8", [(1.0, 1.0), (0.5, 1.0)])
    assert other != cache_dtype_name("uint8", "fp8", [(0.5, 1.0), (1.0, 1.0)])
