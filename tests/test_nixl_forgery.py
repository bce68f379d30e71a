"""Foreign NIXL agents forging every push-protocol message beside real traffic (issue 11).

Two real ranks (`tests/runtime_peer.py`: PushRuntime + NixlTransport + side channel, each
in its own process) run real transfers while `tests/forger.py`, in a third process, sends
both of them every message kind (Register, Reject with and without an address, Cancel,
Heartbeat from either role, Done, Failed, CancelAck, and garbage) with the real engine
ids, incarnations and side-channel addresses and the very transfer ids the ranks use,
before the transfers start and while they run. Some come from an agent of its own with
the right message key (the side channel gave it, as no token is set), some from agents
that carry the real ranks' agent names but no key.

Zero real transfers lost (both sides ok, bytes compared), and every forged message
counted: in `forged_messages` (the ones with the key, under the reason the protocol
found, and the others as "bad_key") or, for the garbage, in `malformed_messages`.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from test_nixl_multiprocess import RankProcess

pytestmark = pytest.mark.nixl

FORGER = Path(__file__).with_name("forger.py")
TRANSFERS = 8
BLOCKS_PER_TRANSFER = 2
COUNTED_WITHIN_S = 30.0  # a loaded 2-core machine; counting is done in well under 1 s


class Forger:
    def __init__(self, sender_port: int, receiver_port: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(FORGER), str(sender_port), str(receiver_port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.replies: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.agents = self._reply(60)["agents"]

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("@reply "):
                self.replies.put(json.loads(line[len("@reply ") :]))
        self.replies.put({"error": f"forger exited ({self.process.wait()})"})

    def _reply(self, timeout: float) -> dict[str, Any]:
        reply = self.replies.get(timeout=timeout)
        assert "error" not in reply, reply.get("trace", reply["error"])
        return reply

    def burst(self, transfer_ids: list[str]) -> dict[str, dict[str, int]]:
        assert self.process.stdin is not None
        cmd = {"op": "burst", "transfer_ids": transfer_ids, "num_blocks": BLOCKS_PER_TRANSFER}
        self.process.stdin.write(json.dumps(cmd) + "\n")
        self.process.stdin.flush()
        sent: dict[str, dict[str, int]] = self._reply(60)["sent"]
        return sent

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.process.stdin.flush()
                self.process.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(10)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


def _add(total: dict[str, int], more: dict[str, int]) -> None:
    for k, v in more.items():
        total[k] = total.get(k, 0) + v


def test_forged_messages_from_foreign_agents_lose_no_real_transfer_and_are_all_counted() -> None:
    sender = RankProcess("engine-p", "sender", seed=1)
    receiver = RankProcess("engine-d", "receiver", seed=2)
    forger: Forger | None = None
    try:
        sender.ready()
        receiver.ready()
        forger = Forger(sender.port, receiver.port)
        tids = [f"req-{i}" for i in range(TRANSFERS)]
        sent = {"sender": {}, "receiver": {}}  # type: dict[str, dict[str, int]]
        # Before the real transfers: the ids are predicted, the engines not started.
        for side, counts in forger.burst(tids).items():
            _add(sent[side], counts)
        blocks = {
            tid: list(range(i * BLOCKS_PER_TRANSFER, (i + 1) * BLOCKS_PER_TRANSFER))
            for i, tid in enumerate(tids)
        }
        for i, tid in enumerate(tids):
            # Half the receivers come first, half the senders.
            first, second = (receiver, sender) if i % 2 else (sender, receiver)
            for rank in (first, second):
                if rank is sender:
                    sender.call(op="send", transfer_id=tid, blocks=blocks[tid])
                else:
                    target = [b + 16 for b in blocks[tid]]
                    receiver.call(
                        op="receive", transfer_id=tid, sender_port=sender.port, blocks=target
                    )
        # And while they run.
        for side, counts in forger.burst(tids).items():
            _add(sent[side], counts)

        def done(results: list[dict[str, Any]]) -> bool:
            return len({r["transfer_id"] for r in results}) == TRANSFERS

        for rank in (sender, receiver):
            results = rank.wait_results(done, timeout=60)
            assert [r for r in results if r["reason"] is not None] == [], results
            assert len(results) == TRANSFERS, results
        for tid in tids:
            ours = sender.call(op="checksums", blocks=blocks[tid])["sums"]
            theirs = receiver.call(op="checksums", blocks=[b + 16 for b in blocks[tid]])["sums"]
            assert ours == theirs, tid

        # Every forged message counted, once, on the rank it was sent to.
        for side, rank in (("sender", sender), ("receiver", receiver)):
            want = sent[side]
            end = time.monotonic() + COUNTED_WITHIN_S
            while True:
                stats = rank.call(op="stats")
                forged = dict(stats["forged_messages"])
                bad_key = forged.pop("bad_key", 0)
                counted = (sum(forged.values()), bad_key, stats["malformed_messages"])
                if counted == (want["keyed"], want["unkeyed"], want["garbage"]):
                    break
                assert time.monotonic() < end, (side, want, stats["forged_messages"], stats)
                time.sleep(0.1)
            assert stats["failed"] == 0 and stats["finished"] == TRANSFERS, stats
            assert stats["blocks_held_sending"] == stats["blocks_held_receiving"] == 0, stats
    finally:
        if forger is not None:
            forger.close()
        sender.close()
        receiver.close()
