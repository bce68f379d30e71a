"""Drive `tests/nixl_peer.py` processes from a test: one NIXL endpoint per process."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

PEER = Path(__file__).with_name("nixl_peer.py")
REPLY_MARK = "@reply "
NUM_BLOCKS = 24


class ScriptProcess:
    """A test script in its own process, spoken to in JSON lines: commands on stdin, and
    `@reply {...}` lines back, read by a thread of its own (so that several processes
    come up in parallel); any other `@kind` line goes to `_line`. `capture_stderr`
    keeps its last stderr lines for failure messages (else stderr is dropped)."""

    call_timeout_s = 30.0

    def __init__(
        self,
        script: Path,
        *args: str,
        env: dict[str, str] | None = None,
        capture_stderr: bool = False,
        name: str | None = None,
    ) -> None:
        self.name = name or script.name  # in failure messages
        self.process = subprocess.Popen(
            [sys.executable, str(script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if capture_stderr else subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.stderr: list[str] = []
        self._exit_asked = False
        self.replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._readers = [threading.Thread(target=self._read, daemon=True)]
        if capture_stderr:
            self._readers.append(threading.Thread(target=self._read_stderr, daemon=True))
        for reader in self._readers:
            reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            kind, _, body = line.partition(" ")
            if kind == "@reply":
                self.replies.put(json.loads(body))
            elif kind.startswith("@"):
                self._line(kind, body)
        self.replies.put({"error": f"{self.name} exited ({self.process.wait()})"})

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr = [*self.stderr[-40:], line]

    def _line(self, kind: str, body: str) -> None:
        """A line other than a reply (`@result`, ...): ignored unless a subclass reads it."""

    def _reply(self, timeout: float | None = None) -> dict[str, Any]:
        timeout = self.call_timeout_s if timeout is None else timeout
        try:
            reply = self.replies.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"{self.name}: no reply within {timeout}s; stderr: {self.stderr}")
        assert "error" not in reply, (reply.get("trace", reply["error"]), self.stderr)
        return reply

    def tell(self, **cmd: Any) -> None:
        """Send a command without waiting for its reply (a stopped process reads it later)."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(cmd) + "\n")
        self.process.stdin.flush()

    def call(self, **cmd: Any) -> dict[str, Any]:
        self.tell(**cmd)
        return self._reply()

    def ask_to_exit(self) -> None:
        """Tell it to exit, once; `close()` then waits for it."""
        if self.process.poll() is None and not self._exit_asked:
            self._exit_asked = True
            with contextlib.suppress(OSError):  # it may have died: close() reaps it
                self.tell(op="exit")

    def close(self) -> None:
        self.ask_to_exit()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        for reader in self._readers:
            reader.join(5)


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
