"""The OpenAI-compatible HTTP front end: `/v1/completions`, `/health`, `/metrics`.

Requests are validated here, in full, before anything reaches the engine thread: a bad
request gets a 4xx whose message says which field was wrong and what was expected, and
nothing else is disturbed. Only greedy decoding exists, so `temperature` must be 0 (or
absent). `stream: true` answers with server-sent events in OpenAI's chunk format,
ending with `data: [DONE]`.

Beyond OpenAI's fields, as vLLM does: `return_token_ids` adds `prompt_token_ids` and each
choice's `token_ids`; `ignore_eos`; `kv_transfer_params` (disaggregated serving) is
passed to the role and returned in the response. Every response also carries
`kvpush_stats` (per-request speculation statistics), so acceptance can be compared.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvpush.serving.checkpoint import Tokenizer
from kvpush.serving.engine import EngineStats, FinishReason, RequestStats, SamplingParams
from kvpush.serving.metrics import Registry
from kvpush.serving.worker import Done, EngineWorker, Event, Job, Rejected, Tokens


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    stream: bool
    ignore_eos: bool
    return_token_ids: bool
    include_usage: bool
    kv_transfer_params: dict[str, object] | None
    model: str | None


_IGNORED_IF_DEFAULT: dict[str, tuple[object, ...]] = {
    "n": (1, None),
    "best_of": (1, None),
    "top_p": (1, 1.0, None),
    "logprobs": (None, 0),
    "echo": (False, None),
    "stop": (None, [], ""),
    "suffix": (None, ""),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "seed": (),  # any seed is fine: decoding is deterministic
    "user": (),
    "top_k": (None, -1, 0),
}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_completion_request(
    body: object, tokenizer: Tokenizer, *, vocab_size: int, max_model_len: int
) -> CompletionRequest:
    """Validate a `/v1/completions` body; raises `BadRequest` naming the bad field."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    for key, allowed in _IGNORED_IF_DEFAULT.items():
        if key in body and allowed and body[key] not in allowed:
            raise BadRequest(
                f"{key}={body[key]!r} is not supported by this server: expected "
                + " or ".join(repr(a) for a in allowed if a is not None)
                + " (or leave it out)"
            )
    known = {
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "stream",
        "stream_options",
        "ignore_eos",
        "return_token_ids",
        "kv_transfer_params",
        *_IGNORED_IF_DEFAULT,
    }
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}: expected OpenAI completion fields")

    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty: expected text or a list of token ids")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"prompt token id {bad[0]} out of range: expected 0..{vocab_size - 1}")
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("batched prompts are not supported: send one prompt per request")
    else:
        raise BadRequest(
            f"prompt must be a non-empty string or list of token ids, got {type(prompt).__name__}"
        )

    max_tokens = body.get("max_tokens", 16)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if len(ids) + max_tokens > max_model_len:
        raise BadRequest(
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context length {max_model_len}"
        )
    temperature = body.get("temperature", 0)
    if temperature is not None and (
        not isinstance(temperature, int | float)
        or isinstance(temperature, bool)
        or temperature != 0
    ):
        raise BadRequest(
            f"temperature={temperature!r} is not supported: this server decodes greedily, "
            "expected 0"
        )
    flags: dict[str, bool] = {}
    for key in ("stream", "ignore_eos", "return_token_ids"):
        value = body.get(key, False)
        if value is None:
            value = False
        if not isinstance(value, bool):
            raise BadRequest(f"{key} must be true or false, got {value!r}")
        flags[key] = value
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise BadRequest("stream_options must be an object")
        include_usage = bool(stream_options.get("include_usage", False))
    kvp = body.get("kv_transfer_params")
    if kvp is not None and not isinstance(kvp, dict):
        raise BadRequest("kv_transfer_params must be an object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string")
    return CompletionRequest(
        prompt_token_ids=ids,
        max_tokens=int(max_tokens),
        stream=flags["stream"],
        ignore_eos=flags["ignore_eos"],
        return_token_ids=flags["return_token_ids"],
        include_usage=include_usage,
        kv_transfer_params=kvp,
        model=model,
    )


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status
    )


def _stats_json(stats: RequestStats | None) -> dict[str, object] | None:
    if stats is None:
        return None
    return {
        "num_prompt_tokens": stats.num_prompt_tokens,
        "num_cached_tokens": stats.num_cached_tokens,
        "num_steps": stats.num_steps,
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "mean_acceptance_length": stats.mean_acceptance_length,
    }


class _Detokenizer:
    """Text deltas from growing token lists; holds back an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._sent = ""

    def add(self, ids: tuple[int, ...]) -> str:
        self._ids.extend(ids)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self._sent) :] if text.startswith(self._sent) else text
        self._sent = text
        return delta

    def flush(self) -> str:
        text = self._tok.decode(self._ids)
        delta = text[len(self._sent) :] if text.startswith(self._sent) else ""
        self._sent = text
        return delta


def update_engine_metrics(registry: Registry, stats: EngineStats) -> None:
    registry.set("kvpush_requests_running", stats.num_running)
    registry.set("kvpush_requests_waiting", stats.num_waiting)
    registry.set("kvpush_kv_blocks_total", stats.num_blocks)
    registry.set("kvpush_kv_blocks_free", stats.num_free_blocks)
    registry.set("kvpush_kv_blocks_held", stats.num_blocks - stats.num_free_blocks)
    registry.set("kvpush_prefix_cache_queries_total", stats.prefix_queries)
    registry.set("kvpush_prefix_cache_hits_total", stats.prefix_hits)
    registry.set("kvpush_spec_decode_num_drafts_total", stats.num_drafts)
    registry.set("kvpush_spec_decode_num_draft_tokens_total", stats.num_draft_tokens)
    registry.set("kvpush_spec_decode_num_accepted_tokens_total", stats.num_accepted_tokens)
    registry.set("kvpush_spec_decode_mean_acceptance_length", stats.mean_acceptance_length)


# A role may rewrite a request before it is submitted (the prefill role caps max_tokens).
Prepare = Callable[[CompletionRequest], CompletionRequest]


def create_app(
    worker: EngineWorker,
    tokenizer: Tokenizer,
    registry: Registry,
    *,
    model_name: str,
    role: str,
    vocab_size: int,
    max_model_len: int,
    prepare: Prepare | None = None,
    health_extra: Callable[[], dict[str, object]] | None = None,
) -> FastAPI:
    app = FastAPI(title=f"kvpush {role} server", docs_url=None, redoc_url=None)
    worker.on_stats = lambda s: update_engine_metrics(registry, s)

    @app.get("/health")
    async def health() -> Response:
        body: dict[str, object] = {"status": "ok" if worker.alive else "stopped", "role": role}
        if health_extra is not None:
            body.update(health_extra())
        return JSONResponse(body, status_code=200 if worker.alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        # Refresh from the latest snapshot, so every gauge is there from the first scrape.
        update_engine_metrics(registry, worker.statistics())
        return PlainTextResponse(registry.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": model_name, "object": "model", "owned_by": "kvpush"}],
            }
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "request body is not valid JSON")
        try:
            req = parse_completion_request(
                body, tokenizer, vocab_size=vocab_size, max_model_len=max_model_len
            )
        except BadRequest as exc:
            return _error(exc.status, exc.message)
        if req.model is not None and req.model != model_name:
            return _error(
                404, f"model {req.model!r} does not exist: this server has {model_name!r}"
            )
        if prepare is not None:
            try:
                req = prepare(req)
            except BadRequest as exc:
                return _error(exc.status, exc.message)
        if not worker.alive:
            return _error(503, "the engine is not running", "server_error")

        request_id = f"cmpl-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        started = time.monotonic()
        worker.submit(
            Job(
                request_id,
                req.prompt_token_ids,
                SamplingParams(max_tokens=req.max_tokens, ignore_eos=req.ignore_eos),
                sink,
                kv_transfer_params=req.kv_transfer_params,
            )
        )
        registry.inc("kvpush_prompt_tokens_total", len(req.prompt_token_ids))
        try:
            first = await events.get()
        except asyncio.CancelledError:
            worker.abort(request_id)
            raise
        if isinstance(first, Rejected):
            registry.inc("kvpush_requests_total", labels={"outcome": "rejected"})
            return _error(first.status, first.message)
        created = int(time.time())
        head = {"id": request_id, "created": created, "model": model_name}
        ttft_seen = False

        def on_tokens(n: int) -> None:
            nonlocal ttft_seen
            registry.inc("kvpush_generation_tokens_total", n)
            if not ttft_seen:
                ttft_seen = True
                registry.observe("kvpush_time_to_first_token_seconds", time.monotonic() - started)

        def on_done(done: Done) -> None:
            outcome = "error" if done.reason is FinishReason.ERROR else "ok"
            registry.inc("kvpush_requests_total", labels={"outcome": outcome})
            registry.observe("kvpush_e2e_request_latency_seconds", time.monotonic() - started)

        def usage(n_out: int) -> dict[str, int]:
            n_in = len(req.prompt_token_ids)
            return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

        if req.stream:

            async def sse() -> AsyncIterator[bytes]:
                detok = _Detokenizer(tokenizer)
                n_out = 0
                finished = False
                try:
                    while True:
                        ev = await events.get()
                        if isinstance(ev, Tokens):
                            on_tokens(len(ev.token_ids))
                            n_out += len(ev.token_ids)
                            choice: dict[str, Any] = {
                                "index": 0,
                                "text": detok.add(ev.token_ids),
                                "logprobs": None,
                                "finish_reason": None,
                            }
                            if req.return_token_ids:
                                choice["token_ids"] = list(ev.token_ids)
                            chunk = {**head, "object": "text_completion", "choices": [choice]}
                            yield f"data: {json.dumps(chunk)}\n\n".encode()
                        elif isinstance(ev, Done):
                            finished = True
                            on_done(ev)
                            if ev.reason is FinishReason.ERROR:
                                err = {"error": {"message": ev.error, "type": "server_error"}}
                                yield f"data: {json.dumps(err)}\n\n".encode()
                                yield b"data: [DONE]\n\n"
                                return
                            last: dict[str, Any] = {
                                **head,
                                "object": "text_completion",
                                "choices": [
                                    {
                                        "index": 0,
                                        "text": detok.flush(),
                                        "logprobs": None,
                                        "finish_reason": ev.reason.value,
                                    }
                                ],
                                "kvpush_stats": _stats_json(ev.stats),
                            }
                            if ev.kv_transfer_params is not None:
                                last["kv_transfer_params"] = ev.kv_transfer_params
                            if req.include_usage:
                                last["usage"] = usage(n_out)
                            yield f"data: {json.dumps(last)}\n\n".encode()
                            yield b"data: [DONE]\n\n"
                            return
                finally:
                    if not finished:
                        worker.abort(request_id)

            return StreamingResponse(sse(), media_type="text/event-stream")

        out: list[int] = []
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, Tokens):
                    on_tokens(len(ev.token_ids))
                    out.extend(ev.token_ids)
                elif isinstance(ev, Done):
                    break
        except asyncio.CancelledError:
            worker.abort(request_id)
            raise
        on_done(ev)
        if ev.reason is FinishReason.ERROR:
            return _error(ev.status, ev.error or "request failed", "server_error")
        choice_out: dict[str, Any] = {
            "index": 0,
            "text": tokenizer.decode(out),
            "logprobs": None,
            "finish_reason": ev.reason.value,
        }
        if req.return_token_ids:
            choice_out["token_ids"] = out
        response: dict[str, Any] = {
            **head,
            "object": "text_completion",
            "choices": [choice_out],
            "usage": usage(len(out)),
            "kvpush_stats": _stats_json(ev.stats),
        }
        if req.return_token_ids:
            response["prompt_token_ids"] = req.prompt_token_ids
        if ev.kv_transfer_params is not None:
            response["kv_transfer_params"] = ev.kv_transfer_params
        return JSONResponse(response)

    return app
