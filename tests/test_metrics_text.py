"""Reading `/metrics` (`kvpush.metrics_text`, prometheus_client's parser): the samples a
server's exposition holds, their series as the exposition writes them, and text that is
not of the format refused saying why. Real servers' answers are read in
tests/test_serving_pd.py (the demo's figures) and tests/test_cli_doctor.py (the doctor's)."""

from __future__ import annotations

import pytest

from kvpush.metrics_text import MalformedMetrics, Sample, parse_metrics, series, total

EXPOSITION = """\
# HELP kvpush_transfers_total Transfers by outcome.
# TYPE kvpush_transfers_total counter
kvpush_transfers_total{side="sender",outcome="finished",reason=""} 5
kvpush_transfers_total{side="sender",outcome="failed",reason="peer_timeout"} 2
# TYPE kvpush_transfer_latency_seconds histogram
kvpush_transfer_latency_seconds_bucket{side="receiver",le="+Inf"} 3
kvpush_transfer_latency_seconds_sum{side="receiver"} 0.25
kvpush_transfer_latency_seconds_count{side="receiver"} 3
vllm:num_requests_running{model_name="a \\"quoted\\" name"} 1
kvpush_kv_blocks_total 40
"""


def test_every_sample_is_read_with_its_labels_and_series() -> None:
    samples = parse_metrics(EXPOSITION)
    assert [s.name for s in samples] == [
        "kvpush_transfers_total",
        "kvpush_transfers_total",
        "kvpush_transfer_latency_seconds_bucket",
        "kvpush_transfer_latency_seconds_sum",
        "kvpush_transfer_latency_seconds_count",
        "vllm:num_requests_running",
        "kvpush_kv_blocks_total",
    ]
    assert samples[1] == Sample(
        "kvpush_transfers_total",
        {"side": "sender", "outcome": "failed", "reason": "peer_timeout"},
        2.0,
    )
    assert total(samples, "kvpush_transfers_total") == 7.0
    assert total(samples, "kvpush_transfers_total", outcome="finished") == 5.0
    assert total(samples, "kvpush_transfers_total", outcome="cancelled") is None
    # The series as the exposition wrote it, escapes and all.
    lines = [line for line in EXPOSITION.splitlines() if not line.startswith("#")]
    assert [f"{series(s)} {s.value:g}" for s in samples] == lines


def test_text_that_is_not_the_format_is_refused_saying_why() -> None:
    with pytest.raises(MalformedMetrics, match=r"^not Prometheus text \(ValueError: "):
        parse_metrics("<html><body>not found</body></html>\n")
    with pytest.raises(MalformedMetrics, match="expected lines of `name"):
        parse_metrics("kvpush_kv_blocks_total forty\n")
