"""A NIXL endpoint in its own process, driven by JSON lines on stdin (one reply per line).

Tests spawn it (`python tests/nixl_peer.py`), so that sender and receiver are real,
separate processes (and, for the two-host test, in separate network namespaces). Commands:

    {"op": "setup", "id": K, "layout": L, "dtype": D, "num_blocks": N, "seed": S}
        -> {"name", "metadata" (base64), "geometry" (JSON)}   new endpoint K
    {"op": "add_peer", "id": K, "name", "metadata", "geometry"}  -> {"ok": true}
    {"op": "write", "id": K, "peer", "write_id", "ours", "theirs", "notification"}
        -> {"event": "done" | "failed", "reason", "detail", "descriptors"}
    {"op": "await", "id": K, "payload"}  -> {"from": sender}   polls until it arrives
    {"op": "checksums", "id": K}  -> {"sums": [[sha256 prefix per block] per region]}
    {"op": "exit"}

Errors come back as {"error": "..."}; the process keeps serving.
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import msgspec
import numpy as np

from kvpush.bench.presets import SyntheticKVCache, synthetic_kv_cache
from kvpush.geometry import CacheGeometry
from kvpush.transports.base import MessageReceived, WriteDone, WriteFailed
from kvpush.transports.nixl import NixlTransport

TIMEOUT_S = 20.0
# NIXL logs to stdout too; replies are the lines that start with this.
REPLY_MARK = "@reply "


def fill_random(geometry: CacheGeometry, seed: int) -> None:
    """Random bytes over every region's span, whatever the layout and dtype."""
    rng = np.random.default_rng(seed)
    for region in geometry.regions:
        span = (region.num_blocks - 1) * region.block_stride + region.block_bytes
        data = rng.integers(0, 256, size=span, dtype=np.uint8)
        ctypes.memmove(region.base_addr, data.ctypes.data, span)


def checksums(geometry: CacheGeometry) -> list[list[str]]:
    return [
        [
            hashlib.sha256(
                ctypes.string_at(r.base_addr + b * r.block_stride, r.block_bytes)
            ).hexdigest()[:16]
            for b in range(r.num_blocks)
        ]
        for r in geometry.regions
    ]


class Peer:
    def __init__(self) -> None:
        self.endpoints: dict[int, tuple[NixlTransport, SyntheticKVCache]] = {}
        self.inbox: dict[int, list[MessageReceived]] = {}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "setup":
            return self.setup(cmd)
        transport, cache = self.endpoints[cmd["id"]]
        if op == "add_peer":
            geometry = msgspec.json.decode(cmd["geometry"], type=CacheGeometry)
            transport.add_peer(cmd["name"], base64.b64decode(cmd["metadata"]), geometry)
            return {"ok": True}
        if op == "write":
            return self.write(transport, cmd)
        if op == "await":
            return self.await_message(cmd["id"], transport, cmd["payload"].encode())
        if op == "checksums":
            return {"sums": checksums(cache.geometry)}
        raise ValueError(f"unknown op {op!r}")

    def setup(self, cmd: dict[str, Any]) -> dict[str, Any]:
        cache = synthetic_kv_cache(
            preset=cmd.get("preset", "tiny"),
            num_blocks=cmd["num_blocks"],
            layout=cmd["layout"],
            dtype=cmd["dtype"],
            fill=0,
        )
        if cmd.get("seed") is not None:
            fill_random(cache.geometry, cmd["seed"])
        transport = NixlTransport(cmd["name"])
        transport.start()
        transport.register_memory(cache.geometry)
        self.endpoints[cmd["id"]] = (transport, cache)
        self.inbox[cmd["id"]] = []
        return {
            "name": transport.agent_name,
            "metadata": base64.b64encode(transport.metadata()).decode(),
            "geometry": msgspec.json.encode(cache.geometry).decode(),
        }

    def write(self, transport: NixlTransport, cmd: dict[str, Any]) -> dict[str, Any]:
        write_id = cmd["write_id"]
        transport.write_blocks(
            cmd["peer"], write_id, cmd["ours"], cmd["theirs"], cmd["notification"].encode()
        )
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            for event in transport.poll():
                if isinstance(event, WriteDone) and event.write_id == write_id:
                    return {
                        "event": "done",
                        "descriptors": transport.statistics().last_write_descriptors,
                    }
                if isinstance(event, WriteFailed) and event.write_id == write_id:
                    return {"event": "failed", "reason": event.reason, "detail": event.detail}
            time.sleep(0.0002)
        return {"event": "timeout"}

    def await_message(self, key: int, transport: NixlTransport, payload: bytes) -> dict[str, Any]:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            self.inbox[key].extend(e for e in transport.poll() if isinstance(e, MessageReceived))
            for m in self.inbox[key]:
                if m.payload == payload:
                    self.inbox[key].remove(m)
                    return {"from": m.peer}
            time.sleep(0.0002)
        return {"error": f"no message {payload!r} within {TIMEOUT_S}s"}

    def close(self) -> None:
        for transport, _ in self.endpoints.values():
            transport.close()


def main() -> int:
    logging.getLogger("nixl").setLevel(logging.WARNING)
    peer = Peer()
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            try:
                reply = peer.handle(cmd)
            except Exception as exc:
                reply = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
            print(REPLY_MARK + json.dumps(reply), flush=True)
    finally:
        peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
