"""Shared fixtures: free ports, `kvpush` subprocesses, a live `kvpush endpoint`, and a
tiny model on disk. Helpers that are not fixtures live in `helpers/`."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers.wire import Wire
from kvpush.procs.readiness import free_port  # noqa: F401 (re-exported for the tests)

KVPUSH = [sys.executable, "-m", "kvpush"]


def run_kvpush(
    *args: str, timeout: float = 30, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m kvpush ARGS`, captured. Raises if it outlives `timeout` (a hang is a bug)."""
    # An inherited $KVPUSH_TOKEN would change what the command does; tests pass their own.
    full_env = {k: v for k, v in os.environ.items() if k != "KVPUSH_TOKEN"}
    full_env.update(env or {})
    return subprocess.run(
        [*KVPUSH, *args], check=False, capture_output=True, text=True, timeout=timeout, env=full_env
    )


@dataclass
class Endpoint:
    """A `kvpush endpoint` process, started and read until its ready line; from then on
    a thread keeps reading what it prints (so that a chatty endpoint never blocks on a
    full pipe), and `stop()` hands it over."""

    process: subprocess.Popen[str]
    host: str
    port: int
    ready_line: str
    output: list[str] = field(default_factory=list)
    _rest: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    def __post_init__(self) -> None:
        self._reader = threading.Thread(target=self._read, name=f"endpoint-{self.port}-output")
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._rest.append(line)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def printed(self) -> str:
        """Everything it printed so far (for a failure's message)."""
        return "".join([*self.output, *self._rest])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        """Signal it, wait for it, keep what it printed; returns its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise
        finally:
            assert self._reader is not None and self.process.stdout is not None
            self._reader.join(timeout)
            self.process.stdout.close()
        self.output.append("".join(self._rest))
        return self.process.returncode


def start_endpoint(*args: str, host: str = "127.0.0.1", timeout: float = 60) -> Endpoint:
    process = subprocess.Popen(
        [*KVPUSH, "endpoint", "--host", host, "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "KVPUSH_TOKEN"},
    )
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not selector.select(timeout=deadline - time.monotonic()):
                continue
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if match := re.search(r"ready: .* port=(\d+)", line):
                return Endpoint(process, host, int(match.group(1)), line, lines)
    process.kill()
    rest, _ = process.communicate()
    raise AssertionError(f"endpoint never became ready: {''.join(lines)}{rest}")


@pytest.fixture(scope="session")
def tiny_endpoint() -> Iterator[Endpoint]:
    """One live endpoint on 127.0.0.1 (tiny preset, 2 ranks, no token), shared by tests."""
    ep = start_endpoint("--preset", "tiny", "--blocks", "8", "--ranks", "2")
    yield ep
    ep.stop()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint on disk, built once for the session."""
    # Imported here: most tests never load a model, and this import is not cheap.
    from kvpush.serving.checkpoint import make_model

    path = tmp_path_factory.mktemp("tiny-model")
    make_model(path, seed=3)
    return path


@pytest.fixture
def wire() -> Wire:
    """A fake wire with two protocol endpoints on it: p-1 (engine-p) and d-1 (engine-d)."""
    w = Wire()
    w.add("p-1", "engine-p")
    w.add("d-1", "engine-d")
    return w


def lines_of(result: subprocess.CompletedProcess[str]) -> Sequence[str]:
    return (result.stdout + result.stderr).strip().splitlines()
