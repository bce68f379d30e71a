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

Subclasses (the prefill and decode roles) add work through `_pump()`, which runs on the
engine thread before every step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvpush.errors import ClosedError
from kvpush.serving.engine import Engine, EngineStats, FinishReason, RequestStats
from kvpush.serving.sampling import RequestRejected, SamplingParams

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


class EngineWorker:
    """Runs an engine on its own thread; `start()` and `close()` own that thread."""

    def __init__(
        self,
        engine: Engine,
        *,
        name: str = "kvpush-engine",
        admission: AdmissionConfig | None = None,
    ) -> None:
        self.engine = engine
        self.admission = admission or AdmissionConfig()
        self._name = name
        # Set when a step placed and ran nothing (every block held): waiting requests
        # then wait for a command or a transfer's end instead of spinning.
        self._stalled = False
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._jobs: dict[str, Job] = {}
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

    # -- engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            # Only engine work runs without waiting. A transfer in flight is waited for in
            # `_idle_wait()` slices: a zero-timeout get never drops the GIL, so spinning
            # here would hold off the push runtime's thread (which must poll NIXL to move
            # this very transfer) by the interpreter's 5 ms switch interval per pass.
            busy = self.engine.has_work and not self._stalled
            try:
                cmd = self._commands.get(timeout=0.0 if busy else self._idle_wait())
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._stalled = False
                try:
                    self._handle(*cmd)
                except Exception as exc:  # a bug: that command fails, the thread serves on
                    log.exception("engine command %r failed", cmd[0])
                    if cmd[0] == "submit" and isinstance(cmd[1], Job):
                        self._jobs.pop(cmd[1].request_id, None)
                        cmd[1].sink(Rejected(500, f"internal error: {type(exc).__name__}"))
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._stopping.is_set():
                break
            try:
                self._pump()
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
        self._shutdown()

    def _idle_wait(self) -> float:
        """How long to sleep on the command queue when the engine has nothing to run."""
        return 0.5

    def _handle(self, kind: str, arg: object) -> None:
        if kind == "submit":
            assert isinstance(arg, Job)
            self._accept(arg)
        elif kind == "abort":
            assert isinstance(arg, str)
            job = self._jobs.pop(arg, None)
            if job is not None:
                self._abort_job(job)
        elif kind == "refuse":
            assert isinstance(arg, tuple)
            self._refuse_transfer(*arg)
        elif kind == "abort_transfer":
            assert isinstance(arg, str)
            self._abort_transfer(arg)

    def _num_queued(self) -> int:
        return self.engine.num_waiting + self._queued_outside_engine()

    def _queued_outside_engine(self) -> int:
        """Hook for roles: requests waiting in a queue of the role's own, not yet handed
        to the engine (they count against `max_waiting` and show in `num_waiting`)."""
        return 0

    def _queue_full(self, job: Job) -> Rejected | None:
        n = self._num_queued()
        if n < self.admission.max_waiting:
            return None
        return Rejected(
            429,
            f"too many requests waiting for KV blocks ({n}, the limit is "
            f"{self.admission.max_waiting}): retry later",
            RETRY_AFTER_S,
        )

    def _queue_timeout(self) -> Rejected:
        return Rejected(
            503,
            f"no KV blocks became free for this request within "
            f"{self.admission.queue_timeout_s:g} s: the server is overloaded, retry later",
            RETRY_AFTER_S,
        )

    def _accept(self, job: Job) -> None:
        full = self._queue_full(job)
        if full is not None:
            job.sink(full)
            return
        try:
            self.engine.add_request(job.request_id, job.prompt_token_ids, job.params)
        except RequestRejected as exc:
            job.sink(Rejected(400, str(exc)))
            return
        self._jobs[job.request_id] = job

    def _expire_queued(self, now: float) -> None:
        """Refuse requests that waited for blocks longer than the queue timeout."""
        timeout = self.admission.queue_timeout_s
        for rid in self.engine.waiting_ids():
            job = self._jobs.get(rid)
            if job is not None and now - job.submitted_at > timeout:
                del self._jobs[rid]
                self._drop_queued(job)
                job.sink(self._queue_timeout())

    def _drop_queued(self, job: Job) -> None:
        """Forget a request that never got blocks (it timed out in the queue)."""
        self.engine.release(job.request_id)

    def _refuse_transfer(
        self, kv_transfer_params: dict[str, object], prompt_token_ids: list[int] | None, why: str
    ) -> None:
        """Hook for roles (see `refuse_transfer`)."""

    def _abort_transfer(self, transfer_id: str) -> None:
        """Hook for roles (see `abort_transfer`)."""

    def _abort_job(self, job: Job) -> None:
        self.engine.release(job.request_id)

    def _step(self) -> None:
        outputs = self.engine.step()
        self._stalled = not outputs
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is None:
                continue
            if out.new_token_ids:
                job.sink(Tokens(out.new_token_ids))
            if out.finished:
                assert out.finish_reason is not None
                self._finished(job, out.finish_reason)

    def _finished(self, job: Job, reason: FinishReason) -> None:
        stats = self.engine.request_stats(job.request_id)
        self._jobs.pop(job.request_id, None)
        self.engine.forget(job.request_id)
        job.sink(Done(reason, stats))

    def _fail_all(self, message: str) -> None:
        for job in list(self._jobs.values()):
            self._jobs.pop(job.request_id, None)
            try:
                self.engine.release(job.request_id)
            finally:
                job.sink(Done(FinishReason.ERROR, None, error=message))

    def _snapshot(self) -> EngineStats:
        stats = self.engine.statistics()
        held = self._queued_outside_engine()
        return replace(stats, num_waiting=stats.num_waiting + held) if held else stats

    def _pump(self) -> None:
        """Hook for roles: run on the engine thread before each step."""

    def _shutdown(self) -> None:
        """Hook for roles: release what the role owns, on the engine thread."""
