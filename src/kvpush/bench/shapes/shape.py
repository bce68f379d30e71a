"""What a shape is (`Shape`, `parse_shapes`) and what each of its ranks holds: the
model's seeded KV, head by head, and the transfers of a batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvpush.bench.workload import Transfer, Workload
from kvpush.errors import ConfigError
from kvpush.topology import (
    EngineShape,
    UnsupportedShape,
    plan_transfer,
    transfer_parts,
)

HOST = "127.0.0.1"
# vLLM's CPU attention layout: one tensor per layer, each block one run of
# `[heads, tokens, K|V]`, so one head of a block is one run of bytes.
LAYOUT = "vllm_packed/BHNC"


@dataclass(frozen=True, slots=True)
class Shape:
    """A deployment shape: the prefill engine's and the decode engine's TP sizes."""

    prefill_tp: int
    decode_tp: int

    @property
    def mode(self) -> str:
        """The shape's entry in a report, e.g. `kvpush tp2:1`."""
        return f"kvpush tp{self.prefill_tp}:{self.decode_tp}"

    @property
    def ranks(self) -> int:
        return self.prefill_tp + self.decode_tp

    def describe(self, workload: Workload) -> dict[str, object]:
        return {
            "prefill_tp": self.prefill_tp,
            "decode_tp": self.decode_tp,
            "kv_heads": workload.kv_heads,
            "layout": LAYOUT,
            "parts_per_transfer": len(transfer_parts("x", self.prefill_tp, self.decode_tp)),
            "processes": self.ranks,
        }


def parse_shapes(text: str, workload: Workload) -> tuple[Shape, ...]:
    """`1:1,2:1` -> shapes (prefill TP:decode TP), each one the workload's model can run;
    `ConfigError` (naming the shape) otherwise."""
    shapes: list[Shape] = []
    for item in (s.strip() for s in text.split(",")):
        p, sep, d = item.partition(":")
        if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
            raise ConfigError(
                f"--shapes {text!r}: expected comma-separated PREFILL_TP:DECODE_TP pairs "
                f"such as 1:1,2:1, got {item!r}"
            )
        shape = Shape(int(p), int(d))
        if shape in shapes:
            raise ConfigError(f"--shapes {text!r}: {item} is listed twice")
        shapes.append(shape)
    natural = workload.block_size_tokens * workload.kv_heads * workload.head_dim
    if workload.block_bytes != natural * workload.dtype_bytes:
        raise ConfigError(
            f"--shapes splits blocks by KV heads, so it needs the preset's own block "
            f"({workload.kv_heads} KV heads of {workload.head_dim}): leave out --block-bytes"
        )
    for shape in shapes:
        try:
            plan_transfer(
                prefill=EngineShape(shape.prefill_tp, workload.block_size_tokens),
                decode=EngineShape(shape.decode_tp, workload.block_size_tokens),
                total_kv_heads=workload.kv_heads,
                replicated_kv=False,
                bytes_per_head_per_block=head_bytes(workload),
            )
        except UnsupportedShape as exc:
            raise ConfigError(f"--shapes {shape.prefill_tp}:{shape.decode_tp}: {exc}") from None
    return tuple(shapes)


def head_bytes(workload: Workload) -> int:
    """One KV head of one block of one layer: its tokens' K and V, packed."""
    return workload.block_size_tokens * 2 * workload.head_dim * workload.dtype_bytes


def model_layer(workload: Workload, layer: int) -> npt.NDArray[np.uint8]:
    """The model's KV of one layer, every head, `[blocks, heads, head bytes]`: seeded
    random bytes, the same in every process."""
    w = workload
    rng = np.random.default_rng([w.seed, layer])
    raw = rng.bytes(w.num_blocks * w.kv_heads * head_bytes(w))
    return np.frombuffer(raw, dtype=np.uint8).reshape(w.num_blocks, w.kv_heads, head_bytes(w))


def transfer_id(tag: int) -> str:
    return f"bench-{tag}"


def slots(transfers: Sequence[Transfer]) -> list[Transfer]:
    """One transfer per distinct destination slot, for checksums."""
    seen: dict[tuple[int, ...], Transfer] = {}
    for t in transfers:
        seen.setdefault(t.dst_blocks, t)
    return list(seen.values())
