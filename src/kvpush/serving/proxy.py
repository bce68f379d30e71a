"""The disaggregating proxy: one client request becomes a prefill leg and a decode leg.

Push mode needs both legs at once: the decode server allocates blocks and registers them
with the prefill server while the prefill server computes and pushes, so the proxy sends
both requests together (a sequential proxy would add a whole round trip before the
decode server could even allocate) and relays the decode server's answer, streamed or
whole. Both legs carry the same fresh `transfer_id` in `kv_transfer_params`, shaped like
vLLM's.

Failures: if the prefill leg fails (server unreachable, an error answer), the proxy drops
the decode leg (the decode server aborts its transfer when its client goes away) and
answers 502 naming the prefill server and what it said, at once, instead of waiting for
the transfer's deadline. Load is spread by sending each leg to the instance of its pool
with the fewest requests in flight.

The prefill servers' side-channel addresses come from their `/health` answers, fetched
when first needed and again after a failure (a restarted server may have a new engine id).
Servers whose `/health` says nothing of it (vLLM's, running `KvpushConnector`) have their
side channels given to the proxy, one per prefill server (`prefill_side_channels`); their
prefill leg asks for one token, as vLLM's own proxy does.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvpush.serving.http import (
    DEFAULT_MAX_BODY_BYTES,
    BadBody,
    Terminated,
    bearer_headers,
    error_event,
    error_response,
    install_error_handlers,
    read_json,
    stopped_by_sigterm,
    wait_for_disconnect,
)
from kvpush.serving.metrics import Registry

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Instance:
    url: str
    in_flight: int = 0
    info: dict[str, Any] | None = None
    # Given up front (a vLLM server's /health tells no side channel): never refetched.
    fixed_info: dict[str, Any] | None = None


@dataclass(slots=True)
class _Pool:
    name: str
    instances: list[_Instance]
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def pick(self) -> _Instance:
        # Fewest in flight; ties go round-robin so idle instances share the load.
        start = next(self._turn) % len(self.instances)
        order = self.instances[start:] + self.instances[:start]
        return min(order, key=lambda i: i.in_flight)


def _error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


def proxy_registry() -> Registry:
    r = Registry()
    r.counter("kvpush_proxy_requests_total", "Client requests by outcome.")
    r.counter("kvpush_proxy_prefill_aborts_total", "Prefill legs cancelled: the decode leg failed.")
    r.gauge("kvpush_proxy_in_flight", "Requests in flight per backend.")
    return r


class _Lease:
    """One request's share of its backends' in-flight counts, given back exactly once."""

    def __init__(self, *instances: _Instance) -> None:
        self._instances: list[_Instance] | None = list(instances)
        for inst in instances:
            inst.in_flight += 1

    def release(self, inst: _Instance | None = None) -> None:
        if self._instances is None:
            return
        if inst is None:
            for i in self._instances:
                i.in_flight -= 1
            self._instances = None
        elif inst in self._instances:
            inst.in_flight -= 1
            self._instances.remove(inst)


def create_proxy_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    timeout_s: float = 300.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    prefill_side_channels: Sequence[tuple[str, int]] | None = None,
    token: str | None = None,
) -> FastAPI:
    if not prefill_urls or not decode_urls:
        raise ValueError("a proxy needs at least one prefill and one decode server")
    if prefill_side_channels is not None and len(prefill_side_channels) != len(prefill_urls):
        raise ValueError(
            f"{len(prefill_side_channels)} prefill side channels for {len(prefill_urls)} "
            "prefill servers: give one per server, in the same order"
        )
    prefill = _Pool("prefill", [_Instance(u.rstrip("/")) for u in prefill_urls])
    for inst, (sc_host, sc_port) in zip(
        prefill.instances, prefill_side_channels or (), strict=False
    ):
        inst.fixed_info = {"side_channel_host": sc_host, "side_channel_port": sc_port}
    decode = _Pool("decode", [_Instance(u.rstrip("/")) for u in decode_urls])
    state: dict[str, httpx.AsyncClient] = {}
    registry = proxy_registry()
    background: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Servers close a keep-alive connection after 5 s idle (uvicorn's default, vLLM's
        # too), httpx reuses one for 5 s: a request sent into a connection the server is
        # closing fails with ReadError before the server ever saw it. Reusing only
        # connections idle under 2 s leaves the server's close no such window.
        limits = httpx.Limits(
            max_connections=1000, max_keepalive_connections=100, keepalive_expiry=2.0
        )
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            state["client"] = client
            yield
            for task in list(background):
                task.cancel()

    app = FastAPI(title="kvpush proxy", docs_url=None, redoc_url=None, lifespan=lifespan)
    install_error_handlers(app)

    async def prefill_info(inst: _Instance) -> dict[str, Any]:
        if inst.fixed_info is not None:
            return inst.fixed_info
        if inst.info is None:
            resp = await state["client"].get(f"{inst.url}/health", timeout=5.0)
            body = resp.json()
            if body.get("role") != "prefill" or "side_channel_port" not in body:
                raise RuntimeError(f"{inst.url} is not a prefill server (health: {body})")
            inst.info = body
        return inst.info

    async def backend_health(pool: _Pool, inst: _Instance) -> dict[str, Any]:
        try:
            resp = await state["client"].get(f"{inst.url}/health", timeout=2.0)
        except httpx.HTTPError as exc:
            return {"url": inst.url, "status": "unreachable", "detail": f"{type(exc).__name__}"}
        status = "ok" if resp.status_code == 200 else "unhealthy"
        return {"url": inst.url, "status": status, "http_status": resp.status_code}

    @app.get("/health")
    async def health() -> Response:
        p, d = await asyncio.gather(
            asyncio.gather(*(backend_health(prefill, i) for i in prefill.instances)),
            asyncio.gather(*(backend_health(decode, i) for i in decode.instances)),
        )
        ok = any(b["status"] == "ok" for b in p) and any(b["status"] == "ok" for b in d)
        body = {"status": "ok" if ok else "unhealthy", "role": "proxy", "prefill": p, "decode": d}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        for pool in (prefill, decode):
            for inst in pool.instances:
                labels = {"pool": pool.name, "url": inst.url}
                registry.set("kvpush_proxy_in_flight", inst.in_flight, labels=labels)
        return PlainTextResponse(registry.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> Response:
        errors = []
        for inst in decode.instances:
            try:
                resp = await state["client"].get(f"{inst.url}/v1/models", timeout=5.0)
            except httpx.HTTPError as exc:
                errors.append(f"{inst.url}: {type(exc).__name__}")
                continue
            if resp.status_code == 200:
                return Response(resp.content, media_type="application/json")
            errors.append(f"{inst.url}: HTTP {resp.status_code}")
        return error_response(502, f"no decode server answered /v1/models: {'; '.join(errors)}")

    def done(outcome: str) -> None:
        registry.inc("kvpush_proxy_requests_total", labels={"outcome": outcome})

    def abort_prefill(p_inst: _Instance, p_task: asyncio.Task[Any], tid: str) -> None:
        """The decode leg will not take this transfer: the prefill server must not hold
        its blocks for it. Its request is dropped (if still running) and its transfer
        cancelled by id (if already computed, or not even started)."""
        p_task.cancel()
        registry.inc("kvpush_proxy_prefill_aborts_total")

        async def cancel() -> None:
            with contextlib.suppress(httpx.HTTPError):
                resp = await state["client"].post(
                    f"{p_inst.url}/kvpush/abort",
                    json={"transfer_id": tid},
                    headers=bearer_headers(token),
                    timeout=5.0,
                )
                if resp.status_code == 401:  # a token missing or wrong: say so, once per cancel
                    log.warning(
                        "prefill server %s refused to cancel %s: %s",
                        p_inst.url,
                        tid,
                        _error_text(resp),
                    )

        task = asyncio.create_task(cancel())
        background.add(task)
        task.add_done_callback(background.discard)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, "/v1/chat/completions")

    async def complete(request: Request, path: str) -> Response:
        try:
            body = await read_json(request, max_body_bytes)
        except BadBody as exc:
            done("rejected")
            return error_response(exc.status, exc.message)
        if not isinstance(body, dict):
            done("rejected")
            return error_response(400, "request body must be a JSON object")
        if body.get("kv_transfer_params") is not None:
            done("rejected")
            return error_response(400, "kv_transfer_params is set by the proxy: leave it out")
        client = state["client"]
        p_inst, d_inst = prefill.pick(), decode.pick()
        try:
            info = await prefill_info(p_inst)
        except (httpx.HTTPError, ValueError, RuntimeError) as exc:
            p_inst.info = None
            done("prefill_failed")
            return error_response(502, f"prefill server {p_inst.url} is unavailable: {exc!s}")
        tid = f"xfer-{uuid.uuid4().hex}"
        stream = body.get("stream") is True
        d_body = {
            **body,
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "remote_engine_id": info.get("engine_id"),
                "remote_host": info["side_channel_host"],
                "remote_port": info["side_channel_port"],
                "transfer_id": tid,
            },
        }
        # The prefill leg keeps the client's max_tokens: its checks (context length) then
        # speak of what the client asked; the prefill server computes one token anyway.
        p_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        if p_inst.fixed_info is not None:
            p_body["max_tokens"] = 1  # a vLLM prefill server computes what it is asked
        p_body["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": tid}

        lease = _Lease(p_inst, d_inst)
        try:
            return await legs(
                request, client, path, p_inst, d_inst, p_body, d_body, tid, stream, lease
            )
        except BaseException:
            lease.release()
            raise

    async def legs(
        request: Request,
        client: httpx.AsyncClient,
        path: str,
        p_inst: _Instance,
        d_inst: _Instance,
        p_body: dict[str, Any],
        d_body: dict[str, Any],
        tid: str,
        stream: bool,
        lease: _Lease,
    ) -> Response:
        async def prefill_leg() -> tuple[int, str] | None:
            """None when the prefill server did its part; else (status, what went wrong).

            A 4xx from the prefill server is the client's mistake and keeps its status
            and message; anything else is a 502 naming the server."""
            try:
                resp = await client.post(f"{p_inst.url}{path}", json=p_body)
            except httpx.HTTPError as exc:
                p_inst.info = None
                return 502, f"prefill server {p_inst.url} failed: {type(exc).__name__}: {exc}"
            finally:
                lease.release(p_inst)
            if 400 <= resp.status_code < 500:
                return resp.status_code, _error_text(resp)
            if resp.status_code != 200:
                text = _error_text(resp)
                return 502, f"prefill server {p_inst.url} answered {resp.status_code}: {text}"
            return None

        p_task = asyncio.create_task(prefill_leg())

        async def prefill_outcome(
            task: asyncio.Task[tuple[int, str] | None],
        ) -> tuple[int, str] | None:
            """The prefill leg's failure, if it ends within a moment; else None."""
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                return await asyncio.wait_for(asyncio.shield(task), _PREFILL_VERDICT_S)
            return None

        d_req = client.build_request("POST", f"{d_inst.url}{path}", json=d_body)
        d_task = asyncio.create_task(client.send(d_req, stream=True))
        gone = asyncio.create_task(wait_for_disconnect(request))

        async def drop_decode() -> None:
            d_task.cancel()
            with contextlib.suppress(BaseException):
                resp = await d_task
                await resp.aclose()

        # Wait for the decode server to answer (headers), for the prefill leg to fail,
        # or for the client to go away.
        p_checked = False
        try:
            while not d_task.done():
                waiting: set[asyncio.Future[Any]] = {d_task, gone}
                if not p_checked:
                    waiting.add(p_task)
                ready, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if gone in ready:
                    await drop_decode()
                    abort_prefill(p_inst, p_task, tid)
                    lease.release()
                    done("client_gone")
                    return Response(status_code=499)
                if p_task in ready and not p_checked:
                    p_checked = True
                    p_error = p_task.result()
                    if p_error is not None:
                        await drop_decode()
                        lease.release()
                        done("prefill_failed")
                        return error_response(*p_error)
        except BaseException:
            gone.cancel()
            raise
        try:
            d_resp = d_task.result()
        except httpx.HTTPError as exc:
            gone.cancel()
            abort_prefill(p_inst, p_task, tid)
            lease.release()
            done("decode_failed")
            return error_response(502, f"decode server {d_inst.url} failed: {exc}")
        if d_resp.status_code != 200:
            gone.cancel()
            with contextlib.suppress(httpx.HTTPError):
                await d_resp.aread()
            await d_resp.aclose()
            if d_resp.status_code >= 500 and not p_checked:
                # The decode server failed its transfer: if the prefill leg failed too,
                # that is the cause to report (a dead prefill server, say).
                p_checked = True
                p_error = await prefill_outcome(p_task)
                if p_error is not None:
                    lease.release()
                    done("prefill_failed")
                    return error_response(*p_error)
            abort_prefill(p_inst, p_task, tid)
            lease.release()
            done("rejected")
            headers = {}
            if "retry-after" in d_resp.headers:
                headers["Retry-After"] = d_resp.headers["retry-after"]
            return Response(
                d_resp.content,
                status_code=d_resp.status_code,
                media_type=d_resp.headers.get("content-type"),
                headers=headers,
            )

        async def relay() -> AsyncIterator[bytes]:
            """The decode server's body in whole events, cut short if the prefill leg
            fails first, the decode server fails, or the client goes away."""
            nonlocal p_checked
            chunks = d_resp.aiter_raw().__aiter__()
            nxt: asyncio.Future[bytes] | None = None
            finished = False
            buffer = b""
            try:
                while True:
                    if nxt is None:
                        nxt = asyncio.ensure_future(chunks.__anext__())
                    waiting: set[asyncio.Future[Any]] = {nxt, gone}
                    if not p_checked:
                        waiting.add(p_task)
                    ready, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                    if gone in ready:
                        raise _ClientGone
                    if p_task in ready and not p_checked:
                        p_checked = True
                        err = p_task.result()
                        if err is not None:
                            raise _LegFailed(*err)
                    if nxt in ready:
                        try:
                            chunk = nxt.result()
                        except StopAsyncIteration:
                            finished = True
                            if buffer:
                                yield buffer
                            return
                        except httpx.HTTPError as exc:
                            raise _LegFailed(
                                502,
                                f"decode server {d_inst.url} failed mid-response: "
                                f"{type(exc).__name__}: {exc}",
                            ) from None
                        nxt = None
                        if not stream:
                            buffer += chunk
                            continue
                        # Only whole events go out, so an error event after a failure
                        # never lands inside a half-relayed one.
                        buffer += chunk
                        cut = buffer.rfind(b"\n\n")
                        if cut >= 0:
                            events, buffer = buffer[: cut + 2], buffer[cut + 2 :]
                            if b'data: {"error"' in events and not p_checked:
                                # As above: a failed prefill leg is the cause to report.
                                p_checked = True
                                err = await prefill_outcome(p_task)
                                if err is not None:
                                    raise _LegFailed(*err)
                            yield events
            finally:
                gone.cancel()
                if nxt is not None:
                    nxt.cancel()
                await d_resp.aclose()
                lease.release()
                if not finished:
                    abort_prefill(p_inst, p_task, tid)

        if stream:

            async def sse() -> AsyncIterator[bytes]:
                try:
                    async for chunk in relay():
                        yield chunk
                    done("ok")
                except _LegFailed as exc:
                    done("failed")
                    yield error_event(exc.status, exc.message)
                    yield b"data: [DONE]\n\n"
                except _ClientGone:
                    done("client_gone")

            return StreamingResponse(sse(), media_type="text/event-stream")

        parts: list[bytes] = []
        try:
            async for chunk in relay():
                parts.append(chunk)
        except _LegFailed as exc:
            done("failed")
            return error_response(exc.status, exc.message)
        except _ClientGone:
            done("client_gone")
            return Response(status_code=499)
        done("ok")
        return Response(b"".join(parts), status_code=200, media_type="application/json")

    return app


# How long a failed decode leg waits for the prefill leg's verdict, to report the cause.
_PREFILL_VERDICT_S = 2.0


class _ClientGone(Exception):
    pass


class _LegFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def run_proxy(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    host: str,
    port: int,
    *,
    prefill_side_channels: Sequence[tuple[str, int]] | None = None,
    token: str | None = None,
) -> int:
    import uvicorn

    from kvpush.net import unbracket_host

    app = create_proxy_app(
        prefill_urls, decode_urls, prefill_side_channels=prefill_side_channels, token=token
    )
    server = uvicorn.Server(
        uvicorn.Config(app, host=unbracket_host(host), port=port, log_config=None, access_log=False)
    )
    # uvicorn re-raises the SIGINT/SIGTERM it handled once it has stopped: a normal end.
    with contextlib.suppress(KeyboardInterrupt, Terminated), stopped_by_sigterm():
        server.run()
    return 0 if server.started else 1
