"""Which decode requests the connector's scheduler half claims (issue 39), on vLLM's own
`Request`, `KVCacheBlocks` and `SchedulerOutput` (run in the vLLM venv, no server); and
the prefill's claim window as `kv_connector_extra_config` sets it.

A decode request is claimed from the moment vLLM adds it (`on_new_request`) until it has
blocks: named as its `Receive` will be (its transfer id, or the push dialect's pairing
id; the prefill's TP and the decode TP the transfer was split for). A request that gets
blocks, or is refused, on the step it arrived is not claimed (its Register or Reject
speaks for it); params that cannot be read claim nothing; none is claimed twice.
"""

from __future__ import annotations

from typing import Any

import pytest

from helpers.vllm_venv import run_in_vllm_venv

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

SCRIPT = r"""
import json
from types import SimpleNamespace
from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request, RequestStatus
from kvpush.config import TimingConfig
from kvpush.errors import ConfigError
from kvpush.integrations.vllm.params import ConnectorConfig
from kvpush.integrations.vllm.scheduler import SchedulerSide

config = ConnectorConfig(
    engine_id="d", role="receiver", side_channel_host="127.0.0.1", side_channel_port=1,
    token=None, timing=TimingConfig(), tp_size=1, total_kv_heads=2, use_mla=False,
    pp_size=1, dcp_size=1, block_size_tokens=32,
)

def request(rid, params, num_tokens=100):
    sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params})
    return Request(rid, list(range(num_tokens)), sampling, None)

def kvpush_params(rid):
    return {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5600,
            "tp_size": 2, "decode_tp_size": 1, "transfer_id": f"t-{rid}"}

def step(side):
    p = side.build_connector_meta(SchedulerOutput.make_empty())
    return {
        "claims": [[c.transfer_id, c.host, c.port, c.sender_tp_size, c.split_for_tp]
                   for c in p.claims],
        "receives": [r.transfer_id for r in p.receives],
        "refusals": [r.transfer_id for r in p.refusals],
    }

def blocks(n):
    return KVCacheBlocks((tuple(KVCacheBlock(i) for i in range(n)),))

out = {}
side = SchedulerSide(config)
queued = request("queued-abc12345", kvpush_params("queued"))
side.on_new_request(queued)
out["pending before the step"] = side.has_pending_push_work()
out["queued"] = step(side)
side.on_new_request(queued)  # vLLM adds it again (preempted): not claimed twice
out["again"] = step(side)
asked = side.get_num_new_matched_tokens(queued, 0)
side.update_state_after_alloc(queued, blocks(4), asked[0])
out["allocated later"] = step(side)

# Added and given blocks on one step: the Receive registers, no claim goes out.
at_once = request("at-once", kvpush_params("at-once"))
side.on_new_request(at_once)
side.update_state_after_alloc(at_once, blocks(4), side.get_num_new_matched_tokens(at_once, 0)[0])
out["at once"] = step(side)

# Claimed, then aborted before it was scheduled: the refusal ends the claim.
dropped = request("dropped", kvpush_params("dropped"))
side.on_new_request(dropped)
out["dropped claimed"] = step(side)
dropped.status = RequestStatus.FINISHED_ABORTED
out["dropped finished"] = list(side.request_finished(dropped, ([],)))
out["dropped"] = step(side)

# vLLM's push dialect: no transfer_id, the pairing id names it; no decode TP.
dialect = {"do_remote_prefill": True, "remote_host": "10.0.0.9", "remote_port": 5601,
           "remote_engine_id": "p", "tp_size": 1}
routed = request("cmpl-client-id-0-1234abcd", dialect, num_tokens=8)
side.on_new_request(routed)
out["dialect"] = step(side)

# Params that cannot be read: nothing claimed (the request fails once it has blocks).
bad = request("bad", {"do_remote_prefill": True, "remote_port": 5600, "transfer_id": "t-bad"})
side.on_new_request(bad)
out["bad"] = step(side)

def window(extra):
    kv = SimpleNamespace(kv_role="kv_producer", engine_id="p", kv_connector_extra_config=extra)
    vllm_config = SimpleNamespace(
        kv_transfer_config=kv,
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
        model_config=SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: 2),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        scheduler_config=SimpleNamespace(async_scheduling=False),
    )
    try:
        return ConnectorConfig.from_vllm(vllm_config).timing.claim_window_s
    except ConfigError as exc:
        return f"ConfigError: {exc}"

out["window"] = {
    "default": window({}),
    "set": window({"claim_window_s": 4}),
    "null": window({"claim_window_s": None}),
    "bad": window({"claim_window_s": "soon"}),
    "below heartbeat": window({"claim_window_s": 0.1}),
}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def answers() -> dict[str, Any]:
    answer: dict[str, Any] = run_in_vllm_venv(SCRIPT)
    return answer


def test_a_queued_decode_request_is_claimed_once_until_it_has_blocks(
    answers: dict[str, Any],
) -> None:
    assert answers["pending before the step"] is True
    assert answers["queued"] == {
        "claims": [["t-queued", "127.0.0.1", 5600, 2, 1]],
        "receives": [],
        "refusals": [],
    }
    assert answers["again"]["claims"] == []
    assert answers["allocated later"] == {"claims": [], "receives": ["t-queued"], "refusals": []}


def test_a_request_given_blocks_or_refused_on_its_first_step_is_not_claimed(
    answers: dict[str, Any],
) -> None:
    assert answers["at once"] == {"claims": [], "receives": ["t-at-once"], "refusals": []}
    assert answers["dropped claimed"]["claims"] == [["t-dropped", "127.0.0.1", 5600, 2, 1]]
    assert answers["dropped finished"] == [False, None]
    assert answers["dropped"] == {"claims": [], "receives": [], "refusals": ["t-dropped"]}


def test_the_push_dialect_is_claimed_by_its_pairing_id_and_bad_params_not_at_all(
    answers: dict[str, Any],
) -> None:
    [[tid, host, port, sender_tp, split_for]] = answers["dialect"]["claims"]
    # The client's id without vLLM's suffix, then the digest of what the KV is made of.
    assert tid.startswith("cmpl-client-id-0@") and len(tid.split("@")[1]) == 32
    assert (host, port, sender_tp, split_for) == ("10.0.0.9", 5601, 1, None)
    assert answers["bad"]["claims"] == []


def test_the_prefills_claim_window_is_30_s_unless_set_and_null_turns_it_off(
    answers: dict[str, Any],
) -> None:
    got = answers["window"]
    assert got["default"] == 30.0
    assert got["set"] == 4.0
    assert got["null"] is None
    assert got["bad"] == (
        "ConfigError: kv_connector_extra_config.claim_window_s is 'soon': expected a "
        "number of seconds"
    )
    assert got["below heartbeat"].startswith("ConfigError: claim_window_s (0.1) must be above")
