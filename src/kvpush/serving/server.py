"""The OpenAI-compatible HTTP front end: `/v1/completions`, `/health`, `/metrics`.

Requests are validated here, in full, before anything reaches the engine thread: a bad
request gets a 4xx whose message says which field was wrong and what was expected, and
nothing else is disturbed. `temperature` 0 (the default) decodes greedily; above it,
tokens are sampled (with `top_p`) from a generator seeded by `seed`, so the same seed
gives the same tokens on a single instance and through prefill/decode. `stop` (up to
four strings) ends the completion before the first one, as OpenAI does. `stream: true`
answers with server-sent events in OpenAI's chunk format, ending with `data: [DONE]`.

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
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvpush.errors import ClosedError
from kvpush.serving.checkpoint import Tokenizer
from kvpush.serving.engine import EngineStats, FinishReason, RequestStats, SamplingParams
from kvpush.serving.http import (
    DEFAULT_MAX_BODY_BYTES,
    BadBody,
    check_bearer,
    error_event,
    error_response,
    install_error_handlers,
    read_json,
    wait_for_disconnect,
)
from kvpush.serving.metrics import Registry
from kvpush.serving.worker import Accepted, Done, EngineWorker, Event, Job, Rejected, Tokens


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
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
        )


_IGNORED_IF_DEFAULT: dict[str, tuple[object, ...]] = {
    "n": (1, None),
    "best_of": (1, None),
    "logprobs": (None, 0),
    "echo": (False, None),
    "suffix": (None, ""),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "user": (),
    "top_k": (None, -1, 0),
}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise BadRequest(f"{key} must be a number in {low:g}..{high:g}, got {value!r}")
    return float(value)


_MAX_STOPS = 4


def _stop_strings(value: object) -> tuple[str, ...]:
    if value is None or value == "":
        return ()
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > _MAX_STOPS
        or not all(isinstance(x, str) and x and len(x) <= 256 for x in stops)
    ):
        raise BadRequest(
            f"stop must be a string or a list of up to {_MAX_STOPS} non-empty strings "
            f"(at most 256 characters each), got {str(value)[:60]!r}"
        )
    return tuple(stops)


class _StopMatcher:
    """Finds the first stop string in the growing text; says how much text is safe to
    send while a stop string might still be forming at its end."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max((len(x) for x in stops), default=1) - 1

    def find(self, text: str, since: int) -> int | None:
        start = max(0, since - self.hold)
        hits = [i for x in self.stops if (i := text.find(x, start)) >= 0]
        return min(hits) if hits else None


# A token is hardly ever longer than this many characters: a longer text cannot fit in
# the context, so it is refused before the tokenizer spends time on it.
_MAX_CHARS_PER_TOKEN = 64


def parse_prompt(
    prompt: object, tokenizer: Tokenizer, *, vocab_size: int, max_model_len: int
) -> list[int]:
    """The prompt's token ids; raises `BadRequest`. Cheap checks come before tokenizing."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty: expected text or a list of token ids")
        if len(prompt) > max_model_len * _MAX_CHARS_PER_TOKEN:
            raise BadRequest(
                f"prompt of {len(prompt)} characters cannot fit the model's context length "
                f"of {max_model_len} tokens"
            )
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if len(prompt) > max_model_len:
            raise BadRequest(
                f"prompt of {len(prompt)} tokens exceeds the model's context length {max_model_len}"
            )
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"prompt token id {bad[0]} out of range: expected 0..{vocab_size - 1}")
        return ids
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("batched prompts are not supported: send one prompt per request")
    raise BadRequest(
        f"prompt must be a non-empty string or list of token ids, got {type(prompt).__name__}"
    )


def parse_completion_request(
    body: object,
    tokenizer: Tokenizer,
    *,
    vocab_size: int,
    max_model_len: int,
    prompt_token_ids: list[int] | None = None,
) -> CompletionRequest:
    """Validate a `/v1/completions` body; raises `BadRequest` naming the bad field.
    `prompt_token_ids`: the prompt, already parsed by `parse_prompt`."""
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
        "top_p",
        "seed",
        "stop",
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

    ids = (
        prompt_token_ids
        if prompt_token_ids is not None
        else parse_prompt(
            body.get("prompt"), tokenizer, vocab_size=vocab_size, max_model_len=max_model_len
        )
    )

    max_tokens = body.get("max_tokens", 16)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if len(ids) + max_tokens > max_model_len:
        raise BadRequest(
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context length {max_model_len}"
        )
    temperature = _number(body, "temperature", 0.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise BadRequest("top_p must be above 0 (and at most 1), got 0")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadRequest(f"seed must be an integer, got {seed!r}")
    stop = _stop_strings(body.get("stop"))
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
        usage_flag = stream_options.get("include_usage", False)
        if not isinstance(usage_flag, bool):
            raise BadRequest(
                f"stream_options.include_usage must be true or false, got {usage_flag!r}"
            )
        include_usage = usage_flag
    kvp = body.get("kv_transfer_params")
    if kvp is not None and not isinstance(kvp, dict):
        raise BadRequest("kv_transfer_params must be an object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string")
    return CompletionRequest(
        temperature=temperature,
        top_p=top_p,
        seed=None if seed is None else int(seed),
        stop=stop,
        prompt_token_ids=ids,
        max_tokens=int(max_tokens),
        stream=flags["stream"],
        ignore_eos=flags["ignore_eos"],
        return_token_ids=flags["return_token_ids"],
        include_usage=include_usage,
        kv_transfer_params=kvp,
        model=model,
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
    """Text deltas from growing token lists; holds back an incomplete UTF-8 sequence and,
    with stop strings, the tail in which one of them may still be forming."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._sent = ""
        self._stop = _StopMatcher(stops) if stops else None
        self.stopped = False  # a stop string was found: the text ends before it

    def add(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        text = self._tok.decode(self._ids)
        if self._stop is not None:
            at = self._stop.find(text, len(self._sent))
            if at is not None:
                self.stopped = True
                delta = text[len(self._sent) : at] if at > len(self._sent) else ""
                self._sent += delta
                return delta
        if text.endswith("\ufffd") or not text.startswith(self._sent):
            return ""
        end = len(text) - (self._stop.hold if self._stop is not None else 0)
        if end <= len(self._sent):
            return ""
        delta = text[len(self._sent) : end]
        self._sent += delta
        return delta

    def flush(self) -> str:
        if self.stopped:
            return ""
        text = self._tok.decode(self._ids)
        delta = text[len(self._sent) :] if text.startswith(self._sent) else ""
        self._sent += delta
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
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    chat_template: str | None = None,
    internal_token: str | None = None,
) -> FastAPI:
    app = FastAPI(title=f"kvpush {role} server", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    worker.on_stats = lambda s: update_engine_metrics(registry, s)

    @app.get("/health")
    async def health() -> Response:
        extra = health_extra() if health_extra is not None else {}
        healthy = worker.alive and extra.get("healthy", True) is True
        status = "ok" if healthy else ("stopped" if not worker.alive else "unhealthy")
        body: dict[str, object] = {"status": status, "role": role, **extra}
        return JSONResponse(body, status_code=200 if healthy else 503)

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

    @app.post("/kvpush/abort")
    async def abort_transfer(request: Request) -> Response:
        """Cancel a transfer by the `transfer_id` its legs carry (the proxy calls this when
        the other leg failed); unknown ids are remembered and refused if they come later.
        With a token configured, only a caller that has it (the proxy) may."""
        refused = check_bearer(request, internal_token)
        if refused is not None:
            return refused
        try:
            body = await read_json(request, 4096)
        except BadBody as exc:
            return error_response(exc.status, exc.message)
        tid = body.get("transfer_id") if isinstance(body, dict) else None
        if not isinstance(tid, str) or not tid or len(tid) > 256:
            return error_response(400, 'expected {"transfer_id": "..."}')
        worker.abort_transfer(tid)
        return JSONResponse({"transfer_id": tid, "status": "cancelling"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    async def complete(request: Request, *, chat: bool) -> Response:
        try:
            parsed = await read_json(request, max_body_bytes)
        except BadBody as exc:
            return error_response(exc.status, exc.message)
        if not isinstance(parsed, dict):
            return error_response(400, "request body must be a JSON object")
        body: dict[str, Any] = parsed
        if chat:
            try:
                body = await asyncio.to_thread(chat_to_completion, body, chat_template)
            except BadRequest as exc:
                return error_response(exc.status, exc.message)
        shape = _Shape(chat)
        raw_kvp = body.get("kv_transfer_params")
        ids: list[int] | None = None

        def refuse(status: int, message: str, retry_after_s: float | None = None) -> Response:
            # The other leg of a transfer (the prefill server) must not hold its blocks
            # for a request this server will never take: tell it now.
            if isinstance(raw_kvp, dict):
                worker.refuse_transfer(raw_kvp, ids, message)
            registry.inc("kvpush_requests_total", labels={"outcome": "rejected"})
            return error_response(status, message, retry_after_s=retry_after_s)

        try:
            # Tokenizing a long prompt takes a while: off the event loop, so /health and
            # every other request keep being answered meanwhile.
            ids = await asyncio.to_thread(
                parse_prompt,
                body.get("prompt"),
                tokenizer,
                vocab_size=vocab_size,
                max_model_len=max_model_len,
            )
            req = parse_completion_request(
                body,
                tokenizer,
                vocab_size=vocab_size,
                max_model_len=max_model_len,
                prompt_token_ids=ids,
            )
        except BadRequest as exc:
            return refuse(exc.status, exc.message)
        if req.model is not None and req.model != model_name:
            return refuse(
                404, f"model {req.model!r} does not exist: this server has {model_name!r}"
            )
        if prepare is not None:
            try:
                req = prepare(req)
            except BadRequest as exc:
                return refuse(exc.status, exc.message)
        if not worker.alive:
            return refuse(503, "the engine is not running", 5.0)

        request_id = f"cmpl-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        # None: the client went away.
        events: asyncio.Queue[Event | None] = asyncio.Queue()

        def sink(ev: Event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        async def watch() -> None:
            await wait_for_disconnect(request)
            events.put_nowait(None)

        watcher = asyncio.create_task(watch())
        started = time.monotonic()
        try:
            worker.submit(
                Job(
                    request_id,
                    req.prompt_token_ids,
                    req.sampling_params(),
                    sink,
                    kv_transfer_params=req.kv_transfer_params,
                )
            )
        except ClosedError:
            watcher.cancel()
            return refuse(503, "the server is shutting down", 5.0)
        registry.inc("kvpush_prompt_tokens_total", len(req.prompt_token_ids))
        try:
            first = await events.get()
        except asyncio.CancelledError:
            watcher.cancel()
            worker.abort(request_id)
            raise
        if first is None:
            return _client_gone(worker, registry, request_id)
        if isinstance(first, Rejected):
            watcher.cancel()
            registry.inc("kvpush_requests_total", labels={"outcome": "rejected"})
            return error_response(first.status, first.message, retry_after_s=first.retry_after_s)
        pending: list[Event] = [] if isinstance(first, Accepted) else [first]
        created = int(time.time())
        head = {"id": request_id, "created": created, "model": model_name}
        ttft_seen = False

        async def next_event() -> Event | None:
            return pending.pop() if pending else await events.get()

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
                detok = _Detokenizer(tokenizer, req.stop)
                n_out = 0
                finished = False
                try:
                    while True:
                        ev = await next_event()
                        if ev is None:
                            return  # the client went away: aborted in `finally`
                        if isinstance(ev, Rejected):
                            finished = True
                            registry.inc("kvpush_requests_total", labels={"outcome": "rejected"})
                            yield error_event(ev.status, ev.message)
                            yield b"data: [DONE]\n\n"
                            return
                        if isinstance(ev, Tokens):
                            on_tokens(len(ev.token_ids))
                            n_out += len(ev.token_ids)
                            choice = shape.chunk_choice(
                                detok.add(ev.token_ids), n_out == len(ev.token_ids)
                            )
                            if req.return_token_ids:
                                choice["token_ids"] = list(ev.token_ids)
                            if detok.stopped:
                                # A stop string: the completion ends here, like an EOS.
                                finished = True
                                worker.abort(request_id)
                                choice["finish_reason"] = FinishReason.STOP.value
                                registry.inc("kvpush_requests_total", labels={"outcome": "ok"})
                            chunk = {**head, "object": shape.chunk_object, "choices": [choice]}
                            if detok.stopped and req.include_usage:
                                chunk["usage"] = usage(n_out)
                            yield f"data: {json.dumps(chunk)}\n\n".encode()
                            if detok.stopped:
                                yield b"data: [DONE]\n\n"
                                return
                        elif isinstance(ev, Done):
                            finished = True
                            on_done(ev)
                            if ev.reason is FinishReason.ERROR:
                                yield error_event(ev.status, ev.error or "request failed")
                                yield b"data: [DONE]\n\n"
                                return
                            final = shape.chunk_choice(detok.flush(), n_out == 0)
                            final["finish_reason"] = ev.reason.value
                            last: dict[str, Any] = {
                                **head,
                                "object": shape.chunk_object,
                                "choices": [final],
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
                    watcher.cancel()
                    if not finished:
                        worker.abort(request_id)

            return StreamingResponse(sse(), media_type="text/event-stream")

        out: list[int] = []
        detok_all = _Detokenizer(tokenizer, req.stop)
        text_parts: list[str] = []
        try:
            while True:
                ev = await next_event()
                if ev is None:
                    return _client_gone(worker, registry, request_id)
                if isinstance(ev, Rejected):
                    watcher.cancel()
                    registry.inc("kvpush_requests_total", labels={"outcome": "rejected"})
                    return error_response(ev.status, ev.message, retry_after_s=ev.retry_after_s)
                if isinstance(ev, Tokens):
                    on_tokens(len(ev.token_ids))
                    out.extend(ev.token_ids)
                    text_parts.append(detok_all.add(ev.token_ids))
                    if detok_all.stopped:
                        worker.abort(request_id)
                        ev = Done(FinishReason.STOP, None)
                        break
                elif isinstance(ev, Done):
                    break
        except asyncio.CancelledError:
            worker.abort(request_id)
            raise
        finally:
            watcher.cancel()
        on_done(ev)
        if ev.reason is FinishReason.ERROR:
            return error_response(ev.status, ev.error or "request failed")
        choice_out = shape.whole_choice("".join(text_parts) + detok_all.flush())
        choice_out["finish_reason"] = ev.reason.value
        if req.return_token_ids:
            choice_out["token_ids"] = out
        response: dict[str, Any] = {
            **head,
            "object": shape.whole_object,
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


class _Shape:
    """Where a completion and a chat completion differ: how a choice looks."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.whole_object = "chat.completion" if chat else "text_completion"

    def chunk_choice(self, text: str, first: bool) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}

    def whole_choice(self, text: str) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": None}


_CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# Chat fields that mean the same as a completion's; the rest are refused as usual.
_CHAT_ONLY = ("messages", "max_completion_tokens", "add_generation_prompt")


def chat_to_completion(body: dict[str, Any], chat_template: str | None) -> dict[str, Any]:
    """A `/v1/chat/completions` body as the completion body it amounts to: the messages
    rendered with the checkpoint's chat template become the prompt."""
    if chat_template is None:
        raise BadRequest(
            "this model has no chat template (no chat_template in its tokenizer_config.json): "
            "use /v1/completions"
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _CHAT_ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(_CHAT_ROLES)}")
        if not isinstance(m.get("content"), str):
            raise BadRequest(f"messages[{i}].content must be a string")
    if "prompt" in body:
        raise BadRequest("a chat request has messages, not a prompt")
    generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(generation_prompt, bool):
        raise BadRequest("add_generation_prompt must be true or false")
    out = {k: v for k, v in body.items() if k not in _CHAT_ONLY}
    if "max_completion_tokens" in body:
        out["max_tokens"] = body["max_completion_tokens"]
    out["prompt"] = render_chat(chat_template, messages, add_generation_prompt=generation_prompt)
    return out


def render_chat(template: str, messages: list[Any], *, add_generation_prompt: bool) -> str:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        text = env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as exc:
        raise BadRequest(f"the chat template cannot render these messages: {exc}") from None
    if not text:
        raise BadRequest("the chat template rendered these messages as empty text")
    return text


def _client_gone(worker: EngineWorker, registry: Registry, request_id: str) -> Response:
    """The client disconnected: stop its request now (its blocks, its transfer)."""
    worker.abort(request_id)
    registry.inc("kvpush_requests_total", labels={"outcome": "aborted"})
    return Response(status_code=499)
