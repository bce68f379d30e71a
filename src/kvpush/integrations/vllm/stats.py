"""What the connector reports to vLLM's stats logger and Prometheus endpoint.

Workers collect `TransferStats` per logging interval (vLLM ships them to the engine's
logger process and aggregates them over ranks); `KvpushPromMetrics` turns them into
counters and histograms on vLLM's `/metrics`:

- `vllm:kvpush_transfers_total{side, outcome, reason}`: transfers ended, by side
  (sender/receiver), outcome (finished/failed) and failure reason.
- `vllm:kvpush_transfer_bytes_total{side}`: bytes that finished transfers moved (after a
  prefix hit at the decode, only the blocks it lacked).
- `vllm:kvpush_transfer_seconds{side}`: from the step that started a transfer to the
  step that saw it end.
- `vllm:kvpush_sends_total{push}`: prefill transfers opened, `layerwise` (each layer
  announced as it is computed) or `whole` (when the request finished).
- `vllm:kvpush_sends_registered_first_total`: prefill transfers whose decode had
  registered before the prefill offered its blocks: push running concurrently with the
  prefill, as it does when a router dispatches both legs at once.
- `vllm:kvpush_layers_announced_total{by}`: layers of layer-wise sends announced, by
  `save_kv_layer` (as computed) or by `wait_for_save` (at the step's end: layers that
  vLLM computed without calling `save_kv_layer` for them, e.g. in a CUDA graph).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvpush.transfer_metrics import record_ended, record_failed_at_once

if TYPE_CHECKING:
    from kvpush.runtime import TransferResult

_SECONDS_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


def _key(side: str, outcome: str, reason: str) -> str:
    return f"{side}|{outcome}|{reason}"


def _empty() -> dict[str, Any]:
    return {
        "ended": {},
        "bytes": {},
        "seconds": {},
        "opened": {},
        "layers": {},
        "registered_first": 0,
    }


@dataclass
class TransferStats(KVConnectorStats):
    """`data`: `ended` {"side|outcome|reason": count}, `bytes` {side: n},
    `seconds` {side: [durations]} (plain values: vLLM serializes them)."""

    data: dict[str, Any] = field(default_factory=_empty)

    def ended(self, result: TransferResult, seconds: float, bytes_per_block: int) -> None:
        record_ended(self, result, seconds=seconds, bytes_per_block=bytes_per_block)

    def opened(self, push: str) -> None:
        o = self.data.setdefault("opened", {})
        o[push] = o.get(push, 0) + 1

    def layers_announced(self, by: str, n: int) -> None:
        a = self.data.setdefault("layers", {})
        a[by] = a.get(by, 0) + n

    def ended_at_once(self, side: str, why: str) -> None:
        record_failed_at_once(self, side)

    # The `TransferMetricsSink` that `record_ended` counts into.

    def count_ended(self, side: str, outcome: str, reason: str) -> None:
        ended = self.data["ended"]
        key = _key(side, outcome, reason)
        ended[key] = ended.get(key, 0) + 1

    def add_bytes(self, side: str, nbytes: int) -> None:
        b = self.data["bytes"]
        b[side] = b.get(side, 0) + nbytes

    def registered_first(self, n: int) -> None:
        self.data["registered_first"] = self.data.get("registered_first", 0) + n

    def observe_seconds(self, side: str, seconds: float) -> None:
        self.data["seconds"].setdefault(side, []).append(seconds)

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        mine, theirs = self.data, other.data
        ended = Counter(mine.get("ended", {}))
        ended.update(theirs.get("ended", {}))
        nbytes = Counter(mine.get("bytes", {}))
        nbytes.update(theirs.get("bytes", {}))
        seconds: dict[str, list[float]] = {}
        for src in (mine.get("seconds", {}), theirs.get("seconds", {})):
            for side, values in src.items():
                seconds.setdefault(side, []).extend(values)
        opened = Counter(mine.get("opened", {}))
        opened.update(theirs.get("opened", {}))
        layers = Counter(mine.get("layers", {}))
        layers.update(theirs.get("layers", {}))
        self.data = {
            "ended": dict(ended),
            "bytes": dict(nbytes),
            "seconds": seconds,
            "opened": dict(opened),
            "layers": dict(layers),
            "registered_first": mine.get("registered_first", 0) + theirs.get("registered_first", 0),
        }
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key, n in sorted(self.data.get("ended", {}).items()):
            side, outcome, reason = key.split("|")
            name = f"{side} {outcome}" + (f" ({reason})" if reason else "")
            out[name] = n
        for side, n in sorted(self.data.get("bytes", {}).items()):
            out[f"{side} MiB"] = round(n / 2**20, 3)
        for side, values in sorted(self.data.get("seconds", {}).items()):
            if values:
                ordered = sorted(values)
                out[f"{side} p50 ms"] = round(ordered[len(ordered) // 2] * 1000, 3)
        for push, n in sorted(self.data.get("opened", {}).items()):
            out[f"sends {push}"] = n
        for by, n in sorted(self.data.get("layers", {}).items()):
            out[f"layers by {by}"] = n
        if self.data.get("registered_first"):
            out["sends registered first"] = self.data["registered_first"]
        return out

    def is_empty(self) -> bool:
        data = self.data
        return not (
            data.get("ended")
            or data.get("opened")
            or data.get("layers")
            or data.get("registered_first")
        )


class KvpushPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._transfers = self._counter_cls(
            name="vllm:kvpush_transfers_total",
            documentation="KV transfers ended through kvpush, by side, outcome and reason.",
            labelnames=[*labelnames, "side", "outcome", "reason"],
        )
        self._bytes = self._counter_cls(
            name="vllm:kvpush_transfer_bytes_total",
            documentation="Bytes of KV moved by finished kvpush transfers.",
            labelnames=[*labelnames, "side"],
        )
        self._seconds = self._histogram_cls(
            name="vllm:kvpush_transfer_seconds",
            documentation="Time from the step that started a kvpush transfer to its end.",
            buckets=_SECONDS_BUCKETS,
            labelnames=[*labelnames, "side"],
        )
        self._opened = self._counter_cls(
            name="vllm:kvpush_sends_total",
            documentation="Prefill transfers opened through kvpush, layer-wise or whole.",
            labelnames=[*labelnames, "push"],
        )
        self._registered_first = self._counter_cls(
            name="vllm:kvpush_sends_registered_first_total",
            documentation="Prefill transfers whose decode registered before they were offered.",
            labelnames=labelnames,
        )
        self._layers = self._counter_cls(
            name="vllm:kvpush_layers_announced_total",
            documentation="Layers of layer-wise kvpush sends announced, by which hook.",
            labelnames=[*labelnames, "by"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for key, n in transfer_stats_data.get("ended", {}).items():
            side, outcome, reason = key.split("|")
            self._transfers.labels(*engine, side, outcome, reason).inc(n)
        for side, n in transfer_stats_data.get("bytes", {}).items():
            self._bytes.labels(*engine, side).inc(n)
        for side, values in transfer_stats_data.get("seconds", {}).items():
            hist = self._seconds.labels(*engine, side)
            for v in values:
                hist.observe(v)
        for push, n in transfer_stats_data.get("opened", {}).items():
            self._opened.labels(*engine, push).inc(n)
        for by, n in transfer_stats_data.get("layers", {}).items():
            self._layers.labels(*engine, by).inc(n)
        if transfer_stats_data.get("registered_first"):
            self._registered_first.labels(*engine).inc(transfer_stats_data["registered_first"])
