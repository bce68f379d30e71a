"""Every mode's child processes, what they measure, and the report they fill.

Theory of operation. For a two-process mode the parent spawns a receiver and a sender
(multiprocessing "spawn": no inherited NIXL or UCX state) joined by a pipe. The receiver
allocates its cache and hands its metadata to the sender over that pipe. For each batch
the sender tells the receiver which transfers to expect ("arm"); the receiver zeroes their
destination blocks and answers; the sender writes them all, at most `inflight` at once,
stamping each "blocks ready" time; the receiver stamps each "finished" time as it observes
completion, then checksums what landed. Both clocks are CLOCK_MONOTONIC on one host.

  aggregate GB/s = bytes of the batch / (last finished - first ready): wall time of the
  whole batch, never a sum of per-transfer rates.

Each side measures its own CPU time (getrusage, every thread of the process) across the
batch. A local mode's children run plans as the parent orders them (`serve_orders`; the
parent is `kvpush.bench.interleave`); `--shapes` and `--target` children run every plan
in turn (`measure_plans`), and `run_children` relays their progress. The parent kills
children that outlive their deadline.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import resource
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from kvpush.bench.common import BenchFailed, ModeUnavailable
from kvpush.bench.modes import MemcpyPair, factories, nixl_or_unavailable
from kvpush.bench.rounds import paired_ratios, ratios
from kvpush.bench.workload import Plan, Workload, plans
from kvpush.errors import KVPushError
from kvpush.stats import percentile

PIPE_TIMEOUT_S = 120.0
# How long an interleaved mode's child waits for its next order while the others run.
ORDER_TIMEOUT_S = 1800.0

ProgressFn = Callable[[str, int, int], None]
# A child process to start: its function and its arguments.
ChildSpec = tuple[Callable[..., None], tuple[Any, ...]]


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def recv_message(conn: Connection, timeout: float, what: str) -> Any:
    """The next message, or `BenchFailed` on timeout or when our parent is gone, so an
    orphaned child never waits out its whole timeout. A peer's skip (`ModeUnavailable`)
    or failure is raised here as ours."""
    end = time.monotonic() + timeout
    parent = mp.parent_process()
    while not conn.poll(min(0.5, max(0.0, end - time.monotonic()))):
        if time.monotonic() >= end:
            raise BenchFailed(f"no answer from the peer process within {timeout:.0f} s ({what})")
        if parent is not None and not parent.is_alive():
            raise BenchFailed(f"the bench process is gone ({what})")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "skipped":
        raise ModeUnavailable(msg[1])
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise BenchFailed(f"peer process failed: {msg[1]}")
    return msg


@dataclass(slots=True)
class Measured:
    """What one side measured of one batch; `batch_result` turns it into figures."""

    submitted: dict[int, int]  # tag -> "blocks ready", monotonic ns
    finished: dict[int, int]  # tag -> "finished", monotonic ns
    sender_cpu: float
    receiver_cpu: float | None
    src_crc: dict[tuple[int, ...], int]  # destination slot -> CRC of its source blocks
    dst_crc: dict[tuple[int, ...], int]  # destination slot -> CRC of what landed
    extra: dict[str, Any] = field(default_factory=dict)


def batch_result(workload: Workload, plan: Plan, m: Measured) -> dict[str, Any]:
    size = plan.blocks * workload.bytes_per_block
    total = size * len(plan.transfers)
    start = min(m.submitted.values())
    end = max(m.finished.values())
    wall = max(end - start, 1) / 1e9
    lat = [(m.finished[t.tag] - m.submitted[t.tag]) / 1e3 for t in plan.transfers]
    gb = total / 1e9
    src_crc, dst_crc = m.src_crc, m.dst_crc
    mismatched = [k for k in src_crc if dst_crc.get(k) != src_crc[k]]
    return {
        "label": plan.label,
        "bytes": size,
        "blocks": plan.blocks,
        "descriptors": plan.blocks * workload.regions,
        "transfers": len(plan.transfers),
        "total_bytes": total,
        "wall_s": wall,
        "gbps": gb / wall,
        "transfers_per_s": len(plan.transfers) / wall,
        "p50_us": percentile(lat, 50),
        "p99_us": percentile(lat, 99),
        "sender_cpu_s_per_gb": m.sender_cpu / gb,
        "receiver_cpu_s_per_gb": None if m.receiver_cpu is None else m.receiver_cpu / gb,
        "sender_cpu_us_per_transfer": m.sender_cpu / len(plan.transfers) * 1e6,
        "receiver_cpu_us_per_transfer": (
            None if m.receiver_cpu is None else m.receiver_cpu / len(plan.transfers) * 1e6
        ),
        "inflight": plan.inflight or workload.inflight,
        "checksums": {
            "slots": len(src_crc),
            "src": [src_crc[k] for k in src_crc],
            "dst": [dst_crc.get(k) for k in src_crc],
            "match": not mismatched,
        },
    } | m.extra


# ----------------------------------------------------------------- child processes


def quiet_foreign_loggers() -> None:
    """NIXL logs INFO lines through its own handler; in a bench child they would land in
    the middle of the table. Runs in the children only (the CLI owns the parent's logging)."""
    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        # NIXL configures its logger when first imported; import it first, then quiet it.
        with contextlib.suppress(ModeUnavailable):
            nixl_or_unavailable()
        logging.getLogger("nixl").setLevel(logging.WARNING)


def close_quietly(thing: Any) -> None:
    """Close on the way out of a child process, which is about to end anyway."""
    with contextlib.suppress(Exception):
        thing.close()


@contextlib.contextmanager
def child_process(conn: Connection, prefix: str = "") -> Iterator[contextlib.ExitStack]:
    """The frame of every bench child. An exception ends the child as one message on
    `conn`: ("skipped", why) for `ModeUnavailable`, else ("error", what); then whatever
    the body put on the yielded stack is closed, errors ignored."""
    with contextlib.ExitStack() as stack:
        try:
            quiet_foreign_loggers()
            yield stack
        except BaseException as exc:
            with contextlib.suppress(OSError):
                if isinstance(exc, ModeUnavailable):
                    conn.send(("skipped", str(exc)))
                else:
                    conn.send(("error", f"{prefix}{type(exc).__name__}: {exc}"))
            if not isinstance(exc, KVPushError):
                traceback.print_exc()


def measure_plans(
    workload: Workload, parent: Connection, measure: Callable[[Plan], Measured]
) -> None:
    """Every plan in turn: progress to the parent, `measure`, and the batch's figures
    (all but the warm-up's)."""
    for plan in plans(workload):
        parent.send(("progress", plan.label))
        measured = measure(plan)
        if plan.label != "warmup":
            parent.send(("batch", batch_result(workload, plan, measured)))


def serve_orders(
    workload: Workload,
    parent: Connection,
    measure: Callable[[Plan], Measured],
    idle: Callable[[], float | None],
) -> None:
    """The interleaved run's child loop: the warm-up, then ("ready",), then the parent's
    orders one at a time: ("plan", label, round, limit) -> ("batch", figures, latencies),
    where `limit`, if not None, keeps only the plan's first `limit` transfers (a warm-up);
    ("idle",) -> ("idle", % of a core or None); ("stop",) -> ("finished",). Between
    orders the child waits on its pipe and spends no CPU while other modes run."""
    by_label = {p.label: p for p in plans(workload)}
    measure(by_label["warmup"])
    parent.send(("ready",))
    while True:
        msg = recv_message(parent, ORDER_TIMEOUT_S, "waiting for the bench's next order")
        if msg[0] == "plan":
            _, label, round_index, limit = msg
            plan = next(p for p in plans(workload, round_index) if p.label == label)
            if limit is not None:
                plan.transfers = plan.transfers[:limit]
            measured = measure(plan)
            latencies = [
                (measured.finished[t.tag] - measured.submitted[t.tag]) / 1e3 for t in plan.transfers
            ]
            # When the batch ran (monotonic ns, one clock for the host): each round's
            # figures say so, which shows the modes took their turns.
            span = {
                "start_ns": min(measured.submitted.values()),
                "end_ns": max(measured.finished.values()),
            }
            parent.send(("batch", batch_result(workload, plan, measured) | span, latencies))
        elif msg[0] == "idle":
            parent.send(("idle", idle()))
        elif msg[0] == "stop":
            break
    parent.send(("finished",))


def start_busy_engine(stack: contextlib.ExitStack) -> None:
    """`--busy-engine`: a thread that computes in Python for as long as the child lives,
    as an engine's model loop does (it holds the GIL but at switch requests)."""
    stop = threading.Event()

    def compute() -> None:
        x = 0
        while not stop.is_set():
            for i in range(10_000):
                x ^= i

    thread = threading.Thread(target=compute, name="bench-busy-engine", daemon=True)
    thread.start()
    stack.callback(thread.join, 5.0)
    stack.callback(stop.set)


def receiver_main(mode: str, workload: Workload, peer: Connection) -> None:
    with child_process(peer, prefix="receiver: ") as stack:
        if workload.busy_engine:
            start_busy_engine(stack)
        rx = factories(mode)[0](workload)
        stack.callback(close_quietly, rx)
        meta = rx.setup(peer)
        peer.send(("meta", meta))
        while True:
            msg = recv_message(peer, PIPE_TIMEOUT_S * 5, "receiver waiting for orders")
            if msg[0] == "peer-info":
                rx.peer_info(msg[1])
            elif msg[0] == "arm":
                transfers = msg[1]
                slots = {dst for _, dst in transfers}
                for dst in slots:
                    rx.buffers.zero(dst)
                rx.arm(transfers, time.monotonic() + PIPE_TIMEOUT_S)
                peer.send(("armed",))
                cpu0 = cpu_seconds()
                done = rx.wait({tag for tag, _ in transfers}, time.monotonic() + PIPE_TIMEOUT_S)
                cpu = cpu_seconds() - cpu0
                crcs = {dst: rx.buffers.checksum(dst) for dst in slots}
                peer.send(("done", done, cpu, crcs))
            elif msg[0] == "idle":
                cpu0 = cpu_seconds()
                rx.idle(float(msg[1]))
                peer.send(("idled", cpu_seconds() - cpu0))
            elif msg[0] == "stop":
                break


def sender_main(mode: str, workload: Workload, peer: Connection, parent: Connection) -> None:
    with child_process(parent) as stack:
        if workload.busy_engine:
            start_busy_engine(stack)
        tx = factories(mode)[1](workload)
        stack.callback(close_quietly, tx)
        _, meta = recv_message(peer, PIPE_TIMEOUT_S, "receiver metadata")
        tx.setup(meta, peer)

        # The source is never written, so a plan's source checksums (the same slots in
        # every round) are taken once; a warm-up's plan, cut to its first window, has
        # fewer slots, hence the count in the key.
        src_crcs: dict[tuple[str, int], dict[tuple[int, ...], int]] = {}

        def measure(plan: Plan) -> Measured:
            key = (plan.label, len(plan.transfers))
            src_crc = src_crcs.get(key)
            if src_crc is None:
                src_crc = {t.dst_blocks: tx.buffers.checksum(t.src_blocks) for t in plan.slots}
                src_crcs[key] = src_crc
            peer.send(("arm", [(t.tag, t.dst_blocks) for t in plan.transfers]))
            recv_message(peer, PIPE_TIMEOUT_S, "receiver arming")
            tx.prepare(plan.transfers, time.monotonic() + PIPE_TIMEOUT_S)
            cpu0 = cpu_seconds()
            submitted = tx.run_batch(
                plan.transfers,
                plan.inflight or workload.inflight,
                time.monotonic() + PIPE_TIMEOUT_S,
            )
            cpu = cpu_seconds() - cpu0
            _, finished, rx_cpu, dst_crc = recv_message(peer, PIPE_TIMEOUT_S, "receiver completion")
            return Measured(submitted, finished, cpu, rx_cpu, src_crc, dst_crc)

        def idle() -> float:
            peer.send(("idle", workload.idle_s))
            _, idle_cpu = recv_message(peer, PIPE_TIMEOUT_S, "receiver idling")
            return 100.0 * float(idle_cpu) / workload.idle_s

        serve_orders(workload, parent, measure, idle)
        peer.send(("stop",))


def memcpy_main(workload: Workload, parent: Connection) -> None:
    with child_process(parent):
        pair = MemcpyPair(workload)
        pair.setup()

        def measure(plan: Plan) -> Measured:
            slots = plan.slots
            src_crc = {t.dst_blocks: pair.buffers.checksum(t.src_blocks) for t in slots}
            for t in slots:
                pair.dst.zero(t.dst_blocks)
            cpu0 = cpu_seconds()
            submitted, finished = pair.run_batch(plan.transfers)
            cpu = cpu_seconds() - cpu0
            dst_crc = {t.dst_blocks: pair.dst.checksum(t.dst_blocks) for t in slots}
            return Measured(submitted, finished, cpu, None, src_crc, dst_crc)

        serve_orders(workload, parent, measure, lambda: None)


# ----------------------------------------------------------------- parent


def stop_children(procs: list[mp.process.BaseProcess]) -> None:
    """Join every child; kill any that does not exit in time. Runs on every exit path."""
    for p in procs:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def empty_result(mode: str) -> dict[str, Any]:
    return {"mode": mode, "status": "ok", "reason": None, "sizes": []} | {
        "rate": None,
        "latency": None,
        "idle_cpu_percent": None,
    }


def run_children(
    mode: str,
    children: Callable[[Connection], list[ChildSpec]],
    *,
    label: str | None = None,
    on_progress: ProgressFn | None = None,
    step_offset: int = 0,
    total_steps: int = 0,
    deadline_s: float = 900.0,
) -> dict[str, Any]:
    """Start `children(report_end)` in fresh "spawn" processes and relay what they report
    on `report_end` into one mode's result; never raises for the mode's failure."""
    label = label or mode
    result = empty_result(mode)
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    procs: list[mp.process.BaseProcess] = []
    try:
        procs = [ctx.Process(target=fn, args=args) for fn, args in children(child_end)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + deadline_s
        step = step_offset
        while True:
            if not parent_end.poll(0.2):
                if time.monotonic() > deadline:
                    raise BenchFailed(f"{label} did not finish within {deadline_s:.0f} s")
                dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead or all(not p.is_alive() for p in procs):
                    code = dead[0].exitcode if dead else 0
                    if not parent_end.poll(0.5):
                        raise BenchFailed(f"a {label} child process exited (status {code})")
                continue
            msg = parent_end.recv()
            kind = msg[0]
            if kind == "progress":
                step += 1
                if on_progress is not None:
                    on_progress(f"{label} {msg[1]}", step, total_steps)
            elif kind == "batch":
                if msg[1]["label"] == "rate":
                    result["rate"] = msg[1]
                elif msg[1]["label"] == "latency":
                    result["latency"] = msg[1]
                else:
                    result["sizes"].append(msg[1])
            elif kind == "idle":
                result["idle_cpu_percent"] = msg[1]
            elif kind == "skipped":
                result |= {"status": "skipped", "reason": msg[1]}
                break
            elif kind == "error":
                result |= {"status": "failed", "reason": msg[1]}
                break
            elif kind == "finished":
                break
    except BenchFailed as exc:
        result |= {"status": "failed", "reason": str(exc)}
    finally:
        stop_children(procs)
        parent_end.close()
        child_end.close()
    return result


def steps_per_mode(workload: Workload) -> int:
    return len(plans(workload)) + 1


def new_report(workload: Workload, **extra: Any) -> dict[str, Any]:
    """A report's header; `finish_report` adds the totals once every mode has run."""
    import platform

    return {
        "kvpush_bench": 1,
        **extra,
        "host": {
            "machine": platform.machine(),
            "node": platform.node(),
            "cpus": len(os.sched_getaffinity(0)),
            # The 1-minute load average as the run starts and ends: on a host that other
            # work shares, ratios from runs at different loads differ (docs/benchmarks.md,
            # "Interleaved rounds").
            "load_start": os.getloadavg()[0],
        },
        "versions": versions(),
        "started_unix": time.time(),
        "workload": workload.describe(),
        "modes": [],
    }


def finish_report(report: dict[str, Any]) -> dict[str, Any]:
    report["elapsed_s"] = time.time() - report["started_unix"]
    report["host"]["load_end"] = os.getloadavg()[0]
    report["ratios"] = ratios(report)
    report["paired_ratios"] = paired_ratios(report)
    return report


@dataclass(frozen=True, slots=True)
class ModeRun:
    """One entry of a report that runs on its own (a `--shapes` shape): its name, its
    progress steps, and how to run it (`run(on_progress, step_offset, total_steps)`,
    which never raises for the run's own failure: it reports it)."""

    mode: str
    steps: int
    run: Callable[[ProgressFn | None, int, int], dict[str, Any]]


def versions() -> dict[str, str | None]:
    """Installed versions of what the modes use, so a report says what it measured."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for dist in ("kvpush", "nixl", "nixl-cu12", "nixl-cu13", "mooncake-transfer-engine-non-cuda"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out
