"""Step 6 on a vLLM server with KvpushConnector: what its `/metrics` says.

vLLM publishes no kvpush `/health` figures; its `/metrics` has the connector's own series
(`vllm:kvpush_*`: transfers ended by side, outcome and reason, bytes, time from the
step that started them), the series vLLM's NIXL connectors publish, which the connector
fills the same way (`vllm:nixl_*`: per transfer part, time with a write in flight,
bytes, failed parts, expired leases), and vLLM's own request and KV-cache gauges.
"""

from __future__ import annotations

from kvpush.doctor.report import StepResult, Verdict
from kvpush.metrics_text import Sample, total

__all__ = ["VLLM_PREFIX", "vllm_metrics"]

# vLLM's series: the connector's appear with its first transfer, vLLM's own at once.
VLLM_PREFIX = "vllm:"


def vllm_metrics(
    role: str, samples: list[Sample], step: StepResult, figures: dict[str, object]
) -> None:
    """Read a vLLM server's series into `figures` and `step` (one line, and a warning
    with the next action where transfers failed or expired for a reason other than
    `_IN_COURSE`'s)."""
    running = total(samples, "vllm:num_requests_running")
    waiting = total(samples, "vllm:num_requests_waiting")
    usage = total(samples, "vllm:kv_cache_usage_perc")
    finished = total(samples, "vllm:kvpush_transfers_total", outcome="finished") or 0.0
    failures: dict[str, float] = {}
    for s in samples:
        if s.name == "vllm:kvpush_transfers_total" and s.labels.get("outcome") != "finished":
            key = f"{s.labels.get('outcome', '?')}/{s.labels.get('reason', '?')}"
            if s.value:
                failures[key] = failures.get(key, 0.0) + s.value
    moved = total(samples, "vllm:kvpush_transfer_bytes_total") or 0.0
    seconds = _mean(samples, "vllm:kvpush_transfer_seconds")
    xfer = _mean(samples, "vllm:nixl_xfer_time_seconds")
    parts = total(samples, "vllm:nixl_xfer_time_seconds_count")
    failed_parts = total(samples, "vllm:nixl_num_failed_transfers_total")
    expired = total(samples, "vllm:nixl_num_kv_expired_reqs_total")
    figures.update(
        {
            "requests_running": running,
            "requests_waiting": waiting,
            "kv_cache_usage": usage,
            "transfers_finished": finished,
            "transfer_failures": failures,
            "transfer_bytes": moved,
            "transfer_seconds_mean": seconds,
            "nixl_parts": parts,
            "nixl_xfer_seconds_mean": xfer,
            "nixl_failed_parts": failed_parts,
            "nixl_expired": expired,
        }
    )
    text = (
        f"vLLM's /metrics: requests running {_n(running)}, waiting {_n(waiting)}"
        + (f", KV cache {usage:.0%} used" if usage is not None else "")
        + f"; kvpush transfers finished {_n(finished)} ({_n(moved)} bytes"
        + (f", {seconds * 1000:.1f} ms each on average" if seconds is not None else "")
        + f"), not finished {_n(sum(failures.values()))}"
    )
    if parts:
        text += (
            f"; NIXL writes of {_n(parts)} transfer parts"
            + (f", {xfer * 1000:.2f} ms in flight on average" if xfer is not None else "")
            + f", failed parts {_n(failed_parts)}, expired {_n(expired)}"
        )
    if not any(s.name.startswith("vllm:kvpush_") for s in samples):
        text += (
            " (no vllm:kvpush_* series yet: none before the first transfer, or not KvpushConnector)"
        )
    step.add(Verdict.OK, text, side=role)
    faults = {k: v for k, v in failures.items() if k.rsplit("/", 1)[-1] not in _IN_COURSE}
    if faults or failed_parts or expired:
        what = ", ".join(f"{k} {v:g}" for k, v in sorted(faults.items()))
        if failed_parts or expired:
            what += ("; " if what else "") + (
                f"NIXL parts failed {_n(failed_parts)}, expired {_n(expired)}"
            )
        step.add(
            Verdict.WARN,
            f"transfers have not finished since it started: {what}",
            side=role,
            next_action=f"read the {role} server's log for those transfers (kvpush logs "
            "each with its reason); expired or peer_timeout: the other server took too "
            "long, so raise transfer_deadline_s or lease_s in kv_connector_extra_config, "
            "or find the stalled peer",
        )


# Ends that are no fault of the pair, as vLLM's NIXL series count them (not in
# vllm:nixl_num_failed_transfers): the engine aborted the request (its client went),
# the decode refused it before allocating (it held every block), the server stopped.
_IN_COURSE = frozenset({"cancelled", "rejected", "shutdown"})


def _mean(samples: list[Sample], histogram: str) -> float | None:
    count = total(samples, f"{histogram}_count")
    whole = total(samples, f"{histogram}_sum")
    return whole / count if count and whole is not None else None


def _n(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "?" if value is None else str(value)
