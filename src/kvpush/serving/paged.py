"""The paged KV cache and its block allocator, with prefix caching by block-content hashes.

The cache is one K and one V tensor per layer, each `[num_blocks, block_size, kv_heads,
head_dim]` (layout `kv_separate/NHD`), allocated once; kvpush registers exactly these
tensors, so a transport writes received blocks straight into them.

A block that is full and whose K/V have been computed gets a content hash: the hash of
its parent block's hash and its own token ids. A later request whose prompt starts with
the same tokens reuses those blocks (reference counted) instead of recomputing them.
Freed blocks keep their hash and content until they are handed out again, least
recently freed first, so a recently finished prompt stays reusable as long as possible.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpush.errors import KVPushError

KV_LAYOUT = "kv_separate/NHD"


class OutOfBlocks(KVPushError):
    """The allocator has fewer free blocks than asked for."""


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    h = hashlib.sha256(parent or b"root")
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    num_blocks: int
    num_free: int
    num_cached: int  # blocks that carry a content hash (in use or free)
    prefix_queries: int  # blocks looked up in the prefix cache
    prefix_hits: int  # of those, found


class BlockAllocator:
    """Hands out block ids; one engine thread owns it."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._queries = 0
        self._hits = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(
                f"need {n} free KV blocks, have {len(self._free)} of {self.num_blocks}"
            )
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            old = self._hash_of.pop(block, None)
            if old is not None:
                del self._block_of[old]
            self._refs[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        # Freed in reverse, so a sequence's tail is evicted before its (more shareable) head.
        for block in reversed(blocks):
            if self._refs[block] <= 0:
                raise ValueError(f"block {block} freed twice")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    def lookup_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Take a reference on the longest run of cached blocks matching `hashes`."""
        found: list[int] = []
        for h in hashes:
            self._queries += 1
            block = self._block_of.get(h)
            if block is None:
                break
            self._hits += 1
            found.append(block)
        for block in found:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        return found

    def mark_cached(self, block: int, content_hash: bytes) -> None:
        """Record that `block` now holds the computed K/V for the content `content_hash`."""
        if self._hash_of.get(block) == content_hash:
            return
        if content_hash in self._block_of:
            return  # an identical block exists already; keep the first
        old = self._hash_of.pop(block, None)
        if old is not None:
            del self._block_of[old]
        self._hash_of[block] = content_hash
        self._block_of[content_hash] = block

    def statistics(self) -> AllocatorStats:
        return AllocatorStats(
            num_blocks=self.num_blocks,
            num_free=len(self._free),
            num_cached=len(self._hash_of),
            prefix_queries=self._queries,
            prefix_hits=self._hits,
        )


class PagedKVCache:
    """Per-layer K and V tensors `[num_blocks, block_size, kv_heads, head_dim]`."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(num_layers)
        ]

    def by_layer(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """`{"model.layers.N": (k, v)}` in layer order: what `register_kv_cache` takes."""
        return {f"model.layers.{i}": kv for i, kv in enumerate(self.layers)}

    @property
    def bytes_per_block(self) -> int:
        k = self.layers[0][0]
        return 2 * len(self.layers) * k[0].numel() * k.element_size()

    def read_blocks(self, blocks: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the given blocks of every layer (for tests and for in-process moves)."""
        index = torch.tensor(list(blocks), dtype=torch.long)
        return [(k[index].clone(), v[index].clone()) for k, v in self.layers]

    def write_blocks(
        self, blocks: Sequence[int], data: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        index = torch.tensor(list(blocks), dtype=torch.long)
        for (k, v), (dk, dv) in zip(self.layers, data, strict=True):
            k[index] = dk
            v[index] = dv
