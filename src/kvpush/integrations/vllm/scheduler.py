"""The scheduler half of `KvpushConnector`: which requests move KV, and their blocks.

It runs in vLLM's engine-core process, next to the scheduler, and does no transfer
itself: each engine step it hands the workers a `StepPlan` (what to receive, send,
refuse or abort), and it learns from vLLM's aggregated worker output which transfers
ended. (The engine's side channel, in the same process, is
`kvpush.integrations.vllm.side_channel`.)

Decode side (`do_remote_prefill`): the request waits for remote KV (`get_num_new_matched_tokens`
answers "the rest of the prompt, asynchronously"); once vLLM allocated its blocks, the
blocks after its own prefix-cache hit are registered with the prefill's ranks each worker
rank pairs with (`Receive`, `sender_offset` = the blocks it already had; its params name
both TP sizes, see `kvpush.integrations.vllm.worker`). vLLM frees them when the
worker reports the request in `finished_recving` (failed ones also in `failed_recving`,
so vLLM's `kv_load_failure_policy` decides: fail the request or recompute it). A decode
request aborted while it waits has its transfer aborted; vLLM keeps its blocks until
the runtime reports that transfer ended, so no late write lands in reused blocks.
From the moment vLLM adds such a request (`on_new_request`) until it has blocks, the
workers claim its transfer (`Claim`: the parts each rank will register), so a prefill
with a claim window keeps it however long the request queues here, and frees its
blocks a window after this decode died; the registration, or the `Refuse` of a request
dropped before it was scheduled, ends the claim.

Prefill side (`do_remote_decode`): when the request finishes, its blocks are offered
(`Send`) and kept (`request_finished` -> delay free) until the worker reports the
transfer ended in `finished_sending`, whichever way it ended. A request that ended
without its KV (aborted) still opens and at once aborts its transfer, so a decode server
that already registered hears of it now rather than at its deadline.

Layer-wise push (the default, `push: "layerwise"`): a prefill request that ends on the
step computing its last prompt tokens (max_tokens 1, what proxies send) has its
transfer opened on that step, before its KV is computed (`Send(layerwise=True)`); the
worker announces each layer as the forward pass computes it, so writes overlap the
rest of the prefill. Its blocks are the running request's until `request_finished`,
which then holds them as above: nothing can free them in between, as vLLM (without
async scheduling) finishes the request in the same step's output, before it schedules
again. Should the transfer end before the request finished all the same, its
`finished_sending` is held back (vLLM would free a running request's blocks) and the
request's blocks are then freed as any other's.

Hybrid models (vLLM's hybrid KV-cache manager, several KV-cache groups): every block
list above is one per group (`request_finished_all_groups`, the cache manager's block
ids), and only the blocks that move are named (`kvpush.integrations.vllm.groups`: a
sliding window's from the first block its window holds); the decode's prefix hit is
counted in each group. A prefill request that ran past its prompt (vLLM then freed
the blocks of the prompt's last window, or advanced its Mamba state) has its transfer
cancelled, not sent wrong. A model with a Mamba group moves the prompt but its last
token (`groups.prefill_backoff`): the prefill drops that token from the request when
vLLM adds it (`on_new_request`, as vLLM's NIXL connectors do), and the decode loads
one token less and computes the last one itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvpush.geometry import KVCacheGroup
from kvpush.integrations.vllm.claims import claim_of
from kvpush.integrations.vllm.groups import (
    in_sender_blocks,
    prefill_backoff,
    received_blocks,
    sent_blocks,
    state_lost,
    tokens_moved,
)
from kvpush.integrations.vllm.metadata import Receive, Refuse, Send, StepPlan
from kvpush.integrations.vllm.params import (
    ConnectorConfig,
    client_request_id,
    pairing_id,
    prefill_answer,
    prefill_transfer,
)
from kvpush.topology import UnsupportedShape
from kvpush.transfer_params import (
    BadTransferParams,
    RemotePrefill,
    parse_remote_prefill,
    wants_remote_decode,
    wants_remote_prefill,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


BlockIds = Sequence[Sequence[int]]  # a request's block ids, one list per KV-cache group


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, groups: tuple[KVCacheGroup, ...] = ()) -> None:
        """`groups`: the model's KV-cache groups (`kvpush.integrations.vllm.groups`);
        empty: one full-attention group."""
        self._config = config
        self._groups = groups or (KVCacheGroup("full_attention", config.block_size_tokens),)
        self._plan = StepPlan()
        # Decode: requests waiting for their KV, by request id -> transfer id.
        self._receiving: dict[str, str] = {}
        # Decode: local prefix-cache hits seen by get_num_new_matched_tokens.
        self._local_hits: dict[str, int] = {}
        # Decode: requests whose remote prefill was already planned (never twice, even
        # when vLLM asks again after a preemption).
        self._planned: set[str] = set()
        # Prefill: requests whose blocks are held for a transfer, request id -> transfer id.
        self._sending: dict[str, str] = {}
        # Prefill: the decode TP each of those transfers was split for, where its params
        # named it (its answer says; None: the decode's own, learned by the worker).
        self._split_for: dict[str, int | None] = {}
        # Prefill, layer-wise: requests that may be pushed layer by layer once the step
        # computing their last prompt tokens is scheduled; then those opened early,
        # request id -> their blocks; and those whose transfer ended before the request
        # finished (their finished_sending held back).
        self._layerwise_candidates: dict[str, Request] = {}
        self._opened_early: dict[str, tuple[tuple[int, ...], ...]] = {}
        self._ended_early: set[str] = set()
        # Prefill, Mamba: requests whose prompt's last token was dropped (never twice,
        # even when vLLM adds a preempted request again).
        self._truncated: set[str] = set()
        # Decode: requests whose transfer was claimed (`Claim`), never twice.
        self._claimed: set[str] = set()
        # Both: the transfer id of each request whose params name none (`pairing_id`).
        self._pairing: dict[str, str] = {}
        self._block_ids_of: Callable[[str], BlockIds] | None = None

    def bind_block_ids(self, block_ids_of: Callable[[str], BlockIds]) -> None:
        """How to read a running request's blocks, per group (vLLM's KV cache manager)."""
        self._block_ids_of = block_ids_of

    # ----------------------------------------------------------------- prefill side

    def on_new_request(self, request: Request) -> None:
        """vLLM added a request. One whose params name no transfer id (a router that
        speaks vLLM's push dialect sent it) gets its `pairing_id` now, from the prompt
        as the client sent it. A prefill request of a model with a Mamba group then
        drops its prompt's last token, which its decode computes
        (`groups.prefill_backoff`)."""
        rid = request.request_id
        params = request.kv_transfer_params
        sends = self._config.sends and wants_remote_decode(params)
        receives = self._config.receives and wants_remote_prefill(params)
        if not sends and not receives:
            return
        assert params is not None
        if params.get("transfer_id") is None and rid not in self._pairing:
            lora = getattr(request, "lora_request", None)
            self._pairing[rid] = pairing_id(
                client_request_id(rid, self._config),
                request.prompt_token_ids or (),
                cache_salt=getattr(request, "cache_salt", None),
                lora_name=getattr(lora, "lora_name", None),
            )
        if receives:
            self._claim(rid, params)
        if not sends:
            return
        prompt = request.prompt_token_ids
        backoff = prefill_backoff(self._groups, request.num_prompt_tokens)
        if not backoff or rid in self._truncated or prompt is None:
            return
        # As vLLM's NIXL connectors truncate it: the prompt, the request's token list
        # (kept in step with it) and its count.
        del prompt[-backoff:]
        del request._all_token_ids[-backoff:]
        request.num_prompt_tokens -= backoff
        request.max_tokens = 1
        self._truncated.add(rid)

    # ----------------------------------------------------------------- decode side

    def _claim(self, rid: str, params: dict[str, Any]) -> None:
        """Claim the transfer of a decode request vLLM just queued, once (see the
        module and `claims.claim_of`)."""
        if rid in self._claimed or rid in self._planned:
            return
        claim = claim_of(params, self._pairing.get(rid))
        if claim is not None:
            self._claimed.add(rid)
            self._plan.claims.append(claim)

    def _unclaim(self, remote: RemotePrefill) -> None:
        """A claim still in this step's plan whose request registers or is refused on
        the same step: the registration or refusal speaks for it, no need to claim."""
        tid = remote.transfer_id
        self._plan.claims = [c for c in self._plan.claims if c.transfer_id != tid]

    def _tokens_moved(self, request: Request) -> int:
        """The prompt tokens whose KV a decode request receives (`groups.tokens_moved`)."""
        return tokens_moved(self._groups, len(request.prompt_token_ids or ()))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not self._config.receives or not wants_remote_prefill(params):
            return 0, False
        if request.request_id in self._planned:
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        count = self._tokens_moved(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        rid = request.request_id
        if (
            self._config.layerwise
            and self._block_ids_of is not None
            and wants_remote_decode(params)
            and getattr(request, "max_tokens", None) == 1
            and rid not in self._sending
        ):
            self._layerwise_candidates[rid] = request
        if not self._config.receives or not wants_remote_prefill(params):
            return
        if rid in self._planned:
            return
        assert params is not None
        self._planned.add(rid)
        try:
            remote = parse_remote_prefill(params, pairing_id=self._pairing.get(rid))
        except BadTransferParams as exc:
            # vLLM has no way to refuse a request here; it waits for KV that never
            # comes unless the worker reports it failed: it does, on the next step.
            log.error("request %s: %s", rid, exc)
            self._plan.receives.append(Receive(rid, "", "", 0, (), 0))
            self._receiving[rid] = ""
            return
        self._unclaim(remote)
        local_hits = self._local_hits.pop(rid, 0)
        num_tokens = self._tokens_moved(request)
        if num_external_tokens <= 0:
            if not num_tokens:
                why = "a one-token prompt of a model with a Mamba state: the decode computes it"
            elif local_hits >= num_tokens:
                why = "the decode server had every block in its prefix cache"
            else:
                # We asked for tokens, vLLM allocated none for us: under a MultiConnector,
                # another child (an offload tier) took the request and loads them.
                why = (
                    f"the decode server loads this prompt's KV otherwise: it asked for "
                    f"{num_tokens - local_hits} tokens and vLLM gave this connector none "
                    "(another connector of a MultiConnector took the request)"
                )
            self._refuse(remote, why)
            return
        ours = received_blocks(self._groups, blocks.get_block_ids(), num_tokens, local_hits)
        nulls = {b.block_id for group in blocks.blocks for b in group if b.is_null}
        if nulls & {b for group in ours for b in group.blocks}:
            # vLLM freed a block the window needs (it never should): receiving into its
            # null block would corrupt every request. Recompute instead.
            self._cannot_receive(
                rid, remote, "the decode's sliding-window blocks for this prompt were freed"
            )
            return
        own_size = self._config.block_size_tokens
        sender_size = remote.block_size or own_size
        try:
            ours = in_sender_blocks(self._groups, ours, num_tokens, own_size, sender_size)
        except UnsupportedShape as exc:
            self._cannot_receive(rid, remote, str(exc))
            return
        self._plan.receives.append(
            Receive(
                rid,
                remote.transfer_id,
                remote.remote_host,
                remote.remote_port,
                ours[0].blocks,
                ours[0].sender_offset,
                remote.tp_size,
                remote.decode_tp_size,
                more_groups=ours[1:],
                sender_block_tokens=None if sender_size == own_size else sender_size,
                sender_pp_size=remote.pp_size,
            )
        )
        self._receiving[rid] = remote.transfer_id

    def _cannot_receive(self, rid: str, remote: RemotePrefill, detail: str) -> None:
        """Refuse the transfer (the prefill frees its blocks at once) and fail the
        request on the next step: vLLM then computes its prompt here."""
        log.error("request %s: %s", rid, detail)
        self._refuse(remote, detail)
        self._plan.receives.append(Receive(rid, "", "", 0, (), 0))
        self._receiving[rid] = ""

    def _refuse(self, remote: RemotePrefill, detail: str) -> None:
        self._plan.refusals.append(
            Refuse(
                remote.transfer_id,
                remote.remote_host,
                remote.remote_port,
                detail,
                remote.tp_size,
                remote.decode_tp_size,
                remote.pp_size,
            )
        )

    # ----------------------------------------------------------------- both

    def request_finished(
        self, request: Request, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        """`block_ids`: the request's, one list per KV-cache group
        (`request_finished_all_groups`)."""
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        params = request.kv_transfer_params
        self._local_hits.pop(rid, None)
        self._layerwise_candidates.pop(rid, None)
        self._truncated.discard(rid)
        pairing = self._pairing.pop(rid, None)
        self._claimed.discard(rid)
        planned = rid in self._planned
        self._planned.discard(rid)
        if rid in self._receiving:
            # Finished while its KV is still on the way (aborted): vLLM keeps the blocks
            # until the worker reports the transfer ended.
            tid = self._receiving[rid]
            if tid:
                self._plan.aborts.append(tid)
            return False, None
        if self._config.receives and wants_remote_prefill(params) and not planned:
            # Never scheduled: tell the sender now instead of letting it wait.
            assert params is not None
            try:
                remote = parse_remote_prefill(params, pairing_id=pairing)
            except BadTransferParams:
                return False, None
            self._unclaim(remote)
            self._refuse(remote, "the decode request ended before it was scheduled")
            return False, None
        if not self._config.sends or not wants_remote_decode(params):
            return False, None
        assert params is not None
        computed = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        num_tokens = len(request.prompt_token_ids or ())
        early = self._opened_early.pop(rid, None)
        if early is not None:
            return self._finished_early(rid, early, num_tokens, computed)
        xfer = prefill_transfer(params, self._config, pairing)
        ours = sent_blocks(self._groups, block_ids, num_tokens)
        if not any(ours):
            return False, None
        lost = self._moved_lost(request, num_tokens)
        if lost is not None and computed:
            log.error("request %s: %s: its transfer is cancelled", rid, lost)
            computed = False
        self._plan.sends.append(
            Send(
                rid,
                xfer.transfer_id,
                ours[0],
                cancel=not computed,
                decode=xfer.decode,
                decode_tp_size=xfer.decode_tp_size,
                more_groups=ours[1:],
            )
        )
        self._sending[rid] = xfer.transfer_id
        self._split_for[rid] = xfer.decode_tp_size
        if not computed:
            return True, None
        return True, prefill_answer(
            self._config,
            transfer_id=xfer.transfer_id,
            request_id=rid,
            block_ids=list(ours[0]),
            num_tokens=num_tokens,
            decode_tp_size=xfer.decode_tp_size,
        )

    def _moved_lost(self, request: Request, num_tokens: int) -> str | None:
        """Why a finished prefill request no longer holds what its groups move, if it
        does not: it ran past its prompt (max_tokens above 1, pushed whole), and vLLM
        freed the blocks before its last window, or its Mamba state went on."""
        computed_tokens = int(getattr(request, "num_computed_tokens", num_tokens))
        for group in self._groups:
            if state_lost(group, num_tokens, computed_tokens):
                lost = "freed the blocks of its prompt's last window"
                if group.kind == "mamba":
                    lost = "advanced its state"
                return (
                    f"it computed {computed_tokens} tokens of its {num_tokens}-token "
                    f"prompt and beyond, and vLLM {lost} ({group.describe()})"
                )
        return None

    def _finished_early(
        self, rid: str, blocks: tuple[tuple[int, ...], ...], num_tokens: int, computed: bool
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request whose transfer was opened layer by layer has finished."""
        if rid in self._ended_early:
            # Its transfer ended already (its finished_sending was held back): vLLM may
            # free the blocks now. Computed, its KV went (or failed) as reported.
            self._ended_early.discard(rid)
            tid = self._sending.pop(rid)
            split = self._split_for.pop(rid, None)
            if not computed:
                return False, None
        else:
            tid = self._sending[rid]
            split = self._split_for.get(rid)
            if not computed:
                self._plan.aborts.append(tid)
                return True, None
        answer = prefill_answer(
            self._config,
            transfer_id=tid,
            request_id=rid,
            block_ids=list(blocks[0]),
            num_tokens=num_tokens,
            decode_tp_size=split,
        )
        return rid in self._sending, answer

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        plan.idle = scheduler_output.total_num_scheduled_tokens == 0
        if self._layerwise_candidates:
            self._open_layerwise(plan, scheduler_output)
        return plan

    def _open_layerwise(self, plan: StepPlan, scheduler_output: SchedulerOutput) -> None:
        """Open, on this step's plan, the transfers of the requests whose last prompt
        tokens this step computes (called before vLLM advances their computed tokens)."""
        assert self._block_ids_of is not None
        scheduled = scheduler_output.num_scheduled_tokens
        for rid, request in list(self._layerwise_candidates.items()):
            n = scheduled.get(rid, 0)
            num_tokens = len(request.prompt_token_ids or ())
            if n <= 0 or request.num_computed_tokens + n < num_tokens:
                continue  # not scheduled, or an earlier chunk of its prompt
            del self._layerwise_candidates[rid]
            blocks = sent_blocks(self._groups, self._block_ids_of(rid), num_tokens)
            if not any(blocks):
                continue  # offered whole when it finishes, as without layer-wise push
            assert request.kv_transfer_params is not None
            xfer = prefill_transfer(
                request.kv_transfer_params, self._config, self._pairing.get(rid)
            )
            plan.sends.append(
                Send(
                    rid,
                    xfer.transfer_id,
                    blocks[0],
                    layerwise=True,
                    decode=xfer.decode,
                    decode_tp_size=xfer.decode_tp_size,
                    more_groups=blocks[1:],
                )
            )
            self._sending[rid] = xfer.transfer_id
            self._split_for[rid] = xfer.decode_tp_size
            self._opened_early[rid] = blocks

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        if self._opened_early and output.finished_sending:
            # vLLM frees the blocks of every request in finished_sending; a request
            # still running keeps its blocks until request_finished (see the module).
            early = output.finished_sending & self._opened_early.keys()
            output.finished_sending -= early
            self._ended_early |= early
        for rid in output.finished_sending or ():
            self._sending.pop(rid, None)
            self._split_for.pop(rid, None)
        for rid in output.finished_recving or ():
            self._receiving.pop(rid, None)

    def has_pending_push_work(self) -> bool:
        """True only while a prefill's blocks are held for a transfer (vLLM must keep
        stepping to hear that it ended) or a plan is waiting for the next step."""
        plan = self._plan
        return bool(self._sending or plan.sends or plan.aborts or plan.refusals or plan.claims)
