"""A pipeline-parallel prefill into a decode without stages, at the connector's worker
level, without vLLM, over the loopback transport: every (stage, tensor-parallel rank)
of the prefill its own `WorkerSide`, runtime and KV cache holding only its stage's
layers (named as in the whole model, as vLLM names them on each stage), all answering
on the prefill's one side channel as rank `stage * tp + rank`; the decode's ranks hold
every layer.

The model's KV is made once per engine (every byte random, per layer, block and head).
After a transfer, every decode rank's blocks must hold exactly the prefill model's
bytes of its heads, every layer of them, each written by the stage that holds it, and
nothing else may have changed; each worker reports the request once. Then what is not
carried: a stage holding a layer the decode lacks, or a layer of other bytes, is
refused by both sides' compatibility check, naming the regions, and the request fails
at once on both servers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
import torch

from helpers.vllm_worker import (
    TIMING,
    EngineRanks,
    RecordingStats,
    run_until_ended,
    step_each,
    worker_config,
)
from kvpush.config import TimingConfig
from kvpush.doctor.checks.options import DoctorOptions, Observed, Target
from kvpush.doctor.checks.step3_compatibility import check_compatibility
from kvpush.doctor.report import StepResult, Verdict
from kvpush.geometry import (
    CacheGeometry,
    KVHeads,
    PipelineStage,
    Region,
    UnsupportedShape,
    describe_compat_differences,
    write_plan,
)
from kvpush.integrations.vllm.plan import Receive, Refuse, Send, StepPlan, StepResults
from kvpush.integrations.vllm.worker import WorkerSide
from kvpush.sidechannel.client import fetch_metadata_timed
from kvpush.topology import decode_tp_named, rank_heads, stage_part_id
from kvpush.transports.loopback import LoopbackFabric

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
BLOCKS, TOKENS, C = 8, 16, 32  # C = head_size + head_size_v


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


class Engine:
    """One vLLM engine of `pp` stages of `tp` ranks: its workers, each holding its
    stage's layers (`layers[stage]`, model layer numbers) and its rank's heads."""

    def __init__(
        self,
        stack: ExitStack,
        fabric: LoopbackFabric,
        name: str,
        role: str,
        *,
        layers: list[list[int]],
        tp: int,
        heads: int,
        seed: int,
        head_size: int = C,
        timing: TimingConfig = TIMING,
    ) -> None:
        self.tp, self.pp, self.layers = tp, len(layers), layers
        engine = EngineRanks(stack, fabric)
        self.ranks, self.server = engine.ranks, engine.server
        config = worker_config(
            name,
            role,
            engine.port,
            total_kv_heads=heads,
            block_size_tokens=TOKENS,
            tp_size=tp,
            pp_size=self.pp,
            model_layers=sum(len(stage) for stage in layers),
            timing=timing,
        )
        # The whole model's KV, by model layer number: [layers, blocks, heads, tokens, C].
        count = max(i for stage in layers for i in stage) + 1
        self.model = torch.empty((count, BLOCKS, heads, TOKENS, head_size), dtype=torch.bfloat16)
        flat = self.model.view(torch.uint8).reshape(-1)
        gen = torch.Generator().manual_seed(seed)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
        self.workers: list[WorkerSide[RecordingStats]] = []  # by side-channel rank
        self.caches: list[dict[int, torch.Tensor]] = []  # by side-channel rank: layer -> cache
        for stage, stage_layers in enumerate(layers):
            for rank in range(tp):
                held = rank_heads(rank, tp, heads, False)
                caches = {
                    i: self.model[i].narrow(1, held.first_head, held.num_heads).clone()
                    for i in stage_layers
                }
                named = {layer_name(i): c for i, c in caches.items()}
                before = set(self.ranks)
                worker = engine.start_rank(config, rank, named, stage=stage)
                assert set(self.ranks) - before == {stage * tp + rank}  # its metadata's rank
                self.workers.append(worker)
                self.caches.append(caches)
        self.ended = [StepResults() for _ in self.workers]
        # How often each worker reported each request: exactly once is the contract.
        self.reports: list[dict[str, int]] = [{} for _ in self.workers]

    def step(self, plan: StepPlan | None = None) -> None:
        """One engine step on every worker, all stages given the same plan (as vLLM
        hands every worker the scheduler's connector metadata)."""
        for i, out in enumerate(step_each(self.workers, self.ended, plan)):
            for rid in out.finished_recving | out.finished_sending:
                self.reports[i][rid] = self.reports[i].get(rid, 0) + 1

    def parts_ended(self) -> list[str]:
        """Every part that ended on any worker since the last call."""
        stats = [w.take_stats() for w in self.workers]
        return [pid for s in stats if s is not None for pid in s.parts_ended]


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


SHAPES = [
    # (prefill PP, prefill TP, decode TP, KV heads, model layers)
    (2, 1, 1, 2, 4),  # two stages of two layers each into one decode rank
    (2, 2, 1, 4, 4),  # every (stage, TP rank) a part of its own into the decode rank
    (2, 1, 2, 4, 4),  # each stage writes one head into each decode rank
    (3, 1, 1, 2, 5),  # uneven stages: 2, 2 and 1 layers, as vLLM splits 5 into 3
]


def stage_layers(pp: int, count: int) -> list[list[int]]:
    """The layers of each stage, contiguous, the first ones one larger where they do
    not divide (vLLM's `get_pp_indices` may cut otherwise: only contiguity matters)."""
    sizes = [count // pp + (s < count % pp) for s in range(pp)]
    starts = [sum(sizes[:s]) for s in range(pp)]
    return [list(range(start, start + size)) for start, size in zip(starts, sizes, strict=True)]


@pytest.mark.parametrize(
    ("pp", "p_tp", "d_tp", "heads", "count"),
    SHAPES,
    ids=[f"pp{pp}-tp{p}-to-tp{d}-{n}layers" for pp, p, d, _, n in SHAPES],
)
@pytest.mark.parametrize("named", [True, False], ids=["tp-named", "tp-learned"])
def test_each_stage_writes_its_own_layers_and_the_decode_holds_the_whole_models_bytes(
    stack: ExitStack, pp: int, p_tp: int, d_tp: int, heads: int, count: int, named: bool
) -> None:
    """Every stage pushes its own layers of the request's blocks into the decode's
    layers of the same names; the decode registers for every stage's parts (the
    prefill's `pp_size` in its params) and reports the request once all ended.
    `named`: the prefill is told the decode's TP (kvpush proxy), else it learns it from
    the registrations (vLLM's push dialect), per stage."""
    fabric = LoopbackFabric()
    prefill = Engine(
        stack,
        fabric,
        "prefill",
        "sender",
        layers=stage_layers(pp, count),
        tp=p_tp,
        heads=heads,
        seed=1,
    )
    decode = Engine(
        stack,
        fabric,
        "decode",
        "receiver",
        layers=[list(range(count))],
        tp=d_tp,
        heads=heads,
        seed=2,
    )
    before = [decode.caches[r][i].clone() for r in range(d_tp) for i in range(count)]
    ours, theirs = (5, 6, 7), (1, 2, 3)
    split = d_tp if named else None
    receive = Receive(
        "req-d", "t1", HOST, prefill.server.port, ours, 0, p_tp, split, sender_pp_size=pp
    )
    decode.step(StepPlan(receives=[receive]))
    prefill.step(StepPlan(sends=[Send("req-p", "t1", theirs, decode_tp_size=split)]))
    run_until_ended(prefill, decode)
    for rank in range(d_tp):
        assert decode.ended[rank].failed_recving == set(), f"decode rank {rank} failed"
        held = rank_heads(rank, d_tp, heads, False)
        for i in range(count):
            cache = decode.caches[rank][i]
            want = before[rank * count + i].clone()
            want[list(ours)] = prefill.model[i, list(theirs), held.first_head : held.stop]
            assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8)), (
                f"decode rank {rank} layer {i}: not the prefill's blocks of its heads in "
                "blocks 5, 6, 7 (or a block outside the request changed)"
            )
    for engine, rid in ((prefill, "req-p"), (decode, "req-d")):
        for w, reports in enumerate(engine.reports):
            assert reports == {rid: 1}, f"worker {w} reported {reports}: expected once"
    # Every (stage, rank pair) was a part of its own, ended on the decode.
    ended = sorted(decode.parts_ended())
    assert len(ended) == pp * max(p_tp, d_tp), ended
    assert {pid.rsplit("|pp", 1)[1] for pid in ended} == {f"{s}/{pp}" for s in range(pp)}


def test_a_stage_holding_a_layer_the_decode_lacks_is_refused_naming_the_regions(
    stack: ExitStack, caplog: pytest.LogCaptureFixture
) -> None:
    """A prefill of four layers in two stages, a decode of three (another model):
    stage 1's `model.layers.3` is none of the decode's, and the stages hold four layers
    together against the decode's three. The decode's handshake with each stage refuses
    it (stage 1 naming that region too, stage 0 the counts: its own layers are the
    decode's, but a model of another size is not one it may write into), and the
    request fails at once, reported once. Neither stage heard of a decode (each was
    refused before any registration), so each send ends as any send no decode speaks
    for: at the transfer deadline (3 s here), its blocks freed, reported once."""
    fabric = LoopbackFabric()
    timing = TimingConfig(
        heartbeat_interval_s=0.2, liveness_timeout_s=10.0, lease_s=3.0, transfer_deadline_s=3.0
    )
    prefill = Engine(
        stack,
        fabric,
        "prefill",
        "sender",
        layers=[[0, 1], [2, 3]],
        tp=1,
        heads=2,
        seed=1,
        timing=timing,
    )
    decode = Engine(stack, fabric, "decode", "receiver", layers=[[0, 1, 2]], tp=1, heads=2, seed=2)
    receive = Receive("req-d", "t2", HOST, prefill.server.port, (5, 6), 0, 1, 1, sender_pp_size=2)
    decode.step(StepPlan(receives=[receive]))
    prefill.step(StepPlan(sends=[Send("req-p", "t2", (1, 2), decode_tp_size=1)]))
    run_until_ended(prefill, decode, seconds=20)
    assert decode.ended[0].failed_recving == {"req-d"}
    said = "model.layers.3.self_attn.attn.kv (none of that name)"
    assert said in caplog.text, caplog.text
    assert "the whole model's 3 regions against the stages' 4 together" in caplog.text
    assert "rank 1: compatibility hash differs" in caplog.text
    assert "regions: theirs are pipeline stage 1 of 2's" in caplog.text
    for engine, rid in ((prefill, "req-p"), (decode, "req-d")):
        for w, reports in enumerate(engine.reports):
            assert reports == {rid: 1}, f"worker {w} reported {reports}: expected once"


def geometry(
    names: list[str], unit: int, *, stage: PipelineStage | None = None, tp_rank: int = 0
) -> CacheGeometry:
    heads = KVHeads(total=2, per_rank=2, tp_size=1, tp_rank=tp_rank)
    block = unit * 2 * TOKENS
    regions = tuple(
        Region(
            n,
            i,
            base_addr=4096 * (i + 1) * 1000,
            block_bytes=block,
            block_stride=block,
            num_blocks=BLOCKS,
        )
        for i, n in enumerate(names)
    )
    return CacheGeometry("vllm_packed/BHNC", TOKENS, "bfloat16", regions, heads=heads, stage=stage)


def test_a_stage_is_compatible_only_as_a_name_matched_subset_with_equal_geometry() -> None:
    """The compatibility rule, both ways round (a decode checks the stage, the stage the
    decode): a stage's regions, each one of the whole model's by name with equal bytes
    per head per token, are no difference; a missing name or other bytes are, naming
    the region and both sides. A write's views pair the regions by name."""
    whole = geometry([layer_name(i) for i in range(4)], 64)
    stage = geometry([layer_name(2), layer_name(3)], 64, stage=PipelineStage(2, 1, 4))
    assert describe_compat_differences(stage.compat_fields(), whole.compat_fields()) == []
    assert describe_compat_differences(whole.compat_fields(), stage.compat_fields()) == []
    # The stage's writes read its regions and land in the whole model's of their names.
    plan = write_plan(stage, whole)
    assert [r.name for r in plan.theirs.regions] == [layer_name(2), layer_name(3)]
    assert [r.base_addr for r in plan.theirs.regions] == [r.base_addr for r in whole.regions[2:]]
    assert plan.ours.regions == stage.regions
    back = write_plan(whole, stage)
    assert [r.name for r in back.ours.regions] == [layer_name(2), layer_name(3)]

    other = geometry([layer_name(3), layer_name(4)], 64, stage=PipelineStage(2, 1, 4))
    [said] = describe_compat_differences(other.compat_fields(), whole.compat_fields())
    assert said == (
        "regions: theirs are pipeline stage 1 of 2's, which must each be one "
        "of ours (a whole model's 4 regions) by name, with equal bytes; not carried: "
        "model.layers.4.self_attn.attn (none of that name)"
    )
    wider = geometry([layer_name(0), layer_name(1)], 128, stage=PipelineStage(2, 0, 4))
    [said] = describe_compat_differences(whole.compat_fields(), wider.compat_fields())
    assert said.startswith("regions: ours are pipeline stage 0 of 2's")
    assert said.endswith(
        "not carried: model.layers.0.self_attn.attn (128 bytes per unit, theirs 64), "
        "model.layers.1.self_attn.attn (128 bytes per unit, theirs 64)"
    )
    # A whole model with a layer no stage holds (the stages hold 4 together): that
    # layer would never be written, so the pair is refused, naming both counts.
    longer = geometry([layer_name(i) for i in range(5)], 64)
    [said] = describe_compat_differences(stage.compat_fields(), longer.compat_fields())
    assert said.endswith(
        "not carried: the whole model's 5 regions against the stages' 4 together (a layer "
        "no stage holds would never be written)"
    ), said
    with pytest.raises(UnsupportedShape, match="5 regions against the stages' 4"):
        write_plan(stage, longer)
    # Two stages are compared as ever: every field equal.
    first = geometry([layer_name(0), layer_name(1)], 64, stage=PipelineStage(2, 0, 4))
    assert describe_compat_differences(first.compat_fields(), stage.compat_fields()) != []
    # An engine without stages keeps its hash: nothing new in its fields.
    assert "pipeline" not in whole.compat_fields()


def test_stage_part_ids_say_the_decode_tp_as_before() -> None:
    """A stage's part id is its rank pair's part with the stage after it; a prefill
    reads the decode's TP from it as from a part without stages."""
    assert stage_part_id("t", 0, 1) == "t"
    assert stage_part_id("t#0>0/2", 1, 2) == "t#0>0/2|pp1/2"
    assert decode_tp_named("t#1>0/2|pp1/2@g1", "t", 4) == 2
    assert decode_tp_named("t|pp1/2", "t", 4) == 4
    assert decode_tp_named("t|pp1/2@g2", "t", 4) == 4
    assert decode_tp_named("u|pp1/2", "t", 4) is None


def test_the_decode_leg_names_the_prefills_stages_or_none() -> None:
    """The decode learns how many stages send (one part each) from its leg's params:
    vLLM's prefill answer carries `pp_size` (kvpush's too); none means 1; a value that
    is no size is refused naming the field."""
    from kvpush.transfer_params import BadTransferParams, parse_remote_prefill

    params = {"transfer_id": "t", "remote_host": HOST, "remote_port": 5600}
    assert parse_remote_prefill({**params, "pp_size": 2}).pp_size == 2
    assert parse_remote_prefill(params).pp_size is None
    with pytest.raises(BadTransferParams, match=r"kv_transfer_params\.pp_size must be"):
        parse_remote_prefill({**params, "pp_size": 0})


def test_a_decode_not_told_of_the_stages_is_refused_at_once_and_takes_nothing(
    stack: ExitStack, caplog: pytest.LogCaptureFixture
) -> None:
    """A decode leg whose params lost the prefill's `pp_size` (a router that rewrites
    them) registers the parts of a prefill without stages, ids no stage sends, with
    stage 0's rank. Stage 0 refuses that registration at once, saying why, and ends its
    send: the decode's request fails long before its transfer deadline (60 s), nothing
    written, never finishing with one stage's layers. Stage 1 heard from no decode: its
    send ends at its transfer deadline (6 s here), blocks freed. Every worker reports
    once."""
    fabric = LoopbackFabric()
    timing = TimingConfig(
        heartbeat_interval_s=0.2, liveness_timeout_s=10.0, lease_s=3.0, transfer_deadline_s=6.0
    )
    prefill = Engine(
        stack, fabric, "prefill", "sender", layers=[[0], [1]], tp=1, heads=2, seed=1, timing=timing
    )
    decode = Engine(stack, fabric, "decode", "receiver", layers=[[0, 1]], tp=1, heads=2, seed=2)
    before = {i: c.clone() for i, c in decode.caches[0].items()}
    started = time.monotonic()
    decode.step(StepPlan(receives=[Receive("req-d", "t3", HOST, prefill.server.port, (5,), 0)]))
    prefill.step(StepPlan(sends=[Send("req-p", "t3", (1,), decode_tp_size=1)]))
    while "req-d" not in decode.ended[0].finished_recving:
        assert time.monotonic() - started < 5, "the decode's request was not refused at once"
        prefill.step()
        decode.step()
        time.sleep(0.002)
    assert decode.ended[0].failed_recving == {"req-d"}
    assert "req-p" in prefill.ended[0].finished_sending, "stage 0 did not end its send"
    run_until_ended(prefill, decode, seconds=20)
    for i, cache in decode.caches[0].items():
        assert torch.equal(cache.view(torch.uint8), before[i].view(torch.uint8)), i
    assert (
        "the decode registered t3, a part of a prefill without pipeline stages, but this "
        "prefill runs pipeline_parallel_size 2"
    ) in caplog.text
    for engine, rid in ((prefill, "req-p"), (decode, "req-d")):
        for w, reports in enumerate(engine.reports):
            assert reports == {rid: 1}, f"worker {w} reported {reports}: expected once"


def test_a_decodes_refusal_reaches_every_stage_which_frees_its_blocks_at_once(
    stack: ExitStack,
) -> None:
    """A decode that will not take a transfer (its prefix cache held the whole prompt)
    refuses every stage's parts, each with that stage's rank: each stage ends its send
    at once, long before the transfer deadline (60 s), and reports it once."""
    fabric = LoopbackFabric()
    prefill = Engine(stack, fabric, "prefill", "sender", layers=[[0], [1]], tp=1, heads=2, seed=1)
    decode = Engine(stack, fabric, "decode", "receiver", layers=[[0, 1]], tp=1, heads=2, seed=2)
    prefill.step(StepPlan(sends=[Send("req-p", "t4", (1, 2), decode_tp_size=1)]))
    started = time.monotonic()
    refuse = Refuse("t4", HOST, prefill.server.port, "every block cached", 1, 1, 2)
    decode.step(StepPlan(refusals=[refuse]))
    while not all("req-p" in e.finished_sending for e in prefill.ended):
        assert time.monotonic() - started < 20, f"a stage was not told: {prefill.ended}"
        prefill.step()
        decode.step()
        time.sleep(0.002)
    for w, reports in enumerate(prefill.reports):
        assert reports == {"req-p": 1}, f"stage {w} reported {reports}: expected once"


def _doctor_step3(prefill: Engine, decode: Engine) -> StepResult:
    """`kvpush doctor`'s compatibility step on the two engines' side channels, every rank
    each serves read as the doctor reads it (`fetch_metadata_timed`)."""
    seen = Observed()
    for role, engine in (("prefill", prefill), ("decode", decode)):
        seen.ranks[role] = [
            fetch_metadata_timed(HOST, engine.server.port, rank) for rank in sorted(engine.ranks)
        ]
    step = StepResult(3, "compatibility")
    options = DoctorOptions(
        Target("prefill", HOST, prefill.server.port), Target("decode", HOST, decode.server.port)
    )
    check_compatibility(options, seen, step)
    return step


def test_the_doctor_pairs_each_stage_with_the_decode(stack: ExitStack) -> None:
    """`kvpush doctor` reads a prefill of two stages as what it is: each stage's rank with
    the decode's, compatible where the decode holds the stage's layers; a decode of
    another model (a layer no stage holds) fails for each stage, naming it."""
    fabric = LoopbackFabric()
    prefill = Engine(stack, fabric, "p", "sender", layers=[[0, 1], [2, 3]], tp=1, heads=2, seed=1)
    decode = Engine(stack, fabric, "d", "receiver", layers=[[0, 1, 2, 3]], tp=1, heads=2, seed=2)
    step = _doctor_step3(prefill, decode)
    assert step.verdict is Verdict.OK, [f.text for f in step.findings]
    said = [f.text for f in step.findings]
    assert said[0].startswith("prefill rank 0 -> decode rank 0 (pipeline stage 0 of 2): compatible")
    assert said[1].startswith("prefill rank 1 -> decode rank 0 (pipeline stage 1 of 2): compatible")

    other = Engine(stack, fabric, "o", "receiver", layers=[[0, 1, 2]], tp=1, heads=2, seed=3)
    step = _doctor_step3(prefill, other)
    assert step.verdict is Verdict.FAIL
    failed = [f.text for f in step.findings if f.verdict is Verdict.FAIL]
    assert any(
        t.startswith("prefill rank 1 -> decode rank 0 (pipeline stage 1 of 2): regions: ")
        and "model.layers.3.self_attn.attn" in t
        and "the whole model's 3 regions against the stages' 4 together" in t
        for t in failed
    ), failed
    assert any(
        t.startswith("prefill rank 0 -> decode rank 0 (pipeline stage 0 of 2)") for t in failed
    )
