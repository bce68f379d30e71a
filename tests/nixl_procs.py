"""Drive `tests/nixl_peer.py` processes from a test: one NIXL endpoint per process."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

PEER = Path(__file__).with_name("nixl_peer.py")
REPLY_MARK = "@reply "
NUM_BLOCKS = 24


class PeerProcess:
    """`tests/nixl_peer.py` in a subprocess (optionally under a prefix such as
    `ip netns exec NS`), spoken to in JSON lines."""

    def __init__(self, prefix: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.process = subprocess.Popen(
            [*(prefix or []), sys.executable, str(PEER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=full_env,
        )
        self.noise: list[str] = []

    def send(self, **cmd: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(cmd) + "\n")
        self.process.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(REPLY_MARK):
                reply: dict[str, Any] = json.loads(line[len(REPLY_MARK) :])
                assert "error" not in reply, reply.get("trace", reply["error"])
                return reply
            self.noise.append(line)
        raise AssertionError(
            f"peer exited ({self.process.wait()}) without replying; it said: {self.noise[-20:]}"
        )

    def call(self, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.reply()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.send(op="exit")
                self.process.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


def transfer_and_check(
    sender: PeerProcess, receiver: PeerProcess, key: int, layout: str, dtype: str
) -> dict[str, Any]:
    """Set up one endpoint on each side, write a random block mapping, compare checksums."""
    name = f"{layout.replace('/', '-')}-{dtype}-{os.getpid()}-{key}"
    s = sender.call(
        op="setup",
        id=key,
        name=f"s-{name}",
        layout=layout,
        dtype=dtype,
        num_blocks=NUM_BLOCKS,
        seed=key,
    )
    r = receiver.call(
        op="setup",
        id=key,
        name=f"r-{name}",
        layout=layout,
        dtype=dtype,
        num_blocks=NUM_BLOCKS,
        seed=1000 + key,
    )
    sender.call(
        op="add_peer", id=key, name=r["name"], metadata=r["metadata"], geometry=r["geometry"]
    )
    before = receiver.call(op="checksums", id=key)["sums"]
    rng = random.Random(key)
    ours = [*rng.sample(range(NUM_BLOCKS - 4), 10), 20, 21, 22]
    theirs = rng.sample(range(NUM_BLOCKS - 4), 10)
    theirs += [b for b in range(NUM_BLOCKS) if b not in theirs][-3:]
    notification = f"done {key}"
    receiver.send(op="await", id=key, payload=notification)
    result = sender.call(
        op="write",
        id=key,
        peer=r["name"],
        write_id=key,
        ours=ours,
        theirs=theirs,
        notification=notification,
    )
    assert result["event"] == "done", result
    assert receiver.reply() == {"from": s["name"]}
    src = sender.call(op="checksums", id=key)["sums"]
    dst = receiver.call(op="checksums", id=key)["sums"]
    mapping = dict(zip(theirs, ours, strict=True))
    for region in range(len(dst)):
        for block in range(NUM_BLOCKS):
            want = src[region][mapping[block]] if block in mapping else before[region][block]
            assert dst[region][block] == want, (layout, dtype, region, block)
    return result
