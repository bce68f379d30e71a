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
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpush.bench.common import BenchFailed, ModeUnavailable, check_deadline
from kvpush.bench.runner import (
    PIPE_TIMEOUT_S,
    ChildSpec,
    Measured,
    ModeRun,
    ProgressFn,
    child_process,
    close_quietly,
    cpu_seconds,
    measure_plans,
    recv_message,
    run_children,
    start_busy_engine,
)
from kvpush.bench.workload import Plan, Transfer, Workload, plans
from kvpush.errors import ConfigError
from kvpush.stats import percentile
from kvpush.topology import (
    EngineShape,
    RankHeads,
    UnsupportedShape,
    plan_transfer,
    rank_heads,
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


def shape_runs(shapes: Sequence[Shape], workload: Workload) -> list[ModeRun]:
    """One report entry per shape; every shape after the first is compared with it."""
    runs: list[ModeRun] = []
    for shape in shapes:
        base = shapes[0].mode if shape != shapes[0] else None

        def run(
            on_progress: ProgressFn | None,
            step_offset: int,
            total_steps: int,
            shape: Shape = shape,
            base: str | None = base,
        ) -> dict[str, Any]:
            result = run_shape(
                shape,
                workload,
                on_progress=on_progress,
                step_offset=step_offset,
                total_steps=total_steps,
            )
            result["shape"] = shape.describe(workload)
            if base is not None:
                result["vs"] = base
            return result

        runs.append(ModeRun(shape.mode, len(plans(workload)), run))
    return runs


def run_shape(
    shape: Shape,
    workload: Workload,
    *,
    on_progress: ProgressFn | None = None,
    step_offset: int = 0,
    total_steps: int = 0,
    deadline_s: float = 900.0,
) -> dict[str, Any]:
    """Run one shape in fresh processes (one per rank); never raises for its failure."""

    def children(report: Connection) -> list[ChildSpec]:
        ctx = mp.get_context("spawn")
        prefill = [ctx.Pipe() for _ in range(shape.prefill_tp - 1)]
        decode = [ctx.Pipe() for _ in range(shape.decode_tp)]
        lead_args = (shape, workload, report, [a for a, _ in prefill], [a for a, _ in decode])
        specs: list[ChildSpec] = [(_lead_main, lead_args)]
        for k, (_, end) in enumerate(prefill, start=1):
            specs.append((_rank_main, (shape, workload, "prefill", k, end)))
        for d, (_, end) in enumerate(decode):
            specs.append((_rank_main, (shape, workload, "decode", d, end)))
        return specs

    return run_children(
        shape.mode,
        children,
        on_progress=on_progress,
        step_offset=step_offset,
        total_steps=total_steps,
        deadline_s=deadline_s,
    )


# ----------------------------------------------------------------- one rank


def model_layer(workload: Workload, layer: int) -> npt.NDArray[np.uint8]:
    """The model's KV of one layer, every head, `[blocks, heads, head bytes]`: seeded
    random bytes, the same in every process."""
    w = workload
    rng = np.random.default_rng([w.seed, layer])
    raw = rng.bytes(w.num_blocks * w.kv_heads * head_bytes(w))
    return np.frombuffer(raw, dtype=np.uint8).reshape(w.num_blocks, w.kv_heads, head_bytes(w))


def transfer_id(tag: int) -> str:
    return f"bench-{tag}"


class ShapeRank:
    """One rank of one engine: its heads of the model's cache, a `Rank` over NIXL, and,
    on rank 0, the engine's side channel."""

    def __init__(self, workload: Workload, shape: Shape, role: str, rank: int) -> None:
        self.workload = workload
        self.shape = shape
        self.role = role  # "prefill" | "decode"
        self.rank = rank
        tp = shape.prefill_tp if role == "prefill" else shape.decode_tp
        self.tp = tp
        self.heads: RankHeads = rank_heads(rank, tp, workload.kv_heads, False)
        self.layers: list[npt.NDArray[np.uint8]] = []
        self.published: dict[int, Any] = {}
        self.server: Any = None
        self.node_rank: Any = None

    def allocate(self) -> None:
        """Prefill: our heads of the model's cache; decode: zeros."""
        w, h = self.workload, self.heads
        for layer in range(w.layers):
            if self.role == "prefill":
                arr = model_layer(w, layer)[:, h.first_head : h.stop].copy()
            else:
                arr = np.zeros((w.num_blocks, h.num_heads, head_bytes(w)), dtype=np.uint8)
            self.layers.append(arr)

    def geometry(self) -> Any:
        """Our cache as vLLM's worker registers it: packed tensors and our `KVHeads`."""
        try:
            import torch

            from kvpush.geometry import KVHeads
            from kvpush.integrations.vllm.kvcache import register_vllm_kv_caches
        except ImportError as exc:
            raise ModeUnavailable(f"not available: {exc}") from None
        w = self.workload
        dtype = getattr(torch, w.dtype)
        shape = (w.num_blocks, self.heads.num_heads, w.block_size_tokens, 2 * w.head_dim)
        tensors = {
            f"model.layers.{i}.self_attn.attn": torch.from_numpy(arr).view(dtype).view(shape)
            for i, arr in enumerate(self.layers)
        }
        heads = KVHeads(
            total=w.kv_heads, per_rank=self.heads.num_heads, tp_size=self.tp, tp_rank=self.rank
        )
        geometry = register_vllm_kv_caches(tensors, w.block_size_tokens, heads)
        if geometry.layout != LAYOUT:
            raise BenchFailed(f"registered layout {geometry.layout}, expected {LAYOUT}")
        return geometry

    def serve_side_channel(self) -> int:
        """Rank 0: bind the engine's side channel (port 0); its port."""
        from kvpush.config import SideChannelConfig
        from kvpush.sidechannel import MetadataServer

        self.server = MetadataServer(HOST, 0, SideChannelConfig(), self.published)
        self.server.start()
        return int(self.server.port)

    def start(self, port: int) -> Any:
        """Start our `Rank` (its metadata served on `port`); our metadata."""
        try:
            from kvpush.node import NodeIdentity, Rank, RankSettings, nixl_transport
            from kvpush.transports import nixl  # noqa: F401  (NIXL missing: mode unavailable)
        except ImportError as exc:
            raise ModeUnavailable(f"not available: {exc}") from None
        identity = NodeIdentity(
            f"bench-{self.role}", "sender" if self.role == "prefill" else "receiver", HOST
        )
        self.node_rank = Rank(
            self.geometry(),
            identity,
            port=port,
            rank=self.rank,
            settings=RankSettings(lookup_timeout_ms=2000),
            transport_factory=nixl_transport,
        )
        self.node_rank.start()
        meta = self.node_rank.metadata()
        if self.server is not None:
            self.published[self.rank] = meta
        return meta

    @property
    def runtime(self) -> Any:
        return self.node_rank.runtime

    def transport_counts(self) -> dict[str, int]:
        """The NIXL transport's counters (writes, descriptors after merging, bytes) and
        how often the runtime polled it."""
        from kvpush.transports.nixl import NixlTransport

        counts = {"polls": self.runtime.statistics().transport_polls}
        transport = self.node_rank.transport
        if isinstance(transport, NixlTransport):
            s = transport.statistics()
            counts |= {
                "writes": s.writes_posted,
                "descriptors": s.descriptors_posted,
                "bytes": s.bytes_posted,
            }
        return counts

    def parts(self, transfers: Sequence[Transfer]) -> dict[str, tuple[int, int]]:
        """Our parts of `transfers`: part id -> (tag, the other side's rank)."""
        ours: dict[str, tuple[int, int]] = {}
        for t in transfers:
            for p, d, pid in transfer_parts(transfer_id(t.tag), *self.tp_pair):
                if (p if self.role == "prefill" else d) == self.rank:
                    ours[pid] = (t.tag, d if self.role == "prefill" else p)
        return ours

    @property
    def tp_pair(self) -> tuple[int, int]:
        return self.shape.prefill_tp, self.shape.decode_tp

    def head_crcs(self, blocks: Sequence[int]) -> dict[int, int]:
        """Global head -> CRC-32 of that head over `blocks`, layer by layer."""
        out: dict[int, int] = {}
        for i in range(self.heads.num_heads):
            crc = 0
            for arr in self.layers:
                for b in blocks:
                    crc = zlib.crc32(arr[b, i].data, crc)
            out[self.heads.first_head + i] = crc
        return out

    def zero(self, blocks: Sequence[int]) -> None:
        idx = np.asarray(blocks, dtype=np.int64)
        for arr in self.layers:
            arr[idx] = 0

    def results(self, deadline: float, what: str) -> list[Any]:
        check_deadline(deadline, what)
        results = self.runtime.wait(timeout=0.2)
        for r in results:
            if not r.ok:
                raise BenchFailed(f"{what}: part {r.transfer_id} failed ({r.reason}): {r.detail}")
        return list(results)

    # ---- decode side

    def arm(self, transfers: Sequence[tuple[int, tuple[int, ...]]], prefill_port: int) -> Any:
        """Zero the destination blocks, register every part that comes to us; what
        `collect` waits for: part id -> tag."""
        from kvpush.runtime import PeerAddress

        for _, dst in transfers:
            self.zero(dst)
        expected: dict[str, int] = {}
        for tag, dst in transfers:
            for p, d, pid in transfer_parts(transfer_id(tag), *self.tp_pair):
                if d == self.rank:
                    self.runtime.receive(pid, PeerAddress(HOST, prefill_port, p), list(dst))
                    expected[pid] = tag
        return expected

    def collect(self, expected: dict[str, int], deadline: float) -> dict[str, int]:
        """Part id -> monotonic ns when that part to us was received."""
        done: dict[str, int] = {}
        while len(done) < len(expected):
            results = self.results(deadline, f"decode rank {self.rank}")
            now = time.monotonic_ns()
            for r in results:
                if r.transfer_id in expected:
                    done[r.transfer_id] = now
        return done

    # ---- prefill side

    def prepare(self, transfers: Sequence[Transfer], deadline: float) -> None:
        """Untimed: wait until the decode ranks' registrations of our parts reached us."""
        count = len(self.parts(transfers))
        while self.runtime.statistics().sending.get("registered", 0) < count:
            check_deadline(deadline, f"prefill rank {self.rank} waiting for registrations")
            time.sleep(0.001)

    def push(self, transfers: Sequence[Transfer], inflight: int, deadline: float) -> dict[int, int]:
        """`send()` our parts of every transfer, at most `inflight` transfers open; tag ->
        "blocks ready" for our parts (see `modes.Sender.run_batch`)."""
        parts: dict[int, list[str]] = {}
        for pid, (tag, _) in self.parts(transfers).items():
            parts.setdefault(tag, []).append(pid)
        submitted: dict[int, int] = {}
        pending = [t for t in reversed(transfers) if t.tag in parts]
        open_parts: dict[str, int] = {}
        open_count: dict[int, int] = {}
        while pending or open_parts:
            ready = time.monotonic_ns()
            while pending and len(open_count) < inflight:
                t = pending.pop()
                submitted[t.tag] = ready
                open_count[t.tag] = len(parts[t.tag])
                for pid in parts[t.tag]:
                    self.runtime.send(pid, list(t.src_blocks))
                    open_parts[pid] = t.tag
            for r in self.results(deadline, f"prefill rank {self.rank}"):
                if r.transfer_id not in open_parts:
                    continue
                tag = open_parts.pop(r.transfer_id)
                open_count[tag] -= 1
                if not open_count[tag]:
                    del open_count[tag]
        return submitted

    def close(self) -> None:
        if self.server is not None:
            close_quietly(self.server)
        if self.node_rank is not None:
            self.node_rank.close()


# ----------------------------------------------------------------- processes


def _rank_main(shape: Shape, workload: Workload, role: str, rank: int, lead: Connection) -> None:
    """Every rank but the lead: obeys the lead's orders on `lead` until told to stop."""
    with child_process(lead, prefix=f"{role} rank {rank}: ") as stack:
        if workload.busy_engine:
            start_busy_engine(stack)
        ours = ShapeRank(workload, shape, role, rank)
        stack.callback(close_quietly, ours)
        ours.allocate()
        if role == "decode" and rank == 0:
            lead.send(("port", ours.serve_side_channel()))
        _, port = recv_message(lead, PIPE_TIMEOUT_S, "the engine's side-channel port")
        lead.send(("meta", ours.start(port)))
        prefill_port = 0
        transfers: list[Transfer] = []
        while True:
            msg = recv_message(lead, PIPE_TIMEOUT_S * 5, f"{role} rank {rank} waiting for orders")
            if msg[0] == "publish":
                ours.published[msg[1]] = msg[2]
            elif msg[0] == "prefill-port":
                prefill_port = msg[1]
            elif msg[0] == "arm":
                expected = ours.arm(msg[1], prefill_port)
                lead.send(("armed",))
                before = ours.transport_counts()
                cpu0 = cpu_seconds()
                done = ours.collect(expected, time.monotonic() + PIPE_TIMEOUT_S)
                cpu = cpu_seconds() - cpu0
                polls = counts_since(before, ours)["polls"]
                crcs = {dst: ours.head_crcs(dst) for dst in {dst for _, dst in msg[1]}}
                lead.send(("done", done, cpu, polls, crcs))
            elif msg[0] == "prepare":
                transfers = msg[1]
                crcs = {t.dst_blocks: ours.head_crcs(t.src_blocks) for t in slots(transfers)}
                ours.prepare(transfers, time.monotonic() + PIPE_TIMEOUT_S)
                lead.send(("prepared", crcs))
            elif msg[0] == "go":
                before = ours.transport_counts()
                cpu0 = cpu_seconds()
                submitted = ours.push(transfers, msg[1], time.monotonic() + PIPE_TIMEOUT_S)
                cpu = cpu_seconds() - cpu0
                lead.send(("pushed", submitted, cpu, counts_since(before, ours)))
            elif msg[0] == "stop":
                break


def _lead_main(
    shape: Shape,
    workload: Workload,
    report: Connection,
    prefill: list[Connection],
    decode: list[Connection],
) -> None:
    """Prefill rank 0: sets both engines up, then drives every batch (module docstring)."""
    with child_process(report, prefix="prefill rank 0: ") as stack:
        if workload.busy_engine:
            start_busy_engine(stack)
        ours = ShapeRank(workload, shape, "prefill", 0)
        stack.callback(close_quietly, ours)
        for pipe in (*prefill, *decode):
            stack.callback(_stop, pipe)
        ours.allocate()
        prefill_port = ours.serve_side_channel()
        _, decode_port = recv_message(decode[0], PIPE_TIMEOUT_S, "the decode's side-channel port")
        for pipe in prefill:
            pipe.send(("port", prefill_port))
        for pipe in decode:
            pipe.send(("port", decode_port))
        ours.start(prefill_port)
        for k, pipe in enumerate(prefill, start=1):
            ours.published[k] = recv_message(pipe, PIPE_TIMEOUT_S, f"prefill rank {k}'s metadata")[
                1
            ]
        for d, pipe in enumerate(decode):
            meta = recv_message(pipe, PIPE_TIMEOUT_S, f"decode rank {d}'s metadata")[1]
            if d:
                decode[0].send(("publish", d, meta))
        for pipe in decode:
            pipe.send(("prefill-port", prefill_port))
        lead = _Lead(workload, ours, prefill, decode)
        measure_plans(workload, report, lead.measure)
        report.send(("finished",))


def _stop(pipe: Connection) -> None:
    with contextlib.suppress(OSError):
        pipe.send(("stop",))


def slots(transfers: Sequence[Transfer]) -> list[Transfer]:
    """One transfer per distinct destination slot, for checksums."""
    seen: dict[tuple[int, ...], Transfer] = {}
    for t in transfers:
        seen.setdefault(t.dst_blocks, t)
    return list(seen.values())


def counts_since(before: dict[str, int], rank: ShapeRank) -> dict[str, int]:
    after = rank.transport_counts()
    return {k: after[k] - before.get(k, 0) for k in after}


class _Lead:
    """The lead's half of a batch; the other ranks' halves are in `_rank_main`."""

    def __init__(
        self,
        workload: Workload,
        ours: ShapeRank,
        prefill: list[Connection],
        decode: list[Connection],
    ) -> None:
        self.workload = workload
        self.ours = ours
        self.prefill = prefill
        self.decode = decode

    def measure(self, plan: Plan) -> Measured:
        w, ours = self.workload, self.ours
        transfers = plan.transfers
        inflight = plan.inflight or w.inflight
        deadline = time.monotonic() + PIPE_TIMEOUT_S
        for pipe in self.decode:
            pipe.send(("arm", [(t.tag, t.dst_blocks) for t in transfers]))
        for d, pipe in enumerate(self.decode):
            recv_message(pipe, PIPE_TIMEOUT_S, f"decode rank {d} arming")
        for pipe in self.prefill:
            pipe.send(("prepare", transfers))
        src: dict[tuple[tuple[int, ...], int], int] = {}
        for t in slots(transfers):
            for head, crc in ours.head_crcs(t.src_blocks).items():
                src[(t.dst_blocks, head)] = crc
        ours.prepare(transfers, deadline)
        for k, pipe in enumerate(self.prefill, start=1):
            _, crcs = recv_message(pipe, PIPE_TIMEOUT_S, f"prefill rank {k} preparing")
            for slot, heads in crcs.items():
                for head, crc in heads.items():
                    src.setdefault((slot, head), crc)
        # The timed part: every prefill rank sends its parts at once.
        for pipe in self.prefill:
            pipe.send(("go", inflight))
        before = ours.transport_counts()
        cpu0 = cpu_seconds()
        ready = {0: ours.push(transfers, inflight, deadline)}  # prefill rank -> tag -> ns
        sender_cpu = cpu_seconds() - cpu0
        counts = counts_since(before, ours)
        for k, pipe in enumerate(self.prefill, start=1):
            _, ready[k], cpu, theirs = recv_message(
                pipe, PIPE_TIMEOUT_S, f"prefill rank {k} sending"
            )
            sender_cpu += cpu
            for key, n in theirs.items():
                counts[key] = counts.get(key, 0) + n
        received: dict[str, int] = {}  # part id -> ns
        receiver_cpu = 0.0
        receiver_polls = 0
        dst: dict[tuple[tuple[int, ...], int, int], int] = {}
        for d, pipe in enumerate(self.decode):
            _, done, cpu, polls, crcs = recv_message(
                pipe, PIPE_TIMEOUT_S, f"decode rank {d} receiving"
            )
            receiver_cpu += cpu
            receiver_polls += polls
            received |= done
            for slot, heads in crcs.items():
                for head, crc in heads.items():
                    dst[(slot, d, head)] = crc
        submitted: dict[int, int] = {}
        finished: dict[int, int] = {}
        latency: list[float] = []
        shape = ours.shape
        for t in transfers:
            parts = transfer_parts(transfer_id(t.tag), shape.prefill_tp, shape.decode_tp)
            submitted[t.tag] = min(ready[p][t.tag] for p, _, _ in parts)
            finished[t.tag] = max(received[pid] for _, _, pid in parts)
            latency.append(max(received[pid] - ready[p][t.tag] for p, _, pid in parts) / 1e3)
        extra = self._extra(plan, counts, src, dst)
        wall = max(max(finished.values()) - min(submitted.values()), 1) / 1e9
        # How often the runtimes polled NIXL (which moves only when polled), per second
        # of the batch, summed over each engine's ranks.
        extra["polls_per_s"] = {
            "prefill": counts.get("polls", 0) / wall,
            "decode": receiver_polls / wall,
        }
        # Each part from its own rank's "blocks ready": the ranks of a real engine are
        # ready together (one forward pass), while the bench's run their windows apart.
        extra |= {"p50_us": percentile(latency, 50), "p99_us": percentile(latency, 99)}
        return Measured(submitted, finished, sender_cpu, receiver_cpu, {}, {}, extra=extra)

    def _extra(
        self,
        plan: Plan,
        counts: dict[str, int],
        src: dict[tuple[tuple[int, ...], int], int],
        dst: dict[tuple[tuple[int, ...], int, int], int],
    ) -> dict[str, Any]:
        """What a shape adds to a batch's figures: NIXL's own counts of what the prefill
        ranks posted, and the checksums head by head."""
        keys = sorted(dst)
        want = [src.get((slot, head)) for slot, _, head in keys]
        got = [dst[k] for k in keys]
        n = len(plan.transfers)
        shape = self.ours.shape
        heads_held = sum(
            rank_heads(d, shape.decode_tp, self.workload.kv_heads, False).num_heads
            for d in range(shape.decode_tp)
        )
        complete = len(keys) == len(slots(plan.transfers)) * heads_held
        return {
            # Descriptors NIXL was handed per transfer, over every part, after merging
            # runs contiguous on both sides (the transport's count).
            "descriptors": counts.get("descriptors", 0) / n,
            "writes_per_transfer": counts.get("writes", 0) / n,
            "bytes_posted": counts.get("bytes", 0),
            "checksums": {
                "slots": len(slots(plan.transfers)),
                "heads": len(keys),
                "src": want,
                "dst": got,
                "match": complete and want == got,
            },
        }
