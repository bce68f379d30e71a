"""A whole kvpush rank in its own process: a `kvpush.node.Node` over NIXL.

Driven by JSON lines on stdin; replies `@reply {...}` and, whenever a transfer ends,
`@result {...}` (from a thread that waits on the runtime). Tests kill it with SIGKILL.
With KVPUSH_TAP, what a reader of the network sees of it (its side channel's metadata
answer, every message it sends) is written to that file (`helpers.tap`).

    [KVPUSH_TOKEN=...] [KVPUSH_TAP=FILE] [KVPUSH_HOST=::1] \
        python tests/runtime_peer.py ENGINE_ID ROLE PORT SEED [LIVENESS_S LEASE_S]
        -> first line: @reply {"port", "agent_name", "incarnation"}
    {"op": "send", "transfer_id", "blocks", "ready_layers": null | [..],
     "receiver_port": null | the decode's side-channel port (on HOST)}
    {"op": "receive", "transfer_id", "sender_port", "blocks"}
    {"op": "checksums", "blocks"}   -> {"sums": [[per region] per block]}
    {"op": "stats"}                  -> a few RuntimeStatistics fields (forged_messages too)
    {"op": "exit"}
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np

from helpers.tap import TappedTransport, record_metadata
from kvpush.config import TimingConfig
from kvpush.geometry import CacheGeometry, Region
from kvpush.node import Node, NodeIdentity, RankSettings, nixl_transport
from kvpush.runtime import PeerAddress, PushRuntime
from kvpush.transports.base import Transport

# Where its side channel listens, and where it looks its senders up (KVPUSH_HOST).
HOST = os.environ.get("KVPUSH_HOST", "127.0.0.1")
NUM_BLOCKS = 32
NUM_LAYERS = 2
BLOCK_BYTES = 2048  # one layer's K (or V) of a 16-token block: 2 heads x 32 dims x bf16
_print_lock = threading.Lock()


def emit(kind: str, body: dict[str, Any]) -> None:
    with _print_lock:
        print(f"@{kind} {json.dumps(body)}", flush=True)


def main(argv: list[str]) -> int:
    logging.getLogger("nixl").setLevel(logging.WARNING)
    engine_id, role, port, seed = argv[0], argv[1], int(argv[2]), int(argv[3])
    liveness = float(argv[4]) if len(argv) > 4 else 1.0
    lease = float(argv[5]) if len(argv) > 5 else 2.0
    timing = TimingConfig(
        heartbeat_interval_s=liveness / 5,
        liveness_timeout_s=liveness,
        lease_s=lease,
        transfer_deadline_s=30.0,
    )
    # numpy buffers, not torch: importing torch costs seconds per process on a busy machine.
    rng = np.random.default_rng(seed)
    buffers = [
        rng.integers(0, 256, size=(NUM_BLOCKS, BLOCK_BYTES), dtype=np.uint8)
        for _ in range(2 * NUM_LAYERS)
    ]
    geometry = CacheGeometry(
        layout="kv_separate/NHD",
        block_size_tokens=16,
        dtype="bfloat16",
        regions=tuple(
            Region(
                name=f"model.layers.{i // 2}.attn.{'kv'[i % 2]}",
                layer=i // 2,
                base_addr=b.ctypes.data,
                block_bytes=BLOCK_BYTES,
                block_stride=BLOCK_BYTES,
                num_blocks=NUM_BLOCKS,
            )
            for i, b in enumerate(buffers)
        ),
    )

    tap = os.environ.get("KVPUSH_TAP")

    def transport(name: str) -> Transport:
        inner = nixl_transport(name)
        return inner if tap is None else TappedTransport(inner, Path(tap))

    node = Node(
        [geometry],
        NodeIdentity(engine_id, role, HOST),
        port=port,
        transport_factory=transport,
        settings=RankSettings(
            token=os.environ.get("KVPUSH_TOKEN"),
            timing=timing,
            lookup_timeout_ms=1000,
            check_compat_in_lookup=False,
        ),
    )
    node.start()
    runtime = node.runtime
    if tap is not None:
        record_metadata(Path(tap), runtime.local_metadata())
    stop = threading.Event()

    def report() -> None:
        while not stop.is_set():
            for r in runtime.wait(timeout=0.1):
                emit(
                    "result",
                    {
                        "transfer_id": r.transfer_id,
                        "side": str(r.side),
                        "reason": None if r.reason is None else r.reason.value,
                        "detail": r.detail,
                    },
                )

    reporter = threading.Thread(target=report, name="runtime-peer-results")
    reporter.start()
    emit(
        "reply",
        {"port": node.port, "agent_name": runtime.agent_name, "incarnation": node.incarnation},
    )
    try:
        _serve(runtime, geometry, buffers)
    finally:
        stop.set()
        reporter.join(5)
        node.close()
    return 0


def _serve(runtime: PushRuntime, geometry: CacheGeometry, buffers: list[Any]) -> None:
    """Answer commands until stdin closes or says exit (`buffers` keeps the memory alive)."""
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            emit("reply", handle(cmd, runtime, geometry))
        except Exception as exc:
            emit(
                "reply",
                {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()},
            )


def handle(cmd: dict[str, Any], runtime: PushRuntime, geometry: Any) -> dict[str, Any]:
    op = cmd["op"]
    if op == "send":
        port = cmd.get("receiver_port")
        receiver = None if port is None else PeerAddress(HOST, port, 0)
        runtime.send(
            cmd["transfer_id"],
            cmd["blocks"],
            ready_layers=cmd.get("ready_layers"),
            receiver=receiver,
        )
        return {"ok": True}
    if op == "layers_ready":
        runtime.layers_ready(cmd["transfer_id"], cmd["layers"])
        return {"ok": True}
    if op == "receive":
        sender = PeerAddress(HOST, cmd["sender_port"], 0)
        runtime.receive(cmd["transfer_id"], sender, cmd["blocks"])
        return {"ok": True}
    if op == "checksums":
        return {
            "sums": [
                [
                    hashlib.sha256(
                        ctypes.string_at(r.base_addr + b * r.block_stride, r.block_bytes)
                    ).hexdigest()[:16]
                    for r in geometry.regions
                ]
                for b in cmd["blocks"]
            ]
        }
    if op == "stats":
        s = runtime.statistics()
        return {
            "in_flight": s.in_flight,
            "finished": s.finished,
            "failed": s.failed,
            "failures": s.failures,
            "blocks_held_sending": s.blocks_held_sending,
            "blocks_held_receiving": s.blocks_held_receiving,
            "duplicate_reports": s.duplicate_reports,
            "peers": s.peers,
            "writes_in_flight": s.writes_in_flight,
            "stale_registers": s.stale_registers,
            "wrong_receivers": getattr(s, "wrong_receivers", 0),
            "malformed_messages": s.malformed_messages,
            # getattr: so that this script also drives an older kvpush (the check that
            # tests/test_nixl_forgery.py fails there).
            "forged_messages": getattr(s, "forged_messages", {}),
            "sending": s.sending,
            "receiving": s.receiving,
        }
    raise ValueError(f"unknown op {op!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
