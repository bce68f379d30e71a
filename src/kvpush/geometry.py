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
from collections.abc import Mapping
from typing import Any

import msgspec

# Bumped whenever the meaning of any wire message or the geometry changes.
# 2: leases are measured on the receiver's clock (Register/Heartbeat `sent_at`, `echo`);
# a version-1 sender would grant leases by arrival time, which a stall makes unsafe.
# 3: every data-plane message begins with the receiving rank's message key (published in
# its metadata), and a Reject names its receiver; a version-2 peer's messages would all
# be dropped unread, so the side channel refuses the pair instead, saying why.
# 4: the side channel's token is proven both ways (HMAC over a nonce) instead of sent in
# clear (`kvpush.sidechannel.wire`); a version-3 peer's request is refused, saying why.
PROTOCOL_VERSION = 4


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


class ScratchRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A small buffer a rank registers beside its KV cache, for `kvpush doctor`'s test
    writes only: bytes `[base_addr, base_addr + nbytes)` in `device` memory. It is never
    part of the cache, and a peer refuses one that overlaps any KV region
    (`overlapping_region`)."""

    base_addr: int
    nbytes: int
    device: str = "cpu"

    def overlapping_region(self, geometry: CacheGeometry) -> Region | None:
        """The first KV region of `geometry` this buffer shares a byte with, if any."""
        lo, hi = self.base_addr, self.base_addr + self.nbytes
        for r in geometry.regions:
            if r.num_blocks <= 0:
                continue
            r_hi = r.base_addr + (r.num_blocks - 1) * r.block_stride + r.block_bytes
            if lo < r_hi and r.base_addr < hi:
                return r
        return None


def describe_compat_differences(
    theirs: Mapping[str, object], ours: Mapping[str, object]
) -> list[str]:
    """What differs between two `CacheGeometry.compat_fields()`, one phrase per field,
    each naming theirs and ours (regions: the first region that differs)."""
    out: list[str] = []
    for key in sorted(set(ours) | set(theirs)):
        ours_value, their_value = ours.get(key), theirs.get(key)
        if their_value == ours_value:
            continue
        if key == "regions":
            out.append(_describe_region_difference(their_value, ours_value))
        else:
            out.append(f"{key}: theirs {their_value!r}, ours {ours_value!r}")
    return out


def _describe_region_difference(theirs: Any, ours: Any) -> str:
    theirs, ours = list(theirs or ()), list(ours or ())
    if len(theirs) != len(ours):
        return f"regions: theirs {len(theirs)}, ours {len(ours)}"
    for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        if tuple(a) != tuple(b):
            return (
                f"regions differ first at #{i}: theirs (name, layer, block_bytes) = "
                f"{tuple(a)}, ours {tuple(b)}"
            )
    return "regions differ"
