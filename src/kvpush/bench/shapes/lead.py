"""Prefill rank 0, the lead: it sets both engines up, drives every batch and measures it
(`_Lead`); and the report's entries, one per shape (`shape_runs`)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

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
from kvpush.bench.shapes.rank import ShapeRank, counts_since, rank_main
from kvpush.bench.shapes.shape import Shape, slots, transfer_id
from kvpush.bench.workload import Plan, Workload, plans
from kvpush.stats import percentile
from kvpush.topology import (
    rank_heads,
    transfer_parts,
)


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
            specs.append((rank_main, (shape, workload, "prefill", k, end)))
        for d, (_, end) in enumerate(decode):
            specs.append((rank_main, (shape, workload, "decode", d, end)))
        return specs

    return run_children(
        shape.mode,
        children,
        on_progress=on_progress,
        step_offset=step_offset,
        total_steps=total_steps,
        deadline_s=deadline_s,
    )


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
