"""What the benchmark moves: a paged KV cache shaped like a real model's, and the plan of
transfers over it.

A cache has `layers` layers of two regions each (K and V, the `kv_separate` layout); block
`b` of a region is `block_bytes` contiguous bytes at `base + b * block_bytes`. Every mode
copies the same blocks through the same descriptor list: one descriptor per block per
region, in layer order, with block ids drawn from a seeded shuffle on each side (a paged
cache rarely hands out neighbouring blocks, so descriptors do not merge).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvpush.bench.presets import get_preset
from kvpush.errors import ConfigError

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB


# Bytes of one element, by the torch dtype names presets use. `ModelPreset`'s own byte
# counts ask torch, which would cost the bench's parent process seconds to import.
_ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
RATE_INFLIGHT = 8
# Tags of round r start at r * ROUND_TAGS, so that no two transfers of a mode share one.
ROUND_TAGS = 1_000_000
# Each round's batch of a size moves at least this many bytes, and its 1-block runs make
# at least this many transfers (the whole count, where that is fewer), whatever the
# number of rounds: a batch of a few milliseconds is one scheduler tick of a shared host,
# and its first window's start-up weighs on its median. Where a run's bytes were simply
# divided among its rounds, `--quick`'s batches at 2 MiB were six transfers (12 MiB,
# about 4 ms), and `--rounds 32` instead of 8 moved kvpush/nixl-raw's p50 at 512 KiB
# from 1.1 to 2.1: more rounds measured something else (docs/benchmarks.md, "Fifth
# pass").
ROUND_MIN_BYTES = 64 * MIB
ROUND_MIN_TRANSFERS = 64


@dataclass(frozen=True, slots=True)
class Workload:
    """The cache geometry both sides allocate, and the transfer sizes to sweep."""

    preset: str
    layers: int
    block_size_tokens: int
    block_bytes: int  # one block of one region (K or V of one layer)
    num_blocks: int  # blocks per region, on each side
    sizes_blocks: tuple[int, ...]  # transfer sizes, in blocks, ascending
    inflight: int  # transfers outstanding at once
    target_bytes_per_size: int  # each size runs until about this many bytes moved
    min_iters: int
    max_iters: int
    rate_transfers: int  # 1-block transfers for the control-plane rate
    idle_s: float
    latency_transfers: int = 200  # 1-block transfers, one at a time, for the latency row
    rate_inflight: int = RATE_INFLIGHT  # 1-block transfers outstanding in the rate run
    # A Python thread computing all the time in each process of a two-process mode, as
    # an engine's model loop does: every other thread that wakes waits for the GIL.
    busy_engine: bool = False
    # The local modes run interleaved: in each of `rounds` rounds, every mode runs each
    # size in turn (`kvpush.bench.interleave.run_interleaved`), with its share of the
    # transfers. Remote runs and `--shapes` runs take every round's transfers in one.
    rounds: int = 1
    seed: int = 20260101
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    dtype_bytes: int = 2

    @property
    def regions(self) -> int:
        return 2 * self.layers

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id stands for, over every region."""
        return self.regions * self.block_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size_tokens

    @property
    def cache_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    def iterations(self, blocks: int) -> int:
        """Transfers of `blocks` blocks in one round: enough to move one round's share of
        the target bytes and at least `ROUND_MIN_BYTES`, within `min_iters`..`max_iters`
        (small sizes get many, so that one descheduled moment does not decide a round's
        figure)."""
        size = blocks * self.bytes_per_block
        share = max(self.target_bytes_per_size / self.rounds, ROUND_MIN_BYTES)
        wanted = math.ceil(share / size)
        return max(self.min_iters, min(self.max_iters, wanted))

    def round_share(self, count: int) -> int:
        """One round's share of `count` 1-block transfers, at least `ROUND_MIN_TRANSFERS`
        of them (or all `count`, where that is fewer)."""
        return max(min(count, ROUND_MIN_TRANSFERS), math.ceil(count / self.rounds))

    def describe(self) -> dict[str, object]:
        return {
            "preset": self.preset,
            "layers": self.layers,
            "regions": self.regions,
            "block_size_tokens": self.block_size_tokens,
            "block_bytes": self.block_bytes,
            "bytes_per_block": self.bytes_per_block,
            "bytes_per_token": self.bytes_per_token,
            "num_blocks": self.num_blocks,
            "cache_bytes_per_side": self.cache_bytes,
            "sizes_bytes": [b * self.bytes_per_block for b in self.sizes_blocks],
            "inflight": self.inflight,
            "rate_transfers": self.rate_transfers,
            "rate_inflight": self.rate_inflight,
            "latency_transfers": self.latency_transfers,
            "busy_engine": self.busy_engine,
            "rounds": self.rounds,
            "idle_s": self.idle_s,
            "seed": self.seed,
        }


def parse_size(text: str) -> int:
    """`4096`, `32K`, `64M`, `1G` (binary units) -> bytes."""
    units = {"": 1, "B": 1, "K": KIB, "KB": KIB, "KIB": KIB, "M": MIB, "MB": MIB}
    units |= {"MIB": MIB, "G": GIB, "GB": GIB, "GIB": GIB}
    s = text.strip().upper()
    digits = s.rstrip("KMGIB")
    unit = s[len(digits) :]
    try:
        value = float(digits)
    except ValueError:
        raise ConfigError(
            f"bad size {text!r}: expected a number with K, M or G (e.g. 64M)"
        ) from None
    if unit not in units or value <= 0:
        raise ConfigError(f"bad size {text!r}: expected a positive number with K, M or G")
    return int(value * units[unit])


def make_workload(
    *,
    preset: str = "llama-3.1-8b",
    layers: int | None = None,
    block_size_tokens: int | None = None,
    block_bytes: int | None = None,
    context_tokens: int | None = None,
    max_size_bytes: int | None = None,
    sizes_bytes: list[int] | None = None,
    inflight: int = 4,
    quick: bool = False,
    busy_engine: bool = False,
    rounds: int = 1,
) -> Workload:
    """Build a workload from a `kvpush.bench.presets` preset (its layers, KV heads, head dim,
    dtype and block size) and overrides; raises `ConfigError` on bad values."""
    model = get_preset(preset)
    elem = _ELEMENT_BYTES.get(model.dtype)
    if elem is None:
        raise ConfigError(f"preset {preset!r}: the bench does not know dtype {model.dtype!r}")
    if layers is None:
        layers = 8 if quick else model.num_layers
    if layers <= 0 or layers > model.num_layers * 4:
        raise ConfigError(f"--layers {layers} out of range: expected 1..{model.num_layers * 4}")
    if block_size_tokens is None:
        block_size_tokens = model.block_size_tokens
    if block_size_tokens <= 0:
        raise ConfigError(f"--block-size {block_size_tokens}: expected a positive token count")
    natural = block_size_tokens * model.num_kv_heads * model.head_dim * elem
    if block_bytes is None:
        block_bytes = natural
    if block_bytes <= 0 or block_bytes % (elem * block_size_tokens):
        raise ConfigError(
            f"--block-bytes {block_bytes}: expected a positive multiple of "
            f"{elem * block_size_tokens} ({block_size_tokens} tokens of {elem}-byte values)"
        )
    if inflight <= 0 or inflight > 256:
        raise ConfigError(f"--inflight {inflight}: expected 1..256")
    if rounds <= 0 or rounds > 100:
        raise ConfigError(f"--rounds {rounds}: expected 1..100")
    per_block = 2 * layers * block_bytes
    if context_tokens is not None:
        if context_tokens < block_size_tokens:
            raise ConfigError(
                f"--context {context_tokens} tokens is less than one block "
                f"({block_size_tokens} tokens)"
            )
        max_size_bytes = math.ceil(context_tokens / block_size_tokens) * per_block
    if sizes_bytes:
        blocks_list = sorted({max(1, round(s / per_block)) for s in sizes_bytes})
    else:
        top = max_size_bytes if max_size_bytes is not None else (64 * MIB if quick else GIB)
        top_blocks = max(1, math.ceil(top / per_block))
        blocks_list = []
        b = 1
        while b < top_blocks:
            blocks_list.append(b)
            b *= 4
        blocks_list.append(top_blocks)
    largest = blocks_list[-1]
    if largest * per_block > 4 * GIB:
        raise ConfigError(
            f"largest transfer {largest * per_block / GIB:.1f} GiB exceeds 4 GiB per side: "
            "lower --max-size, --context or --layers"
        )
    # Enough blocks for the largest transfer, and for `inflight` distinct 1-block slots.
    num_blocks = max(largest, inflight * 4, RATE_INFLIGHT * 4, 16)
    return Workload(
        preset=preset,
        layers=layers,
        block_size_tokens=block_size_tokens,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        sizes_blocks=tuple(blocks_list),
        inflight=inflight,
        target_bytes_per_size=(96 * MIB) if quick else (2 * GIB),
        min_iters=1 if quick else 3,
        max_iters=128 if quick else 200,
        rate_transfers=300 if quick else 1000,
        idle_s=1.0 if quick else 3.0,
        latency_transfers=200 if quick else 300,
        busy_engine=busy_engine,
        rounds=rounds,
        kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=model.dtype,
        dtype_bytes=elem,
    )


@dataclass(frozen=True, slots=True)
class Transfer:
    """One transfer: `src_blocks[i]` on the sender lands in `dst_blocks[i]` on the receiver."""

    tag: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]


@dataclass(slots=True)
class Plan:
    """The transfers of one batch (one size), with their slots for verification."""

    label: str
    blocks: int
    transfers: list[Transfer] = field(default_factory=list)
    inflight: int | None = None  # None: the workload's

    @property
    def slots(self) -> list[Transfer]:
        """One transfer per distinct destination slot, for checksums."""
        seen: dict[tuple[int, ...], Transfer] = {}
        for t in self.transfers:
            seen.setdefault(t.dst_blocks, t)
        return list(seen.values())


def make_plan(workload: Workload, label: str, blocks: int, count: int, first_tag: int) -> Plan:
    """`count` transfers of `blocks` blocks, spread over as many disjoint slots as fit."""
    rng = random.Random(workload.seed + blocks)
    src_perm = list(range(workload.num_blocks))
    dst_perm = list(range(workload.num_blocks))
    rng.shuffle(src_perm)
    rng.shuffle(dst_perm)
    nslots = max(1, min(count, workload.num_blocks // blocks))
    plan = Plan(label=label, blocks=blocks)
    for i in range(count):
        s = i % nslots
        plan.transfers.append(
            Transfer(
                tag=first_tag + i,
                src_blocks=tuple(src_perm[s * blocks : (s + 1) * blocks]),
                dst_blocks=tuple(dst_perm[s * blocks : (s + 1) * blocks]),
            )
        )
    return plan


def plans(workload: Workload, round_index: int = 0) -> list[Plan]:
    """Warm-up, every size, then the 1-block runs: latency (one in flight) and the
    control-plane rate (`rate_inflight` in flight). Each is one round's share of its
    transfers (all of them when `workload.rounds` is 1); round `round_index` has tags of
    its own, and the same blocks as every other round."""
    base = round_index * ROUND_TAGS
    out = [make_plan(workload, "warmup", 1, max(4, workload.inflight), first_tag=base + 1)]
    tag = base + 1000
    for blocks in workload.sizes_blocks:
        count = workload.iterations(blocks)
        out.append(make_plan(workload, f"size:{blocks}", blocks, count, first_tag=tag))
        tag += count
    count = workload.round_share(workload.latency_transfers)
    latency = make_plan(workload, "latency", 1, count, first_tag=tag)
    latency.inflight = 1
    out.append(latency)
    tag += count
    count = workload.round_share(workload.rate_transfers)
    rate = make_plan(workload, "rate", 1, count, first_tag=tag)
    rate.inflight = workload.rate_inflight
    out.append(rate)
    return out


class CacheBuffers:
    """One side's KV regions: one page-aligned numpy allocation per region."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.regions: list[npt.NDArray[np.uint8]] = []

    def allocate(self, fill_seed: int | None) -> None:
        """Allocate every region; fill with seeded random bytes, or zeros if no seed."""
        w = self.workload
        rng = np.random.default_rng(fill_seed) if fill_seed is not None else None
        for _ in range(w.regions):
            if rng is None:
                arr = np.zeros((w.num_blocks, w.block_bytes), dtype=np.uint8)
            else:
                arr = np.frombuffer(rng.bytes(w.num_blocks * w.block_bytes), dtype=np.uint8)
                arr = arr.reshape(w.num_blocks, w.block_bytes).copy()
            self.regions.append(arr)

    def bases(self) -> list[int]:
        return [int(r.ctypes.data) for r in self.regions]

    def zero(self, blocks: tuple[int, ...]) -> None:
        idx = np.asarray(blocks, dtype=np.int64)
        for r in self.regions:
            r[idx] = 0

    def checksum(self, blocks: tuple[int, ...]) -> int:
        """CRC-32 over the given blocks, region by region, in descriptor order."""
        import zlib

        crc = 0
        for r in self.regions:
            for b in blocks:
                crc = zlib.crc32(r[b].data, crc)
        return crc


def descriptor_arrays(
    workload: Workload,
    src_bases: list[int],
    dst_bases: list[int],
    transfer: Transfer,
    dst_strides: list[int] | None = None,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Nx3 (address, length, device id) arrays for the source and destination sides.

    Blocks are `block_bytes` apart on our side; on the destination they are
    `dst_strides[r]` apart in region `r` when given (a remote endpoint's layout).
    """
    bb = workload.block_bytes
    src_idx = np.asarray(transfer.src_blocks, dtype=np.int64) * bb
    dst_ids = np.asarray(transfer.dst_blocks, dtype=np.int64)
    n = len(transfer.src_blocks) * len(src_bases)
    src = np.zeros((n, 3), dtype=np.int64)
    dst = np.zeros((n, 3), dtype=np.int64)
    nb = len(transfer.src_blocks)
    for r, (sb, db) in enumerate(zip(src_bases, dst_bases, strict=True)):
        stride = bb if dst_strides is None else dst_strides[r]
        src[r * nb : (r + 1) * nb, 0] = sb + src_idx
        dst[r * nb : (r + 1) * nb, 0] = db + dst_ids * stride
    src[:, 1] = bb
    dst[:, 1] = bb
    return src, dst
