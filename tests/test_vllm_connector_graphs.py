"""What `KvpushConnector` tells vLLM about CUDA graphs, asked the way vLLM asks it.

vLLM decides whether full CUDA graphs must give way to piecewise ones while it builds
its config, before any connector exists: it loads the connector class through its
factory and calls `requires_piecewise_for_cudagraph(kv_connector_extra_config)`. This
test does exactly that in the vLLM venv (`.venv-vllm`), for each role and push mode. No
GPU is needed: the answer is a class method's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.vllm_venv import SRC, run_in_vllm_venv
from kvpush_lab.vllm_servers import KVPUSH_MODULE

pytestmark = [pytest.mark.vllm_venv, pytest.mark.timeout(300)]


ASK_AS_VLLM_DOES = """
import json, sys
import kvpush
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

out = {"kvpush": kvpush.__file__, "answers": []}
for role, extra in json.loads(sys.argv[1]):
    config = KVTransferConfig(
        kv_connector="KvpushConnector",
        kv_connector_module_path=sys.argv[2],
        kv_role=role,
        kv_connector_extra_config=extra,
    )
    cls = KVConnectorFactory.get_connector_class(config)
    out["answers"].append(cls.requires_piecewise_for_cudagraph(config.kv_connector_extra_config))
print(json.dumps(out))
"""

CASES: list[tuple[str, dict[str, str], bool]] = [
    # A decode server never saves KV: full CUDA graphs stay (this was True before).
    ("kv_consumer", {}, False),
    ("kv_consumer", {"push": "whole"}, False),
    # The default on a prefill server: vLLM does not tell the class the role (nor
    # whether async scheduling turned layer-wise push off), so it does not force
    # piecewise graphs; a replayed graph's layers are announced at the step's end.
    ("kv_producer", {}, False),
    ("kv_both", {}, False),
    ("kv_producer", {"push": "whole"}, False),
    # Asked for explicitly: every layer announced as vLLM computes it.
    ("kv_producer", {"push": "layerwise"}, True),
    ("kv_both", {"push": "layerwise"}, True),
]


def test_piecewise_graphs_are_asked_for_only_where_layerwise_push_is_set() -> None:
    reply = run_in_vllm_venv(
        ASK_AS_VLLM_DOES, json.dumps([[role, extra] for role, extra, _ in CASES]), KVPUSH_MODULE
    )
    assert Path(reply["kvpush"]).resolve().is_relative_to(SRC)
    assert reply["answers"] == [want for _, _, want in CASES]
