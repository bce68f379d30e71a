"""A small Prometheus text-format registry: counters, gauges and histograms with labels.

Thread-safe (one lock per registry); rendering takes a consistent snapshot. Kept here
rather than pulling in `prometheus_client`, because the serving stack needs only this.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

Labels = tuple[tuple[str, str], ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_labels(labels: Labels, extra: Sequence[tuple[str, str]] = ()) -> str:
    items = [*labels, *extra]
    if not items:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in items)
    return "{" + body + "}"


def _fmt_value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


class Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._meta: dict[str, tuple[str, str]] = {}  # name -> (type, help)
        self._values: dict[str, dict[Labels, float]] = {}
        self._hist: dict[str, tuple[tuple[float, ...], dict[Labels, list[float]]]] = {}

    def counter(self, name: str, help_text: str) -> None:
        self._meta[name] = ("counter", help_text)
        self._values.setdefault(name, {})

    def gauge(self, name: str, help_text: str) -> None:
        self._meta[name] = ("gauge", help_text)
        self._values.setdefault(name, {})

    def histogram(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self._meta[name] = ("histogram", help_text)
        self._hist.setdefault(name, (tuple(sorted(buckets)), {}))

    @staticmethod
    def _key(labels: dict[str, str] | None) -> Labels:
        return tuple(sorted((labels or {}).items()))

    def inc(self, name: str, amount: float = 1.0, labels: dict[str, str] | None = None) -> None:
        with self._lock:
            series = self._values[name]
            key = self._key(labels)
            series[key] = series.get(key, 0.0) + amount

    def set(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        with self._lock:
            self._values[name][self._key(labels)] = value

    def observe(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        with self._lock:
            buckets, series = self._hist[name]
            key = self._key(labels)
            # counts per bucket, then +Inf count, then sum
            row = series.setdefault(key, [0.0] * (len(buckets) + 2))
            for i, bound in enumerate(buckets):
                if value <= bound:
                    row[i] += 1
            row[len(buckets)] += 1
            row[len(buckets) + 1] += value

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        with self._lock:
            return self._values[name].get(self._key(labels), 0.0)

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            for name, (kind, help_text) in self._meta.items():
                lines.append(f"# HELP {name} {help_text}")
                lines.append(f"# TYPE {name} {kind}")
                if kind == "histogram":
                    buckets, series = self._hist[name]
                    for key, row in series.items():
                        for i, bound in enumerate(buckets):
                            le = _fmt_labels(key, [("le", _fmt_value(bound))])
                            lines.append(f"{name}_bucket{le} {_fmt_value(row[i])}")
                        inf = _fmt_labels(key, [("le", "+Inf")])
                        lines.append(f"{name}_bucket{inf} {_fmt_value(row[len(buckets)])}")
                        lines.append(
                            f"{name}_count{_fmt_labels(key)} {_fmt_value(row[len(buckets)])}"
                        )
                        lines.append(
                            f"{name}_sum{_fmt_labels(key)} {_fmt_value(row[len(buckets) + 1])}"
                        )
                else:
                    for key, v in self._values[name].items():
                        lines.append(f"{name}{_fmt_labels(key)} {_fmt_value(v)}")
        return "\n".join(lines) + "\n"


LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def serving_registry() -> Registry:
    """The metrics every kvpush server exports."""
    r = Registry()
    r.counter("kvpush_requests_total", "Completed requests by outcome.")
    r.counter("kvpush_body_disconnects_total", "Clients that went away while their body was read.")
    r.counter("kvpush_prompt_tokens_total", "Prompt tokens received.")
    r.counter("kvpush_generation_tokens_total", "Tokens generated.")
    r.gauge("kvpush_requests_running", "Requests being computed or waiting for KV.")
    r.gauge("kvpush_requests_waiting", "Requests queued for KV blocks.")
    r.gauge("kvpush_kv_blocks_total", "KV cache blocks.")
    r.gauge("kvpush_kv_blocks_free", "KV cache blocks not held by any request.")
    r.gauge("kvpush_kv_blocks_held", "KV cache blocks held by requests or transfers.")
    r.counter("kvpush_prefix_cache_queries_total", "Blocks looked up in the prefix cache.")
    r.counter("kvpush_prefix_cache_hits_total", "Blocks found in the prefix cache.")
    r.counter("kvpush_spec_decode_num_drafts_total", "Decode steps that carried drafts.")
    r.counter("kvpush_spec_decode_num_draft_tokens_total", "Draft tokens proposed.")
    r.counter("kvpush_spec_decode_num_accepted_tokens_total", "Draft tokens accepted.")
    r.gauge("kvpush_spec_decode_mean_acceptance_length", "1 + accepted drafts per drafted step.")
    r.histogram("kvpush_time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
    r.histogram("kvpush_e2e_request_latency_seconds", "Request latency.", LATENCY_BUCKETS)
    r.counter("kvpush_transfers_total", "KV transfers ended, by outcome and failure reason.")
    r.counter("kvpush_transfer_bytes_total", "KV bytes moved by transfers.")
    r.counter(
        "kvpush_transfers_rejected_total",
        "Transfers refused before allocating (the sender was told), by HTTP status.",
    )
    r.histogram("kvpush_transfer_latency_seconds", "KV transfer latency.", LATENCY_BUCKETS)
    r.counter(
        "kvpush_forged_messages_total",
        "Data-plane messages dropped unread because of who sent them, by reason "
        "(bad_mac, replayed, bad_key, unknown_agent, ...); none ends a transfer.",
    )
    r.counter(
        "kvpush_malformed_messages_total",
        "Data-plane messages from a known peer that could not be decoded.",
    )
    return r


class RegistryTransferMetrics:
    """The serving stack's `TransferMetricsSink`: transfer metrics into a registry made by
    `serving_registry`."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def count_ended(self, side: str, outcome: str, reason: str) -> None:
        self.registry.inc(
            "kvpush_transfers_total", labels={"side": side, "outcome": outcome, "reason": reason}
        )

    def add_bytes(self, side: str, nbytes: int) -> None:
        self.registry.inc("kvpush_transfer_bytes_total", nbytes, labels={"side": side})

    def observe_seconds(self, side: str, seconds: float) -> None:
        self.registry.observe("kvpush_transfer_latency_seconds", seconds, labels={"side": side})
