"""Waiting for a freshly started server: its process, its HTTP endpoint, its side channel.

Every round checks the process first: a server that died is reported at once, with its
exit status when it is our child (a `Popen`, or a pid we forked: `cmd & exec kvpush
wait-ready --pid $!` makes the server our child), and never waited for until a deadline.
Then each check still pending gets one attempt; each has its own deadline, counted from
the start. The clock and the sleep are constructor-style arguments, so tests can drive
rounds without waiting.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpush.errors import (
    NotReady,
    PeerUnreachable,
    ServerExited,
    SideChannelError,
    UnknownRank,
)
from kvpush.net import unbracket_host, zmq_address
from kvpush.sidechannel.client import FetchResult, fetch_metadata_timed

DEFAULT_POLL_INTERVAL_S = 0.2
_ATTEMPT_TIMEOUT_S = 1.0  # longest single HTTP or side-channel attempt


@dataclass(frozen=True, slots=True)
class ReadyReport:
    """What `wait_ready` found once every check passed."""

    pid: int
    rounds: int
    elapsed_s: float
    http_status: int | None  # None when no HTTP check was asked for
    side_channel: FetchResult | None  # None when no side-channel check was asked for


def process_exit(process: subprocess.Popen[Any] | int) -> ServerExited | None:
    """None while the process runs; otherwise how it ended, as an error to raise."""
    if isinstance(process, subprocess.Popen):
        code = process.poll()
        return None if code is None else _exited(process.pid, code)
    pid = process
    try:
        waited, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return _not_our_child_exit(pid)
    if waited == 0:
        return None
    return _exited(pid, os.waitstatus_to_exitcode(status))


def _exited(pid: int, code: int) -> ServerExited:
    if code < 0:
        return ServerExited(pid, code, f"process {pid} was killed by signal {-code}")
    return ServerExited(pid, code, f"process {pid} exited with status {code}")


def _not_our_child_exit(pid: int) -> ServerExited | None:
    unknown = "(not our child, so its exit status is unknown)"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return ServerExited(pid, None, f"process {pid} is gone {unknown}")
    except PermissionError:
        return None  # alive, and someone else's
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    if state in (b"Z", b"X"):
        return ServerExited(pid, None, f"process {pid} has exited {unknown}")
    return None


def _try_http(url: str, timeout_s: float) -> tuple[int | None, str]:
    """(2xx status, "") when it answers so, else (None, why not)."""
    # No proxies: a readiness check talks to the server itself, not through $http_proxy.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as response:
            status = int(response.status)
    except urllib.error.HTTPError as exc:
        return None, f"HTTP {exc.code} {exc.reason}"
    except urllib.error.URLError as exc:
        return None, f"{exc.reason}"
    except (OSError, ValueError) as exc:
        return None, str(exc) or type(exc).__name__
    if 200 <= status < 300:
        return status, ""
    return None, f"HTTP {status}"


def wait_ready(
    process: subprocess.Popen[Any] | int,
    *,
    http_url: str | None = None,
    side_channel: tuple[str, int] | None = None,
    rank: int = 0,
    token: str | None = None,
    timeout_s: float = 60.0,
    http_timeout_s: float | None = None,
    side_channel_timeout_s: float | None = None,
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> ReadyReport:
    """Wait until the server is up: process alive, HTTP 2xx, side channel answering.

    Raises `ServerExited` as soon as a round finds the process ended, `NotReady` naming
    the check whose deadline passed (or that failed for good: a refused token, an
    incompatible peer).
    """
    pid = process.pid if isinstance(process, subprocess.Popen) else process
    started = clock()
    deadlines: dict[str, float] = {}
    if http_url is not None:
        deadlines["http"] = started + (http_timeout_s if http_timeout_s is not None else timeout_s)
    if side_channel is not None:
        sc_timeout = side_channel_timeout_s if side_channel_timeout_s is not None else timeout_s
        deadlines["side channel"] = started + sc_timeout
    last_error = dict.fromkeys(deadlines, "not tried yet")
    http_status: int | None = None
    fetched: FetchResult | None = None
    rounds = 0
    while True:
        rounds += 1
        exited = process_exit(process)
        if exited is not None:
            raise exited
        now = clock()
        if http_url is not None and http_status is None:
            attempt = max(0.05, min(_ATTEMPT_TIMEOUT_S, deadlines["http"] - now))
            http_status, last_error["http"] = _try_http(http_url, attempt)
        if side_channel is not None and fetched is None:
            fetched, last_error["side channel"] = _try_side_channel(
                side_channel, rank, token, deadlines["side channel"] - clock()
            )
        pending = [
            name
            for name, done in (("http", http_status), ("side channel", fetched))
            if name in deadlines and done is None
        ]
        if not pending:
            return ReadyReport(pid, rounds, clock() - started, http_status, fetched)
        now = clock()
        for name in pending:
            if now >= deadlines[name]:
                target = http_url if name == "http" else _side_channel_text(side_channel)
                raise NotReady(
                    name,
                    f"{target} not ready within {deadlines[name] - started:.1f} s "
                    f"(process {pid} still running): {last_error[name]}",
                )
        next_deadline = min(deadlines[name] for name in pending)
        sleep(max(0.0, min(poll_interval_s, next_deadline - now)))


def _side_channel_text(side_channel: tuple[str, int] | None) -> str:
    if side_channel is None:
        return "side channel"
    return f"side channel {zmq_address(*side_channel)}"


def _try_side_channel(
    side_channel: tuple[str, int], rank: int, token: str | None, left_s: float
) -> tuple[FetchResult | None, str]:
    host, port = side_channel
    timeout_ms = max(50, int(min(_ATTEMPT_TIMEOUT_S, left_s) * 1000))
    try:
        return fetch_metadata_timed(host, port, rank, timeout_ms=timeout_ms, token=token), ""
    except (PeerUnreachable, UnknownRank) as exc:
        # Not listening yet, or its ranks are still coming up: try again next round.
        return None, f"{type(exc).__name__}: {exc}"
    except SideChannelError as exc:
        # A refused token or an incompatible peer does not get better by waiting.
        raise NotReady(
            "side channel", f"{_side_channel_text(side_channel)}: {type(exc).__name__}: {exc}"
        ) from exc


# The lowest port `free_port` hands out; it picks below the OS's ephemeral range.
_LOWEST_PICKED_PORT = 20000
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int] | None:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return None
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host`, for a server started next to bind.

    Where the OS says which ports it hands out itself (Linux), the port is picked at
    random below that ephemeral range: every socket bound to port 0 (a server's own
    internal sockets, vLLM's and ZeroMQ's included) and the source port of every
    outgoing connection come from that range, so none of them can take the port before
    the server binds it. A port is never handed out twice by one process; another
    process calling this may still pick the same one, rarely."""
    bare = unbracket_host(host)
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    ephemeral = _ephemeral_range()
    if ephemeral is not None and ephemeral[0] > _LOWEST_PICKED_PORT + 1000:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(_LOWEST_PICKED_PORT, ephemeral[0])
            if port in _handed_out:
                continue
            with socket.socket(family, socket.SOCK_STREAM) as s:
                try:
                    s.bind((bare, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((bare, 0))
        return int(s.getsockname()[1])
