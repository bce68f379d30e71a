"""Claims through the vLLM connector's worker side (issue 39), without vLLM, over the
loopback transport: every rank its own `WorkerSide`, runtime and KV cache, each engine
one real side channel serving all its ranks, real time.

A prefill with a claim window gives up a transfer that no decode registered for nor
claimed within it; a decode claims every request it holds queued (`StepPlan.claims`),
each rank the parts it will receive from the prefill ranks it pairs with, so a living
decode keeps its transfers however long they queue, and one that died (before or after
claiming) costs the prefill its blocks for at most the window, not the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
import torch

from helpers.vllm_worker import EngineRanks, RecordingStats, step_each, worker_config
from kvpush.config import TimingConfig
from kvpush.integrations.vllm.plan import Claim, Receive, Refuse, Send, StepPlan, StepResults
from kvpush.integrations.vllm.worker import WorkerSide
from kvpush.topology import rank_heads
from kvpush.transports.loopback import LoopbackFabric

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
BLOCKS, LAYERS, HEADS, TOKENS, C = 8, 2, 4, 16, 32  # C = head_size + head_size_v
WINDOW = 4.0
# Liveness 10 s, as the other worker tests: a loaded host starves in-process threads.
TIMING = TimingConfig(
    heartbeat_interval_s=0.2,
    liveness_timeout_s=10.0,
    lease_s=3.0,
    transfer_deadline_s=60.0,
    claim_window_s=WINDOW,
)
TID = "t-claims"


class Engine:
    """One vLLM engine: its ranks' workers and caches, and the scheduler's side channel."""

    def __init__(
        self, stack: ExitStack, fabric: LoopbackFabric, name: str, role: str, tp: int, seed: int
    ) -> None:
        self.tp = tp
        engine = EngineRanks(stack, fabric)
        self.ranks, self.server = engine.ranks, engine.server
        config = worker_config(
            name,
            role,
            engine.port,
            total_kv_heads=HEADS,
            block_size_tokens=TOKENS,
            tp_size=tp,
            timing=TIMING,
        )
        generator = torch.Generator().manual_seed(seed)
        model = torch.empty((LAYERS, BLOCKS, HEADS, TOKENS, C), dtype=torch.bfloat16)
        flat = model.view(torch.uint8).reshape(-1)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=generator))
        self.model = model
        self.workers: list[WorkerSide[RecordingStats]] = []
        self.caches: list[torch.Tensor] = []
        for rank in range(tp):
            held = rank_heads(rank, tp, HEADS, False)
            cache = model.narrow(2, held.first_head, held.num_heads).clone()
            layers = {f"model.layers.{i}.self_attn.attn": cache[i] for i in range(LAYERS)}
            self.workers.append(engine.start_rank(config, rank, layers))
            self.caches.append(cache)
        self.ended = [StepResults() for _ in range(tp)]

    def step(self, plan: StepPlan | None = None) -> None:
        """One engine step on every rank (each rank gets its own copy of the plan)."""
        step_each(self.workers, self.ended, plan)

    def sent(self) -> bool:
        return all("req-p" in e.finished_sending for e in self.ended)

    def received(self) -> bool:
        return all("req-d" in e.finished_recving for e in self.ended)

    def claimed(self) -> list[int]:
        """How many parts each rank's runtime claims now."""
        counts = []
        for worker in self.workers:
            stats = worker.statistics()
            assert stats is not None
            counts.append(stats.claimed)
        return counts

    def agents(self) -> list[str]:
        return [meta.agent_name for meta in self.ranks.values()]


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


def pair(stack: ExitStack, p_tp: int, d_tp: int) -> tuple[LoopbackFabric, Engine, Engine]:
    fabric = LoopbackFabric()
    prefill = Engine(stack, fabric, "prefill", "sender", p_tp, seed=1)
    decode = Engine(stack, fabric, "decode", "receiver", d_tp, seed=2)
    return fabric, prefill, decode


SENT = (2, 3, 4)  # the prefill's blocks, into the decode's 5, 6, 7
INTO = (5, 6, 7)


def send(prefill: Engine, decode: Engine) -> StepPlan:
    return StepPlan(sends=[Send("req-p", TID, SENT, decode_tp_size=decode.tp)])


def claim(prefill: Engine, decode: Engine) -> StepPlan:
    return StepPlan(claims=[Claim(TID, HOST, prefill.server.port, prefill.tp, decode.tp)])


def receive(prefill: Engine, decode: Engine) -> StepPlan:
    return StepPlan(
        receives=[Receive("req-d", TID, HOST, prefill.server.port, INTO, 0, prefill.tp, decode.tp)]
    )


def step_both_for(prefill: Engine, decode: Engine, seconds: float) -> None:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        prefill.step()
        decode.step()
        time.sleep(0.01)


def step_until(prefill: Engine, decode: Engine, done: str, timeout: float) -> float:
    """Step both engines until `done` ("sent", "received", "both"); the seconds it took."""
    start = time.monotonic()
    while time.monotonic() < start + timeout:
        ok = {
            "sent": prefill.sent(),
            "received": decode.received(),
            "both": prefill.sent() and decode.received(),
        }[done]
        if ok:
            return time.monotonic() - start
        prefill.step()
        decode.step()
        time.sleep(0.01)
    raise AssertionError(
        f"not {done} in {timeout}s: prefill {prefill.ended}, decode {decode.ended}"
    )


def assert_every_decode_rank_holds_the_prefills_heads(prefill: Engine, decode: Engine) -> None:
    for rank, cache in enumerate(decode.caches):
        held = rank_heads(rank, decode.tp, HEADS, False)
        want = prefill.model[:, list(SENT)].narrow(2, held.first_head, held.num_heads)
        assert torch.equal(cache[:, list(INTO)].view(torch.uint8), want.view(torch.uint8))


SHAPES = [(2, 1), (1, 2)]


@pytest.mark.parametrize(("p_tp", "d_tp"), SHAPES, ids=[f"tp{p}-to-tp{d}" for p, d in SHAPES])
def test_a_decode_that_claims_its_queued_request_keeps_the_transfer_past_the_window(
    stack: ExitStack, p_tp: int, d_tp: int
) -> None:
    _fabric, prefill, decode = pair(stack, p_tp, d_tp)
    prefill.step(send(prefill, decode))
    decode.step(claim(prefill, decode))
    # Each decode rank claims the parts it will receive: one per prefill rank it pairs with.
    parts_per_rank = max(1, p_tp // d_tp)
    # Queued for most of two windows: the claims keep the prefill's transfer.
    step_both_for(prefill, decode, 1.75 * WINDOW)
    assert not any(e.finished_sending for e in prefill.ended)
    assert decode.claimed() == [parts_per_rank] * d_tp
    # Then the request gets blocks: its registration ends the claim and the KV arrives.
    decode.step(receive(prefill, decode))
    assert decode.claimed() == [0] * d_tp
    step_until(prefill, decode, "both", 20)
    assert not any(e.failed_recving for e in decode.ended)
    assert_every_decode_rank_holds_the_prefills_heads(prefill, decode)


def test_a_transfer_no_decode_claims_is_freed_a_window_after_it_was_offered(
    stack: ExitStack,
) -> None:
    """A decode that died before it got the request's leg, or one that does not claim:
    the prefill frees the blocks at the window, far under the deadline, and a late
    registration fails with nothing written."""
    _fabric, prefill, decode = pair(stack, 1, 1)
    before = decode.caches[0].clone()
    prefill.step(send(prefill, decode))
    took = step_until(prefill, decode, "sent", WINDOW + 10)
    assert WINDOW - 0.5 <= took <= WINDOW + 5, took
    decode.step(receive(prefill, decode))
    step_until(prefill, decode, "received", 20)
    assert decode.ended[0].failed_recving == {"req-d"}
    assert torch.equal(decode.caches[0].view(torch.uint8), before.view(torch.uint8))


def test_a_refused_request_ends_its_claim_and_the_prefill_frees_its_blocks_at_once(
    stack: ExitStack,
) -> None:
    _fabric, prefill, decode = pair(stack, 2, 1)
    prefill.step(send(prefill, decode))
    decode.step(claim(prefill, decode))
    step_both_for(prefill, decode, 0.5)
    assert decode.claimed() == [2]
    # The request ended before it was scheduled (aborted): the scheduler refuses it.
    refuse = Refuse(TID, HOST, prefill.server.port, "ended before it was scheduled", 2, 1)
    decode.step(StepPlan(refusals=[refuse]))
    assert decode.claimed() == [0]
    took = step_until(prefill, decode, "sent", WINDOW)
    assert took < WINDOW / 2, took


def test_an_aborted_claim_is_dropped_and_the_prefill_gives_the_transfer_up_at_the_window(
    stack: ExitStack,
) -> None:
    _fabric, prefill, decode = pair(stack, 1, 1)
    prefill.step(send(prefill, decode))
    decode.step(claim(prefill, decode))
    step_both_for(prefill, decode, 1.0)
    assert decode.claimed() == [1]
    decode.step(StepPlan(aborts=[TID]))
    assert decode.claimed() == [0]
    took = step_until(prefill, decode, "sent", WINDOW + 10)
    assert took <= WINDOW + 5, took


def test_a_decode_killed_while_claiming_costs_the_prefill_its_blocks_for_the_window_at_most(
    stack: ExitStack,
) -> None:
    """The decode's data plane vanishes as under `kill -9` while it claims a queued
    request: its claims stop, and the prefill frees the blocks within the window."""
    fabric, prefill, decode = pair(stack, 1, 1)
    prefill.step(send(prefill, decode))
    decode.step(claim(prefill, decode))
    step_both_for(prefill, decode, 1.0)
    assert decode.claimed() == [1]
    for agent in decode.agents():
        fabric.kill(agent)
    start = time.monotonic()
    while not prefill.sent():
        assert time.monotonic() - start < WINDOW + 5, prefill.ended
        prefill.step()
        time.sleep(0.01)


def test_a_send_whose_decode_tp_nobody_named_is_split_as_the_claims_say_and_kept(
    stack: ExitStack,
) -> None:
    """vLLM's push dialect: neither leg names the decode's TP. The prefill holds the
    send unsplit; the queued decode's claims name its parts (and so its TP), so the
    prefill offers it split for TP 2 and keeps it past the window until it registers."""
    _fabric, prefill, decode = pair(stack, 1, 2)
    prefill.step(StepPlan(sends=[Send("req-p", TID, SENT)]))
    decode.step(StepPlan(claims=[Claim(TID, HOST, prefill.server.port, 1, None)]))
    step_both_for(prefill, decode, 1.75 * WINDOW)
    assert not any(e.finished_sending for e in prefill.ended)
    assert decode.claimed() == [1, 1]
    held = prefill.workers[0].statistics()
    # Offered, split for the decode's TP: one part per decode rank, its blocks held.
    assert held is not None and sum(held.sending.values()) == 2, held
    assert held.blocks_held_sending == 2 * len(SENT), held
    unnamed = Receive("req-d", TID, HOST, prefill.server.port, INTO, 0, 1, None)
    decode.step(StepPlan(receives=[unnamed]))
    step_until(prefill, decode, "both", 20)
    assert not any(e.failed_recving for e in decode.ended)
    assert_every_decode_rank_holds_the_prefills_heads(prefill, decode)


def test_a_send_whose_decode_tp_nobody_named_nor_claimed_ends_at_the_window(
    stack: ExitStack,
) -> None:
    _fabric, prefill, decode = pair(stack, 1, 1)
    prefill.step(StepPlan(sends=[Send("req-p", TID, SENT)]))
    took = step_until(prefill, decode, "sent", WINDOW + 10)
    assert WINDOW - 0.5 <= took <= WINDOW + 5, took


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "stages", "groups"),
    [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (2, 4, 1, 2), (1, 1, 2, 1), (2, 1, 2, 1)],
)
def test_a_rank_claims_exactly_the_parts_its_receive_registers(
    p_tp: int, d_tp: int, stages: int, groups: int
) -> None:
    """Pipeline stages and KV-cache groups included: a claim that named other ids than
    the registration would keep nothing the registration then ends."""
    from kvpush.integrations.vllm.parts import claim_parts, receive_parts
    from kvpush.integrations.vllm.plan import GroupBlocks

    more = tuple(GroupBlocks((9,)) for _ in range(groups - 1))
    for rank in range(d_tp):
        rcv = Receive("req-d", TID, HOST, 1, INTO, 0, p_tp, d_tp, more, sender_pp_size=stages)
        registered = [(pid, p) for pid, p, _g in receive_parts(rcv, d_tp, rank)]
        claimed = claim_parts(Claim(TID, HOST, 1, p_tp, d_tp, stages), d_tp, rank, groups)
        assert claimed == registered
        assert len(claimed) == stages * groups * max(1, p_tp // d_tp)
