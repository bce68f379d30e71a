"""The doctor's steps, run in order against a live prefill/decode pair: one module each.

1. `step1_addresses`: the side channels resolve and answer TCP, where they advertise too.
2. `step2_side_channel`: every rank's metadata, read with the token.
3. `step3_compatibility`: each rank pair's caches agree.
4. `kvpush.doctor.data_plane`: a real write between the two servers' agents.
5. `step5_liveness`: round trips, deadlines, what the leases measured of the clocks.
6. `step6_health`: `/health`, `/metrics`, the CPU share of an idle server.

Each step reads what earlier ones found (`options.Observed`) and adds findings and figures
to its `StepResult`. Once a step fails, the later ones are listed as not run: what they
would say is explained by the failure. Every network call is bounded by the timeout given,
so a stopped or hung peer makes the doctor fail, never wait. Nothing here changes a
server's state: it reads metadata, `/health` and `/metrics`, and opens TCP connections;
step 4 writes into the servers' scratch buffers only.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpush.doctor.checks.options import DoctorOptions, Observed, Target
from kvpush.doctor.checks.step1_addresses import check_addresses
from kvpush.doctor.checks.step2_side_channel import check_side_channel, served_ranks
from kvpush.doctor.checks.step3_compatibility import check_compatibility, geometry_differences
from kvpush.doctor.checks.step5_liveness import check_liveness
from kvpush.doctor.checks.step6_health import check_health
from kvpush.doctor.data_plane import check_data_plane
from kvpush.doctor.report import Report, StepResult, Verdict
from kvpush.roles import PAIR_ROLES

__all__ = [
    "DoctorOptions",
    "Target",
    "geometry_differences",
    "run_doctor",
    "served_ranks",
]


def run_doctor(options: DoctorOptions) -> Report:
    observed = Observed()
    steps: list[StepResult] = []
    failed: StepResult | None = None
    for number, name, check in _STEPS:
        step = StepResult(number, name)
        if failed is not None:
            step.not_run_because = f"step {failed.number} ({failed.name}) failed"
        else:
            check(options, observed, step)
            if step.verdict is Verdict.FAIL:
                failed = step
        steps.append(step)
    return Report(options.prefill.address, options.decode.address, tuple(steps))


def _check_data_plane(options: DoctorOptions, seen: Observed, step: StepResult) -> None:
    check_data_plane(
        step,
        {role: [r.metadata for r in found] for role, found in seen.ranks.items()},
        {role: (options.target(role).host, options.target(role).port) for role in PAIR_ROLES},
        token=options.token,
        timeout_ms=options.timeout_ms,
    )


_Check = Callable[[DoctorOptions, Observed, StepResult], None]
_STEPS: tuple[tuple[int, str, _Check], ...] = (
    (1, "addresses", check_addresses),
    (2, "side channel", check_side_channel),
    (3, "compatibility", check_compatibility),
    (4, "data plane", _check_data_plane),
    (5, "liveness and clocks", check_liveness),
    (6, "health", check_health),
)
