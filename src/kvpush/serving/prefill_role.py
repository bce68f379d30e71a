"""The prefill role: a request with `do_remote_decode` computes the prompt (one output
token) and holds its blocks; they are offered with `PushRuntime.send` (with `--layerwise`,
as each layer finishes, so writes overlap the rest of the forward pass) and freed when
the runtime reports the transfer ended, whichever way."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpush.serving.engine import Engine, FinishReason
from kvpush.serving.metrics import Registry, RegistryTransferMetrics
from kvpush.serving.sampling import InvalidRequest, SamplingParams
from kvpush.serving.transfers import (
    TRANSFER_POLL_S,
    count_ended,
    prompt_fingerprint,
    runtime_transfer_id,
)
from kvpush.serving.worker import IDLE_WAIT_S, Done, Job, Jobs, Rejected
from kvpush.transfer_params import (
    PrefillComputed,
    RemoteDecode,
    parse_remote_decode,
    wants_remote_decode,
)

if TYPE_CHECKING:
    from kvpush.runtime import PeerAddress, PushRuntime, TransferResult

log = logging.getLogger(__name__)

# Ids the proxy cancelled before their prefill request arrived: refused when it does.
_CANCELLED_KEPT = 4096
_CANCELLED_TTL_S = 120.0


@dataclass(slots=True)
class _OutgoingRequest:
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


class PrefillRole:
    """The prefill role, a `worker.Role`. Admission is what keeps prefill and decode from
    waiting on each other (each queues its leg of a request in its own order): a prefill
    request whose decode server has already registered its blocks goes first, and requests
    not yet registered never take the last `max_request_blocks` blocks. Blocks held for an
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
        jobs: Jobs,
        runtime: PushRuntime,
        registry: Registry,
        *,
        layerwise: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.jobs = jobs
        self.runtime = runtime
        self.registry = registry
        self._transfer_metrics = RegistryTransferMetrics(registry)
        self.layerwise = layerwise
        self._clock = clock
        self._outgoing: dict[str, _OutgoingRequest] = {}  # by request id
        self._by_transfer: dict[str, _OutgoingRequest] = {}  # by the runtime's id, once placed
        self._by_client_id: dict[str, _OutgoingRequest] = {}  # by the id in kv_transfer_params
        self._cancelled: OrderedDict[str, float] = OrderedDict()
        self._waiting: deque[_OutgoingRequest] = deque()  # FIFO, not in the engine yet
        self._registered: set[str] = set()  # runtime ids a decode server registered
        self._last_look = float("-inf")
        if layerwise:
            engine.on_layer_done = self._layer_done

    # -- the loop's named points (`worker.Role`) ----------------------------------------

    def idle_wait(self) -> float:
        in_flight = bool(self._by_transfer) or bool(self._waiting)
        return TRANSFER_POLL_S if in_flight else IDLE_WAIT_S

    def queued(self) -> int:
        return len(self._waiting)

    def take(self, job: Job) -> bool:
        kvp = job.kv_transfer_params or {}
        if not wants_remote_decode(kvp):
            return False
        params = parse_remote_decode(kvp, require_transfer_id=True)
        client_tid = params.transfer_id
        assert client_tid is not None  # checked by the HTTP layer's prepare
        if client_tid in self._by_client_id:
            job.sink(Rejected(409, f"transfer_id {client_tid!r} is already in flight here"))
            return True
        if self._was_cancelled(client_tid):
            job.sink(Rejected(409, f"transfer {client_tid!r} was cancelled before it started"))
            return True
        full = self.jobs.queue_full(self.engine.num_waiting + len(self._waiting))
        if full is not None:
            job.sink(full)
            return True
        try:
            self.engine.check_request(job.request_id, job.prompt_token_ids, _PREFILL_PARAMS)
        except InvalidRequest as exc:
            job.sink(Rejected(400, str(exc)))
            return True
        tid = runtime_transfer_id(client_tid, job.prompt_token_ids)
        log.debug("transfer %s: prefill request accepted", tid)
        out = _OutgoingRequest(
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
        self.jobs.add(job)
        self._waiting.append(out)
        self._admit()
        return True

    def abort(self, job: Job) -> bool:
        out = self._outgoing.get(job.request_id)
        if out is None:
            return False
        self._end_early(out, "aborted: the client went away")
        return True

    def refuse_transfer(
        self, kv_transfer_params: dict[str, object], prompt_token_ids: list[int] | None, why: str
    ) -> None:
        pass  # only a decode server has someone to tell: a prefill leg holds nothing yet

    def abort_transfer(self, transfer_id: str) -> None:
        out = self._by_client_id.get(transfer_id)
        if out is None:
            self._cancelled[transfer_id] = self._clock()
            while len(self._cancelled) > _CANCELLED_KEPT:
                self._cancelled.popitem(last=False)
            return
        job = self.jobs.pop(out.request_id)
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

    def before_step(self) -> bool:
        came_back = False
        for result in self.runtime.poll():
            came_back = True
            self._transfer_ended(result)
        self._look_at_registrations()
        self._admit()
        return came_back

    def drop_queued(self, job: Job) -> bool:
        out = self._outgoing.get(job.request_id)
        if out is None:
            return False
        self._end_early(out, "no KV blocks became free in time")
        return True

    def expire(self, now: float) -> None:
        timeout = self.jobs.admission.queue_timeout_s
        while self._waiting:
            out = self._waiting[0]
            job = self.jobs.get(out.request_id)
            if job is not None and now - job.submitted_at <= timeout:
                break
            self.jobs.pop(out.request_id)
            rejected = self.jobs.queue_timeout()
            self._end_early(out, rejected.message)
            if job is not None:
                job.sink(rejected)

    def finished(self, job: Job, reason: FinishReason) -> bool:
        out = self._outgoing.get(job.request_id)
        if out is None:
            return False
        stats = self.engine.request_stats(job.request_id)
        log.debug("transfer %s: prompt computed", out.transfer_id)
        if not out.sent:
            blocks = self.engine.held_blocks(job.request_id)[: out.num_blocks]
            self.runtime.send(out.transfer_id, blocks, receiver=out.receiver)
            out.sent, out.sent_at = True, self._clock()
        out.request_done = True
        self.jobs.pop(job.request_id)
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
        return True

    def fail_all(self, message: str) -> None:
        # A layer-wise request may be half computed with its first layers' writes in
        # flight: its blocks stay held until the runtime reports the transfer ended.
        for out in list(self._outgoing.values()):
            job = self.jobs.pop(out.request_id)
            if job is None:
                if out.sent and not out.ended:
                    self.runtime.abort(out.transfer_id)
                continue
            self._end_early(out, message)
            job.sink(Done(FinishReason.ERROR, None, error=message))

    # -- the role's own work -----------------------------------------------------------

    def _admit(self) -> None:
        """Hand waiting requests to the engine: registered ones first (in order), then
        unregistered ones (in order) while the reserve stays free."""
        if not self._waiting:
            return
        free = self.engine.unclaimed_blocks
        reserve = self.engine.max_request_blocks
        placed: list[_OutgoingRequest] = []
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

    def _place(self, out: _OutgoingRequest) -> None:
        job = self.jobs.get(out.request_id)
        assert job is not None  # in the table from `take` until it is answered
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

    def _legs_differ(self, out: _OutgoingRequest, their_tid: str, their_fingerprint: str) -> None:
        ours = out.transfer_id.rpartition("#")[2]
        why = (
            f"the prefill and decode legs of transfer_id {out.client_transfer_id!r} carry "
            f"different prompts (prompt fingerprints {ours} at the prefill server, "
            f"{their_fingerprint} at the decode server): both legs must send the same request"
        )
        log.info("transfer %s: %s", out.transfer_id, why)
        self.runtime.refuse(their_tid, why)
        self.registry.inc("kvpush_transfers_rejected_total", labels={"status": "409"})
        job = self.jobs.pop(out.request_id)
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

    def _end_early(self, out: _OutgoingRequest, why: str) -> None:
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

    def _forget(self, out: _OutgoingRequest) -> None:
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
        count_ended(self._transfer_metrics, self.engine, result, out.started)
        if not result.ok:
            log.info(
                "transfer %s failed (%s): %s", result.transfer_id, result.reason, result.detail
            )
        job = self.jobs.pop(out.request_id)
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
