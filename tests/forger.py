"""Foreign NIXL agents in their own process, forging push-protocol messages at two real
ranks (`tests/runtime_peer.py` processes), driven by JSON lines on stdin.

It reads both ranks' metadata from their side channels, as any peer may (no token is
configured, so their message keys come with it), and runs three NIXL agents:

- `own`: a name of its own. It sends every message kind with the right message key,
  each claiming to come from the other rank (its engine id, incarnation and side-channel
  address), for transfer ids the test predicts: identity must come from who sent it.
- two name thieves, each named as one real rank's agent, sending the same messages to
  the other rank without the key (they hold the NIXL metadata, not the side channel's
  word): the data plane reports them under the real names, so only the key tells.
- `rival`: an agent with registered memory and a side channel of its own that serves it
  as a new incarnation of the receiver's engine (compatible cache, as a peer the token
  admits could run). It sends the sender Registers naming that side channel: a sender
  that knows the receiver's engine must ask its side channel again, find it still
  running, and refuse. (To a sender that never heard of that engine, such a Register is
  a new receiver like any other: see "Who sent it" in `kvpush.protocol.state`.)

    python tests/forger.py SENDER_PORT RECEIVER_PORT
        -> first line: @reply {"agents": [...]}
    {"op": "burst", "transfer_ids": [...], "num_blocks": N, "rival": bool}
        -> {"sent": {"sender"|"receiver": {"keyed": n, "unkeyed": n, "garbage": n}}}
        (keyed: with the key, from `own` and `rival`; unkeyed: from the thieves)
    {"op": "exit"}
"""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import msgspec
import numpy as np

from kvpush.config import SideChannelConfig
from kvpush.errors import FailureReason
from kvpush.geometry import CacheGeometry
from kvpush.protocol.messages import (
    Cancel,
    CancelAck,
    Done,
    Failed,
    Heartbeat,
    Message,
    Register,
    Reject,
    encode,
)
from kvpush.sidechannel import PeerMetadata, fetch_metadata
from kvpush.sidechannel.server import MetadataServer
from kvpush.transports._nixl_import import load_nixl
from kvpush.transports.nixl import NixlTransport

HOST = "127.0.0.1"
GARBAGE = b"\xc1 not a message"


def emit(body: dict[str, Any]) -> None:
    print(f"@reply {json.dumps(body)}", flush=True)


def forgeries(tid: str, claimed: PeerMetadata, port: int, num_blocks: int) -> list[Message]:
    """Every message kind, each as if `claimed` (whose side channel is at `port`) sent it."""
    now = time.monotonic()
    engine, inc = claimed.engine_id, claimed.incarnation
    blocks = tuple(range(num_blocks))
    named = {
        "receiver_engine_id": engine,
        "receiver_incarnation": inc,
        "receiver_host": HOST,
        "receiver_port": port,
    }
    # An older kvpush's Reject names nobody (so that the check against it runs too).
    named = {k: v for k, v in named.items() if k in Reject.__struct_fields__}
    return [
        Register(tid, engine, inc, HOST, port, 0, blocks, 0, sent_at=now),
        Reject(tid, "forged", FailureReason.REJECTED, **named),
        Reject(tid, "forged, naming nobody"),
        Cancel(tid, FailureReason.CANCELLED, "forged"),
        Heartbeat("receiver", engine, inc, (tid,), sent_at=now, echo=now),
        Done(tid, num_blocks),
        Failed(tid, FailureReason.PEER_GONE, "forged"),
        CancelAck(tid),
        Heartbeat("sender", engine, inc, (tid,), sent_at=now),
    ]


def agent_with_memory_like(
    name: str, shape: PeerMetadata, peer: PeerMetadata
) -> tuple[NixlTransport, CacheGeometry, list[Any]]:
    """A started NIXL agent named `name-...`, loaded with `peer`, that registered a cache
    of `shape`'s geometry in zeroed memory of its own (kept alive by the list)."""
    buffers = [
        np.zeros(r.num_blocks * r.block_stride, dtype=np.uint8) for r in shape.geometry.regions
    ]
    geometry = msgspec.structs.replace(
        shape.geometry,
        regions=tuple(
            msgspec.structs.replace(r, base_addr=b.ctypes.data)
            for r, b in zip(shape.geometry.regions, buffers, strict=True)
        ),
    )
    transport = NixlTransport(f"{name}-{uuid.uuid4().hex[:8]}")
    transport.start()
    transport.register_memory(geometry)
    transport.add_peer(peer.agent_name, peer.agent_metadata, peer.geometry)
    return transport, geometry, buffers


def rival_endpoint(
    impersonated: PeerMetadata, peer: PeerMetadata
) -> tuple[NixlTransport, MetadataServer, list[Any]]:
    """An endpoint whose side channel serves it as a new incarnation of `impersonated`'s
    engine, with a cache of the same shape in memory of its own, loaded with `peer`."""
    transport, geometry, buffers = agent_with_memory_like("rival", impersonated, peer)
    ranks = {
        0: msgspec.structs.replace(
            impersonated,
            incarnation="forged",
            agent_name=transport.agent_name,
            agent_metadata=transport.metadata(),
            geometry=geometry,
            message_key=b"",
        )
    }
    server = MetadataServer(HOST, 0, SideChannelConfig(), ranks)
    server.start()
    return transport, server, buffers


def main(argv: list[str]) -> int:
    logging.getLogger("nixl").setLevel(logging.WARNING)
    ports = {"sender": int(argv[0]), "receiver": int(argv[1])}
    meta = {side: fetch_metadata(HOST, port, 0) for side, port in ports.items()}
    other = {"sender": "receiver", "receiver": "sender"}
    # getattr: an older kvpush publishes no key (and checks none).
    key = {side: getattr(m, "message_key", b"") for side, m in meta.items()}
    nixl = load_nixl()

    def agent(name: str) -> Any:
        config = nixl.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]
        )
        return nixl.nixl_agent(name, config)

    own = agent(f"forger-{uuid.uuid4().hex[:8]}")
    for m in meta.values():
        own.add_remote_agent(m.agent_metadata)
    # thieves[target]: an agent named as the target's counterpart, loaded with the target.
    thieves = {side: agent(meta[other[side]].agent_name) for side in meta}
    for side, thief in thieves.items():
        thief.add_remote_agent(meta[side].agent_metadata)
    agents = [own, *thieves.values()]
    rival, rival_server, rival_memory = rival_endpoint(meta["receiver"], meta["sender"])
    names = [own.name, *(t.name for t in thieves.values()), rival.agent_name]
    emit({"agents": names, "rival_port": rival_server.port})

    def pump(seconds: float) -> None:
        # UCX progresses only when polled: sends complete here.
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for a in agents:
                a.get_new_notifs()
            rival.poll()
            time.sleep(0.005)

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            sent: dict[str, dict[str, int]] = {}
            for side, target in meta.items():
                claimed = meta[other[side]]
                counts = sent[side] = {"keyed": 0, "unkeyed": 0, "garbage": 0}
                for tid in cmd["transfer_ids"]:
                    for message in forgeries(tid, claimed, ports[other[side]], cmd["num_blocks"]):
                        payload = encode(message)
                        own.send_notif(target.agent_name, key[side] + payload)
                        thieves[side].send_notif(target.agent_name, payload)
                        counts["keyed"] += 1
                        counts["unkeyed"] += 1
                    own.send_notif(target.agent_name, key[side] + GARBAGE)
                    counts["garbage"] += 1
                    if side == "sender" and cmd.get("rival"):
                        claimed = meta["receiver"]
                        blocks = tuple(range(cmd["num_blocks"]))
                        register = Register(
                            tid,
                            claimed.engine_id,
                            "forged",
                            HOST,
                            rival_server.port,
                            0,
                            blocks,
                            sent_at=time.monotonic(),
                        )
                        rival.send_message(target.agent_name, key[side] + encode(register))
                        counts["keyed"] += 1
                pump(0.05)
            pump(0.5)
            emit({"sent": sent})
        except Exception as exc:
            emit({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
    pump(0.2)
    rival_server.close()
    rival.close()
    del rival_memory
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
