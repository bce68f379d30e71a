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

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvpush.errors import ClosedError
from kvpush.health import ServerHealth
from kvpush.health import encode as encode_health
from kvpush.serving.checkpoint import Tokenizer
from kvpush.serving.engine import EngineStats, FinishReason, RequestStats, SamplingParams
from kvpush.serving.http import (
    DEFAULT_MAX_BODY_BYTES,
    BadBody,
    ClientDisconnected,
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
    """A request refused before it reaches the engine: its status and why."""

    def __init__(self, message: str, status: int = 400, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.retry_after_s = retry_after_s


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


_KNOWN_FIELDS = frozenset(
    {
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
)


def _check_field_names(body: dict[str, Any]) -> None:
    """Refuses fields we do not know and OpenAI fields set to what we do not support."""
    for key, allowed in _IGNORED_IF_DEFAULT.items():
        if key in body and allowed and body[key] not in allowed:
            raise BadRequest(
                f"{key}={body[key]!r} is not supported by this server: expected "
                + " or ".join(repr(a) for a in allowed if a is not None)
                + " (or leave it out)"
            )
    unknown = sorted(set(body) - _KNOWN_FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}: expected OpenAI completion fields")


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false, got {value!r}")
    return value


def _include_usage(stream_options: object) -> bool:
    if stream_options is None:
        return False
    if not isinstance(stream_options, dict):
        raise BadRequest("stream_options must be an object")
    usage_flag = stream_options.get("include_usage", False)
    if not isinstance(usage_flag, bool):
        raise BadRequest(f"stream_options.include_usage must be true or false, got {usage_flag!r}")
    return usage_flag


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
    _check_field_names(body)
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
    flags = {key: _flag(body, key) for key in ("stream", "ignore_eos", "return_token_ids")}
    include_usage = _include_usage(body.get("stream_options"))
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


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """What a server's routes need to know besides its engine thread and registry."""

    model_name: str
    role: str
    vocab_size: int
    max_model_len: int
    prepare: Prepare | None = None
    health_extra: Callable[[], ServerHealth] | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    chat_template: str | None = None
    internal_token: str | None = None
    # What the role adds to /metrics at each scrape (run off the event loop).
    metrics_extra: Callable[[], None] | None = None


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
    health_extra: Callable[[], ServerHealth] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    chat_template: str | None = None,
    internal_token: str | None = None,
    metrics_extra: Callable[[], None] | None = None,
) -> FastAPI:
    settings = ServerSettings(
        model_name=model_name,
        role=role,
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        prepare=prepare,
        health_extra=health_extra,
        max_body_bytes=max_body_bytes,
        chat_template=chat_template,
        internal_token=internal_token,
        metrics_extra=metrics_extra,
    )
    app = FastAPI(title=f"kvpush {role} server", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    worker.on_stats = lambda s: update_engine_metrics(registry, s)
    app.include_router(ServerRoutes(worker, tokenizer, registry, settings).router())
    return app


class ServerRoutes:
    """The routes of one server: status routes, the internal abort, and the completions
    (each of which becomes a `_Completion` once it is submitted)."""

    def __init__(
        self,
        worker: EngineWorker,
        tokenizer: Tokenizer,
        registry: Registry,
        settings: ServerSettings,
    ) -> None:
        self.worker = worker
        self.tokenizer = tokenizer
        self.registry = registry
        self.settings = settings

    def router(self) -> APIRouter:
        r = APIRouter()
        r.add_api_route("/health", self.health, methods=["GET"])
        r.add_api_route("/metrics", self.metrics, methods=["GET"])
        r.add_api_route("/v1/models", self.models, methods=["GET"])
        r.add_api_route("/kvpush/abort", self.abort_transfer, methods=["POST"])
        r.add_api_route("/v1/completions", self.completions, methods=["POST"])
        r.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        return r

    async def health(self) -> Response:
        s = self.settings
        # Off the event loop: the role's health asks the runtime's thread for a snapshot.
        part = (
            await asyncio.to_thread(s.health_extra)
            if s.health_extra is not None
            else ServerHealth()
        )
        alive = self.worker.alive
        healthy = alive and part.healthy is not False
        status = "ok" if healthy else ("stopped" if not alive else "unhealthy")
        body = msgspec.structs.replace(part, status=status, role=s.role)
        return Response(
            encode_health(body),
            status_code=200 if healthy else 503,
            media_type="application/json",
        )

    async def metrics(self) -> Response:
        # Refresh from the latest snapshot, so every gauge is there from the first scrape.
        update_engine_metrics(self.registry, self.worker.statistics())
        if self.settings.metrics_extra is not None:
            await asyncio.to_thread(self.settings.metrics_extra)
        return PlainTextResponse(self.registry.render(), media_type="text/plain; version=0.0.4")

    async def models(self) -> Response:
        model = {"id": self.settings.model_name, "object": "model", "owned_by": "kvpush"}
        return JSONResponse({"object": "list", "data": [model]})

    async def abort_transfer(self, request: Request) -> Response:
        """Cancel a transfer by the `transfer_id` its legs carry (the proxy calls this when
        the other leg failed); unknown ids are remembered and refused if they come later.
        With a token configured, only a caller that has it (the proxy) may."""
        refused = check_bearer(request, self.settings.internal_token)
        if refused is not None:
            return refused
        try:
            body = await read_json(request, 4096)
        except ClientDisconnected:
            return self._body_disconnect()
        except BadBody as exc:
            return error_response(exc.status, exc.message)
        tid = body.get("transfer_id") if isinstance(body, dict) else None
        if not isinstance(tid, str) or not tid or len(tid) > 256:
            return error_response(400, 'expected {"transfer_id": "..."}')
        self.worker.abort_transfer(tid)
        return JSONResponse({"transfer_id": tid, "status": "cancelling"})

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    def _body_disconnect(self) -> Response:
        """The client went away while its body was read: counted, nobody to answer."""
        self.registry.inc("kvpush_body_disconnects_total")
        return Response(status_code=499)

    async def _complete(self, request: Request, *, chat: bool) -> Response:
        try:
            body = await self._read_body(request, chat=chat)
        except ClientDisconnected:
            return self._body_disconnect()
        except BadRequest as exc:
            return error_response(exc.status, exc.message)
        refusal = _Refusal(self.worker, self.registry, body.get("kv_transfer_params"))
        try:
            req = await self._parse(body, refusal)
        except BadRequest as exc:
            return refusal.answer(exc.status, exc.message, exc.retry_after_s)
        completion = _Completion(self, req, _Shape(chat), request)
        try:
            completion.submit()
        except ClosedError:
            return refusal.answer(503, "the server is shutting down", 5.0)
        return await completion.respond()

    async def _read_body(self, request: Request, *, chat: bool) -> dict[str, Any]:
        """The request's body as a completion body; raises `BadRequest`."""
        try:
            parsed = await read_json(request, self.settings.max_body_bytes)
        except BadBody as exc:
            raise BadRequest(exc.message, exc.status) from None
        if not isinstance(parsed, dict):
            raise BadRequest("request body must be a JSON object")
        if not chat:
            return parsed
        return await asyncio.to_thread(chat_to_completion, parsed, self.settings.chat_template)

    async def _parse(self, body: dict[str, Any], refusal: _Refusal) -> CompletionRequest:
        """The checked request, ready to submit; raises `BadRequest`."""
        s = self.settings
        # Tokenizing a long prompt takes a while: off the event loop, so /health and
        # every other request keep being answered meanwhile.
        refusal.prompt_token_ids = await asyncio.to_thread(
            parse_prompt,
            body.get("prompt"),
            self.tokenizer,
            vocab_size=s.vocab_size,
            max_model_len=s.max_model_len,
        )
        req = parse_completion_request(
            body,
            self.tokenizer,
            vocab_size=s.vocab_size,
            max_model_len=s.max_model_len,
            prompt_token_ids=refusal.prompt_token_ids,
        )
        if req.model is not None and req.model != s.model_name:
            raise BadRequest(
                f"model {req.model!r} does not exist: this server has {s.model_name!r}", 404
            )
        if s.prepare is not None:
            req = s.prepare(req)
        if not self.worker.alive:
            raise BadRequest("the engine is not running", 503, retry_after_s=5.0)
        return req


class _Refusal:
    """How a request is refused before the engine took it."""

    def __init__(
        self, worker: EngineWorker, registry: Registry, kv_transfer_params: object
    ) -> None:
        self.worker = worker
        self.registry = registry
        self.kv_transfer_params = kv_transfer_params
        self.prompt_token_ids: list[int] | None = None

    def answer(self, status: int, message: str, retry_after_s: float | None = None) -> Response:
        # The other leg of a transfer (the prefill server) must not hold its blocks for a
        # request this server will never take: tell it now.
        if isinstance(self.kv_transfer_params, dict):
            self.worker.refuse_transfer(self.kv_transfer_params, self.prompt_token_ids, message)
        self.registry.inc("kvpush_requests_total", labels={"outcome": "rejected"})
        return error_response(status, message, retry_after_s=retry_after_s)


class _Completion:
    """One submitted request: its engine events, turned into a response (streamed or
    whole) and into metrics. A `None` event: the client went away."""

    def __init__(
        self, routes: ServerRoutes, req: CompletionRequest, shape: _Shape, request: Request
    ) -> None:
        self.worker = routes.worker
        self.registry = routes.registry
        self.tokenizer = routes.tokenizer
        self.req = req
        self.shape = shape
        self.request = request
        self.request_id = f"cmpl-{uuid.uuid4().hex}"
        self.events: asyncio.Queue[Event | None] = asyncio.Queue()
        self.pending: list[Event] = []
        self.head = {"id": self.request_id, "created": 0, "model": routes.settings.model_name}
        self.started = 0.0
        self.ttft_seen = False
        self.watcher: asyncio.Task[None] | None = None

    def submit(self) -> None:
        """Hand the request to the engine thread; raises `ClosedError` when it is closed."""
        loop = asyncio.get_running_loop()

        def sink(ev: Event) -> None:
            loop.call_soon_threadsafe(self.events.put_nowait, ev)

        self.watcher = asyncio.create_task(self._watch())
        self.started = time.monotonic()
        req = self.req
        job = Job(
            self.request_id,
            req.prompt_token_ids,
            req.sampling_params(),
            sink,
            kv_transfer_params=req.kv_transfer_params,
        )
        try:
            self.worker.submit(job)
        except ClosedError:
            self._stop_watching()
            raise
        self.registry.inc("kvpush_prompt_tokens_total", len(req.prompt_token_ids))

    async def _watch(self) -> None:
        await wait_for_disconnect(self.request)
        self.events.put_nowait(None)

    def _stop_watching(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()

    async def respond(self) -> Response:
        """The response, once the engine took the request (or refused it)."""
        try:
            first = await self.events.get()
        except asyncio.CancelledError:
            self._stop_watching()
            self.worker.abort(self.request_id)
            raise
        if first is None:
            return self._client_gone()
        if isinstance(first, Rejected):
            self._stop_watching()
            return self._rejected(first)
        self.pending = [] if isinstance(first, Accepted) else [first]
        self.head["created"] = int(time.time())
        if self.req.stream:
            return StreamingResponse(self._sse(), media_type="text/event-stream")
        return await self._whole()

    async def _next_event(self) -> Event | None:
        return self.pending.pop() if self.pending else await self.events.get()

    def _rejected(self, ev: Rejected) -> Response:
        self._outcome("rejected")
        return error_response(ev.status, ev.message, retry_after_s=ev.retry_after_s)

    def _client_gone(self) -> Response:
        """The client disconnected: stop its request now (its blocks, its transfer)."""
        self.worker.abort(self.request_id)
        self._outcome("aborted")
        return Response(status_code=499)

    def _outcome(self, outcome: str) -> None:
        self.registry.inc("kvpush_requests_total", labels={"outcome": outcome})

    def _tokens(self, n: int) -> None:
        self.registry.inc("kvpush_generation_tokens_total", n)
        if not self.ttft_seen:
            self.ttft_seen = True
            elapsed = time.monotonic() - self.started
            self.registry.observe("kvpush_time_to_first_token_seconds", elapsed)

    def _done(self, done: Done) -> None:
        self._outcome("error" if done.reason is FinishReason.ERROR else "ok")
        elapsed = time.monotonic() - self.started
        self.registry.observe("kvpush_e2e_request_latency_seconds", elapsed)

    def _usage(self, n_out: int) -> dict[str, int]:
        n_in = len(self.req.prompt_token_ids)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    async def _sse(self) -> AsyncIterator[bytes]:
        stream = _Stream(self)
        try:
            while not stream.finished:
                ev = await self._next_event()
                if ev is None:
                    return  # the client went away: aborted in `finally`
                for chunk in stream.on_event(ev):
                    yield chunk
        finally:
            self._stop_watching()
            if not stream.finished:
                self.worker.abort(self.request_id)

    async def _whole(self) -> Response:
        req = self.req
        out: list[int] = []
        detok = _Detokenizer(self.tokenizer, req.stop)
        text_parts: list[str] = []
        try:
            while True:
                ev = await self._next_event()
                if ev is None:
                    return self._client_gone()
                if isinstance(ev, Rejected):
                    return self._rejected(ev)
                if isinstance(ev, Tokens):
                    self._tokens(len(ev.token_ids))
                    out.extend(ev.token_ids)
                    text_parts.append(detok.add(ev.token_ids))
                    if detok.stopped:
                        self.worker.abort(self.request_id)
                        ev = Done(FinishReason.STOP, None)
                        break
                elif isinstance(ev, Done):
                    break
        except asyncio.CancelledError:
            self.worker.abort(self.request_id)
            raise
        finally:
            self._stop_watching()
        self._done(ev)
        if ev.reason is FinishReason.ERROR:
            return error_response(ev.status, ev.error or "request failed")
        return JSONResponse(self._whole_body(ev, "".join(text_parts) + detok.flush(), out))

    def _whole_body(self, ev: Done, text: str, out: list[int]) -> dict[str, Any]:
        req = self.req
        choice = self.shape.whole_choice(text)
        choice["finish_reason"] = ev.reason.value
        if req.return_token_ids:
            choice["token_ids"] = out
        response: dict[str, Any] = {
            **self.head,
            "object": self.shape.whole_object,
            "choices": [choice],
            "usage": self._usage(len(out)),
            "kvpush_stats": _stats_json(ev.stats),
        }
        if req.return_token_ids:
            response["prompt_token_ids"] = req.prompt_token_ids
        if ev.kv_transfer_params is not None:
            response["kv_transfer_params"] = ev.kv_transfer_params
        return response


_DONE_EVENT = b"data: [DONE]\n\n"


def _sse_event(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


class _Stream:
    """A streamed completion: each engine event as the server-sent events it makes."""

    def __init__(self, completion: _Completion) -> None:
        self.c = completion
        self.detok = _Detokenizer(completion.tokenizer, completion.req.stop)
        self.n_out = 0
        self.finished = False

    def on_event(self, ev: Event) -> list[bytes]:
        if isinstance(ev, Rejected):
            self.finished = True
            self.c._outcome("rejected")
            return [error_event(ev.status, ev.message), _DONE_EVENT]
        if isinstance(ev, Tokens):
            return self._tokens(ev)
        if isinstance(ev, Done):
            return self._done(ev)
        return []

    def _tokens(self, ev: Tokens) -> list[bytes]:
        c, shape = self.c, self.c.shape
        c._tokens(len(ev.token_ids))
        self.n_out += len(ev.token_ids)
        choice = shape.chunk_choice(self.detok.add(ev.token_ids), self.n_out == len(ev.token_ids))
        if c.req.return_token_ids:
            choice["token_ids"] = list(ev.token_ids)
        chunk: dict[str, Any] = {**c.head, "object": shape.chunk_object, "choices": [choice]}
        if not self.detok.stopped:
            return [_sse_event(chunk)]
        # A stop string: the completion ends here, like an EOS.
        self.finished = True
        c.worker.abort(c.request_id)
        choice["finish_reason"] = FinishReason.STOP.value
        c._outcome("ok")
        if c.req.include_usage:
            chunk["usage"] = c._usage(self.n_out)
        return [_sse_event(chunk), _DONE_EVENT]

    def _done(self, ev: Done) -> list[bytes]:
        c, shape = self.c, self.c.shape
        self.finished = True
        c._done(ev)
        if ev.reason is FinishReason.ERROR:
            return [error_event(ev.status, ev.error or "request failed"), _DONE_EVENT]
        final = shape.chunk_choice(self.detok.flush(), self.n_out == 0)
        final["finish_reason"] = ev.reason.value
        last: dict[str, Any] = {
            **c.head,
            "object": shape.chunk_object,
            "choices": [final],
            "kvpush_stats": _stats_json(ev.stats),
        }
        if ev.kv_transfer_params is not None:
            last["kv_transfer_params"] = ev.kv_transfer_params
        if c.req.include_usage:
            last["usage"] = c._usage(self.n_out)
        return [_sse_event(last), _DONE_EVENT]


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
