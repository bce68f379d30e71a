"""A server's `/metrics` (the Prometheus text format), read once, by `prometheus_client`'s
parser: the diagnostics and the demo take their figures from these samples, and neither
parses the format by hand."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvpush.errors import KVPushError

__all__ = ["MalformedMetrics", "Sample", "parse_metrics", "series", "total"]


class MalformedMetrics(KVPushError, ValueError):
    """Text that is not a Prometheus exposition; the message says what the parser found."""


@dataclass(frozen=True, slots=True)
class Sample:
    name: str  # the sample's own name: `x_total`, `x_bucket`, `x_sum`, ...
    labels: dict[str, str]
    value: float


def parse_metrics(text: str) -> list[Sample]:
    """Every sample of `text`, in order. Raises `MalformedMetrics` for text that is not
    of the format, saying what was wrong."""
    try:
        return [
            Sample(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]
    except (ValueError, IndexError, KeyError) as exc:
        raise MalformedMetrics(
            f"not Prometheus text ({type(exc).__name__}: {exc}); expected lines of "
            '`name{label="value",...} number`, and # comments'
        ) from None


def total(samples: list[Sample], name: str, **labels: str) -> float | None:
    """The sum of `name`'s samples whose labels include `labels`; None if there are none."""
    chosen = [
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(chosen) if chosen else None


def series(sample: Sample) -> str:
    """A sample's series as the exposition writes it: `name{label="value",...}`."""
    if not sample.labels:
        return sample.name
    escaped = (
        (k, v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n"))
        for k, v in sample.labels.items()
    )
    return sample.name + "{" + ",".join(f'{k}="{v}"' for k, v in escaped) + "}"
