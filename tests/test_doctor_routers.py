"""`kvpush doctor`'s verdict on the routers a compatible pair works behind (issue 35):
one block size works behind every router; blocks of other sizes, which vLLM's push
dialect cannot name, fail every request there, and the doctor says so with the fix."""

from __future__ import annotations

import msgspec

from kvpush.bench.presets import synthetic_kv_cache
from kvpush.doctor.report import Verdict
from kvpush.doctor.routers import behind_routers

GEOMETRY = synthetic_kv_cache(preset="tiny", num_blocks=4, fill=None).geometry


def test_one_block_size_works_behind_every_router() -> None:
    verdict = behind_routers(GEOMETRY, GEOMETRY)
    assert verdict.verdict is Verdict.OK and verdict.next_action is None
    assert "vllm-router" in verdict.text and "nothing kvpush-specific" in verdict.text


def test_decode_blocks_of_another_size_fail_behind_routers_naming_both_and_the_fix() -> None:
    larger = msgspec.structs.replace(GEOMETRY, block_size_tokens=2 * GEOMETRY.block_size_tokens)
    verdict = behind_routers(GEOMETRY, larger)
    assert verdict.verdict is Verdict.WARN
    p, d = GEOMETRY.block_size_tokens, larger.block_size_tokens
    assert f"its own {d}-token blocks" in verdict.text
    assert f"count in its {p}-token blocks" in verdict.text
    assert (
        verdict.next_action == "give both servers one --block-size, or route through kvpush proxy"
    )
