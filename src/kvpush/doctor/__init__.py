"""`kvpush doctor`: what is wrong with a live prefill/decode pair, with the next action.

`run_doctor(DoctorOptions(...))` runs the steps of `kvpush.doctor.checks` in order
(addresses, side channel, compatibility, data plane, liveness and clocks, health) and
returns a `Report`, which the CLI renders as text or JSON. The doctor only reads: side
channel metadata, `/health` and `/metrics`; it changes no server state.
"""

from kvpush.doctor.checks import DoctorOptions, Target, run_doctor
from kvpush.doctor.report import Finding, Report, StepResult, Verdict

__all__ = ["DoctorOptions", "Finding", "Report", "StepResult", "Target", "Verdict", "run_doctor"]
