"""The engine thread: the one owner of an `Engine`, fed by a command queue.

HTTP handlers never touch the engine. They `submit()` a job carrying a `sink` (a
callable the engine thread calls with each event for that request) and `abort()` it if
the client goes away. The thread drains commands, runs one `Engine.step()` while there is
work (so requests that arrive mid-generation join the next step: continuous batching),
and sleeps on the queue when idle. An exception inside a step fails every request in
flight with the error and the thread keeps serving the next ones.

Admission, as vLLM's scheduler does it: a request the engine cannot place yet waits in a
FIFO queue for blocks, bounded in length (`AdmissionConfig.max_waiting`: one more is
refused with 429) and in time (`queue_timeout_s`: then 503). Both refusals carry a
retry hint. A request says it started with its first `Tokens` (or `Accepted`, for one
that waits for its KV from elsewhere), so a refusal can still come first.

The loop is `EngineWorker._run`, below, and reads top to bottom: drain the commands, let
the role work, refuse what waited too long, run one step, publish the statistics. What a
server does beyond serving requests whole is its `Role`, an object the loop calls at named
points: `PlainRole` here does nothing at any of them; `prefill_role.PrefillRole` and
`decode_role.DecodeRole` move KV through a `PushRuntime`. The loop and its role share one
table of requests (`Jobs`), and only the engine thread touches either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvpush.errors import ClosedError
from kvpush.mailbox import Mailbox
from kvpush.serving.engine import Engine, EngineStats, FinishReason, RequestStats
from kvpush.serving.sampling import InvalidRequest, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """How many requests may wait for KV blocks, and for how long."""

    max_waiting: int = 512
    queue_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be 0 or more, got {self.max_waiting}")
        if self.queue_timeout_s <= 0:
            raise ValueError(f"queue_timeout_s must be positive, got {self.queue_timeout_s}")


# How soon a refused client should try again: about when blocks are likely to be free.
RETRY_AFTER_S = 1.0
# How long the engine thread sleeps on its command queue when nothing is running.
IDLE_WAIT_S = 0.5


@dataclass(frozen=True, slots=True)
class Accepted:
    """The engine took the request; tokens follow."""


@dataclass(frozen=True, slots=True)
class Rejected:
    status: int
    message: str
    retry_after_s: float | None = None  # set when trying again later may succeed


@dataclass(frozen=True, slots=True)
class Tokens:
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Done:
    reason: FinishReason
    stats: RequestStats | None
    error: str | None = None
    kv_transfer_params: dict[str, object] | None = None
    status: int = 500  # the HTTP status an error maps to


Event = Accepted | Rejected | Tokens | Done
Sink = Callable[[Event], None]


@dataclass(slots=True)
class Job:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: Sink
    kv_transfer_params: dict[str, object] | None = None
    submitted_at: float = field(default_factory=time.monotonic)


class Jobs:
    """The requests an engine thread serves, by request id, and the admission rule they
    wait under. The loop and its role share this one table; a request leaves it when its
    answer is decided, so whoever takes it out (`pop`) sends its last event."""

    def __init__(self, admission: AdmissionConfig | None = None) -> None:
        self.admission = admission or AdmissionConfig()
        self._by_id: dict[str, Job] = {}

    def add(self, job: Job) -> None:
        self._by_id[job.request_id] = job

    def get(self, request_id: str) -> Job | None:
        return self._by_id.get(request_id)

    def pop(self, request_id: str) -> Job | None:
        return self._by_id.pop(request_id, None)

    def all(self) -> list[Job]:
        """Every request in the table, first added first (a copy: pop while iterating)."""
        return list(self._by_id.values())

    def queue_full(self, num_queued: int) -> Rejected | None:
        """The refusal for one more request when `num_queued` already wait; None: room."""
        if num_queued < self.admission.max_waiting:
            return None
        return Rejected(
            429,
            f"too many requests waiting for KV blocks ({num_queued}, the limit is "
            f"{self.admission.max_waiting}): retry later",
            RETRY_AFTER_S,
        )

    def queue_timeout(self) -> Rejected:
        """The refusal for a request that waited for blocks longer than the timeout."""
        return Rejected(
            503,
            f"no KV blocks became free for this request within "
            f"{self.admission.queue_timeout_s:g} s: the server is overloaded, retry later",
            RETRY_AFTER_S,
        )


class Role(Protocol):
    """What a server adds to the engine loop beyond serving requests whole.

    Each method is called by the loop at one point, named here, always on the engine
    thread. A method that returns a bool says whether the role dealt with that request
    itself; False leaves it to the loop, which then does what a plain server does."""

    def idle_wait(self) -> float:
        """Waiting for a command while nothing runs: how long to sleep before looking again."""

    def queued(self) -> int:
        """Requests waiting in the role's own queue, not yet in the engine (they count
        against `max_waiting` and show in `num_waiting`)."""

    def take(self, job: Job) -> bool:
        """Command `submit`: take a new request if it is the role's (accept or refuse it)."""

    def abort(self, job: Job) -> bool:
        """Command `abort`: the client went away (the loop has taken the job out of the table)."""

    def refuse_transfer(
        self, kv_transfer_params: dict[str, object], prompt_token_ids: list[int] | None, why: str
    ) -> None:
        """Command `refuse`: see `EngineWorker.refuse_transfer`."""

    def abort_transfer(self, transfer_id: str) -> None:
        """Command `abort_transfer`: see `EngineWorker.abort_transfer`."""

    def before_step(self) -> bool:
        """Before each step: the role's own work. True when blocks may have come back,
        so a stalled engine tries again."""

    def drop_queued(self, job: Job) -> bool:
        """Expiry: a request waited in the engine's queue too long (the loop has taken it
        out of the table and refuses it next)."""

    def expire(self, now: float) -> None:
        """Expiry, after the engine's queue: refuse what waited too long in the role's."""

    def finished(self, job: Job, reason: FinishReason) -> bool:
        """After a step: a request's last token is out. True: the role answered it."""

    def fail_all(self, message: str) -> None:
        """A step failed, or the server stops: end the role's requests with `message`
        (the loop then fails what is left in the table)."""


class PlainRole:
    """A server that serves every request whole (`--role both`): nothing to add."""

    def idle_wait(self) -> float:
        return IDLE_WAIT_S

    def queued(self) -> int:
        return 0

    def take(self, job: Job) -> bool:
        return False

    def abort(self, job: Job) -> bool:
        return False

    def refuse_transfer(
        self, kv_transfer_params: dict[str, object], prompt_token_ids: list[int] | None, why: str
    ) -> None:
        pass

    def abort_transfer(self, transfer_id: str) -> None:
        pass

    def before_step(self) -> bool:
        return False

    def drop_queued(self, job: Job) -> bool:
        return False

    def expire(self, now: float) -> None:
        pass

    def finished(self, job: Job, reason: FinishReason) -> bool:
        return False

    def fail_all(self, message: str) -> None:
        pass


class EngineWorker:
    """Runs an engine on its own thread; `start()` and `close()` own that thread.

    `role` and `jobs` come together: a role is built over the table it shares with the
    loop (`disagg.build_role`). Without them the server is plain."""

    def __init__(
        self,
        engine: Engine,
        role: Role | None = None,
        *,
        jobs: Jobs | None = None,
        name: str = "kvpush-engine",
    ) -> None:
        self.engine = engine
        self.role: Role = role or PlainRole()
        self.jobs = jobs or Jobs()
        self._name = name
        # Set when a step placed and ran nothing (every block held): waiting requests
        # then wait for a command or a transfer's end instead of spinning.
        self._stalled = False
        # Not a queue.SimpleQueue: its timed get could sleep past its timeout until
        # the next command (kvpush.mailbox), with transfers in flight.
        self._commands: Mailbox[tuple[str, object]] = Mailbox()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._stats = engine.statistics()
        self._closed = False
        self.on_stats: Callable[[EngineStats], None] | None = None

    # -- any thread --------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine worker already started")
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("engine thread did not stop within %.1fs", timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def submit(self, job: Job) -> None:
        if self._closed:
            raise ClosedError("the engine worker is closed")
        self._commands.put(("submit", job))

    def abort(self, request_id: str) -> None:
        if not self._closed:
            self._commands.put(("abort", request_id))

    def refuse_transfer(
        self, kv_transfer_params: dict[str, object], prompt_token_ids: list[int] | None, why: str
    ) -> None:
        """A request carrying `kv_transfer_params` was refused before it reached the engine:
        the role tells the other side at once (the decode role: the prefill server)."""
        if not self._closed:
            self._commands.put(("refuse", (kv_transfer_params, prompt_token_ids, why)))

    def abort_transfer(self, transfer_id: str) -> None:
        """Cancel the transfer a client names (the proxy, when the other leg failed)."""
        if not self._closed:
            self._commands.put(("abort_transfer", transfer_id))

    def statistics(self) -> EngineStats:
        """The engine's statistics as of its last step (a snapshot; no locking)."""
        return self._stats

    # -- engine thread: the loop -------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            # Only engine work runs without waiting. A transfer in flight is waited for in
            # `role.idle_wait()` slices: a take without a timeout never drops the GIL, so spinning
            # here would hold off the push runtime's thread (which must poll NIXL to move
            # this very transfer) by the interpreter's 5 ms switch interval per pass.
            busy = self.engine.has_work and not self._stalled
            commands = self._commands.take(timeout=0.0 if busy else self.role.idle_wait())
            while commands:
                for cmd in commands:
                    self._stalled = False
                    try:
                        self._handle(*cmd)
                    except Exception as exc:  # a bug: that command fails, the thread serves on
                        log.exception("engine command %r failed", cmd[0])
                        if cmd[0] == "submit" and isinstance(cmd[1], Job):
                            self.jobs.pop(cmd[1].request_id)
                            cmd[1].sink(Rejected(500, f"internal error: {type(exc).__name__}"))
                commands = self._commands.take()
            if self._stopping.is_set():
                break
            try:
                if self.role.before_step():
                    self._stalled = False  # blocks may have come back
                self._expire_queued(time.monotonic())
                if self.engine.has_work and not self._stalled:
                    self._step()
            except Exception as exc:  # a bug: fail what is in flight, keep serving
                log.exception("engine step failed")
                self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
            self._stats = self._snapshot()
            if self.on_stats is not None:
                self.on_stats(self._stats)
        self._fail_all("server shutting down")

    def _handle(self, kind: str, arg: object) -> None:
        if kind == "submit":
            assert isinstance(arg, Job)
            if not self.role.take(arg):
                self._accept(arg)
        elif kind == "abort":
            assert isinstance(arg, str)
            job = self.jobs.pop(arg)
            if job is not None and not self.role.abort(job):
                self.engine.release(job.request_id)
        elif kind == "refuse":
            assert isinstance(arg, tuple)
            self.role.refuse_transfer(*arg)
        elif kind == "abort_transfer":
            assert isinstance(arg, str)
            self.role.abort_transfer(arg)

    def _accept(self, job: Job) -> None:
        full = self.jobs.queue_full(self.engine.num_waiting + self.role.queued())
        if full is not None:
            job.sink(full)
            return
        try:
            self.engine.add_request(job.request_id, job.prompt_token_ids, job.params)
        except InvalidRequest as exc:
            job.sink(Rejected(400, str(exc)))
            return
        self.jobs.add(job)

    def _expire_queued(self, now: float) -> None:
        """Refuse requests that waited for blocks longer than the queue timeout."""
        timeout = self.jobs.admission.queue_timeout_s
        for rid in self.engine.waiting_ids():
            job = self.jobs.get(rid)
            if job is not None and now - job.submitted_at > timeout:
                self.jobs.pop(rid)
                if not self.role.drop_queued(job):
                    self.engine.release(job.request_id)
                job.sink(self.jobs.queue_timeout())
        self.role.expire(now)

    def _step(self) -> None:
        outputs = self.engine.step()
        self._stalled = not outputs
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                continue
            if out.new_token_ids:
                job.sink(Tokens(out.new_token_ids))
            if out.finished:
                assert out.finish_reason is not None
                self._finished(job, out.finish_reason)

    def _finished(self, job: Job, reason: FinishReason) -> None:
        if self.role.finished(job, reason):
            return
        stats = self.engine.request_stats(job.request_id)
        self.jobs.pop(job.request_id)
        self.engine.forget(job.request_id)
        job.sink(Done(reason, stats))

    def _fail_all(self, message: str) -> None:
        self.role.fail_all(message)
        for job in self.jobs.all():
            self.jobs.pop(job.request_id)
            try:
                self.engine.release(job.request_id)
            finally:
                job.sink(Done(FinishReason.ERROR, None, error=message))

    def _snapshot(self) -> EngineStats:
        stats = self.engine.statistics()
        held = self.role.queued()
        return replace(stats, num_waiting=stats.num_waiting + held) if held else stats
