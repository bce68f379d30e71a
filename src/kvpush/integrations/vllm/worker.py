"""The worker half of `KvpushConnector`: one `PushRuntime` per worker rank.

Each vLLM worker process (one per tensor-parallel rank) registers its own KV cache and
runs its own runtime over its own NIXL agent (a `kvpush.node.Rank`); rank r of a decode
engine registers with rank r of the prefill engine (homogeneous TP), through the prefill
engine's one side channel, which answers by rank. The worker carries out the scheduler's
`StepPlan` on the runtime at the start of each step and turns what the runtime reports
into vLLM's transfer results:

- a receive that ended is in `finished_recving`; a failed one also in `failed_recving`
  (vLLM then applies `kv_load_failure_policy`). Exactly once, because the runtime
  reports every transfer exactly once, and only when kvpush no longer touches the
  blocks (a receiver that gave up waits for the sender's acknowledgement or the fence).
- a send that ended, either way, is in `finished_sending`: vLLM frees the prefill's
  blocks then, never while a write still reads them.

Layer-wise push: a `Send(layerwise=True)` is opened with no layer ready on the step that
computes the request's last prompt tokens, before its first layer is saved (vLLM may call
`start_load_kv` after the forward pass, so whichever of `start_load_kv`, `save_kv_layer`
and `wait_for_save` comes first opens it). Each `save_kv_layer` then announces that
layer (`layers_ready`): on CPU the layer's KV is in the cache when vLLM calls it; on a
GPU only once an event recorded on the compute stream after it has completed.
`wait_for_save` announces whatever is left, as the step's forward is over by then.

The worker side imports no vLLM: it reads `plan.StepPlan` and answers `plan.StepResults`,
which the connector turns into vLLM's types, so it runs over the loopback transport in
tests (`transport_factory`).

Misuse the runtime refuses at the call (a transfer id already in flight, params that
cannot be used) ends that one request the same way, on the next results.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from kvpush.errors import FailureReason, KVPushError
from kvpush.integrations.vllm.kvcache import register_vllm_kv_caches
from kvpush.integrations.vllm.plan import Send, StepPlan, StepResults
from kvpush.node import NodeIdentity, Rank, RankSettings, TransportFactory, nixl_transport

if TYPE_CHECKING:
    import torch

    from kvpush.integrations.vllm.params import ConnectorConfig
    from kvpush.runtime import PeerAddress, PushRuntime, TransferResult
    from kvpush.sidechannel import PeerMetadata

log = logging.getLogger(__name__)


def _receiver(snd: Send) -> PeerAddress | None:
    """The decode server a send is for (any of its ranks), when the proxy named it."""
    from kvpush.runtime import PeerAddress

    return None if snd.decode is None else PeerAddress(*snd.decode)


class WorkerStats(Protocol):
    """What the worker counts (`kvpush.integrations.vllm.stats.TransferStats` in vLLM)."""

    def opened(self, push: str) -> None: ...

    def layers_announced(self, by: str, n: int) -> None: ...

    def ended_at_once(self, side: str, why: str) -> None: ...

    def ended(self, result: TransferResult, seconds: float, bytes_per_block: int) -> None: ...

    def is_empty(self) -> bool: ...


S = TypeVar("S", bound=WorkerStats)


class WorkerSide(Generic[S]):
    """One worker rank. `new_stats` makes the counts handed to vLLM each interval;
    `transport_factory` builds the rank's transport (NIXL unless given)."""

    def __init__(
        self,
        config: ConnectorConfig,
        rank: int,
        *,
        new_stats: Callable[[], S],
        transport_factory: TransportFactory = nixl_transport,
    ) -> None:
        self._config = config
        self._rank = rank
        self._new_stats = new_stats
        self._transport_factory = transport_factory
        self._node_rank: Rank | None = None
        self._runtime: PushRuntime | None = None
        self._bytes_per_block = 0
        # transfer id -> (request id, when it started, blocks), per side
        # transfer id -> (request id, when it started)
        self._receiving: dict[str, tuple[str, float]] = {}
        self._sending: dict[str, tuple[str, float]] = {}
        # Ended at the call, reported with the next results: request id -> reason.
        self._failed_at_once: dict[str, str] = {}
        self._sent_at_once: set[str] = set()
        self._idle = False
        self._stats = new_stats()
        self._layer_of: dict[str, int] = {}  # vLLM's layer name -> the geometry's layer
        self._all_layers: frozenset[int] = frozenset()
        # Layer-wise sends of the current step: the plan they came from, and per
        # transfer id the layers not announced yet; device events not yet complete.
        self._opened_plan: StepPlan | None = None
        self._announcing: dict[str, set[int]] = {}
        self._events: list[tuple[int, torch.cuda.Event]] = []

    # ----------------------------------------------------------------- lifecycle

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        cfg = self._config
        geometry = register_vllm_kv_caches(kv_caches, cfg.block_size_tokens)
        if cfg.switch_interval_ms is not None:
            sys.setswitchinterval(cfg.switch_interval_ms / 1000)
        self._bytes_per_block = geometry.bytes_per_block
        # Regions are numbered in the order vLLM hands the layers (as the peer does).
        self._layer_of = {name: index for index, name in enumerate(kv_caches)}
        self._all_layers = frozenset(r.layer for r in geometry.regions)
        # The side channel is the scheduler's (it serves every rank's handshake
        # metadata): the worker runs the rank alone.
        rank = Rank(
            geometry,
            NodeIdentity(cfg.engine_id, cfg.role, cfg.side_channel_host),
            port=cfg.side_channel_port,
            rank=self._rank,
            settings=RankSettings(
                token=cfg.token,
                timing=cfg.timing,
                idle_poll_s=cfg.idle_poll_ms / 1000,
                lookup_timeout_ms=cfg.handshake_timeout_ms,
            ),
            transport_factory=self._transport_factory,
        )
        self._node_rank = rank
        rank.start()
        self._runtime = rank.runtime
        log.info(
            "kvpush rank %d: %d layers, %d blocks of %d bytes, layout %s",
            self._rank,
            geometry.num_layers,
            geometry.num_blocks,
            geometry.bytes_per_block,
            geometry.layout,
        )

    def handshake_metadata(self) -> PeerMetadata | None:
        """The rank's metadata for the scheduler's side channel (after registration)."""
        if self._runtime is None:
            return None
        return self._runtime.local_metadata()

    def shutdown(self) -> None:
        if self._node_rank is not None:
            self._node_rank.close()

    # ----------------------------------------------------------------- each step

    def start_step(self, plan: StepPlan) -> None:
        """Carry out the scheduler's plan for this step (called once per step)."""
        from kvpush.runtime import PeerAddress

        runtime = self._require_runtime()
        self._idle = plan.idle
        self._open_layerwise(plan)
        now = time.monotonic()
        for rcv in plan.receives:
            if not rcv.transfer_id:
                self._failed_at_once[rcv.request_id] = "unusable kv_transfer_params"
                continue
            sender = PeerAddress(rcv.host, rcv.port, self._rank)
            try:
                runtime.receive(
                    rcv.transfer_id, sender, rcv.blocks, sender_offset=rcv.sender_offset
                )
            except KVPushError as exc:
                log.error("request %s: cannot receive %s: %s", rcv.request_id, rcv.transfer_id, exc)
                self._failed_at_once[rcv.request_id] = f"{type(exc).__name__}: {exc}"
                continue
            self._receiving[rcv.transfer_id] = (rcv.request_id, now)
        for ref in plan.refusals:
            try:
                runtime.reject(
                    ref.transfer_id, PeerAddress(ref.host, ref.port, self._rank), ref.detail
                )
            except KVPushError as exc:
                log.warning("could not refuse transfer %s: %s", ref.transfer_id, exc)
        for snd in plan.sends:
            if snd.layerwise:
                continue  # opened by _open_layerwise
            try:
                runtime.send(
                    snd.transfer_id,
                    snd.blocks,
                    ready_layers=[] if snd.cancel else None,
                    receiver=_receiver(snd),
                )
                if snd.cancel:
                    runtime.abort(snd.transfer_id)
            except KVPushError as exc:
                log.error("request %s: cannot send %s: %s", snd.request_id, snd.transfer_id, exc)
                self._sent_at_once.add(snd.request_id)
                continue
            self._sending[snd.transfer_id] = (snd.request_id, now)
            if not snd.cancel:
                self._stats.opened("whole")
        for tid in plan.aborts:
            if tid in self._receiving or tid in self._sending:
                runtime.abort(tid)

    # ----------------------------------------------------------------- layer-wise push

    def _open_layerwise(self, plan: StepPlan) -> None:
        """Open this step's layer-wise sends, once (the first call of the step)."""
        if plan is self._opened_plan:
            return
        if self._announcing:  # a step that never reached wait_for_save: all computed
            self._flush_events(wait=True)
            self._announce(self._all_layers, "wait_for_save")
        self._opened_plan = plan
        self._announcing = {}
        runtime = self._require_runtime()
        now = time.monotonic()
        for snd in plan.sends:
            if not snd.layerwise:
                continue
            try:
                runtime.send(snd.transfer_id, snd.blocks, ready_layers=[], receiver=_receiver(snd))
            except KVPushError as exc:
                log.error("request %s: cannot send %s: %s", snd.request_id, snd.transfer_id, exc)
                self._sent_at_once.add(snd.request_id)
                continue
            self._sending[snd.transfer_id] = (snd.request_id, now)
            self._announcing[snd.transfer_id] = set(self._all_layers)
            self._stats.opened("layerwise")

    def layer_saved(self, plan: StepPlan, layer_name: str, kv_layer: torch.Tensor) -> None:
        """vLLM computed `layer_name` for this step (`save_kv_layer`)."""
        self._open_layerwise(plan)
        if not self._announcing:
            return
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return  # not a layer we registered: nothing of ours to announce
        if kv_layer.device.type == "cpu":
            self._announce((layer,), "save_kv_layer")
            return
        import torch

        # Kernels are queued, not done: announce once the stream got past this layer.
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(kv_layer.device))
        self._events.append((layer, event))
        self._flush_events(wait=False)

    def step_saved(self, plan: StepPlan) -> None:
        """The step's forward is over (`wait_for_save`): every layer is computed."""
        self._open_layerwise(plan)
        if self._announcing:
            self._flush_events(wait=True)
            self._announce(self._all_layers, "wait_for_save")

    def _flush_events(self, *, wait: bool) -> None:
        done: list[int] = []
        while self._events:
            layer, event = self._events[0]
            if wait:
                event.synchronize()
            elif not event.query():  # type: ignore[no-untyped-call]
                break
            self._events.pop(0)
            done.append(layer)
        if done:
            self._announce(done, "save_kv_layer")

    def _announce(self, layers: Iterable[int], by: str) -> None:
        runtime = self._require_runtime()
        wanted = set(layers)
        for tid, remaining in list(self._announcing.items()):
            new = remaining & wanted
            if not new:
                continue
            remaining.difference_update(new)
            if not remaining:
                del self._announcing[tid]
            self._stats.layers_announced(by, len(new))
            try:
                runtime.layers_ready(tid, sorted(new))
            except KVPushError as exc:
                # It ended already (refused, aborted): its result says how.
                log.info("transfer %s: layers %s not announced: %s", tid, sorted(new), exc)

    # ----------------------------------------------------------------- results

    def transfer_results(self) -> StepResults:
        runtime = self._require_runtime()
        ended = runtime.poll()
        if not ended and self._idle and (self._receiving or self._sending):
            # Nothing to compute this step: wait a little for an end instead of letting
            # vLLM's loop come straight back (that loop would spin a core).
            ended = runtime.wait(self._config.idle_wait_s)
        out = StepResults()
        for rid, why in self._failed_at_once.items():
            out.finished_recving.add(rid)
            out.failed_recving.add(rid)
            self._stats.ended_at_once("receiver", why)
        self._failed_at_once.clear()
        out.finished_sending |= self._sent_at_once
        self._sent_at_once.clear()
        for result in ended:
            self._ended(result, out)
        return out

    def _ended(self, result: TransferResult, out: StepResults) -> None:
        book = self._receiving if result.side == "receiver" else self._sending
        entry = book.pop(result.transfer_id, None)
        if entry is None:
            return
        rid, started = entry
        self._stats.ended(result, time.monotonic() - started, self._bytes_per_block)
        if result.side == "sender":
            out.finished_sending.add(rid)
            if not result.ok and result.reason is not FailureReason.CANCELLED:
                log.warning(
                    "request %s: sending %s failed (%s): %s",
                    rid,
                    result.transfer_id,
                    result.reason,
                    result.detail,
                )
            return
        out.finished_recving.add(rid)
        if not result.ok:
            out.failed_recving.add(rid)
            log.warning(
                "request %s: receiving %s failed (%s): %s",
                rid,
                result.transfer_id,
                result.reason,
                result.detail,
            )

    def take_stats(self) -> S | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, self._new_stats()
        return stats

    def _require_runtime(self) -> PushRuntime:
        if self._runtime is None:
            raise KVPushError(
                "KvpushConnector: the worker has no KV cache registered yet "
                "(register_kv_caches was not called)"
            )
        return self._runtime
