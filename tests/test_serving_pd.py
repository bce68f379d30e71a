"""Disaggregated serving end to end: prefill, decode and proxy processes over NIXL.

The acceptance test of issue 6: with speculative decoding on, every request through
prefill/decode gives exactly the single instance's tokens and the same mean acceptance
length, on 127.0.0.1 and on ::1 (one with layer-wise push, one without).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import run_kvpush
from kvpush.config import TimingConfig
from kvpush.serving.checkpoint import make_model
from kvpush.serving.demo import (
    DemoOptions,
    Stack,
    make_prompts,
    metric_sum,
    metric_values,
    run_workload,
)

pytestmark = pytest.mark.nixl  # prefill and decode servers move KV through real NIXL


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pd-model")
    make_model(path, seed=11)
    return path


@pytest.fixture(
    scope="module",
    params=[("127.0.0.1", True), ("::1", False)],
    ids=["ipv4-layerwise", "ipv6-whole"],
)
def stack(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    host, layerwise = request.param
    options = DemoOptions(
        model_dir=model_dir, host=host, block_size=8, layerwise=layerwise, ready_timeout_s=90
    )
    s = Stack(options, tmp_path_factory.mktemp("pd-logs"))
    s.start()
    yield s
    s.close()


def test_pd_matches_single_instance_token_for_token_with_equal_acceptance(stack: Stack) -> None:
    prompts = make_prompts(10, seed=5)
    pd = run_workload(stack.proxy.url, prompts, max_tokens=24, concurrency=5)
    single = run_workload(stack.single.url, prompts, max_tokens=24, concurrency=5)
    assert [r.error for r in pd] == [None] * len(prompts)
    assert [r.error for r in single] == [None] * len(prompts)
    for a, b in zip(pd, single, strict=True):
        assert len(a.token_ids) == 24
        assert a.token_ids == b.token_ids, a.index
        assert a.acceptance == b.acceptance, a.index
    decode, single_m = stack.metrics(stack.decode), stack.metrics(stack.single)
    acceptance = decode["kvpush_spec_decode_mean_acceptance_length"]
    assert acceptance > 1.0
    assert acceptance == single_m["kvpush_spec_decode_mean_acceptance_length"]
    assert metric_sum(decode, "kvpush_transfers_total", "finished", "receiver") == len(prompts)
    assert metric_sum(decode, "kvpush_transfers_total", '"failed"') == 0
    assert metric_sum(decode, "kvpush_transfer_bytes_total", "receiver") > 0
    prefill = stack.metrics(stack.prefill)
    assert metric_sum(prefill, "kvpush_transfers_total", "finished", "sender") == len(prompts)
    # Every block is back: nothing held after the transfers ended.
    assert prefill["kvpush_kv_blocks_held"] == 0
    assert decode["kvpush_kv_blocks_held"] == 0


def test_pd_non_streamed_completion_and_bad_requests(stack: Stack) -> None:
    body = {"prompt": "push mode", "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    via_proxy = httpx.post(f"{stack.proxy.url}/v1/completions", json=body, timeout=60)
    alone = httpx.post(f"{stack.single.url}/v1/completions", json=body, timeout=60)
    assert via_proxy.status_code == 200, via_proxy.text
    assert via_proxy.json()["choices"][0]["token_ids"] == alone.json()["choices"][0]["token_ids"]

    bad = httpx.post(
        f"{stack.proxy.url}/v1/completions", json={**body, "temperature": 1.0}, timeout=60
    )
    assert bad.status_code == 400
    assert "temperature" in bad.json()["error"]["message"]
    own = httpx.post(
        f"{stack.proxy.url}/v1/completions",
        json={**body, "kv_transfer_params": {"transfer_id": "x"}},
        timeout=60,
    )
    assert own.status_code == 400
    assert "set by the proxy" in own.json()["error"]["message"]
    missing = httpx.post(
        f"{stack.decode.url}/v1/completions",
        json={
            **body,
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "transfer_id": "t1",
                "remote_host": "127.0.0.1",
            },
        },
        timeout=60,
    )
    assert missing.status_code == 400
    assert "remote_port" in missing.json()["error"]["message"]
    wrong_role = httpx.post(
        f"{stack.prefill.url}/v1/completions",
        json={**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "t2"}},
        timeout=60,
    )
    assert wrong_role.status_code == 400
    assert "prefill server" in wrong_role.json()["error"]["message"]


def test_decode_request_naming_an_unreachable_prefill_side_channel_fails_with_the_reason(
    stack: Stack,
) -> None:
    from kvpush.readiness import free_port

    host = stack.options.host
    body = {
        "prompt": "nobody will send this",
        "max_tokens": 4,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "transfer_id": "to-nowhere",
            "remote_host": host,
            "remote_port": free_port(host),
        },
    }
    r = httpx.post(f"{stack.decode.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 502, r.text
    message = r.json()["error"]["message"]
    assert "to-nowhere" in message
    assert "handshake_failed" in message
    decode = stack.metrics(stack.decode)
    assert decode["kvpush_kv_blocks_held"] == 0
    assert metric_sum(decode, "kvpush_transfers_total", "handshake_failed") >= 1
    ok = httpx.post(
        f"{stack.proxy.url}/v1/completions",
        json={"prompt": "still fine", "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


def test_a_full_decode_server_refuses_at_once_instead_of_waiting(
    stack: Stack, tmp_path: Path
) -> None:
    if stack.options.host != "127.0.0.1":
        pytest.skip("exercised once, on IPv4")
    from kvpush.readiness import free_port
    from kvpush.serving.procs import ServerProcess

    host = stack.options.host
    port, side = free_port(host), free_port(host)
    small = ServerProcess(
        "small-decode",
        [
            "serve",
            "--role",
            "decode",
            "--model",
            str(stack.options.model_dir),
            "--host",
            host,
            "--port",
            str(port),
            "--side-channel-port",
            str(side),
            "--block-size",
            "8",
            "--num-blocks",
            "256",
        ],
        host=host,
        port=port,
        log_dir=tmp_path,
        side_channel_port=side,
    )
    small.start()
    try:
        small.wait_ready(90)
        # A local request takes 255 of the 256 blocks (2039 tokens) and runs for a while.
        with httpx.stream(
            "POST",
            f"{small.url}/v1/completions",
            timeout=60,
            json={
                "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9],
                "max_tokens": 2030,
                "ignore_eos": True,
                "stream": True,
            },
        ) as busy:
            lines = busy.iter_lines()  # kept referenced: dropping it would close the stream
            while not next(lines).startswith("data: {"):
                pass
            p_side = stack.prefill.side_channel_port
            r = httpx.post(
                f"{small.url}/v1/completions",
                timeout=30,
                json={
                    "prompt": "x" * 10,
                    "max_tokens": 8,
                    "kv_transfer_params": {
                        "do_remote_prefill": True,
                        "transfer_id": "no-room",
                        "remote_host": host,
                        "remote_port": p_side,
                    },
                },
            )
            assert r.status_code == 503, r.text
            assert "no free KV blocks" in r.json()["error"]["message"]
        # Leaving the stream aborts the busy request: every block comes back.
        for _ in range(100):
            metrics = httpx.get(f"{small.url}/metrics", timeout=10).text
            if "kvpush_kv_blocks_held 0\n" in metrics:
                break
            threading.Event().wait(0.1)
        assert "kvpush_kv_blocks_held 0\n" in metrics
    finally:
        assert small.close() == 0
    # The prefill server was told, and serves on.
    ok = httpx.post(
        f"{stack.proxy.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60
    )
    assert ok.status_code == 200, ok.text


def test_the_proxy_spreads_requests_over_several_decode_servers(
    stack: Stack, tmp_path: Path
) -> None:
    if stack.options.host != "127.0.0.1":
        pytest.skip("exercised once, on IPv4")
    from kvpush.readiness import free_port
    from kvpush.serving.procs import ServerProcess

    host = stack.options.host
    port, side, proxy_port = free_port(host), free_port(host), free_port(host)
    second = ServerProcess(
        "decode-2",
        [
            "serve",
            "--role",
            "decode",
            "--model",
            str(stack.options.model_dir),
            "--host",
            host,
            "--port",
            str(port),
            "--side-channel-port",
            str(side),
            "--block-size",
            "8",
            "--speculative-tokens",
            "4",
        ],
        host=host,
        port=port,
        log_dir=tmp_path,
        side_channel_port=side,
    )
    proxy = ServerProcess(
        "proxy-2",
        [
            "proxy",
            "--prefill",
            stack.prefill.url,
            "--decode",
            stack.decode.url,
            second.url,
            "--host",
            host,
            "--port",
            str(proxy_port),
        ],
        host=host,
        port=proxy_port,
        log_dir=tmp_path,
    )
    before = metric_sum(stack.metrics(stack.decode), "kvpush_transfers_total", "finished")
    try:
        second.start()
        proxy.start()
        second.wait_ready(90)
        proxy.wait_ready(90)
        prompts = make_prompts(8, seed=21)
        spread = run_workload(proxy.url, prompts, max_tokens=8, concurrency=8)
        single = run_workload(stack.single.url, prompts, max_tokens=8, concurrency=8)
        assert [r.error for r in spread] == [None] * 8
        assert [r.token_ids for r in spread] == [r.token_ids for r in single]
        first = metric_sum(stack.metrics(stack.decode), "kvpush_transfers_total", "finished")
        other = metric_sum(
            metric_values(httpx.get(f"{second.url}/metrics", timeout=10).text),
            "kvpush_transfers_total",
            "finished",
        )
        assert first - before > 0
        assert other > 0
        assert first - before + other == 8
    finally:
        proxy.close()
        second.close()


def test_a_dead_prefill_server_fails_requests_promptly_and_a_restart_recovers(
    stack: Stack,
) -> None:
    if stack.options.host != "127.0.0.1":
        pytest.skip("restarting a server is exercised once, on IPv4")
    prompts = make_prompts(3, seed=9)
    stack.prefill.kill()
    failed = run_workload(stack.proxy.url, prompts, max_tokens=8, concurrency=3, timeout_s=30)
    for r in failed:
        assert r.error is not None
        assert "prefill server" in r.error
        assert r.latency_s < 10
    # Blocks the dead sender might still write into stay fenced until its lease has
    # certainly run out (lease + 2 x liveness = 11 s by default), then come back.
    fence_s = TimingConfig().lease_s + 2 * TimingConfig().liveness_timeout_s
    deadline = time.monotonic() + fence_s + 10
    decode = stack.metrics(stack.decode)
    while decode["kvpush_kv_blocks_held"] and time.monotonic() < deadline:
        time.sleep(0.25)
        decode = stack.metrics(stack.decode)
    assert decode["kvpush_kv_blocks_held"] == 0
    assert decode["kvpush_requests_running"] == 0

    stack.restart_prefill()
    again = run_workload(stack.proxy.url, prompts, max_tokens=8, concurrency=3)
    single = run_workload(stack.single.url, prompts, max_tokens=8, concurrency=3)
    assert [r.error for r in again] == [None] * 3
    assert [r.token_ids for r in again] == [r.token_ids for r in single]

    # A graceful restart (the decode side saw no failure and still knows the old agent):
    # the very first request after it must succeed, not hit the stale agent.
    stack.restart_prefill()
    first = run_workload(stack.proxy.url, prompts[:1], max_tokens=8, concurrency=1)
    assert first[0].error is None
    assert first[0].token_ids == single[0].token_ids


def test_kvpush_demo_builds_the_model_checks_every_token_and_survives_a_killed_prefill(
    tmp_path: Path,
) -> None:
    done = run_kvpush(
        "demo",
        *("--model", str(tmp_path / "model"), "--requests", "4", "--concurrency", "2"),
        *("--max-tokens", "8", "--block-size", "8", "--inject", "kill-prefill"),
        *("--log-dir", str(tmp_path / "logs")),
        timeout=240,
    )
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-4000:]
    assert "building the tiny model" in out
    assert "tokens match single run   4/4" in out
    assert "(per request equal: 4/4)" in out
    assert "transfers failed          0" in out
    assert "after restart: ok" in out
    slowest = re.search(r"requests failed, slowest after ([0-9.]+) s", out)
    assert slowest is not None and float(slowest.group(1)) < 10
    assert "PROBLEM" not in out
    assert out.rstrip().endswith("demo OK")
    assert (tmp_path / "model" / "config.json").exists()
    assert (tmp_path / "logs" / "prefill.log").exists()
