"""What the connector's halves hand each other, as plain values (no vLLM needed).

- `StepPlan` (scheduler -> every worker, once per engine step): the transfers to start,
  refuse, abort or claim on this step. Each worker rank carries out the same plan with
  its own runtime, towards the ranks of the peer it pairs with
  (`kvpush.topology.rank_pairs`: the rank of the same number where the TP sizes are
  equal), one part per pair.
- `StepResults` (worker -> vLLM, every step): the requests whose transfers ended.

`kvpush.integrations.vllm.metadata` wraps the plan into vLLM's own connector metadata
type; the worker side (`kvpush.integrations.vllm.worker`) reads only these, so it runs,
and is tested, without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class GroupBlocks:
    """A request's blocks of one more KV-cache group (a hybrid model's), as `Receive`
    has them for the first: `blocks[i]` receives the sender's `sender_offset + i`-th
    block of that group."""

    blocks: tuple[int, ...]
    sender_offset: int = 0


@dataclass(frozen=True, slots=True)
class Receive:
    """Decode side: expect `transfer_id` from the sender's side channel into `blocks`;
    `blocks[i]` receives the sender's block `sender_offset + i`. A hybrid model's first
    KV-cache group is in `blocks`, the others in `more_groups`, in vLLM's group order;
    each group is a part of the transfer of its own (`kvpush.integrations.vllm.groups`)."""

    request_id: str
    transfer_id: str
    host: str
    port: int
    blocks: tuple[int, ...]
    sender_offset: int
    # The prefill's TP, and the decode TP it split the transfer for (None: ours).
    sender_tp_size: int | None = None
    split_for_tp: int | None = None
    more_groups: tuple[GroupBlocks, ...] = ()
    # The prefill's block size where the decode's is a whole multiple of it: `blocks`
    # and `sender_offset` are then parts of our blocks, one per prefill block (None: ours).
    sender_block_tokens: int | None = None
    # The prefill's pipeline-parallel size: each stage sends its own layers, a part of
    # its own per rank pair (`kvpush.topology.stage_part_id`). None: 1.
    sender_pp_size: int | None = None


@dataclass(frozen=True, slots=True)
class Refuse:
    """Decode side: tell the sender at once that `transfer_id` will never be received,
    so it frees its blocks (a request aborted before it was scheduled, a full local
    prefix-cache hit)."""

    transfer_id: str
    host: str
    port: int
    detail: str
    sender_tp_size: int | None = None  # as in `Receive`
    split_for_tp: int | None = None
    sender_pp_size: int | None = None


@dataclass(frozen=True, slots=True)
class Claim:
    """Decode side: a request for `transfer_id` is queued here, its blocks not allocated
    yet. Each worker rank claims the parts it will receive, from the prefill ranks it
    pairs with (the parts `Receive` would register, named the same way), so a prefill
    with a claim window (`claim_window_s`) keeps them while we live, however long the
    request queues, and gives them up a window after we die. The claim ends when the
    request's `Receive` registers those parts, or a `Refuse` or abort names them."""

    transfer_id: str
    host: str
    port: int
    sender_tp_size: int | None = None  # as in `Receive`
    split_for_tp: int | None = None
    sender_pp_size: int | None = None


@dataclass(frozen=True, slots=True)
class Send:
    """Prefill side: offer `blocks` (all layers computed) for `transfer_id`. With
    `cancel`, the request ended without its KV (aborted): the transfer is opened with
    no layer ready and aborted at once, so the receiver hears of it now, nothing is
    written, and the blocks come back through the runtime's result like any other.
    With `layerwise`, this step computes the prompt's last tokens: the transfer is
    opened with no layer ready before the first layer's KV is saved, and each layer is
    announced once this step computed it (`save_kv_layer`; all by `wait_for_save`).
    `decode`: the decode server's side channel (host, port) that the proxy named, the
    only one whose ranks may take the transfer; None: not named. A hybrid model's
    first KV-cache group is in `blocks`, the others in `more_groups`, in group order
    (only the blocks that move: a sliding window's last ones)."""

    request_id: str
    transfer_id: str
    blocks: tuple[int, ...]
    cancel: bool = False
    layerwise: bool = False
    decode: tuple[str, int] | None = None
    # The decode TP to split it for; None: not named, learned from the decode ranks'
    # registrations (`WorkerSide`).
    decode_tp_size: int | None = None
    more_groups: tuple[tuple[int, ...], ...] = ()


@dataclass
class StepPlan:
    receives: list[Receive] = field(default_factory=list)
    refusals: list[Refuse] = field(default_factory=list)
    sends: list[Send] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # transfer ids
    # Nothing is computed on this step: the worker may wait a little for a transfer to
    # end instead of returning at once (an engine that only waits must not spin).
    idle: bool = False
    claims: list[Claim] = field(default_factory=list)


@dataclass
class StepResults:
    """Request ids, as vLLM's `KVConnectorTransferResults` takes them: a receive that
    ended is in `finished_recving` (a failed one in `failed_recving` too); a send that
    ended, either way, in `finished_sending`."""

    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)
