"""`kvpush bench --target HOST:PORT`: measure a running `kvpush endpoint` over the network.

The endpoint (`kvpush endpoint --transport nixl`) publishes its kvpush runtime's NIXL
agent metadata and cache geometry on its side channel. The bench fetches them and, in a
fresh child process per mode, runs the sending side here:

* `nixl-raw`: allocate a source cache shaped like the endpoint's and WRITE into its
  blocks with NIXL directly, exactly as the local `nixl-raw` mode does (no notification:
  the endpoint's runtime would take it for a kvpush message). The endpoint reports nothing
  back, so completion is NIXL's DONE at the writer; after each size the written blocks
  are READ back and their CRCs compared with the source.
* `kvpush`: the whole kvpush path. The bench builds a source cache with the endpoint's
  geometry (`register_kv_cache` through `synthetic_kv_cache`), starts a sending
  `PushRuntime` over NIXL with its own side channel (on the local address that routes to
  the endpoint, so the endpoint can handshake back), and for each batch asks the endpoint
  to expect the transfers (`bench_expect`, see `kvpush.bench.endpoint_service`). Once the
  endpoint's registrations have reached us (untimed), the timed part: `send()` per
  transfer ("blocks ready", at most `inflight` open), and each transfer counts as
  finished when our runtime reports it finished: every WRITE done and `Done` sent. Then
  the endpoint must report every transfer finished on its side (`bench_results`; the time
  until then is `endpoint_confirmed_s`), and the endpoint's CRCs of the destination
  blocks (`bench_checksum`) are compared with ours of the source blocks.

Both modes time the same thing at the same place (the writer), so their ratio means what
it does locally. Clocks of two machines are never subtracted.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import time
import traceback
import uuid
from multiprocessing.connection import Connection
from typing import Any

from kvpush.bench.modes import (
    SENDER_FILL_SEED,
    BenchFailed,
    NixlRawSender,
    check_deadline,
    nixl_register,
)
from kvpush.bench.runner import (
    PIPE_TIMEOUT_S,
    ProgressFn,
    batch_result,
    cpu_seconds,
    plans,
    quiet_foreign_loggers,
    ratios,
    stop_children,
    versions,
)
from kvpush.bench.workload import CacheBuffers, Transfer, Workload, make_workload
from kvpush.errors import ConfigError, KVPushError
from kvpush.net import parse_host_port

READ_BACK_SLOTS = 4
REMOTE_MODES = ("nixl-raw", "kvpush")
# Requests stay well under the side channel's 64 KiB frame cap.
_EXPECT_FRAME_BUDGET = 48 * 1024
_RESULTS_PER_REQUEST = 1000
_CONTROL_TIMEOUT_MS = 10_000
LATENCY_END = {
    "nixl-raw": "the writer sees its WRITEs complete (the endpoint reports nothing back)",
    "kvpush": "the sending runtime reports the transfer finished (WRITEs done, Done sent); "
    "the endpoint's own report of each transfer is checked after the batch",
}


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
            submitted = tx.run_batch(
                plan.transfers, workload.inflight, deadline, finished, notify=False
            )
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


class RemoteKvpushSender:
    """The sending side of the remote `kvpush` mode; lives in the bench's child process."""

    def __init__(
        self, host: str, port: int, token: str | None, meta: Any, workload: Workload
    ) -> None:
        self.host, self.port, self.token = host, port, token
        self.meta = meta
        self.workload = workload
        self.run_id = uuid.uuid4().hex[:12]
        self.cache: Any = None
        self.runtime: Any = None
        self.server: Any = None
        self.our_host = ""

    def setup(self) -> None:
        from kvpush.config import SideChannelConfig
        from kvpush.runtime import PushRuntime, RuntimeIdentity, SideChannelPeerDirectory
        from kvpush.sidechannel import MetadataServer
        from kvpush.transports.nixl import NixlTransport

        self.cache = source_cache(self.meta.geometry, self.workload.num_blocks)
        self.our_host = local_address_towards(self.host, self.port)
        ranks: dict[int, Any] = {}
        self.server = MetadataServer(self.our_host, 0, SideChannelConfig(token=self.token), ranks)
        self.server.start()
        incarnation = uuid.uuid4().hex
        identity = RuntimeIdentity(
            engine_id=f"bench-{self.run_id}",
            incarnation=incarnation,
            host=self.our_host,
            port=self.server.port,
            role="sender",
        )
        transport = NixlTransport(f"bench-sender-{incarnation[:8]}")
        self.runtime = PushRuntime(
            transport,
            self.cache.geometry,
            identity,
            SideChannelPeerDirectory(token=self.token, timeout_ms=_CONTROL_TIMEOUT_MS),
        )
        self.runtime.start()
        ranks[0] = self.runtime.local_metadata()

    def tid(self, tag: int) -> str:
        return f"bench-{self.run_id}-{tag}"

    def control(self, kind: bytes, body: object) -> Any:
        from kvpush.sidechannel import control_request

        return control_request(
            self.host, self.port, kind, body, token=self.token, timeout_ms=_CONTROL_TIMEOUT_MS
        )

    def checksum(self, blocks: tuple[int, ...]) -> int:
        from kvpush.bench.endpoint_service import blocks_checksum

        return blocks_checksum(self.cache.geometry, blocks)

    def expect(self, transfers: list[Transfer]) -> float:
        """Ask the endpoint to expect `transfers`; its CPU seconds after the last request."""
        from kvpush.bench.endpoint_service import BENCH_EXPECT, MAX_TRANSFERS_PER_REQUEST

        sender = [self.our_host, self.server.port, 0]
        chunk: list[list[Any]] = []
        size = 0
        cpu = 0.0
        for t in transfers:
            item = [self.tid(t.tag), list(t.dst_blocks)]
            cost = 16 + len(item[0]) + 5 * len(t.dst_blocks)
            if cost > _EXPECT_FRAME_BUDGET:
                raise BenchFailed(
                    f"a transfer of {len(t.dst_blocks)} blocks does not fit one side-channel "
                    "request: use fewer blocks per transfer (--max-size)"
                )
            if chunk and (
                size + cost > _EXPECT_FRAME_BUDGET or len(chunk) >= MAX_TRANSFERS_PER_REQUEST
            ):
                cpu = self.control(BENCH_EXPECT, {"sender": sender, "transfers": chunk})["cpu_s"]
                chunk, size = [], 0
            chunk.append(item)
            size += cost
        if chunk:
            cpu = self.control(BENCH_EXPECT, {"sender": sender, "transfers": chunk})["cpu_s"]
        return float(cpu)

    def prepare(self, count: int, deadline: float) -> None:
        """Untimed: wait until the endpoint's registrations for the batch reached us."""
        while self.runtime.statistics().sending.get("registered", 0) < count:
            check_deadline(deadline, "kvpush sender waiting for the endpoint's registrations")
            time.sleep(0.001)

    def run_batch(
        self, transfers: list[Transfer], inflight: int, deadline: float
    ) -> tuple[dict[int, int], dict[int, int]]:
        submitted: dict[int, int] = {}
        finished: dict[int, int] = {}
        tags = {self.tid(t.tag): t.tag for t in transfers}
        pending = list(reversed(transfers))
        open_ = 0
        while pending or open_:
            while pending and open_ < inflight:
                t = pending.pop()
                submitted[t.tag] = time.monotonic_ns()
                self.runtime.send(self.tid(t.tag), list(t.src_blocks))
                open_ += 1
            check_deadline(deadline, "kvpush sender batch")
            results = self.runtime.wait(timeout=0.2)
            now = time.monotonic_ns()
            for r in results:
                if not r.ok:
                    raise BenchFailed(
                        f"kvpush: transfer {r.transfer_id} failed ({r.reason}): {r.detail}"
                    )
                if r.transfer_id in tags:
                    finished[tags[r.transfer_id]] = now
                    open_ -= 1
        return submitted, finished

    def confirm(self, transfers: list[Transfer], deadline: float) -> tuple[int, float]:
        """Wait until the endpoint reports every transfer ended; all must have finished.
        Returns when we knew (monotonic ns) and the endpoint's CPU seconds then."""
        from kvpush.bench.endpoint_service import BENCH_RESULTS

        waiting = [self.tid(t.tag) for t in transfers]
        cpu = 0.0
        while waiting:
            check_deadline(deadline, f"the endpoint reporting {len(waiting)} transfers")
            still: list[str] = []
            for i in range(0, len(waiting), _RESULTS_PER_REQUEST):
                part = waiting[i : i + _RESULTS_PER_REQUEST]
                answer = self.control(BENCH_RESULTS, {"transfers": part})
                cpu = float(answer["cpu_s"])
                for tid in part:
                    ended = answer["ended"].get(tid)
                    if ended is None:
                        still.append(tid)
                    elif not ended[0]:
                        raise BenchFailed(
                            f"kvpush: the endpoint reports {tid} failed ({ended[1]}): {ended[2]}"
                        )
            waiting = still
            if waiting:
                time.sleep(0.001)
        return time.monotonic_ns(), cpu

    def endpoint_checksums(self, slots: list[tuple[int, ...]]) -> dict[tuple[int, ...], int]:
        from kvpush.bench.endpoint_service import BENCH_CHECKSUM

        answer = self.control(BENCH_CHECKSUM, {"blocks": [list(s) for s in slots]})
        crcs = [int(c) for c in answer["crc"]]
        if len(crcs) != len(slots):
            raise BenchFailed(f"the endpoint returned {len(crcs)} checksums for {len(slots)}")
        return dict(zip(slots, crcs, strict=True))

    def endpoint_cpu(self) -> float:
        from kvpush.bench.endpoint_service import BENCH_STATUS

        return float(self.control(BENCH_STATUS, None)["cpu_s"])

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None
        if self.server is not None:
            self.server.close()
            self.server = None


def source_cache(geometry: Any, num_blocks: int) -> Any:
    """A cache with the endpoint's geometry (all but addresses and block count), filled
    with seeded random bytes; refuses a geometry it cannot reproduce."""
    import numpy as np
    import torch

    from kvpush.kvcache import synthetic_kv_cache
    from kvpush.sidechannel.wire import describe_differences

    layer0 = [r for r in geometry.regions if r.layer == 0]
    cache = synthetic_kv_cache(
        geometry.num_layers,
        num_blocks,
        block_bytes=sum(r.block_bytes for r in layer0),
        dtype=geometry.dtype,
        layout=geometry.layout,
        block_size_tokens=geometry.block_size_tokens,
        fill=None,
    )
    if cache.geometry.compat_hash() != geometry.compat_hash():
        differences = describe_differences(geometry, cache.geometry)
        raise ConfigError(
            "cannot build a source cache compatible with the endpoint's: " + "; ".join(differences)
        )
    rng = np.random.default_rng(SENDER_FILL_SEED)
    for value in cache.kv_caches.values():
        for tensor in value if isinstance(value, tuple) else (value,):
            flat = tensor.view(torch.uint8).view(-1).numpy()
            flat[:] = np.frombuffer(rng.bytes(flat.size), dtype=np.uint8)
    return cache


def local_address_towards(host: str, port: int) -> str:
    """Our address on the route to `host` (what the endpoint can reach us at)."""
    from kvpush.net import unbracket_host

    host = unbracket_host(host)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot resolve {host!r}: {exc.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)  # UDP: picks the route, sends nothing
        return str(s.getsockname()[0])


def _remote_kvpush_main(
    host: str,
    port: int,
    token: str | None,
    meta: Any,
    workload: Workload,
    parent: Connection,
) -> None:
    tx: RemoteKvpushSender | None = None
    quiet_foreign_loggers()
    try:
        tx = RemoteKvpushSender(host, port, token, meta, workload)
        tx.setup()
        for plan in plans(workload):
            parent.send(("progress", plan.label))
            deadline = time.monotonic() + PIPE_TIMEOUT_S
            slots = [t.dst_blocks for t in plan.slots]
            src_crc = {t.dst_blocks: tx.checksum(t.src_blocks) for t in plan.slots}
            rx_cpu0 = tx.expect(plan.transfers)
            tx.prepare(len(plan.transfers), deadline)
            cpu0 = cpu_seconds()
            submitted, finished = tx.run_batch(plan.transfers, workload.inflight, deadline)
            cpu = cpu_seconds() - cpu0
            confirmed_ns, rx_cpu1 = tx.confirm(plan.transfers, deadline)
            dst_crc = tx.endpoint_checksums(slots)
            if plan.label == "warmup":
                continue
            res = batch_result(
                workload,
                plan=plan,
                submitted=submitted,
                finished=finished,
                sender_cpu=cpu,
                receiver_cpu=rx_cpu1 - rx_cpu0,
                src_crc=src_crc,
                dst_crc=dst_crc,
            )
            res["endpoint_confirmed_s"] = (confirmed_ns - min(submitted.values())) / 1e9
            parent.send(("batch", res))
        parent.send(("progress", "idle"))
        cpu0, t0 = tx.endpoint_cpu(), time.monotonic()
        time.sleep(workload.idle_s)
        cpu1, t1 = tx.endpoint_cpu(), time.monotonic()
        parent.send(("idle", 100.0 * (cpu1 - cpu0) / (t1 - t0)))
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


def _run_child(
    mode: str,
    target: Any,
    args: tuple[Any, ...],
    total: int,
    step: int,
    on_progress: ProgressFn | None,
) -> dict[str, Any]:
    """One mode's child process, relayed until it finishes; never raises for its failure."""
    result: dict[str, Any] = {"mode": mode, "status": "ok", "reason": None, "sizes": []}
    result |= {"rate": None, "idle_cpu_percent": None, "latency_end": LATENCY_END[mode]}
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child_end))
    try:
        proc.start()
        end = time.monotonic() + 900
        while True:
            if not parent_end.poll(0.2):
                if time.monotonic() > end:
                    raise BenchFailed(f"remote {mode} did not finish within 900 s")
                if not proc.is_alive() and not parent_end.poll(0.5):
                    raise BenchFailed(f"the remote {mode} process exited ({proc.exitcode})")
                continue
            msg = parent_end.recv()
            if msg[0] == "progress":
                step += 1
                if on_progress is not None:
                    on_progress(f"remote {mode} {msg[1]}", step, total)
            elif msg[0] == "batch":
                if msg[1]["label"] == "rate":
                    result["rate"] = msg[1]
                else:
                    result["sizes"].append(msg[1])
            elif msg[0] == "idle":
                result["idle_cpu_percent"] = msg[1]
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
    return result


def run_remote(
    target: str,
    token: str | None,
    *,
    max_size_bytes: int | None,
    inflight: int,
    quick: bool,
    modes: tuple[str, ...] = REMOTE_MODES,
    on_progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Bench the endpoint at `target`; the report has the local bench's shape."""
    import platform

    modes = tuple(m for m in modes if m in REMOTE_MODES)
    if not modes:
        raise ConfigError(
            f"--target runs only {' and '.join(REMOTE_MODES)} (the others need both sides "
            "on this machine)"
        )
    host, port = check_target(target)
    meta = fetch_endpoint(target, token)
    workload, bases, strides = workload_for(
        meta, max_size_bytes=max_size_bytes, inflight=inflight, quick=quick
    )
    report: dict[str, Any] = {
        "kvpush_bench": 1,
        "target": target,
        "endpoint": {"engine_id": meta.engine_id, "incarnation": meta.incarnation},
        "host": {"machine": platform.machine(), "node": platform.node(), "cpus": 0},
        "versions": versions(),
        "started_unix": time.time(),
        "workload": workload.describe(),
        "latency_end": {m: LATENCY_END[m] for m in modes},
        "modes": [],
    }
    per = len(plans(workload)) + 1
    for i, mode in enumerate(modes):
        if mode == "nixl-raw":
            peer_meta = {"agent_md": meta.agent_metadata, "bases": bases, "strides": strides}
            child_args: tuple[Any, ...] = (workload, peer_meta)
            target_fn: Any = _remote_main
        else:
            child_args = (host, port, token, meta, workload)
            target_fn = _remote_kvpush_main
        report["modes"].append(
            _run_child(mode, target_fn, child_args, per * len(modes), per * i, on_progress)
        )
    report["elapsed_s"] = time.time() - report["started_unix"]
    report["ratios"] = ratios(report)
    return report
