"""The worker half of `KvpushConnector`: one `PushRuntime` per worker rank.

Each vLLM worker process (one per tensor-parallel rank of each pipeline stage) registers
its own KV cache and runs its own runtime over its own NIXL agent (a `kvpush.node.Rank`),
through the engine's one side channel, which answers by rank (`stage * tp_size + tp
rank`). A request's transfer is one part per
pair of ranks that exchange its KV (`kvpush.topology.rank_pairs`): with equal TP sizes
rank r with rank r, the part being the transfer itself; with a prefill at TP 2 and a
decode at TP 1, the decode rank receives two parts, one from each prefill rank, each
filling its half of the heads of every block (`kvpush.geometry.write_views`). Each part
is a runtime transfer of its own (`kvpush.topology.part_id`), with all its guarantees.
A prefill's pipeline stages split each pair's part by stage, each stage sending its
own layers (`kvpush.topology.stage_part_id`; `WorkerSide` says how).
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
- a request queued on the decode without blocks (`Claim`) has each part this rank will
  receive claimed from its prefill rank until it registers, is refused or ends
  (`kvpush.integrations.vllm.claims`).

Where nothing names the decode's TP size (vLLM's push dialect: vllm-router, llm-d,
Dynamo), a send is split as the decode's registrations or claims say: at once where the
decode registered or claimed first (both legs sent together, or the decode leg queued
there), else held until a step sees one (`kvpush.integrations.vllm.splits`). A send or
receive whose transfer id another request of this rank holds (a router that reused a
request id for the same prompt) ends at once: one transfer id, one request.

Layer-wise push: a `Send(layerwise=True)` is opened with no layer ready on the step that
computes the request's last prompt tokens, before its first layer is saved (vLLM may call
`start_load_kv` after the forward pass, so whichever of `start_load_kv`, `save_kv_layer`
and `wait_for_save` comes first opens it); which layers each of its parts may then
announce, `kvpush.integrations.vllm.layerwise` says. The rank itself, its geometry and
its runtime, is started by `kvpush.integrations.vllm.worker_rank`.

The worker side imports no vLLM: it reads `plan.StepPlan` and answers `plan.StepResults`,
which the connector turns into vLLM's types, so it runs over the loopback transport in
tests (`transport_factory`).

Misuse the runtime refuses at the call (a transfer id already in flight, params that
cannot be used) ends that one request the same way, on the next results.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from kvpush.errors import FailureReason, KVPushError
from kvpush.geometry import KVCacheGroup
from kvpush.integrations.vllm.books import RequestBooks, report
from kvpush.integrations.vllm.claims import DecodeClaims
from kvpush.integrations.vllm.layerwise import Announcement
from kvpush.integrations.vllm.parts import (
    UnstagedRegistrations,
    receive_parts,
    receive_problem,
    request_parts,
    unstaged_detail,
)
from kvpush.integrations.vllm.plan import Receive, Refuse, Send, StepPlan, StepResults
from kvpush.integrations.vllm.splits import SendSplits
from kvpush.integrations.vllm.worker_rank import StartedRank, start_rank
from kvpush.node import TransportFactory, nixl_transport

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
    """One worker rank: tensor-parallel rank `rank` of pipeline stage `stage`.
    `new_stats` makes the counts handed to vLLM each interval; `transport_factory`
    builds the rank's transport (NIXL unless given).

    A prefill of several pipeline stages (`ConnectorConfig.pp_size`): each stage's
    workers register their own slice of the layers (named as in the whole model, a
    `PipelineStage` in their geometry), answer on the side channel as rank `stage *
    tp_size + rank`, and send their own layers of every request, one part per rank
    pair of their own (`kvpush.topology.stage_part_id`); a decode registers for every
    stage's parts (`Receive.sender_pp_size`) and reports the request once all ended."""

    def __init__(
        self,
        config: ConnectorConfig,
        rank: int,
        *,
        new_stats: Callable[[], S],
        transport_factory: TransportFactory = nixl_transport,
        groups: tuple[KVCacheGroup, ...] = (),
        state_layers: frozenset[str] = frozenset(),
        stage: int = 0,
    ) -> None:
        if not 0 <= stage < config.pp_size:
            raise KVPushError(
                f"pipeline stage {stage} of an engine of {config.pp_size}: expected a stage "
                f"in 0..{config.pp_size - 1}"
            )
        self._config = config
        self._stage = stage
        # A hybrid model's KV-cache groups (`kvpush.integrations.vllm.groups`); empty:
        # one full-attention group. Its Mamba layers, whose states lie in the blocks of
        # attention layers' regions (`kvcache.check_state_pages`).
        self._groups = groups
        self._state_layers = state_layers
        self._rank = rank
        self._new_stats = new_stats
        self._transport_factory = transport_factory
        self._started: StartedRank | None = None
        self._runtime: PushRuntime | None = None
        self._books = RequestBooks()
        # Decode: the parts we claim (`Claim`) until a `Receive`, `Refuse` or abort.
        self._claims = DecodeClaims(config.tp_size, rank, max(1, len(groups)))
        self._idle = False
        self._stats = new_stats()
        # Prefill: the decode TP each send is split for, and the sends whose params
        # named none (a router that speaks vLLM's push dialect), held until a decode
        # rank registers for, rejects or claims a part of theirs: the part's id says
        # the decode's TP (`topology.part_id`).
        self._sends = SendSplits(config.timing, config.handshake_timeout_ms / 1000, config.tp_size)
        # Layer-wise sends are opened once per step: the plan they came from.
        self._opened_plan: StepPlan | None = None
        # A pipeline stage: the registrations of decodes not told of the stages.
        self._unstaged = UnstagedRegistrations()

    # ----------------------------------------------------------------- lifecycle

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        kv_scales: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        """`kv_scales`: each layer's (k_scale, v_scale), which a quantized cache's bytes
        were computed with (vLLM keeps them on its attention layers)."""
        self._started = start_rank(
            self._config,
            self._rank,
            self._stage,
            kv_caches,
            kv_scales or {},
            groups=self._groups,
            state_layers=self._state_layers,
            transport_factory=self._transport_factory,
        )
        self._runtime = self._started.node.runtime

    def handshake_metadata(self) -> PeerMetadata | None:
        """The rank's metadata for the scheduler's side channel (after registration)."""
        if self._started is None or self._runtime is None:
            return None
        metadata = self._runtime.local_metadata()
        doctor = self._started.doctor
        return metadata if doctor is None else doctor.publish(metadata)

    def statistics(self) -> RuntimeStatistics | None:
        """The rank's runtime's `statistics()` (None before registration)."""
        return None if self._runtime is None else self._runtime.statistics()

    def shutdown(self) -> None:
        if self._started is not None:
            self._started.close()

    # ----------------------------------------------------------------- each step

    def start_step(self, plan: StepPlan) -> None:
        """Carry out the scheduler's plan for this step (called once per step)."""
        runtime = self._require_runtime()
        self._idle = plan.idle
        self._open_layerwise(plan)
        now = time.monotonic()
        for claim in plan.claims:
            self._claims.claim(runtime, claim)
        for rcv in plan.receives:
            self._receive(rcv, now)
            self._claims.end(runtime, self._books, rcv.transfer_id)
        for ref in plan.refusals:
            self._claims.refuse(runtime, ref)
        for snd in plan.sends:
            if snd.layerwise:
                continue  # opened by _open_layerwise
            split = self._sends.split_for(snd.transfer_id)
            if split is not None:
                self._offer(dataclasses.replace(snd, decode_tp_size=split), now)
            else:
                self._hold(snd, now)
        for tid in plan.aborts:
            held = self._sends.held.pop(tid)
            if held is not None:  # offered and aborted at once if a decode speaks in time
                self._hold(dataclasses.replace(held, cancel=True), now)
            for side in ("sender", "receiver"):
                self._abort(self._books.open_parts(side, tid))
            self._claims.end(runtime, self._books, tid)

    def _offer(self, snd: Send, now: float) -> None:
        """Offer a send whose decode TP is known, all its layers computed (or none, a
        cancelled one: it is opened and aborted at once, so a decode hears of it)."""
        if not self._send(snd, [] if snd.cancel else None, now):
            return
        if snd.cancel:
            self._abort(self._books.open_parts("sender", snd.transfer_id))
        else:
            self._stats.opened("whole")

    def _hold(self, snd: Send, now: float) -> None:
        """Hold a send until a decode rank speaks for it (`_open_unsplit`), or for as long
        as `HeldSends.hold` says."""
        held = snd.transfer_id in self._sends.held
        if held or self._books.holds("sender", snd.transfer_id):  # see `_open`
            detail = f"transfer {snd.transfer_id} is in flight already for another request"
            self._end_at_once("sender", snd.request_id, detail)
            return
        self._sends.held.hold(snd, now)

    def _open_unsplit(self, now: float) -> None:
        """Offer each held send whose decode has spoken since (its step is over: all
        layers computed); a send no decode spoke for in time (`_hold`) ends, its blocks
        freed."""
        offers, ended = self._sends.settle(self._require_runtime(), now)
        for snd, detail in ended:
            self._end_at_once("sender", snd.request_id, detail)
        for snd in offers:
            self._offer(snd, now)

    def _refuse_unstaged(self) -> None:
        """A pipeline stage's sends: a decode whose leg did not say the prefill's stages
        (a router that dropped `pp_size`) registers part ids without a stage
        (`stage_part_id`), which no stage sends. Refuse each at once, saying why (the
        decode's request fails now, not at its deadline), and end our send of that
        transfer (its blocks freed now): one stage's layers never make a request."""
        if self._config.pp_size == 1:
            return
        tids = self._books.sending() + self._sends.held.transfer_ids()
        runtime = self._require_runtime()
        spoken = runtime.spoken_before_send(tids) if tids else []
        for pid, tid in self._unstaged.new(spoken, tids):
            detail = unstaged_detail(pid, self._config.pp_size)
            log.error("transfer %s: %s", tid, detail)
            try:
                runtime.refuse(pid, detail)
            except KVPushError as exc:
                log.warning("could not refuse %s: %s", pid, exc)
            held = self._sends.held.pop(tid)
            if held is not None:
                self._end_at_once("sender", held.request_id, detail)
            self._abort(self._books.open_parts("sender", tid))

    def _receive(self, rcv: Receive, now: float) -> None:
        """Register for every part of a transfer that comes to this rank."""
        from kvpush.runtime import PeerAddress

        if not rcv.transfer_id:
            self._end_at_once("receiver", rcv.request_id, "unusable kv_transfer_params")
            return
        problem = receive_problem(rcv, self._config.tp_size, self._num_groups)
        if problem is not None:
            log.error("request %s: %s", rcv.request_id, problem)
            self._claims.refuse(
                self._require_runtime(),
                Refuse(
                    rcv.transfer_id,
                    rcv.host,
                    rcv.port,
                    problem,
                    rcv.sender_tp_size,
                    rcv.split_for_tp,
                    rcv.sender_pp_size,
                ),
            )
            self._end_at_once("receiver", rcv.request_id, problem)
            return
        parts = receive_parts(rcv, self._config.tp_size, self._rank)
        blocks_of = {pid: group for pid, _p, group in parts}

        def register(pid: str, p: int) -> None:
            group = blocks_of[pid]
            self._require_runtime().receive(
                pid,
                PeerAddress(rcv.host, rcv.port, p),
                group.blocks,
                sender_offset=group.sender_offset,
                sender_block_tokens=rcv.sender_block_tokens,
            )

        started = [(pid, p) for pid, p, _group in parts]
        self._open("receiver", rcv.request_id, rcv.transfer_id, started, register, now)

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
        for pid, _p, d, blocks in request_parts(
            snd.transfer_id,
            ours,
            decode_tp,
            groups,
            prefill=self._rank,
            stages=self._config.pp_size,
            stage=self._stage,
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
        (`RequestParts.open`). False if no part started (the request ended at once). A
        transfer another request of ours holds ends this one at once, before the
        runtime sees it (`RequestBooks.taken`)."""
        taken = self._books.taken(side, tid, (pid for pid, _ in parts))
        if taken is not None:
            log.error("request %s: %s", rid, taken)
            self._end_at_once(side, rid, taken)
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
        abort = self._books.opened(side, rid, tid, started, refused, now)
        if abort is None:
            return False
        self._abort(abort)
        return True

    def _end_at_once(self, side: Side, rid: str, detail: str) -> None:
        """A request with no part to open: it fails (it ends, on a sender) at once."""
        self._books.end_at_once(side, rid, detail)

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
        layers = self._require_started().layers
        self._announce(layers.new_step())
        self._opened_plan = plan
        now = time.monotonic()
        first = self._sends.new_step(self._require_runtime(), plan.sends)
        if first:
            self._stats.registered_first(first)
        for snd in plan.sends:
            if not snd.layerwise:
                continue
            split = self._sends.split_for(snd.transfer_id)
            if split is None:  # offered whole once its decode speaks (`_open_unsplit`)
                self._hold(snd, now)
                continue
            if not self._send(dataclasses.replace(snd, decode_tp_size=split), [], now):
                continue
            for pid in self._books.open_parts("sender", snd.transfer_id):
                layers.expect(pid)
            self._stats.opened("layerwise")

    def layer_saved(self, plan: StepPlan, layer_name: str, kv_layer: torch.Tensor) -> None:
        """vLLM computed `layer_name` for this step (`save_kv_layer`)."""
        self._open_layerwise(plan)
        self._announce(self._require_started().layers.saved(layer_name, kv_layer))

    def step_saved(self, plan: StepPlan) -> None:
        """The step's forward is over (`wait_for_save`): every layer is computed."""
        self._open_layerwise(plan)
        self._announce(self._require_started().layers.step_done())

    def _announce(self, announcements: Iterable[Announcement]) -> None:
        runtime = self._require_runtime()
        for a in announcements:
            self._stats.layers_announced(a.by, len(a.layers))
            try:
                runtime.layers_ready(a.part_id, list(a.layers))
            except KVPushError as exc:
                # It ended already (refused, aborted): its result says how.
                log.info("transfer %s: layers %s not announced: %s", a.part_id, list(a.layers), exc)

    # ----------------------------------------------------------------- results

    def transfer_results(self) -> StepResults:
        runtime = self._require_runtime()
        self._refuse_unstaged()
        self._open_unsplit(time.monotonic())
        ended = runtime.poll()
        if not ended and self._idle and (self._books or self._sends.held):
            # Nothing to compute this step: wait a little for an end instead of letting
            # vLLM's loop come straight back (that loop would spin a core).
            ended = runtime.wait(self._config.idle_wait_s)
        out = StepResults()
        for request in self._books.take_ended_at_once():
            if not request.ok:
                self._stats.ended_at_once(request.side, request.detail)
            report(request, out)
        for result in ended:
            self._ended(result, out)
        return out

    def _ended(self, result: TransferResult, out: StepResults) -> None:
        ended = self._books.part_ended(result, time.monotonic())
        if ended is None:
            return
        # Each part moved its rank pair's share of our blocks (the heads it exchanges);
        # a hybrid model's groups split a pair's part once more, each moving whole
        # blocks of its own ids, so the share is per rank pair, not per part.
        pairs = max(1, ended.parts // self._num_groups)
        per_block = self._require_started().bytes_per_block
        self._stats.ended(result, ended.seconds, per_block // pairs)
        if not result.ok and result.reason is not FailureReason.CANCELLED:
            log.warning(
                "request %s: %s part %s failed (%s): %s",
                ended.request_id,
                "sending" if result.side == "sender" else "receiving",
                result.transfer_id,
                result.reason,
                result.detail,
            )
        self._abort(ended.abort)
        if ended.request is not None:
            report(ended.request, out)

    def take_stats(self) -> S | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, self._new_stats()
        return stats

    def _require_started(self) -> StartedRank:
        if self._started is None:
            self._require_runtime()  # raises, saying why
        assert self._started is not None
        return self._started

    def _require_runtime(self) -> PushRuntime:
        if self._runtime is None:
            raise KVPushError(
                "KvpushConnector: the worker has no KV cache registered yet "
                "(register_kv_caches was not called)"
            )
        return self._runtime
