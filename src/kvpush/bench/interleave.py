"""The local run: every mode at once, each in its own child processes, measured in turn,
round by round, so that each ratio pairs figures taken one right after the other.

Theory of operation. `run_bench` starts every local mode's children
(`kvpush.bench.runner`: a receiver and a sender, or memcpy's one) together; each allocates,
connects, runs its warm-up and reports ready, then waits on its pipe, spending no CPU.
In each of `workload.rounds` rounds the parent hands every size, then the 1-block latency
and rate runs, to each mode in turn, starting with a different mode each round, and
collects the batch's figures. On a host that other work shares, the load changes over
seconds; a pair of batches a few milliseconds apart sees the same load, so the ratio of
the pair is steady where two whole runs minutes apart are not. Every round's figures are
kept; `kvpush.bench.rounds` merges them and pairs them into ratios with their spread.
Then each mode's idle endpoint is measured, alone, and its children stop.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kvpush.bench import DEFAULT_MODES
from kvpush.bench.common import BenchFailed
from kvpush.bench.rounds import merge_rounds
from kvpush.bench.runner import (
    PIPE_TIMEOUT_S,
    ChildSpec,
    ModeRun,
    ProgressFn,
    empty_result,
    finish_report,
    memcpy_main,
    new_report,
    receiver_main,
    sender_main,
    stop_children,
)
from kvpush.bench.workload import Workload, plans


def _local_children(mode: str, workload: Workload) -> Callable[[Connection], list[ChildSpec]]:
    def children(report: Connection) -> list[ChildSpec]:
        if mode == "memcpy":
            return [(memcpy_main, (workload, report))]
        rx_end, tx_end = mp.get_context("spawn").Pipe()
        return [
            (receiver_main, (mode, workload, rx_end)),
            (sender_main, (mode, workload, tx_end, report)),
        ]

    return children


class _Running:
    """One mode of an interleaved run: its children, our end of its pipe, its result,
    and each plan's figures round by round."""

    def __init__(self, mode: str, workload: Workload) -> None:
        self.mode = mode
        self.result = empty_result(mode)
        self.by_label: dict[str, list[tuple[dict[str, Any], list[float]]]] = {}
        ctx = mp.get_context("spawn")
        self.conn, child_end = ctx.Pipe()
        self.procs: list[mp.process.BaseProcess] = [
            ctx.Process(target=fn, args=args)
            for fn, args in _local_children(mode, workload)(child_end)
        ]
        for p in self.procs:
            p.start()
        child_end.close()

    @property
    def ok(self) -> bool:
        return bool(self.result["status"] == "ok")

    def ask(self, order: tuple[Any, ...] | None, want: str, timeout: float) -> Any:
        """Send `order` (if any) and return the answer of kind `want`; a skip, failure,
        dead child or timeout ends the mode (its status says which) and returns None."""
        try:
            if order is not None:
                self.conn.send(order)
            end = time.monotonic() + timeout
            while True:
                if self.conn.poll(0.2):
                    msg = self.conn.recv()
                    if msg[0] == want:
                        return msg
                    if msg[0] == "skipped":
                        self.end("skipped", msg[1])
                        return None
                    if msg[0] == "error":
                        self.end("failed", msg[1])
                        return None
                    continue
                if time.monotonic() > end:
                    raise BenchFailed(f"{self.mode}: no {want!r} within {timeout:.0f} s")
                dead = [p for p in self.procs if not p.is_alive()]
                if dead and not self.conn.poll(0.5):
                    raise BenchFailed(
                        f"a {self.mode} child process exited (status {dead[0].exitcode})"
                    )
        except (BenchFailed, OSError, EOFError) as exc:
            self.end("failed", str(exc))
            return None

    def end(self, status: str, reason: str | None) -> None:
        """Record how the mode ended (unless it already had) and stop its children."""
        if status != "ok" and self.ok:
            self.result |= {"status": status, "reason": reason}
        stop_children(self.procs)
        self.procs = []
        self.conn.close()


def run_interleaved(
    workload: Workload,
    modes: tuple[str, ...],
    on_progress: ProgressFn | None = None,
    total_steps: int = 0,
) -> list[dict[str, Any]]:
    """Every mode at once, each in its own child processes, measured in turn: in each of
    `workload.rounds` rounds, every size (then the 1-block latency and rate runs) goes to
    each mode, one right after the other, starting with a different mode each round. A
    mode's results are its rounds merged (`rounds.merge_rounds`); a mode that cannot run
    or fails is reported so and leaves the others running."""
    running: list[_Running] = []
    step = 0

    def progress(label: str) -> None:
        nonlocal step
        step += 1
        if on_progress is not None:
            on_progress(label, step, total_steps)

    try:
        running = [_Running(mode, workload) for mode in modes]
        for r in running:
            progress(f"{r.mode} setup")
            r.ask(None, "ready", PIPE_TIMEOUT_S * 2)
        labels = [p.label for p in plans(workload) if p.label != "warmup"]
        for round_index in range(workload.rounds):
            turn = round_index % max(1, len(running))
            for label in labels:
                for r in running[turn:] + running[:turn]:
                    progress(f"{round_index + 1}/{workload.rounds} {r.mode} {label}")
                    if not r.ok:
                        continue
                    msg = r.ask(("plan", label, round_index), "batch", PIPE_TIMEOUT_S * 2)
                    if msg is not None:
                        r.by_label.setdefault(label, []).append((msg[1], msg[2]))
        for r in running:
            progress(f"{r.mode} idle")
            if r.ok:
                msg = r.ask(("idle",), "idle", PIPE_TIMEOUT_S)
                if msg is not None:
                    r.result["idle_cpu_percent"] = msg[1]
            if r.ok:
                r.ask(("stop",), "finished", PIPE_TIMEOUT_S)
    finally:
        for r in running:
            if r.procs:
                r.end("ok", None)
    for r in running:
        for label, per_round in r.by_label.items():
            merged = merge_rounds(per_round)
            if label in ("rate", "latency"):
                r.result[label] = merged
            else:
                r.result["sizes"].append(merged)
    return [r.result for r in running]


def interleaved_steps(workload: Workload, modes: int) -> int:
    """Progress steps of `run_interleaved`: set-ups, every round's batches, idles."""
    batches = len(plans(workload)) - 1  # all but the warm-up
    return modes * (2 + workload.rounds * batches)


def run_bench(
    workload: Workload,
    modes: tuple[str, ...] = DEFAULT_MODES,
    on_progress: ProgressFn | None = None,
    instead: dict[str, list[ModeRun]] | None = None,
) -> dict[str, Any]:
    """Every mode on the same workload; the report as a JSON-ready dict. The local modes
    run interleaved (`run_interleaved`); `instead` maps a mode to the runs that replace
    it (`--shapes` replaces kvpush), which run one after the other, after them."""
    instead = instead or {}
    local = tuple(m for m in modes if m not in instead)
    others = [run for m in modes for run in instead.get(m, [])]
    step = interleaved_steps(workload, len(local))
    total = step + sum(r.steps for r in others)
    report = new_report(workload)
    results: dict[str, dict[str, Any]] = {}
    if local:
        results |= zip(local, run_interleaved(workload, local, on_progress, total), strict=True)
    for run in others:
        results[run.mode] = run.run(on_progress, step, total)
        step += run.steps
    for m in modes:
        report["modes"] += [results[r.mode] for r in instead[m]] if m in instead else [results[m]]
    return finish_report(report)
