"""An attacker who reads the network and sends on it, but holds no token, in its own
process, driven by JSON lines on stdin.

It knows everything a reader of the network saw of two real ranks (`tests/runtime_peer.py`
with KVPUSH_TAP: see `helpers.tap`): their side channels' metadata answers (NIXL agent
metadata, agent names, incarnations, message keys) and every data-plane message each one
has sent so far. It runs two NIXL agents, each under one real rank's agent name and
loaded with the other rank, and one under a name of its own, and sends each rank, as the
rank's real counterpart:

- every message kind (Register, Reject with and without an address, Cancel, Heartbeat of
  either role, Done, Failed, CancelAck) for the transfer ids the test gives it (live and
  predicted), with the right message key: without a MAC trailer, with a random one, and
  with the trailer of a real message;
- every real message it saw going to that rank, again (replays), and each once more with
  one byte of its body changed.

    python tests/eavesdropper.py SENDER_TAP RECEIVER_TAP SENDER_PORT RECEIVER_PORT
        -> first line: @reply {"agents": [...]}
    {"op": "burst", "transfer_ids": [...], "num_blocks": N}
        -> {"sent": {"sender": n, "receiver": n}}   (messages sent to each rank)
    {"op": "exit"}
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from forger import emit, forgeries
from helpers.tap import read_tap
from kvpush.protocol.auth import TRAILER_BYTES
from kvpush.protocol.messages import encode
from kvpush.sidechannel import PeerMetadata
from kvpush.transports._nixl_import import load_nixl

SIDES = ("sender", "receiver")
OTHER = {"sender": "receiver", "receiver": "sender"}


def main(argv: list[str]) -> int:
    logging.getLogger("nixl").setLevel(logging.WARNING)
    taps = dict(zip(SIDES, (Path(argv[0]), Path(argv[1])), strict=True))
    ports = dict(zip(SIDES, (int(argv[2]), int(argv[3])), strict=True))  # seen on the wire
    meta: dict[str, PeerMetadata] = {}
    for side, tap in taps.items():
        m, _ = read_tap(tap)
        if m is None:
            raise SystemExit(f"{tap} holds no metadata yet")
        meta[side] = m
    nixl = load_nixl()

    def agent(name: str) -> Any:
        config = nixl.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]
        )
        return nixl.nixl_agent(name, config)

    # thieves[target]: named as the target's counterpart, loaded with the target.
    thieves = {side: agent(meta[OTHER[side]].agent_name) for side in SIDES}
    own = agent(f"eavesdropper-{uuid.uuid4().hex[:8]}")
    for side, thief in thieves.items():
        thief.add_remote_agent(meta[side].agent_metadata)
        own.add_remote_agent(meta[side].agent_metadata)
    agents = [own, *thieves.values()]
    emit({"agents": [a.name for a in agents]})

    def pump(seconds: float) -> None:
        # UCX progresses only when polled: sends complete here.
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for a in agents:
                a.get_new_notifs()
            time.sleep(0.005)

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            sent = dict.fromkeys(SIDES, 0)
            for side in SIDES:
                target = meta[side].agent_name
                key = meta[side].message_key
                claimed = meta[OTHER[side]]
                # What the counterpart really sent this rank, as the network carried it.
                _, seen = read_tap(taps[OTHER[side]])
                real = [payload for to, payload in seen if to == target]
                trailer = real[-1][-TRAILER_BYTES:] if real else bytes(TRAILER_BYTES)
                payloads: list[bytes] = []
                for tid in cmd["transfer_ids"]:
                    for message in forgeries(tid, claimed, ports[OTHER[side]], cmd["num_blocks"]):
                        body = key + encode(message)
                        payloads += [body, body + os.urandom(TRAILER_BYTES), body + trailer]
                for payload in real:
                    changed = bytearray(payload)
                    changed[len(key)] ^= 0x01  # the body's first byte
                    payloads += [payload, bytes(changed)]
                for i, payload in enumerate(payloads):
                    thieves[side].send_notif(target, payload)
                    if i % 16 == 0:
                        own.send_notif(target, payload)
                        sent[side] += 1
                    sent[side] += 1
                    if i % 64 == 63:
                        pump(0.01)
                pump(0.05)
            pump(0.5)
            emit({"sent": sent})
        except Exception as exc:
            emit({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
    pump(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
