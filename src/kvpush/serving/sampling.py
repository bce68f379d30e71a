"""What a request asks of the engine, and how the engine chooses its tokens: the sampling
parameters (checked when made: `RequestRejected` says what was wrong), `sample` for one
row of logits, and prompt-lookup speculation (`SpecConfig`, `propose_ngram`), whose drafts
the engine verifies against greedy decoding."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpush.errors import KVPushError


class RequestRejected(KVPushError):
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
            raise RequestRejected(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.temperature <= 2 or not math.isfinite(self.temperature):
            raise RequestRejected(f"temperature must be in 0..2, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestRejected(f"top_p must be in (0, 1], got {self.top_p}")

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
