"""Model presets and synthetic KV caches: what the bench (and tests and endpoints) moves.

A `ModelPreset` is the KV-cache shape of a model; `synthetic_kv_cache` allocates torch
tensors of that shape (or of a given block size) and registers them with
`kvpush.kvcache.register_kv_cache`, the way an engine would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpush.errors import ConfigError
from kvpush.geometry import CacheGeometry
from kvpush.kvcache import KVLayout, KVTensors, register_kv_cache

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """The KV-cache shape of a model: what a synthetic cache of that model looks like."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_size_tokens: int = 16

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        import torch

        elem = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def layer_block_bytes(self) -> int:
        """K and V of one block of one layer."""
        return self.kv_bytes_per_token // self.num_layers * self.block_size_tokens


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        # 128 KiB of KV per token: 32 layers x 2 x 8 heads x 128 dims x 2 bytes.
        ModelPreset("llama-3.1-8b", num_layers=32, num_kv_heads=8, head_dim=128),
        # 320 KiB of KV per token.
        ModelPreset("llama-3-70b", num_layers=80, num_kv_heads=8, head_dim=128),
        # Small enough for tests and demos: 2 layers, 512 bytes per token.
        ModelPreset("tiny", num_layers=2, num_kv_heads=2, head_dim=32),
    )
}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown model preset {name!r}: expected one of {', '.join(PRESETS)}"
        ) from None


@dataclass(frozen=True, slots=True)
class SyntheticKVCache:
    """Tensors shaped like an engine's KV cache, and the geometry registered from them.

    Keep this object alive while its memory is registered anywhere.
    """

    kv_caches: dict[str, KVTensors]
    layout: KVLayout
    block_size_tokens: int
    geometry: CacheGeometry


def synthetic_kv_cache(
    num_layers: int | None = None,
    num_blocks: int = 64,
    *,
    block_bytes: int | None = None,
    preset: ModelPreset | str | None = None,
    dtype: str | None = None,
    layout: KVLayout | str = KVLayout.KV_SEPARATE_NHD,
    block_size_tokens: int | None = None,
    device: str = "cpu",
    fill: int | None = 0,
) -> SyntheticKVCache:
    """A KV cache for tests, endpoints and benchmarks, registered with `register_kv_cache`.

    Give either a `preset` (a model's shape; `num_layers` overrides its layer count) or
    `num_layers` and `block_bytes`, the bytes of K and V together of one block of one
    layer (then heads = 1 and the head dim is derived). `fill` sets every byte (None leaves
    memory uninitialised, which costs nothing until it is touched).
    """
    import torch

    layout = KVLayout.parse(layout) if isinstance(layout, str) else layout
    if num_blocks <= 0:
        raise ConfigError(f"num_blocks must be positive, got {num_blocks}")
    if preset is not None:
        if block_bytes is not None:
            raise ConfigError("give either a preset or block_bytes, not both")
        p = get_preset(preset) if isinstance(preset, str) else preset
        layers = p.num_layers if num_layers is None else num_layers
        heads, head_dim = p.num_kv_heads, p.head_dim
        dtype_text = dtype or p.dtype
        tokens = block_size_tokens or p.block_size_tokens
    else:
        if num_layers is None or block_bytes is None:
            raise ConfigError("give a preset, or both num_layers and block_bytes")
        layers = num_layers
        dtype_text = dtype or "bfloat16"
        tokens = block_size_tokens or 16
        elem = torch.empty((), dtype=_torch_dtype(dtype_text)).element_size()
        per_head = 2 * tokens * elem
        if block_bytes <= 0 or block_bytes % per_head:
            raise ConfigError(
                f"block_bytes {block_bytes} must be a positive multiple of {per_head} "
                f"(K and V x {tokens} tokens x {elem}-byte {dtype_text})"
            )
        heads, head_dim = 1, block_bytes // per_head
    if layers <= 0:
        raise ConfigError(f"num_layers must be positive, got {layers}")
    torch_dtype = _torch_dtype(dtype_text)
    inner = (tokens, heads, head_dim) if layout.token_order == "NHD" else (heads, tokens, head_dim)

    def make(*shape: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch_dtype, device=device)
        if fill is not None:
            t.view(torch.uint8).fill_(fill)
        return t

    caches: dict[str, KVTensors] = {}
    for i in range(layers):
        name = f"model.layers.{i}.attn"
        if layout.separate_kv:
            caches[name] = (make(num_blocks, *inner), make(num_blocks, *inner))
        elif layout.blocks_first:
            caches[name] = make(num_blocks, 2, *inner)
        else:
            caches[name] = make(2, num_blocks, *inner)
    geometry = register_kv_cache(caches, layout, tokens)
    return SyntheticKVCache(caches, layout, tokens, geometry)


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown dtype {name!r}: expected a torch dtype such as bfloat16")
    return dtype
