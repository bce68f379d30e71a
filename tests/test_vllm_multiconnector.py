"""KvpushConnector as a child of vLLM's `MultiConnector`, at the level that runs here
(issue 36): its scheduler half on vLLM's own `Request`, `KVCacheBlocks` and
`SchedulerOutput`, called in the order `MultiConnector` calls its children (run in the
vLLM venv, without a server).

Real servers with a storage tier beside it are `tests/test_vllm_e2e_multiconnector.py`;
this module pins the scheduler half's answers without one. What `MultiConnector` 0.32
does with a decode request
(`distributed/kv_transfer/kv_connector/v1/multi_connector.py`): it asks every child
for its matched tokens, the first child with some takes the request (434-453), and
every other child is told that 0 tokens come from it (467-477). So:

- where another child (an offload tier) took a request that also names a prefill,
  KvpushConnector refuses the prefill's transfer at once (the prefill frees its blocks,
  nothing moves twice), saying why, and holds nothing for it: no receive, no abort when
  the request ends, no pending work;
- where KvpushConnector took it, it receives the blocks after the decode's own hit.
"""

from __future__ import annotations

from typing import Any

import pytest

from helpers.vllm_venv import run_in_vllm_venv

pytestmark = [pytest.mark.vllm_venv, pytest.mark.timeout(300)]

SCRIPT = r"""
import dataclasses, json
from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request, RequestStatus
from kvpush.config import TimingConfig
from kvpush.integrations.vllm.params import ConnectorConfig
from kvpush.integrations.vllm.scheduler import SchedulerSide

config = ConnectorConfig(
    engine_id="d", role="receiver", side_channel_host="127.0.0.1", side_channel_port=1,
    token=None, timing=TimingConfig(), tp_size=1, total_kv_heads=2, use_mla=False,
    pp_size=1, dcp_size=1, block_size_tokens=32,
)

def request(rid, num_tokens):
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5600,
              "tp_size": 1, "transfer_id": f"t-{rid}"}
    sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params})
    return Request(rid, list(range(num_tokens)), sampling, None)

def blocks(n):
    return KVCacheBlocks((tuple(KVCacheBlock(i) for i in range(n)),))

def plan(side):
    p = side.build_connector_meta(SchedulerOutput.make_empty())
    return {
        "receives": [[r.request_id, r.transfer_id, list(r.blocks), r.sender_offset]
                     for r in p.receives],
        "refusals": [[r.transfer_id, r.detail] for r in p.refusals],
        "aborts": list(p.aborts),
    }

out = {}
for case, taken in (("another child took it", False), ("kvpush took it", True)):
    side = SchedulerSide(config)
    req = request("r", 100)
    # A local hit of one block: every child is asked for the rest.
    asked = side.get_num_new_matched_tokens(req, 32)
    side.update_state_after_alloc(req, blocks(4), asked[0] if taken else 0)
    first = plan(side)
    if taken:
        finished = None  # it waits for its KV: the worker's results end it
    else:
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        finished = list(side.request_finished(req, ([0, 1, 2, 3],)))
    out[case] = {"asked": list(asked), "plan": first, "finished": finished,
                 "after": plan(side), "pending": side.has_pending_push_work()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def answers() -> dict[str, Any]:
    answer: dict[str, Any] = run_in_vllm_venv(SCRIPT)
    return answer


def test_a_request_another_child_took_refuses_the_prefill_and_holds_nothing(
    answers: dict[str, Any],
) -> None:
    got = answers["another child took it"]
    assert got["asked"] == [68, True]  # 100 prompt tokens less its 32-token hit
    assert got["plan"]["receives"] == [] and got["plan"]["aborts"] == []
    [(tid, detail)] = got["plan"]["refusals"]
    assert tid == "t-r"
    assert detail == (
        "the decode server loads this prompt's KV otherwise: it asked for 68 tokens and "
        "vLLM gave this connector none (another connector of a MultiConnector took the "
        "request)"
    )
    # Its end frees its blocks at once (nothing to wait for), aborts nothing.
    assert got["finished"] == [False, None]
    assert got["after"] == {"receives": [], "refusals": [], "aborts": []}
    assert got["pending"] is False


def test_a_request_kvpush_took_receives_the_blocks_after_the_decodes_hit(
    answers: dict[str, Any],
) -> None:
    got = answers["kvpush took it"]
    assert got["plan"]["refusals"] == [] and got["plan"]["aborts"] == []
    # Blocks 1-3 (block 0 is the local hit), from the prefill's block 1 on.
    assert got["plan"]["receives"] == [["r", "t-r", [1, 2, 3], 1]]
