"""The connector's stats as vLLM handles them, in the vLLM venv, without servers.

Several worker ranks' `TransferStats` are built through the connector class as vLLM
loads it, reduced over ranks by vLLM's own `KVOutputAggregator`, serialized as the
engine core sends them, then logged by vLLM's `KVConnectorLogging` and exported by the
connector's Prometheus metrics. The same transfers, put as vLLM's NIXL connector would
have recorded them, go through vLLM's own `NixlKVConnectorStats` and `NixlPromMetrics`:
the `vllm:nixl_*` series must be identical (names, types, labels, buckets, values) and
the "KV Transfer metrics" line must open with vLLM's fields and values.

What counts as what is stated here once more, independently of
`kvpush.transfer_metrics.nixl_failure`: a finished sending part that wrote is one
observation; a sending part whose receiver did not take its blocks in time (deadline,
lease or silence) expired; any other failure on either side failed, except what the
engines ended themselves (cancelled, rejected, shut down).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helpers.vllm_venv import SRC, run_in_vllm_venv
from kvpush_lab.vllm_servers import KVPUSH_MODULE

pytestmark = [pytest.mark.vllm_venv, pytest.mark.timeout(400)]

AS_VLLM_DOES = r"""
import functools, json, sys

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm.config import VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

import kvpush
from kvpush.errors import FailureReason
from kvpush.runtime import TransferResult, WritesMeasured

module, ranks, nixl_data = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
kv = KVTransferConfig(
    kv_connector="KvpushConnector", kv_connector_module_path=module, kv_role="kv_both"
)
connector = KVConnectorFactory.get_connector_class(kv)
LABELS, ENGINES = ["model_name", "engine"], {0: ["tiny", "0"]}


def registry_types(registry):
    bind = lambda cls: functools.partial(cls, registry=registry)
    return {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)}


def families(registry):
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        if fam.name.endswith("_created"):  # when each series was made: differs by design
            continue
        samples = sorted(
            [s.name, sorted(s.labels.items()), s.value]
            for s in fam.samples
            if not s.name.endswith("_created")  # when it was made: differs by design
        )
        out[fam.name] = {"type": fam.type, "samples": samples}
    return out


# Each rank's stats, as its worker fills them.
outputs, empties = [], []
for events in ranks:
    stats = connector.build_kv_connector_stats()
    empties.append(stats.is_empty())
    for ev in events:
        if ev.get("at_once"):
            stats.ended_at_once(ev["side"], "unusable kv_transfer_params")
            continue
        reason = None if ev["reason"] is None else FailureReason(ev["reason"])
        writes = None if ev["writes"] is None else WritesMeasured(*ev["writes"])
        result = TransferResult("t", ev["side"], reason, "", (1,), ev["blocks"], writes)
        stats.ended(result, 0.01, 1024)
    outputs.append(
        ModelRunnerOutput(
            req_ids=[],
            req_id_to_index={},
            kv_connector_output=KVConnectorOutput(kv_connector_stats=stats),
        )
    )
only_failed = connector.build_kv_connector_stats()
only_failed.ended_at_once("receiver", "unusable kv_transfer_params")
# Over ranks as vLLM does, then serialized as the engine core sends it to the frontend.
merged = KVOutputAggregator(len(ranks)).aggregate(outputs).kv_connector_output
payload = json.loads(json.dumps(merged.kv_connector_stats.to_dict()))

lines = []
logging_ = KVConnectorLogging(kv)
logging_.observe(payload)
logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
ours = connector.build_kv_connector_stats(payload).reduce()

config = VllmConfig(kv_transfer_config=kv)
ours_registry, vllm_registry = CollectorRegistry(), CollectorRegistry()
prom = connector.build_prom_metrics(config, registry_types(ours_registry), LABELS, ENGINES)
prom.observe(payload, 0)
vllm_data = {key: [] for key in NixlKVConnectorStats().data}
vllm_data.update(nixl_data)
nixl = NixlPromMetrics(config, registry_types(vllm_registry), LABELS, ENGINES)
nixl.observe(vllm_data, 0)

# Beside vLLM's NixlConnector in a MultiConnector: the vllm:nixl_* series are its.
multi = VllmConfig(
    kv_transfer_config=KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "connectors": [
                {
                    "kv_connector": "KvpushConnector",
                    "kv_connector_module_path": module,
                    "kv_role": "kv_both",
                },
                {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
            ]
        },
    )
)
beside = CollectorRegistry()
connector.build_prom_metrics(multi, registry_types(beside), LABELS, ENGINES).observe(payload, 0)
NixlPromMetrics(multi, registry_types(beside), LABELS, ENGINES)

print(json.dumps({
    "kvpush": kvpush.__file__,
    "empty_at_start": empties,
    "only_failed_empty": only_failed.is_empty(),
    "lines": lines,
    "ours": ours,
    "vllm": NixlKVConnectorStats(data=vllm_data).reduce(),
    "ours_families": families(ours_registry),
    "vllm_families": families(vllm_registry),
    "beside_families": sorted(families(beside)),
}))
"""

# (writes, descriptors, nbytes, post_s, busy_s), as `WritesMeasured` holds them.
W1 = [1, 8, 4096, 0.0002, 0.003]
W2 = [3, 12, 8192, 0.0005, 0.020]
W3 = [2, 40, 3 * 2**20, 0.001, 0.150]
FAILED_WRITE = [1, 0, 0, 0.0001, 0.001]


def _ended(side: str, reason: str | None = None, writes: list[Any] | None = None) -> dict[str, Any]:
    return {"side": side, "reason": reason, "writes": writes, "blocks": 0 if reason else 2}


RANKS = [
    [
        _ended("sender", writes=W1),
        _ended("sender", writes=W2),
        _ended("sender", "deadline_exceeded"),  # expired
        _ended("sender", "peer_timeout"),  # expired: the receiver went silent
        _ended("sender", "cancelled"),  # the engine's abort: nothing
        _ended("receiver"),  # received: the decode posts no write
    ],
    [
        _ended("sender", writes=W3),
        _ended("receiver", "peer_gone"),  # failed
        _ended("receiver", "deadline_exceeded"),  # failed: a receiver's is not expiry
        _ended("sender", "rejected"),  # the decode needed nothing: nothing
        _ended("sender", "shutdown"),  # our own stop: nothing
        {"at_once": True, "side": "receiver"},  # failed before the runtime took it
        _ended("sender", "write_error", FAILED_WRITE),  # failed
    ],
]
# What vLLM's NIXL connector would have recorded for the same transfers.
NIXL_DATA = {
    "transfer_duration": [W1[4], W2[4], W3[4]],
    "post_duration": [W1[3], W2[3], W3[3]],
    "bytes_transferred": [W1[2], W2[2], W3[2]],
    "num_descriptors": [W1[1], W2[1], W3[1]],
    "num_failed_transfers": [1] * 4,
    "num_kv_expired_reqs": [1] * 2,
}
SERIES = {
    "vllm:nixl_xfer_time_seconds": "histogram",
    "vllm:nixl_post_time_seconds": "histogram",
    "vllm:nixl_bytes_transferred": "histogram",
    "vllm:nixl_num_descriptors": "histogram",
    "vllm:nixl_num_failed_transfers": "counter",
    "vllm:nixl_num_kv_expired_reqs": "counter",
}


@pytest.fixture(scope="module")
def reply() -> dict[str, Any]:
    out: dict[str, Any] = run_in_vllm_venv(
        AS_VLLM_DOES, KVPUSH_MODULE, json.dumps(RANKS), json.dumps(NIXL_DATA), timeout_s=360
    )
    assert Path(out["kvpush"]).resolve().is_relative_to(SRC)
    return out


def test_ranks_reduced_by_vllm_export_the_nixl_series_its_nixl_connector_would(
    reply: dict[str, Any],
) -> None:
    ours, theirs = reply["ours_families"], reply["vllm_families"]
    for name, kind in SERIES.items():
        assert ours[name]["type"] == theirs[name]["type"] == kind, name
        assert ours[name]["samples"] == theirs[name]["samples"], name
    # The counts are there, and are what the transfers say (not both empty).
    count = {
        s[0]: s[2]
        for s in ours["vllm:nixl_xfer_time_seconds"]["samples"]
        if s[0].endswith("_count")
    }
    assert count == {"vllm:nixl_xfer_time_seconds_count": 3}
    [failed] = [s[2] for s in ours["vllm:nixl_num_failed_transfers"]["samples"]]
    [expired] = [s[2] for s in ours["vllm:nixl_num_kv_expired_reqs"]["samples"]]
    assert (failed, expired) == (4, 2)
    # vLLM's two notification counters have no kvpush counterpart (docs/vllm.md).
    assert not {n for n in ours if n.startswith("vllm:nixl_")} - set(SERIES)
    # kvpush's own series are still there beside them.
    assert "vllm:kvpush_transfers" in ours


def test_the_kv_transfer_metrics_line_opens_with_vllms_fields(reply: dict[str, Any]) -> None:
    ours, theirs = reply["ours"], reply["vllm"]
    vllm_fields = {k: v for k, v in theirs.items() if k != "Num notifs after expiry"}
    assert list(ours.items())[: len(vllm_fields)] == list(vllm_fields.items())
    assert ours["Num successful transfers"] == 3 and ours["Num KV expired reqs"] == 2
    # Then kvpush's own, by side, outcome and reason.
    assert ours["sender finished"] == 3 and ours["sender failed (deadline_exceeded)"] == 1
    assert reply["lines"] == [
        "KV Transfer metrics: " + ", ".join(f"{k}={v}" for k, v in ours.items())
    ]


def test_stats_empty_until_something_ended_and_failures_alone_are_logged(
    reply: dict[str, Any],
) -> None:
    assert reply["empty_at_start"] == [True, True]
    assert reply["only_failed_empty"] is False


def test_beside_vllms_nixl_connector_the_nixl_series_are_its_own(reply: dict[str, Any]) -> None:
    """In a `MultiConnector` with NixlConnector, that connector registers the
    `vllm:nixl_*` series; ours would clash with them (prometheus refuses a second
    registration): kvpush exports only its own there, and vLLM's start up."""
    names = reply["beside_families"]
    assert "vllm:kvpush_transfers" in names and "vllm:nixl_xfer_time_seconds" in names
