"""`kvpush doctor` against live `kvpush serve` prefill/decode pairs, on 127.0.0.1 and ::1.

One pair per address family, shared by the module (servers are slow to start on a small
host); the tests that break something (a wrong token, a stopped process) leave the pair
as they found it. The cases that expect an all-ok report come first in the file (pytest
runs a module's tests in order, for each pair): later cases count in the servers'
side-channel statistics (a wrong token is a refused request there, and a warning after).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Endpoint, start_endpoint
from kvpush.bench.presets import synthetic_kv_cache
from kvpush.cli import main
from kvpush.config import SideChannelConfig
from kvpush.doctor.addresses import ResolvedAddress, SideAddress, pair_problems
from kvpush.doctor.checks import served_ranks
from kvpush.doctor.data_plane import UCX_ACTION
from kvpush.doctor_probe import DOCTOR_DIGEST, DOCTOR_WRITE
from kvpush.errors import PeerUnreachable
from kvpush.geometry import PROTOCOL_VERSION
from kvpush.net import bracket_host
from kvpush.procs.readiness import free_port
from kvpush.procs.server_process import ServerProcess
from kvpush.serving.checkpoint import make_model
from kvpush.sidechannel import MetadataServer, PeerMetadata, RequestRejected, control_request
from kvpush.sidechannel.client import fetch_metadata

pytestmark = pytest.mark.timeout(240)
servers = pytest.mark.nixl  # the cases that start prefill and decode servers (NIXL agents)

TOKEN = "doctor-test-secret"
PREFILL_BLOCKS, DECODE_BLOCKS = 40, 48
PREFILL_DEADLINE_S, DECODE_DEADLINE_S, QUEUE_TIMEOUT_S = 45.0, 50.0, 20.0
SLOW_MS = 1000.0


@dataclass
class Pair:
    host: str
    prefill: ServerProcess
    decode: ServerProcess
    token_file: Path

    def agent(self, server: ServerProcess) -> str:
        """The data-plane agent of `server`'s rank 0, as its side channel publishes it."""
        assert server.side_channel_port is not None
        return fetch_metadata(self.host, server.side_channel_port, token=TOKEN).agent_name

    def side(self, server: ServerProcess) -> str:
        assert server.side_channel_port is not None
        return f"{bracket_host(self.host)}:{server.side_channel_port}"

    def args(self, *, http: bool = True, token: bool = True) -> list[str]:
        out = ["--prefill", self.side(self.prefill), "--decode", self.side(self.decode)]
        # A loaded test host may answer slowly: the all-ok cases must not see a warning.
        out += ["--slow-round-trip-ms", str(SLOW_MS)]
        if http:
            out += ["--prefill-http", self.prefill.url, "--decode-http", self.decode.url]
        if token:
            out += ["--token-file", str(self.token_file)]
        return out


def _server(
    name: str,
    host: str,
    role: str,
    model: Path,
    log_dir: Path,
    *extra: str,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    port, side = free_port(host), free_port(host)
    args = ["serve", "--role", role, "--model", str(model), "--host", host, "--port", str(port)]
    args += ["--side-channel-port", str(side), "--block-size", "8", *extra]
    env = {k: v for k, v in os.environ.items() if k != "KVPUSH_TOKEN"} | (env or {})
    return ServerProcess(
        name, args, host=host, port=port, log_dir=log_dir, side_channel_port=side, env=env
    )


@pytest.fixture(scope="module", params=["127.0.0.1", "::1"], ids=["ipv4", "ipv6"])
def pair(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    host = request.param
    log_dir = tmp_path_factory.mktemp("doctor-logs")
    token_file = log_dir / "token"
    token_file.write_text(TOKEN)
    token = ["--token-file", str(token_file)]
    prefill = _server(
        "prefill",
        host,
        "prefill",
        model_dir,
        log_dir,
        "--num-blocks",
        str(PREFILL_BLOCKS),
        "--transfer-deadline-s",
        str(PREFILL_DEADLINE_S),
        *token,
    )
    decode = _server(
        "decode",
        host,
        "decode",
        model_dir,
        log_dir,
        "--num-blocks",
        str(DECODE_BLOCKS),
        "--transfer-deadline-s",
        str(DECODE_DEADLINE_S),
        "--queue-timeout-s",
        str(QUEUE_TIMEOUT_S),
        *token,
    )
    try:
        for s in (prefill, decode):
            s.start()
        for s in (prefill, decode):
            s.wait_ready(120)
        yield Pair(host, prefill, decode, token_file)
    finally:
        decode.close()
        prefill.close()


@pytest.fixture(autouse=True)
def _no_inherited_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # The doctor reads $KVPUSH_TOKEN when no --token-file is given; each case says its own.
    monkeypatch.delenv("KVPUSH_TOKEN", raising=False)


def _doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["doctor", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _doctor_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code, out, _ = _doctor(capsys, *args, "--json")
    return code, json.loads(out)


def _verdicts(report: dict[str, Any]) -> list[str]:
    return [s["verdict"] for s in report["steps"]]


def _findings(report: dict[str, Any], step: int, verdict: str) -> list[dict[str, Any]]:
    return [f for f in report["steps"][step - 1]["findings"] if f["verdict"] == verdict]


@servers
def test_a_healthy_pair_is_all_ok_with_figures(
    pair: Pair, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = _doctor_json(capsys, *pair.args())
    assert (code, report["verdict"], report["exit_code"]) == (0, "ok", 0), json.dumps(
        [s for s in report["steps"] if s["verdict"] != "ok"]
    )
    assert _verdicts(report) == ["ok"] * 6
    steps = {s["name"]: s for s in report["steps"]}
    # The data plane, for real: the prefill's agent wrote into the decode's scratch
    # buffer at both sizes, and the decode's digest of it matched the doctor's.
    [written] = _findings(report, 4, "ok")
    assert written["side"] == "prefill"
    assert re.fullmatch(
        r"prefill rank 0 -> decode rank 0: 64 KiB in \d+\.\d\d ms \(\d+\.\d\d GB/s\), "
        r"median of 5; 4 MiB in \d+\.\d\d ms \(\d+\.\d\d GB/s\), median of 5; the 4 MiB "
        r"landed intact \(sha256 compared\); NIXL with the UCX backend, .*; host memory on "
        r"both sides, so nothing is staged",
        written["text"],
    ), written["text"]
    figures = steps["data plane"]["figures"]["prefill0->decode0"]
    assert figures["verified_bytes"] == 4 * 1024 * 1024 and figures["their_device"] == "cpu"
    for size in (str(64 * 1024), str(4 * 1024 * 1024)):
        assert figures["sizes"][size]["writes"] == 5
        assert figures["sizes"][size]["seconds"] > 0 and figures["sizes"][size]["gb_per_s"] > 0
    assert figures["transport"]["memory"] == "DRAM"
    family = "IPv6" if ":" in pair.host else "IPv4"
    for role, server in (("prefill", pair.prefill), ("decode", pair.decode)):
        addresses = steps["addresses"]["figures"][role]
        assert addresses["advertised_host"] == pair.host
        [found] = addresses["addresses"]
        assert (found["ip"], found["family"], found["loopback"]) == (pair.host, family, True)
        assert addresses["advertised_addresses"] == []  # the same address: tried once
        assert found["tcp_ms"] > 0
        [rank] = steps["side channel"]["figures"][role]
        assert rank["rank"] == 0 and rank["protocol_version"] == PROTOCOL_VERSION
        assert rank["engine_id"].startswith(f"{role}-")
        assert rank["role"] == ("sender" if role == "prefill" else "receiver")
        assert "works behind" in steps["compatibility"]["figures"]["pair"]["routers"]
        [geometry] = steps["compatibility"]["figures"][role]
        blocks = PREFILL_BLOCKS if role == "prefill" else DECODE_BLOCKS
        assert (geometry["block_size_tokens"], geometry["num_blocks"]) == (8, blocks)
        assert geometry["num_layers"] == 2 and geometry["devices"] == ["cpu"]
        live = steps["liveness and clocks"]["figures"][role]
        rtt = live["side_channel_round_trip_ms"]
        assert 0 < rtt["min"] <= rtt["median"] <= rtt["max"] and rtt["samples"] == 5
        health = steps["health"]["figures"][role]
        assert health["status"] == "ok"
        assert (health["kv_blocks_total"], health["kv_blocks_held"]) == (blocks, 0)
        assert health["runtime"]["in_flight"] == 0
        assert health["runtime"]["forged_messages"] == {}
        # Idle between two /health readings at least 0.5 s apart: below half a core.
        cpu = health["cpu"]
        assert cpu["idle"] is True and cpu["window_s"] >= 0.5, cpu
        assert 0 <= cpu["runtime_thread"] < 0.5 and 0 <= cpu["process"] < 0.5, cpu
        assert health["side_channel_requests"]["served"] > 0
        assert server.url in json.dumps(steps["addresses"]["findings"])
    live = steps["liveness and clocks"]["figures"]
    assert live["prefill"]["transfer_deadline_s"] == PREFILL_DEADLINE_S
    assert live["decode"]["transfer_deadline_s"] == DECODE_DEADLINE_S
    assert live["decode"]["queue_timeout_s"] == QUEUE_TIMEOUT_S
    assert any("proven both ways" in f["text"] for f in _findings(report, 2, "ok"))

    # The text report says the same, from the same Report.
    code, text, _ = _doctor(capsys, *pair.args())
    assert code == 0
    lines = text.splitlines()
    assert lines[0] == f"kvpush doctor: prefill {pair.side(pair.prefill)}, decode " + pair.side(
        pair.decode
    )
    heads = [line for line in lines if line.startswith("[")]
    assert [h.split()[0] for h in heads] == [f"[{v}]" for v in _verdicts(report)]
    assert lines[-1] == "verdict: ok (0 failing steps, 0 with warnings, not checked: none)"
    assert f"blocks held 0 of {DECODE_BLOCKS}" in text
    assert "transfer deadline 50.0 s, queue timeout 20.0 s" in text
    # No transfer between them yet: what the prefill's leases will measure is not known.
    assert "heartbeat round trip to decode rank 0: not measured yet (no transfer" in text
    assert "heartbeat_round_trip_ms" not in live["prefill"]


@servers
def test_a_slow_side_channel_is_a_warning_with_its_threshold(
    pair: Pair, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given twice, the last one counts (as for any option): 0.001 ms, which nothing meets.
    code, report = _doctor_json(capsys, *pair.args(http=False), "--slow-round-trip-ms", "0.001")
    assert (code, report["verdict"]) == (0, "warn")
    assert _verdicts(report) == ["ok", "ok", "ok", "ok", "warn", "skip"]
    warns = _findings(report, 5, "warn")
    assert [w["side"] for w in warns] == ["prefill", "decode"]
    for w in warns:
        assert w["text"].startswith("side-channel round trip (connect, request, reply) over 5")
        assert "answers slowly (over 0.001 ms)" in w["next_action"]
        assert "raise --slow-round-trip-ms" in w["next_action"]


@contextlib.contextmanager
def _http_server(host: str, health: bytes | Callable[[], bytes], metrics: bytes) -> Iterator[str]:
    """A real HTTP server on `host` answering /health and /metrics with these bodies (what
    a vLLM server or a server in a given state answers; `health` called for each one, if
    it changes from one request to the next); yields its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = {"/health": health, "/metrics": metrics}.get(self.path)
            if callable(body):
                body = body()
            self.send_response(404 if body is None else 200)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    with Server((host, 0), Handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://{bracket_host(host)}:{server.server_address[1]}"
        finally:
            server.shutdown()
            thread.join(10)


@servers
def test_an_http_server_that_is_not_kvpush_serve_is_read_for_its_status_only(
    pair: Pair, capsys: pytest.CaptureFixture[str]
) -> None:
    # vLLM's /health: 200, no body; its metrics are vLLM's own.
    with _http_server(pair.host, b"", b"vllm:num_requests_running 0.0\n") as url:
        code, report = _doctor_json(
            capsys, *pair.args(http=False), "--prefill-http", url, "--decode-http", pair.decode.url
        )
    assert (code, report["verdict"]) == (0, "ok"), report
    assert _verdicts(report) == ["ok"] * 6
    texts = [f["text"] for f in _findings(report, 1, "ok") if f["side"] == "prefill"]
    assert texts[1] == (
        f"{url}/health answers 200, without kvpush's fields (not a kvpush serve server?): its "
        "advertised address and deadlines are not known"
    )
    assert report["steps"][0]["figures"]["prefill"]["advertised_host"] is None
    assert "transfer_deadline_s" not in report["steps"][4]["figures"]["prefill"]
    assert report["steps"][4]["figures"]["decode"]["transfer_deadline_s"] == DECODE_DEADLINE_S
    # vLLM's series are read as a vLLM server's (no connector series: none yet).
    [health] = [f["text"] for f in _findings(report, 6, "ok") if f["side"] == "prefill"]
    assert health == (
        "vLLM's /metrics: requests running 0, waiting ?; kvpush transfers finished 0 "
        "(0 bytes), not finished 0 (no vllm:kvpush_* series yet: none before the first "
        "transfer, or not KvpushConnector)"
    )
    # Neither kvpush's nor vLLM's series: nothing is known of blocks and transfers.
    with _http_server(pair.host, b"", b"process_cpu_seconds_total 1.0\n") as url:
        code, report = _doctor_json(
            capsys, *pair.args(http=False), "--prefill-http", url, "--decode-http", pair.decode.url
        )
    assert (code, report["verdict"]) == (0, "ok"), report
    [health] = [f["text"] for f in _findings(report, 6, "ok") if f["side"] == "prefill"]
    assert health == (
        f"{url}/metrics has no kvpush serving metrics (not a kvpush serve server?): blocks and "
        "transfers are not known"
    )


@servers
def test_short_deadlines_failed_transfers_and_forged_messages_are_warnings(
    pair: Pair, capsys: pytest.CaptureFixture[str]
) -> None:
    # A prefill server's /health and /metrics as a server in that state answers them: its
    # deadline below the decode queue's timeout, transfers failed, forged messages dropped,
    # heartbeats to the decode's agent slow (1.5 s, over the test's threshold of 1 s).
    decode_agent = pair.agent(pair.decode)
    slow = {"round_trip_s": 1.5, "skew_lb_s": -0.5, "age_s": 4.0}
    readings = iter(range(1, 100))

    def cpu() -> dict[str, float]:  # 0.8 s of CPU per second, at each reading
        n = next(readings)
        return {"at_s": 1000.0 + n, "process_s": 0.8 * n, "runtime_thread_s": 0.75 * n}

    health = {
        "status": "ok",
        "role": "prefill",
        "side_channel_host": pair.host,
        "side_channel_port": pair.prefill.side_channel_port,
        "transfer_deadline_s": 10.0,
        "transfers": {
            "in_flight": 0,
            "forged_messages": {"bad_key": 3},
            "clock_bounds": {decode_agent: slow, "an-agent-of-another-decode": slow},
        },
        "side_channel_requests": {"served": 9, "refused_auth": 0, "malformed": 2},
    }
    metrics = "\n".join(
        [
            "# TYPE kvpush_kv_blocks_total gauge",
            "kvpush_kv_blocks_total 40",
            "kvpush_kv_blocks_held 6",
            'kvpush_transfers_total{side="sender",outcome="finished",reason=""} 5',
            'kvpush_transfers_total{side="sender",outcome="failed",reason="peer_timeout"} 2',
            'kvpush_transfers_total{side="sender",outcome="failed",reason="cancelled"} 1',
        ]
    )
    with _http_server(
        pair.host, lambda: json.dumps({**health, "cpu": cpu()}).encode(), metrics.encode()
    ) as url:
        code, report = _doctor_json(
            capsys, *pair.args(http=False), "--prefill-http", url, "--decode-http", pair.decode.url
        )
    assert (code, report["verdict"]) == (0, "warn")
    assert _verdicts(report) == ["ok", "ok", "ok", "ok", "warn", "warn"]
    deadline, heartbeat = _findings(report, 5, "warn")
    assert (heartbeat["side"], heartbeat["text"]) == (
        "prefill",
        "data-plane heartbeat round trip to decode rank 0: 1500.00 ms (4 s ago): the prefill "
        "bounds that rank's clock to within 1500.00 ms, and takes each lease to end that much "
        "sooner",
    )
    assert heartbeat["next_action"].startswith(
        f"heartbeats between the servers' agents are slow (over {SLOW_MS:g} ms): check the "
        "hosts' load and the transport UCX uses between them (UCX_TLS, UCX_NET_DEVICES)"
    )
    figures = report["steps"][4]["figures"]["prefill"]["heartbeat_round_trip_ms"]
    assert figures == {"0": {"round_trip_ms": 1500.0, "age_s": 4.0}}
    assert deadline["text"].startswith(
        f"the prefill server's transfer deadline (10.0 s) is not above the decode server's "
        f"queue timeout ({QUEUE_TIMEOUT_S} s)"
    )
    assert deadline["next_action"] == (
        f"start the prefill server with --transfer-deadline-s above {QUEUE_TIMEOUT_S} (the "
        "decode server's --queue-timeout-s)"
    )
    warns = [(f["side"], f["text"]) for f in _findings(report, 6, "warn")]
    assert warns == [
        ("prefill", "transfers have failed since it started: cancelled 1, peer_timeout 2"),
        ("prefill", "data-plane messages dropped unread because of who sent them: bad_key 3"),
        ("prefill", "side-channel requests refused or dropped since it started: malformed 2"),
        (
            "prefill",
            "CPU over 1.0 s: the process 80% of a core, its runtime thread 75%, with nothing "
            "in flight: an idle server should use almost none",
        ),
    ]
    spin = _findings(report, 6, "warn")[-1]["next_action"]
    assert spin.startswith("find the thread that spins (top -H -p PID on the prefill host)")
    cpu_figures = report["steps"][5]["figures"]["prefill"]["cpu"]
    assert cpu_figures == {"window_s": 1.0, "process": 0.8, "runtime_thread": 0.75, "idle": True}
    [held] = [f["text"] for f in _findings(report, 6, "ok") if f["side"] == "prefill"]
    assert held == (
        "blocks held 6 of 40; transfers in flight 0; requests running ?, waiting ?; "
        "transfers finished 5, failed 3"
    )


@servers
def test_figures_of_the_wrong_type_in_a_health_answer_are_not_known_not_a_crash(
    pair: Pair, capsys: pytest.CaptureFixture[str]
) -> None:
    decode_agent = pair.agent(pair.decode)
    health = {
        "status": "ok",
        "side_channel_host": pair.host,
        "side_channel_port": pair.prefill.side_channel_port,
        "transfers": {"in_flight": 0, "clock_bounds": {decode_agent: {"round_trip_s": "1"}}},
        "cpu": {"at_s": True, "process_s": "0.5"},
    }
    metrics = b"kvpush_kv_blocks_total 40\n"
    with _http_server(pair.host, json.dumps(health).encode(), metrics) as url:
        code, report = _doctor_json(
            capsys, *pair.args(http=False), "--prefill-http", url, "--decode-http", pair.decode.url
        )
    assert (code, report["verdict"]) == (0, "ok"), report
    texts = [f["text"] for f in _findings(report, 5, "ok")]
    assert "heartbeat round trip to decode rank 0: not measured yet" in texts[-1]
    assert "cpu" not in report["steps"][5]["figures"]["prefill"]


@servers
def test_through_a_proxy_every_pair_is_checked_and_a_dead_backend_named(
    pair: Pair, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    dead = f"http://{bracket_host(pair.host)}:{free_port(pair.host)}"
    port = free_port(pair.host)
    args = ["proxy", "--prefill", pair.prefill.url, "--decode", pair.decode.url, dead]
    args += ["--host", pair.host, "--port", str(port), "--token-file", str(pair.token_file)]
    with ServerProcess("proxy", args, host=pair.host, port=port, log_dir=tmp_path) as proxy:
        proxy.wait_ready(60)
        # One request through the pair: the prefill's leases then know the decode's clock.
        body = {"prompt": "push it " * 10, "max_tokens": 4}
        served = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=60)
        assert served.status_code == 200, served.text
        args = ["--proxy", proxy.url, "--token-file", str(pair.token_file)]
        args += ["--slow-round-trip-ms", str(SLOW_MS)]
        code, report = _doctor_json(capsys, *args)
        text_code, text, _ = _doctor(capsys, *args)
    assert (code, text_code, report["verdict"]) == (1, 1, "fail")
    [backend] = report["backends"]
    assert (backend["verdict"], backend["side"]) == ("fail", "decode")
    assert backend["text"].startswith(f"backend {dead}: GET {dead}/health: ")
    assert backend["next_action"] == (
        f"start the decode server at {dead}, or take it out of the proxy's --decode"
    )
    [checked] = report["pairs"]
    assert (checked["prefill"], checked["decode"]) == (
        pair.side(pair.prefill),
        pair.side(pair.decode),
    )
    assert _verdicts(checked) == ["ok"] * 6
    measured = checked["steps"][4]["figures"]["prefill"]["heartbeat_round_trip_ms"]
    assert list(measured) == ["0"] and 0 < measured["0"]["round_trip_ms"] < SLOW_MS
    assert measured["0"]["age_s"] >= 0
    assert "data-plane heartbeat round trip to decode rank 0: " in text
    assert text.splitlines()[0] == f"kvpush doctor: proxy {proxy.url}: 1 pair(s) to check"
    assert "--- pair 1 of 1" in text and text.splitlines()[-1] == "proxy verdict: fail"


@servers
def test_a_wrong_or_missing_token_fails_the_side_channel_step(
    pair: Pair, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-secret")
    code, report = _doctor_json(capsys, *pair.args(token=False), "--token-file", str(wrong))
    assert code == 1
    assert _verdicts(report) == ["ok", "fail", "skip", "skip", "skip", "skip"]
    assert report["steps"][2]["not_run_because"] == "step 2 (side channel) failed"
    fails = _findings(report, 2, "fail")
    assert [f["side"] for f in fails] == ["prefill", "decode"]
    for f in fails:
        assert f["text"].startswith("AuthenticationRefused: ") and "wrong token" in f["text"]
        assert "holds another token than the one given" in f["next_action"]
        assert "--token-file" in f["next_action"]

    code, report = _doctor_json(capsys, *pair.args(token=False))
    assert code == 1
    [first, _] = _findings(report, 2, "fail")
    assert "no token given" in first["text"]
    assert first["next_action"].startswith("the prefill server needs the shared token")


@servers
def test_incompatible_caches_name_every_differing_field(
    pair: Pair,
    capsys: pytest.CaptureFixture[str],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # A decode server with another model (3 layers, not 2) and another block size.
    other_model = tmp_path_factory.mktemp("three-layers")
    make_model(other_model, seed=3, num_layers=3)
    odd = _server(
        "decode-odd",
        pair.host,
        "decode",
        other_model,
        tmp_path_factory.mktemp("odd-logs"),
        "--block-size",
        "16",
        "--token-file",
        str(pair.token_file),
    )
    with odd:
        odd.wait_ready(120)
        assert odd.side_channel_port is not None
        side = f"{bracket_host(pair.host)}:{odd.side_channel_port}"
        args = ["--prefill", pair.side(pair.prefill), "--decode", side]
        code, report = _doctor_json(capsys, *args, "--token-file", str(pair.token_file))
        text_code, text, _ = _doctor(capsys, *args, "--token-file", str(pair.token_file))
    assert (code, text_code) == (1, 1)
    assert _verdicts(report) == ["ok", "ok", "fail", "skip", "skip", "skip"]
    fails = [(f["text"], f["next_action"]) for f in _findings(report, 3, "fail")]
    assert fails[:2] == [
        (
            "rank 0: block_size_tokens differs: prefill 8, decode 16",
            "start both servers with the same --block-size",
        ),
        (
            "rank 0: regions differ: prefill registers 4 (2 layers), decode 6 (3 layers)",
            "serve the same model, with the same tensor-parallel layout, on both servers "
            "(each rank's layers, KV heads and head size must match)",
        ),
    ]
    assert fails[2][0].startswith("rank 0: a transfer would be refused (compat hash prefill ")
    assert len(fails) == 3
    assert "FAIL: rank 0: block_size_tokens differs: prefill 8, decode 16" in text
    assert "next: start both servers with the same --block-size" in text


@servers
def test_nothing_listening_fails_the_address_step_naming_the_port(
    pair: Pair, capsys: pytest.CaptureFixture[str]
) -> None:
    closed = free_port(pair.host)
    started = time.monotonic()
    code, report = _doctor_json(
        capsys,
        "--prefill",
        pair.side(pair.prefill),
        "--decode",
        f"{bracket_host(pair.host)}:{closed}",
        "--token-file",
        str(pair.token_file),
    )
    assert time.monotonic() - started < 10  # refused at once, not a timeout
    assert code == 1
    assert _verdicts(report) == ["fail", "skip", "skip", "skip", "skip", "skip"]
    [fail] = _findings(report, 1, "fail")
    assert fail["side"] == "decode"
    assert f"nothing answers TCP on port {closed}" in fail["text"]
    assert "connection refused" in fail["text"]
    assert fail["next_action"].startswith("start the decode server, or give --decode the port")
    [ok] = _findings(report, 1, "ok")
    assert ok["side"] == "prefill"


@servers
def test_http_urls_of_the_wrong_server_are_named(
    pair: Pair, capsys: pytest.CaptureFixture[str]
) -> None:
    # --decode-http names the prefill server: its side channel is not --decode's.
    args = ["--prefill", pair.side(pair.prefill), "--decode", pair.side(pair.decode)]
    args += ["--decode-http", pair.prefill.url, "--token-file", str(pair.token_file)]
    code, report = _doctor_json(capsys, *args)
    assert code == 1
    assert _verdicts(report)[0] == "fail"
    texts = [f["text"] for f in _findings(report, 1, "fail")]
    assert texts == [
        f"{pair.prefill.url} is a server whose side channel is on port "
        f"{pair.prefill.side_channel_port}, not {pair.decode.side_channel_port}: --decode and "
        "--decode-http name different servers",
        f"{pair.prefill.url} serves the prefill role, not decode",
    ]


@servers
def test_a_stopped_decode_fails_within_the_timeout_with_the_next_action(
    pair: Pair, capsys: pytest.CaptureFixture[str]
) -> None:
    pid = pair.decode.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        code, report = _doctor_json(capsys, *pair.args(http=False), "--timeout-ms", "1000")
        side_channel_s = time.monotonic() - started
        started = time.monotonic()
        http_code, http_report = _doctor_json(capsys, *pair.args(), "--timeout-ms", "1000")
        http_s = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    # One bounded wait each, not a hang: the kernel still accepts its TCP connections.
    assert side_channel_s < 8 and http_s < 8, (side_channel_s, http_s)
    assert code == 1
    assert _verdicts(report) == ["ok", "fail", "skip", "skip", "skip", "skip"]
    [fail] = _findings(report, 2, "fail")
    assert fail["side"] == "decode"
    assert "connected, but no answer within 1000 ms" in fail["text"]
    assert "it is stopped (SIGSTOP, a debugger), hung or overloaded" in fail["next_action"]
    assert "kill -CONT PID" in fail["next_action"]
    # With its HTTP URL, the silent /health is found first, in step 1.
    assert http_code == 1
    assert _verdicts(http_report)[:2] == ["fail", "skip"]
    [fail] = _findings(http_report, 1, "fail")
    assert fail["text"] == f"GET {pair.decode.url}/health: no answer within 1000 ms"
    assert "accepts connections on its HTTP port but does not answer" in fail["next_action"]
    # Resumed, it is whole again.
    code, report = _doctor_json(capsys, *pair.args(http=False))
    assert (code, _verdicts(report)[:3]) == (0, ["ok", "ok", "ok"])


@contextlib.contextmanager
def _another_pair(
    host: str,
    model: Path,
    log_dir: Path,
    prefill: tuple[list[str], dict[str, str]],
    decode: tuple[list[str], dict[str, str]],
) -> Iterator[Pair]:
    """A pair of its own, each server with these extra arguments and environment."""
    token_file = log_dir / "token"
    token_file.write_text(TOKEN)
    made = [
        _server(role, host, role, model, log_dir, *extra, env=env)
        for role, (extra, env) in (("prefill", prefill), ("decode", decode))
    ]
    try:
        for s in made:
            s.start()
        for s in made:
            s.wait_ready(120)
        yield Pair(host, made[0], made[1], token_file)
    finally:
        for s in reversed(made):
            s.close()


def _network_interface() -> str:
    """An interface other than loopback that is up (UCX can be told to use only it)."""
    for _, name in socket.if_nameindex():
        state = Path(f"/sys/class/net/{name}/operstate")
        if name != "lo" and state.is_file() and state.read_text().strip() in ("up", "unknown"):
            return name
    pytest.skip("this host has no network interface but loopback for UCX to be kept on")


@servers
@pytest.mark.parametrize("host", ["127.0.0.1", "::1"], ids=["ipv4", "ipv6"])
def test_a_decode_whose_data_plane_is_unreachable_fails_step_4_naming_ucx(
    host: str, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The side channels answer, but UCX on the prefill may use loopback only while the
    decode's agent offers another interface: NIXL cannot reach the decode's agent. Every
    step before the data plane is ok; step 4 fails, naming what to change."""
    token = ["--token-file", str(tmp_path / "token")]
    with _another_pair(
        host,
        model_dir,
        tmp_path,
        (token, {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"}),
        (token, {"UCX_NET_DEVICES": _network_interface(), "UCX_TLS": "tcp"}),
    ) as broken:
        code, report = _doctor_json(capsys, *broken.args())
        agent = broken.agent(broken.decode)
    assert (code, report["exit_code"]) == (1, 1)
    assert _verdicts(report) == ["ok", "ok", "ok", "fail", "skip", "skip"]
    [fail] = _findings(report, 4, "fail")
    assert fail["side"] == "prefill"
    assert fail["text"].startswith(
        f"prefill rank 0 -> decode rank 0: the test write failed: our data plane could not "
        f"load {agent}: NIXL could not load the agent metadata for {agent}: "
    ), fail["text"]
    assert fail["next_action"] == UCX_ACTION
    assert "UCX_NET_DEVICES must name an interface the other host reaches" in UCX_ACTION


def _global_address(host: str) -> str:
    """An address of this host in `host`'s family that is not loopback."""
    listed = subprocess.run(
        ["ip", "-j", "-6" if ":" in host else "-4", "addr", "show", "scope", "global"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for link in json.loads(listed):
        for address in link.get("addr_info", []):
            if address.get("local") and not address.get("tentative"):
                return str(address["local"])
    pytest.skip(f"this host has no address but loopback in the family of {host}")


@servers
@pytest.mark.parametrize("host", ["127.0.0.1", "::1"], ids=["ipv4", "ipv6"])
def test_a_side_channel_bound_to_loopback_but_advertised_elsewhere_fails_step_1(
    host: str, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The decode binds its side channel to loopback but tells its peers another address of
    this host, where nothing listens: it answers the doctor, given the loopback address,
    and no peer. Step 1 fails naming both addresses; started as the next action says, the
    same pair is all ok."""
    elsewhere = _global_address(host)
    token = ["--token-file", str(tmp_path / "token")]
    advertise = ["--advertise-host", elsewhere]
    with _another_pair(host, model_dir, tmp_path, (token, {}), ([*token, *advertise], {})) as pair:
        code, report = _doctor_json(capsys, *pair.args())
        port = pair.decode.side_channel_port
        assert port is not None
        # What the doctor says a peer meets, a peer meets.
        with pytest.raises(PeerUnreachable):
            fetch_metadata(elsewhere, port, token=TOKEN)
        assert fetch_metadata(host, port, token=TOKEN).rank == 0
    assert (code, report["exit_code"]) == (1, 1)
    assert _verdicts(report) == ["fail"] + ["skip"] * 5
    [fail] = _findings(report, 1, "fail")
    assert fail["side"] == "decode"
    told = f"{bracket_host(elsewhere)}:{port}"
    assert fail["text"] == (
        f"the doctor reached its side channel at {bracket_host(host)}:{port}, but it "
        f"advertises {told}, where nothing answers TCP ({elsewhere}: connection refused): it "
        "does not listen on the address its peers are told"
    )
    every = "::" if ":" in host else "0.0.0.0"
    assert fail["next_action"] == (
        f"start the decode server listening where it advertises: --host {elsewhere}, or "
        f"--host {every} with --advertise-host {elsewhere} (vLLM binds and advertises the "
        "same kv_connector_extra_config side_channel_host)"
    )
    figures = report["steps"][0]["figures"]["decode"]
    assert figures["advertised_host"] == elsewhere
    [tried] = figures["advertised_addresses"]
    assert (tried["ip"], tried["loopback"], tried["local"]) == (elsewhere, False, True)
    assert tried["tcp_ms"] is None and tried["tcp_error"] == "connection refused"
    assert figures["addresses"][0]["tcp_ms"] > 0  # the loopback address did answer

    # The next action: listen on every address, advertise the one peers are told.
    wildcard = ["--host", every, *advertise]
    with _another_pair(host, model_dir, tmp_path, (token, {}), ([*token, *wildcard], {})) as fixed:
        code, report = _doctor_json(capsys, *fixed.args())
        port = fixed.decode.side_channel_port
    assert (code, _verdicts(report)) == (0, ["ok"] * 6), json.dumps(report["steps"][0])
    told = f"{bracket_host(elsewhere)}:{port}"
    assert any(
        f["side"] == "decode"
        and f["text"].startswith(f"it advertises its side channel as {told}: TCP answers on ")
        for f in _findings(report, 1, "ok")
    ), report["steps"][0]["findings"]


@servers
def test_without_a_token_only_an_operator_allows_test_writes(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No token: the prefill was started with --allow-doctor-writes, the decode was not.
    The decode publishes no scratch buffer and refuses the doctor's requests; the doctor
    says step 4 was not checked, and why."""
    host = "127.0.0.1"
    with _another_pair(
        host, model_dir, tmp_path, (["--allow-doctor-writes"], {}), ([], {})
    ) as tokenless:
        code, report = _doctor_json(capsys, *tokenless.args(token=False))
        assert tokenless.decode.side_channel_port and tokenless.prefill.side_channel_port
        decode = (host, tokenless.decode.side_channel_port)
        prefill = (host, tokenless.prefill.side_channel_port)
        refusals = []
        for kind, body in (
            (DOCTOR_WRITE, {"rank": 0, "to": [*prefill, 0], "seed": b"0123456789abcdef"}),
            (DOCTOR_DIGEST, {"rank": 0, "bytes": 1024}),
        ):
            with pytest.raises(RequestRejected) as refused:
                control_request(*decode, kind, body)
            refusals.append(str(refused.value))
        # The prefill, allowed, takes a check (it then finds no buffer to write into).
        started = control_request(
            *prefill, DOCTOR_WRITE, {"rank": 0, "to": [*decode, 0], "seed": b"0123456789abcdef"}
        )
        assert isinstance(started["probe"], int)
    assert code == 0
    assert _verdicts(report) == ["ok", "warn", "ok", "skip", "ok", "ok"]
    [skipped] = _findings(report, 4, "skip")
    assert skipped["side"] == "decode"
    assert skipped["text"] == (
        "prefill rank 0 -> decode rank 0: not checked: the decode rank registers no scratch "
        "buffer for test writes (a kvpush serve without a token and without "
        "--allow-doctor-writes, or a vLLM server without a token and without allow_doctor_writes "
        "in its kv_connector_extra_config)"
    )
    assert refusals[0].endswith(
        "this rank has no scratch buffer: its server was started without a token and "
        "without allowing doctor writes"
    ), refusals
    assert refusals[1].endswith("doctor-digest: this rank has no scratch buffer"), refusals


# ------------------------------------------- `kvpush endpoint`s: several ranks, no token


@pytest.fixture(scope="module")
def endpoints() -> Iterator[tuple[Endpoint, Endpoint]]:
    """A sender and a receiver of 2 ranks each, with NIXL agents and no token; the
    receiver's cache is float16 where the sender's is bfloat16."""
    common = ["--preset", "tiny", "--blocks", "8", "--ranks", "2", "--transport", "nixl"]
    sender = start_endpoint(*common, "--role", "sender")
    try:
        receiver = start_endpoint(*common, "--role", "receiver", "--dtype", "float16")
    except BaseException:
        sender.stop()
        raise
    yield sender, receiver
    receiver.stop()
    sender.stop()


@servers
def test_every_rank_is_read_and_compared_and_no_token_is_a_warning(
    endpoints: tuple[Endpoint, Endpoint], capsys: pytest.CaptureFixture[str]
) -> None:
    sender, receiver = endpoints
    code, report = _doctor_json(capsys, "--prefill", sender.address, "--decode", receiver.address)
    assert code == 1
    assert _verdicts(report) == ["ok", "warn", "fail", "skip", "skip", "skip"]
    ranks = report["steps"][1]["figures"]
    assert [r["rank"] for r in ranks["prefill"]] == [0, 1] == [r["rank"] for r in ranks["decode"]]
    [warn] = _findings(report, 2, "warn")
    assert warn["text"].startswith("no token: both side channels answer anyone")
    assert (
        "the same secret (kvpush serve --token-file FILE, or KVPUSH_TOKEN)" in warn["next_action"]
    )
    fails = [f["text"] for f in _findings(report, 3, "fail")]
    assert [t for t in fails if "dtype" in t] == [
        "rank 0: dtype differs: prefill 'bfloat16', decode 'float16'",
        "rank 1: dtype differs: prefill 'bfloat16', decode 'float16'",
    ]
    assert len(fails) == 4  # per rank: the field, and that a transfer would be refused


@servers
def test_swapped_roles_and_a_rank_without_an_agent_fail_the_side_channel_step(
    endpoints: tuple[Endpoint, Endpoint],
    tiny_endpoint: Endpoint,
    capsys: pytest.CaptureFixture[str],
) -> None:
    sender, receiver = endpoints
    code, report = _doctor_json(capsys, "--prefill", receiver.address, "--decode", sender.address)
    assert code == 1
    assert _verdicts(report)[:3] == ["ok", "fail", "skip"]
    fails = _findings(report, 2, "fail")
    assert [(f["side"], f["text"]) for f in fails] == [
        ("prefill", "rank 0 publishes role 'receiver': a prefill server publishes sender or both"),
        ("prefill", "rank 1 publishes role 'receiver': a prefill server publishes sender or both"),
        ("decode", "rank 0 publishes role 'sender': a decode server publishes receiver or both"),
        ("decode", "rank 1 publishes role 'sender': a decode server publishes receiver or both"),
    ]
    assert {f["next_action"] for f in fails} == {"swap --prefill and --decode"}
    # An engine whose side channel runs without a transport (`--transport none`).
    code, report = _doctor_json(
        capsys, "--prefill", tiny_endpoint.address, "--decode", receiver.address
    )
    assert code == 1
    texts = [f["text"] for f in _findings(report, 2, "fail")]
    assert texts == [
        f"rank {r} publishes no transport agent: it cannot take part in a transfer" for r in (0, 1)
    ]


# ------------------------------------------------------------------ no servers needed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefill", "::1:5", "--decode", "h:6"], "an IPv6 host must be bracketed"),
        (["--prefill", "h:5", "--decode", "h:x"], "bad port in 'h:x'"),
        (["--prefill", "h:5", "--decode", "h:6", "--timeout-ms", "0"], "must be positive"),
        (["--prefill", "h:5", "--decode", "h:6", "--prefill-http", "h:80"], "bad HTTP URL"),
        (["--prefill", "h:5"], "give --prefill HOST:PORT and --decode HOST:PORT, or --proxy URL"),
        (["--proxy", "http://h:1", "--decode", "h:6"], "either --proxy, or --prefill and"),
        (["--proxy", "h:1"], "bad HTTP URL"),
        (["--proxy", "http://h:1", "--slow-round-trip-ms", "0"], "must be positive"),
    ],
)
def test_usage_errors_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _doctor(capsys, *args)
    assert (code, out) == (2, "")
    assert message in err


def _side(
    role: str, host: str, ip: str, *, local: bool, advertised: str | None = None
) -> SideAddress:
    family = "IPv6" if ":" in ip else "IPv4"
    loopback = ip in ("127.0.0.1", "::1")
    found = ResolvedAddress(ip, family, loopback, local, tcp_ms=0.1)
    return SideAddress(role, host, 5600, (found,), advertised)


def test_a_loopback_side_channel_with_its_peer_on_another_host_is_a_fail() -> None:
    prefill = _side("prefill", "127.0.0.1", "127.0.0.1", local=True)
    # 198.51.100.7 (TEST-NET-2) is no address of this host.
    decode = _side("decode", "198.51.100.7", "198.51.100.7", local=False)
    [(problem, action)] = pair_problems(prefill, decode)
    assert problem == (
        "its side channel is on loopback (127.0.0.1) while the decode server "
        "(198.51.100.7:5600) is on another host: the decode server cannot reach it"
    )
    assert action.startswith("start the prefill server with --host set to an address of its host")
    assert pair_problems(decode, prefill) == []
    # Both on this host: loopback is fine.
    here = _side("decode", "::1", "::1", local=True)
    assert pair_problems(prefill, here) == [] and pair_problems(here, prefill) == []


def test_an_advertised_loopback_or_wildcard_address_is_a_fail() -> None:
    peer = _side("prefill", "198.51.100.8", "198.51.100.8", local=False)
    reached_elsewhere = _side(
        "decode", "198.51.100.7", "198.51.100.7", local=False, advertised="::1"
    )
    problems = pair_problems(reached_elsewhere, peer)
    assert [p for p, _ in problems] == [
        "the doctor reached it at 198.51.100.7:5600, but it advertises its side channel as ::1 "
        "(loopback): peers are told an address that names their own host",
        "its side channel is on loopback (::1) while the prefill server (198.51.100.8:5600) is "
        "on another host: the prefill server cannot reach it",
    ]
    assert problems[0][1].startswith("start the decode server with --host 198.51.100.7")
    wildcard = _side("decode", "198.51.100.7", "198.51.100.7", local=False, advertised="0.0.0.0")
    [(problem, action)] = pair_problems(wildcard, peer)
    assert "advertised as 0.0.0.0, a wildcard" in problem
    assert "(not 0.0.0.0 or ::)" in action


# Kept alive for the module: the geometry's addresses point into it.
_TINY = synthetic_kv_cache(preset="tiny", num_blocks=4, fill=None)


def _meta(engine: str, role: str, rank: int) -> PeerMetadata:
    return PeerMetadata(
        engine_id=engine,
        incarnation=f"{engine}-inc",
        rank=rank,
        role=role,
        agent_name=f"{engine}-agent-{rank}",
        agent_metadata=b"agent metadata",
        geometry=_TINY.geometry,
        kvpush_version="0.1.0",
    )


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_rank_that_never_publishes_is_named(
    host: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Ranks 0 and 2 of the prefill engine publish, rank 1 never does; the decode engine
    # serves none yet.
    sender = {r: _meta("engine-p", "sender", r) for r in (0, 2)}
    receiver: dict[int, PeerMetadata] = {}
    with (
        MetadataServer(host, 0, SideChannelConfig(), sender) as p,
        MetadataServer(host, 0, SideChannelConfig(), lambda: receiver) as d,
    ):
        args = ["--prefill", f"{bracket_host(host)}:{p.port}"]
        args += ["--decode", f"{bracket_host(host)}:{d.port}", "--slow-round-trip-ms", "1000"]
        code, report = _doctor_json(capsys, *args)
        assert code == 1
        fails = [(f["side"], f["text"]) for f in _findings(report, 2, "fail")]
        assert fails == [
            (
                "prefill",
                "rank 1 is not published, while 0, 2 are: a transfer for a missing rank "
                "cannot start",
            ),
            ("decode", "it publishes no rank yet: its ranks have not started, or failed to"),
        ]
        # Once they all publish, every rank is read, and compared.
        sender[1] = _meta("engine-p", "sender", 1)
        receiver.update({r: _meta("engine-d", "receiver", r) for r in range(3)})
        code, report = _doctor_json(capsys, *args)
    assert code == 0
    assert _verdicts(report) == ["ok", "warn", "ok", "skip", "ok", "skip"]
    assert [f["text"] for f in _findings(report, 3, "ok")] == [
        f"rank {r}: compatible (hash {_TINY.geometry.compat_hash()})" for r in range(3)
    ]


def test_the_ranks_an_unknown_rank_refusal_names_are_read() -> None:
    assert served_ranks("x: no rank 5 here: this engine serves ranks 0, 1") == [0, 1]
    assert served_ranks("x: no rank 9 here: this engine serves ranks 0..7") == list(range(8))
    assert served_ranks("x: no rank 0 here: this engine serves ranks none (yet)") == []
    assert served_ranks("x: something else") is None


def test_a_name_that_does_not_resolve_fails_the_address_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    closed = free_port("127.0.0.1")
    args = ["--prefill", f"127.0.0.1:{closed}", "--decode", "no-such-host.invalid:5600"]
    code, report = _doctor_json(capsys, *args)
    assert code == 1
    assert _verdicts(report) == ["fail", "skip", "skip", "skip", "skip", "skip"]
    fails = {f["side"]: f for f in _findings(report, 1, "fail")}
    assert fails["decode"]["text"].startswith("cannot resolve 'no-such-host.invalid': ")
    assert "a name this host resolves" in fails["decode"]["next_action"]
    assert f"nothing answers TCP on port {closed}" in fails["prefill"]["text"]
