"""The shape of a registered KV cache, as kvpush and its peers see it.

`kvcache.register_kv_cache` derives a `CacheGeometry` from an engine's torch tensors;
the side channel publishes it; transports register and address memory from it. These
are plain, frozen msgspec structs so they travel on the wire unchanged.

Block `b` of region `r` occupies bytes `[r.base_addr + b * r.block_stride,
r.base_addr + b * r.block_stride + r.block_bytes)` in `r.device` memory. A region is one
tensor (or one half of a K/V-combined tensor) of one layer; the same block id names the
same token slots in every region.
"""

from __future__ import annotations

import hashlib

import msgspec

# Bumped whenever the meaning of any wire message or the geometry changes.
PROTOCOL_VERSION = 1


class Region(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    name: str  # e.g. "model.layers.0.k"
    layer: int  # index of the layer this region belongs to (for layer-wise push)
    base_addr: int
    block_bytes: int
    block_stride: int
    num_blocks: int
    device: str = "cpu"  # "cpu" or "cuda:N"


class CacheGeometry(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    layout: str  # e.g. "kv_separate/NHD" (kvcache.KVLayout names the legal values)
    block_size_tokens: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    regions: tuple[Region, ...]
    mode: str = "push"

    @property
    def num_blocks(self) -> int:
        return self.regions[0].num_blocks if self.regions else 0

    @property
    def num_layers(self) -> int:
        return len({r.layer for r in self.regions})

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id stands for, over all regions."""
        return sum(r.block_bytes for r in self.regions)

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    def compat_fields(self) -> dict[str, object]:
        """What two peers must agree on; addresses and block counts may differ."""
        return {
            "protocol_version": PROTOCOL_VERSION,
            "layout": self.layout,
            "block_size_tokens": self.block_size_tokens,
            "dtype": self.dtype,
            "mode": self.mode,
            "regions": [(r.name, r.layer, r.block_bytes) for r in self.regions],
        }

    def compat_hash(self) -> str:
        encoded = msgspec.json.encode(self.compat_fields())
        return hashlib.sha256(encoded).hexdigest()[:32]
