"""The serving stack's Prometheus metrics, kept by `prometheus_client`.

A `Registry` names its metrics once, with their label names, and is then updated by name:
counters, gauges and histograms are `prometheus_client`'s own (thread-safe), in a
`CollectorRegistry` of the registry's own. A counter whose count is kept elsewhere (the
engine's prefix-cache and speculation counts, the runtime's dropped messages) is declared
`copied`: `set` copies the latest count in, and it is exported as a `CounterMetricFamily`,
`prometheus_client`'s way of exporting another system's counts.

`render` writes the text format as this server always has (integral values without
`.0`, no `_created` series), so what scrapers and the tools already read is unchanged.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector


class _CopiedCounter(Collector):
    """A counter copied from the count that another object keeps."""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str]) -> None:
        self._name = name
        self._help = help_text
        self._labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._values: dict[tuple[str, ...], float] = {}

    def set(self, value: float, labels: dict[str, str] | None) -> None:
        key = tuple((labels or {})[k] for k in self._labelnames)
        with self._lock:
            self._values[key] = value

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._help, labels=self._labelnames)
        with self._lock:
            for key, value in self._values.items():
                family.add_metric(list(key), value)
        yield family


_Metric = Counter | Gauge | Histogram | _CopiedCounter


class Registry:
    """Metrics by name; each is declared once, with the names of its labels."""

    def __init__(self) -> None:
        self._registry = CollectorRegistry(auto_describe=False)
        self._metrics: dict[str, _Metric] = {}

    def counter(
        self, name: str, help_text: str, labels: Sequence[str] = (), *, copied: bool = False
    ) -> None:
        """`copied`: the count is kept elsewhere and copied in with `set`."""
        if copied:
            collector = _CopiedCounter(name, help_text, labels)
            self._registry.register(collector)
            self._metrics[name] = collector
        else:
            self._metrics[name] = Counter(name, help_text, labels, registry=self._registry)

    def gauge(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self._metrics[name] = Gauge(name, help_text, labels, registry=self._registry)

    def histogram(
        self, name: str, help_text: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> None:
        self._metrics[name] = Histogram(
            name, help_text, labels, registry=self._registry, buckets=sorted(buckets)
        )

    def _child(self, name: str, labels: dict[str, str] | None) -> _Metric:
        metric = self._metrics[name]
        if labels and not isinstance(metric, _CopiedCounter):
            return metric.labels(**labels)
        return metric

    def inc(self, name: str, amount: float = 1.0, labels: dict[str, str] | None = None) -> None:
        child = self._child(name, labels)
        if not isinstance(child, Counter | Gauge):
            raise TypeError(f"{name} is not a counter or a gauge")
        child.inc(amount)

    def set(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        child = self._child(name, labels)
        if isinstance(child, _CopiedCounter):
            child.set(value, labels)
        elif isinstance(child, Gauge):
            child.set(value)
        else:
            raise TypeError(f"{name} is not a gauge or a copied counter")

    def observe(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        child = self._child(name, labels)
        if not isinstance(child, Histogram):
            raise TypeError(f"{name} is not a histogram")
        child.observe(value)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """The value of one series of a counter or a gauge; 0 if it has none yet."""
        found = self._registry.get_sample_value(name, labels or {})
        return 0.0 if found is None else found

    def render(self) -> str:
        lines: list[str] = []
        for family in self._registry.collect():
            name = f"{family.name}_total" if family.type == "counter" else family.name
            lines.append(f"# HELP {name} {family.documentation}")
            lines.append(f"# TYPE {name} {family.type}")
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    lines.append(f"{sample.name}{_fmt_labels(sample.labels)} {_fmt(sample.value)}")
        return "\n".join(lines) + "\n"


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _fmt_labels(labels: dict[str, str]) -> str:
    """Labels in name order, a histogram's bound (`le`) last and written as a number."""
    items = [(k, labels[k]) for k in sorted(labels) if k != "le"]
    if "le" in labels:
        items.append(("le", _fmt(float(labels["le"]))))
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def serving_registry() -> Registry:
    """The metrics every kvpush server exports."""
    r = Registry()
    r.counter("kvpush_requests_total", "Completed requests by outcome.", ["outcome"])
    r.counter("kvpush_body_disconnects_total", "Clients that went away while their body was read.")
    r.counter("kvpush_prompt_tokens_total", "Prompt tokens received.")
    r.counter("kvpush_generation_tokens_total", "Tokens generated.")
    r.gauge("kvpush_requests_running", "Requests being computed or waiting for KV.")
    r.gauge("kvpush_requests_waiting", "Requests queued for KV blocks.")
    r.gauge("kvpush_kv_blocks_total", "KV cache blocks.")
    r.gauge("kvpush_kv_blocks_free", "KV cache blocks not held by any request.")
    r.gauge("kvpush_kv_blocks_held", "KV cache blocks held by requests or transfers.")
    # The engine counts these; each update copies its counts in.
    r.counter(
        "kvpush_prefix_cache_queries_total", "Blocks looked up in the prefix cache.", copied=True
    )
    r.counter("kvpush_prefix_cache_hits_total", "Blocks found in the prefix cache.", copied=True)
    r.counter(
        "kvpush_spec_decode_num_drafts_total", "Decode steps that carried drafts.", copied=True
    )
    r.counter("kvpush_spec_decode_num_draft_tokens_total", "Draft tokens proposed.", copied=True)
    r.counter("kvpush_spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", copied=True)
    r.gauge("kvpush_spec_decode_mean_acceptance_length", "1 + accepted drafts per drafted step.")
    r.histogram("kvpush_time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
    r.histogram("kvpush_e2e_request_latency_seconds", "Request latency.", LATENCY_BUCKETS)
    r.counter(
        "kvpush_transfers_total",
        "KV transfers ended, by outcome and failure reason.",
        ["outcome", "reason", "side"],
    )
    r.counter("kvpush_transfer_bytes_total", "KV bytes moved by transfers.", ["side"])
    r.counter(
        "kvpush_transfers_rejected_total",
        "Transfers refused before allocating (the sender was told), by HTTP status.",
        ["status"],
    )
    r.histogram(
        "kvpush_transfer_latency_seconds", "KV transfer latency.", LATENCY_BUCKETS, ["side"]
    )
    # The runtime counts these; the role copies them in at each scrape.
    r.counter(
        "kvpush_forged_messages_total",
        "Data-plane messages dropped unread because of who sent them, by reason "
        "(bad_mac, replayed, bad_key, unknown_agent, ...); none ends a transfer.",
        ["reason"],
        copied=True,
    )
    r.counter(
        "kvpush_malformed_messages_total",
        "Data-plane messages from a known peer that could not be decoded.",
        copied=True,
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
