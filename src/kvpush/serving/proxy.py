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
side channels given to the proxy, one per prefill server (`prefill_side_channels`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

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


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status
    )


def _error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


def create_proxy_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    timeout_s: float = 300.0,
    prefill_side_channels: Sequence[tuple[str, int]] | None = None,
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

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            state["client"] = client
            yield

    app = FastAPI(title="kvpush proxy", docs_url=None, redoc_url=None, lifespan=lifespan)

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

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "role": "proxy",
                "prefill": [i.url for i in prefill.instances],
                "decode": [i.url for i in decode.instances],
            }
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        if body.get("kv_transfer_params") is not None:
            return _error(400, "kv_transfer_params is set by the proxy: leave it out")
        client = state["client"]
        p_inst, d_inst = prefill.pick(), decode.pick()
        try:
            info = await prefill_info(p_inst)
        except (httpx.HTTPError, ValueError, RuntimeError) as exc:
            p_inst.info = None
            return _error(
                502, f"prefill server {p_inst.url} is unavailable: {exc!s}", "server_error"
            )
        tid = f"xfer-{uuid.uuid4().hex}"
        stream = bool(body.get("stream"))
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
        p_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        p_body["max_tokens"] = 1
        p_body["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": tid}

        p_inst.in_flight += 1
        d_inst.in_flight += 1

        async def prefill_leg() -> tuple[int, str] | None:
            """None when the prefill server did its part; else (status, what went wrong).

            A 4xx from the prefill server is the client's mistake and keeps its status
            and message; anything else is a 502 naming the server."""
            try:
                resp = await client.post(f"{p_inst.url}/v1/completions", json=p_body)
            except httpx.HTTPError as exc:
                p_inst.info = None
                return 502, f"prefill server {p_inst.url} failed: {type(exc).__name__}: {exc}"
            finally:
                p_inst.in_flight -= 1
            if 400 <= resp.status_code < 500:
                return resp.status_code, _error_text(resp)
            if resp.status_code != 200:
                text = _error_text(resp)
                return 502, f"prefill server {p_inst.url} answered {resp.status_code}: {text}"
            return None

        p_task = asyncio.create_task(prefill_leg())
        d_req = client.build_request("POST", f"{d_inst.url}/v1/completions", json=d_body)
        d_task = asyncio.create_task(client.send(d_req, stream=True))

        def finish() -> None:
            d_inst.in_flight -= 1

        # Wait for the decode server to answer (headers), or for the prefill leg to fail.
        p_error: tuple[int, str] | None = None
        p_checked = False
        while not d_task.done():
            done, _ = await asyncio.wait(
                {d_task} if p_checked else {d_task, p_task},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if p_task in done and not p_checked:
                p_checked = True
                p_error = p_task.result()
                if p_error is not None:
                    d_task.cancel()
                    with contextlib.suppress(BaseException):
                        resp = await d_task
                        await resp.aclose()
                    finish()
                    status, message = p_error
                    kind = "server_error" if status >= 500 else "invalid_request_error"
                    return _error(status, message, kind)
        try:
            d_resp = d_task.result()
        except httpx.HTTPError as exc:
            finish()
            p_task.cancel()
            return _error(502, f"decode server {d_inst.url} failed: {exc}", "server_error")
        if d_resp.status_code != 200:
            await d_resp.aread()
            await d_resp.aclose()
            finish()
            # The decode server refused before allocating and told the prefill server.
            return Response(
                d_resp.content,
                status_code=d_resp.status_code,
                media_type=d_resp.headers.get("content-type"),
            )

        async def relay() -> AsyncIterator[bytes]:
            """The decode server's body, cut short if the prefill leg fails first."""
            nonlocal p_checked
            chunks = d_resp.aiter_raw().__aiter__()
            nxt: asyncio.Future[bytes] | None = None
            try:
                while True:
                    if nxt is None:
                        nxt = asyncio.ensure_future(chunks.__anext__())
                    waiting: set[asyncio.Future[Any]] = {nxt} if p_checked else {nxt, p_task}
                    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                    if p_task in done and not p_checked:
                        p_checked = True
                        err = p_task.result()
                        if err is not None:
                            nxt.cancel()
                            raise _LegFailed(*err)
                    if nxt in done:
                        try:
                            chunk = nxt.result()
                        except StopAsyncIteration:
                            return
                        nxt = None
                        yield chunk
            finally:
                if nxt is not None:
                    nxt.cancel()
                await d_resp.aclose()
                finish()

        if stream:

            async def sse() -> AsyncIterator[bytes]:
                try:
                    async for chunk in relay():
                        yield chunk
                except _LegFailed as exc:
                    err = {
                        "error": {
                            "message": exc.message,
                            "type": "server_error",
                            "code": exc.status,
                        }
                    }
                    yield f"data: {json.dumps(err)}\n\n".encode()
                    yield b"data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")

        parts: list[bytes] = []
        try:
            async for chunk in relay():
                parts.append(chunk)
        except _LegFailed as exc:
            return _error(exc.status, exc.message, "server_error")
        return Response(b"".join(parts), status_code=200, media_type="application/json")

    return app


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
) -> int:
    import uvicorn

    from kvpush.net import unbracket_host

    app = create_proxy_app(prefill_urls, decode_urls, prefill_side_channels=prefill_side_channels)
    server = uvicorn.Server(
        uvicorn.Config(app, host=unbracket_host(host), port=port, log_config=None, access_log=False)
    )
    # uvicorn re-raises the SIGINT it handled once it has stopped: a normal end.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0 if server.started else 1
