"""Disaggregated serving end to end: prefill, decode and proxy processes over NIXL.

The acceptance test of issue 6: with speculative decoding on, every request through
prefill/decode gives exactly the single instance's tokens and the same mean acceptance
length, on 127.0.0.1 and on ::1 (one with layer-wise push, one without).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from conftest import run_kvpush
from kvpush.config import TimingConfig
from kvpush.demo.run import (
    DemoOptions,
    Stack,
    make_load_prompts,
    make_prompts,
    metric_sum,
    metric_values,
    run_workload,
)
from kvpush.net import http_url
from kvpush.procs.readiness import free_port
from kvpush.procs.server_process import ServerProcess, log_tail
from kvpush.stats import percentile

# Prefill and decode servers move KV through real NIXL. The module's stacks start while
# the other half of `make test` runs vLLM servers: a fresh-clone run saw the ipv4 stack's
# prefill take 2 minutes to reach its NIXL agent while vLLM's data-parallel engines
# (which spin) ran beside it, past a 90 s readiness wait and the 120 s test timeout.
# Readiness is waited for STACK_READY_S, and each test (its stack's start included)
# gets the room to take it.
STACK_READY_S = 240.0
pytestmark = [pytest.mark.nixl, pytest.mark.timeout(STACK_READY_S + 120)]

DECODE_BLOCKS = 256
PREFILL_BLOCKS = 768
TOKEN = "pd-secret-" + uuid.uuid4().hex
QUEUE_TIMEOUT_S = 240.0
LIVENESS_S = 8.0  # the servers' --liveness-timeout-s (see the stack)
# "At once" in these tests: within a cap generous for a loaded host, yet far below what
# ends a transfer when nobody tells its servers it is over: the transfer deadline the
# stack's servers run with (demo.Stack: the queue's timeout + 30 s, so 270 s here).
AT_ONCE_S = 15.0


@pytest.fixture(
    scope="module",
    params=[("127.0.0.1", True), ("::1", False)],
    ids=["ipv4-layerwise", "ipv6-whole"],
)
def stack(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    host, layerwise = request.param
    # One family with a shared secret (side channels and the proxy's cancels), one without.
    token_file = None
    if host == "::1":
        token_file = tmp_path_factory.mktemp("pd-token") / "token"
        token_file.write_text(TOKEN)
    # The decode server's KV cache holds only a fraction of a burst (256 blocks of 8
    # tokens): requests it cannot place yet must wait for blocks, not be refused.
    options = DemoOptions(
        model_dir=model_dir,
        host=host,
        block_size=8,
        layerwise=layerwise,
        ready_timeout_s=STACK_READY_S,
        decode_num_blocks=DECODE_BLOCKS,
        # The prefill cache holds a fraction of a burst too: both servers queue, each in
        # its own order, and must never wait on each other.
        prefill_num_blocks=PREFILL_BLOCKS,
        # A loaded CI host runs the load test's burst slowly: no request may time out of
        # the queue there (the queue's timeout is tested with its own small server).
        queue_timeout_s=QUEUE_TIMEOUT_S,
        token_file=token_file,
        # The load test's burst keeps each server's engine thread busy while the other
        # half of `make test` starts vLLM servers: a live prefill went unheard for 4.1 s
        # there, past the default 3 s (as the vLLM modules, `helpers.vllm_e2e.TIMING`).
        liveness_timeout_s=LIVENESS_S,
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


def test_seeded_sampling_and_stop_through_prefill_decode_match_the_single_instance(
    stack: Stack,
) -> None:
    # Issue 10, item 9: under one seed, P/D gives exactly the single instance's tokens.
    for i, prompt in enumerate(make_prompts(4, seed=3)):
        body = {
            "prompt": prompt,
            "max_tokens": 16,
            "temperature": 1.5,
            "top_p": 0.99,
            "seed": 100 + i,
            "return_token_ids": True,
            "stop": ["zz", "kv cache"],
        }
        via = httpx.post(f"{stack.proxy.url}/v1/completions", json=body, timeout=60)
        alone = httpx.post(f"{stack.single.url}/v1/completions", json=body, timeout=60)
        assert via.status_code == alone.status_code == 200, (via.text, alone.text)
        a, b = via.json()["choices"][0], alone.json()["choices"][0]
        assert (a["token_ids"], a["text"], a["finish_reason"]) == (
            b["token_ids"],
            b["text"],
            b["finish_reason"],
        )
    chat = {
        "messages": [{"role": "user", "content": "push the cache"}],
        "max_tokens": 12,
        "seed": 5,
        "temperature": 1.0,
        "return_token_ids": True,
    }
    via = httpx.post(f"{stack.proxy.url}/v1/chat/completions", json=chat, timeout=60)
    alone = httpx.post(f"{stack.single.url}/v1/chat/completions", json=chat, timeout=60)
    assert via.status_code == alone.status_code == 200, (via.text, alone.text)
    assert via.json()["choices"][0]["message"] == alone.json()["choices"][0]["message"]
    assert via.json()["choices"][0]["token_ids"] == alone.json()["choices"][0]["token_ids"]


def test_pd_non_streamed_completion_and_bad_requests(stack: Stack) -> None:
    body = {"prompt": "push mode", "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    via_proxy = httpx.post(f"{stack.proxy.url}/v1/completions", json=body, timeout=60)
    alone = httpx.post(f"{stack.single.url}/v1/completions", json=body, timeout=60)
    assert via_proxy.status_code == 200, via_proxy.text
    assert via_proxy.json()["choices"][0]["token_ids"] == alone.json()["choices"][0]["token_ids"]

    bad = httpx.post(
        f"{stack.proxy.url}/v1/completions", json={**body, "temperature": 3.0}, timeout=60
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


def test_the_proxy_spreads_requests_over_several_decode_servers(
    stack: Stack, tmp_path: Path
) -> None:
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
            *_token_args(stack),
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
            *_token_args(stack),
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
    prompts = make_prompts(3, seed=9)
    # A request answered first: the proxy knows the prefill server, so the legs of the
    # requests after the kill go out (and fail), whatever ran before this test.
    assert run_workload(stack.proxy.url, prompts[:1], max_tokens=8, concurrency=1)[0].error is None
    stack.prefill.kill()
    logged_before = stack.proxy.log_path.stat().st_size
    failed = run_workload(stack.proxy.url, prompts, max_tokens=8, concurrency=3, timeout_s=30)
    for r in failed:
        assert r.error is not None
        assert "prefill server" in r.error
        assert r.latency_s < 10
    # The proxy logs each: a leg that failed with its transfer's id (the servers' logs
    # name it), a request that failed before its legs went out (the first failure
    # makes the proxy ask the server again) without one.
    said = stack.proxy.log_path.read_bytes()[logged_before:].decode(errors="replace")
    legs = re.findall(r"WARNING .*transfer xfer-[0-9a-f]{32} failed \(502\): prefill", said)
    before = re.findall(r"WARNING .*a request failed \(502\): prefill", said)
    assert legs and len(legs) + len(before) >= len(prompts), said
    # Blocks the dead sender might still write into stay fenced until its lease has
    # certainly run out (lease + 2 x liveness), then come back.
    fence_s = TimingConfig().lease_s + 2 * LIVENESS_S
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


# --------------------------------------------------------------------------- issue 10: abuse


def _held(server: ServerProcess) -> float:
    return metric_values(httpx.get(f"{server.url}/metrics", timeout=10).text)[
        "kvpush_kv_blocks_held"
    ]


def _until(predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.01) -> float | None:
    """Seconds until `predicate()` held, or None if it did not within `timeout_s`."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            return None
        time.sleep(step_s)


def _prefill_leg(stack: Stack, tid: str, prompt: object, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(
        f"{stack.prefill.url}/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": max_tokens,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid},
        },
        timeout=60,
    )


def _decode_kvp(stack: Stack, tid: str) -> dict[str, object]:
    return {
        "do_remote_prefill": True,
        "transfer_id": tid,
        "remote_host": stack.options.host,
        "remote_port": stack.prefill.side_channel_port,
    }


def _decode_leg(
    stack: Stack,
    tid: str,
    prompt: object,
    *,
    server: ServerProcess | None = None,
    timeout: float = 60,
    **fields: object,
) -> httpx.Response:
    """The decode leg of `tid` (on `server`, the stack's decode server by default);
    `fields` add to the body (max_tokens is 8 unless given)."""
    body = {"prompt": prompt, "max_tokens": 8, **fields}
    body["kv_transfer_params"] = _decode_kvp(stack, tid)
    url = (server or stack.decode).url
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def _token_args(stack: Stack) -> list[str]:
    token_file = stack.options.token_file
    return [] if token_file is None else ["--token-file", str(token_file)]


def _serve(
    name: str, stack: Stack, log_dir: Path, role: str, *extra: str
) -> tuple[ServerProcess, int | None]:
    host = stack.options.host
    port = free_port(host)
    side = free_port(host) if role != "both" else None
    args = ["serve", "--role", role, "--model", str(stack.options.model_dir), "--host", host]
    args += ["--port", str(port), "--block-size", "8", *_token_args(stack), *extra]
    if side is not None:
        args += ["--side-channel-port", str(side)]
    return (
        ServerProcess(name, args, host=host, port=port, log_dir=log_dir, side_channel_port=side),
        side,
    )


def _proxy(name: str, stack: Stack, log_dir: Path, decode_url: str) -> ServerProcess:
    host = stack.options.host
    port = free_port(host)
    args = ["proxy", "--prefill", stack.prefill.url, "--decode", decode_url]
    args += ["--host", host, "--port", str(port), *_token_args(stack)]
    return ServerProcess(name, args, host=host, port=port, log_dir=log_dir)


def test_a_decode_side_refusal_frees_the_prefill_blocks_long_before_the_deadline(
    stack: Stack, record_property: Callable[[str, object], None]
) -> None:
    # Issue 10, item 2: the prefill leg was computed and held its blocks until the
    # transfer deadline (60 s), because nobody told it the decode leg was refused.
    tid = f"refused-{uuid.uuid4().hex}"
    prompt = "kv " * 150  # 450 tokens: 57 blocks held by the prefill server
    assert _prefill_leg(stack, tid, prompt).status_code == 200
    assert _held(stack.prefill) > 0
    refused = _decode_leg(stack, tid, prompt, n=2)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["type"] == "invalid_request_error"
    freed_after = _until(lambda: _held(stack.prefill) == 0, timeout_s=AT_ONCE_S)
    # Within AT_ONCE_S: left to the deadline, the blocks would be held for minutes.
    assert freed_after is not None, "the prefill server still holds the refused request's KV"
    record_property("prefill_blocks_freed_after_decode_refusal_s", freed_after)
    print(f"\nprefill blocks back to 0 in {freed_after * 1e3:.0f} ms after the decode refusal")
    # The id is spent on the prefill side: a late decode leg for it fails, quickly.
    prefill = stack.metrics(stack.prefill)
    assert metric_sum(prefill, "kvpush_transfers_total", "rejected", "sender") >= 1


def test_a_dead_decode_server_behind_the_proxy_frees_the_prefill_blocks_at_once(
    stack: Stack, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    dead_url = http_url(stack.options.host, free_port(stack.options.host))
    proxy = _proxy("proxy-dead-decode", stack, tmp_path, dead_url)
    proxy.start()
    try:
        proxy.wait_ready(60, health_path="/metrics")  # its /health is 503: no decode server
        r = httpx.post(
            f"{proxy.url}/v1/completions", json={"prompt": "kv " * 150, "max_tokens": 4}, timeout=60
        )
        assert r.status_code == 502, r.text
        message = r.json()["error"]["message"]
        assert "decode server" in message
        # The operator reads it in the proxy's log too.
        said = proxy.log_path.read_text(errors="replace")
        assert f"WARNING kvpush.serving.proxy: a request failed (502): {message}" in said, said
        freed_after = _until(lambda: _held(stack.prefill) == 0, timeout_s=AT_ONCE_S)
        assert freed_after is not None, "freed only by the deadline, if ever"
        record_property("prefill_blocks_freed_after_decode_down_s", freed_after)
        # Its /health says which backend is gone.
        health = httpx.get(f"{proxy.url}/health", timeout=30)
        assert health.status_code == 503
        decode_health = health.json()["decode"]
        assert decode_health == [
            {"url": dead_url, "status": "unreachable", "detail": "ConnectError"}
        ]
        assert health.json()["prefill"][0]["status"] == "ok"
        in_flight = metric_values(httpx.get(f"{proxy.url}/metrics", timeout=10).text)
        assert metric_sum(in_flight, "kvpush_proxy_in_flight") == 0
    finally:
        proxy.close()


def test_kvpush_abort_needs_the_servers_token_when_one_is_configured(stack: Stack) -> None:
    # POST /kvpush/abort cancelled anyone's transfer, unauthenticated. With a token
    # configured (the ::1 stack) it needs that token, as the side channel does; the
    # proxy sends it (the dead-decode test frees the prefill blocks through it).
    tid = f"guarded-{uuid.uuid4().hex}"
    assert _prefill_leg(stack, tid, "kv " * 150).status_code == 200
    held = _held(stack.prefill)
    assert held > 0
    abort = f"{stack.prefill.url}/kvpush/abort"
    token_file = stack.options.token_file
    if token_file is not None:
        for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": TOKEN}):
            refused = httpx.post(abort, json={"transfer_id": tid}, headers=headers, timeout=10)
            assert refused.status_code == 401, refused.text
            error = refused.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == 401
            assert "Authorization: Bearer <token>" in error["message"]
            assert error["param"] == "authorization"
        decode_refused = httpx.post(
            f"{stack.decode.url}/kvpush/abort", json={"transfer_id": tid}, timeout=10
        )
        assert decode_refused.status_code == 401
        # Refused means not done: the transfer is still there, its blocks held.
        assert _held(stack.prefill) == held
        headers = {"Authorization": f"Bearer {token_file.read_text()}"}
    else:
        headers = {}  # no token configured: as open as the side channel
    done = httpx.post(abort, json={"transfer_id": tid}, headers=headers, timeout=10)
    assert done.status_code == 200, done.text
    assert done.json() == {"transfer_id": tid, "status": "cancelling"}
    # Freed by the abort, within AT_ONCE_S: not left to the transfer deadline.
    assert _until(lambda: _held(stack.prefill) == 0, AT_ONCE_S) is not None


def test_a_client_that_disconnects_stops_its_request_on_both_legs(stack: Stack) -> None:
    # Issue 10, item 3: a non-streamed request went on generating (and holding blocks)
    # after its client left, so the proxy's cancel of the other leg did nothing.
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 2040, "ignore_eos": True}
    before = metric_sum(stack.metrics(stack.decode), "kvpush_generation_tokens_total")
    try:
        r = httpx.post(
            f"{stack.proxy.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3)
        )
    except httpx.ReadTimeout:
        pass  # the client gives up and disconnects
    else:
        raise AssertionError(
            f"expected no answer within 0.3 s, got {r.status_code}: {r.text[:300]}"
        )
    assert _until(lambda: _held(stack.decode) == 0 and _held(stack.prefill) == 0, 10) is not None
    decode = stack.metrics(stack.decode)
    assert decode["kvpush_requests_running"] == 0
    generated = metric_sum(decode, "kvpush_generation_tokens_total") - before
    assert generated < 2040, "the abandoned request ran to its end"
    assert metric_sum(decode, "kvpush_requests_total", "aborted") >= 1


def test_a_full_decode_server_queues_in_order_and_refuses_only_a_full_queue(
    stack: Stack, tmp_path: Path
) -> None:
    # Issue 10, item 4: a request the decode server could not place was refused (503 "no
    # free KV blocks"); now it waits for blocks, and only a full queue refuses, with 429.
    small, _ = _serve(
        "small-decode", stack, tmp_path, "decode", "--num-blocks", "256", "--max-waiting", "1"
    )
    small.start()
    try:
        small.wait_ready(90)
        with httpx.stream(
            "POST",
            f"{small.url}/v1/completions",
            timeout=60,
            json={
                "prompt": list(range(1, 10)),
                "max_tokens": 2030,
                "ignore_eos": True,
                "stream": True,
            },
        ) as busy:
            lines = busy.iter_lines()  # kept referenced: dropping it would close the stream
            while not next(lines).startswith("data: {"):
                pass
            prompt_a, prompt_b = "queued " * 10, "refused " * 10
            tid_a, tid_b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"
            assert _prefill_leg(stack, tid_a, prompt_a).status_code == 200
            held_a = _held(stack.prefill)
            assert held_a > 0
            queued: list[httpx.Response] = []
            waiter = threading.Thread(
                target=lambda: queued.append(
                    _decode_leg(stack, tid_a, prompt_a, server=small, return_token_ids=True)
                )
            )
            waiter.start()
            waiting = lambda: stack.metrics(small)["kvpush_requests_waiting"] == 1  # noqa: E731
            assert _until(waiting, 30) is not None
            assert _prefill_leg(stack, tid_b, prompt_b).status_code == 200
            assert _held(stack.prefill) > held_a
            full = _decode_leg(stack, tid_b, prompt_b, server=small, timeout=30)
            assert full.status_code == 429, full.text
            assert full.headers["retry-after"] == "1"
            error = full.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == 429
            assert "too many requests waiting" in error["message"]
            # The refused request's prefill blocks come back; the queued one's stay.
            assert _until(lambda: _held(stack.prefill) == held_a, 10) is not None
            assert queued == [] and waiter.is_alive()
        # Leaving the stream aborts the busy request: the queued one gets its blocks.
        waiter.join(60)
        assert queued and queued[0].status_code == 200, queued and queued[0].text
        single = httpx.post(
            f"{stack.single.url}/v1/completions",
            json={"prompt": prompt_a, "max_tokens": 8, "return_token_ids": True},
            timeout=60,
        )
        assert (
            queued[0].json()["choices"][0]["token_ids"] == single.json()["choices"][0]["token_ids"]
        )
        assert _until(lambda: _held(small) == 0 and _held(stack.prefill) == 0, 10) is not None
    finally:
        assert small.close() == 0


def test_a_decode_server_dying_mid_stream_ends_the_clients_stream_with_an_error(
    stack: Stack, tmp_path: Path
) -> None:
    # Issue 10, item 6: the client got a truncated body, without an error or [DONE].
    doomed, _ = _serve("doomed-decode", stack, tmp_path, "decode")
    doomed.start()
    proxy = _proxy("proxy-doomed", stack, tmp_path, doomed.url)
    proxy.start()
    try:
        doomed.wait_ready(90)
        proxy.wait_ready(60)
        events: list[str] = []
        with httpx.stream(
            "POST",
            f"{proxy.url}/v1/completions",
            timeout=60,
            json={"prompt": "die", "max_tokens": 2000, "ignore_eos": True, "stream": True},
        ) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line)
                if len(events) == 3:
                    doomed.kill()
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: ") :])["error"]
        assert error["type"] == "server_error" and "decode server" in error["message"]
        for event in events[:-2]:
            assert "choices" in json.loads(event[len("data: ") :])  # whole events only
    finally:
        proxy.close()
        doomed.close()


def test_sigterm_stops_a_server_with_exit_status_0_and_its_runtime_closed(
    stack: Stack, tmp_path: Path
) -> None:
    server, side = _serve("sigterm-prefill", stack, tmp_path, "prefill")
    server.start()
    try:
        server.wait_ready(90)
        assert server.pid is not None
        os.kill(server.pid, signal.SIGTERM)
        assert _until(lambda: server.poll() is not None, 30, 0.1) is not None
        assert server.poll() == 0, log_tail(server.log_path)
        # Its runtime and side channel were closed: the ports are free again.
        assert side is not None
        family = socket.AF_INET6 if ":" in stack.options.host else socket.AF_INET
        for port in (server.port, side):
            with socket.socket(family) as sock:
                # Connections the health checks left in TIME_WAIT do not hold a port
                # against SO_REUSEADDR; a listening socket still would.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((stack.options.host, port))
    finally:
        server.close()


BAD_BODIES: list[tuple[bytes, int, str]] = [
    (b'{"prompt": "a", "max_tokens": NaN}', 400, "NaN is not valid JSON"),
    (b'{"prompt": "a", "max_tokens": Infinity}', 400, "Infinity is not valid JSON"),
    (b'{"prompt": [1, -Infinity]}', 400, "-Infinity is not valid JSON"),
    (b'{"prompt": "\\ud800", "max_tokens": 2}', 400, "lone surrogate"),
    (b'{"prompt": "ok", "user": "\\udfff"}', 400, "lone surrogate"),
    (b"[" * 100_000, 400, "nested"),
    (b'{"prompt": ' + b"[" * 200 + b"]" * 200 + b"}", 400, "nested deeper"),
    (b'{"prompt": "a", "stream_options": {"include_usage": "yes"}}', 400, "include_usage"),
    (b'{"prompt": "a", "max_tokens": "8"}', 400, "max_tokens"),
    (b"\xff\xfe not utf-8", 400, "not valid JSON"),
    (b'"just a string"', 400, "JSON object"),
]


def test_bad_bodies_get_openai_shaped_4xx_and_never_a_500(stack: Stack) -> None:
    # Issue 10, item 5: some of these answered a plain-text 500 with a traceback, and
    # through the proxy leaked its in-flight counter.
    huge_prompt = json.dumps({"prompt": "x" * 5_000_000, "max_tokens": 2}).encode()
    too_big = json.dumps({"prompt": "x" * 9_000_000}).encode()
    cases = [*BAD_BODIES, (huge_prompt, 400, "cannot fit"), (too_big, 413, "limit")]
    for server in (stack.proxy, stack.single, stack.decode, stack.prefill):
        for raw, status, fragment in cases:
            started = time.monotonic()
            r = httpx.post(
                f"{server.url}/v1/completions",
                content=raw,
                headers={"content-type": "application/json"},
                timeout=60,
            )
            assert r.status_code == status, (server.name, raw[:60], r.text[:300])
            error = r.json()["error"]
            assert fragment in error["message"], (server.name, raw[:60], error)
            assert error["type"] == "invalid_request_error" and error["code"] == status
            assert time.monotonic() - started < 10, (server.name, raw[:60])
        missing = httpx.get(f"{server.url}/v2/nothing", timeout=10)
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == 404
        wrong_method = httpx.get(f"{server.url}/v1/completions", timeout=10)
        assert wrong_method.status_code == 405
        assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    proxy_metrics = metric_values(httpx.get(f"{stack.proxy.url}/metrics", timeout=10).text)
    assert metric_sum(proxy_metrics, "kvpush_proxy_in_flight") == 0
    assert _held(stack.prefill) == 0 and _held(stack.decode) == 0
    ok = httpx.post(
        f"{stack.proxy.url}/v1/completions", json={"prompt": "fine", "max_tokens": 2}, timeout=60
    )
    assert ok.status_code == 200, ok.text


def test_the_proxy_serves_models_metrics_health_and_names_the_clients_max_tokens(
    stack: Stack,
) -> None:
    models = httpx.get(f"{stack.proxy.url}/v1/models", timeout=10)
    assert models.status_code == 200
    assert models.json() == httpx.get(f"{stack.decode.url}/v1/models", timeout=10).json()
    health = httpx.get(f"{stack.proxy.url}/health", timeout=10)
    assert health.status_code == 200
    assert [b["status"] for b in health.json()["prefill"] + health.json()["decode"]] == ["ok"] * 2
    too_long = httpx.post(
        f"{stack.proxy.url}/v1/completions",
        json={"prompt": [7] * 2000, "max_tokens": 100},
        timeout=60,
    )
    assert too_long.status_code == 400
    assert "max_tokens (100)" in too_long.json()["error"]["message"]
    metrics = httpx.get(f"{stack.proxy.url}/metrics", timeout=10).text
    assert 'kvpush_proxy_requests_total{outcome="ok"}' in metrics
    assert 'kvpush_proxy_requests_total{outcome="prefill_failed"}' in metrics
    # The side channel's and the runtime's health are part of a role server's.
    decode_health = httpx.get(f"{stack.decode.url}/health", timeout=10).json()
    assert decode_health["side_channel"] == "ok" and decode_health["status"] == "ok"
    assert decode_health["runtime"] == "ok" and "runtime_failure" not in decode_health
    # The deadlines in force, --liveness-timeout-s among them, as each server runs them.
    prefill_health = httpx.get(f"{stack.prefill.url}/health", timeout=10).json()
    for server_health in (prefill_health, decode_health):
        assert server_health["liveness_timeout_s"] == LIVENESS_S, server_health
        assert server_health["transfer_deadline_s"] == QUEUE_TIMEOUT_S + 30, server_health


def test_legs_sharing_a_transfer_id_but_not_a_prompt_fail_at_once_saying_so(
    stack: Stack, record_property: Callable[[str, object], None]
) -> None:
    # Issue 10, item 7: two legs with one transfer_id and different prompts of the same
    # length decoded from the other prompt's KV, silently; then (prompt fingerprints in
    # the runtime's ids) they could not pair, and both waited out the transfer deadline.
    # The prefill server sees the registration of its id with another fingerprint and
    # refuses both legs at once, saying why.
    tid = f"forged-{uuid.uuid4().hex}"
    prefilled = _prefill_leg(stack, tid, "aaaa bbbb cccc")
    assert prefilled.status_code == 200
    fingerprint = prefilled.json()["kv_transfer_params"]["prompt_fingerprint"]
    assert len(fingerprint) == 16
    assert _held(stack.prefill) > 0
    started = time.monotonic()
    decoded = _decode_leg(stack, tid, "zzzz yyyy xxxx", max_tokens=4, timeout=30)
    failed_after = time.monotonic() - started
    assert decoded.status_code == 502, decoded.text
    message = decoded.json()["error"]["message"]
    assert "carry different prompts" in message and fingerprint in message, message
    freed = _until(lambda: _held(stack.prefill) == 0 and _held(stack.decode) == 0, 10)
    assert freed is not None
    record_property("mismatched_legs_failed_after_s", failed_after)
    print(f"\nmismatched legs: decode leg failed after {failed_after * 1e3:.0f} ms")
    assert failed_after < AT_ONCE_S  # not left to the transfer deadline
    # The other order: the decode leg waits first, the prefill leg comes second.
    tid = f"forged-{uuid.uuid4().hex}"
    answers: list[httpx.Response] = []
    waiter = threading.Thread(
        target=lambda: answers.append(
            _decode_leg(stack, tid, "qqqq rrrr ssss", max_tokens=4, timeout=30)
        )
    )
    waiter.start()
    assert _until(lambda: _held(stack.decode) > 0, 10) is not None
    _prefill_leg(stack, tid, "aaaa bbbb cccc")  # 200, or 409 if still computing
    waiter.join(10)
    assert answers and answers[0].status_code == 502, answers and answers[0].text
    assert "carry different prompts" in answers[0].json()["error"]["message"]
    assert _until(lambda: _held(stack.prefill) == 0 and _held(stack.decode) == 0, 10) is not None


@pytest.mark.timeout(300)  # two servers of its own to start: slow on a loaded host
def test_prefill_and_decode_queues_never_wait_on_each_other(stack: Stack, tmp_path: Path) -> None:
    # A prefill cache full of prompts whose decode legs wait in the decode server's
    # queue, while the decode cache is full of requests whose prompts wait in the
    # prefill server's queue: on main both waited for a queue timeout (30 s). Here each
    # cache holds one request (51 of 64 blocks): X is prefilled first, Y's decode leg
    # takes the decode cache, then Y's prefill leg and X's decode leg arrive.
    prefill, _ = _serve("tiny-prefill", stack, tmp_path, "prefill", "--num-blocks", "64")
    decode, _ = _serve("tiny-decode", stack, tmp_path, "decode", "--num-blocks", "64")
    prefill.start()
    decode.start()
    try:
        prefill.wait_ready(150)
        decode.wait_ready(150)
        prompts = {"x": "push it " * 50, "y": "wait now" * 50}  # 401 tokens each
        tids = {k: f"{k}-{uuid.uuid4().hex}" for k in prompts}
        answers: dict[str, httpx.Response] = {}

        def leg(name: str, url: str, body: dict[str, object]) -> threading.Thread:
            def post() -> None:
                answers[name] = httpx.post(f"{url}/v1/completions", json=body, timeout=60)

            t = threading.Thread(target=post, name=name)
            t.start()
            return t

        def p_leg(k: str) -> threading.Thread:
            kvp = {"do_remote_decode": True, "transfer_id": tids[k]}
            body = {"prompt": prompts[k], "max_tokens": 8, "kv_transfer_params": kvp}
            return leg(f"prefill-{k}", prefill.url, body)

        def d_leg(k: str) -> threading.Thread:
            kvp = {
                "do_remote_prefill": True,
                "transfer_id": tids[k],
                "remote_host": stack.options.host,
                "remote_port": prefill.side_channel_port,
            }
            body = {
                "prompt": prompts[k],
                "max_tokens": 8,
                "ignore_eos": True,
                "return_token_ids": True,
                "kv_transfer_params": kvp,
            }
            return leg(f"decode-{k}", decode.url, body)

        def taken(server: ServerProcess) -> bool:
            m = stack.metrics(server)
            return m["kvpush_kv_blocks_held"] > 0 or m["kvpush_requests_waiting"] > 0

        legs = [p_leg("x")]
        assert _until(lambda: taken(prefill), 30) is not None
        legs.append(d_leg("y"))
        assert _until(lambda: _held(decode) > 0, 30) is not None
        legs += [p_leg("y"), d_leg("x")]
        started = time.monotonic()
        for t in legs:
            t.join(max(0.1, 20 - (time.monotonic() - started)))
        took = time.monotonic() - started
        stuck = sorted(t.name for t in legs if t.is_alive())
        assert not stuck, f"legs still waiting after {took:.1f} s: {stuck}"
        assert {k: r.status_code for k, r in answers.items()} == dict.fromkeys(answers, 200), {
            k: r.text[:200] for k, r in answers.items()
        }
        for k, prompt in prompts.items():
            alone = httpx.post(
                f"{stack.single.url}/v1/completions",
                json={
                    "prompt": prompt,
                    "max_tokens": 8,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
                timeout=60,
            )
            got = answers[f"decode-{k}"].json()["choices"][0]["token_ids"]
            assert got == alone.json()["choices"][0]["token_ids"], k
        assert _until(lambda: _held(prefill) == 0 and _held(decode) == 0, 10) is not None
    finally:
        # Their exit status is another test's (SIGTERM): here a failure to start would
        # be hidden behind the exit status of the server stopped while it started.
        decode.close()
        prefill.close()


@pytest.mark.timeout(600)  # about 20 s here; a loaded CI host may take several times that
def test_concurrent_mixed_requests_into_small_caches_all_match_the_single_instance(
    stack: Stack, record_property: Callable[[str, object], None]
) -> None:
    # Issue 10, item 4 and the load test: with prompts of mixed lengths (up to ~600
    # tokens), 118-126 of 200 concurrent requests through the proxy were refused. Both
    # caches hold a fraction of the burst, so both servers queue, each in its own order
    # (the prefill's admission keeps the two queues from waiting on each other). 200
    # requests on 127.0.0.1; on ::1 (the other stack: whole pushes, a token) a third of
    # that, to keep CI short: the same queueing, on the other family.
    n = 200 if stack.options.host == "127.0.0.1" else 64
    prompts = make_load_prompts(n, seed=10)
    started = time.monotonic()
    pd = run_workload(stack.proxy.url, prompts, max_tokens=4, concurrency=n, timeout_s=280)
    pd_wall = time.monotonic() - started
    freed = _until(lambda: _held(stack.prefill) == 0 and _held(stack.decode) == 0, 20)
    started = time.monotonic()
    single = run_workload(stack.single.url, prompts, max_tokens=4, concurrency=n, timeout_s=280)
    single_wall = time.monotonic() - started
    assert [r.error for r in pd] == [None] * len(prompts)
    assert [r.error for r in single] == [None] * len(prompts)
    assert [r.token_ids for r in pd] == [r.token_ids for r in single]
    assert freed is not None, "blocks still held after the burst"
    decode, prefill = stack.metrics(stack.decode), stack.metrics(stack.prefill)
    figures = {
        "requests": n,
        "pd_p50_s": percentile([r.latency_s for r in pd], 50),
        "pd_p99_s": percentile([r.latency_s for r in pd], 99),
        "single_p50_s": percentile([r.latency_s for r in single], 50),
        "single_p99_s": percentile([r.latency_s for r in single], 99),
        "pd_wall_s": pd_wall,
        "single_wall_s": single_wall,
        "blocks_held_after_s": freed,
        "decode_blocks": decode["kvpush_kv_blocks_total"],
        "prefill_blocks": prefill["kvpush_kv_blocks_total"],
    }
    for key, value in figures.items():
        record_property(key, value)
    print(
        f"\nload test ({stack.options.host}, {n} concurrent):",
        {k: round(v, 3) for k, v in figures.items()},
    )


def test_a_client_gone_while_the_proxy_reads_its_body_is_counted_not_a_crash(
    stack: Stack,
) -> None:
    name = "kvpush_proxy_body_disconnects_total"
    before = stack.metrics(stack.proxy).get(name, 0.0)
    host, port = stack.proxy.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            b'{"prompt": "half a bo'
        )
        time.sleep(0.2)  # the proxy is reading the body now
    deadline = time.monotonic() + 10
    while stack.metrics(stack.proxy).get(name, 0.0) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stack.metrics(stack.proxy).get(name, 0.0) == before + 1
    log = stack.proxy.log_path.read_text(errors="replace")
    assert "Traceback" not in log
    assert "Exception in ASGI application" not in log


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (
            ["--prefill-dp", "2"],
            "ConfigError: prefill data parallelism 2: expected 1, or more for vLLM prefill "
            "servers given their side channels",
        ),
        (
            ["--decode-side-channel", "127.0.0.1:5600", "--decode-dp", "0"],
            "ConfigError: decode data parallelism 0: expected 1",
        ),
    ],
)
def test_the_proxy_refuses_data_parallelism_it_cannot_route(args: list[str], words: str) -> None:
    """A data-parallel server's engines are told apart by their side channels (the
    given port plus each index): without one, or with no engine, the proxy refuses to
    start, saying what it expected."""
    urls = ["--prefill", "http://127.0.0.1:5500", "--decode", "http://127.0.0.1:5501"]
    done = run_kvpush("proxy", *urls, *args, "--port", str(free_port()))
    assert done.returncode == 1, done.stderr
    assert words in done.stderr, done.stderr
