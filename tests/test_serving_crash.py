"""A decode that dies, a decode that stops for a while, a prefill told to stop (issue 39):
`kvpush serve` processes over real NIXL, real signals.

What holds (the bounds: docs/serving.md, "When a server dies or is stopped"):

* a decode killed (SIGKILL) while a prefill holds its requests' KV, registered or not,
  costs the prefill those blocks for at most the claim window (unregistered: from the
  last claim, or the submit) or the liveness timeout (registered), not the deadline;
* a decode stopped (SIGSTOP) for less than the claim window, with a request queued,
  still receives that request's KV once it runs again;
* a prefill told to stop (SIGTERM) finishes what a decode registers for while it drains,
  tells every decode it registered with but never sent to, and exits within its bound;
  the decode learns at once, not at its deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpush.demo.run import metric_values
from kvpush.procs.readiness import free_port
from kvpush.procs.server_process import ServerProcess, log_tail

# Servers to start and stop, on a loaded host each a minute or more: setup, a test and
# the module's teardown count against one test's timeout.
pytestmark = [pytest.mark.nixl, pytest.mark.timeout(300)]

HOST = "127.0.0.1"
WINDOW_S = 4.0  # the prefill's --claim-window-s
LIVENESS_S = 3.0  # TimingConfig's default liveness timeout
DEADLINE_S = 120.0  # --transfer-deadline-s: what held blocks until before claims
# The decode cache holds one request of these (about 58 blocks of 8 tokens) at a time:
# a second one queues for blocks, and the decode claims it meanwhile.
DECODE_BLOCKS = 90
# Generous for a loaded 2-core host, and still far below the deadline.
SLACK_S = 6.0


def _prompt(i: int) -> str:
    return f"request {i}: " + "kv " * 150


def _short(i: int) -> str:
    return f"request {i}: " + "kv " * 8


def _serve(name: str, model_dir: Path, log_dir: Path, role: str, *extra: str) -> ServerProcess:
    port, side = free_port(HOST), free_port(HOST)
    args = ["serve", "--role", role, "--model", str(model_dir), "--host", HOST]
    args += ["--port", str(port), "--side-channel-port", str(side), "--block-size", "8"]
    args += ["--transfer-deadline-s", str(DEADLINE_S), *extra]
    return ServerProcess(name, args, host=HOST, port=port, log_dir=log_dir, side_channel_port=side)


@pytest.fixture(scope="module")
def servers(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """One prefill and one decode for the module; its last test kills the decode."""
    logs = tmp_path_factory.mktemp("crash-logs")
    prefill = _serve("prefill", model_dir, logs, "prefill", "--claim-window-s", str(WINDOW_S))
    decode = _serve("decode", model_dir, logs, "decode", "--num-blocks", str(DECODE_BLOCKS))
    prefill.start()
    decode.start()
    try:
        prefill.wait_ready(120)
        decode.wait_ready(120)
        yield prefill, decode
    finally:
        for server in (decode, prefill):
            if server.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server.pid, signal.SIGCONT)  # a stopped one must be able to end
            server.close()


def _held(server: ServerProcess) -> float:
    return metric_values(httpx.get(f"{server.url}/metrics", timeout=10).text)[
        "kvpush_kv_blocks_held"
    ]


def _transfers(server: ServerProcess) -> dict[str, Any]:
    """The runtime's figures in the server's /health."""
    transfers: dict[str, Any] = httpx.get(f"{server.url}/health", timeout=10).json()["transfers"]
    return transfers


def _sending(server: ServerProcess) -> dict[str, int]:
    return dict(_transfers(server)["sending"])


def _until(predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.05) -> float | None:
    """Seconds until `predicate()` held, or None if it did not within `timeout_s`."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            return None
        time.sleep(step_s)


def _prefill_leg(prefill: ServerProcess, tid: str, prompt: str) -> None:
    r = httpx.post(
        f"{prefill.url}/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": 4,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid},
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text


class DecodeLeg(threading.Thread):
    """A decode leg, sent on a thread of its own (it waits for the KV); its response,
    or the error that ended it, once joined."""

    def __init__(
        self,
        decode: ServerProcess,
        prefill: ServerProcess,
        tid: str,
        prompt: str,
        timeout_s: float = 90.0,
    ) -> None:
        super().__init__(daemon=True)
        self.body = {
            "prompt": prompt,
            "max_tokens": 4,
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "transfer_id": tid,
                "remote_host": HOST,
                "remote_port": prefill.side_channel_port,
            },
        }
        self.url = f"{decode.url}/v1/completions"
        self.timeout_s = timeout_s
        self.response: httpx.Response | None = None
        self.error: Exception | None = None
        self.ended_at: float | None = None
        self.start()

    def run(self) -> None:
        try:
            self.response = httpx.post(self.url, json=self.body, timeout=self.timeout_s)
        except Exception as exc:  # the decode died under it: that is the test's point
            self.error = exc
        self.ended_at = time.monotonic()


def _state(prefill: ServerProcess, state: str, n: int) -> Callable[[], bool]:
    return lambda: _sending(prefill).get(state, 0) == n


def test_a_decode_stopped_for_less_than_the_window_still_receives_its_kv(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    prefill, decode = servers
    run = uuid.uuid4().hex[:8]
    finished = _transfers(prefill)["finished"]
    # A request whose KV never comes fills the decode's cache; its client gives up
    # after a while, which frees its blocks (the decode aborts it).
    blocker = DecodeLeg(decode, prefill, f"block-{run}", _prompt(0), timeout_s=WINDOW_S * 3)
    assert _until(_state(prefill, "registered", 1), 60) is not None, _sending(prefill)
    tid = f"slow-{run}"
    _prefill_leg(prefill, tid, _prompt(1))
    slow = DecodeLeg(decode, prefill, tid, _prompt(1))
    assert _until(lambda: _transfers(decode)["claimed"] == 1, 30) is not None
    time.sleep(WINDOW_S * 1.25)  # queued past one window: the claims keep it
    assert _sending(prefill).get("awaiting_register") == 1
    assert decode.pid is not None
    os.kill(decode.pid, signal.SIGSTOP)
    time.sleep(WINDOW_S - 1.5)  # no claims, no heartbeats, for most of a window
    os.kill(decode.pid, signal.SIGCONT)
    slow.join(90)
    blocker.join(30)
    assert slow.error is None and slow.response is not None, slow.error
    assert slow.response.status_code == 200, slow.response.text
    assert slow.response.json()["choices"][0]["text"]
    health = _transfers(prefill)
    assert health["finished"] == finished + 1 and health["blocks_held_sending"] == 0, health


def test_a_prefill_told_to_stop_drains_tells_its_decodes_and_exits_within_its_bound(
    servers: tuple[ServerProcess, ServerProcess],
    model_dir: Path,
    tmp_path: Path,
    record_property: Callable[[str, object], None],
) -> None:
    drain_s = 3.0
    prefill = _serve("prefill-drain", model_dir, tmp_path, "prefill", "--drain-s", str(drain_s))
    _, decode = servers  # short prompts: three fit in its cache at once
    prefill.start()
    try:
        prefill.wait_ready(120)
        run = uuid.uuid4().hex[:8]
        # Held, registered, never computed: the decode registered (legs at once).
        orphans = [DecodeLeg(decode, prefill, f"orphan-{run}-{i}", _short(i)) for i in (0, 1)]
        assert _until(_state(prefill, "registered", 2), 60) is not None, _sending(prefill)
        # Held, computed, not registered yet: its decode leg is on its way.
        tid = f"late-{run}"
        _prefill_leg(prefill, tid, _short(2))
        assert prefill.pid is not None
        os.kill(prefill.pid, signal.SIGTERM)
        stopped_at = time.monotonic()
        late = DecodeLeg(decode, prefill, tid, _short(2))  # during the drain: finishes
        # HTTP's own grace (5 s, for legs in flight), the drain, the runtime's close (5 s),
        # then the interpreter's exit, which a loaded host slows most (the SIGTERM test of
        # test_serving_pd.py allows 30 s for an idle server).
        bound = 5.0 + drain_s + 5.0
        exited = _until(lambda: prefill.poll() is not None, bound + 30.0)
        assert exited is not None, f"the prefill did not exit within {bound + 30.0}s"
        assert prefill.poll() == 0, log_tail(prefill.log_path)
        record_property("prefill_exit_after_sigterm_s", exited)
        late.join(60)
        assert late.response is not None and late.response.status_code == 200, (
            late.error or late.response.text  # type: ignore[union-attr]
        )
        for leg in orphans:
            leg.join(60)
            assert leg.response is not None, leg.error
            assert leg.response.status_code == 502, leg.response.text
            message = leg.response.json()["error"]["message"]
            assert "shutting down" in message, message
            assert leg.ended_at is not None and leg.ended_at - stopped_at < bound + SLACK_S
        told = max(leg.ended_at - stopped_at for leg in orphans if leg.ended_at is not None)
        record_property("decode_told_after_prefill_sigterm_s", told)
        print(f"\nits decodes told {told:.2f}s and the prefill exited {exited:.2f}s after SIGTERM")
        # The decode holds nothing for the requests that ended.
        assert _until(lambda: _held(decode) == 0, 30) is not None
    finally:
        prefill.close()


def test_a_killed_decode_costs_the_prefill_its_blocks_for_the_bound_not_the_deadline(
    servers: tuple[ServerProcess, ServerProcess], record_property: Callable[[str, object], None]
) -> None:
    prefill, decode = servers
    run = uuid.uuid4().hex[:8]
    before = _transfers(prefill)["failures"]
    # Registered: the decode leg first (legs at once); the decode takes its blocks and
    # registers, and the prefill has not computed yet.
    registered = DecodeLeg(decode, prefill, f"reg-{run}", _prompt(0))
    assert _until(_state(prefill, "registered", 1), 60) is not None, _sending(prefill)
    # Claimed: computed and held by the prefill, queued at the decode (its cache is full).
    claimed = [f"claim-{run}-{i}" for i in (1, 2)]
    for i, tid in enumerate(claimed, 1):
        _prefill_leg(prefill, tid, _prompt(i))
    queued = [DecodeLeg(decode, prefill, tid, _prompt(i)) for i, tid in enumerate(claimed, 1)]
    assert _until(lambda: _transfers(decode)["claimed"] == 2, 30) is not None
    # Longer than a window: only the decode's claims keep these.
    time.sleep(WINDOW_S * 1.5)
    assert _sending(prefill).get("awaiting_register") == 2, "claims did not keep them"
    # Unregistered, unclaimed: its decode leg never reached a decode.
    _prefill_leg(prefill, f"lost-{run}", _prompt(3))
    assert decode.pid is not None
    os.kill(decode.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    # The registered request's prefill now computes and holds its KV for a dead decode.
    _prefill_leg(prefill, f"reg-{run}", _prompt(0))
    bound = WINDOW_S + SLACK_S
    freed = _until(lambda: _held(prefill) == 0, bound)
    assert freed is not None, f"still {_held(prefill)} blocks held {bound}s after the kill"
    freed_after = time.monotonic() - killed_at
    record_property("prefill_blocks_freed_after_decode_sigkill_s", freed_after)
    print(f"\nprefill blocks all freed {freed_after:.2f}s after the decode's SIGKILL")
    assert freed_after < DEADLINE_S / 10
    health = _transfers(prefill)
    assert health["sending"] == {} and health["blocks_held_sending"] == 0
    # Each ended failed with a reason (the registered one's peer, the others' window).
    failures = {k: n - before.get(k, 0) for k, n in health["failures"].items()}
    assert sum(failures.values()) == 4, failures
    assert {k for k, n in failures.items() if n} <= {"peer_timeout", "peer_gone", "write_error"}
    for leg in (registered, *queued):
        leg.join(30)
        assert leg.error is not None or leg.response is None or leg.response.status_code >= 500
