"""`kvpush endpoint` and `kvpush demo` as a user runs them: real processes and signals."""

from __future__ import annotations

import json
import signal

import pytest

from conftest import run_kvpush, start_endpoint

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


def test_demo_runs_end_to_end() -> None:
    result = run_kvpush("demo", "--preset", "tiny", "--blocks", "4", timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "kvpush endpoint ready:" in out
    assert "demo: probe tcp://127.0.0.1:" in out
    assert "2 layers, 4 regions x 4 blocks" in out
    assert out.rstrip().endswith("demo: endpoint stopped cleanly (exit 0); demo OK")


@pytest.mark.nixl
def test_endpoint_with_nixl_publishes_its_agent_and_stops_cleanly() -> None:
    ep = start_endpoint("--preset", "tiny", "--blocks", "4", "--transport", "nixl")
    probe = run_kvpush("probe", "--port", str(ep.port), "--json")
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert found["agent_name"].startswith(found["engine_id"] + "-r0-")
    assert found["agent_metadata_bytes"] > 0
    assert ep.stop() == 0
