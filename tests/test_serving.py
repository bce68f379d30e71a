"""`kvpush serve --role both`: a real server process, real HTTP on loopback, real tokens."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpush.errors import ConfigError
from kvpush.procs.readiness import free_port
from kvpush.procs.server_process import ServerFailed, ServerProcess
from kvpush.serving.checkpoint import LoadedModel, load_model
from kvpush.serving.engine import Engine
from kvpush.serving.options import ServeOptions
from kvpush.serving.sampling import SamplingParams, SpecConfig

SPEC = SpecConfig(num_speculative_tokens=4)
TEXTS = [
    "Hello world, this is kvpush.",
    "The quick brown fox jumps over the lazy dog. " * 2,
    "a",
    "Disaggregated serving moves KV caches from prefill to decode.",
    "0123456789" * 4,
    "push, don't pull",
]


@pytest.fixture(scope="module")
def tiny(model_dir: Path) -> LoadedModel:
    return load_model(model_dir)


def start_server(model_dir: Path, host: str, log_dir: Path, *extra: str) -> ServerProcess:
    port = free_port(host)
    server = ServerProcess(
        "serve",
        [
            "serve",
            "--model",
            str(model_dir),
            "--host",
            host,
            "--port",
            str(port),
            "--block-size",
            "8",
            "--num-blocks",
            "256",
            *extra,
        ],
        host=host,
        port=port,
        log_dir=log_dir,
    )
    server.start()
    try:
        server.wait_ready(timeout_s=60)
    except BaseException:
        server.close()
        raise
    return server


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = start_server(
        model_dir, "127.0.0.1", tmp_path_factory.mktemp("logs"), "--speculative-tokens", "4"
    )
    yield s
    assert s.close() == 0


def reference(tiny: LoadedModel, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    engine = Engine(tiny.model, block_size=8, num_blocks=256, spec=SPEC)
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while engine.has_work:
        engine.step()
    return engine.output_token_ids("r"), engine.request_stats("r").mean_acceptance_length


def complete(url: str, **body: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_completion_matches_the_engine_token_for_token(
    server: ServerProcess, tiny: LoadedModel
) -> None:
    r = complete(server.url, prompt=TEXTS[0], max_tokens=24, ignore_eos=True, return_token_ids=True)
    assert r.status_code == 200, r.text
    body = r.json()
    prompt = tiny.tokenizer.encode(TEXTS[0])
    assert body["prompt_token_ids"] == prompt
    expected, acceptance = reference(tiny, prompt, 24)
    choice = body["choices"][0]
    assert choice["token_ids"] == expected
    assert choice["text"] == tiny.tokenizer.decode(expected)
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 24,
        "total_tokens": len(prompt) + 24,
    }
    assert body["kvpush_stats"]["mean_acceptance_length"] == acceptance


def test_concurrent_requests_are_batched_and_each_is_exact(
    server: ServerProcess, tiny: LoadedModel
) -> None:
    results: dict[int, list[int]] = {}
    errors: list[str] = []
    long_first_chunk = threading.Event()
    long_done_at: list[int] = []
    finished_order: list[int] = []
    lock = threading.Lock()

    def long_stream() -> None:
        with httpx.stream(
            "POST",
            f"{server.url}/v1/completions",
            timeout=120,
            json={
                "prompt": [tiny.config.bos_token_id, 10, 11],
                "max_tokens": 1000,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            },
        ) as resp:
            ids: list[int] = []
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    ids.extend(json.loads(line[6:])["choices"][0].get("token_ids", []))
                    long_first_chunk.set()
        with lock:
            finished_order.append(-1)
            long_done_at.append(len(finished_order))
            results[-1] = ids

    def short(i: int) -> None:
        r = complete(
            server.url, prompt=TEXTS[i], max_tokens=12, ignore_eos=True, return_token_ids=True
        )
        with lock:
            if r.status_code != 200:
                errors.append(r.text)
                return
            results[i] = r.json()["choices"][0]["token_ids"]
            finished_order.append(i)

    long_thread = threading.Thread(target=long_stream)
    long_thread.start()
    assert long_first_chunk.wait(60)
    shorts = [threading.Thread(target=short, args=(i,)) for i in range(len(TEXTS))]
    for t in shorts:
        t.start()
    for t in shorts:
        t.join(60)
    long_thread.join(120)
    assert not errors
    # The short requests joined the running batch and finished while the long one streamed.
    assert finished_order[-1] == -1
    for i, text in enumerate(TEXTS):
        assert results[i] == reference(tiny, tiny.tokenizer.encode(text), 12)[0], i
    assert results[-1] == reference(tiny, [tiny.config.bos_token_id, 10, 11], 1000)[0]


def test_stream_gives_the_same_tokens_and_a_final_chunk(
    server: ServerProcess, tiny: LoadedModel
) -> None:
    body = {"prompt": TEXTS[3], "max_tokens": 16, "ignore_eos": True, "return_token_ids": True}
    whole = complete(server.url, **body).json()
    ids: list[int] = []
    text = ""
    lines = []
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        timeout=60,
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    for c in chunks:
        ids.extend(c["choices"][0].get("token_ids", []))
        text += c["choices"][0]["text"]
    assert ids == whole["choices"][0]["token_ids"]
    assert text == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"prompt": "x", "temperature": 2.5}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "seed": 1.5}, 400, "seed"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"prompt": "x", "stop": [""]}, 400, "stop"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": ""}, 400, "prompt is empty"),
        ({"prompt": [1, 99999]}, 400, "out of range"),
        ({"prompt": 5}, 400, "prompt must be"),
        ({"prompt": ["a", "b"]}, 400, "batched prompts"),
        ({"prompt": "x", "n": 2}, 400, "n=2"),
        ({"prompt": "x", "bogus": 1}, 400, "unknown field"),
        ({"prompt": "x", "stream": "yes"}, 400, "stream must be"),
        ({"prompt": "x", "max_tokens": 5000}, 400, "context length"),
        ({"prompt": "x", "model": "other"}, 404, "does not exist"),
        ({"prompt": "x", "kv_transfer_params": []}, 400, "kv_transfer_params"),
    ],
)
def test_bad_requests_get_4xx_with_a_reason(
    server: ServerProcess, body: dict[str, object], status: int, needle: str
) -> None:
    r = complete(server.url, **body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    assert complete(server.url, prompt="still serving", max_tokens=2).status_code == 200


def test_non_json_body_is_a_400(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/completions", content=b"{nope", timeout=10)
    assert r.status_code == 400
    assert "not valid JSON" in r.json()["error"]["message"]


def _metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")
    return float(values.get(name, "0"))


def test_a_client_gone_while_its_body_is_read_is_counted_not_a_crash(
    server: ServerProcess,
) -> None:
    before = _metric(server, "kvpush_body_disconnects_total")
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            b'{"prompt": "half a bo'
        )
        threading.Event().wait(0.2)  # the server is reading the body now
    for _ in range(100):
        if _metric(server, "kvpush_body_disconnects_total") > before:
            break
        threading.Event().wait(0.05)
    assert _metric(server, "kvpush_body_disconnects_total") == before + 1
    assert complete(server.url, prompt="still serving", max_tokens=2).status_code == 200
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log
    assert "Exception in ASGI application" not in log


def test_client_gone_mid_stream_frees_its_blocks(server: ServerProcess) -> None:
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        timeout=60,
        json={
            "prompt": "abandon me",
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        },
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    # The server notices the closed connection, aborts the request and frees its blocks.
    for _ in range(100):
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        values = dict(
            line.rsplit(" ", 1) for line in metrics.splitlines() if line and line[0] != "#"
        )
        if values["kvpush_kv_blocks_free"] == values["kvpush_kv_blocks_total"]:
            break
        threading.Event().wait(0.1)
    assert values["kvpush_kv_blocks_free"] == "256"
    assert values["kvpush_requests_running"] == "0"
    assert "# TYPE kvpush_time_to_first_token_seconds histogram" in metrics
    assert float(values["kvpush_spec_decode_num_drafts_total"]) > 0


def test_ipv6_loopback(model_dir: Path, tiny: LoadedModel, tmp_path: Path) -> None:
    server = start_server(model_dir, "::1", tmp_path)
    try:
        assert server.url.startswith("http://[::1]:")
        assert httpx.get(f"{server.url}/health", timeout=10).json()["role"] == "both"
        r = complete(
            server.url, prompt=TEXTS[2], max_tokens=6, ignore_eos=True, return_token_ids=True
        )
        assert (
            r.json()["choices"][0]["token_ids"]
            == reference(tiny, tiny.tokenizer.encode(TEXTS[2]), 6)[0]
        )
    finally:
        assert server.close() == 0


def test_a_server_that_cannot_start_fails_fast_with_its_log(tmp_path: Path) -> None:
    with pytest.raises(ServerFailed, match=r"(?s)exit.*no config\.json"):
        start_server(tmp_path / "no-model", "127.0.0.1", tmp_path)


def test_seeded_sampling_repeats_under_one_seed_and_matches_the_engine(
    server: ServerProcess, tiny: LoadedModel
) -> None:
    body = {"prompt": TEXTS[3], "max_tokens": 24, "ignore_eos": True, "return_token_ids": True}
    sampled = {"temperature": 1.5, "top_p": 0.99, "seed": 1234}
    first = complete(server.url, **body, **sampled).json()["choices"][0]["token_ids"]
    again = complete(server.url, **body, **sampled).json()["choices"][0]["token_ids"]
    other = complete(server.url, **body, **{**sampled, "seed": 99}).json()["choices"][0]
    greedy = complete(server.url, **body).json()["choices"][0]["token_ids"]
    assert first == again
    assert first != other["token_ids"] and first != greedy
    engine = Engine(tiny.model, num_blocks=256, block_size=8)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.5, top_p=0.99, seed=1234)
    assert engine.generate([tiny.tokenizer.encode(TEXTS[3])], params) == [first]


def test_stop_strings_end_the_text_before_them_streamed_or_not(server: ServerProcess) -> None:
    body = {"prompt": TEXTS[1], "max_tokens": 40, "ignore_eos": True}
    full = complete(server.url, **body).json()["choices"][0]["text"]
    assert len(full) > 12
    stop = full[8:11]
    cut = full[: full.index(stop)]
    whole = complete(server.url, **body, stop=[stop, "never-seen"]).json()["choices"][0]
    assert (whole["text"], whole["finish_reason"]) == (cut, "stop")
    streamed = ""
    reasons = []
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={**body, "stop": stop, "stream": True},
        timeout=60,
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                streamed += choice["text"]
                reasons.append(choice["finish_reason"])
    assert streamed == cut
    assert reasons[-1] == "stop"


def test_chat_completions_render_the_checkpoints_template(server: ServerProcess) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say kvpush."},
    ]
    rendered = "<|system|>\nYou are terse.\n<|user|>\nSay kvpush.\n<|assistant|>\n"
    common = {"max_tokens": 12, "ignore_eos": True, "return_token_ids": True}
    chat = httpx.post(
        f"{server.url}/v1/chat/completions", json={"messages": messages, **common}, timeout=60
    )
    assert chat.status_code == 200, chat.text
    plain = complete(server.url, prompt=rendered, **common).json()
    body = chat.json()
    assert body["object"] == "chat.completion"
    assert body["prompt_token_ids"] == plain["prompt_token_ids"]
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": plain["choices"][0]["text"]}
    assert choice["token_ids"] == plain["choices"][0]["token_ids"]
    deltas = []
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json={
            "messages": messages,
            "max_completion_tokens": 12,
            "ignore_eos": True,
            "stream": True,
        },
        timeout=60,
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert chunk["object"] == "chat.completion.chunk"
                deltas.append(chunk["choices"][0]["delta"])
    assert deltas[0]["role"] == "assistant"
    assert "".join(d["content"] for d in deltas) == choice["message"]["content"]
    bad = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": [{"role": "wizard", "content": "x"}]},
        timeout=60,
    )
    assert bad.status_code == 400
    assert "messages[0].role" in bad.json()["error"]["message"]


def test_an_advertised_wildcard_is_refused_naming_what_is_expected(tmp_path: Path) -> None:
    for wildcard in ("0.0.0.0", "::", "[::]", "*"):
        with pytest.raises(ConfigError) as refused:
            ServeOptions(
                model=str(tmp_path), role="decode", side_channel_port=5600, advertise_host=wildcard
            )
        assert str(refused.value) == (
            f"--advertise-host {wildcard}: a wildcard peers cannot connect to; expected an "
            "address of this host they can reach (--host may be the wildcard)"
        )
    # Listening on the wildcard while advertising an address is what the flag is for.
    opts = ServeOptions(
        model=str(tmp_path),
        role="decode",
        host="0.0.0.0",
        side_channel_port=5600,
        advertise_host="192.0.2.2",
    )
    assert opts.side_channel_host == "192.0.2.2"
    assert ServeOptions(model=str(tmp_path)).side_channel_host == "127.0.0.1"


def test_a_liveness_timeout_not_above_the_heartbeat_interval_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        ServeOptions(model=str(tmp_path), liveness_timeout_s=0.5)
    assert str(refused.value) == (
        "heartbeat_interval_s (0.5) must be below liveness_timeout_s (0.5)"
    )
    assert (
        ServeOptions(model=str(tmp_path), liveness_timeout_s=8.0).timing().liveness_timeout_s == 8
    )
