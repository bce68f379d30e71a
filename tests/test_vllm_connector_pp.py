"""Pipeline parallelism, as vLLM hands it to `KvpushConnector` at start-up: a prefill
(`kv_producer`) of several pipeline stages is taken (each stage pushes its own layers,
`tests/test_vllm_worker_pp.py`; a real PP 2 prefill into a PP 1 decode in
`test_vllm_e2e_shapes.py`), with layer-wise push off; a server that may receive KV
(`kv_consumer`, `kv_both`) at `--pipeline-parallel-size` > 1 is refused, on either
side of vLLM's connector, saying what was found, what runs and what to do instead.

This test builds vLLM's own `VllmConfig` (a tiny local model, `ParallelConfig` at PP
2) in the vLLM venv and asks vLLM's connector factory for the connector, in the
scheduler and in a worker, for every refused `kv_role`; the prefill's config is read
and its scheduler half built; the same configs at PP 1 are taken. No server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helpers.vllm_venv import SRC, run_in_vllm_venv
from kvpush_lab.vllm_servers import KVPUSH_MODULE, make_tiny_model

pytestmark = [pytest.mark.vllm_venv, pytest.mark.timeout(300)]

AS_VLLM_STARTS = """
import json, os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
import kvpush
from vllm.config import ModelConfig, ParallelConfig, VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig
from kvpush.integrations.vllm.params import ConnectorConfig

model, module, shapes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
out = {"kvpush": kvpush.__file__, "refused": [], "taken": []}


def config(kv_role, pp, tp):
    kv = KVTransferConfig(
        kv_connector="KvpushConnector", kv_connector_module_path=module, kv_role=kv_role
    )
    return VllmConfig(
        model_config=ModelConfig(model=model, dtype="float32"),
        parallel_config=ParallelConfig(pipeline_parallel_size=pp, tensor_parallel_size=tp),
        kv_transfer_config=kv,
    )


for kv_role, pp, tp in shapes:
    vllm_config = config(kv_role, pp, tp)
    if kv_role == "kv_producer":
        # Taken: its settings are read, and the scheduler's half is built (a worker's
        # needs vLLM's process groups, which only a server has).
        taken = ConnectorConfig.from_vllm(vllm_config)
        empty = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
        connector = KVConnectorFactory.create_connector(
            vllm_config, KVConnectorRole.SCHEDULER, empty
        )
        out["staged"] = [
            kv_role, taken.pp_size, taken.tp_size, taken.layerwise, taken.layerwise_refused(),
            type(connector).__name__,
        ]
        continue
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        empty = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
        try:
            KVConnectorFactory.create_connector(vllm_config, role, empty)
        except Exception as exc:
            error = f"{type(exc).__module__}.{type(exc).__name__}"
            out["refused"].append([kv_role, pp, tp, role.name, error, str(exc)])
        else:
            out["refused"].append([kv_role, pp, tp, role.name, None, None])
    # The same server without pipeline stages: its settings are read and taken.
    taken = ConnectorConfig.from_vllm(config(kv_role, 1, tp))
    out["taken"].append([kv_role, taken.pp_size, taken.tp_size])
print(json.dumps(out))
"""

# (kv_role, pipeline_parallel_size, tensor_parallel_size)
REFUSED = [("kv_consumer", 2, 2), ("kv_both", 2, 1)]
SHAPES = [*REFUSED, ("kv_producer", 2, 1)]


@pytest.fixture(scope="module")
def reply(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = make_tiny_model(tmp_path_factory.mktemp("pp") / "tiny")
    out: dict[str, Any] = run_in_vllm_venv(
        AS_VLLM_STARTS, str(model), KVPUSH_MODULE, json.dumps(SHAPES), timeout_s=280
    )
    assert Path(out["kvpush"]).resolve().is_relative_to(SRC)
    return out


def test_a_pipeline_parallel_prefill_is_taken_with_layerwise_push_off(
    reply: dict[str, Any],
) -> None:
    """Each stage pushes its own layers once the request finished; layer by layer is
    off, as the stages run different steps' batches."""
    assert reply["staged"] == [
        "kv_producer",
        2,
        1,
        False,
        "pipeline parallel size is 2",
        "KvpushConnector",
    ]


def test_a_server_that_receives_is_refused_at_pipeline_stages_naming_the_shape_and_the_way_out(
    reply: dict[str, Any],
) -> None:
    refused = reply["refused"]
    # Every role that may receive, in the scheduler and in a worker: none starts.
    assert [(r[0], r[3]) for r in refused] == [
        (role, side) for role, _, _ in REFUSED for side in ("SCHEDULER", "WORKER")
    ]
    for kv_role, pp, tp, side, error, said in refused:
        assert error == "kvpush.errors.ConfigError", (kv_role, side, error, said)
        workers = pp * tp
        assert said.startswith(
            f"pipeline_parallel_size is {pp} on a server with kv_role {kv_role!r}: "
            "KvpushConnector carries a pipeline-parallel prefill into a decode without "
            "pipeline stages, not a decode (or kv_both server) with them; expected 1. "
        ), said
        # What was found.
        assert (
            f"Found: kv_role {kv_role!r}, {pp} pipeline stages of tensor_parallel_size {tp} "
            f"({workers} workers)."
        ) in said
        # What runs.
        assert (
            "Supported: a kv_producer at any pipeline_parallel_size into a kv_consumer at "
            "pipeline_parallel_size 1"
        ) in said
        # What to do instead: the same workers as tensor parallelism.
        assert (
            f"Next: start this server with --pipeline-parallel-size 1 (to keep {workers} "
            f"workers: --tensor-parallel-size {workers}, "
        ) in said
        assert "a decode with pipeline stages is carried by none of vLLM's NIXL" in said


def test_the_same_servers_without_pipeline_stages_are_taken(reply: dict[str, Any]) -> None:
    """What the refusal turns on is the pipeline: at PP 1 the same configs are read."""
    assert reply["taken"] == [[role, 1, tp] for role, _, tp in REFUSED]
