"""vLLM's KV cache as kvpush registers it: one region per layer, read from the tensors.

vLLM hands `register_kv_caches` one tensor per attention layer. Its logical shape is
`[blocks, heads, tokens, head_size + head_size_v]` (K and V packed side by side in the
last axis, as the CPU backend and the layouts of vLLM's `KVCacheLayout` have it); its
physical order is whatever the resolved layout made of it (`LBHNC` on CPU: each layer
compact, each block one run of `[heads, tokens, K|V]`). MLA's latent cache is
`[blocks, tokens, latent]`, one latent per token on every rank: registered the same way,
as one head. Other backends hand
`[2, blocks, ...]` or `[blocks, 2, ...]` tensors: those kvpush's own layouts cover.
A Mamba layer's cache is an untyped page per block (`[blocks, 1, 1, bytes]`, its conv
and SSM states one after the other) that vLLM lays over an attention layer's blocks
(it pads the state to the attention page): it is registered as the start of that
layer's region, and a state moves as the whole block holding it.

Nothing is assumed from the layout's name: the block axis is axis 0 of the view, and a
block must be one contiguous run of bytes (the other axes dense, in any order); the
order they are stored in becomes part of the geometry's layout string, so two engines
with different physical orders are refused as incompatible. Errors are kvpush's own
`KVLayoutError`, naming the layer, the expected and actual block counts, shape, strides,
dtype and device, the way `kvpush.kvcache.register_kv_cache` names them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import msgspec

from kvpush.errors import KVLayoutError
from kvpush.geometry import PACKED_PREFIX, CacheGeometry, KVHeads, Region
from kvpush.kvcache import KVLayout, dtype_name, register_kv_cache, storage_shortfall

if TYPE_CHECKING:
    import torch

# Logical axis letters of one packed layer view, in vLLM's own naming (RFC 42082).
_AXES = "BHNC"
LAYOUT_PREFIX = PACKED_PREFIX


# vLLM's cache dtypes (`--kv-cache-dtype`) whose bytes the tensors' dtype names fully:
# "auto" is the model's dtype, the others float types of their own.
PLAIN_CACHE_DTYPES = frozenset({"auto", "float", "float16", "half", "bfloat16", "float32"})


def cache_dtype_name(
    tensor_dtype: str, vllm_cache_dtype: str, kv_scales: Sequence[tuple[float, float]]
) -> str:
    """What the cache's bytes are, as the geometry's `dtype` names them for the
    compatibility check: the tensors' dtype for a plain cache; for a quantized one
    (`--kv-cache-dtype fp8`, `fp8_e4m3`, `fp8_e5m2`, ...) also vLLM's format and the
    scales every layer quantized with (`kv_scales`, (k_scale, v_scale) per layer).
    vLLM stores every fp8 format in uint8 tensors and keeps its scales on the layers,
    so the tensors alone cannot tell e4m3 from e5m2, nor bytes quantized with other
    scales: a peer holding any of those would read ours as other numbers."""
    if vllm_cache_dtype in PLAIN_CACHE_DTYPES:
        return tensor_dtype
    distinct = sorted(set(kv_scales))
    if not distinct:
        scales = "no per-layer scales"
    elif len(distinct) == 1:
        k, v = distinct[0]
        scales = f"k_scale {k!r}, v_scale {v!r} in every layer"
    else:
        digest = hashlib.sha256(repr(list(kv_scales)).encode()).hexdigest()[:16]
        scales = f"k/v scales of their own per layer, digest {digest}"
    return f"{tensor_dtype} holding {vllm_cache_dtype} ({scales})"


def register_vllm_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    block_size_tokens: int,
    heads: KVHeads | None = None,
    state_layers: frozenset[str] = frozenset(),
) -> CacheGeometry:
    """The geometry of vLLM's KV cache, from the tensors' own shapes, strides and storage.

    Packed per-layer tensors (`[B, H, N, C]`) become one region per layer; tensors of
    kvpush's 5-D layouts (`[2, B, N, H, D]`, `[B, 2, ...]`) go to
    `kvpush.kvcache.register_kv_cache`. `heads`: how this rank's blocks hold the model's
    KV heads (from vLLM's config), checked against the tensors' head axis.
    `state_layers`: the Mamba layers, each of which must lie within an attention
    layer's blocks (`check_state_pages`)."""
    if not kv_caches:
        raise KVLayoutError("vLLM handed an empty KV cache: expected at least one layer")
    slots = layer_slots(kv_caches)
    firsts: dict[int, str] = {}
    for name, slot in slots.items():
        if name not in state_layers:
            firsts.setdefault(slot, name)
    everything = kv_caches
    kv_caches = {firsts[slot]: kv_caches[firsts[slot]] for slot in sorted(firsts)}
    if not kv_caches:
        raise KVLayoutError(
            f"vLLM handed only Mamba state layers ({', '.join(sorted(state_layers))}): "
            "kvpush moves a state within an attention layer's blocks, expected at least one "
            "attention layer"
        )
    geometry = _register(kv_caches, block_size_tokens, heads)
    check_state_pages(everything, state_layers, slots, geometry)
    return geometry


def _register(
    kv_caches: Mapping[str, torch.Tensor], block_size_tokens: int, heads: KVHeads | None
) -> CacheGeometry:
    first = next(iter(kv_caches.values()))
    if first.dim() == 3:
        # MLA's latent cache, `[B, N, C]`: one latent "head" per block, every rank the
        # same (`heads.replicated`); registered as the packed layout with H = 1.
        kv_caches = {name: t.unsqueeze(1) for name, t in kv_caches.items()}
        first = next(iter(kv_caches.values()))
    if first.dim() == 5:
        layout = _five_d_layout(first, block_size_tokens)
        geometry = register_kv_cache(kv_caches, layout, block_size_tokens)
        head_axis = 3 if layout.token_order == "NHD" else 2
        return _with_heads(geometry, heads, int(first.shape[head_axis]), next(iter(kv_caches)))
    regions: list[Region] = []
    reference: _Packed | None = None
    for index, (name, tensor) in enumerate(kv_caches.items()):
        facts = _Packed(name, index, tensor, block_size_tokens)
        facts.check(reference)
        reference = reference or facts
        regions.append(facts.region())
    assert reference is not None
    geometry = CacheGeometry(
        layout=LAYOUT_PREFIX + reference.physical_order(),
        block_size_tokens=block_size_tokens,
        dtype=dtype_name(reference.tensor.dtype),
        regions=tuple(regions),
    )
    return _with_heads(geometry, heads, int(reference.tensor.shape[1]), reference.name)


def layer_slots(kv_caches: Mapping[str, object]) -> dict[str, int]:
    """Each layer's region (its index, in the order the layers come): layers whose
    tensors start at one address, with one stride and count of blocks, share one.
    vLLM's hybrid KV-cache manager lays the layers of its KV-cache groups over each
    other (layer i of every group in one view, or a Mamba layer's state pages over an
    attention layer's blocks; a block belongs to one group at a time), so one region per
    place in memory moves each group's blocks once."""
    import torch

    slots: dict[str, int] = {}
    seen: dict[object, int] = {}
    for name, tensor in kv_caches.items():
        key: object = name  # not a tensor: its own region (registration names the problem)
        if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
            key = (tensor.data_ptr(), tensor.stride(0) * tensor.element_size(), tensor.shape[0])
        slots[name] = seen.setdefault(key, len(seen))
    return slots


def check_state_pages(
    kv_caches: Mapping[str, torch.Tensor],
    state_layers: frozenset[str],
    slots: Mapping[str, int],
    geometry: CacheGeometry,
) -> None:
    """Every Mamba layer's state lies within the blocks of the region it shares (its
    block `b` inside that region's block `b`), so moving that block moves the state."""
    import torch

    for name in sorted(state_layers & kv_caches.keys()):
        t = kv_caches[name]
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            raise KVLayoutError(
                f"Mamba layer {name!r}: expected a tensor of state pages [blocks, ...], got "
                f"{type(t).__name__}{'' if not isinstance(t, torch.Tensor) else tuple(t.shape)}"
            )
        region = next(
            (r for r in geometry.regions if r.layer == slots[name] and r.base_addr == t.data_ptr()),
            None,
        )
        extent = 1 + sum(
            (int(n) - 1) * int(st) for n, st in zip(t.shape[1:], t.stride()[1:], strict=True)
        )
        page = extent * t.element_size()
        if region is None or page > region.block_bytes:
            where = (
                "no attention layer's blocks"
                if region is None
                else f"region {region.name!r} ({region.block_bytes} bytes per block)"
            )
            raise KVLayoutError(
                f"Mamba layer {name!r}: its state pages ({page} bytes per block, every "
                f"{t.stride(0) * t.element_size()} bytes from {t.data_ptr():#x}, "
                f"{t.shape[0]} blocks) do not fit within {where}: expected vLLM's hybrid "
                "layout, where each state page is the start of an attention layer's block "
                "padded to hold it"
            )


def _with_heads(
    geometry: CacheGeometry, heads: KVHeads | None, tensor_heads: int, layer: str
) -> CacheGeometry:
    if heads is None:
        return geometry
    if tensor_heads != heads.per_rank:
        raise KVLayoutError(
            f"layer {layer!r}: its blocks hold {tensor_heads} KV heads, but this rank "
            f"(TP rank {heads.tp_rank} of {heads.tp_size}, {heads.total} KV heads in the "
            f"model{', replicated' if heads.replicated else ''}) should hold {heads.per_rank}"
        )
    return msgspec.structs.replace(geometry, heads=heads)


def _five_d_layout(tensor: torch.Tensor, block_size_tokens: int) -> KVLayout:
    """Which of kvpush's layouts a 5-D vLLM tensor is: K/V axis first or second, and
    whether tokens come before heads (found from the axis holding block_size tokens)."""
    kv_first = int(tensor.shape[0]) == 2 and int(tensor.shape[1]) != 2
    token_order = "NHD" if int(tensor.shape[2]) == block_size_tokens else "HND"
    if kv_first:
        return KVLayout.parse(f"kv_first/{token_order}")
    return KVLayout.parse(f"blocks_first/{token_order}")


class _Packed:
    """One packed layer tensor, read once, with everything an error message needs."""

    def __init__(self, name: str, index: int, tensor: object, block_size_tokens: int) -> None:
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise KVLayoutError(
                f"layer {name!r} (index {index}): expected a torch.Tensor "
                f"[blocks, heads, tokens, head_size + head_size_v], got a {type(tensor).__name__}"
            )
        self.name = name
        self.index = index
        self.tensor = tensor
        self.block_size_tokens = block_size_tokens

    def describe(self, expected_blocks: int | None) -> str:
        t = self.tensor
        actual = int(t.shape[0]) if t.dim() else "none"
        expected = actual if expected_blocks is None else expected_blocks
        return (
            f"expected blocks {expected}, actual blocks {actual}; shape {tuple(t.shape)}, "
            f"strides {tuple(t.stride())} (elements), dtype {dtype_name(t.dtype)}, device "
            f"{t.device}; declared layout vLLM packed [B, H, N, C] (C = head_size + "
            f"head_size_v), blocks first: yes, block_size_tokens {self.block_size_tokens}"
        )

    def fail(self, problem: str, expected_blocks: int | None = None) -> None:
        raise KVLayoutError(
            f"layer {self.name!r} (index {self.index}): {problem} "
            f"[{self.describe(expected_blocks)}]"
        )

    def check(self, first: _Packed | None) -> None:
        t = self.tensor
        expected = None if first is None else int(first.tensor.shape[0])
        if t.dim() != 4:
            self.fail(
                f"wrong rank: expected 4 dimensions [B, H, N, C] like the first layer (3 "
                f"for MLA's [B, N, C], 5 for a split K/V layout), got {t.dim()}",
                expected,
            )
        if any(int(s) <= 0 for s in t.shape):
            self.fail("every axis must have a positive size", expected)
        if int(t.shape[2]) != self.block_size_tokens:
            self.fail(
                f"the token axis (axis 2) holds {t.shape[2]} tokens per block, expected "
                f"block_size_tokens={self.block_size_tokens}",
                expected,
            )
        if t.device.type == "meta":
            self.fail("tensor on the meta device has no memory to register", expected)
        if first is not None:
            f = first.tensor
            if int(t.shape[0]) != int(f.shape[0]):
                self.fail(
                    f"different block count: expected {f.shape[0]} blocks (as in layer "
                    f"{first.name!r}), got {t.shape[0]}",
                    expected,
                )
            if t.dtype != f.dtype:
                self.fail(
                    f"mixed dtypes: expected {dtype_name(f.dtype)} (as in layer "
                    f"{first.name!r}), got {dtype_name(t.dtype)}",
                    expected,
                )
            if t.device != f.device:
                self.fail(
                    f"mixed devices: expected {f.device} (as in layer {first.name!r}), "
                    f"got {t.device}",
                    expected,
                )
            if tuple(t.shape[1:]) != tuple(f.shape[1:]) or self.physical_order() != (
                first.physical_order()
            ):
                self.fail(
                    f"different block shape or order: expected {tuple(f.shape)} stored "
                    f"{first.physical_order()} (as in layer {first.name!r})",
                    expected,
                )
        self._check_block_is_one_run(expected)
        self._check_storage(expected)

    def physical_order(self) -> str:
        """The logical axes from outermost to innermost in memory, e.g. `BHNC`."""
        strides = tuple(self.tensor.stride())
        axes = sorted(range(4), key=lambda a: (-strides[a], a))
        return "".join(_AXES[a] for a in axes)

    def _check_block_is_one_run(self, expected: int | None) -> None:
        t = self.tensor
        strides = tuple(t.stride())
        inner = sorted((1, 2, 3), key=lambda a: strides[a])
        run = 1
        for axis in inner:
            if int(t.shape[axis]) != 1 and int(t.stride(axis)) != run:
                self.fail(
                    f"non-contiguous block: axis {axis} ({_AXES[axis]}) has stride "
                    f"{t.stride(axis)}, expected {run} for a block to be one run of bytes "
                    "(a layout with heads outside blocks, such as LHBNC, is not supported)",
                    expected,
                )
            run *= int(t.shape[axis])
        if int(t.shape[0]) > 1 and int(t.stride(0)) < run:
            self.fail(
                f"blocks overlap: the block axis has stride {t.stride(0)}, expected at "
                f"least {run} elements",
                expected,
            )

    def _check_storage(self, expected: int | None) -> None:
        short = storage_shortfall(self.tensor)
        if short is not None:
            needed, have = short
            self.fail(
                f"tensor too small for its geometry: it needs {needed} bytes of storage, "
                f"its storage holds {have}",
                expected,
            )

    def region(self) -> Region:
        t = self.tensor
        elem = t.element_size()
        return Region(
            name=f"{self.name}.kv",
            layer=self.index,
            base_addr=int(t.data_ptr()),
            block_bytes=int(t.shape[1]) * int(t.shape[2]) * int(t.shape[3]) * elem,
            block_stride=int(t.stride(0)) * elem,
            num_blocks=int(t.shape[0]),
            device=str(t.device),
        )
