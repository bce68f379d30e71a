"""Step 5, liveness and clocks: side-channel round trips, the deadlines in force, and
what the prefill's leases measured of each decode rank's clock."""

from __future__ import annotations

import statistics

from kvpush.doctor.checks.options import DoctorOptions, Observed
from kvpush.doctor.checks.step2_side_channel import side_channel_action
from kvpush.doctor.report import StepResult, Verdict
from kvpush.errors import SideChannelError
from kvpush.roles import PAIR_ROLES
from kvpush.sidechannel.client import fetch_metadata_timed


def check_liveness(options: DoctorOptions, seen: Observed, step: StepResult) -> None:
    deadlines: dict[str, float] = {}
    for role in PAIR_ROLES:
        t = options.target(role)
        samples: list[float] = []
        for _ in range(options.round_trip_samples):
            try:
                r = fetch_metadata_timed(
                    t.host, t.port, 0, timeout_ms=options.timeout_ms, token=options.token
                )
            except SideChannelError as exc:
                step.add(
                    Verdict.FAIL,
                    f"it stopped answering: {type(exc).__name__}: {exc}",
                    side=role,
                    next_action=side_channel_action(role, exc, options),
                )
                break
            samples.append(r.round_trip_s * 1000)
        figures: dict[str, object] = {}
        if samples:
            median = statistics.median(samples)
            figures["side_channel_round_trip_ms"] = {
                "min": round(min(samples), 3),
                "median": round(median, 3),
                "max": round(max(samples), 3),
                "samples": len(samples),
            }
            text = (
                f"side-channel round trip (connect, request, reply) over {len(samples)} tries: "
                f"min {min(samples):.2f} ms, median {median:.2f} ms, max {max(samples):.2f} ms"
            )
            if median > options.slow_round_trip_ms:
                step.add(
                    Verdict.WARN,
                    text,
                    side=role,
                    next_action=f"the {role} server answers slowly (over "
                    f"{options.slow_round_trip_ms:g} ms): check its host's load and the network "
                    "path; where that is expected, raise --slow-round-trip-ms",
                )
            else:
                step.add(Verdict.OK, text, side=role)
        health = seen.health.get(role)
        for key, value in (
            ("transfer_deadline_s", health.transfer_deadline_s if health else None),
            ("queue_timeout_s", health.queue_timeout_s if health else None),
            ("liveness_timeout_s", health.liveness_timeout_s if health else None),
        ):
            if value is not None:
                figures[key] = value
        if "transfer_deadline_s" in figures:
            deadlines[role] = float(figures["transfer_deadline_s"])  # type: ignore[arg-type]
            shown = ", ".join(
                f"{k.replace('_s', '')} {figures[k]} s"
                for k in ("transfer_deadline_s", "queue_timeout_s", "liveness_timeout_s")
                if k in figures
            )
            step.add(Verdict.OK, f"in force: {shown.replace('_', ' ')}", side=role)
        step.figures[role] = figures
    decode_health = seen.health.get("decode")
    queue = decode_health.queue_timeout_s if decode_health is not None else None
    if queue is not None:
        for role, deadline in deadlines.items():
            if deadline <= queue:
                step.add(
                    Verdict.WARN,
                    f"the {role} server's transfer deadline ({deadline} s) is not above the "
                    f"decode server's queue timeout ({queue} s): a request that waits in the "
                    "decode queue for KV blocks can see its transfer fail first",
                    side=role,
                    next_action=f"start the {role} server with --transfer-deadline-s above "
                    f"{queue} (the decode server's --queue-timeout-s)",
                )
    if not deadlines:
        step.add(
            Verdict.OK,
            "transfer deadlines: not known (give --prefill-http and --decode-http to read them)",
        )
    _clock_bounds(options, seen, step)


def _clock_bounds(options: DoctorOptions, seen: Observed, step: StepResult) -> None:
    """What the prefill's leases measured of each decode rank's clock: the data plane's
    heartbeat round trip, by which a lease is taken to end sooner than it may."""
    health = seen.health.get("prefill")
    transfers = health.transfers if health is not None else None
    if transfers is None:
        why = (
            "give --prefill-http to read what the prefill's leases measured"
            if health is None
            else "the prefill server's /health does not publish what its leases measured; "
            "kvpush serve's does"
        )
        step.add(Verdict.OK, f"heartbeat round trip and clock bound: not known ({why})")
        return
    found: dict[str, object] = {}
    for r in seen.ranks.get("decode", []):
        bound = transfers.clock_bounds.get(r.metadata.agent_name)
        rank = r.metadata.rank
        if bound is None:
            step.add(
                Verdict.OK,
                f"heartbeat round trip to decode rank {rank}: not measured yet (no transfer "
                "between them since the prefill server started; its first one measures it)",
            )
            continue
        rtt_ms = bound.round_trip_s * 1000
        found[str(rank)] = {"round_trip_ms": round(rtt_ms, 3), "age_s": round(bound.age_s, 1)}
        text = (
            f"data-plane heartbeat round trip to decode rank {rank}: {rtt_ms:.2f} ms "
            f"({bound.age_s:.0f} s ago): the prefill bounds that rank's clock to "
            f"within {rtt_ms:.2f} ms, and takes each lease to end that much sooner"
        )
        if rtt_ms > options.slow_round_trip_ms:
            step.add(
                Verdict.WARN,
                text,
                side="prefill",
                next_action="heartbeats between the servers' agents are slow (over "
                f"{options.slow_round_trip_ms:g} ms): check the hosts' load and the "
                "transport UCX uses between them (UCX_TLS, UCX_NET_DEVICES); where that "
                "is expected, raise --slow-round-trip-ms",
            )
        else:
            step.add(Verdict.OK, text, side="prefill")
    if found:
        step.figures.setdefault("prefill", {})["heartbeat_round_trip_ms"] = found  # type: ignore[index]
