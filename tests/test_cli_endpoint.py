"""`kvpush endpoint` as a user runs it: real processes and signals."""

from __future__ import annotations

import json
import re
import signal
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from conftest import Endpoint, free_port, run_kvpush, start_endpoint

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_endpoint_stops_cleanly_on_a_signal_and_says_what_it_served(sig: int) -> None:
    ep = start_endpoint("--block-bytes", "4096", "--layers", "3", "--blocks", "16")
    assert "layout=kv_separate/NHD" in ep.ready_line
    assert f"registered_bytes={3 * 4096 * 16}" in ep.ready_line
    probe = run_kvpush("probe", "--port", str(ep.port))
    assert probe.returncode == 0, probe.stderr
    assert ep.stop(sig) == 0
    assert "kvpush endpoint stopped: served 1, refused 0, dropped 0" in ep.output[-1]
    # The port is free again: nothing answers there any more.
    after = run_kvpush("probe", "--port", str(ep.port))
    assert after.returncode == 1
    assert "connection refused" in after.stderr


def test_endpoint_configuration_errors_exit_1_with_a_reason() -> None:
    result = run_kvpush("endpoint", "--port", "0", "--block-bytes", "1000")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "ConfigError: block_bytes 1000 must be a positive multiple of 64 "
        "(K and V x 16 tokens x 2-byte bfloat16)"
    )
    assert run_kvpush("endpoint", "--ranks").returncode == 2


@pytest.mark.nixl
def test_endpoint_with_nixl_publishes_its_agent_and_stops_cleanly() -> None:
    ep = start_endpoint("--preset", "tiny", "--blocks", "4", "--transport", "nixl")
    probe = run_kvpush("probe", "--port", str(ep.port), "--json")
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert found["agent_name"].startswith(found["engine_id"] + "-r0-")
    assert found["agent_metadata_bytes"] > 0
    assert ep.stop() == 0


# --------------------------------------------------------------------------- bench control


def _control(ep: Endpoint, kind: bytes, body: object, token: str | None = None) -> Any:
    from kvpush.sidechannel import control_request

    return control_request(ep.host, ep.port, kind, body, token=token, timeout_ms=5000)


@pytest.mark.nixl
def test_bench_control_requests_refuse_bad_input_with_a_reason_and_keep_serving(
    tmp_path: Path,
) -> None:
    from kvpush.errors import AuthenticationRefused
    from kvpush.sidechannel import RequestRejected

    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    ep = start_endpoint(
        "--preset", "tiny", "--blocks", "16", "--transport", "nixl", "--token-file",
        str(token_file),
    )  # fmt: skip
    try:
        token = "s3cret"
        sender = ["127.0.0.1", free_port(), 0]
        refused = [
            ({"transfers": [["t", [0]]]}, 'expected a map {"sender": ..., "transfers": ...}'),
            ({"sender": ["h", 0, 0], "transfers": [["t", [0]]]}, "sender: expected [host, port"),
            ({"sender": sender, "transfers": []}, "transfers: expected a non-empty array"),
            ({"sender": sender, "transfers": [["t", [16]]]}, "block 16 is not a block id"),
            ({"sender": sender, "transfers": [["t", [1, 1]]]}, "a block id is listed twice"),
            ({"sender": sender, "transfers": [[7, [1]]]}, "a transfer id must be a string"),
            ({"sender": sender, "transfers": [["t", [1]], ["t", [2]]]}, "given twice"),
            ("garbage", "bench_expect: expected a map"),
        ]
        for body, reason in refused:
            with pytest.raises(RequestRejected, match=re.escape(reason)):
                _control(ep, b"bench_expect", body, token)
        with pytest.raises(RequestRejected, match="takes no body"):
            _control(ep, b"bench_status", {"x": 1}, token)
        with pytest.raises(AuthenticationRefused, match="no token given"):
            _control(ep, b"bench_status", None)
        with pytest.raises(AuthenticationRefused, match="wrong token"):
            _control(ep, b"bench_status", None, "nope")
        # Nothing was half-accepted, and metadata is still served.
        assert _control(ep, b"bench_status", None, token)["expecting"] == 0
        probe = run_kvpush("probe", "--port", str(ep.port), "--token-file", str(token_file))
        assert probe.returncode == 0, probe.stderr

        # A sender nobody answers for: accepted, then it fails at the endpoint, once, with
        # the runtime's reason; the blocks it zeroed read back as zeros.
        accepted = _control(
            ep, b"bench_expect", {"sender": sender, "transfers": [["lost", [3, 5]]]}, token
        )
        assert accepted["accepted"] == 1
        with pytest.raises(RequestRejected, match="'lost' is already expected"):
            _control(ep, b"bench_expect", {"sender": sender, "transfers": [["lost", [1]]]}, token)
        deadline = time.monotonic() + 20
        ended: dict[str, Any] = {}
        while not ended and time.monotonic() < deadline:
            ended = _control(ep, b"bench_results", {"transfers": ["lost"]}, token)["ended"]
            time.sleep(0.05)
        ok, reason, detail = ended["lost"]
        assert ok is False and reason == "handshake_failed", (reason, detail)
        again = _control(ep, b"bench_results", {"transfers": ["lost"]}, token)
        assert again["ended"] == {}  # answered once
        crc = _control(ep, b"bench_checksum", {"blocks": [[3, 5]]}, token)["crc"]
        per_block = 4 * 2048  # tiny: 4 regions of 16 tokens x 2 heads x 32 dims x 2 bytes
        assert crc == [zlib.crc32(bytes(2 * per_block))]
    finally:
        status = ep.stop()
    assert status == 0, ep.output
    last = ep.output[-1].strip().splitlines()[-1]
    assert "transfers 0 finished, 1 failed" in last, last
    assert "refused 0" in last  # control refusals are counted apart from metadata ones
    answered = re.search(r"bench requests (\d+) answered, (\d+) refused", last)
    assert answered is not None, last
    assert int(answered.group(1)) >= 5  # results were polled until the failure came
    assert int(answered.group(2)) == len(refused) + 4


def test_an_endpoint_without_a_transport_answers_no_bench_requests(
    tiny_endpoint: Endpoint,
) -> None:
    from kvpush.errors import SideChannelError

    with pytest.raises(SideChannelError, match="could not read our request"):
        _control(tiny_endpoint, b"bench_status", None)
    assert run_kvpush("probe", "--port", str(tiny_endpoint.port)).returncode == 0


def test_a_control_handler_that_fails_is_refused_and_the_server_keeps_serving() -> None:
    from kvpush.bench.presets import synthetic_kv_cache
    from kvpush.config import SideChannelConfig
    from kvpush.errors import SideChannelError
    from kvpush.sidechannel import (
        MetadataServer,
        PeerMetadata,
        RequestRejected,
        control_request,
        fetch_metadata,
    )

    geometry = synthetic_kv_cache(preset="tiny", num_blocks=4).geometry
    meta = PeerMetadata("e", "i", 0, "both", "", b"", geometry, "0")

    def echo(body: Any) -> object:
        if body == "refuse":
            raise RequestRejected("no thanks")
        if body == "crash":
            raise RuntimeError("boom")
        return {"echo": body}

    with MetadataServer("::1", 0, SideChannelConfig(), {0: meta}, control={b"echo": echo}) as srv:
        assert control_request("::1", srv.port, b"echo", [1, "a"]) == {"echo": [1, "a"]}
        with pytest.raises(RequestRejected, match="no thanks"):
            control_request("::1", srv.port, b"echo", "refuse")
        with pytest.raises(SideChannelError, match=r"unavailable.*echo failed: boom"):
            control_request("::1", srv.port, b"echo", "crash")
        with pytest.raises(SideChannelError, match="could not read our request"):
            control_request("::1", srv.port, b"other", None)
        assert fetch_metadata("::1", srv.port, 0).engine_id == "e"
        stats = srv.statistics()
    assert (stats.control_served, stats.control_rejected) == (1, 2)
    assert (stats.served, stats.malformed) == (1, 1)
