"""`kvpush bench --shapes`: kvpush between engines of different tensor parallelism.

Theory of operation. A shape `P:D` runs a prefill engine of P ranks and a decode engine
of D ranks, every rank its own fresh "spawn" process with its own `kvpush.node.Rank`
over NIXL, as a vLLM deployment runs them. Both engines hold one model's KV cache: the
preset's KV heads, split over each engine's ranks by `kvpush.topology.rank_heads`, in
vLLM's packed layout (one region per layer, each block `[heads, tokens, K|V]`: heads
outermost), registered by `register_vllm_kv_caches` with the rank's `KVHeads`. So
every (prefill rank, decode rank) pair moves the heads `kvpush.topology` gives it; at
1:1 the same layout moves whole blocks, which makes 1:1 the baseline of the same bytes.
Rank 0 of each engine serves its engine's side channel (a `MetadataServer`, as vLLM's
scheduler process does) with the metadata of every rank of its engine.

Prefill rank 0 leads, over one pipe to every other rank. For each batch: every decode
rank zeroes its destination blocks and registers each part of each transfer that comes
to it (`kvpush.topology.transfer_parts`); every prefill rank waits, untimed, until its
parts are registered; then the lead tells the other prefill ranks to go and starts its
own: each prefill rank sends its parts at once (at most `inflight` transfers open), so
the ranks of a TP 2 prefill write their halves of the heads into one decode rank
concurrently.

  GB/s = bytes landed in the decode engine's caches (the model's KV of the batch's
  blocks) / (last part received on any decode rank - first "blocks ready" on any
  prefill rank): the wall time of the whole batch, every part inside it.

Integrity is checked head by head: each prefill rank reports CRC-32 of every head it
holds over each transfer's source blocks (layer by layer, block by block), each decode
rank the same over its destination blocks, and every head every decode rank holds must
match. Each rank's cache is cut from one seeded model cache, so a head that two ranks
hold is the same bytes on both.

The package, top to bottom: `lead` (prefill rank 0, which drives every batch and measures
it; `shape_runs`, the report's entries) over `rank` (one rank in its own process: its
cache, its `Rank`, and the orders it obeys) over `shape` (what a shape is and what each of
its ranks holds).
"""

from kvpush.bench.shapes.lead import run_shape, shape_runs
from kvpush.bench.shapes.shape import Shape, parse_shapes

__all__ = ["Shape", "parse_shapes", "run_shape", "shape_runs"]
