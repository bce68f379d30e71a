"""What a request asks of the engine, and how the engine chooses its tokens: the sampling
parameters (checked when made: `InvalidRequest` says what was wrong), `sample` for one
row of logits, and prompt-lookup speculation.

Speculation is prompt lookup (with vLLM's parameter names): the last n tokens of a sequence
are searched for earlier in the same sequence and the tokens that followed are proposed as
drafts (`propose_drafts`). The forward pass scores the drafts in one go; a draft is kept
only while it equals what greedy decoding would have chosen (`verify_drafts`), so the
output is exactly greedy's, just in fewer steps. The mean acceptance length (tokens gained
per step that carried drafts) is counted per request and for the engine (`DraftCounts`), as
vLLM reports it."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpush.errors import KVPushError


class InvalidRequest(KVPushError):
    """A request cannot be served as asked (too long, bad parameters, unknown id)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """`temperature` 0 decodes greedily; above it, tokens are sampled (nucleus `top_p`)
    from a generator seeded with `seed`, so one seed gives one output wherever the
    request runs (a single instance, or the decode side of disaggregated serving)."""

    max_tokens: int = 16
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.temperature <= 2 or not math.isfinite(self.temperature):
            raise InvalidRequest(f"temperature must be in 0..2, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator | None:
        """A fresh generator for one request; None when decoding greedily."""
        if self.greedy:
            return None
        gen = torch.Generator()
        gen.manual_seed(self.seed % 2**63 if self.seed is not None else secrets.randbits(63))
        return gen


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from one row of logits."""
    if gen is None:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1:
        ordered, order = probs.sort(descending=True)
        # Keep the smallest head whose mass reaches top_p (the first token always).
        drop = ordered.cumsum(-1) - ordered >= params.top_p
        ordered[drop] = 0
        probs = torch.zeros_like(probs).scatter_(-1, order, ordered)
    return int(torch.multinomial(probs, 1, generator=gen))


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Prompt-lookup speculation, with vLLM's parameter names."""

    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")


def propose_ngram(tokens: Sequence[int], spec: SpecConfig, limit: int) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier match of the tail."""
    if limit <= 0:
        return []
    n_tokens = len(tokens)
    for n in range(min(spec.prompt_lookup_max, n_tokens - 1), spec.prompt_lookup_min - 1, -1):
        tail = list(tokens[n_tokens - n :])
        for start in range(n_tokens - n - 1, -1, -1):
            if list(tokens[start : start + n]) == tail:
                follow = list(
                    tokens[start + n : start + n + min(limit, spec.num_speculative_tokens)]
                )
                if follow:
                    return follow
    return []


def propose_drafts(
    tokens: Sequence[int], num_output: int, params: SamplingParams, spec: SpecConfig | None
) -> list[int]:
    """The drafts a sequence of `tokens` (`num_output` of them generated) carries into its
    next step: none without speculation, before its first output token, or when sampled
    (drafts are checked against greedy choices); never more than its tokens left but one."""
    if spec is None or num_output == 0 or not params.greedy:
        return []
    return propose_ngram(tokens, spec, params.max_tokens - num_output - 1)


def verify_drafts(
    rows: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    gen: torch.Generator | None,
    eos_token_id: int | None,
) -> tuple[list[int], int]:
    """The tokens a step gained and how many drafts it accepted. `rows` are the logits of
    the last real token and of each draft, each predicting the next token: drafts are kept
    while they equal those choices, then one token more, cut after an end-of-sequence."""
    # A sampled request carries no drafts: its one row is sampled.
    targets = rows.argmax(dim=-1).tolist() if gen is None else [sample(rows[0], params, gen)]
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    gained = [int(t) for t in targets[: accepted + 1]]
    if not params.ignore_eos and eos_token_id is not None and eos_token_id in gained:
        gained = gained[: gained.index(eos_token_id) + 1]
    return gained, accepted


@dataclass(slots=True)
class DraftCounts:
    """Speculation's counts, for one request or a whole engine."""

    drafts: int = 0  # steps that carried at least one draft
    draft_tokens: int = 0
    accepted: int = 0

    def record(self, num_drafts: int, accepted: int) -> None:
        """One step that carried `num_drafts` drafts (maybe none), `accepted` of them kept."""
        if num_drafts:
            self.drafts += 1
            self.draft_tokens += num_drafts
            self.accepted += accepted


def mean_acceptance_length(num_drafts: int, num_accepted_tokens: int) -> float:
    """Tokens gained per drafted step (1 + accepted drafts); 0 when nothing was drafted."""
    if num_drafts == 0:
        return 0.0
    return 1.0 + num_accepted_tokens / num_drafts
