"""`kvpush.topology` against vLLM's own TP mapping, on the same shapes.

vLLM's NIXL connectors compute, on each decode rank at its handshake, which prefill
ranks it takes KV from, where each one's heads land in its block and at which offset it
reads (`compute_tp_mapping`); `tests/vllm_tp_mapping.py` prints that from the vLLM venv
(`.venv-vllm`, `make vllm-venv`) for every shape kvpush plans up to TP 16 with 1-64 KV
heads, split and MLA. Each decode rank's plan must say the same: the same source ranks
in the same order, each landing at vLLM's slot, read from vLLM's offset, and each source
written to by as many decode ranks as vLLM's producer waits for.

One deliberate difference, checked as such: where a head sits on several prefill ranks
(prefill TP above the head count, or MLA into a smaller decode), vLLM's producers that
no decode rank reads from still count one reader (`local_consumers` is 1); in kvpush's
plan such a rank has no targets at all, so it has nothing to wait for.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvpush.errors import ConfigError
from kvpush.topology import EngineShape, TransferPlan, plan_transfer
from kvpush_lab.vllm_servers import DEFAULT_VLLM_VENV, vllm_python

pytestmark = [pytest.mark.vllm_venv, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).with_name("vllm_tp_mapping.py")
MAX_TP, MAX_HEADS = 16, 64


def _holds_whole_heads(tp: int, heads: int) -> bool:
    return heads % tp == 0 or tp % heads == 0


def cases() -> list[tuple[int, int, int, bool]]:
    out: list[tuple[int, int, int, bool]] = []
    for p in range(1, MAX_TP + 1):
        for d in range(1, MAX_TP + 1):
            if max(p, d) % min(p, d):
                continue
            # MLA: vLLM counts its latent cache as one KV head.
            out.append((p, d, 1, True))
            out.extend(
                (p, d, k, False)
                for k in range(1, MAX_HEADS + 1)
                if _holds_whole_heads(p, k) and _holds_whole_heads(d, k)
            )
    return out


def vllm_answers(shapes: list[tuple[int, int, int, bool]]) -> list[dict[str, object]]:
    try:
        python = vllm_python()
    except ConfigError:
        pytest.skip(f"no vLLM venv at {DEFAULT_VLLM_VENV} (make vllm-venv builds it)")
    run = subprocess.run(
        [str(python), str(SCRIPT)],
        input=json.dumps(shapes),
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def _plan(p: int, d: int, heads: int, mla: bool) -> TransferPlan:
    return plan_transfer(
        prefill=EngineShape(p, 16),
        decode=EngineShape(d, 16),
        total_kv_heads=heads,
        replicated_kv=mla,
        bytes_per_head_per_block=64,
    )


def test_the_plan_is_vllms_tp_mapping_for_every_shape_up_to_tp16() -> None:
    shapes = cases()
    answers = vllm_answers(shapes)
    assert len(answers) == sum(d for _, d, _, _ in shapes)
    plans = {shape: _plan(*shape) for shape in shapes}
    without_readers = 0
    for vllm in answers:
        p, d, heads, mla = vllm["case"]  # type: ignore[misc]
        plan = plans[(p, d, heads, mla)]
        ours = plan.for_decode(vllm["decode_rank"])  # type: ignore[arg-type]
        where = f"prefill TP {p} -> decode TP {d}, {heads} heads, mla={mla}: {vllm}"
        assert list(ours.source_ranks) == vllm["source_ranks"], where
        assert sorted(ours.source_ranks) == vllm["all_source_ranks"], where
        assert set(ours.source_ranks) <= set(vllm["handshake_target_ranks"]), where  # type: ignore[call-overload]
        slots = vllm["rank_to_attention_slot"]
        for s in ours.sources:
            # vLLM's slot: the source's place among this rank's sources, each as wide.
            assert s.first_head_in_decode_rank == slots[str(s.prefill_rank)] * s.num_heads, where  # type: ignore[index]
            # vLLM's offset: which of the source's decode-rank-sized parts is read.
            offset = s.first_head_in_prefill_rank // ours.heads.num_heads
            assert offset == vllm["rank_offset_factor"], where
            targets = plan.for_prefill(s.prefill_rank).targets
            assert len(targets) == vllm["local_consumers"], where
        for prefill in plan.prefill_ranks:
            if not prefill.targets:
                without_readers += 1
                assert vllm["local_consumers"] == 1, where
    assert without_readers > 0  # the difference the module docstring names is exercised
