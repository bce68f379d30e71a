"""The local run: every mode at once, each in its own child processes, measured in turn,
round by round, so that each ratio pairs figures taken one right after the other.

Theory of operation. `run_bench` starts every local mode's children
(`kvpush.bench.runner`: a receiver and a sender, or memcpy's one) together; each allocates,
connects, runs its warm-up and reports ready, then waits on its pipe, spending no CPU.
The parent then runs a warm-up round (one window of every plan, on every mode, its
figures discarded), then `workload.rounds` counted rounds. In each round it hands every
size, then the 1-block latency and rate runs, to each mode in turn (`round_order`): the
modes' order is reversed from one round to the next (A B, B A, A B, ...), so that no mode
of a pair always runs first, and a load that rises or falls through a run weighs on both
alike. On a host that other work shares, the load changes over seconds; a pair of batches
a few milliseconds apart sees about the same load, where two whole runs minutes apart may
not; many short rounds, rather than a few long ones, let the median of the pairs step
over the rounds that a burst of other work hit. A ratio still depends on the load when
one mode's speed does (nixl-raw's polling processes need a core each): the report gives
the load at both ends of the run (docs/benchmarks.md, "Interleaved rounds"). Every counted
round's figures are kept; `kvpush.bench.rounds` merges them and pairs them into ratios
with their spread. Then each mode's idle endpoint is measured, alone, and its children
stop.

Each mode's children are pinned, one per CPU (`pin_one_per_cpu`): every mode's receiver
on one core and its sender on another, where the host has two. Left to the scheduler, a side's
threads moved between cores from run to run, and five `--quick` runs in a row disagreed
by up to 24 % on a ratio's median at a quiet hour; pinned, within 9 % (docs/benchmarks.md,
"Third pass").
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, Protocol, TypeVar

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

T = TypeVar("T")


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


class ModeProcesses(Protocol):
    """One mode of an interleaved run as the parent drives it: its result, filled as it
    goes, and its orders (`kvpush.bench.runner.serve_orders`) and their answers. The
    child processes are one implementation (`ChildProcesses`); a test may inject another."""

    mode: str
    result: dict[str, Any]

    @property
    def ok(self) -> bool: ...

    def ask(self, order: tuple[Any, ...] | None, want: str, timeout: float) -> Any:
        """Send `order` (if any) and return the answer of kind `want`; a skip, failure,
        dead child or timeout ends the mode (its status says which) and returns None."""

    def end(self, status: str, reason: str | None) -> None:
        """Record how the mode ended (unless it already had) and stop it; idempotent."""


StartMode = Callable[[str, Workload], ModeProcesses]


def pin_one_per_cpu(procs: Sequence[mp.process.BaseProcess]) -> None:
    """Each of a mode's children on a CPU of its own, the same ones for every mode (the
    module says why); nothing where the host lets us use fewer than two."""
    if not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return
    for i, p in enumerate(procs):
        if p.pid is not None:
            with contextlib.suppress(OSError):  # gone already: its pipe says so
                os.sched_setaffinity(p.pid, {cpus[i % len(cpus)]})


class ChildProcesses:
    """One mode of an interleaved run in its own child processes: our end of its pipe,
    and its result."""

    def __init__(self, mode: str, workload: Workload) -> None:
        self.mode = mode
        self.result = empty_result(mode)
        ctx = mp.get_context("spawn")
        self.conn, child_end = ctx.Pipe()
        self.procs: list[mp.process.BaseProcess] = [
            ctx.Process(target=fn, args=args)
            for fn, args in _local_children(mode, workload)(child_end)
        ]
        for p in self.procs:
            p.start()
        pin_one_per_cpu(self.procs)
        child_end.close()

    @property
    def ok(self) -> bool:
        return bool(self.result["status"] == "ok")

    def ask(self, order: tuple[Any, ...] | None, want: str, timeout: float) -> Any:
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
        if status != "ok" and self.ok:
            self.result |= {"status": status, "reason": reason}
        if self.procs:
            stop_children(self.procs)
            self.procs = []
            self.conn.close()


def round_order(modes: Sequence[T], round_index: int) -> list[T]:
    """The order in which the modes take their turn in counted round `round_index` (from
    0): as given in even rounds, reversed in odd ones. Each pair of modes thus runs in
    both orders equally often (one more time as given, over an odd number of rounds), and
    modes given next to each other (nixl-raw, kvpush) are always one right after the
    other."""
    return list(modes) if round_index % 2 == 0 else list(reversed(modes))


def run_interleaved(
    workload: Workload,
    modes: tuple[str, ...],
    on_progress: ProgressFn | None = None,
    total_steps: int = 0,
    start: StartMode = ChildProcesses,
) -> list[dict[str, Any]]:
    """Every mode at once, measured in turn: a warm-up round (one window of each plan,
    its figures discarded), then `workload.rounds` rounds in which every size (then the
    1-block latency and rate runs) goes to each mode one right after the other, in
    `round_order`. A mode's results are its counted rounds merged
    (`rounds.merge_rounds`); a mode that cannot run or fails is reported so and leaves
    the others running."""
    running: list[ModeProcesses] = []
    by_label: dict[str, dict[str, list[tuple[dict[str, Any], list[float]]]]] = {}
    step = 0

    def progress(label: str) -> None:
        nonlocal step
        step += 1
        if on_progress is not None:
            on_progress(label, step, total_steps)

    def batch(r: ModeProcesses, label: str, round_index: int, limit: int | None) -> Any:
        return r.ask(("plan", label, round_index, limit), "batch", PIPE_TIMEOUT_S * 2)

    try:
        for mode in modes:
            running.append(start(mode, workload))
        for r in running:
            progress(f"{r.mode} setup")
            r.ask(None, "ready", PIPE_TIMEOUT_S * 2)
        # label -> one window: the transfers a plan has in flight at once.
        windows = {p.label: p.inflight or workload.inflight for p in plans(workload)}
        labels = [label for label in windows if label != "warmup"]
        # The warm-up round: each plan's first window, with the tags of round 0 (counted
        # rounds are 1..rounds), in the first round's order.
        for label in labels:
            for r in round_order(running, 0):
                progress(f"warm-up {r.mode} {label}")
                if r.ok:
                    batch(r, label, 0, windows[label])
        for k in range(workload.rounds):
            for label in labels:
                for r in round_order(running, k):
                    progress(f"{k + 1}/{workload.rounds} {r.mode} {label}")
                    if not r.ok:
                        continue
                    msg = batch(r, label, k + 1, None)
                    if msg is not None:
                        by_label.setdefault(r.mode, {}).setdefault(label, []).append(
                            (msg[1], msg[2])
                        )
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
            r.end("ok", None)
    for r in running:
        for label, per_round in by_label.get(r.mode, {}).items():
            merged = merge_rounds(per_round)
            if label in ("rate", "latency"):
                r.result[label] = merged
            else:
                r.result["sizes"].append(merged)
    return [r.result for r in running]


def interleaved_steps(workload: Workload, modes: int) -> int:
    """Progress steps of `run_interleaved`: set-ups, the warm-up round, every counted
    round's batches, idles."""
    batches = len(plans(workload)) - 1  # all but the warm-up
    return modes * (2 + (workload.rounds + 1) * batches)


def run_bench(
    workload: Workload,
    modes: tuple[str, ...] = DEFAULT_MODES,
    on_progress: ProgressFn | None = None,
    instead: dict[str, list[ModeRun]] | None = None,
    start: StartMode = ChildProcesses,
) -> dict[str, Any]:
    """Every mode on the same workload; the report as a JSON-ready dict. The local modes
    run interleaved (`run_interleaved`, each started by `start`); `instead` maps a mode
    to the runs that replace it (`--shapes` replaces kvpush), which run one after the
    other, after them."""
    instead = instead or {}
    local = tuple(m for m in modes if m not in instead)
    others = [run for m in modes for run in instead.get(m, [])]
    step = interleaved_steps(workload, len(local))
    total = step + sum(r.steps for r in others)
    report = new_report(workload)
    results: dict[str, dict[str, Any]] = {}
    if local:
        results |= zip(
            local, run_interleaved(workload, local, on_progress, total, start), strict=True
        )
    for run in others:
        results[run.mode] = run.run(on_progress, step, total)
        step += run.steps
    for m in modes:
        report["modes"] += [results[r.mode] for r in instead[m]] if m in instead else [results[m]]
    return finish_report(report)
