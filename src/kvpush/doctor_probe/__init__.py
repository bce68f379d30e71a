"""The server side of `kvpush doctor`'s data-plane check (its step 4), as a service that
a `Node` is given (`DoctorProbe`), as the bench's control kinds are: the runtime and the
layers below it never name the doctor.

- `service`: `DoctorProbe`, the node service: its request kinds on the side channel,
  and a `RankProbe` for each rank.
- `rank`: `RankProbe`, the checks of one rank, a `kvpush.runtime.services.RuntimeService`
  that the rank's runtime drives.
- `scratch`: the scratch buffer the checks write into, and the bytes they write.
"""

from kvpush.doctor_probe.rank import PROBE_TIMEOUT_S, ProbeRefused, ProbeReport, RankProbe
from kvpush.doctor_probe.service import DOCTOR_DIGEST, DOCTOR_RESULT, DOCTOR_WRITE, DoctorProbe

__all__ = [
    "DOCTOR_DIGEST",
    "DOCTOR_RESULT",
    "DOCTOR_WRITE",
    "PROBE_TIMEOUT_S",
    "DoctorProbe",
    "ProbeRefused",
    "ProbeReport",
    "RankProbe",
]
