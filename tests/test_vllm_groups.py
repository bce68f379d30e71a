"""What `KvpushConnector` makes of vLLM's KV-cache groups at start-up, on vLLM's own
spec types (run in the vLLM venv, `.venv-vllm`, without starting a server): a one-group
model as ever, a hybrid of full-attention and sliding-window groups as groups, a Mamba
group as a state whose tensors peers must have alike, and anything it cannot carry
(speculative state blocks, a group of another block size) refused with a message that
names the groups. Also on vLLM's own `Request`: a Mamba model's prefill request drops
its prompt's last token once, and its decode request loads one token less."""

from __future__ import annotations

import json
import subprocess

import pytest

from kvpush.errors import ConfigError
from kvpush_lab.vllm_servers import DEFAULT_VLLM_VENV, vllm_python

pytestmark = [pytest.mark.vllm_venv, pytest.mark.timeout(300)]

SCRIPT = r"""
import json
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec,
)
from kvpush.config import TimingConfig
from kvpush.errors import ConfigError
from kvpush.integrations.vllm.connector import kv_cache_groups, state_layers
import dataclasses
from kvpush.integrations.vllm.params import ConnectorConfig

config = ConnectorConfig(
    engine_id="e", role="both", side_channel_host="127.0.0.1", side_channel_port=1,
    token=None, timing=TimingConfig(), tp_size=1, total_kv_heads=2, use_mla=False,
    pp_size=1, dcp_size=1, block_size_tokens=32,
)
attn = dict(num_kv_heads=2, head_size=32, dtype=torch.float32)
full = FullAttentionSpec(block_size=32, **attn)
window = SlidingWindowSpec(block_size=32, sliding_window=48, **attn)
state = dict(shapes=((3, 288), (8, 32, 16)), dtypes=(torch.bfloat16, torch.float32))
mamba = MambaSpec(block_size=1024, **state)
cases = {
    "full": [full],
    "window": [window],
    "hybrid": [window, full],
    "mamba": [mamba, full],
    "mamba-only": [mamba],
    "speculative": [MambaSpec(block_size=1024, num_speculative_blocks=2, **state), full],
    "block-size": [window, FullAttentionSpec(block_size=64, **attn)],
}
out = {}
for name, specs in cases.items():
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    try:
        got = kv_cache_groups(KVCacheConfig(8, [], groups), config)
        out[name] = [[g.kind, g.block_size_tokens, g.sliding_window, g.state] for g in got]
    except ConfigError as exc:
        out[name] = str(exc)
groups = [KVCacheGroupSpec(["m.0", "m.2"], mamba), KVCacheGroupSpec(["a.1", "a.3"], full)]
out["state_layers"] = sorted(state_layers(KVCacheConfig(8, [], groups)))

# The scheduler's backoff, on vLLM's own requests (prefill: truncated when vLLM adds it).
from vllm import SamplingParams
from vllm.v1.request import Request
from kvpush.integrations.vllm.scheduler import SchedulerSide

hybrid = kv_cache_groups(KVCacheConfig(8, [], groups), config)

def request(rid, prompt, params):
    sampling = SamplingParams(max_tokens=5, extra_args={"kv_transfer_params": params})
    return Request(rid, list(prompt), sampling, None)

prefill = SchedulerSide(dataclasses.replace(config, role="sender"), hybrid)
req = request("p", range(10), {"do_remote_decode": True})
prefill.on_new_request(req)
prefill.on_new_request(req)  # vLLM adds a preempted request again: not twice
one = request("p1", [7], {"do_remote_decode": True})
prefill.on_new_request(one)
plain = SchedulerSide(dataclasses.replace(config, role="sender"), ())
other = request("q", range(10), {"do_remote_decode": True})
plain.on_new_request(other)
out["prefill"] = {
    "mamba": [req.prompt_token_ids, list(req.all_token_ids), req.num_prompt_tokens, req.max_tokens],
    "one token": [one.prompt_token_ids, one.num_prompt_tokens, one.max_tokens],
    "attention only": [other.prompt_token_ids, other.num_prompt_tokens, other.max_tokens],
}
decode = SchedulerSide(dataclasses.replace(config, role="receiver"), hybrid)
wants = {"do_remote_prefill": True}
out["decode"] = {
    "no hit": list(decode.get_num_new_matched_tokens(request("d", range(10), wants), 0)),
    "a hit of 4": list(decode.get_num_new_matched_tokens(request("e", range(10), wants), 4)),
    "a hit of 9": list(decode.get_num_new_matched_tokens(request("f", range(10), wants), 9)),
    "one token": list(decode.get_num_new_matched_tokens(request("g", [7], wants), 0)),
}
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
    assert answers["window"] == [["sliding_window", 32, 48, None]]
    assert answers["hybrid"] == [
        ["sliding_window", 32, 48, None],
        ["full_attention", 32, None, None],
    ]


STATE = "mamba2 (3, 288) bfloat16, (8, 32, 16) float32 per rank of TP 1"


def test_a_mamba_group_is_carried_with_its_state_tensors(answers: dict[str, object]) -> None:
    """A Mamba group's block size is vLLM's for states (not the engine's); its state's
    shapes (as vLLM orients them) and dtypes at this TP size are what peers compare.
    A model of Mamba layers alone is a group too, never one attention group."""
    assert answers["mamba"] == [
        ["mamba", 1024, None, STATE],
        ["full_attention", 32, None, None],
    ]
    assert answers["mamba-only"] == [["mamba", 1024, None, STATE]]
    assert answers["state_layers"] == ["m.0", "m.2"]


def test_groups_it_cannot_carry_are_refused_naming_them(answers: dict[str, object]) -> None:
    carries = (
        "it carries full-attention and sliding-window groups of the engine's block size and "
        "Mamba groups without speculative blocks"
    )
    assert answers["speculative"] == (
        "KvpushConnector cannot carry this model's 2 KV-cache groups: group 0 (Mamba) keeps 2 "
        f"speculative state blocks per request (speculative decoding), expected none; {carries} "
        "(carried here: full attention)"
    )
    assert answers["block-size"] == (
        "KvpushConnector cannot carry this model's 2 KV-cache groups: group 1 has 64-token "
        f"blocks, the engine 32; {carries} (carried here: sliding window of 48 tokens, full "
        "attention)"
    )


def test_a_mamba_prefill_leaves_the_last_prompt_token_to_the_decode(
    answers: dict[str, object],
) -> None:
    """The prefill drops its prompt's last token (from the prompt, the token list and
    the count; max_tokens 1) once, however often vLLM adds the request; a one-token
    prompt and a model without a state are left as they are. The decode asks for all
    but the last prompt token, less its own prefix hit, and for none when its hit covers
    them or the prompt is one token (it computes that itself)."""
    assert answers["prefill"] == {
        "mamba": [list(range(9)), list(range(9)), 9, 1],
        "one token": [[7], 1, 5],
        "attention only": [list(range(10)), 10, 5],
    }
    assert answers["decode"] == {
        "no hit": [9, True],
        "a hit of 4": [5, True],
        "a hit of 9": [0, False],
        "one token": [0, False],
    }
