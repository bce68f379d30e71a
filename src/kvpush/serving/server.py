"""The OpenAI-compatible HTTP front end: `/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/health`, `/metrics` and the internal `/kvpush/abort`.

A request is read and checked in full here (`openai_request`) before anything reaches the
engine thread: a bad request gets a 4xx, and nothing else is disturbed. Once submitted,
its engine events become the response: whole, or with `stream: true` server-sent events
in OpenAI's chunk format ending with `data: [DONE]`; text comes from the tokens through
a `Detokenizer`, which ends the completion before the first `stop` string, as OpenAI
does. `kv_transfer_params` (disaggregated serving) is passed to the role and returned in
the response. Every response also carries `kvpush_stats` (per-request speculation
statistics), so acceptance can be compared.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvpush.errors import ClosedError
from kvpush.serving.checkpoint import Tokenizer
from kvpush.serving.detokenizer import Detokenizer
from kvpush.serving.engine import EngineStats, FinishReason, RequestStats
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
from kvpush.serving.openai_request import (
    BadRequest,
    CompletionRequest,
    chat_to_completion,
    parse_completion_request,
    parse_prompt,
)
from kvpush.serving.worker import Accepted, Done, EngineWorker, Event, Job, Rejected, Tokens


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
    health_extra: Callable[[], dict[str, object]] | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    chat_template: str | None = None
    internal_token: str | None = None
    # What the role adds to /metrics at each scrape (run off the event loop).
    metrics_extra: Callable[[], None] | None = None


def create_app(
    worker: EngineWorker, tokenizer: Tokenizer, registry: Registry, settings: ServerSettings
) -> FastAPI:
    app = FastAPI(title=f"kvpush {settings.role} server", docs_url=None, redoc_url=None)
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
        extra = await asyncio.to_thread(s.health_extra) if s.health_extra is not None else {}
        alive = self.worker.alive
        healthy = alive and extra.get("healthy", True) is True
        status = "ok" if healthy else ("stopped" if not alive else "unhealthy")
        body: dict[str, object] = {"status": status, "role": s.role, **extra}
        return JSONResponse(body, status_code=200 if healthy else 503)

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
        detok = Detokenizer(self.tokenizer, req.stop)
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
        self.detok = Detokenizer(completion.tokenizer, completion.req.stop)
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
