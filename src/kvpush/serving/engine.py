"""The reference engine: continuous batching, greedy decoding and n-gram speculation.

One thread owns an `Engine` and calls `step()` in a loop; every call runs one forward
pass over all running sequences at once (new prompts and decode steps side by side, the
way vLLM schedules), and returns what each request gained. A step may carry speculated
tokens (drafts) for a sequence; which ones, which of them the pass confirms and how they
are counted is `sampling`'s (`propose_drafts`, `verify_drafts`, `DraftCounts`).

For disaggregated serving a request can (a) stop after its prompt and hold its blocks
until `release()` (the prefill side), or (b) arrive with its blocks to be filled from
outside and start decoding only once `kv_arrived()` says the KV is there (the decode side).
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kvpush.serving.model import LlamaModel, SeqSlice
from kvpush.serving.paged import BlockAllocator, PagedKVCache, block_hash
from kvpush.serving.sampling import (
    DraftCounts,
    InvalidRequest,
    SamplingParams,
    SpecConfig,
    mean_acceptance_length,
    propose_drafts,
    verify_drafts,
)


class FinishReason(enum.StrEnum):
    STOP = "stop"  # end-of-sequence token
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"
    ERROR = "error"


class _State(enum.Enum):
    WAITING = 1  # not yet admitted: no blocks
    WAITING_FOR_KV = 2  # blocks allocated, filled from outside (decode side)
    RUNNING = 3
    HELD = 4  # finished, blocks kept for a transfer (prefill side)
    FINISHED = 5


@dataclass(frozen=True, slots=True)
class RequestStats:
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache
    num_output_tokens: int
    num_steps: int  # forward passes that produced tokens for this request
    num_drafts: int  # steps that carried at least one draft
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def mean_acceptance_length(self) -> float:
        return mean_acceptance_length(self.num_drafts, self.num_accepted_tokens)


@dataclass(frozen=True, slots=True)
class RemoteBlocks:
    """Where a remotely computed prompt's KV goes: `blocks[i]` takes the sender's block
    `sender_offset + i` (the first `sender_offset` blocks came from the prefix cache)."""

    blocks: tuple[int, ...]
    sender_offset: int


@dataclass(frozen=True, slots=True)
class StepOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_held: int
    num_blocks: int
    num_free_blocks: int
    prefix_queries: int
    prefix_hits: int
    num_steps: int
    num_generated_tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def mean_acceptance_length(self) -> float:
        return mean_acceptance_length(self.num_drafts, self.num_accepted_tokens)


@dataclass(slots=True)
class _Seq:
    request_id: str
    prompt_len: int
    tokens: list[int]
    params: SamplingParams
    hold_blocks: bool
    state: _State = _State.WAITING
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # of blocks whose K/V are complete
    num_computed: int = 0
    num_cached: int = 0
    steps: int = 0
    drafted: DraftCounts = field(default_factory=DraftCounts)
    generator: torch.Generator | None = None

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    def stats(self) -> RequestStats:
        return RequestStats(
            num_prompt_tokens=self.prompt_len,
            num_cached_tokens=self.num_cached,
            num_output_tokens=self.num_output,
            num_steps=self.steps,
            num_drafts=self.drafted.drafts,
            num_draft_tokens=self.drafted.draft_tokens,
            num_accepted_tokens=self.drafted.accepted,
        )


LayerHook = Callable[[int, Sequence[str]], None]


class Engine:
    """A paged-attention engine over one `LlamaModel`; driven by one thread."""

    def __init__(
        self,
        model: LlamaModel,
        *,
        num_blocks: int = 256,
        block_size: int = 16,
        max_batch_tokens: int = 4096,
        spec: SpecConfig | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.spec = spec
        self.enable_prefix_caching = enable_prefix_caching
        self.kv_cache = PagedKVCache(
            num_layers=cfg.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
        )
        self.allocator = BlockAllocator(num_blocks)
        self._seqs: dict[str, _Seq] = {}
        self._waiting: deque[str] = deque()
        self._steps = 0
        self._generated = 0
        self._drafted = DraftCounts()
        # Called after each layer of a step with the ids of sequences in that step.
        self.on_layer_done: LayerHook | None = None

    # -- requests ----------------------------------------------------------------------

    def _check_new(self, request_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
        cfg = self.model.config
        if request_id in self._seqs:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if not prompt:
            raise InvalidRequest("prompt is empty: expected at least one token")
        bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
        if bad:
            raise InvalidRequest(
                f"prompt token id {bad[0]} out of range: expected 0..{cfg.vocab_size - 1}"
            )
        total = len(prompt) + params.max_tokens
        if total > cfg.max_position_embeddings:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model's context length {cfg.max_position_embeddings}"
            )
        if self._blocks_for(total) > self.allocator.num_blocks:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) needs "
                f"{self._blocks_for(total)} KV blocks; this server has {self.allocator.num_blocks}"
            )

    def _blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        hold_blocks: bool = False,
    ) -> None:
        """Queue a request; `hold_blocks` keeps its KV blocks after it finishes."""
        prompt = [int(t) for t in prompt_token_ids]
        self._check_new(request_id, prompt, params)
        self._seqs[request_id] = _Seq(
            request_id, len(prompt), prompt, params, hold_blocks, generator=params.generator()
        )
        self._waiting.append(request_id)

    def add_remote_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> RemoteBlocks | None:
        """Allocate blocks for a prompt whose KV will be written from outside.

        The sender computes the whole prompt; this engine takes the K/V of all but the
        last prompt token (the blocks covering positions `0 .. len-2`) and recomputes the
        last one itself, which gives it the logits for the first output token. Full
        blocks found in the local prefix cache are not received again: the result says
        which blocks to fill and from which of the sender's blocks (`sender_offset`).
        Returns None when there is no room now. The request waits for `kv_arrived`.
        """
        prompt = [int(t) for t in prompt_token_ids]
        self._check_new(request_id, prompt, params)
        need = self._blocks_for(len(prompt) + params.max_tokens)
        hashes = self._prefix_hashes(prompt)
        cached = self.allocator.lookup_prefix(hashes)
        if need - len(cached) > self.allocator.num_free:
            self.allocator.free(cached)
            return None
        seq = _Seq(
            request_id,
            len(prompt),
            prompt,
            params,
            hold_blocks=False,
            generator=params.generator(),
        )
        seq.blocks = cached + self.allocator.allocate(need - len(cached))
        seq.hashes = hashes[: len(cached)]
        seq.num_cached = len(cached) * self.block_size
        seq.state = _State.WAITING_FOR_KV
        self._seqs[request_id] = seq
        return RemoteBlocks(
            blocks=tuple(seq.blocks[len(cached) : self.transfer_block_count(len(prompt))]),
            sender_offset=len(cached),
        )

    def transfer_block_count(self, prompt_len: int) -> int:
        """Blocks a receiver needs from the sender for a prompt: those of all but its last
        token (which the receiver recomputes)."""
        return self._blocks_for(prompt_len - 1)

    def kv_arrived(self, request_id: str) -> None:
        """The prompt's KV is in this request's blocks; decoding starts at the next step."""
        seq = self._get(request_id)
        if seq.state is not _State.WAITING_FOR_KV:
            raise InvalidRequest(f"request {request_id!r} is not waiting for KV")
        seq.num_computed = seq.prompt_len - 1
        self._register_full_blocks(seq)
        seq.state = _State.RUNNING

    def blocks_of(self, request_id: str) -> list[int]:
        """The blocks a request holds now, in token order (empty before admission)."""
        return list(self._get(request_id).blocks)

    def held_blocks(self, request_id: str) -> list[int]:
        """Blocks holding a held request's prompt KV, in order."""
        seq = self._get(request_id)
        if seq.state is not _State.HELD:
            raise InvalidRequest(f"request {request_id!r} holds no blocks")
        return seq.blocks[: self._blocks_for(seq.prompt_len)]

    def release(self, request_id: str) -> None:
        """Free a held (or any unfinished) request's blocks and forget it."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        if seq.state is _State.WAITING:
            self._waiting.remove(request_id)
        if seq.blocks:
            self.allocator.free(seq.blocks)
            seq.blocks = []
        seq.state = _State.FINISHED

    def stop_and_hold(self, request_id: str) -> None:
        """Stop computing a request but keep its blocks (a transfer may still read them):
        it becomes held, like a finished prefill, until `release()`."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.state is _State.FINISHED:
            return
        if seq.state is _State.WAITING:
            self._waiting.remove(request_id)
        seq.state = _State.HELD

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def check_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Raises `InvalidRequest` if the request could never be served here."""
        self._check_new(request_id, [int(t) for t in prompt_token_ids], params)

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks that `num_tokens` tokens take."""
        return self._blocks_for(num_tokens)

    @property
    def max_request_blocks(self) -> int:
        """The most blocks one request that passes `check_request` can take."""
        return min(
            self.allocator.num_blocks, self._blocks_for(self.model.config.max_position_embeddings)
        )

    @property
    def unclaimed_blocks(self) -> int:
        """Free blocks that the requests already queued here will not take (at most:
        prefix-cache hits let them take fewer)."""
        claimed = sum(
            self._blocks_for(seq.prompt_len + seq.params.max_tokens)
            for seq in (self._seqs[rid] for rid in self._waiting)
        )
        return self.allocator.num_free - claimed

    def waiting_ids(self) -> list[str]:
        """Queued requests, first come first."""
        return list(self._waiting)

    def request_stats(self, request_id: str) -> RequestStats:
        return self._get(request_id).stats()

    def output_token_ids(self, request_id: str) -> list[int]:
        seq = self._get(request_id)
        return seq.tokens[seq.prompt_len :]

    def _get(self, request_id: str) -> _Seq:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise InvalidRequest(f"unknown request id {request_id!r}")
        return seq

    @property
    def has_work(self) -> bool:
        return any(s.state is _State.RUNNING for s in self._seqs.values()) or bool(self._waiting)

    # -- scheduling --------------------------------------------------------------------

    def _admit(self, budget: int) -> int:
        """Give blocks to waiting requests, first come first served; returns tokens used."""
        used = 0
        while self._waiting:
            seq = self._seqs[self._waiting[0]]
            prompt = seq.tokens
            # Keep at least one prompt token to compute: its logits give the first output.
            hashes = self._prefix_hashes(prompt)
            need_total = self._blocks_for(len(prompt) + seq.params.max_tokens)
            cached = self.allocator.lookup_prefix(hashes)
            new_tokens = len(prompt) - len(cached) * self.block_size
            if need_total - len(cached) > self.allocator.num_free or (
                used and used + new_tokens > budget
            ):
                self.allocator.free(cached)
                break
            self._waiting.popleft()
            seq.blocks = cached + self.allocator.allocate(need_total - len(cached))
            seq.hashes = hashes[: len(cached)]
            seq.num_computed = seq.num_cached = len(cached) * self.block_size
            seq.state = _State.RUNNING
            used += new_tokens
        return used

    def _prefix_hashes(self, prompt: Sequence[int]) -> list[bytes]:
        """Hashes of the prompt's full blocks, leaving at least its last token to compute."""
        if not self.enable_prefix_caching:
            return []
        hashes: list[bytes] = []
        parent: bytes | None = None
        for b in range((len(prompt) - 1) // self.block_size):
            parent = block_hash(parent, prompt[b * self.block_size : (b + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    def _register_full_blocks(self, seq: _Seq) -> None:
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        while (len(seq.hashes) + 1) * bs <= seq.num_computed:
            b = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else None
            h = block_hash(parent, seq.tokens[b * bs : (b + 1) * bs])
            seq.hashes.append(h)
            self.allocator.mark_cached(seq.blocks[b], h)

    def _stop_reason(self, seq: _Seq) -> FinishReason | None:
        if seq.num_output >= seq.params.max_tokens:
            return FinishReason.LENGTH
        eos = self.model.config.eos_token_id
        if (
            not seq.params.ignore_eos
            and seq.num_output
            and eos is not None
            and seq.tokens[-1] == eos
        ):
            return FinishReason.STOP
        return None

    def _finish(self, seq: _Seq, reason: FinishReason) -> StepOutput:
        if seq.hold_blocks:
            seq.state = _State.HELD
        else:
            seq.state = _State.FINISHED
            self.allocator.free(seq.blocks)
            seq.blocks = []
        return StepOutput(seq.request_id, (), True, reason)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record (its statistics) once the caller is done."""
        seq = self._seqs.get(request_id)
        if seq is not None and seq.state is _State.FINISHED:
            del self._seqs[request_id]

    def step(self) -> list[StepOutput]:
        """Run one forward pass over every running sequence; returns their new tokens."""
        outputs: list[StepOutput] = []
        # Requests that are already done (e.g. max_tokens reached by the first token).
        for seq in list(self._seqs.values()):
            if seq.state is _State.RUNNING:
                reason = self._stop_reason(seq)
                if reason is not None:
                    outputs.append(self._finish(seq, reason))
        running = [s for s in self._seqs.values() if s.state is _State.RUNNING]
        budget = self.max_batch_tokens - sum(
            len(s.tokens) - s.num_computed + (self.spec.num_speculative_tokens if self.spec else 0)
            for s in running
        )
        self._admit(max(budget, 0))
        batch = [s for s in self._seqs.values() if s.state is _State.RUNNING]
        if not batch:
            return outputs

        inputs: list[int] = []
        slices: list[SeqSlice] = []
        drafts_of: list[list[int]] = []
        for seq in batch:
            drafts = propose_drafts(seq.tokens, seq.num_output, seq.params, self.spec)
            new = seq.tokens[seq.num_computed :] + drafts
            inputs.extend(new)
            slices.append(SeqSlice(seq.blocks, seq.num_computed, len(new)))
            drafts_of.append(drafts)

        hook = self.on_layer_done
        ids = [s.request_id for s in batch]
        logits = self.model.forward(
            torch.tensor(inputs, dtype=torch.long),
            slices,
            self.kv_cache.layers,
            on_layer_done=(lambda layer: hook(layer, ids)) if hook is not None else None,
        )
        self._steps += 1

        row = 0
        for seq, sl, drafts in zip(batch, slices, drafts_of, strict=True):
            # Rows of the last real token and of each draft predict the next token.
            first = row + sl.num_new - len(drafts) - 1
            row += sl.num_new
            gained, accepted = verify_drafts(
                logits[first : first + len(drafts) + 1],
                drafts,
                seq.params,
                seq.generator,
                self.model.config.eos_token_id,
            )
            seq.num_computed = len(seq.tokens) + min(accepted, len(gained) - 1)
            seq.tokens.extend(gained)
            seq.steps += 1
            seq.drafted.record(len(drafts), accepted)
            self._drafted.record(len(drafts), accepted)
            self._generated += len(gained)
            self._register_full_blocks(seq)
            reason = self._stop_reason(seq)
            if reason is None:
                outputs.append(StepOutput(seq.request_id, tuple(gained), False))
            else:
                done = self._finish(seq, reason)
                outputs.append(StepOutput(seq.request_id, tuple(gained), True, done.finish_reason))
        return outputs

    # -- convenience -------------------------------------------------------------------

    def generate(self, prompts: Iterable[Sequence[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion together; returns each one's output token ids."""
        ids = []
        for i, prompt in enumerate(prompts):
            rid = f"generate-{self._steps}-{i}"
            self.add_request(rid, prompt, params)
            ids.append(rid)
        while self.has_work:
            self.step()
        out = [self.output_token_ids(rid) for rid in ids]
        for rid in ids:
            self.forget(rid)
        return out

    def statistics(self) -> EngineStats:
        a = self.allocator.statistics()
        states = [s.state for s in self._seqs.values()]
        return EngineStats(
            num_waiting=len(self._waiting),
            num_running=sum(st in (_State.RUNNING, _State.WAITING_FOR_KV) for st in states),
            num_held=sum(st is _State.HELD for st in states),
            num_blocks=a.num_blocks,
            num_free_blocks=a.num_free,
            prefix_queries=a.prefix_queries,
            prefix_hits=a.prefix_hits,
            num_steps=self._steps,
            num_generated_tokens=self._generated,
            num_drafts=self._drafted.drafts,
            num_draft_tokens=self._drafted.draft_tokens,
            num_accepted_tokens=self._drafted.accepted,
        )
