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

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpush.config import SideChannelConfig, TimingConfig, load_token
from kvpush.errors import FailureReason, KVPushError
from kvpush.kvcache import KVLayout, register_kv_cache
from kvpush.serving.engine import Engine, FinishReason, RequestRejected, SamplingParams
from kvpush.serving.metrics import Registry
from kvpush.serving.paged import KV_LAYOUT
from kvpush.serving.server import BadRequest, CompletionRequest, Prepare
from kvpush.serving.worker import Accepted, Done, EngineWorker, Job, Rejected

if TYPE_CHECKING:
    from kvpush.runtime import PushRuntime, TransferResult
    from kvpush.serving.app import ServeOptions
    from kvpush.sidechannel import MetadataServer

log = logging.getLogger(__name__)

# While a transfer is in flight and the engine is otherwise idle, the engine thread
# sleeps on its command queue this long between polls of the runtime: short against a
# transfer (a few ms), long enough that the sleeping thread leaves the GIL to the
# runtime's thread.
_TRANSFER_POLL_S = 0.001


def _str_param(params: dict[str, object], key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"kv_transfer_params.{key} must be a non-empty string, got {value!r}")
    return value


def _int_param(params: dict[str, object], key: str) -> int:
    value = params.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 65536:
        raise BadRequest(f"kv_transfer_params.{key} must be a port number, got {value!r}")
    return value


@dataclass(slots=True)
class _Outgoing:
    """A prefill request whose blocks go to a decode server."""

    transfer_id: str
    request_id: str
    num_blocks: int
    started: float
    sent: bool = False
    ended: bool = False
    request_done: bool = False


@dataclass(slots=True)
class _Incoming:
    """A decode request waiting for its KV."""

    transfer_id: str
    job: Job
    num_blocks: int
    started: float
    aborted: bool = False


class _TransferWorker(EngineWorker):
    def __init__(self, engine: Engine, runtime: PushRuntime, registry: Registry) -> None:
        super().__init__(engine)
        self.runtime = runtime
        self.registry = registry

    def _idle_wait(self) -> float:
        return _TRANSFER_POLL_S if self._has_pending() else super()._idle_wait()

    def _has_pending(self) -> bool:
        """Whether a transfer of ours is in flight (its end comes from `runtime.poll()`)."""
        raise NotImplementedError

    def _pump(self) -> None:
        for result in self.runtime.poll():
            self._transfer_ended(result)

    def _transfer_ended(self, result: TransferResult) -> None:
        raise NotImplementedError

    def _count(self, result: TransferResult, started: float, nbytes: int) -> None:
        outcome = "finished" if result.ok else "failed"
        reason = result.reason.value if result.reason is not None else ""
        self.registry.inc(
            "kvpush_transfers_total",
            labels={"side": result.side, "outcome": outcome, "reason": reason},
        )
        if result.ok:
            self.registry.inc("kvpush_transfer_bytes_total", nbytes, labels={"side": result.side})
            self.registry.observe(
                "kvpush_transfer_latency_seconds",
                time.monotonic() - started,
                labels={"side": result.side},
            )


class PrefillWorker(_TransferWorker):
    def __init__(
        self, engine: Engine, runtime: PushRuntime, registry: Registry, *, layerwise: bool
    ) -> None:
        super().__init__(engine, runtime, registry)
        self.layerwise = layerwise
        self._outgoing: dict[str, _Outgoing] = {}  # by request id
        self._by_transfer: dict[str, _Outgoing] = {}
        if layerwise:
            engine.on_layer_done = self._layer_done

    def _has_pending(self) -> bool:
        return bool(self._by_transfer)

    def _accept(self, job: Job) -> None:
        kvp = job.kv_transfer_params or {}
        if not kvp.get("do_remote_decode"):
            super()._accept(job)
            return
        tid = str(kvp["transfer_id"])
        if tid in self._by_transfer:
            job.sink(Rejected(409, f"transfer_id {tid!r} is already in flight here"))
            return
        try:
            self.engine.add_request(
                job.request_id,
                job.prompt_token_ids,
                SamplingParams(max_tokens=1, ignore_eos=True),
                hold_blocks=True,
            )
        except RequestRejected as exc:
            job.sink(Rejected(400, str(exc)))
            return
        log.debug("transfer %s: prefill request accepted", tid)
        out = _Outgoing(
            tid,
            job.request_id,
            self.engine.transfer_block_count(len(job.prompt_token_ids)),
            time.monotonic(),
        )
        self._outgoing[job.request_id] = out
        self._by_transfer[tid] = out
        self._jobs[job.request_id] = job
        job.sink(Accepted())

    def _layer_done(self, layer: int, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            out = self._outgoing.get(rid)
            if out is None or out.ended:
                continue
            if not out.sent:
                blocks = self.engine.blocks_of(rid)[: out.num_blocks]
                self.runtime.send(out.transfer_id, blocks, ready_layers=[layer])
                out.sent = True
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
            self.runtime.send(out.transfer_id, blocks)
            out.sent = True
        out.request_done = True
        self._jobs.pop(job.request_id, None)
        job.sink(
            Done(
                reason,
                stats,
                kv_transfer_params={
                    "do_remote_decode": True,
                    "transfer_id": out.transfer_id,
                    "num_blocks": out.num_blocks,
                },
            )
        )

    def _abort_job(self, job: Job) -> None:
        out = self._outgoing.get(job.request_id)
        if out is None:
            super()._abort_job(job)
            return
        if out.sent:
            self.runtime.abort(out.transfer_id)  # blocks are freed when it is reported
        else:
            self._forget(out)

    def _fail_all(self, message: str) -> None:
        for out in list(self._outgoing.values()):
            if out.sent and not out.ended:
                self.runtime.abort(out.transfer_id)
        super()._fail_all(message)

    def _forget(self, out: _Outgoing) -> None:
        self._outgoing.pop(out.request_id, None)
        self._by_transfer.pop(out.transfer_id, None)
        self.engine.release(out.request_id)

    def _transfer_ended(self, result: TransferResult) -> None:
        log.debug("transfer %s ended on the sender side: %s", result.transfer_id, result.reason)
        out = self._by_transfer.get(result.transfer_id)
        if out is None or result.side != "sender":
            return
        out.ended = True
        self._count(result, out.started, out.num_blocks * self.engine.kv_cache.bytes_per_block)
        if not result.ok:
            log.warning(
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


class DecodeWorker(_TransferWorker):
    def __init__(self, engine: Engine, runtime: PushRuntime, registry: Registry) -> None:
        super().__init__(engine, runtime, registry)
        self._incoming: dict[str, _Incoming] = {}  # by transfer id
        self._transfer_of: dict[str, str] = {}  # request id -> transfer id

    def _has_pending(self) -> bool:
        return bool(self._incoming)

    def _accept(self, job: Job) -> None:
        from kvpush.runtime import PeerAddress

        kvp = job.kv_transfer_params or {}
        if not kvp.get("do_remote_prefill"):
            super()._accept(job)
            return
        tid = str(kvp["transfer_id"])
        sender = PeerAddress(str(kvp["remote_host"]), int(str(kvp["remote_port"])))
        if tid in self._incoming:
            job.sink(Rejected(409, f"transfer_id {tid!r} is already in flight here"))
            return
        try:
            where = self.engine.add_remote_request(job.request_id, job.prompt_token_ids, job.params)
        except RequestRejected as exc:
            self.runtime.reject(tid, sender, str(exc))
            job.sink(Rejected(400, str(exc)))
            return
        if where is None:
            detail = "no free KV blocks on the decode server"
            self.runtime.reject(tid, sender, detail)
            job.sink(Rejected(503, f"{detail}: retry later"))
            return
        try:
            self.runtime.receive(tid, sender, where.blocks, sender_offset=where.sender_offset)
        except KVPushError as exc:
            self.engine.release(job.request_id)
            job.sink(Rejected(400, f"cannot receive transfer {tid!r}: {exc}"))
            return
        log.debug("transfer %s: %d blocks registered", tid, len(where.blocks))
        self._incoming[tid] = _Incoming(tid, job, len(where.blocks), time.monotonic())
        self._transfer_of[job.request_id] = tid
        self._jobs[job.request_id] = job
        job.sink(Accepted())

    def _abort_job(self, job: Job) -> None:
        tid = self._transfer_of.get(job.request_id)
        if tid is None or tid not in self._incoming:
            self._transfer_of.pop(job.request_id, None)
            super()._abort_job(job)
            return
        self._incoming[tid].aborted = True
        self.runtime.abort(tid)  # blocks are freed when the runtime reports the end

    def _fail_all(self, message: str) -> None:
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
        self._count(result, inc.started, inc.num_blocks * self.engine.kv_cache.bytes_per_block)
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
    """The kvpush side of one server: runtime (and its transport) plus side channel."""

    def __init__(self, options: ServeOptions, engine: Engine) -> None:
        self.options = options
        self.engine = engine
        self.engine_id = f"{options.role}-{uuid.uuid4().hex[:8]}"
        self.runtime: PushRuntime | None = None
        self.side_channel: MetadataServer | None = None

    def start(self) -> PushRuntime:
        from kvpush.runtime import PushRuntime, RuntimeIdentity, SideChannelPeerDirectory
        from kvpush.sidechannel import MetadataServer
        from kvpush.transports.nixl import NixlTransport

        opts = self.options
        assert opts.side_channel_port is not None
        geometry = register_kv_cache(
            self.engine.kv_cache.by_layer(), KVLayout(KV_LAYOUT), self.engine.block_size
        )
        incarnation = uuid.uuid4().hex
        identity = RuntimeIdentity(
            engine_id=self.engine_id,
            incarnation=incarnation,
            host=opts.host,
            port=opts.side_channel_port,
            role="sender" if opts.role == "prefill" else "receiver",
        )
        token = load_token(opts.token_file)
        transport = NixlTransport(f"{self.engine_id}-{incarnation[:8]}")
        self.runtime = PushRuntime(
            transport,
            geometry,
            identity,
            SideChannelPeerDirectory(token=token, expect_compat_hash=geometry.compat_hash()),
            timing=TimingConfig(),
            # NIXL cannot wake the runtime when a registration arrives: an idle runtime
            # finds it at its next poll, so this bounds the delay a request sees.
            idle_poll_s=opts.idle_poll_ms / 1000,
        )
        self.runtime.start()
        meta = self.runtime.local_metadata()
        self.side_channel = MetadataServer(
            opts.host, opts.side_channel_port, SideChannelConfig(token=token), {0: meta}
        )
        self.side_channel.start()
        return self.runtime

    def close(self) -> None:
        if self.side_channel is not None:
            self.side_channel.close()
        if self.runtime is not None:
            self.runtime.close()

    def health(self) -> dict[str, object]:
        return {
            "engine_id": self.engine_id,
            "side_channel_host": self.options.host,
            "side_channel_port": self.options.side_channel_port,
        }


def _prepare_for(role: str) -> Prepare:
    def prepare(req: CompletionRequest) -> CompletionRequest:
        kvp = req.kv_transfer_params
        if kvp is None:
            return req
        if role == "prefill" and kvp.get("do_remote_decode"):
            _str_param(kvp, "transfer_id")
            if req.stream:
                raise BadRequest("a remote-decode (prefill) request cannot stream")
        elif role == "decode" and kvp.get("do_remote_prefill"):
            _str_param(kvp, "transfer_id")
            _str_param(kvp, "remote_host")
            _int_param(kvp, "remote_port")
        elif kvp.get("do_remote_decode") or kvp.get("do_remote_prefill"):
            raise BadRequest(
                f"this is a {role} server: expected "
                + ("do_remote_decode" if role == "prefill" else "do_remote_prefill")
            )
        return req

    return prepare


def build_role(
    options: ServeOptions, engine: Engine, registry: Registry
) -> tuple[EngineWorker, KVBridge, Prepare, Callable[[], dict[str, object]]]:
    bridge = KVBridge(options, engine)
    runtime = bridge.start()
    try:
        worker: EngineWorker
        if options.role == "prefill":
            worker = PrefillWorker(engine, runtime, registry, layerwise=options.layerwise)
        else:
            worker = DecodeWorker(engine, runtime, registry)
    except BaseException:
        bridge.close()
        raise
    return worker, bridge, _prepare_for(options.role), bridge.health


__all__ = ["DecodeWorker", "FailureReason", "KVBridge", "PrefillWorker", "build_role"]
