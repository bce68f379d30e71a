"""The worker half of `KvpushConnector`: one `PushRuntime` per worker rank.

Each vLLM worker process (one per tensor-parallel rank) registers its own KV cache and
runs its own runtime over its own NIXL agent (a `kvpush.node.Rank`), through the prefill
engine's one side channel, which answers by rank. A request's transfer is one part per
pair of ranks that exchange its KV (`kvpush.topology.rank_pairs`): with equal TP sizes
rank r with rank r, the part being the transfer itself; with a prefill at TP 2 and a
decode at TP 1, the decode rank receives two parts, one from each prefill rank, each
filling its half of the heads of every block (`kvpush.geometry.write_views`). Each part
is a runtime transfer of its own (`kvpush.topology.part_id`), with all its guarantees.
A hybrid model's KV-cache groups split each pair's part once more, one per group
(`kvpush.integrations.vllm.groups`): the groups' layers share regions, and each group's
part moves its own block ids through all of them.
The worker carries out the scheduler's `StepPlan` on the runtime at the start of each
step and turns what the runtime reports into vLLM's transfer results, once per request:

- a receive that ended is in `finished_recving` once every part of it ended; a failed
  one also in `failed_recving` (vLLM then applies `kv_load_failure_policy`). The first
  part that fails aborts the others at once, and the request is reported only when all
  have ended: the runtime reports each part exactly once, and only when kvpush no longer
  touches its blocks (a receiver that gave up waits for the sender's acknowledgement or
  the fence), so no part writes into a block after its request's result.
- a send that ended, either way, is in `finished_sending`, once every part ended: vLLM
  frees the prefill's blocks then, never while a write of any part still reads them.
- a transfer the prefill split for another decode TP than this engine's is refused at
  once, each of its parts (the prefill frees its blocks), and fails, saying so.

Where nothing names the decode's TP size (vLLM's push dialect: vllm-router, llm-d,
Dynamo), a send is split as the decode's registrations say: at once where the decode
registered first (both legs sent together), else held until a step sees one
(`kvpush.integrations.vllm.splits`). A send or receive whose transfer id another
request of this rank holds (a router that reused a request id for the same prompt)
ends at once: one transfer id, one request.

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

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import msgspec

from kvpush.errors import FailureReason, KVPushError
from kvpush.geometry import KVCacheGroup, KVHeads
from kvpush.integrations.vllm.doctor import WorkerDoctor
from kvpush.integrations.vllm.groups import group_part_id
from kvpush.integrations.vllm.kvcache import (
    cache_dtype_name,
    layer_slots,
    register_vllm_kv_caches,
)
from kvpush.integrations.vllm.plan import (
    GroupBlocks,
    Receive,
    Refuse,
    Send,
    StepPlan,
    StepResults,
)
from kvpush.integrations.vllm.splits import HeldSends, split_spoken
from kvpush.node import NodeIdentity, Rank, RankSettings, TransportFactory, nixl_transport
from kvpush.protocol.parts import RequestEnded, RequestParts
from kvpush.topology import rank_heads, transfer_parts

if TYPE_CHECKING:
    import torch

    from kvpush.integrations.vllm.params import ConnectorConfig
    from kvpush.protocol import Side
    from kvpush.runtime import PeerAddress, PushRuntime, RuntimeStatistics, TransferResult
    from kvpush.sidechannel import PeerMetadata

log = logging.getLogger(__name__)


def _receiver(snd: Send) -> PeerAddress | None:
    """The decode server a send is for (any of its ranks), when the proxy named it."""
    from kvpush.runtime import PeerAddress

    return None if snd.decode is None else PeerAddress(*snd.decode)


G = TypeVar("G")


def _layer_number(name: str) -> int | None:
    """A vLLM layer's number in the model, from its name (`model.layers.3.self_attn`)."""
    number = next((part for part in name.split(".") if part.isdigit()), None)
    return None if number is None else int(number)


def _parts(
    tid: str,
    prefill_tp: int,
    decode_tp: int,
    groups: Sequence[G],
    *,
    prefill: int | None = None,
    decode: int | None = None,
) -> list[tuple[str, int, int, G]]:
    """Every part of transfer `tid` (`part id, prefill rank, decode rank, group`): one
    per rank pair (`transfer_parts`; only those of the given prefill or decode rank) and
    per KV-cache group (`group_part_id`)."""
    return [
        (group_part_id(pair_id, g), p, d, group)
        for p, d, pair_id in transfer_parts(tid, prefill_tp, decode_tp)
        if prefill in (None, p) and decode in (None, d)
        for g, group in enumerate(groups)
    ]


class WorkerStats(Protocol):
    """What the worker counts (`kvpush.integrations.vllm.stats.TransferStats` in vLLM)."""

    def opened(self, push: str) -> None: ...

    def layers_announced(self, by: str, n: int) -> None: ...

    def registered_first(self, n: int) -> None: ...

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
        groups: tuple[KVCacheGroup, ...] = (),
        state_layers: frozenset[str] = frozenset(),
    ) -> None:
        self._config = config
        # A hybrid model's KV-cache groups (`kvpush.integrations.vllm.groups`); empty:
        # one full-attention group. Its Mamba layers, whose states lie in the blocks of
        # attention layers' regions (`kvcache.check_state_pages`).
        self._groups = groups
        self._state_layers = state_layers
        # Each numbered Mamba layer's number in the model, read once (`_computed` asks
        # for every layer vLLM computes).
        self._state_numbers = {
            name: n for name in state_layers if (n := _layer_number(name)) is not None
        }
        self._rank = rank
        self._new_stats = new_stats
        self._transport_factory = transport_factory
        self._node_rank: Rank | None = None
        self._doctor: WorkerDoctor | None = None
        self._runtime: PushRuntime | None = None
        self._bytes_per_block = 0
        # Per side, the requests whose parts have not all ended (the one rule that turns
        # parts into a request's result), and when each request was opened.
        self._books: dict[Side, RequestParts] = {
            "receiver": RequestParts("receiver"),
            "sender": RequestParts("sender"),
        }
        self._opened_at: dict[tuple[Side, str], float] = {}
        # Requests that ended at the call, reported with the next results.
        self._ended_at_once: list[RequestEnded] = []
        self._idle = False
        self._stats = new_stats()
        # Sends whose params named no decode TP size (a router that speaks vLLM's push
        # dialect sent them), held until a decode rank registers for a part of theirs
        # or rejects it: the part's id says the decode's TP (`topology.part_id`). Per
        # transfer id: the send and until when it is held. And, for the current step's
        # sends, the decode TP each is split for (None: not known yet).
        self._unsplit = HeldSends(config.timing)
        self._splits: dict[str, int | None] = {}
        # vLLM's layer name -> the geometry's layer (its region: the layers of a hybrid
        # model's groups share one), and each region's layer names.
        self._layer_of: dict[str, int] = {}
        self._names_of: dict[int, frozenset[str]] = {}
        self._all_layers: frozenset[int] = frozenset()
        # Layer-wise: the layer names computed on this step, of regions not complete.
        self._saved_names: set[str] = set()
        # Layer-wise sends of the current step: the plan they came from, and per
        # transfer id the layers not announced yet; device events not yet complete.
        self._opened_plan: StepPlan | None = None
        self._announcing: dict[str, set[int]] = {}
        self._events: list[tuple[str, torch.cuda.Event]] = []

    # ----------------------------------------------------------------- lifecycle

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        kv_scales: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        """`kv_scales`: each layer's (k_scale, v_scale), which a quantized cache's bytes
        were computed with (vLLM keeps them on its attention layers)."""
        cfg = self._config
        held = rank_heads(self._rank, cfg.tp_size, cfg.total_kv_heads, cfg.use_mla)
        heads = KVHeads(
            total=cfg.total_kv_heads,
            per_rank=held.num_heads,
            tp_size=cfg.tp_size,
            tp_rank=self._rank,
            replicated=cfg.use_mla,
        )
        geometry = register_vllm_kv_caches(
            kv_caches, cfg.block_size_tokens, heads, self._state_layers
        )
        if self._groups:
            geometry = msgspec.structs.replace(geometry, groups=self._groups)
        scales = kv_scales or {}
        dtype = cache_dtype_name(
            geometry.dtype, cfg.cache_dtype, [scales[n] for n in kv_caches if n in scales]
        )
        geometry = msgspec.structs.replace(geometry, dtype=dtype)
        if cfg.switch_interval_ms is not None:
            sys.setswitchinterval(cfg.switch_interval_ms / 1000)
        self._bytes_per_block = geometry.bytes_per_block
        # Regions are numbered in the order vLLM hands the layers (as the peer does).
        self._layer_of = layer_slots(kv_caches)
        names: dict[int, set[str]] = {}
        for name, index in self._layer_of.items():
            names.setdefault(index, set()).add(name)
        self._names_of = {index: frozenset(n) for index, n in names.items()}
        self._all_layers = frozenset(r.layer for r in geometry.regions)
        # The side channel is the scheduler's (it serves every rank's handshake
        # metadata): the worker runs the rank alone, and serves the doctor's checks.
        if cfg.doctor_writes:
            self._doctor = WorkerDoctor(cfg.side_channel_host, self._rank, cfg.token)
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
            services=() if self._doctor is None else (self._doctor.service,),
        )
        self._node_rank = rank
        rank.start()
        if self._doctor is not None:
            self._doctor.start()
        self._runtime = rank.runtime
        log.info(
            "kvpush rank %d: %d layers in %d regions, %d blocks of %d bytes, layout %s, %s",
            self._rank,
            len(self._layer_of),
            geometry.num_layers,
            geometry.num_blocks,
            geometry.bytes_per_block,
            geometry.layout,
            f"{len(self._groups)} KV-cache groups ({', '.join(g.describe() for g in self._groups)})"
            if self._groups
            else "one KV-cache group",
        )

    def handshake_metadata(self) -> PeerMetadata | None:
        """The rank's metadata for the scheduler's side channel (after registration)."""
        if self._runtime is None:
            return None
        metadata = self._runtime.local_metadata()
        return metadata if self._doctor is None else self._doctor.publish(metadata)

    def statistics(self) -> RuntimeStatistics | None:
        """The rank's runtime's `statistics()` (None before registration)."""
        return None if self._runtime is None else self._runtime.statistics()

    def shutdown(self) -> None:
        if self._doctor is not None:
            self._doctor.close()
        if self._node_rank is not None:
            self._node_rank.close()

    # ----------------------------------------------------------------- each step

    def start_step(self, plan: StepPlan) -> None:
        """Carry out the scheduler's plan for this step (called once per step)."""
        self._require_runtime()
        self._idle = plan.idle
        self._open_layerwise(plan)
        now = time.monotonic()
        for rcv in plan.receives:
            self._receive(rcv, now)
        for ref in plan.refusals:
            self._refuse(ref)
        for snd in plan.sends:
            if snd.layerwise:
                continue  # opened by _open_layerwise
            split = self._splits.get(snd.transfer_id)
            if split is not None:
                self._offer(dataclasses.replace(snd, decode_tp_size=split), now)
            else:
                self._hold(snd, now)
        for tid in plan.aborts:
            held = self._unsplit.pop(tid)
            if held is not None:  # offered and aborted at once if a decode speaks in time
                self._hold(dataclasses.replace(held, cancel=True), now)
            for book in self._books.values():
                self._abort(book.open_parts(tid))

    def _offer(self, snd: Send, now: float) -> None:
        """Offer a send whose decode TP is known, all its layers computed (or none, a
        cancelled one: it is opened and aborted at once, so a decode hears of it)."""
        if not self._send(snd, [] if snd.cancel else None, now):
            return
        if snd.cancel:
            self._abort(self._books["sender"].open_parts(snd.transfer_id))
        else:
            self._stats.opened("whole")

    def _hold(self, snd: Send, now: float) -> None:
        """Hold a send until a decode rank speaks for it (`_open_unsplit`): for the
        transfer deadline, or, for a cancelled one (nothing to move, only a decode that
        registered to tell), one liveness interval, which a decode leg sent with the
        prefill's (a router's concurrent legs) takes to register."""
        held = snd.transfer_id in self._unsplit
        if held or self._books["sender"].num_parts(snd.transfer_id):  # see `_open`
            detail = f"transfer {snd.transfer_id} is in flight already for another request"
            self._end_at_once("sender", snd.request_id, detail)
            return
        self._unsplit.hold(snd, now)

    def _split_sends(self, plan: StepPlan) -> None:
        """Once per step, before any of its sends opens: the decode TP each send is split
        for, as its params named it or as a decode rank that registered for (or
        rejected) one of its parts already said; and how many sends found their decode
        registered already (push running concurrently with the prefill)."""
        tids = [snd.transfer_id for snd in plan.sends]
        spoken = self._require_runtime().spoken_before_send(tids) if tids else []
        self._splits = {}
        first = 0
        for snd in plan.sends:
            named = split_spoken(snd.transfer_id, spoken, self._config.tp_size)
            first += named is not None and not snd.cancel
            self._splits[snd.transfer_id] = snd.decode_tp_size or named
        if first:
            self._stats.registered_first(first)

    def _open_unsplit(self, now: float) -> None:
        """Offer each held send whose decode has spoken since (its step is over: all
        layers computed); a send no decode spoke for in time (`_hold`) ends, its blocks
        freed."""
        if not self._unsplit:
            return
        spoken = self._require_runtime().spoken_before_send(self._unsplit.transfer_ids())
        offers, ended = self._unsplit.settle(spoken, self._config.tp_size, now)
        for snd, detail in ended:
            self._end_at_once("sender", snd.request_id, detail)
        for snd in offers:
            self._offer(snd, now)

    def _receive(self, rcv: Receive, now: float) -> None:
        """Register for every part of a transfer that comes to this rank."""
        from kvpush.runtime import PeerAddress

        if not rcv.transfer_id:
            self._end_at_once("receiver", rcv.request_id, "unusable kv_transfer_params")
            return
        ours = self._config.tp_size
        sender_tp = rcv.sender_tp_size or ours
        # Unnamed: ours. The prefill then learns it from our parts' ids.
        split_for = rcv.split_for_tp or ours
        if split_for != ours:
            detail = (
                f"the prefill (TP {sender_tp}) split transfer {rcv.transfer_id} for a decode "
                f"at TP {split_for}, but this decode runs TP {ours}: expected the prefill "
                f"leg's kv_transfer_params to name it (decode_tp_size: {ours}; kvpush proxy "
                f"reads it from --decode-side-channel; or name none, and the prefill "
                f"learns it from this decode's registration)"
            )
            log.error("request %s: %s", rcv.request_id, detail)
            self._refuse_parts(rcv.transfer_id, rcv.host, rcv.port, sender_tp, split_for, detail)
            self._end_at_once("receiver", rcv.request_id, detail)
            return
        groups = (GroupBlocks(rcv.blocks, rcv.sender_offset), *rcv.more_groups)
        if len(groups) != self._num_groups:
            detail = (
                f"transfer {rcv.transfer_id} names the blocks of {len(groups)} KV-cache "
                f"group(s), but this rank registered {self._num_groups}"
            )
            self._refuse_parts(rcv.transfer_id, rcv.host, rcv.port, sender_tp, split_for, detail)
            self._end_at_once("receiver", rcv.request_id, detail)
            return
        blocks_of: dict[str, GroupBlocks] = {}
        parts = []
        for pid, p, _d, group in _parts(
            rcv.transfer_id, sender_tp, ours, groups, decode=self._rank
        ):
            blocks_of[pid] = group
            parts.append((pid, p))

        def register(pid: str, p: int) -> None:
            group = blocks_of[pid]
            self._require_runtime().receive(
                pid,
                PeerAddress(rcv.host, rcv.port, p),
                group.blocks,
                sender_offset=group.sender_offset,
                sender_block_tokens=rcv.sender_block_tokens,
            )

        self._open("receiver", rcv.request_id, rcv.transfer_id, parts, register, now)

    def _refuse(self, ref: Refuse) -> None:
        sender_tp = ref.sender_tp_size or self._config.tp_size
        split_for = ref.split_for_tp or self._config.tp_size
        self._refuse_parts(ref.transfer_id, ref.host, ref.port, sender_tp, split_for, ref.detail)

    def _refuse_parts(
        self, tid: str, host: str, port: int, sender_tp: int, split_for: int, detail: str
    ) -> None:
        """Tell each prefill rank at once that its parts of `tid` will never be received
        (the parts it opened, for the decode TP it split the transfer for), each by one
        rank of ours."""
        from kvpush.runtime import PeerAddress

        runtime = self._require_runtime()
        ours = self._config.tp_size
        for pid, p, d, _g in _parts(tid, sender_tp, split_for, range(self._num_groups)):
            if d % ours != self._rank:
                continue
            try:
                runtime.reject(pid, PeerAddress(host, port, p), detail)
            except KVPushError as exc:
                log.warning("could not refuse transfer %s: %s", pid, exc)

    @property
    def _num_groups(self) -> int:
        return max(1, len(self._groups))

    def _send(self, snd: Send, ready_layers: list[int] | None, now: float) -> bool:
        """Offer our blocks to every part of a transfer that goes from this rank; False
        if none could be opened (the request is then reported sent at once)."""
        ours = self._config.tp_size
        decode_tp = snd.decode_tp_size or ours
        groups = (snd.blocks, *snd.more_groups)
        blocks_of: dict[str, tuple[int, ...]] = {}
        parts = []
        for pid, _p, d, blocks in _parts(
            snd.transfer_id, ours, decode_tp, groups, prefill=self._rank
        ):
            blocks_of[pid] = blocks
            parts.append((pid, d))

        def offer(pid: str, _d: int) -> None:
            self._require_runtime().send(
                pid, blocks_of[pid], ready_layers=ready_layers, receiver=_receiver(snd)
            )

        return self._open("sender", snd.request_id, snd.transfer_id, parts, offer, now)

    def _open(
        self,
        side: Side,
        rid: str,
        tid: str,
        parts: list[tuple[str, int]],
        start: Callable[[str, int], None],
        now: float,
    ) -> bool:
        """Start every part; a part the runtime refuses at the call fails the request
        (`RequestParts.open`). False if no part started (the request ended at once).

        A transfer id (or a part of it) that another request of ours holds open ends
        this request at once, before the runtime sees it: two requests that name one
        transfer (a router that reused an `X-Request-Id` for the same prompt) must not
        share its parts, nor its result."""
        book = self._books[side]
        if book.num_parts(tid) or any(book.transfer_of(pid) is not None for pid, _ in parts):
            detail = (
                f"transfer {tid} is in flight already for another request on this "
                f"{side}: a transfer id names one request (a router that reuses a request "
                "id for the same prompt gets the second refused)"
            )
            log.error("request %s: %s", rid, detail)
            self._end_at_once(side, rid, detail)
            return False
        started: list[str] = []
        refused: str | None = None
        for pid, peer_rank in parts:
            try:
                start(pid, peer_rank)
            except KVPushError as exc:
                log.error("request %s: cannot %s %s: %s", rid, side[:-2] + "e", pid, exc)
                refused = f"{type(exc).__name__}: {exc}"
                break
            started.append(pid)
        outcome = self._books[side].open(rid, tid, started, refused)
        if outcome.ended is not None:
            self._ended_at_once.append(outcome.ended)
            return False
        self._opened_at[(side, tid)] = now
        self._abort(outcome.abort)
        return True

    def _end_at_once(self, side: Side, rid: str, detail: str) -> None:
        """A request with no part to open: it fails (it ends, on a sender) at once."""
        self._ended_at_once.append(self._books[side].ended_at_once(rid, detail))

    def _abort(self, parts: Iterable[str]) -> None:
        """Abort these parts (each one's result still comes, once)."""
        runtime = self._require_runtime()
        for pid in parts:
            runtime.abort(pid)

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
        self._saved_names = set()
        now = time.monotonic()
        self._split_sends(plan)
        for snd in plan.sends:
            if not snd.layerwise:
                continue
            split = self._splits.get(snd.transfer_id)
            if split is None:  # offered whole once its decode speaks (`_open_unsplit`)
                self._hold(snd, now)
                continue
            if not self._send(dataclasses.replace(snd, decode_tp_size=split), [], now):
                continue
            for pid in self._books["sender"].open_parts(snd.transfer_id):
                self._announcing[pid] = set(self._all_layers)
            self._stats.opened("layerwise")

    def layer_saved(self, plan: StepPlan, layer_name: str, kv_layer: torch.Tensor) -> None:
        """vLLM computed `layer_name` for this step (`save_kv_layer`)."""
        self._open_layerwise(plan)
        if not self._announcing:
            return
        if layer_name not in self._layer_of:
            return  # not a layer we registered: nothing of ours to announce
        if kv_layer.device.type == "cpu":
            self._computed((layer_name,), "save_kv_layer")
            return
        import torch

        # Kernels are queued, not done: announce once the stream got past this layer.
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(kv_layer.device))
        self._events.append((layer_name, event))
        self._flush_events(wait=False)

    def step_saved(self, plan: StepPlan) -> None:
        """The step's forward is over (`wait_for_save`): every layer is computed."""
        self._open_layerwise(plan)
        if self._announcing:
            self._flush_events(wait=True)
            self._announce(self._all_layers, "wait_for_save")

    def _flush_events(self, *, wait: bool) -> None:
        done: list[str] = []
        while self._events:
            name, event = self._events[0]
            if wait:
                event.synchronize()
            elif not event.query():  # type: ignore[no-untyped-call]
                break
            self._events.pop(0)
            done.append(name)
        if done:
            self._computed(done, "save_kv_layer")

    def _computed(self, names: Iterable[str], by: str) -> None:
        """These layers are computed: announce the regions all of whose layers are (a
        hybrid model's region holds a layer of each group, any block one's KV). A Mamba
        layer never says it is computed (vLLM calls `save_kv_layer` from attention
        layers only); the forward pass runs the layers in order, so each state layer
        numbered before a computed layer is computed too."""
        new = set(names)
        for name in names:
            number = _layer_number(name)
            if number is not None:
                new.update(s for s, before in self._state_numbers.items() if before < number)
        new -= self._saved_names
        self._saved_names |= new
        complete = {
            self._layer_of[name]
            for name in new
            if name in self._layer_of and self._names_of[self._layer_of[name]] <= self._saved_names
        }
        if complete:
            self._announce(complete, by)

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
        self._open_unsplit(time.monotonic())
        ended = runtime.poll()
        if not ended and self._idle and (any(self._books.values()) or self._unsplit):
            # Nothing to compute this step: wait a little for an end instead of letting
            # vLLM's loop come straight back (that loop would spin a core).
            ended = runtime.wait(self._config.idle_wait_s)
        out = StepResults()
        for request in self._ended_at_once:
            if not request.ok:
                self._stats.ended_at_once(request.side, request.detail)
            self._report(request, out)
        self._ended_at_once.clear()
        for result in ended:
            self._ended(result, out)
        return out

    def _ended(self, result: TransferResult, out: StepResults) -> None:
        book = self._books[result.side]
        tid = book.transfer_of(result.transfer_id)
        if tid is None:
            return
        opened = self._opened_at[(result.side, tid)]
        # Each part moved its rank pair's share of our blocks (the heads it exchanges);
        # a hybrid model's groups split a pair's part once more, each moving whole
        # blocks of its own ids, so the share is per rank pair, not per part.
        pairs = max(1, book.num_parts(tid) // self._num_groups)
        self._stats.ended(result, time.monotonic() - opened, self._bytes_per_block // pairs)
        if not result.ok and result.reason is not FailureReason.CANCELLED:
            log.warning(
                "request %s: %s part %s failed (%s): %s",
                book.request_of(result.transfer_id),
                "sending" if result.side == "sender" else "receiving",
                result.transfer_id,
                result.reason,
                result.detail,
            )
        outcome = book.part_ended(result.transfer_id, result.reason, result.detail)
        self._abort(outcome.abort)
        if outcome.ended is not None:
            del self._opened_at[(result.side, tid)]
            self._report(outcome.ended, out)

    @staticmethod
    def _report(request: RequestEnded, out: StepResults) -> None:
        """vLLM's view of a request's one result: a send ended either way frees the
        prefill's blocks; a receive that failed is also in `failed_recving`."""
        if request.side == "sender":
            out.finished_sending.add(request.request_id)
            return
        out.finished_recving.add(request.request_id)
        if not request.ok:
            out.failed_recving.add(request.request_id)

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
