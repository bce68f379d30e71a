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

import socket
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kvpush.bench.common import SENDER_FILL_SEED, BenchFailed, check_deadline
from kvpush.bench.kvpush_mode import BenchRuntime
from kvpush.bench.modes import NixlRawSender, nixl_register
from kvpush.bench.runner import (
    PIPE_TIMEOUT_S,
    ChildSpec,
    Measured,
    ProgressFn,
    child_process,
    close_quietly,
    cpu_seconds,
    finish_report,
    measure_plans,
    new_report,
    run_children,
    steps_per_mode,
)
from kvpush.bench.workload import CacheBuffers, Plan, Transfer, Workload, make_workload
from kvpush.errors import ConfigError
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
    with child_process(parent) as stack:
        tx = NixlRawSender(workload)
        stack.callback(close_quietly, tx)
        tx.setup(peer_meta, parent)
        scratch = CacheBuffers(workload)
        scratch.allocate(None)
        nixl_register(tx.agent, scratch)

        def measure(plan: Plan) -> Measured:
            checked = plan.slots[:READ_BACK_SLOTS]
            src_crc = {t.dst_blocks: tx.buffers.checksum(t.src_blocks) for t in checked}
            cpu0 = cpu_seconds()
            finished: dict[int, int] = {}
            deadline = time.monotonic() + 300
            submitted = tx.run_batch(
                plan.transfers, plan.inflight or workload.inflight, deadline, finished, notify=False
            )
            cpu = cpu_seconds() - cpu0
            dst_crc = {}
            for t in checked:
                scratch.zero(t.dst_blocks)
                tx.read_back(t.dst_blocks, scratch, deadline)
                dst_crc[t.dst_blocks] = scratch.checksum(t.dst_blocks)
            return Measured(submitted, finished, cpu, None, src_crc, dst_crc)

        measure_plans(workload, parent, measure)
        parent.send(("finished",))


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
        self.end = BenchRuntime(f"bench-{self.run_id}-")
        self.our_host = ""
        self.our_port = 0

    def setup(self) -> None:
        self.cache = source_cache(self.meta.geometry, self.workload.num_blocks)
        self.our_host = local_address_towards(self.host, self.port)
        self.our_port = self.end.start(
            self.cache.geometry,
            host=self.our_host,
            role="sender",
            engine_id=f"bench-{self.run_id}",
            token=self.token,
            lookup_timeout_ms=_CONTROL_TIMEOUT_MS,
        )

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

        sender = [self.our_host, self.our_port, 0]
        chunk: list[list[Any]] = []
        size = 0
        cpu = 0.0
        for t in transfers:
            item = [self.end.transfer_id(t.tag), list(t.dst_blocks)]
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

    def confirm(self, transfers: list[Transfer], deadline: float) -> tuple[int, float]:
        """Wait until the endpoint reports every transfer ended; all must have finished.
        Returns when we knew (monotonic ns) and the endpoint's CPU seconds then."""
        from kvpush.bench.endpoint_service import BENCH_RESULTS

        waiting = [self.end.transfer_id(t.tag) for t in transfers]
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
        self.end.close()


def source_cache(geometry: Any, num_blocks: int) -> Any:
    """A cache with the endpoint's geometry (all but addresses and block count), filled
    with seeded random bytes; refuses a geometry it cannot reproduce."""
    import numpy as np
    import torch

    from kvpush.bench.presets import synthetic_kv_cache
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
    with child_process(parent) as stack:
        tx = RemoteKvpushSender(host, port, token, meta, workload)
        stack.callback(close_quietly, tx)
        tx.setup()

        def measure(plan: Plan) -> Measured:
            deadline = time.monotonic() + PIPE_TIMEOUT_S
            slots = [t.dst_blocks for t in plan.slots]
            src_crc = {t.dst_blocks: tx.checksum(t.src_blocks) for t in plan.slots}
            rx_cpu0 = tx.expect(plan.transfers)
            tx.end.wait_registered(len(plan.transfers), deadline, "the endpoint")
            cpu0 = cpu_seconds()
            submitted, finished = tx.end.push(
                plan.transfers, plan.inflight or workload.inflight, deadline
            )
            cpu = cpu_seconds() - cpu0
            confirmed_ns, rx_cpu1 = tx.confirm(plan.transfers, deadline)
            dst_crc = tx.endpoint_checksums(slots)
            confirmed_s = (confirmed_ns - min(submitted.values())) / 1e9
            return Measured(
                submitted,
                finished,
                cpu,
                rx_cpu1 - rx_cpu0,
                src_crc,
                dst_crc,
                extra={"endpoint_confirmed_s": confirmed_s},
            )

        measure_plans(workload, parent, measure)
        parent.send(("progress", "idle"))
        cpu0, t0 = tx.endpoint_cpu(), time.monotonic()
        time.sleep(workload.idle_s)
        cpu1, t1 = tx.endpoint_cpu(), time.monotonic()
        parent.send(("idle", 100.0 * (cpu1 - cpu0) / (t1 - t0)))
        parent.send(("finished",))


def _one_child(
    target: Callable[..., None], args: tuple[Any, ...]
) -> Callable[[Connection], list[ChildSpec]]:
    """One child process, reporting on the connection `run_children` hands it."""
    return lambda report_end: [(target, (*args, report_end))]


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
    report = new_report(
        workload,
        target=target,
        endpoint={"engine_id": meta.engine_id, "incarnation": meta.incarnation},
        latency_end={m: LATENCY_END[m] for m in modes},
    )
    per = steps_per_mode(workload)
    for i, mode in enumerate(modes):
        if mode == "nixl-raw":
            peer_meta = {"agent_md": meta.agent_metadata, "bases": bases, "strides": strides}
            children = _one_child(_remote_main, (workload, peer_meta))
        else:
            children = _one_child(_remote_kvpush_main, (host, port, token, meta, workload))
        result = run_children(
            mode,
            children,
            label=f"remote {mode}",
            on_progress=on_progress,
            step_offset=per * i,
            total_steps=per * len(modes),
        )
        report["modes"].append(result | {"latency_end": LATENCY_END[mode]})
    return finish_report(report)
