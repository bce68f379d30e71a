"""A squatter in its own process: it saw a sender's metadata on the network (message key
included) but does not hold the side channel's token, and tries to take transfers.

It runs a NIXL agent with a cache of the sender's shape in memory of its own, and a side
channel of its own that answers every request with metadata naming that agent, as a
compatible receiver would, and records each request it gets. It sends the sender, with
the right key, a `Register` for each transfer id the test predicts, naming that side
channel, before the real receiver registers. A sender that believed it would write the
KV into the squatter's memory; the real transfer would then meet an id in use.

    python tests/squatter.py   (then JSON lines on stdin)
    {"op": "squat", "sender": "<hex of the sender's PeerMetadata, msgpack>",
     "transfer_ids": [...], "num_blocks": N, "host": "127.0.0.1" | "::1"}
        -> {"sent": n, "side_channel_port": port}
    {"op": "report"}  -> {"requests": n, "token_seen": bool, "bytes_written": n,
                          "notifications": n}
    {"op": "exit"}
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import msgspec
import numpy as np
import zmq

from forger import agent_with_memory_like
from kvpush.net import bracket_host
from kvpush.protocol.messages import Register, encode
from kvpush.sidechannel.wire import PeerMetadata, encode_ok
from kvpush.transports.nixl import NixlTransport


def emit(body: dict[str, Any]) -> None:
    print(f"@reply {json.dumps(body)}", flush=True)


class SquatterSideChannel:
    """A ROUTER that answers every request with `meta` (no proof: it has no token to
    make one with) and keeps what it was sent."""

    def __init__(self, meta: PeerMetadata, host: str) -> None:
        self.reply = encode_ok(meta, "0.1.0")
        self.requests: list[bytes] = []
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IPV6, 1)
        self.port = self.sock.bind_to_random_port(f"tcp://{bracket_host(host)}")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="squatter-side-channel")

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(20):
                identity, *_, request = self.sock.recv_multipart()
                self.requests.append(request)
                self.sock.send_multipart([identity, *self.reply])

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(linger=0)


def main() -> int:
    logging.getLogger("nixl").setLevel(logging.WARNING)
    endpoint: tuple[NixlTransport, SquatterSideChannel, list[Any]] | None = None
    notifications = 0
    emit({"up": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            if cmd["op"] == "squat":
                sender = msgspec.msgpack.decode(bytes.fromhex(cmd["sender"]), type=PeerMetadata)
                host = cmd["host"]
                endpoint = endpoint or squatter_endpoint(sender, host)
                transport, side_channel, _memory = endpoint
                blocks = tuple(range(cmd["num_blocks"]))
                for tid in cmd["transfer_ids"]:
                    register = Register(
                        tid,
                        "engine-squatter",
                        "1",
                        host,
                        side_channel.port,
                        0,
                        blocks,
                        sent_at=time.monotonic(),
                    )
                    transport.send_message(sender.agent_name, sender.message_key + encode(register))
                notifications += pump(transport, 0.3)
                emit({"sent": len(cmd["transfer_ids"]), "side_channel_port": side_channel.port})
            elif cmd["op"] == "report":
                assert endpoint is not None, "squat first"
                transport, side_channel, memory = endpoint
                notifications += pump(transport, 0.2)
                token = cmd["token"].encode()
                emit(
                    {
                        "requests": len(side_channel.requests),
                        "token_seen": any(token in r for r in side_channel.requests),
                        "bytes_written": int(sum(np.count_nonzero(m) for m in memory)),
                        "notifications": notifications,
                    }
                )
        except Exception as exc:
            emit({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
    if endpoint is not None:
        endpoint[1].close()
        endpoint[0].close()
    return 0


def squatter_endpoint(
    sender: PeerMetadata, host: str
) -> tuple[NixlTransport, SquatterSideChannel, list[Any]]:
    """An agent with zeroed memory of the sender's cache shape, loaded with the sender,
    and a side channel that serves it as a compatible receiver."""
    transport, geometry, memory = agent_with_memory_like("squatter", sender, sender)
    side_channel = SquatterSideChannel(
        msgspec.structs.replace(
            sender,
            engine_id="engine-squatter",
            incarnation="1",
            role="receiver",
            agent_name=transport.agent_name,
            agent_metadata=transport.metadata(),
            geometry=geometry,
            message_key=b"",
        ),
        host,
    )
    side_channel.start()
    return transport, side_channel, memory


def pump(transport: NixlTransport, seconds: float) -> int:
    """Poll for `seconds` (UCX progresses only when polled); how many events came."""
    events = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        events += len(transport.poll())
        time.sleep(0.005)
    return events


if __name__ == "__main__":
    sys.exit(main())
