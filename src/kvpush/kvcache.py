"""KV cache registration: from an engine's torch tensors to the regions kvpush moves.

An engine hands kvpush a mapping of layer name to its KV tensor(s) and says how they are
laid out (`KVLayout`). `register_kv_cache` checks every tensor against that declaration
and derives a `CacheGeometry`: per region, the base address, the bytes of one block, the
distance between two blocks and the number of blocks. Nothing is copied or kept alive
here; the engine owns the tensors and must keep them alive while kvpush uses the memory.

Layouts (N = blocks, B = tokens per block, H = KV heads, D = head dim):

=================  =====================================  ==========  =====================
KVLayout           tensors per layer                       blocks 1st  regions per layer
=================  =====================================  ==========  =====================
KV_SEPARATE_NHD    (K, V), each [N, B, H, D]               yes         2 (K, V)
KV_SEPARATE_HND    (K, V), each [N, H, B, D]               yes         2 (K, V)
KV_FIRST_NHD       one [2, N, B, H, D]                     no          2 (K half, V half)
KV_FIRST_HND       one [2, N, H, B, D]                     no          2 (K half, V half)
BLOCKS_FIRST_NHD   one [N, 2, B, H, D]                     yes         1 (K and V together)
BLOCKS_FIRST_HND   one [N, 2, H, B, D]                     yes         1 (K and V together)
=================  =====================================  ==========  =====================

A block must be one contiguous run of bytes in every region (the block axis may have any
stride at least that long): that is what lets one descriptor per block move it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Union

from kvpush.errors import ConfigError, KVLayoutError
from kvpush.geometry import CacheGeometry, Region

if TYPE_CHECKING:
    import torch

KVTensors = Union["torch.Tensor", tuple["torch.Tensor", "torch.Tensor"]]


class KVLayout(enum.StrEnum):
    """How one layer's KV cache is laid out in memory. The value travels in the geometry."""

    KV_SEPARATE_NHD = "kv_separate/NHD"
    KV_SEPARATE_HND = "kv_separate/HND"
    KV_FIRST_NHD = "kv_first/NHD"
    KV_FIRST_HND = "kv_first/HND"
    BLOCKS_FIRST_NHD = "blocks_first/NHD"
    BLOCKS_FIRST_HND = "blocks_first/HND"

    @property
    def separate_kv(self) -> bool:
        """K and V are two tensors per layer."""
        return self.value.startswith("kv_separate/")

    @property
    def blocks_first(self) -> bool:
        """The block axis is the first axis of every tensor the engine hands over."""
        return not self.value.startswith("kv_first/")

    @property
    def token_order(self) -> str:
        """`NHD` (tokens, then heads) or `HND` (heads, then tokens) inside a block."""
        return self.value.rsplit("/", 1)[1]

    @property
    def rank(self) -> int:
        """Number of dimensions of each tensor of a layer."""
        return 4 if self.separate_kv else 5

    def expected_shape(self) -> str:
        """The declared shape, in letters, for error messages."""
        inner = "B, H, D" if self.token_order == "NHD" else "H, B, D"
        if self.separate_kv:
            return f"(K, V), each [N, {inner}]"
        if self.blocks_first:
            return f"[N, 2, {inner}]"
        return f"[2, N, {inner}]"

    @classmethod
    def parse(cls, text: str) -> KVLayout:
        """Accept the value (`kv_separate/NHD`) or the member name (`KV_SEPARATE_NHD`)."""
        for member in cls:
            if text in (member.value, member.name) or text.lower() == member.value.lower():
                return member
        legal = ", ".join(m.value for m in cls)
        raise ConfigError(f"unknown KV layout {text!r}: expected one of {legal}")


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `bfloat16`: the name that travels in the geometry."""
    return str(dtype).removeprefix("torch.")


def register_kv_cache(
    kv_caches: Mapping[str, KVTensors],
    layout: KVLayout | str,
    block_size_tokens: int,
) -> CacheGeometry:
    """Validate an engine's KV cache against its declared layout and derive its geometry.

    `kv_caches` maps layer names to tensors, in layer order (the mapping order gives each
    layer its index). Raises `KVLayoutError` naming the layer, the expected and actual
    block counts, shape, strides, dtype, device, declared layout and whether blocks are
    first, on any inconsistency.
    """
    layout = KVLayout.parse(layout) if isinstance(layout, str) else layout
    if block_size_tokens <= 0:
        raise KVLayoutError(f"block_size_tokens must be positive, got {block_size_tokens}")
    if not kv_caches:
        raise KVLayoutError("the KV cache is empty: expected at least one layer")

    regions: list[Region] = []
    first: _LayerFacts | None = None
    for index, (name, value) in enumerate(kv_caches.items()):
        tensors = _layer_tensors(name, index, value, layout)
        for part, tensor in tensors:
            facts = _LayerFacts(
                name=name,
                index=index,
                part=part,
                tensor=tensor,
                layout=layout,
                block_size_tokens=block_size_tokens,
            )
            if first is None:
                first = facts
            facts.check_against(first)
            regions.extend(facts.regions())
    assert first is not None
    return CacheGeometry(
        layout=layout.value,
        block_size_tokens=block_size_tokens,
        dtype=dtype_name(first.tensor.dtype),
        regions=tuple(regions),
    )


def _layer_tensors(
    name: str, index: int, value: object, layout: KVLayout
) -> list[tuple[str, torch.Tensor]]:
    """The tensors of one layer, each with the suffix its region names get."""
    import torch

    if layout.separate_kv:
        if not (isinstance(value, Sequence) and len(value) == 2):
            got = f"a sequence of {len(value)}" if isinstance(value, Sequence) else _kind(value)
            raise KVLayoutError(
                f"layer {name!r} (index {index}): declared layout {layout.value} expects a "
                f"(K, V) pair of tensors {layout.expected_shape()}, got {got}"
            )
        pairs = [("k", value[0]), ("v", value[1])]
    elif isinstance(value, Sequence):
        raise KVLayoutError(
            f"layer {name!r} (index {index}): declared layout {layout.value} expects one "
            f"tensor {layout.expected_shape()}, got a sequence of {len(value)}"
        )
    else:
        pairs = [("", value)]
    tensors: list[tuple[str, torch.Tensor]] = []
    for part, tensor in pairs:
        if not isinstance(tensor, torch.Tensor):
            where = f" tensor {part.upper()}" if part else ""
            raise KVLayoutError(
                f"layer {name!r} (index {index}){where}: expected a torch.Tensor "
                f"{layout.expected_shape()} for declared layout {layout.value}, "
                f"got {_kind(tensor)}"
            )
        tensors.append((part, tensor))
    return tensors


def storage_shortfall(t: torch.Tensor) -> tuple[int, int] | None:
    """(bytes the view reaches, bytes its storage holds) when the view reaches past its
    storage; None when it fits. From the tensor's own offset, shape and strides."""
    span = sum((int(n) - 1) * int(s) for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    needed = (int(t.storage_offset()) + span) * t.element_size()
    have = t.untyped_storage().nbytes()
    return (needed, have) if needed > have else None


def _kind(value: object) -> str:
    return f"a {type(value).__name__}"


class _LayerFacts:
    """One tensor of one layer, read once, with everything an error message needs."""

    def __init__(
        self,
        *,
        name: str,
        index: int,
        part: str,
        tensor: torch.Tensor,
        layout: KVLayout,
        block_size_tokens: int,
    ) -> None:
        self.name = name
        self.index = index
        self.part = part
        self.tensor = tensor
        self.layout = layout
        self.block_size_tokens = block_size_tokens

    @property
    def block_axis(self) -> int:
        return 0 if self.layout.blocks_first else 1

    @property
    def num_blocks(self) -> int:
        return int(self.tensor.shape[self.block_axis])

    def describe(self, expected_blocks: int | None = None) -> str:
        t = self.tensor
        try:
            shape = tuple(t.shape)
            strides: tuple[int, ...] | str = tuple(t.stride())
            dtype, device = dtype_name(t.dtype), str(t.device)
            actual: int | str = self.num_blocks if t.dim() > self.block_axis else "none"
        except (AttributeError, TypeError, RuntimeError):
            shape, strides, dtype, device, actual = (), "?", "?", "?", "?"
        expected = actual if expected_blocks is None else expected_blocks
        return (
            f"expected blocks {expected}, actual blocks {actual}; shape {shape}, "
            f"strides {strides} (elements), dtype {dtype}, device {device}; declared layout "
            f"{self.layout.value} {self.layout.expected_shape()}, blocks first: "
            f"{'yes' if self.layout.blocks_first else 'no'}, "
            f"block_size_tokens {self.block_size_tokens}"
        )

    def where(self) -> str:
        part = f" tensor {self.part.upper()}" if self.part else ""
        return f"layer {self.name!r} (index {self.index}){part}"

    def fail(self, problem: str, expected_blocks: int | None = None) -> None:
        raise KVLayoutError(f"{self.where()}: {problem} [{self.describe(expected_blocks)}]")

    def check_against(self, first: _LayerFacts) -> None:
        t = self.tensor
        expected_blocks = first.num_blocks if first is not self else None
        if t.dim() != self.layout.rank:
            self.fail(
                f"wrong rank: expected {self.layout.rank} dimensions "
                f"{self.layout.expected_shape()}, got {t.dim()}",
                expected_blocks,
            )
        if self.num_blocks != first.num_blocks:
            self.fail(
                f"different block count: expected {first.num_blocks} blocks (as in "
                f"{first.where()}), got {self.num_blocks}",
                expected_blocks,
            )
        if self.num_blocks <= 0:
            self.fail("no blocks: expected at least one", expected_blocks)
        if t.dtype != first.tensor.dtype:
            self.fail(
                f"mixed dtypes: expected {dtype_name(first.tensor.dtype)} (as in "
                f"{first.where()}), got {dtype_name(t.dtype)}",
                expected_blocks,
            )
        if t.device != first.tensor.device:
            self.fail(
                f"mixed devices: expected {first.tensor.device} (as in {first.where()}), "
                f"got {t.device}",
                expected_blocks,
            )
        if t.device.type == "meta":
            self.fail("tensor on the meta device has no memory to register", expected_blocks)
        if not self.layout.blocks_first and t.shape[0] != 2:
            self.fail(f"the K/V axis (axis 0) must have size 2, got {t.shape[0]}", expected_blocks)
        if self.layout.blocks_first and not self.layout.separate_kv and t.shape[1] != 2:
            self.fail(f"the K/V axis (axis 1) must have size 2, got {t.shape[1]}", expected_blocks)
        token_axis = -3 if self.layout.token_order == "NHD" else -2
        tokens = int(t.shape[token_axis])
        if tokens != self.block_size_tokens:
            size = "too small" if tokens < self.block_size_tokens else "does not match"
            self.fail(
                f"tensor {size} for its declared geometry: the token axis (axis "
                f"{t.dim() + token_axis}) holds {tokens} tokens per block, expected "
                f"block_size_tokens={self.block_size_tokens}",
                expected_blocks,
            )
        if any(int(s) <= 0 for s in t.shape):
            self.fail("every axis must have a positive size", expected_blocks)
        self._check_contiguous_blocks(expected_blocks)
        self._check_storage(expected_blocks)

    def _block_dims(self) -> tuple[int, ...]:
        """The axes that make up one block's bytes in one region."""
        ndim = self.tensor.dim()
        if self.layout.separate_kv or not self.layout.blocks_first:
            return tuple(range(ndim - 3, ndim))
        return tuple(range(1, ndim))  # blocks first, K and V together: [2, ...]

    def _check_contiguous_blocks(self, expected_blocks: int | None) -> None:
        t = self.tensor
        expected_stride = 1
        for axis in reversed(self._block_dims()):
            if int(t.shape[axis]) != 1 and int(t.stride(axis)) != expected_stride:
                self.fail(
                    f"non-contiguous block: axis {axis} has stride {t.stride(axis)}, expected "
                    f"{expected_stride} for a block to be one run of bytes",
                    expected_blocks,
                )
            expected_stride *= int(t.shape[axis])
        block_elems = expected_stride
        if self.num_blocks > 1 and int(t.stride(self.block_axis)) < block_elems:
            self.fail(
                f"blocks overlap: the block axis (axis {self.block_axis}) has stride "
                f"{t.stride(self.block_axis)}, expected at least {block_elems} elements",
                expected_blocks,
            )
        if not self.layout.blocks_first:
            # The V half (at axis-0 offset 1) must start after the K half's last block.
            span = int(t.stride(1)) * (self.num_blocks - 1) + block_elems
            if int(t.stride(0)) < span:
                self.fail(
                    f"K and V halves overlap: axis 0 has stride {t.stride(0)}, expected "
                    f"at least {span} elements",
                    expected_blocks,
                )

    def _check_storage(self, expected_blocks: int | None) -> None:
        short = storage_shortfall(self.tensor)
        if short is not None:
            needed, have = short
            self.fail(
                f"tensor too small for its declared geometry: it needs {needed} bytes of "
                f"storage, its storage holds {have}",
                expected_blocks,
            )

    def regions(self) -> list[Region]:
        t = self.tensor
        elem = t.element_size()
        block_elems = 1
        for axis in self._block_dims():
            block_elems *= int(t.shape[axis])
        block_stride = int(t.stride(self.block_axis)) * elem

        def region(suffix: str, base_addr: int) -> Region:
            return Region(
                name=f"{self.name}.{suffix}",
                layer=self.index,
                base_addr=base_addr,
                block_bytes=block_elems * elem,
                block_stride=block_stride,
                num_blocks=self.num_blocks,
                device=str(t.device),
            )

        base = int(t.data_ptr())
        if self.layout.separate_kv:
            return [region(self.part, base)]
        if self.layout.blocks_first:
            return [region("kv", base)]
        return [region("k", base), region("v", base + int(t.stride(0)) * elem)]
