"""A whole kvpush rank in its own process, with an engine that REUSES blocks at once.

Like `tests/runtime_peer.py` (a `kvpush.node.Node` over NIXL, driven by JSON lines), but
its engine behaves as a busy serving engine does, so that a late or stale write shows up
in the bytes:

- sender side: the moment a transfer ends (ok or failed), its source blocks are
  overwritten with a fresh pattern (the next request's prefill). A write still reading
  them then carries bytes the engine never submitted.
- receiver side: the moment a transfer ends, a finished transfer's blocks are checksummed
  (what "ok" delivered), then every block is given to a new request and filled with a
  canary. A write landing after that overwrites a canary.

Every result is printed as `@result {...}` with what the engine did with its blocks;
`check` reports, for the test, every canary that no longer holds.

    python tests/chaos_peer.py ENGINE_ID ROLE [--port P] [--seed S] [--liveness L]
        [--lease L] [--dtype D] [--layout L] [--torch | --numpy] [--blocks N] [--block-bytes B]
        [--revalidate-after S]
        -> first line: @reply {"port", "pid", "agent_name", "incarnation"}
    {"op": "send", "transfer_id", "blocks", "ready_layers": null | [..]}
        -> {"sums": [[per region] per block]}: what the engine submitted
    {"op": "layers_ready", "transfer_id", "layers"}
    {"op": "receive", "transfer_id", "sender_port", "blocks", "host"?}
    {"op": "stop_after", "then": [send or layers_ready commands]}   (with --queue-engine-calls)
        -> {"sums": {transfer_id: sums}} for the sends, then `@resumed {}` after SIGCONT.
        The engine makes the calls, then the process stops itself with SIGSTOP before
        the runtime thread can take them (os.kill keeps the GIL): they wait in the
        runtime's queue across the stall, as when a process is frozen right after them.
    {"op": "abort", "transfer_id"}
    {"op": "checksums", "blocks"}  -> {"sums"}
    {"op": "check"}                 -> {"canaries_checked", "canaries_overwritten": [..]}
    {"op": "stats"}                 -> RuntimeStatistics fields and NIXL write counters
    {"op": "exit"}
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np

from helpers.forwarding import Forwarding
from kvpush.config import TimingConfig
from kvpush.errors import FailureReason
from kvpush.geometry import CacheGeometry, Region
from kvpush.node import Node, NodeIdentity, RankSettings
from kvpush.protocol import REVALIDATE_AFTER_S
from kvpush.runtime import PeerAddress, PushRuntime, TransferResult
from kvpush.transports.base import (
    PeerLost,
    Transport,
    TransportEvent,
    WriteDone,
    WriteFailed,
)
from kvpush.transports.nixl import NixlStatistics, NixlTransport

NUM_LAYERS = 2
_print_lock = threading.Lock()


def emit(kind: str, body: dict[str, Any]) -> None:
    with _print_lock:
        print(f"@{kind} {json.dumps(body)}", flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="chaos_peer")
    p.add_argument("engine_id")
    p.add_argument("role")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--liveness", type=float, default=1.0)
    p.add_argument("--lease", type=float, default=2.0)
    p.add_argument("--deadline", type=float, default=30.0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layout", default="kv_separate/NHD")
    p.add_argument("--torch", action="store_true", help="torch tensors via register_kv_cache")
    p.add_argument("--numpy", dest="torch", action="store_false", help="numpy buffers (default)")
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--block-bytes", type=int, default=2048)
    p.add_argument("--revalidate-after", type=float, default=None)
    p.add_argument(
        "--queue-engine-calls",
        action="store_true",
        help="PushRuntime(drive_in_step=False): engine calls only queue commands for "
        "the runtime's thread (what stop_after needs to stop with calls still queued)",
    )
    return p.parse_args(argv)


def torch_cache(args: argparse.Namespace) -> tuple[CacheGeometry, list[Any]]:
    """An engine's paged KV cache as the README registers it: torch tensors, one (K, V)
    pair per layer, in the declared layout and dtype."""
    import torch

    from kvpush.kvcache import register_kv_cache

    dtype = getattr(torch, args.dtype)
    block_tokens, heads = 16, 2
    head_dim = args.block_bytes // (block_tokens * heads * torch.empty((), dtype=dtype).itemsize)
    inner = (
        (block_tokens, heads, head_dim)
        if args.layout.endswith("/NHD")
        else (heads, block_tokens, head_dim)
    )
    gen = torch.Generator().manual_seed(args.seed)
    tensors: dict[str, tuple[Any, Any]] = {}
    for layer in range(NUM_LAYERS):
        pair = []
        for _ in range(2):
            t = torch.empty((args.blocks, *inner), dtype=dtype)
            flat = t.view(torch.uint8).reshape(-1)
            flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
            pair.append(t)
        tensors[f"model.layers.{layer}.self_attn"] = (pair[0], pair[1])
    geometry = register_kv_cache(tensors, args.layout, block_size_tokens=block_tokens)
    return geometry, list(tensors.values())


def numpy_cache(args: argparse.Namespace) -> tuple[CacheGeometry, list[Any]]:
    # numpy, not torch: importing torch costs seconds per process on a busy machine.
    rng = np.random.default_rng(args.seed)
    buffers = [
        rng.integers(0, 256, size=(args.blocks, args.block_bytes), dtype=np.uint8)
        for _ in range(2 * NUM_LAYERS)
    ]
    geometry = CacheGeometry(
        layout=args.layout,
        block_size_tokens=16,
        dtype=args.dtype,
        regions=tuple(
            Region(
                name=f"model.layers.{i // 2}.self_attn.{'kv'[i % 2]}",
                layer=i // 2,
                base_addr=b.ctypes.data,
                block_bytes=args.block_bytes,
                block_stride=args.block_bytes,
                num_blocks=args.blocks,
            )
            for i, b in enumerate(buffers)
        ),
    )
    return geometry, buffers


@dataclass(slots=True)
class _Write:
    write_id: int
    peer: str
    our_blocks: frozenset[int]
    forgotten: bool = False  # removed with its peer before the data plane finished it


class AuditedTransport(Forwarding):
    """NIXL itself, plus a record of the writes the data plane has not finished.

    A write is finished when NIXL's own poll reports it done or failed, or when the data
    plane reports its peer gone. A write still unfinished when the runtime removes its
    peer is *forgotten*, not finished: NIXL was told to let go of it, but nothing says
    the data movement stopped reading our memory. `reading(blocks)` names the writes that
    may still read `blocks`; the engine asks it the moment the runtime hands blocks back.
    """

    def __init__(self, inner: NixlTransport) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._writes: dict[int, _Write] = {}

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            for w in self._writes.values():
                if w.peer == peer:
                    w.forgotten = True
        super().remove_peer(peer)

    def write_blocks(
        self,
        peer: str,
        write_id: int,
        our_blocks: Sequence[int],
        their_blocks: Sequence[int],
        notification: bytes | None,
        regions: Sequence[int] | None = None,
    ) -> None:
        super().write_blocks(peer, write_id, our_blocks, their_blocks, notification, regions)
        with self._lock:
            self._writes[write_id] = _Write(write_id, peer, frozenset(our_blocks))

    def poll(self) -> list[TransportEvent]:
        events = super().poll()
        with self._lock:
            for ev in events:
                match ev:
                    case WriteDone(write_id=wid) | WriteFailed(write_id=wid):
                        w = self._writes.get(wid)
                        if w is not None and not w.forgotten:
                            del self._writes[wid]
                    case PeerLost(peer=peer, reason=FailureReason.PEER_GONE):
                        for wid in [i for i, w in self._writes.items() if w.peer == peer]:
                            del self._writes[wid]
        return events

    def reading(self, blocks: Sequence[int]) -> list[str]:
        ours = set(blocks)
        with self._lock:
            return [
                f"write {w.write_id} to {w.peer} "
                f"({'forgotten by the runtime' if w.forgotten else 'in flight'})"
                for w in self._writes.values()
                if w.our_blocks & ours
            ]

    def unfinished(self) -> int:
        with self._lock:
            return len(self._writes)

    def statistics(self) -> NixlStatistics:
        return self._inner.statistics()


class Engine:
    """What the engine does with its blocks; every method runs on one thread at a time
    (the reporter thread, or the command thread under `lock`)."""

    def __init__(self, geometry: CacheGeometry, transport: AuditedTransport, seed: int) -> None:
        self.geometry = geometry
        self.transport = transport
        self.lock = threading.Lock()
        self._rng = np.random.default_rng(seed + 7919)
        self.canaries: dict[int, list[str]] = {}  # receiver block -> sums it must keep
        self.reused_source_blocks = 0

    def sums(self, blocks: list[int]) -> list[list[str]]:
        return [
            [
                hashlib.sha256(
                    ctypes.string_at(r.base_addr + b * r.block_stride, r.block_bytes)
                ).hexdigest()[:16]
                for r in self.geometry.regions
            ]
            for b in blocks
        ]

    def _fill(self, block: int) -> None:
        for r in self.geometry.regions:
            data = self._rng.integers(0, 256, size=r.block_bytes, dtype=np.uint8)
            ctypes.memmove(r.base_addr + block * r.block_stride, data.ctypes.data, r.block_bytes)

    def claim(self, blocks: list[int]) -> None:
        """The engine allocates these receiver blocks for a new transfer: no canary now."""
        with self.lock:
            for b in blocks:
                self.canaries.pop(b, None)

    def ended(self, result: TransferResult) -> dict[str, Any]:
        """The blocks are ours again: reuse them at once, as a busy engine would."""
        blocks = list(result.blocks)
        with self.lock:
            if result.side == "sender":
                still = self.transport.reading(blocks)
                for b in blocks:
                    self._fill(b)  # the next request's prefill overwrites them
                self.reused_source_blocks += len(blocks)
                return {"reused": blocks, "still_read_by": still}
            at_end = self.sums(blocks)  # what the transfer left (ok: what it delivered)
            for b in blocks:
                self._fill(b)
            for b, s in zip(blocks, self.sums(blocks), strict=True):
                self.canaries[b] = s
            return {"at_end": at_end, "canaries": blocks}

    def check(self) -> dict[str, Any]:
        with self.lock:
            blocks = sorted(self.canaries)
            now = self.sums(blocks)
            bad = [b for b, s in zip(blocks, now, strict=True) if s != self.canaries[b]]
            return {"canaries_checked": len(blocks), "canaries_overwritten": bad}


def main(argv: list[str]) -> int:
    logging.getLogger("nixl").setLevel(logging.WARNING)
    args = parse_args(argv)
    timing = TimingConfig(
        heartbeat_interval_s=args.liveness / 5,
        liveness_timeout_s=args.liveness,
        lease_s=args.lease,
        transfer_deadline_s=args.deadline,
    )
    geometry, buffers = torch_cache(args) if args.torch else numpy_cache(args)
    audited: list[AuditedTransport] = []

    def audited_nixl(agent_name: str) -> Transport:
        audited.append(AuditedTransport(NixlTransport(agent_name)))
        return audited[-1]

    # The node exactly as the README builds it: every safety check at its default.
    node = Node(
        [geometry],
        NodeIdentity(args.engine_id, args.role, args.host),
        port=args.port,
        settings=RankSettings(
            timing=timing,
            lookup_timeout_ms=1000,
            revalidate_after_s=(
                REVALIDATE_AFTER_S if args.revalidate_after is None else args.revalidate_after
            ),
            drive_in_step=not args.queue_engine_calls,
            check_compat_in_lookup=False,  # the runtime's own check names both caches
        ),
        transport_factory=audited_nixl,
    )
    node.start()
    runtime, (transport,) = node.runtime, audited
    engine = Engine(geometry, transport, args.seed)
    stop = threading.Event()

    def report() -> None:
        while not stop.is_set():
            for r in runtime.wait(timeout=0.05):
                done = engine.ended(r)  # first: the engine reuses the blocks at once
                emit(
                    "result",
                    {
                        "transfer_id": r.transfer_id,
                        "side": str(r.side),
                        "reason": None if r.reason is None else r.reason.value,
                        "detail": r.detail,
                        "blocks": list(r.blocks),
                        **done,
                    },
                )

    reporter = threading.Thread(target=report, name="chaos-peer-results")
    reporter.start()
    emit(
        "reply",
        {
            "port": node.port,
            "pid": os.getpid(),
            "agent_name": transport.agent_name,
            "incarnation": node.incarnation,
        },
    )
    try:
        _serve(runtime, engine, transport, args.host)
    finally:
        stop.set()
        reporter.join(5)
        node.close()
        del buffers  # the memory stays alive until the runtime is closed
    return 0


def _serve(runtime: PushRuntime, engine: Engine, transport: AuditedTransport, host: str) -> None:
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            reply = handle(cmd, runtime, engine, transport, host)
        except Exception as exc:
            emit(
                "reply",
                {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()},
            )
            continue
        if reply is not None:
            emit("reply", reply)


def handle(
    cmd: dict[str, Any],
    runtime: PushRuntime,
    engine: Engine,
    transport: AuditedTransport,
    host: str,
) -> dict[str, Any] | None:
    op = cmd["op"]
    if op == "send":
        with engine.lock:
            sums = engine.sums(cmd["blocks"])
        runtime.send(cmd["transfer_id"], cmd["blocks"], ready_layers=cmd.get("ready_layers"))
        return {"sums": sums}
    if op == "layers_ready":
        runtime.layers_ready(cmd["transfer_id"], cmd["layers"])
        return {"ok": True}
    if op == "stop_after":
        calls = cmd["then"]
        sums = {}
        with engine.lock:
            for c in calls:
                if c["op"] == "send":
                    sums[c["transfer_id"]] = engine.sums(c["blocks"])
        emit("reply", {"sums": sums})  # first: the test must not wait on a stopped process
        for c in calls:
            if c["op"] == "send":
                runtime.send(c["transfer_id"], c["blocks"], ready_layers=c.get("ready_layers"))
            elif c["op"] == "layers_ready":
                runtime.layers_ready(c["transfer_id"], c["layers"])
            else:
                raise ValueError(f"stop_after: cannot queue {c['op']!r}")
        # No Python runs between the last queue put and the stop (os.kill keeps the
        # GIL), so the runtime thread cannot take these calls before the process stops.
        os.kill(os.getpid(), signal.SIGSTOP)
        emit("resumed", {})
        return None
    if op == "abort":
        runtime.abort(cmd["transfer_id"])
        return {"ok": True}
    if op == "receive":
        engine.claim(cmd["blocks"])
        sender = PeerAddress(cmd.get("host", host), cmd["sender_port"], 0)
        runtime.receive(cmd["transfer_id"], sender, cmd["blocks"])
        return {"ok": True}
    if op == "checksums":
        with engine.lock:
            return {"sums": engine.sums(cmd["blocks"])}
    if op == "check":
        return engine.check()
    if op == "stats":
        s = runtime.statistics()
        t = transport.statistics()
        return {
            "in_flight": s.in_flight,
            "sending": s.sending,
            "receiving": s.receiving,
            "finished": s.finished,
            "failed": s.failed,
            "failures": s.failures,
            "blocks_held_sending": s.blocks_held_sending,
            "blocks_held_receiving": s.blocks_held_receiving,
            "duplicate_reports": getattr(s, "duplicate_reports", 0),
            "writes_posted": t.writes_posted,
            "writes_in_flight": t.writes_in_flight,
            "writes_unfinished": transport.unfinished(),
            "reused_source_blocks": engine.reused_source_blocks,
        }
    raise ValueError(f"unknown op {op!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
