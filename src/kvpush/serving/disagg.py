"""Prefill and decode roles: the engine side of disaggregated serving through kvpush.

Push mode, request by request (the proxy sends both legs at once, with one `transfer_id`):

- decode: a request with `kv_transfer_params.do_remote_prefill` allocates its blocks at
  once, reusing its own prefix cache, and registers them with the prefill server named by
  `remote_host`/`remote_port` (its side channel) through `PushRuntime.receive`. When the
  runtime reports the transfer finished, the engine recomputes the last prompt token and
  decodes; when it reports a failure, the request ends with an error naming the reason.
- prefill: a request with `do_remote_decode` computes the prompt (one output token) and
  holds its blocks; they are offered with `PushRuntime.send` (with `--layerwise`, as each
  layer finishes, so writes overlap the rest of the forward pass) and freed when the
  runtime reports the transfer ended, whichever way.

Both roles poll the runtime on the engine thread, the only thread that touches the engine
(the runtime's own contract: results are taken by the engine, once). A client that goes
away aborts its transfer; its blocks are freed only when the runtime says the transfer
ended, so no late write can land in a reused block.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
import uuid
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpush.config import TimingConfig
from kvpush.errors import FailureReason, KVPushError
from kvpush.kvcache import KVLayout, register_kv_cache
from kvpush.node import Node, NodeIdentity, RankSettings, TransportFactory, nixl_transport
from kvpush.serving.engine import Engine, FinishReason
from kvpush.serving.metrics import Registry, RegistryTransferMetrics
from kvpush.serving.openai_request import BadRequest, CompletionRequest
from kvpush.serving.paged import KV_LAYOUT
from kvpush.serving.sampling import RequestRejected, SamplingParams
from kvpush.serving.server import Prepare
from kvpush.serving.worker import Accepted, AdmissionConfig, Done, EngineWorker, Job, Rejected
from kvpush.transfer_metrics import record_ended
from kvpush.transfer_params import (
    REMOTE_DECODE,
    REMOTE_PREFILL,
    BadTransferParams,
    PrefillComputed,
    RemoteDecode,
    parse_remote_decode,
    parse_remote_prefill,
    wants_remote_decode,
    wants_remote_prefill,
)

if TYPE_CHECKING:
    from kvpush.runtime import PeerAddress, PushRuntime, TransferResult
    from kvpush.serving.options import ServeOptions

log = logging.getLogger(__name__)

# While a transfer is in flight and the engine is otherwise idle, the engine thread
# sleeps on its command queue this long between polls of the runtime: short against a
# transfer (a few ms), long enough that the sleeping thread leaves the GIL to the
# runtime's thread.
_TRANSFER_POLL_S = 0.001


def prompt_fingerprint(prompt_token_ids: Sequence[int]) -> str:
    """A short digest of a prompt's token ids: both legs of a transfer must agree on it."""
    digest = hashlib.sha256(array("q", prompt_token_ids).tobytes())
    return digest.hexdigest()[:16]


def runtime_transfer_id(transfer_id: str, prompt_token_ids: Sequence[int]) -> str:
    """The id the runtime knows a transfer by: the client's id bound to the prompt's
    fingerprint. Two legs that share a `transfer_id` but not a prompt can never be paired,
    so a mismatch fails (and is named) instead of decoding from another prompt's KV."""
    return f"{transfer_id}#{prompt_fingerprint(prompt_token_ids)}"


# Ids the proxy cancelled before their prefill request arrived: refused when it does.
_CANCELLED_KEPT = 4096
_CANCELLED_TTL_S = 120.0


@dataclass(slots=True)
class _Outgoing:
    """A prefill request whose blocks go to a decode server."""

    transfer_id: str  # the runtime's id (bound to the prompt)
    client_transfer_id: str  # the id in kv_transfer_params
    request_id: str
    num_blocks: int
    started: float
    need: int = 0  # blocks the request takes in our engine
    sent: bool = False
    sent_at: float = 0.0
    ended: bool = False
    request_done: bool = False
    receiver: PeerAddress | None = None  # the decode server named in the params, if any


@dataclass(slots=True)
class _Incoming:
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


class _TransferWorker(EngineWorker):
    def __init__(
        self,
        engine: Engine,
        runtime: PushRuntime,
        registry: Registry,
        *,
        admission: AdmissionConfig | None = None,
    ) -> None:
        super().__init__(engine, admission=admission)
        self.runtime = runtime
        self.registry = registry
        self._transfer_metrics = RegistryTransferMetrics(registry)

    def _idle_wait(self) -> float:
        return _TRANSFER_POLL_S if self._has_pending() else super()._idle_wait()

    def _has_pending(self) -> bool:
        """Whether a transfer of ours is in flight (its end comes from `runtime.poll()`)."""
        raise NotImplementedError

    def _pump(self) -> None:
        for result in self.runtime.poll():
            self._stalled = False  # blocks may have come back
            self._transfer_ended(result)

    def _transfer_ended(self, result: TransferResult) -> None:
        raise NotImplementedError

    def _count(self, result: TransferResult, started: float) -> None:
        record_ended(
            self._transfer_metrics,
            result,
            seconds=time.monotonic() - started,
            bytes_per_block=self.engine.kv_cache.bytes_per_block,
        )


class PrefillWorker(_TransferWorker):
    """The prefill role. Admission is what keeps prefill and decode from waiting on each
    other (each queues its leg of a request in its own order): a prefill request whose
    decode server has already registered its blocks goes first, and requests not yet
    registered never take the last `max_request_blocks` blocks. Blocks held for an
    unregistered transfer wait on the decode server; blocks of a registered one come back
    as soon as they are written. So the decode server's registered requests always find
    room here, finish, and free the decode blocks its queued requests wait for.

    The runtime says which transfers a decode server registered (`statistics()`, looked
    at while a request waits here or a computed one waits for its registration). The
    same look catches a registration for one of our transfer ids with another prompt's
    fingerprint: both legs are refused at once, with that reason."""

    def __init__(
        self,
        engine: Engine,
        runtime: PushRuntime,
        registry: Registry,
        *,
        layerwise: bool,
        admission: AdmissionConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(engine, runtime, registry, admission=admission)
        self.layerwise = layerwise
        self._clock = clock
        self._outgoing: dict[str, _Outgoing] = {}  # by request id
        self._by_transfer: dict[str, _Outgoing] = {}  # by the runtime's id, once placed
        self._by_client_id: dict[str, _Outgoing] = {}  # by the id in kv_transfer_params
        self._cancelled: OrderedDict[str, float] = OrderedDict()
        self._waiting: deque[_Outgoing] = deque()  # FIFO, not in the engine yet
        self._registered: set[str] = set()  # runtime ids a decode server registered
        self._last_look = float("-inf")
        if layerwise:
            engine.on_layer_done = self._layer_done

    def _has_pending(self) -> bool:
        return bool(self._by_transfer) or bool(self._waiting)

    def _queued_outside_engine(self) -> int:
        return len(self._waiting)

    def _accept(self, job: Job) -> None:
        kvp = job.kv_transfer_params or {}
        if not wants_remote_decode(kvp):
            super()._accept(job)
            return
        params = parse_remote_decode(kvp, require_transfer_id=True)
        client_tid = params.transfer_id
        assert client_tid is not None  # checked by the HTTP layer's prepare
        if client_tid in self._by_client_id:
            job.sink(Rejected(409, f"transfer_id {client_tid!r} is already in flight here"))
            return
        if self._was_cancelled(client_tid):
            job.sink(Rejected(409, f"transfer {client_tid!r} was cancelled before it started"))
            return
        full = self._queue_full(job)
        if full is not None:
            job.sink(full)
            return
        try:
            self.engine.check_request(job.request_id, job.prompt_token_ids, _PREFILL_PARAMS)
        except RequestRejected as exc:
            job.sink(Rejected(400, str(exc)))
            return
        tid = runtime_transfer_id(client_tid, job.prompt_token_ids)
        log.debug("transfer %s: prefill request accepted", tid)
        out = _Outgoing(
            tid,
            client_tid,
            job.request_id,
            self.engine.transfer_block_count(len(job.prompt_token_ids)),
            self._clock(),
            need=self.engine.blocks_for(len(job.prompt_token_ids) + 1),
            receiver=_decode_of(params),
        )
        self._outgoing[job.request_id] = out
        self._by_client_id[client_tid] = out
        self._jobs[job.request_id] = job
        self._waiting.append(out)
        self._admit()

    def _pump(self) -> None:
        super()._pump()
        self._look_at_registrations()
        self._admit()

    def _admit(self) -> None:
        """Hand waiting requests to the engine: registered ones first (in order), then
        unregistered ones (in order) while the reserve stays free."""
        if not self._waiting:
            return
        free = self.engine.unclaimed_blocks
        reserve = self.engine.max_request_blocks
        placed: list[_Outgoing] = []
        blocked = False
        for out in self._waiting:
            if out.transfer_id in self._registered:
                if out.need > free:
                    blocked = True
                    break
                free -= out.need
                placed.append(out)
        if not blocked:
            for out in self._waiting:
                if out.transfer_id in self._registered:
                    continue
                if out.need + reserve > free:
                    break
                free -= out.need
                placed.append(out)
        for out in placed:
            self._waiting.remove(out)
            self._place(out)

    def _place(self, out: _Outgoing) -> None:
        job = self._jobs[out.request_id]
        self.engine.add_request(
            job.request_id, job.prompt_token_ids, _PREFILL_PARAMS, hold_blocks=True
        )
        self._by_transfer[out.transfer_id] = out

    def _look_at_registrations(self) -> None:
        """Which of our transfers a decode server registered; and registrations that
        carry one of our transfer ids with another prompt's fingerprint."""
        now = self._clock()
        # Requests waiting here are looked for often; computed ones seldom (a decode
        # server that has blocks registers within milliseconds, often before we finish).
        if now - self._last_look < (_LOOK_INTERVAL_S if self._waiting else _PAIRING_LOOK_S):
            return
        if not self._waiting and not any(
            o.sent
            and not o.ended
            and o.transfer_id not in self._registered
            and now - o.sent_at > _PAIRING_LOOK_S
            for o in self._by_transfer.values()
        ):
            return
        self._last_look = now
        registered: set[str] = set()
        for tid, state in self.runtime.statistics().sending_transfers.items():
            if state == "awaiting_register":
                continue
            registered.add(tid)
            client_tid, _, theirs = tid.rpartition("#")
            ours = self._by_client_id.get(client_tid)
            if ours is not None and ours.transfer_id != tid and state == "registered":
                self._legs_differ(ours, tid, theirs)
        self._registered = registered

    def _legs_differ(self, out: _Outgoing, their_tid: str, their_fingerprint: str) -> None:
        ours = out.transfer_id.rpartition("#")[2]
        why = (
            f"the prefill and decode legs of transfer_id {out.client_transfer_id!r} carry "
            f"different prompts (prompt fingerprints {ours} at the prefill server, "
            f"{their_fingerprint} at the decode server): both legs must send the same request"
        )
        log.info("transfer %s: %s", out.transfer_id, why)
        self.runtime.refuse(their_tid, why)
        self.registry.inc("kvpush_transfers_rejected_total", labels={"status": "409"})
        job = self._jobs.pop(out.request_id, None)
        self._end_early(out, why)
        if job is not None:
            job.sink(Done(FinishReason.ERROR, None, error=why, status=409))

    def _was_cancelled(self, client_tid: str) -> bool:
        now = self._clock()
        while self._cancelled and next(iter(self._cancelled.values())) < now - _CANCELLED_TTL_S:
            self._cancelled.popitem(last=False)
        return self._cancelled.pop(client_tid, None) is not None

    def _layer_done(self, layer: int, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            out = self._outgoing.get(rid)
            if out is None or out.ended:
                continue
            if not out.sent:
                blocks = self.engine.blocks_of(rid)[: out.num_blocks]
                self.runtime.send(
                    out.transfer_id, blocks, ready_layers=[layer], receiver=out.receiver
                )
                out.sent, out.sent_at = True, self._clock()
            else:
                self.runtime.layers_ready(out.transfer_id, [layer])

    def _finished(self, job: Job, reason: FinishReason) -> None:
        out = self._outgoing.get(job.request_id)
        if out is None:
            super()._finished(job, reason)
            return
        stats = self.engine.request_stats(job.request_id)
        log.debug("transfer %s: prompt computed", out.transfer_id)
        if not out.sent:
            blocks = self.engine.held_blocks(job.request_id)[: out.num_blocks]
            self.runtime.send(out.transfer_id, blocks, receiver=out.receiver)
            out.sent, out.sent_at = True, self._clock()
        out.request_done = True
        self._jobs.pop(job.request_id, None)
        job.sink(
            Done(
                reason,
                stats,
                kv_transfer_params=PrefillComputed(
                    transfer_id=out.client_transfer_id,
                    num_blocks=out.num_blocks,
                    prompt_fingerprint=prompt_fingerprint(job.prompt_token_ids),
                ).to_params(),
            )
        )

    def _abort_job(self, job: Job) -> None:
        out = self._outgoing.get(job.request_id)
        if out is None:
            super()._abort_job(job)
            return
        self._end_early(out, "aborted: the client went away")

    def _end_early(self, out: _Outgoing, why: str) -> None:
        """Stop a transfer whose request ended early. Blocks a write may still read stay
        held until the runtime reports the transfer ended (fencing); others go at once.
        A decode server that registered for it already is told now."""
        if out.sent:
            if not out.ended:
                self.engine.stop_and_hold(out.request_id)
                self.runtime.abort(out.transfer_id)
        else:
            if out in self._waiting:
                self._waiting.remove(out)
            self.runtime.refuse(out.transfer_id, why)
            self._forget(out)
        log.debug("transfer %s ended early: %s", out.transfer_id, why)

    def _abort_transfer(self, transfer_id: str) -> None:
        out = self._by_client_id.get(transfer_id)
        if out is None:
            self._cancelled[transfer_id] = self._clock()
            while len(self._cancelled) > _CANCELLED_KEPT:
                self._cancelled.popitem(last=False)
            return
        job = self._jobs.pop(out.request_id, None)
        self._end_early(out, "cancelled by the client")
        if job is not None:
            job.sink(
                Done(
                    FinishReason.ERROR,
                    None,
                    error=f"transfer {transfer_id!r} was cancelled",
                    status=409,
                )
            )

    def _expire_queued(self, now: float) -> None:
        super()._expire_queued(now)
        timeout = self.admission.queue_timeout_s
        while self._waiting:
            out = self._waiting[0]
            job = self._jobs.get(out.request_id)
            if job is not None and now - job.submitted_at <= timeout:
                break
            self._jobs.pop(out.request_id, None)
            rejected = self._queue_timeout()
            self._end_early(out, rejected.message)
            if job is not None:
                job.sink(rejected)

    def _drop_queued(self, job: Job) -> None:
        out = self._outgoing.get(job.request_id)
        if out is None:
            super()._drop_queued(job)
        else:
            self._end_early(out, "no KV blocks became free in time")

    def _fail_all(self, message: str) -> None:
        # A layer-wise request may be half computed with its first layers' writes in
        # flight: its blocks stay held until the runtime reports the transfer ended.
        for out in list(self._outgoing.values()):
            job = self._jobs.pop(out.request_id, None)
            if job is None:
                if out.sent and not out.ended:
                    self.runtime.abort(out.transfer_id)
                continue
            self._end_early(out, message)
            job.sink(Done(FinishReason.ERROR, None, error=message))
        super()._fail_all(message)

    def _forget(self, out: _Outgoing) -> None:
        self._outgoing.pop(out.request_id, None)
        self._by_transfer.pop(out.transfer_id, None)
        self._by_client_id.pop(out.client_transfer_id, None)
        self._registered.discard(out.transfer_id)
        self.engine.release(out.request_id)

    def _transfer_ended(self, result: TransferResult) -> None:
        log.debug("transfer %s ended on the sender side: %s", result.transfer_id, result.reason)
        out = self._by_transfer.get(result.transfer_id)
        if out is None or result.side != "sender":
            return
        out.ended = True
        self._count(result, out.started)
        if not result.ok:
            log.info(
                "transfer %s failed (%s): %s", result.transfer_id, result.reason, result.detail
            )
        job = self._jobs.pop(out.request_id, None)
        self._forget(out)
        if job is not None:  # still computing: the prefill request fails with the transfer
            reason = result.reason.value if result.reason else "unknown"
            job.sink(
                Done(
                    FinishReason.ERROR,
                    None,
                    error=f"KV transfer failed ({reason}): {result.detail}",
                    status=502,
                )
            )


# A prefill request computes its prompt and one token (whose logits the decode server
# recomputes), and keeps its blocks for the transfer.
_PREFILL_PARAMS = SamplingParams(max_tokens=1, ignore_eos=True)
# How often the prefill role looks at which transfers are registered, while it waits for
# that (a request waiting for blocks, or a computed one for its decode server).
_LOOK_INTERVAL_S = 0.02
# How long a computed prompt waits for its registration before we look for one that
# carries its transfer id with another prompt's fingerprint (and how often after that).
_PAIRING_LOOK_S = 0.1


def _decode_of(params: RemoteDecode) -> PeerAddress | None:
    """The decode server a prefill request's params name (its side channel), if any."""
    from kvpush.runtime import PeerAddress

    named = params.decode_server()
    return None if named is None else PeerAddress(*named)


def _sender_of(kvp: dict[str, object]) -> tuple[str, PeerAddress] | None:
    """A decode request's transfer id and sender, or None where its params name none."""
    from kvpush.runtime import PeerAddress

    try:
        remote = parse_remote_prefill(kvp)
    except BadTransferParams:
        return None
    return remote.transfer_id, PeerAddress(remote.remote_host, remote.remote_port)


class DecodeWorker(_TransferWorker):
    def __init__(
        self,
        engine: Engine,
        runtime: PushRuntime,
        registry: Registry,
        *,
        admission: AdmissionConfig | None = None,
    ) -> None:
        super().__init__(engine, runtime, registry, admission=admission)
        self._incoming: dict[str, _Incoming] = {}  # by transfer id
        self._transfer_of: dict[str, str] = {}  # request id -> transfer id
        self._queued: deque[_Queued] = deque()  # FIFO, waiting for blocks
        self._queued_ids: set[str] = set()

    def _has_pending(self) -> bool:
        return bool(self._incoming) or bool(self._queued)

    def _queued_outside_engine(self) -> int:
        return len(self._queued)

    def _accept(self, job: Job) -> None:
        kvp = job.kv_transfer_params or {}
        if not wants_remote_prefill(kvp):
            super()._accept(job)
            return
        named = _sender_of(kvp)
        assert named is not None  # checked by the HTTP layer's prepare
        client_tid, sender = named
        tid = runtime_transfer_id(client_tid, job.prompt_token_ids)
        if tid in self._incoming or tid in self._queued_ids:
            job.sink(Rejected(409, f"transfer_id {client_tid!r} is already in flight here"))
            return
        try:
            self.engine.check_request(job.request_id, job.prompt_token_ids, job.params)
        except RequestRejected as exc:
            self._refuse(job, tid, sender, Rejected(400, str(exc)))
            return
        if not self._queued and self._place(job, tid, sender):
            return
        full = self._queue_full(job)
        if full is not None:
            self._refuse(job, tid, sender, full)
            return
        self._queued.append(_Queued(tid, sender, job))
        self._queued_ids.add(tid)
        self._jobs[job.request_id] = job
        # Queued for blocks: the prefill keeps its transfer while we claim it.
        self.runtime.claim(tid, sender)

    def _refuse(self, job: Job, tid: str, sender: PeerAddress, why: Rejected) -> None:
        """Refuse before allocating: the sender frees its blocks at once."""
        self.runtime.reject(tid, sender, why.message)
        self.registry.inc("kvpush_transfers_rejected_total", labels={"status": str(why.status)})
        job.sink(why)

    def _place(self, job: Job, tid: str, sender: PeerAddress) -> bool:
        """Give the request blocks and register them with the sender; False: no room yet."""
        try:
            where = self.engine.add_remote_request(job.request_id, job.prompt_token_ids, job.params)
        except RequestRejected as exc:
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
        self._incoming[tid] = _Incoming(tid, job, time.monotonic())
        self._transfer_of[job.request_id] = tid
        self._jobs[job.request_id] = job
        job.sink(Accepted())
        return True

    def _pump(self) -> None:
        super()._pump()
        while self._queued:
            head = self._queued[0]
            if self._place(head.job, head.transfer_id, head.sender):
                self._queued.popleft()
                self._queued_ids.discard(head.transfer_id)
            else:
                break

    def _expire_queued(self, now: float) -> None:
        super()._expire_queued(now)
        timeout = self.admission.queue_timeout_s
        while self._queued and now - self._queued[0].job.submitted_at > timeout:
            q = self._queued.popleft()
            self._queued_ids.discard(q.transfer_id)
            self._jobs.pop(q.job.request_id, None)
            self._refuse(q.job, q.transfer_id, q.sender, self._queue_timeout())

    def _refuse_transfer(
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

    def _abort_job(self, job: Job) -> None:
        for q in self._queued:
            if q.job is job:
                self._queued.remove(q)
                self._queued_ids.discard(q.transfer_id)
                self.runtime.reject(q.transfer_id, q.sender, "the client went away")
                return
        tid = self._transfer_of.get(job.request_id)
        if tid is None or tid not in self._incoming:
            self._transfer_of.pop(job.request_id, None)
            super()._abort_job(job)
            return
        self._incoming[tid].aborted = True
        self.runtime.abort(tid)  # blocks are freed when the runtime reports the end

    def _fail_all(self, message: str) -> None:
        while self._queued:
            q = self._queued.popleft()
            self._queued_ids.discard(q.transfer_id)
            self._jobs.pop(q.job.request_id, None)
            self.runtime.reject(q.transfer_id, q.sender, message)
            q.job.sink(Done(FinishReason.ERROR, None, error=message, status=503))
        for tid in list(self._incoming):
            self.runtime.abort(tid)
        waiting = {inc.job.request_id for inc in self._incoming.values()}
        for rid in waiting:
            job = self._jobs.pop(rid, None)
            if job is not None:
                job.sink(Done(FinishReason.ERROR, None, error=message))
        super()._fail_all(message)

    def _finished(self, job: Job, reason: FinishReason) -> None:
        self._transfer_of.pop(job.request_id, None)
        super()._finished(job, reason)

    def _transfer_ended(self, result: TransferResult) -> None:
        log.debug("transfer %s ended on the receiver side: %s", result.transfer_id, result.reason)
        inc = self._incoming.pop(result.transfer_id, None)
        if inc is None or result.side != "receiver":
            return
        rid = inc.job.request_id
        self._count(result, inc.started)
        if result.ok and not inc.aborted:
            self.engine.kv_arrived(rid)
            return
        self._transfer_of.pop(rid, None)
        self.engine.release(rid)
        job = self._jobs.pop(rid, None)
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


class KVBridge:
    """The kvpush side of one server: a one-rank `Node` (runtime, transport and side
    channel) over the engine's KV cache. `transport_factory`: NIXL unless given."""

    def __init__(
        self,
        options: ServeOptions,
        engine: Engine,
        token: str | None,
        *,
        transport_factory: TransportFactory = nixl_transport,
    ) -> None:
        self.options = options
        self.engine = engine
        self.token = token
        self.engine_id = f"{options.role}-{uuid.uuid4().hex[:8]}"
        self._transport_factory = transport_factory
        self.node: Node | None = None

    @property
    def runtime(self) -> PushRuntime | None:
        """The runtime, once started."""
        return self.node.runtime if self.node is not None and self.node.ranks else None

    def start(self) -> PushRuntime:
        opts = self.options
        assert opts.side_channel_port is not None
        geometry = register_kv_cache(
            self.engine.kv_cache.by_layer(), KVLayout(KV_LAYOUT), self.engine.block_size
        )
        self.node = Node(
            [geometry],
            NodeIdentity(
                self.engine_id,
                "sender" if opts.role == "prefill" else "receiver",
                opts.side_channel_host,
            ),
            port=opts.side_channel_port,
            bind_host=opts.host,
            settings=RankSettings(
                token=self.token,
                timing=TimingConfig(
                    transfer_deadline_s=opts.transfer_deadline_s,
                    claim_window_s=opts.claim_window_s,
                ),
                idle_poll_s=opts.idle_poll_ms / 1000,
                scratch=self.token is not None or opts.allow_doctor_writes,
            ),
            transport_factory=self._transport_factory,
        )
        self.node.start()
        return self.node.runtime

    def drain(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Told to stop, with no new legs coming in: wait up to `timeout_s` for the
        transfers in flight to end (a decode registering for what we hold, KV arriving
        for what we wait for). True if none is left; `close()` ends the rest, telling
        each peer. Returns at once when the runtime is not running."""
        runtime = self.runtime
        until = time.monotonic() + timeout_s
        while runtime is not None and runtime.failure is None:
            stats = runtime.statistics()
            left = len(stats.sending_transfers) + len(stats.receiving_transfers)
            if left == 0:
                return True
            if time.monotonic() >= until:
                log.info("drain: %d transfers still in flight after %.1fs", left, timeout_s)
                return False
            time.sleep(poll_s)
        return True

    def close(self) -> None:
        if self.node is not None:
            self.node.close()

    def health(self) -> dict[str, object]:
        """What `/health` adds for this role; `healthy: False` makes it answer 503. It
        asks the runtime's thread for a snapshot: call it off an event loop."""
        side_ok = False
        runtime_failure: str | None = "not started"
        side_failure: str | None = None
        internal_errors: int | None = None
        if self.node is not None:
            h = self.node.health()
            side_ok = h.side_channel_healthy
            runtime_failure = h.runtime_failure
            side_failure = h.side_channel_failure
            internal_errors = h.side_channel.internal_errors
        out: dict[str, object] = {
            "engine_id": self.engine_id,
            "side_channel_host": self.options.side_channel_host,
            "side_channel_port": self.options.side_channel_port,
            "side_channel": "ok" if side_ok else "down",
            "runtime": "ok" if runtime_failure is None else "down",
            "healthy": side_ok and runtime_failure is None,
        }
        if runtime_failure is not None:
            out["runtime_failure"] = runtime_failure
        if side_failure is not None:
            out["side_channel_failure"] = side_failure
        if internal_errors is not None:
            out["side_channel_internal_errors"] = internal_errors
        # What `kvpush doctor` reads: the deadlines in force, the runtime's transfer
        # figures and the side channel's request counts.
        out["transfer_deadline_s"] = self.options.transfer_deadline_s
        if self.options.role == "decode":
            out["queue_timeout_s"] = self.options.queue_timeout_s
        runtime = self.runtime
        if runtime is not None and runtime.failure is None:
            s = runtime.statistics()
            out["transfers"] = {
                "in_flight": s.in_flight,
                "oldest_in_flight_s": s.oldest_in_flight_s,
                "sending": s.sending,
                "receiving": s.receiving,
                "writes_in_flight": s.writes_in_flight,
                "handshakes_in_flight": s.handshakes_in_flight,
                "blocks_held_sending": s.blocks_held_sending,
                "blocks_held_receiving": s.blocks_held_receiving,
                "claimed": s.claimed,
                "finished": s.finished,
                "failed": s.failed,
                "failures": s.failures,
                "peers": s.peers,
                "forged_messages": s.forged_messages,
                "malformed_messages": s.malformed_messages,
                "clock_bounds": s.clock_bounds,
            }
            # Two readings of these, a moment apart, are the server's CPU share (the doctor
            # warns when an idle server is busy): its clock, the process, the runtime thread.
            out["cpu"] = {
                "at_s": time.monotonic(),
                "process_s": time.process_time(),
                "runtime_thread_s": s.thread_cpu_s,
            }
        if self.node is not None:
            out["side_channel_requests"] = dataclasses.asdict(self.node.health().side_channel)
        return out

    def update_metrics(self, registry: Registry) -> None:
        """The runtime's counts of dropped data-plane messages, into `registry` (at each
        /metrics scrape; it asks the runtime's thread for a snapshot)."""
        runtime = self.runtime
        if runtime is None or runtime.failure is not None:
            return
        s = runtime.statistics()
        for reason, n in s.forged_messages.items():
            registry.set("kvpush_forged_messages_total", n, labels={"reason": reason})
        registry.set("kvpush_malformed_messages_total", s.malformed_messages)


def _prepare_for(role: str) -> Prepare:
    def prepare(req: CompletionRequest) -> CompletionRequest:
        kvp = req.kv_transfer_params
        if kvp is None:
            return req
        try:
            if role == "prefill" and wants_remote_decode(kvp):
                parse_remote_decode(kvp, require_transfer_id=True)
                if req.stream:
                    raise BadRequest("a remote-decode (prefill) request cannot stream")
            elif role == "decode" and wants_remote_prefill(kvp):
                parse_remote_prefill(kvp)
            elif wants_remote_decode(kvp) or wants_remote_prefill(kvp):
                raise BadRequest(
                    f"this is a {role} server: expected "
                    + (REMOTE_DECODE if role == "prefill" else REMOTE_PREFILL)
                )
        except BadTransferParams as exc:
            raise BadRequest(str(exc)) from None
        return req

    return prepare


def build_role(
    options: ServeOptions,
    engine: Engine,
    registry: Registry,
    token: str | None,
    *,
    transport_factory: TransportFactory = nixl_transport,
) -> tuple[EngineWorker, KVBridge, Prepare, Callable[[], dict[str, object]]]:
    """The prefill or decode role over `engine`: its worker (not started), its started
    `KVBridge`, the request check for its HTTP layer and its `/health` extra. The
    transport is NIXL unless a factory is given (tests run the roles over loopback)."""
    bridge = KVBridge(options, engine, token, transport_factory=transport_factory)
    runtime = bridge.start()
    try:
        worker: EngineWorker
        admission = options.admission()
        if options.role == "prefill":
            worker = PrefillWorker(
                engine, runtime, registry, layerwise=options.layerwise, admission=admission
            )
        else:
            worker = DecodeWorker(engine, runtime, registry, admission=admission)
    except BaseException:
        bridge.close()
        raise
    return worker, bridge, _prepare_for(options.role), bridge.health


__all__ = ["DecodeWorker", "FailureReason", "KVBridge", "PrefillWorker", "build_role"]
