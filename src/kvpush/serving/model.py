"""A Llama-architecture decoder in plain torch, computing over a paged KV cache.

The model is the reference against which disaggregated serving is checked token for
token, so it favours being obviously right over being fast: RMSNorm, rotary embeddings
(Hugging Face's rotate-half convention), grouped-query attention and a SwiGLU MLP, on
CPU. Weights use Hugging Face's parameter names, so a `model.safetensors` written by
`transformers` loads unchanged.

`forward` runs a flattened batch: the new tokens of several sequences concatenated into
one `[T]` tensor, each sequence described by a `SeqSlice` (its block table, how many of
its tokens are already in the cache, and how many new ones it brings). Every layer first
writes the new tokens' K and V into their cache slots, then attends over the cache, so
what is in the cache is exactly what a later step (or a decode server that received the
blocks) reads back. `forward_dense` is the same network without any cache, for tests.

Weights and the KV cache are float32, but the arithmetic runs in float64. CPU matmul
kernels give slightly different float32 results for one row depending on how many rows
are multiplied together, so a token's logits would depend on the batch it happened to be
in; a near-tie could then flip a greedy choice, and a disaggregated run (the decode side
recomputing the last prompt token alone) could differ from a single instance. In float64
those differences vanish when K/V are rounded to float32 for the cache and they cannot
decide an argmax, so the tokens are the same whatever the batching.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpush.errors import ConfigError

LayerDone = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The subset of a Hugging Face `LlamaConfig` this engine understands."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"model config: {name} must be positive, got {getattr(self, name)}"
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model config: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"model config: head_dim must be even for rotary, got {self.head_dim}"
            )

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, object]) -> ModelConfig:
        """Read a Hugging Face `config.json` dict; unknown keys are ignored."""
        archs = raw.get("architectures")
        model_type = raw.get("model_type")
        if model_type not in (None, "llama") and not (
            isinstance(archs, list) and "LlamaForCausalLM" in archs
        ):
            raise ConfigError(
                f"model config: model_type {model_type!r} is not supported: expected 'llama'"
            )
        if raw.get("rope_scaling") not in (None, {}):
            raise ConfigError("model config: rope_scaling is not supported: expected none")

        def need_int(key: str) -> int:
            value = raw.get(key)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"model config: {key} must be an integer, got {value!r}")
            return value

        def opt_int(key: str) -> int | None:
            value = raw.get(key)
            if value is None:
                return None
            if isinstance(value, list) and value and isinstance(value[0], int):
                return int(value[0])
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"model config: {key} must be an integer, got {value!r}")
            return value

        def opt_float(key: str, default: float) -> float:
            value = raw.get(key, default)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ConfigError(f"model config: {key} must be a number, got {value!r}")
            return float(value)

        heads = need_int("num_attention_heads")
        hidden = need_int("hidden_size")
        kv_heads = opt_int("num_key_value_heads") or heads
        head_dim = opt_int("head_dim") or hidden // heads
        return cls(
            vocab_size=need_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need_int("intermediate_size"),
            num_hidden_layers=need_int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=opt_float("rms_norm_eps", 1e-5),
            rope_theta=opt_float("rope_theta", 10000.0),
            max_position_embeddings=opt_int("max_position_embeddings") or 2048,
            bos_token_id=opt_int("bos_token_id"),
            eos_token_id=opt_int("eos_token_id"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )

    def to_hf_dict(self) -> dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "float32",
        }

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight this model needs, by Hugging Face name."""
        h, i = self.hidden_size, self.intermediate_size
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for layer in range(self.num_hidden_layers):
            p = f"model.layers.{layer}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes[p + "mlp.gate_proj.weight"] = (i, h)
            shapes[p + "mlp.up_proj.weight"] = (i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


@dataclass(frozen=True, slots=True)
class SeqSlice:
    """One sequence's share of a flattened batch."""

    block_table: Sequence[int]  # cache blocks holding this sequence's tokens, in order
    num_cached: int  # tokens already in the cache (positions 0 .. num_cached-1)
    num_new: int  # new tokens in this batch, at positions num_cached .. num_cached+num_new-1


class LlamaModel:
    """Weights plus the forward pass. Holds no cache: the caller passes the KV tensors."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> None:
        expected = config.parameter_shapes()
        missing = sorted(set(expected) - set(weights))
        if missing:
            raise ConfigError(
                f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}: "
                f"expected the Hugging Face Llama names"
            )
        for name, shape in expected.items():
            actual = tuple(weights[name].shape)
            if actual != shape:
                raise ConfigError(f"weight {name} has shape {actual}: expected {shape}")
        self.config = config
        self.weights = {name: weights[name].to(torch.float32).contiguous() for name in expected}
        self._w = {name: w.to(torch.float64) for name, w in self.weights.items()}
        self._lm_head = self._w.get("lm_head.weight", self._w["model.embed_tokens.weight"])
        half = config.head_dim // 2
        exponent = torch.arange(0, half, dtype=torch.float64) * 2 / config.head_dim
        self._inv_freq = (1.0 / (config.rope_theta**exponent)).to(torch.float64)

    # -- building blocks ---------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.config.rms_norm_eps) * weight

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, head_dim]; cos/sin: [T, head_dim]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Causal attention of `q` (new tokens from position `start`) over keys 0..end."""
        cfg = self.config
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        n, ctx = q.shape[0], k.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(cfg.head_dim)
        q_pos = torch.arange(start, start + n)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        scores = scores.masked_fill((k_pos > q_pos)[None, :, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v)

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        w = self._w
        gate = F.linear(x, w[p + "mlp.gate_proj.weight"])
        up = F.linear(x, w[p + "mlp.up_proj.weight"])
        return F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])

    def _qkv(
        self, x: torch.Tensor, p: str, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg, w = self.config, self._w
        t = x.shape[0]
        q = F.linear(x, w[p + "self_attn.q_proj.weight"]).view(t, cfg.num_attention_heads, -1)
        k = F.linear(x, w[p + "self_attn.k_proj.weight"]).view(t, cfg.num_key_value_heads, -1)
        v = F.linear(x, w[p + "self_attn.v_proj.weight"]).view(t, cfg.num_key_value_heads, -1)
        cos, sin = self._rope(positions)
        return self._apply_rope(q, cos, sin), self._apply_rope(k, cos, sin), v

    # -- forward passes ----------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        seqs: Sequence[SeqSlice],
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        on_layer_done: LayerDone | None = None,
    ) -> torch.Tensor:
        """Logits `[T, vocab]` for the flattened new tokens; writes their K/V into the cache.

        `kv_caches[layer]` is `(k, v)`, each `[num_blocks, block_size, kv_heads, head_dim]`.
        `on_layer_done(layer)` is called once that layer's K/V for every new token is in
        the cache (the hook for layer-wise push).
        """
        cfg, w = self.config, self._w
        if token_ids.dim() != 1 or token_ids.shape[0] != sum(s.num_new for s in seqs):
            raise ValueError("token_ids must be 1-D with one entry per new token of every sequence")
        block_size = kv_caches[0][0].shape[1]
        positions = torch.cat(
            [torch.arange(s.num_cached, s.num_cached + s.num_new) for s in seqs]
        ).to(torch.long)
        slot_blocks: list[int] = []
        for s in seqs:
            for pos in range(s.num_cached, s.num_cached + s.num_new):
                slot_blocks.append(s.block_table[pos // block_size])
        blocks = torch.tensor(slot_blocks, dtype=torch.long)
        offsets = positions % block_size

        x = w["model.embed_tokens.weight"][token_ids]
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            k_cache, v_cache = kv_caches[layer]
            h = self._rms_norm(x, w[p + "input_layernorm.weight"])
            q, k, v = self._qkv(h, p, positions)
            k_cache[blocks, offsets] = k.to(k_cache.dtype)
            v_cache[blocks, offsets] = v.to(v_cache.dtype)
            outs = []
            row = 0
            for s in seqs:
                end = s.num_cached + s.num_new
                table = torch.tensor(list(s.block_table[: (end + block_size - 1) // block_size]))
                keys = k_cache[table].flatten(0, 1)[:end].to(torch.float64)
                values = v_cache[table].flatten(0, 1)[:end].to(torch.float64)
                outs.append(self._attend(q[row : row + s.num_new], keys, values, s.num_cached))
                row += s.num_new
            attn = torch.cat(outs).reshape(x.shape[0], -1)
            x = x + F.linear(attn, w[p + "self_attn.o_proj.weight"])
            x = x + self._mlp(self._rms_norm(x, w[p + "post_attention_layernorm.weight"]), p)
            if on_layer_done is not None:
                on_layer_done(layer)
        return F.linear(self._rms_norm(x, w["model.norm.weight"]), self._lm_head).float()

    @torch.inference_mode()
    def forward_dense(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits `[T, vocab]` of one whole sequence, with no cache at all."""
        cfg, w = self.config, self._w
        positions = torch.arange(token_ids.shape[0])
        x = w["model.embed_tokens.weight"][token_ids]
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            q, k, v = self._qkv(self._rms_norm(x, w[p + "input_layernorm.weight"]), p, positions)
            attn = self._attend(q, k, v, 0).reshape(x.shape[0], -1)
            x = x + F.linear(attn, w[p + "self_attn.o_proj.weight"])
            x = x + self._mlp(self._rms_norm(x, w[p + "post_attention_layernorm.weight"]), p)
        return F.linear(self._rms_norm(x, w["model.norm.weight"]), self._lm_head).float()
