"""The decode role: a request with `kv_transfer_params.do_remote_prefill` allocates its
blocks at once, reusing its own prefix cache, and registers them with the prefill server
named by `remote_host`/`remote_port` (its side channel) through `PushRuntime.receive`.
When the runtime reports the transfer finished, the engine recomputes the last prompt
token and decodes; when it reports a failure, the request ends with an error naming the
reason. A request with no room yet waits for blocks (claimed at the prefill server, which
keeps its transfer meanwhile)."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpush.errors import KVPushError
from kvpush.serving.engine import Engine, FinishReason
from kvpush.serving.metrics import Registry, RegistryTransferMetrics
from kvpush.serving.sampling import InvalidRequest
from kvpush.serving.transfers import TRANSFER_POLL_S, count_ended, runtime_transfer_id
from kvpush.serving.worker import IDLE_WAIT_S, Accepted, Done, Job, Jobs, Rejected
from kvpush.transfer_params import BadTransferParams, parse_remote_prefill, wants_remote_prefill

if TYPE_CHECKING:
    from kvpush.runtime import PeerAddress, PushRuntime, TransferResult

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _IncomingRequest:
    """A decode request waiting for its KV."""

    transfer_id: str
    job: Job
    started: float
    aborted: bool = False


@dataclass(slots=True)
class _Queued:
    """A decode request waiting for blocks before it can register with the sender."""

    transfer_id: str
    sender: PeerAddress
    job: Job


def _sender_of(kvp: dict[str, object]) -> tuple[str, PeerAddress] | None:
    """A decode request's transfer id and sender, or None where its params name none."""
    from kvpush.runtime import PeerAddress

    try:
        remote = parse_remote_prefill(kvp)
    except BadTransferParams:
        return None
    return remote.transfer_id, PeerAddress(remote.remote_host, remote.remote_port)


class DecodeRole:
    """The decode role, a `worker.Role`: see the module's docstring."""

    def __init__(
        self,
        engine: Engine,
        jobs: Jobs,
        runtime: PushRuntime,
        registry: Registry,
    ) -> None:
        self.engine = engine
        self.jobs = jobs
        self.runtime = runtime
        self.registry = registry
        self._transfer_metrics = RegistryTransferMetrics(registry)
        self._incoming: dict[str, _IncomingRequest] = {}  # by transfer id
        self._transfer_of: dict[str, str] = {}  # request id -> transfer id
        self._queued: deque[_Queued] = deque()  # FIFO, waiting for blocks
        self._queued_ids: set[str] = set()

    # -- the loop's named points (`worker.Role`) ----------------------------------------

    def idle_wait(self) -> float:
        in_flight = bool(self._incoming) or bool(self._queued)
        return TRANSFER_POLL_S if in_flight else IDLE_WAIT_S

    def queued(self) -> int:
        return len(self._queued)

    def take(self, job: Job) -> bool:
        kvp = job.kv_transfer_params or {}
        if not wants_remote_prefill(kvp):
            return False
        named = _sender_of(kvp)
        assert named is not None  # checked by the HTTP layer's prepare
        client_tid, sender = named
        tid = runtime_transfer_id(client_tid, job.prompt_token_ids)
        if tid in self._incoming or tid in self._queued_ids:
            job.sink(Rejected(409, f"transfer_id {client_tid!r} is already in flight here"))
            return True
        try:
            self.engine.check_request(job.request_id, job.prompt_token_ids, job.params)
        except InvalidRequest as exc:
            self._refuse(job, tid, sender, Rejected(400, str(exc)))
            return True
        if not self._queued and self._place(job, tid, sender):
            return True
        full = self.jobs.queue_full(self.engine.num_waiting + len(self._queued))
        if full is not None:
            self._refuse(job, tid, sender, full)
            return True
        self._queued.append(_Queued(tid, sender, job))
        self._queued_ids.add(tid)
        self.jobs.add(job)
        # Queued for blocks: the prefill keeps its transfer while we claim it.
        self.runtime.claim(tid, sender)
        return True

    def abort(self, job: Job) -> bool:
        for q in self._queued:
            if q.job is job:
                self._queued.remove(q)
                self._queued_ids.discard(q.transfer_id)
                self.runtime.reject(q.transfer_id, q.sender, "the client went away")
                return True
        tid = self._transfer_of.get(job.request_id)
        if tid is None or tid not in self._incoming:
            self._transfer_of.pop(job.request_id, None)
            return False
        self._incoming[tid].aborted = True
        self.runtime.abort(tid)  # blocks are freed when the runtime reports the end
        return True

    def refuse_transfer(
        self, kv_transfer_params: dict[str, object], prompt_token_ids: list[int] | None, why: str
    ) -> None:
        named = _sender_of(kv_transfer_params)
        if not wants_remote_prefill(kv_transfer_params) or named is None:
            return  # nobody to tell
        if prompt_token_ids is None:
            return  # a prompt no prefill server could have computed
        tid, sender = named
        self.runtime.reject(runtime_transfer_id(tid, prompt_token_ids), sender, why)
        self.registry.inc("kvpush_transfers_rejected_total", labels={"status": "400"})

    def abort_transfer(self, transfer_id: str) -> None:
        pass  # a decode leg is cancelled by its client going away (`abort`)

    def before_step(self) -> bool:
        came_back = False
        for result in self.runtime.poll():
            came_back = True
            self._transfer_ended(result)
        while self._queued:
            head = self._queued[0]
            if self._place(head.job, head.transfer_id, head.sender):
                self._queued.popleft()
                self._queued_ids.discard(head.transfer_id)
            else:
                break
        return came_back

    def drop_queued(self, job: Job) -> bool:
        return False  # our requests wait in our own queue, not the engine's

    def expire(self, now: float) -> None:
        timeout = self.jobs.admission.queue_timeout_s
        while self._queued and now - self._queued[0].job.submitted_at > timeout:
            q = self._queued.popleft()
            self._queued_ids.discard(q.transfer_id)
            self.jobs.pop(q.job.request_id)
            self._refuse(q.job, q.transfer_id, q.sender, self.jobs.queue_timeout())

    def finished(self, job: Job, reason: FinishReason) -> bool:
        self._transfer_of.pop(job.request_id, None)
        return False  # a decoded request ends as a plain one does

    def fail_all(self, message: str) -> None:
        while self._queued:
            q = self._queued.popleft()
            self._queued_ids.discard(q.transfer_id)
            self.jobs.pop(q.job.request_id)
            self.runtime.reject(q.transfer_id, q.sender, message)
            q.job.sink(Done(FinishReason.ERROR, None, error=message, status=503))
        for tid in list(self._incoming):
            self.runtime.abort(tid)
        waiting = {inc.job.request_id for inc in self._incoming.values()}
        for rid in waiting:
            job = self.jobs.pop(rid)
            if job is not None:
                job.sink(Done(FinishReason.ERROR, None, error=message))

    # -- the role's own work -----------------------------------------------------------

    def _refuse(self, job: Job, tid: str, sender: PeerAddress, why: Rejected) -> None:
        """Refuse before allocating: the sender frees its blocks at once."""
        self.runtime.reject(tid, sender, why.message)
        self.registry.inc("kvpush_transfers_rejected_total", labels={"status": str(why.status)})
        job.sink(why)

    def _place(self, job: Job, tid: str, sender: PeerAddress) -> bool:
        """Give the request blocks and register them with the sender; False: no room yet."""
        try:
            where = self.engine.add_remote_request(job.request_id, job.prompt_token_ids, job.params)
        except InvalidRequest as exc:
            self._refuse(job, tid, sender, Rejected(400, str(exc)))
            return True
        if where is None:
            return False
        try:
            self.runtime.receive(tid, sender, where.blocks, sender_offset=where.sender_offset)
        except KVPushError as exc:
            self.engine.release(job.request_id)
            self._refuse(job, tid, sender, Rejected(400, f"cannot receive transfer {tid!r}: {exc}"))
            return True
        log.debug("transfer %s: %d blocks registered", tid, len(where.blocks))
        self._incoming[tid] = _IncomingRequest(tid, job, time.monotonic())
        self._transfer_of[job.request_id] = tid
        self.jobs.add(job)
        job.sink(Accepted())
        return True

    def _transfer_ended(self, result: TransferResult) -> None:
        log.debug("transfer %s ended on the receiver side: %s", result.transfer_id, result.reason)
        inc = self._incoming.pop(result.transfer_id, None)
        if inc is None or result.side != "receiver":
            return
        rid = inc.job.request_id
        count_ended(self._transfer_metrics, self.engine, result, inc.started)
        if result.ok and not inc.aborted:
            self.engine.kv_arrived(rid)
            return
        self._transfer_of.pop(rid, None)
        self.engine.release(rid)
        job = self.jobs.pop(rid)
        if job is not None:
            reason = result.reason.value if result.reason else "cancelled"
            job.sink(
                Done(
                    FinishReason.ERROR,
                    None,
                    error=f"KV transfer {result.transfer_id} failed ({reason}): {result.detail}",
                    status=502,
                )
            )
