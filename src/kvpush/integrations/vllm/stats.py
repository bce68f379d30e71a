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

And, for dashboards built for vLLM's own NIXL connectors, the `vllm:nixl_*` series its
`NixlPromMetrics` exports, with the same names, types, labels and buckets; what each
means for kvpush, and where that differs from vLLM's, is in docs/vllm.md ("Metrics"):

- `vllm:nixl_xfer_time_seconds`, `vllm:nixl_post_time_seconds`,
  `vllm:nixl_bytes_transferred`, `vllm:nixl_num_descriptors` (histograms): one
  observation per finished sending transfer part that wrote (`WritesMeasured`, from the
  runtime): time with one of its NIXL writes in flight, time spent posting them, bytes
  and descriptors they moved. Observed on the prefill, the side that posts the writes
  (vLLM's NixlConnector observes on the decode, which reads).
- `vllm:nixl_num_failed_transfers` (counter): parts that failed, either side, except
  those the engines ended themselves (cancelled, shut down, rejected) and the expired.
- `vllm:nixl_num_kv_expired_reqs` (counter): sending parts whose receiver did not take
  the blocks before the deadline or the lease ran out (`nixl_failure`).

`TransferStats.reduce()` gives vLLM's "KV Transfer metrics" log line the fields of
vLLM's `NixlKVConnectorStats.reduce()` (where an interval had such transfers or
failures), then kvpush's own.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvpush.transfer_metrics import (
    NIXL_EXPIRED,
    NIXL_FAILED,
    nixl_failure,
    record_ended,
    record_failed_at_once,
)

if TYPE_CHECKING:
    from kvpush.runtime import TransferResult

log = logging.getLogger(__name__)

_SECONDS_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
# vLLM's `NixlPromMetrics` buckets (vllm/distributed/kv_transfer/kv_connector/v1/nixl/
# stats.py), so that a dashboard's quantiles read the same boundaries.
_NIXL_POST_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
_NIXL_XFER_BUCKETS = _NIXL_POST_BUCKETS[1:]
_NIXL_BYTES_BUCKETS = [2 ** (10 + i) for i in range(1, 25, 2)]  # 2 KiB to 8 GiB
_NIXL_DESCRIPTOR_BUCKETS = [10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000]
_NIXL_DESCRIPTOR_BUCKETS += [20000, 50000]
# Per finished sending part that wrote, as vLLM's `NixlKVConnectorStats` keeps them per
# NIXL transfer: its lists, under its keys.
_NIXL_LISTS = ("transfer_duration", "post_duration", "bytes_transferred", "num_descriptors")
# vLLM's NIXL connectors, whose `vllm:nixl_*` series a `MultiConnector` beside ours
# registers itself.
_NIXL_CONNECTORS = frozenset({"NixlConnector", "NixlPushConnector"})


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
        **{key: [] for key in _NIXL_LISTS},
        NIXL_FAILED: 0,
        NIXL_EXPIRED: 0,
    }


@dataclass
class TransferStats(KVConnectorStats):
    """`data`: `ended` {"side|outcome|reason": count}, `bytes` {side: n},
    `seconds` {side: [durations]}; for the `vllm:nixl_*` series, vLLM's lists per
    transfer (`transfer_duration`, `post_duration` in seconds, `bytes_transferred`,
    `num_descriptors`) and the counts `failed` and `expired` (plain values: vLLM
    serializes them)."""

    data: dict[str, Any] = field(default_factory=_empty)

    def ended(self, result: TransferResult, seconds: float, bytes_per_block: int) -> None:
        record_ended(self, result, seconds=seconds, bytes_per_block=bytes_per_block)
        if result.ok:
            if result.writes is not None:
                w = result.writes
                for key, value in zip(
                    _NIXL_LISTS, (w.busy_s, w.post_s, w.nbytes, w.descriptors), strict=True
                ):
                    self.data.setdefault(key, []).append(value)
            return
        kind = nixl_failure(result.side, result.reason)
        if kind is not None:
            self.data[kind] = self.data.get(kind, 0) + 1

    def opened(self, push: str) -> None:
        o = self.data.setdefault("opened", {})
        o[push] = o.get(push, 0) + 1

    def layers_announced(self, by: str, n: int) -> None:
        a = self.data.setdefault("layers", {})
        a[by] = a.get(by, 0) + n

    def ended_at_once(self, side: str, why: str) -> None:
        record_failed_at_once(self, side)
        self.data[NIXL_FAILED] = self.data.get(NIXL_FAILED, 0) + 1

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
            **{key: [*mine.get(key, []), *theirs.get(key, [])] for key in _NIXL_LISTS},
            **{key: mine.get(key, 0) + theirs.get(key, 0) for key in (NIXL_FAILED, NIXL_EXPIRED)},
        }
        return self

    def _nixl_summary(self) -> dict[str, int | float]:
        """vLLM's `NixlKVConnectorStats.reduce()` fields, computed as it computes them
        (its failure fields less "Num notifs after expiry", which kvpush has no
        counterpart of); empty if the interval had neither a transfer that wrote nor a
        failure."""
        data = self.data
        failures: dict[str, int | float] = {
            "Num failed transfers": data.get(NIXL_FAILED, 0),
            "Num KV expired reqs": data.get(NIXL_EXPIRED, 0),
        }
        xfer = np.asarray(data.get("transfer_duration", []), dtype=np.float64)
        n = len(xfer)
        if n == 0:
            if not any(failures.values()):
                return {}
            return {
                "Num successful transfers": 0,
                "Avg xfer time (ms)": 0,
                "P90 xfer time (ms)": 0,
                "Avg post time (ms)": 0,
                "P90 post time (ms)": 0,
                "Avg MB per transfer": 0,
                "Throughput (MB/s)": 0,
                "Avg number of descriptors": 0,
                **failures,
            }
        post = np.asarray(data.get("post_duration", []), dtype=np.float64)
        mb = np.asarray(data.get("bytes_transferred", []), dtype=np.float64) / 2**20
        descriptors = np.asarray(data.get("num_descriptors", []), dtype=np.float64)
        seconds = float(xfer.sum())
        return {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(float(xfer.mean()) * 1e3, 3),
            "P90 xfer time (ms)": round(float(np.percentile(xfer, 90)) * 1e3, 3),
            "Avg post time (ms)": round(float(post.mean()) * 1e3, 3),
            "P90 post time (ms)": round(float(np.percentile(post, 90)) * 1e3, 3),
            "Avg MB per transfer": round(float(mb.sum()) / n, 3),
            "Throughput (MB/s)": round(float(mb.sum()) / seconds, 3) if seconds > 0 else 0,
            "Avg number of descriptors": round(float(descriptors.mean()), 1),
            **failures,
        }

    def reduce(self) -> dict[str, int | float]:
        out = self._nixl_summary()
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
            or data.get(NIXL_FAILED)
            or data.get("transfer_duration")
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
        self._nixl = (
            None
            if _nixl_beside(vllm_config)
            else _NixlSeries(
                self._histogram_cls, self._counter_cls, labelnames, per_engine_labelvalues
            )
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
        if self._nixl is not None:
            self._nixl.observe(transfer_stats_data, engine)


def _nixl_beside(vllm_config: Any) -> bool:
    """Whether a `MultiConnector` runs one of vLLM's NIXL connectors beside ours: that
    one registers the `vllm:nixl_*` series (a second registration would fail), and they
    are its."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None or kv.kv_connector != "MultiConnector":
        return False
    children = (kv.kv_connector_extra_config or {}).get("connectors", [])
    beside = [c.get("kv_connector") for c in children if c.get("kv_connector") in _NIXL_CONNECTORS]
    if beside:
        log.info(
            "KvpushConnector runs beside %s in a MultiConnector: the vllm:nixl_* series are "
            "that connector's; kvpush's transfers are in vllm:kvpush_* only",
            beside[0],
        )
    return bool(beside)


class _NixlSeries:
    """The `vllm:nixl_*` series of vLLM's `NixlPromMetrics`: same names, types, labels
    and buckets, observed from kvpush's transfers (module docstring)."""

    def __init__(
        self,
        histogram: Any,
        counter: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        self.histograms = [
            histogram(
                name="vllm:nixl_xfer_time_seconds",
                documentation="Histogram of transfer duration for NIXL KV Cache transfers "
                "(kvpush: per sending transfer part, time with one of its writes in flight).",
                buckets=_NIXL_XFER_BUCKETS,
                labelnames=labelnames,
            ),
            histogram(
                name="vllm:nixl_post_time_seconds",
                documentation="Histogram of transfer post time for NIXL KV Cache transfers "
                "(kvpush: per sending transfer part, time spent posting its writes).",
                buckets=_NIXL_POST_BUCKETS,
                labelnames=labelnames,
            ),
            histogram(
                name="vllm:nixl_bytes_transferred",
                documentation="Histogram of bytes transferred per NIXL KV Cache transfers "
                "(kvpush: per sending transfer part).",
                buckets=_NIXL_BYTES_BUCKETS,
                labelnames=labelnames,
            ),
            histogram(
                name="vllm:nixl_num_descriptors",
                documentation="Histogram of number of descriptors per NIXL KV Cache transfers "
                "(kvpush: per sending transfer part, summed over its writes, after merging).",
                buckets=_NIXL_DESCRIPTOR_BUCKETS,
                labelnames=labelnames,
            ),
        ]
        self.failed = counter(
            name="vllm:nixl_num_failed_transfers",
            documentation="Number of failed NIXL KV Cache transfers (kvpush: transfer parts "
            "failed on this side, handshakes included; not cancelled, rejected or shut down). "
            "NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
            labelnames=labelnames,
        )
        self.expired = counter(
            name="vllm:nixl_num_kv_expired_reqs",
            documentation="Number of requests that had their KV expire (kvpush: sending "
            "transfer parts whose receiver did not take them before the deadline or the "
            "lease ran out). NOTE: This metric is tracked on the P instance.",
            labelnames=labelnames,
        )
        # Each engine's series exist from the start, at 0, as vLLM's do: a dashboard
        # reads "no failure", not "no data".
        for values in per_engine_labelvalues.values():
            for metric in (*self.histograms, self.failed, self.expired):
                metric.labels(*[str(v) for v in values])

    def observe(self, data: dict[str, Any], engine: list[str]) -> None:
        for histogram, key in zip(self.histograms, _NIXL_LISTS, strict=True):
            series = histogram.labels(*engine)
            for value in data.get(key, []):
                series.observe(value)
        for counter, key in ((self.failed, NIXL_FAILED), (self.expired, NIXL_EXPIRED)):
            if data.get(key):
                counter.labels(*engine).inc(data[key])
