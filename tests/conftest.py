"""Shared fixtures: free ports, `kvpush` subprocesses, a live `kvpush endpoint`, and a
tiny model on disk. Helpers that are not fixtures live in `helpers/`."""

from __future__ import annotations

import os
import re
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

# Modules that run last in their pytest run. `make test` runs the vLLM-server tests beside
# the rest, and the rest ends first (about 20 of 35 minutes): a module whose vLLM engines
# keep the host's cores busy runs once the other half is over. The data-parallel
# engines spin while their transfers wait (docs/vllm.md, "Data parallelism on this
# host"); beside the other half's kvpush servers starting, a fresh-clone run lost a DP
# round to a transfer deadline and the other half's P/D stack its readiness wait.
RUN_LAST = ("test_vllm_e2e_dp.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`RUN_LAST` modules after every other test, each keeping its own order."""
    items.sort(key=lambda item: item.path.name in RUN_LAST)


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


class _Output:
    """A process's output, read line by line by one thread from its start to its end.

    One reader, never a selector on the pipe: a selector wakes only for bytes still in
    the pipe, not for lines already in the reader's buffer (an endpoint that prints its
    ready line with two before it, then falls quiet, would look never ready)."""

    def __init__(self, process: subprocess.Popen[str], name: str) -> None:
        self.lines: list[str] = []
        self._ended = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(process,), name=name)
        self._thread.start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            with self._cv:
                self.lines.append(line)
                self._cv.notify_all()
        with self._cv:
            self._ended = True
            self._cv.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> tuple[str, re.Match[str]] | None:
        """The first line matching `pattern`, or None once the output ends or `timeout`
        passes without one."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cv:
            while True:
                for line in self.lines[seen:]:
                    if match := re.search(pattern, line):
                        return line, match
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if self._ended or left <= 0:
                    return None
                self._cv.wait(left)

    def text(self) -> str:
        with self._cv:
            return "".join(self.lines)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


@dataclass
class Endpoint:
    """A `kvpush endpoint` process, its output read by one thread from its start (so
    that a chatty endpoint never blocks on a full pipe); `stop()` hands that output
    over in `output`."""

    process: subprocess.Popen[str]
    host: str
    port: int
    ready_line: str
    _out: _Output
    output: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def printed(self) -> str:
        """Everything it printed so far (for a failure's message)."""
        return "".join(self.output) if self.output else self._out.text()

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
            assert self.process.stdout is not None
            self._out.join(timeout)
            self.process.stdout.close()
        self.output.append(self._out.text())
        return self.process.returncode


def start_endpoint(*args: str, host: str = "127.0.0.1", timeout: float = 60) -> Endpoint:
    process = subprocess.Popen(
        [*KVPUSH, "endpoint", "--host", host, "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "KVPUSH_TOKEN"},
    )
    out = _Output(process, f"endpoint-{process.pid}-output")
    found = out.wait_for(r"ready: .* port=(\d+)", timeout)
    if found is not None:
        line, match = found
        return Endpoint(process, host, int(match.group(1)), line, out)
    process.kill()
    process.wait()
    out.join(5.0)
    raise AssertionError(f"endpoint never became ready: {out.text()}")


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
