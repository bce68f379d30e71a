"""The vLLM connector's worker side (`WorkerSide`), without vLLM, over the loopback transport.

A prefill and a decode worker each register real torch CPU tensors in vLLM's packed
per-layer layout, run their rank over one `LoopbackFabric`, and publish their metadata on
a real side channel each (as vLLM's scheduler process serves it from the workers'
handshake metadata). The test drives `StepPlan`s through them step by step, as vLLM's
engine loop would (`start_step`, `layer_saved`, `step_saved`, `transfer_results`), and
compares the bytes that arrived.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
import torch

from helpers.vllm_worker import EngineRanks, worker_config
from kvpush.config import TimingConfig
from kvpush.integrations.vllm.plan import Receive, Send, StepPlan, StepResults
from kvpush.transports.loopback import LoopbackFabric

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
TOKEN = "s3cret"
BLOCKS, LAYERS, HEADS, TOKENS, C = 8, 3, 2, 16, 32  # C = head_size + head_size_v


def kv_caches(seed: int) -> dict[str, torch.Tensor]:
    """vLLM's CPU KV cache: one [blocks, heads, tokens, K|V] view per layer."""
    storage = torch.empty((LAYERS, BLOCKS, HEADS, TOKENS, C), dtype=torch.bfloat16)
    flat = storage.view(torch.uint8).reshape(-1)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=_gen(seed)))
    return {f"model.layers.{i}.self_attn.attn": storage[i] for i in range(LAYERS)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def block_bytes(caches: dict[str, torch.Tensor], layer: int, block: int) -> bytes:
    tensor = list(caches.values())[layer]
    return bytes(tensor[block].contiguous().view(torch.uint8).reshape(-1).numpy())


class Engine:
    """One vLLM engine of one rank: its worker side, its KV cache, and the side channel
    its scheduler would serve (started first: the rank's identity carries its port)."""

    def __init__(
        self, stack: ExitStack, fabric: LoopbackFabric, name: str, role: str, seed: int
    ) -> None:
        engine = EngineRanks(stack, fabric, token=TOKEN)
        self.ranks, self.server = engine.ranks, engine.server
        config = worker_config(
            name,
            role,
            engine.port,
            total_kv_heads=HEADS,
            block_size_tokens=TOKENS,
            token=TOKEN,
            timing=TimingConfig(heartbeat_interval_s=0.2, liveness_timeout_s=2.0, lease_s=3.0),
        )
        self.caches = kv_caches(seed)
        self.worker = engine.start_rank(config, 0, self.caches)
        self.ended = StepResults()

    def step(self, plan: StepPlan | None = None) -> StepResults:
        """One engine step as vLLM runs it: the plan, each layer's forward, the end."""
        plan = plan or StepPlan(idle=True)
        self.worker.start_step(plan)
        for name, layer in self.caches.items():
            self.worker.layer_saved(plan, name, layer)
        self.worker.step_saved(plan)
        out = self.worker.transfer_results()
        self.ended.finished_recving |= out.finished_recving
        self.ended.failed_recving |= out.failed_recving
        self.ended.finished_sending |= out.finished_sending
        return out


@pytest.fixture
def engines() -> Iterator[tuple[Engine, Engine]]:
    fabric = LoopbackFabric()
    with ExitStack() as stack:
        yield (
            Engine(stack, fabric, "prefill", "sender", seed=1),
            Engine(stack, fabric, "decode", "receiver", seed=2),
        )


def run_until_ended(prefill: Engine, decode: Engine, rid_p: str, rid_d: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if rid_p in prefill.ended.finished_sending and rid_d in decode.ended.finished_recving:
            return
        prefill.step()
        decode.step()
        time.sleep(0.002)
    raise AssertionError(f"not ended: prefill {prefill.ended}, decode {decode.ended}")


def receive(prefill: Engine, tid: str, blocks: tuple[int, ...], offset: int = 0) -> StepPlan:
    return StepPlan(receives=[Receive("req-d", tid, HOST, prefill.server.port, blocks, offset)])


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_a_prefill_worker_pushes_its_blocks_into_the_decode_workers_cache(
    engines: tuple[Engine, Engine], layerwise: bool
) -> None:
    prefill, decode = engines
    # The decode worker's blocks 5, 6 take the prefill's blocks 3, 4 (offset 1 of 2-4).
    decode.step(receive(prefill, "t1", (5, 6), offset=1))
    # The decode's TP named, as kvpush proxy names it: opened at once, layer by layer.
    send = Send("req-p", "t1", (2, 3, 4), layerwise=layerwise, decode_tp_size=1)
    prefill.step(StepPlan(sends=[send]))
    run_until_ended(prefill, decode, "req-p", "req-d")
    assert decode.ended.failed_recving == set()
    for layer in range(LAYERS):
        for ours, theirs in zip((5, 6), (3, 4), strict=True):
            assert block_bytes(decode.caches, layer, ours) == block_bytes(
                prefill.caches, layer, theirs
            )
    stats = prefill.worker.take_stats()
    assert stats is not None
    assert stats.pushes == Counter({"layerwise" if layerwise else "whole": 1})
    if layerwise:  # each layer announced as the CPU forward saved it
        assert stats.announced == Counter({"save_kv_layer": LAYERS})
    received = decode.worker.take_stats()
    assert received is not None and received.bytes.get("receiver", 0) > 0


@pytest.mark.parametrize("registered_first", [True, False], ids=["decode-first", "prefill-first"])
def test_a_send_counts_whether_its_decode_had_registered_first(
    engines: tuple[Engine, Engine], registered_first: bool
) -> None:
    """Both legs at once (a router's concurrent dispatch): the decode's registration can
    reach the prefill before the prefill offers its blocks; such sends are counted."""
    prefill, decode = engines
    send = StepPlan(sends=[Send("req-p", "t3", (2, 3))])
    if not registered_first:
        prefill.step(send)
    decode.step(receive(prefill, "t3", (5, 6)))
    if registered_first:
        deadline = time.monotonic() + 20
        while _sending_state(prefill, "t3") != "registered":
            assert time.monotonic() < deadline, "the decode's registration never arrived"
            decode.step()
            time.sleep(0.002)
        prefill.step(send)
    run_until_ended(prefill, decode, "req-p", "req-d")
    assert decode.ended.failed_recving == set()
    stats = prefill.worker.take_stats()
    assert stats is not None
    assert stats.registered_first_total == (1 if registered_first else 0)


def test_a_second_request_naming_a_transfer_in_flight_is_refused_not_merged(
    engines: tuple[Engine, Engine],
) -> None:
    """Two requests under one transfer id (a router reused a request id for the same
    prompt) on each side: the second fails at once on both, without touching the
    first, which moves its blocks; no engine thread raises."""
    prefill, decode = engines
    twice = StepPlan(
        receives=[
            Receive("req-d", "t4", HOST, prefill.server.port, (5, 6), 0),
            Receive("req-d2", "t4", HOST, prefill.server.port, (1, 2), 0),
        ]
    )
    out = decode.step(twice)
    assert out.finished_recving == {"req-d2"} and out.failed_recving == {"req-d2"}
    out = prefill.step(StepPlan(sends=[Send("req-p", "t4", (2, 3)), Send("req-p2", "t4", (0, 1))]))
    assert out.finished_sending == {"req-p2"}
    run_until_ended(prefill, decode, "req-p", "req-d")
    assert decode.ended.failed_recving == {"req-d2"}
    for layer in range(LAYERS):
        for ours, theirs in zip((5, 6), (2, 3), strict=True):
            assert block_bytes(decode.caches, layer, ours) == block_bytes(
                prefill.caches, layer, theirs
            )
    refused = decode.worker.take_stats()
    assert refused is not None and len(refused.failed_at_once) == 1
    assert "in flight already for another request" in refused.failed_at_once[0]


def _sending_state(engine: Engine, tid: str) -> str | None:
    stats = engine.worker.statistics()
    assert stats is not None
    return stats.sending_transfers.get(tid)


def test_unusable_params_end_the_request_at_once_on_the_next_results(
    engines: tuple[Engine, Engine],
) -> None:
    prefill, decode = engines
    out = decode.step(receive(prefill, "", (1,)))
    assert out.finished_recving == {"req-d"} and out.failed_recving == {"req-d"}
    stats = decode.worker.take_stats()
    assert stats is not None and stats.failed_at_once == ["unusable kv_transfer_params"]


def test_a_cancelled_send_fails_the_receive_and_frees_the_prefill_blocks(
    engines: tuple[Engine, Engine],
) -> None:
    prefill, decode = engines
    decode.step(receive(prefill, "t2", (1, 2)))
    prefill.step(StepPlan(sends=[Send("req-p", "t2", (0, 1), cancel=True)]))
    run_until_ended(prefill, decode, "req-p", "req-d")
    assert decode.ended.failed_recving == {"req-d"}
