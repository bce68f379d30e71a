"""Server processes for the demo and the tests: start, wait until ready, stop, show logs.

A `ServerProcess` runs one `kvpush` subcommand as a child process with its output in a
log file. `start()` launches it, `wait_ready()` uses the `wait-ready` logic (a child that
dies at start-up fails at once, with its exit status and the tail of its log), and
`close()` stops it: SIGINT first, SIGKILL after a grace period, always reaped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from kvpush.config import load_token
from kvpush.errors import KVPushError, NotReady, ServerExited
from kvpush.net import http_url
from kvpush.procs.readiness import ReadyReport, wait_ready


class ServerFailed(KVPushError):
    """A server process died or never became ready; the message ends with its log tail."""


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class ServerProcess:
    """One `python -m kvpush ARGS...` child; owned by whoever calls `start()`."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        *,
        host: str,
        port: int,
        log_dir: Path,
        side_channel_port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.args = list(args)
        self.host = host
        self.port = port
        self.side_channel_port = side_channel_port
        self.log_path = log_dir / f"{name}.log"
        self._env = env
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError(f"{self.name} already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        env = dict(os.environ if self._env is None else self._env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvpush", *self.args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )

    def wait_ready(self, timeout_s: float = 60.0, health_path: str = "/health") -> ReadyReport:
        if self._proc is None:
            raise RuntimeError(f"{self.name} not started")
        side = (self.host, self.side_channel_port) if self.side_channel_port is not None else None
        # Its side channel is asked with the secret the server was given, if any.
        token_file = None
        if "--token-file" in self.args[:-1]:
            token_file = self.args[self.args.index("--token-file") + 1]
        try:
            return wait_ready(
                self._proc,
                http_url=http_url(self.host, self.port, health_path),
                side_channel=side,
                token=load_token(token_file) if token_file is not None else None,
                timeout_s=timeout_s,
            )
        except (ServerExited, NotReady) as exc:
            raise ServerFailed(
                f"{self.name} is not ready: {exc}\n--- last lines of {self.log_path} ---\n"
                f"{log_tail(self.log_path)}"
            ) from exc

    def poll(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def kill(self) -> None:
        """SIGKILL at once (fault injection); `close()` still reaps it."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()

    def close(self, grace_s: float = 15.0) -> int | None:
        code: int | None = None
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(grace_s)
            code = proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
