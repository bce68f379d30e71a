"""What every step of the doctor shares: the targets and options it was given, what the
steps found so far (`Observed`), and the next actions for a server that does not answer."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush.doctor.addresses import SideAddress, where
from kvpush.doctor.http import HttpFailed
from kvpush.doctor.report import StepResult, Verdict
from kvpush.health import ServerHealth
from kvpush.sidechannel.client import FetchResult

MAX_RANKS = 64  # ranks asked for before giving up on finding the last one
SLOW_ROUND_TRIP_MS = 100.0
CPU_WINDOW_S = 0.5
BUSY_IDLE_CPU = 0.5


@dataclass(frozen=True, slots=True)
class Target:
    """One server: its side channel, and its HTTP base URL when given."""

    role: str  # "prefill" | "decode"
    host: str
    port: int
    http: str | None = None

    @property
    def address(self) -> str:
        return where(SideAddress(self.role, self.host, self.port, ()))


@dataclass(frozen=True, slots=True)
class DoctorOptions:
    prefill: Target
    decode: Target
    token: str | None = None
    timeout_ms: int = 2000
    round_trip_samples: int = 5
    slow_round_trip_ms: float = SLOW_ROUND_TRIP_MS  # a median above it is a warning
    # The window over which a server's CPU share is read (two /health readings), and
    # the share of one core above which an idle server is a warning.
    cpu_window_s: float = CPU_WINDOW_S
    busy_idle_cpu: float = BUSY_IDLE_CPU

    def target(self, role: str) -> Target:
        return self.prefill if role == "prefill" else self.decode

    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000


@dataclass(slots=True)
class Observed:
    """What the steps found so far, for the steps after them."""

    addresses: dict[str, SideAddress] = field(default_factory=dict)
    health: dict[str, ServerHealth] = field(default_factory=dict)
    health_status: dict[str, int] = field(default_factory=dict)
    health_read_at: dict[str, float] = field(default_factory=dict)  # time.monotonic()
    ranks: dict[str, list[FetchResult]] = field(default_factory=dict)


def stopped_action(role: str, what: str) -> str:
    return (
        f"the {role} server accepts connections on its {what} but does not answer: it is "
        "stopped (SIGSTOP, a debugger), hung or overloaded. Check it with `ps -o stat= -p "
        "PID` (T: stopped; resume it with `kill -CONT PID`), or restart it; on a loaded "
        "host, raise --timeout-ms"
    )


def http_failed(step: StepResult, role: str, exc: HttpFailed, otherwise: str) -> None:
    """An HTTP request to `role`'s server failed: a timeout means a stopped or hung server;
    anything else gets `otherwise` as its next action."""
    next_action = stopped_action(role, "HTTP port") if exc.timed_out else otherwise
    step.add(Verdict.FAIL, str(exc), side=role, next_action=next_action)
