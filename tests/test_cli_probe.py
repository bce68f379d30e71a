"""`kvpush probe` against live `kvpush endpoint` processes, on 127.0.0.1 and ::1."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Endpoint, free_port, run_kvpush, start_endpoint

pytestmark = pytest.mark.timeout(90)

TOKEN = "probe-test-secret"


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture(scope="module")
def v6_endpoint(token_file: Path) -> Iterator[Endpoint]:
    """An endpoint on ::1 that wants a token, shaped like Llama-3.1-8B (2 layers of it)."""
    ep = start_endpoint(
        "--preset",
        "llama-3.1-8b",
        "--layers",
        "2",
        "--blocks",
        "4",
        "--token-file",
        str(token_file),
        "--engine-id",
        "v6-engine",
        host="::1",
    )
    yield ep
    assert ep.stop() == 0


def _probe(ep: Endpoint, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = run_kvpush("probe", "--host", ep.host, "--port", str(ep.port), *args, env=env)
    return result.returncode, result.stdout, result.stderr


def test_live_endpoint_answers_with_what_it_registered(tiny_endpoint: Endpoint) -> None:
    code, out, err = _probe(tiny_endpoint, "--json")
    assert code == 0, err
    found = json.loads(out)
    assert found["ok"] is True
    assert found["rank"] == 0
    assert found["engine_id"].startswith("endpoint-")
    assert found["incarnation"] in tiny_endpoint.ready_line
    assert found["role"] == "both"
    assert (found["layout"], found["dtype"], found["num_layers"]) == (
        "kv_separate/NHD",
        "bfloat16",
        2,
    )
    # tiny: 2 layers x (K, V) x 16 tokens x 2 heads x 32 dims x 2 bytes, 8 blocks
    assert found["bytes_per_block"] == 2 * 2 * 16 * 2 * 32 * 2
    assert found["registered_bytes"] == 8 * found["bytes_per_block"]
    assert f"registered_bytes={found['registered_bytes'] * 2}" in tiny_endpoint.ready_line
    assert len(found["regions"]) == 4
    assert found["round_trip_ms"] > 0

    code, out, _ = _probe(tiny_endpoint, "--rank", "1")
    assert code == 0
    assert "rank 1: OK, round trip" in out
    assert "4 x 8 blocks" in out


def test_ipv6_endpoint_with_token(v6_endpoint: Endpoint, token_file: Path) -> None:
    code, out, err = _probe(v6_endpoint, "--token-file", str(token_file))
    assert code == 0, err
    assert out.startswith(f"tcp://[::1]:{v6_endpoint.port} rank 0: OK")
    assert "v6-engine" in out
    # The token may come from the environment too.
    code, _, err = _probe(v6_endpoint, env={"KVPUSH_TOKEN": TOKEN})
    assert code == 0, err


def test_wrong_or_missing_token_exits_1(v6_endpoint: Endpoint, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("guess")
    code, out, err = _probe(v6_endpoint, "--token-file", str(wrong))
    assert (code, out) == (1, "")
    assert err.strip().splitlines() == [
        f"AuthenticationRefused: tcp://[::1]:{v6_endpoint.port} rank 0: wrong token: this side "
        "channel needs the shared token (--token-file or KVPUSH_TOKEN)"
    ]
    code, _, err = _probe(v6_endpoint)
    assert code == 1
    assert "AuthenticationRefused" in err and "no token given" in err


def test_unknown_rank_exits_1(tiny_endpoint: Endpoint) -> None:
    code, _, err = _probe(tiny_endpoint, "--rank", "5")
    assert code == 1
    assert err.startswith("UnknownRank: ")
    assert "no rank 5 here: this engine serves ranks 0, 1" in err


def test_incompatible_endpoint_exits_1_naming_what_differs(
    tiny_endpoint: Endpoint, v6_endpoint: Endpoint, token_file: Path
) -> None:
    reference = start_endpoint("--preset", "tiny", "--blocks", "8", "--token-file", str(token_file))
    try:
        code, out, err = _probe(
            v6_endpoint, "--token-file", str(token_file), "--expect-peer", reference.address
        )
    finally:
        reference.stop()
    assert (code, out) == (1, "")
    assert err.startswith("IncompatiblePeer: ")
    assert "regions differ first at #0" in err
    assert "bytes per block" in err
    # A reference that cannot prove it holds the token is not believed either.
    code, out, err = _probe(
        v6_endpoint, "--token-file", str(token_file), "--expect-peer", tiny_endpoint.address
    )
    assert (code, out) == (1, "")
    assert err.startswith("AuthenticationRefused: the reference peer")
    assert "without proving that it holds the shared token" in err

    code, out, _ = _probe(tiny_endpoint, "--json")
    the_hash = json.loads(out)["compat_hash"]
    code, out, err = _probe(tiny_endpoint, "--expect-compat-hash", the_hash, "--rank", "1")
    assert code == 0, err
    code, out, err = _probe(tiny_endpoint, "--expect-compat-hash", "0" * 32, "--json")
    assert code == 1
    assert json.loads(out)["error"] == "IncompatiblePeer"


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_closed_port_exits_1_at_once(host: str) -> None:
    port = free_port(host)
    result = run_kvpush("probe", "--host", host, "--port", str(port), "--timeout-ms", "60000")
    assert result.returncode == 1
    assert result.stderr.startswith("PeerUnreachable: ")
    assert "connection refused" in result.stderr


def test_usage_errors_exit_2() -> None:
    result = run_kvpush("probe", "--host", "127.0.0.1")
    assert result.returncode == 2
    assert "--port" in result.stderr
    result = run_kvpush("probe", "--port", "x")
    assert result.returncode == 2
