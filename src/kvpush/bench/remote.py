"""`kvpush bench --target HOST:PORT`: write into a running `kvpush endpoint` over the network.

The endpoint publishes its NIXL agent metadata and cache geometry on its side channel
(`kvpush endpoint --transport nixl`). We fetch them, allocate a source cache of the same
shape in a child process, and WRITE into the endpoint's blocks exactly as the local
`nixl-raw` mode does. The endpoint reports nothing back, so completion is the sender's:
NIXL's DONE for the WRITE. After each size, the written blocks are READ back and their
CRCs compared with the source, so the check of the bytes is end to end.

The `kvpush` mode needs the endpoint to run a receiving kvpush runtime; until it does,
the report says so instead of giving a figure.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from kvpush.bench.modes import (
    BenchFailed,
    NixlRawSender,
    nixl_register,
)
from kvpush.bench.runner import (
    ProgressFn,
    batch_result,
    cpu_seconds,
    plans,
    quiet_foreign_loggers,
    ratios,
    stop_children,
)
from kvpush.bench.workload import CacheBuffers, Workload, make_workload
from kvpush.errors import ConfigError, KVPushError
from kvpush.net import parse_host_port

READ_BACK_SLOTS = 4


def check_target(target: str) -> tuple[str, int]:
    """`HOST:PORT` or `[v6]:PORT`; raises `AddressError` saying what was expected."""
    return parse_host_port(target)


def fetch_endpoint(target: str, token: str | None, timeout_ms: int = 5000) -> Any:
    """The endpoint's rank-0 metadata; refuses an endpoint without a data plane."""
    from kvpush.sidechannel import fetch_metadata

    host, port = check_target(target)
    meta = fetch_metadata(host, port, 0, timeout_ms=timeout_ms, token=token)
    if not meta.agent_metadata:
        raise ConfigError(
            f"endpoint {target} publishes no transport metadata: start it with "
            "`kvpush endpoint --transport nixl` so that it can be written to"
        )
    return meta


def workload_for(
    meta: Any, *, max_size_bytes: int | None, inflight: int, quick: bool
) -> tuple[Workload, list[int], list[int]]:
    """A workload shaped like the endpoint's cache, and its region bases and strides."""
    regions = meta.geometry.regions
    sizes = {r.block_bytes for r in regions}
    if len(sizes) != 1 or len(regions) % 2:
        raise ConfigError(
            f"endpoint cache has {len(regions)} regions of block sizes {sorted(sizes)}: "
            "the bench expects K and V regions of one block size per layer"
        )
    (block_bytes,) = sizes
    num_blocks = min(r.num_blocks for r in regions)
    per_block = block_bytes * len(regions)
    top = min(max_size_bytes or num_blocks * per_block, num_blocks * per_block)
    base = make_workload(
        preset="llama-3.1-8b",
        layers=len(regions) // 2,
        block_size_tokens=meta.geometry.block_size_tokens,
        block_bytes=block_bytes,
        max_size_bytes=top,
        inflight=min(inflight, num_blocks),
        quick=quick,
    )
    from dataclasses import replace

    workload = replace(base, preset=f"endpoint:{meta.engine_id}", num_blocks=num_blocks)
    return workload, [r.base_addr for r in regions], [r.block_stride for r in regions]


def _remote_main(
    workload: Workload,
    peer_meta: dict[str, Any],
    parent: Connection,
) -> None:
    tx: NixlRawSender | None = None
    quiet_foreign_loggers()
    try:
        tx = NixlRawSender(workload)
        tx.setup(peer_meta, parent)
        scratch = CacheBuffers(workload)
        scratch.allocate(None)
        nixl_register(tx.agent, scratch)
        for plan in plans(workload):
            parent.send(("progress", plan.label))
            checked = plan.slots[:READ_BACK_SLOTS]
            src_crc = {t.dst_blocks: tx.buffers.checksum(t.src_blocks) for t in checked}
            cpu0 = cpu_seconds()
            finished: dict[int, int] = {}
            deadline = time.monotonic() + 300
            submitted = tx.run_batch(plan.transfers, workload.inflight, deadline, finished)
            cpu = cpu_seconds() - cpu0
            dst_crc = {}
            for t in checked:
                scratch.zero(t.dst_blocks)
                tx.read_back(t.dst_blocks, scratch, deadline)
                dst_crc[t.dst_blocks] = scratch.checksum(t.dst_blocks)
            if plan.label == "warmup":
                continue
            res = batch_result(
                workload,
                plan=plan,
                submitted=submitted,
                finished=finished,
                sender_cpu=cpu,
                receiver_cpu=None,
                src_crc=src_crc,
                dst_crc=dst_crc,
            )
            parent.send(("batch", res))
        parent.send(("finished",))
    except BaseException as exc:
        with contextlib.suppress(OSError):
            parent.send(("error", f"{type(exc).__name__}: {exc}"))
        if not isinstance(exc, KVPushError):
            traceback.print_exc()
    finally:
        if tx is not None:
            with contextlib.suppress(Exception):
                tx.close()


def run_remote(
    target: str,
    token: str | None,
    *,
    max_size_bytes: int | None,
    inflight: int,
    quick: bool,
    on_progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Bench writes into the endpoint at `target`; the report has the local bench's shape."""
    import platform

    meta = fetch_endpoint(target, token)
    workload, bases, strides = workload_for(
        meta, max_size_bytes=max_size_bytes, inflight=inflight, quick=quick
    )
    peer_meta = {"agent_md": meta.agent_metadata, "bases": bases, "strides": strides}
    report: dict[str, Any] = {
        "kvpush_bench": 1,
        "target": target,
        "host": {"machine": platform.machine(), "node": platform.node(), "cpus": 0},
        "started_unix": time.time(),
        "workload": workload.describe(),
        "latency_end": "sender sees its WRITE complete (the endpoint reports nothing back)",
        "modes": [],
    }
    result: dict[str, Any] = {"mode": "nixl-raw", "status": "ok", "reason": None, "sizes": []}
    result |= {"rate": None, "idle_cpu_percent": None}
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=_remote_main, args=(workload, peer_meta, child_end))
    total = len(plans(workload))
    step = 0
    try:
        proc.start()
        end = time.monotonic() + 900
        while True:
            if not parent_end.poll(0.2):
                if time.monotonic() > end:
                    raise BenchFailed("remote bench did not finish within 900 s")
                if not proc.is_alive() and not parent_end.poll(0.5):
                    raise BenchFailed(f"the remote bench process exited ({proc.exitcode})")
                continue
            msg = parent_end.recv()
            if msg[0] == "progress":
                step += 1
                if on_progress is not None:
                    on_progress(f"remote {msg[1]}", step, total)
            elif msg[0] == "batch":
                key = "rate" if msg[1]["label"] == "rate" else "sizes"
                if key == "rate":
                    result["rate"] = msg[1]
                else:
                    result["sizes"].append(msg[1])
            elif msg[0] == "error":
                result |= {"status": "failed", "reason": msg[1]}
                break
            elif msg[0] == "finished":
                break
    except BenchFailed as exc:
        result |= {"status": "failed", "reason": str(exc)}
    finally:
        stop_children([proc])
        parent_end.close()
        child_end.close()
    report["modes"].append(result)
    report["modes"].append(
        {"mode": "kvpush", "status": "skipped", "sizes": [], "rate": None}
        | {
            "idle_cpu_percent": None,
            "reason": "not available remotely: `kvpush endpoint` runs no receiving "
            "kvpush runtime yet, so nothing would report kvpush transfers finished",
        }
    )
    report["elapsed_s"] = time.time() - report["started_unix"]
    report["ratios"] = ratios(report)
    return report
