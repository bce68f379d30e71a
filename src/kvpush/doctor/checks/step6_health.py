"""Step 6, health: each server's `/health` and `/metrics` (blocks held, transfers in
flight, finished and failed, forged messages, refused requests) and its CPU share
while idle; a vLLM server's connector series (`vllm_metrics`)."""

from __future__ import annotations

import time

import msgspec

from kvpush.doctor.checks.options import DoctorOptions, Observed, http_failed
from kvpush.doctor.checks.vllm_metrics import VLLM_PREFIX, vllm_metrics
from kvpush.doctor.http import HttpFailed, get_health, get_metrics
from kvpush.doctor.report import StepResult, Verdict
from kvpush.health import ServerHealth
from kvpush.metrics_text import Sample, total
from kvpush.roles import PAIR_ROLES


def check_health(options: DoctorOptions, seen: Observed, step: StepResult) -> None:
    asked = [r for r in PAIR_ROLES if options.target(r).http is not None]
    if not asked:
        step.add(
            Verdict.SKIP,
            "not checked: no HTTP URLs given (--prefill-http, --decode-http)",
        )
        return
    for role in asked:
        _one_health(role, options, seen, step)


def _one_health(role: str, options: DoctorOptions, seen: Observed, step: StepResult) -> None:
    base = options.target(role).http
    assert base is not None
    body = seen.health.get(role) or ServerHealth()
    status = body.status
    figures: dict[str, object] = {"status": status}
    if status != "ok":
        failure = body.runtime_failure or body.side_channel_failure or ""
        step.add(
            Verdict.FAIL,
            f"/health says {status!r} ({seen.health_status.get(role)}){': ' if failure else ''}"
            f"{failure}",
            side=role,
            next_action=f"restart the {role} server; its log says why it stopped serving",
        )
    try:
        samples = get_metrics(base, options.timeout_s)
    except HttpFailed as exc:
        http_failed(step, role, exc, f"check that --{role}-http is a kvpush server")
        step.figures[role] = figures
        return
    if any(s.name.startswith(VLLM_PREFIX) for s in samples):  # a vLLM server
        vllm_metrics(role, samples, step, figures)
        step.figures[role] = figures
        return
    if not any(s.name.startswith("kvpush_") for s in samples):
        step.add(
            Verdict.OK,
            f"{base}/metrics has no kvpush serving metrics (not a kvpush serve server?): "
            "blocks and transfers are not known",
            side=role,
        )
        step.figures[role] = figures
        return
    figures.update(_metric_figures(samples))
    transfers = body.transfers
    if transfers is not None:
        figures["runtime"] = msgspec.to_builtins(transfers)
    requests = body.side_channel_requests
    if requests is not None:
        figures["side_channel_requests"] = msgspec.to_builtins(requests)
    step.figures[role] = figures
    held, blocks = figures.get("kv_blocks_held"), figures.get("kv_blocks_total")
    in_flight = _in_flight(body)
    parts = [f"blocks held {_n(held)} of {_n(blocks)}"]
    if in_flight is not None:
        oldest = transfers.oldest_in_flight_s if transfers is not None else None
        parts.append(
            f"transfers in flight {in_flight}"
            + (f" (the oldest began {oldest:.1f} s ago)" if isinstance(oldest, float) else "")
        )
    parts.append(
        f"requests running {_n(figures.get('requests_running'))}, waiting "
        f"{_n(figures.get('requests_waiting'))}"
    )
    moved = figures.get("transfer_bytes")
    parts.append(
        f"transfers finished {_n(figures.get('transfers_finished'))}"
        + (f" ({_n(moved)} bytes)" if moved else "")
        + f", failed {_n(figures.get('transfers_failed'))}"
    )
    step.add(Verdict.OK, "; ".join(parts), side=role)
    failures = figures.get("transfer_failures")
    if isinstance(failures, dict) and failures:
        step.add(
            Verdict.WARN,
            "transfers have failed since it started: "
            + ", ".join(f"{k} {v:g}" for k, v in sorted(failures.items())),
            side=role,
            next_action=f"read the {role} server's log for those transfers; "
            "peer_timeout: raise --transfer-deadline-s or find the stalled peer",
        )
    forged = transfers.forged_messages if transfers is not None else None
    if forged:
        step.add(
            Verdict.WARN,
            "data-plane messages dropped unread because of who sent them: "
            + ", ".join(f"{k} {v}" for k, v in sorted(forged.items())),
            side=role,
            next_action="something that is not a verified peer is writing to this server's "
            "agent: set a token on both servers, and find that agent's host",
        )
    elif transfers is not None:
        step.add(Verdict.OK, "no forged or dropped data-plane messages", side=role)
    if requests is not None:
        bad = {k: v for k in _BAD_REQUESTS if (v := getattr(requests, k))}
        if bad:
            step.add(
                Verdict.WARN,
                "side-channel requests refused or dropped since it started: "
                + ", ".join(f"{k} {v}" for k, v in sorted(bad.items())),
                side=role,
                next_action="a client without the token, or of another kvpush version, "
                "asks this side channel: check its peers' --token-file and versions",
            )
    _cpu_share(role, base, options, seen, step, figures)


def _cpu_share(
    role: str,
    base: str,
    options: DoctorOptions,
    seen: Observed,
    step: StepResult,
    figures: dict[str, object],
) -> None:
    """The server's CPU share between its /health of step 1 and one read now (at least
    `cpu_window_s` later, on the server's clock): an idle kvpush server should use
    almost none; one that spins is a busy-polling loop."""
    known = seen.health.get(role)
    first = known.cpu if known is not None else None
    if first is None:
        return  # not kvpush serve: its CPU is not published
    wait = options.cpu_window_s - (time.monotonic() - seen.health_read_at.get(role, 0.0))
    if wait > 0:
        time.sleep(wait)
    try:
        _, body = get_health(base, options.timeout_s)
    except HttpFailed as exc:
        http_failed(step, role, exc, f"the {role} server stopped answering /health")
        return
    second = body.cpu if body is not None else None

    def spent(key: str) -> float | None:
        a = getattr(first, key)
        b = getattr(second, key) if second is not None else None
        return None if a is None or b is None else b - a

    window, process_s, thread_s = spent("at_s"), spent("process_s"), spent("runtime_thread_s")
    if window is None or window <= 0 or process_s is None:
        return  # an answer without these figures (or a server restarted between)
    process = process_s / window
    share: dict[str, object] = {"window_s": round(window, 3), "process": round(process, 3)}
    text = f"CPU over {window:.1f} s: the process {process:.0%} of a core"
    if thread_s is not None:
        thread = thread_s / window
        share["runtime_thread"] = round(thread, 3)
        text += f", its runtime thread {thread:.0%}"
    busy = [_in_flight(b) for b in (seen.health[role], body)]
    idle = busy == [0, 0] and figures.get("requests_running") in (0, None)
    share["idle"] = idle
    figures["cpu"] = share
    if not idle:
        step.add(Verdict.OK, f"{text} (while serving)", side=role)
    elif process > options.busy_idle_cpu:
        step.add(
            Verdict.WARN,
            f"{text}, with nothing in flight: an idle server should use almost none",
            side=role,
            next_action=f"find the thread that spins (top -H -p PID on the {role} host): "
            "NIXL's own progress thread (kvpush turns it off; a NIXL or UCX setting may "
            "turn it on) or an --idle-poll-ms near 0",
        )
    else:
        step.add(Verdict.OK, f"{text}, with nothing in flight", side=role)


def _in_flight(health: ServerHealth | None) -> int | None:
    transfers = health.transfers if health is not None else None
    return transfers.in_flight if transfers is not None else None


_BAD_REQUESTS = ("refused_auth", "malformed", "dropped", "internal_errors")


def _n(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "?" if value is None else str(value)


def _metric_figures(samples: list[Sample]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, name in (
        ("kv_blocks_total", "kvpush_kv_blocks_total"),
        ("kv_blocks_held", "kvpush_kv_blocks_held"),
        ("requests_running", "kvpush_requests_running"),
        ("requests_waiting", "kvpush_requests_waiting"),
        ("transfer_bytes", "kvpush_transfer_bytes_total"),
        ("transfers_rejected", "kvpush_transfers_rejected_total"),
    ):
        out[key] = total(samples, name)
    out["transfers_finished"] = total(samples, "kvpush_transfers_total", outcome="finished") or 0
    failures: dict[str, float] = {}
    for s in samples:
        if s.name == "kvpush_transfers_total" and s.labels.get("outcome") == "failed":
            reason = s.labels.get("reason", "unknown")
            failures[reason] = failures.get(reason, 0) + s.value
    out["transfers_failed"] = sum(failures.values())
    out["transfer_failures"] = failures
    return out
