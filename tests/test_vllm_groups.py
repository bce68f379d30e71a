"""What `KvpushConnector` makes of vLLM's KV-cache groups at start-up, on vLLM's own
spec types (run in the vLLM venv, `.venv-vllm`, without starting a server): a one-group
model as ever, a hybrid of full-attention and sliding-window groups as groups, and
anything it cannot carry (a Mamba state group, a group of another block size) refused
with a message that names the groups."""

from __future__ import annotations

import json
import subprocess

import pytest

from kvpush.errors import ConfigError
from kvpush.lab.vllm_servers import DEFAULT_VLLM_VENV, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

SCRIPT = r"""
import json
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec,
)
from kvpush.config import TimingConfig
from kvpush.errors import ConfigError
from kvpush.integrations.vllm.connector import kv_cache_groups
from kvpush.integrations.vllm.params import ConnectorConfig

config = ConnectorConfig(
    engine_id="e", role="both", side_channel_host="127.0.0.1", side_channel_port=1,
    token=None, timing=TimingConfig(), tp_size=1, total_kv_heads=2, use_mla=False,
    pp_size=1, dcp_size=1, block_size_tokens=32,
)
attn = dict(num_kv_heads=2, head_size=32, dtype=torch.float32)
full = FullAttentionSpec(block_size=32, **attn)
window = SlidingWindowSpec(block_size=32, sliding_window=48, **attn)
mamba = MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,))
cases = {
    "full": [full],
    "window": [window],
    "hybrid": [window, full],
    "mamba": [full, mamba],
    "block-size": [window, FullAttentionSpec(block_size=64, **attn)],
}
out = {}
for name, specs in cases.items():
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    try:
        got = kv_cache_groups(KVCacheConfig(8, [], groups), config)
        out[name] = [[g.kind, g.block_size_tokens, g.sliding_window] for g in got]
    except ConfigError as exc:
        out[name] = str(exc)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def answers() -> dict[str, object]:
    try:
        python = vllm_python()
    except ConfigError:
        pytest.skip(f"no vLLM venv at {DEFAULT_VLLM_VENV} (make vllm-venv builds it)")
    run = subprocess.run(
        [str(python), "-c", SCRIPT], capture_output=True, text=True, timeout=240, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    answer: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    return answer


def test_a_one_group_model_has_no_groups_to_carry(answers: dict[str, object]) -> None:
    """One full-attention group: every block of a request moves, as before groups."""
    assert answers["full"] == []


def test_sliding_window_groups_are_carried_as_such(answers: dict[str, object]) -> None:
    assert answers["window"] == [["sliding_window", 32, 48]]
    assert answers["hybrid"] == [["sliding_window", 32, 48], ["full_attention", 32, None]]


def test_groups_it_cannot_carry_are_refused_naming_them(answers: dict[str, object]) -> None:
    assert answers["mamba"] == (
        "KvpushConnector cannot carry this model's 2 KV-cache groups: group 1 is MambaSpec; "
        "it carries full-attention and sliding-window groups of the engine's block size "
        "(Mamba and other state groups are not supported yet; carried here: full attention)"
    )
    assert answers["block-size"] == (
        "KvpushConnector cannot carry this model's 2 KV-cache groups: group 1 has 64-token "
        "blocks, the engine 32; it carries full-attention and sliding-window groups of the "
        "engine's block size (Mamba and other state groups are not supported yet; carried "
        "here: sliding window of 48 tokens, full attention)"
    )
