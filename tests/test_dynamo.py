"""`KvpushConnector` under NVIDIA Dynamo's vLLM worker, through Dynamo's own code.

Dynamo's prefill handler resolves the engine's connector with
`dynamo.vllm.kv_connector_protocols.make_kv_connector_protocol` and refuses a name its
registry lacks; `kvpush.integrations.dynamo.register_with_dynamo()` adds the entry. This
test imports that module from the real `ai-dynamo` 1.6.1 wheel (installed beside the
vLLM venv by `make vllm-venv`, see scripts/setup-vllm-venv) and, in the vLLM venv:

- without the entry, Dynamo refuses `KvpushConnector` with its own message;
- with it, each leg runs as Dynamo runs it (ai-dynamo 1.6.1, `dynamo/vllm/handlers.py`):
  the prefill handler puts the protocol's prefill params on the request's sampling
  params (`_update_kv_transfer_params`: `extra_args["kv_transfer_params"]`), its engine
  answers through `KvpushConnector`'s scheduler half (`request_finished`), the protocol
  turns that engine output into the decode request's params, and the decode worker
  puts those on its request. kvpush's parsers and a decode scheduler half take them,
  and the decode registers for the very transfer the prefill offers.

No Dynamo runtime, server or transfer runs: Dynamo's handler needs its Rust runtime
(`ai-dynamo-runtime`), etcd and NATS. What moves the KV after these params is the
connector's, tested with vLLM servers in test_vllm_e2e.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from helpers.vllm_venv import SRC, run_in_vllm_venv
from kvpush_lab.vllm_servers import DEFAULT_VLLM_VENV, KVPUSH_MODULE

pytestmark = [pytest.mark.vllm_venv, pytest.mark.timeout(300)]

# Where scripts/setup-vllm-venv installs ai-dynamo: beside the venv's packages, not in
# them, so its vLLM plugin and pytest plugins never load in the vLLM servers.
DYNAMO_DIR = DEFAULT_VLLM_VENV / "ai-dynamo"
PREFILL_PORT = 5600  # never bound: no side channel is served here

RUN_AS_DYNAMO_DOES = """
import json, sys
from types import SimpleNamespace

import dynamo.vllm
import kvpush
from dynamo.vllm import kv_connector_protocols as dkp
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request, RequestStatus

from kvpush.config import TimingConfig
from kvpush.integrations.dynamo import register_with_dynamo
from kvpush.integrations.vllm.params import ConnectorConfig, prefill_transfer
from kvpush.integrations.vllm.scheduler import SchedulerSide
from kvpush.transfer_params import parse_remote_decode, parse_remote_prefill

module_path, prefill_port = sys.argv[1], int(sys.argv[2])
BLOCK = 16
PROMPT = list(range(100, 140))  # 40 tokens: 3 blocks


def engine(role, connector="KvpushConnector", extra=None):
    kv = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=module_path if connector == "KvpushConnector" else None,
        kv_role=role,
        kv_connector_extra_config=extra or {},
    )
    return VllmConfig(kv_transfer_config=kv)


def connector_config(vllm_config, role):
    kv = vllm_config.kv_transfer_config
    return ConnectorConfig(
        engine_id=str(kv.engine_id), role=role, side_channel_host="10.0.0.1",
        side_channel_port=prefill_port if role == "sender" else prefill_port + 1,
        token=None, timing=TimingConfig(), tp_size=1, total_kv_heads=2, use_mla=False,
        pp_size=1, dcp_size=1, block_size_tokens=BLOCK,
    )


def request(rid, max_tokens, kv_transfer_params):
    # dynamo.vllm.handlers._update_kv_transfer_params, as both handlers call it.
    sampling = SamplingParams(
        max_tokens=max_tokens, extra_args={"kv_transfer_params": dict(kv_transfer_params)}
    )
    return Request(rid, list(PROMPT), sampling, None)


out = {"kvpush": kvpush.__file__, "dynamo": dkp.__file__, "version": dynamo.vllm.__version__}
prefill_engine, decode_engine = engine("kv_producer"), engine("kv_consumer")

# Without the entry: Dynamo's own refusal.
try:
    dkp.make_kv_connector_protocol(prefill_engine)
    out["refused"] = None
except ValueError as exc:
    out["refused"] = str(exc)

out["registered"] = register_with_dynamo().__name__
out["registered_again"] = register_with_dynamo().__name__

# The prefill leg, on the prefill worker: one protocol per request.
protocol = dkp.make_kv_connector_protocol(prefill_engine)
out["protocol"] = type(protocol).__name__
prefill_params = protocol.prefill_request_kv_transfer_params()
out["prefill_params"] = prefill_params
prefill_config = connector_config(prefill_engine, "sender")
out["parse_remote_decode"] = parse_remote_decode(prefill_params).to_params()
xfer = prefill_transfer(prefill_params, prefill_config)
out["prefill_transfer"] = {"transfer_id": xfer.transfer_id, "decode": xfer.decode,
                           "decode_tp_size": xfer.decode_tp_size}
prefill = SchedulerSide(prefill_config)
req = request("dynamo-prefill-1", 1, prefill_params)
prefill.on_new_request(req)
req.status = RequestStatus.FINISHED_LENGTH_CAPPED  # max_tokens 1, as Dynamo asks
held, answer = prefill.request_finished(req, [[3, 4, 5]])
sends = prefill.build_connector_meta(SchedulerOutput.make_empty()).sends
out["prefill_holds_blocks"] = held
out["sends"] = [{"transfer_id": s.transfer_id, "blocks": list(s.blocks),
                 "decode": s.decode, "cancel": s.cancel} for s in sends]
out["answer"] = answer

# Dynamo turns the prefill engine's output into the decode leg's params.
engine_output = RequestOutput(
    request_id=req.request_id, prompt=None, prompt_token_ids=list(PROMPT),
    prompt_logprobs=None,
    outputs=[CompletionOutput(index=0, text="", token_ids=[7], cumulative_logprob=None,
                              logprobs=None)],
    finished=True, kv_transfer_params=answer,
)
decode_params = protocol.decode_request_kv_transfer_params(engine_output)
out["decode_params"] = decode_params
out["parse_remote_prefill"] = parse_remote_prefill(decode_params).to_params()

# The decode leg, on the decode worker: the params as the prefill handler returned them.
decode = SchedulerSide(connector_config(decode_engine, "receiver"))
dreq = request("dynamo-decode-1", 8, decode_params)
count, is_async = decode.get_num_new_matched_tokens(dreq, 0)
out["decode_matched"] = [count, is_async]
blocks = KVCacheBlocks(([KVCacheBlock(7), KVCacheBlock(8), KVCacheBlock(9)],))
decode.update_state_after_alloc(dreq, blocks, count)
plan = decode.build_connector_meta(SchedulerOutput.make_empty())
out["receives"] = [{"transfer_id": r.transfer_id, "host": r.host, "port": r.port,
                    "blocks": list(r.blocks)} for r in plan.receives]
out["refusals"] = len(plan.refusals)

# A MultiConnector with kvpush as its one PD child resolves to the same protocol.
multi = engine("kv_producer", "MultiConnector", {"connectors": [
    {"kv_connector": "KvpushConnector", "kv_connector_module_path": module_path,
     "kv_role": "kv_producer"}]})
out["multi_protocol"] = type(dkp.make_kv_connector_protocol(multi)).__name__

# A Dynamo release with an entry of its own for the name: that entry is kept.
dkp.KV_CONNECTOR_PROTOCOLS["KvpushConnector"] = dkp.LMCacheMPConnectorProtocol
out["kept"] = register_with_dynamo().__name__
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def dynamo_run() -> dict[str, Any]:
    if not (DYNAMO_DIR / "dynamo" / "vllm" / "kv_connector_protocols.py").exists():
        pytest.fail(f"no ai-dynamo at {DYNAMO_DIR}: make vllm-venv installs it", pytrace=False)
    # Dynamo from beside the venv (never in its site-packages: see setup-vllm-venv).
    reply: dict[str, Any] = run_in_vllm_venv(
        RUN_AS_DYNAMO_DOES, KVPUSH_MODULE, str(PREFILL_PORT), path=(DYNAMO_DIR,)
    )
    assert Path(reply["kvpush"]).resolve().is_relative_to(SRC)
    assert Path(reply["dynamo"]).resolve().is_relative_to(DYNAMO_DIR.resolve())
    assert reply["version"] == "1.6.1"
    return reply


def test_without_the_entry_dynamo_refuses_kvpush_with_its_own_message(
    dynamo_run: dict[str, Any],
) -> None:
    refused = dynamo_run["refused"]
    assert refused is not None
    assert refused.startswith("Unsupported kv_connector='KvpushConnector' for PD.")
    assert "add it to KV_CONNECTOR_PROTOCOLS" in refused


def test_the_entry_maps_kvpush_to_dynamos_nixl_protocol(dynamo_run: dict[str, Any]) -> None:
    assert dynamo_run["registered"] == "NixlConnectorProtocol"
    assert dynamo_run["registered_again"] == "NixlConnectorProtocol"
    assert dynamo_run["protocol"] == "NixlConnectorProtocol"
    # Dynamo delegates a wrapper to its one PD-capable child: kvpush is one now.
    assert dynamo_run["multi_protocol"] == "NixlConnectorProtocol"
    # An entry Dynamo itself has for the name is never replaced.
    assert dynamo_run["kept"] == "LMCacheMPConnectorProtocol"


def test_the_prefill_leg_dynamo_sends_is_a_kvpush_prefill_request(
    dynamo_run: dict[str, Any],
) -> None:
    # Exactly what Dynamo's protocol puts on the prefill request (no transfer id, no
    # decode named): the NIXL connectors' request, which kvpush reads as "push to the
    # first decode that registers this prefill's fresh transfer id".
    assert dynamo_run["prefill_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert dynamo_run["parse_remote_decode"] == {"do_remote_decode": True}
    xfer = dynamo_run["prefill_transfer"]
    # Dynamo names no decode: the prefill learns its TP from the decode's registration.
    assert xfer["decode"] is None and xfer["decode_tp_size"] is None
    assert dynamo_run["prefill_holds_blocks"] is True
    [send] = dynamo_run["sends"]
    assert send["blocks"] == [3, 4, 5] and send["decode"] is None and not send["cancel"]


def test_the_decode_leg_dynamo_derives_names_the_transfer_the_prefill_offers(
    dynamo_run: dict[str, Any],
) -> None:
    answer = dynamo_run["answer"]
    [send] = dynamo_run["sends"]
    assert answer["transfer_id"] == send["transfer_id"]
    # Dynamo's NIXL protocol forwards the prefill engine's answer unchanged, so the
    # decode leg carries kvpush's `transfer_id`: kvpush's decode parser accepts it as
    # it stands today (it does not need vLLM's push dialect without a transfer id).
    decode_params = dynamo_run["decode_params"]
    assert decode_params == answer
    assert decode_params["transfer_id"] == send["transfer_id"]
    assert dynamo_run["parse_remote_prefill"] == {
        "do_remote_prefill": True,
        "transfer_id": send["transfer_id"],
        "remote_host": "10.0.0.1",
        "remote_port": PREFILL_PORT,
        "remote_engine_id": answer["remote_engine_id"],
        "tp_size": 1,
        "block_size": 16,
    }
    # The decode registers its blocks for that transfer, at the prefill's side channel.
    assert dynamo_run["decode_matched"] == [40, True]
    assert dynamo_run["receives"] == [
        {
            "transfer_id": send["transfer_id"],
            "host": "10.0.0.1",
            "port": PREFILL_PORT,
            "blocks": [7, 8, 9],
        }
    ]
    assert dynamo_run["refusals"] == 0
