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

vLLM servers at data parallelism N (one API server in front of N engines, each with its
own side channel on the given port plus its index, `prefill_dp`/`decode_dp`) are N
instances each: a leg goes to one engine, named by vLLM's `X-data-parallel-rank` header,
and names that engine's side channel, so both legs of a request meet whichever engines
they go to.

The prefill leg names the decode server's side channel too (`decode_host`, `decode_port`),
learnt the same way (`decode_side_channels` for vLLM decode servers): the prefill sends
the transfer only to a receiver that side channel serves, so a peer that registers the
id first takes nothing. A decode server whose side channel the proxy cannot learn (a
vLLM one given none) gets its transfers unnamed: the first receiver the prefill's side
channel admits takes each (the README's trust model says what that trusts).
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
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvpush.errors import ConfigError
from kvpush.serving.http import (
    DEFAULT_MAX_BODY_BYTES,
    BadBody,
    ClientDisconnected,
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
from kvpush.transfer_params import RemoteDecode, RemotePrefill

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Shape:
    """A vLLM server's tensor-parallel size and block size (tokens); None: not known."""

    tp_size: int | None = None
    block_size: int | None = None


@dataclass(slots=True)
class _Instance:
    url: str
    # One engine of a data-parallel vLLM server (its index), which each leg names.
    engine: int | None = None
    in_flight: int = 0
    info: dict[str, Any] | None = None
    # Given up front (a vLLM server's /health tells no side channel): never refetched.
    fixed_info: dict[str, Any] | None = None
    # A vLLM server's shape, read from its side channel (rank 0's geometry) when first
    # needed and again after a failure; None: not known.
    shape: _Shape | None = None

    @property
    def label(self) -> str:
        return self.url if self.engine is None else f"{self.url} (engine {self.engine})"

    @property
    def headers(self) -> dict[str, str]:
        """What routes a leg to this engine (vLLM's API server honours the header)."""
        return {} if self.engine is None else {"X-data-parallel-rank": str(self.engine)}


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
    r.counter("kvpush_proxy_requests_total", "Client requests by outcome.", ["outcome"])
    r.counter("kvpush_proxy_prefill_aborts_total", "Prefill legs cancelled: the decode leg failed.")
    r.gauge("kvpush_proxy_in_flight", "Requests in flight per backend.", ["pool", "url"])
    r.counter(
        "kvpush_proxy_body_disconnects_total",
        "Clients that went away while their body was read.",
    )
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


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """What a proxy is given: its prefill and decode servers, and how it talks to them.
    Side channels, when given, are one per server in the same order; with them, a
    data-parallel server (`*_dp` above 1) counts as one instance per engine."""

    prefill_urls: Sequence[str]
    decode_urls: Sequence[str]
    timeout_s: float = 300.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    prefill_side_channels: Sequence[tuple[str, int]] | None = None
    decode_side_channels: Sequence[tuple[str, int]] | None = None
    # The servers' shared secret, sent with the proxy's cancels.
    token: str | None = None
    prefill_dp: int = 1
    decode_dp: int = 1


def create_proxy_app(settings: ProxySettings) -> FastAPI:
    s = settings
    if not s.prefill_urls or not s.decode_urls:
        raise ValueError("a proxy needs at least one prefill and one decode server")
    prefill = _pool("prefill", s.prefill_urls, s.prefill_side_channels, s.prefill_dp)
    decode = _pool("decode", s.decode_urls, s.decode_side_channels, s.decode_dp)
    routes = ProxyRoutes(
        prefill, decode, timeout_s=s.timeout_s, max_body_bytes=s.max_body_bytes, token=s.token
    )
    app = FastAPI(title="kvpush proxy", docs_url=None, redoc_url=None, lifespan=routes.lifespan)
    install_error_handlers(app)
    app.include_router(routes.router())
    return app


def _pool(
    role: str, urls: Sequence[str], side_channels: Sequence[tuple[str, int]] | None, dp: int
) -> _Pool:
    """A role's instances: one per server, or one per engine of a data-parallel server
    (its side channel the given port plus the engine's index, as vLLM's connectors
    serve them)."""
    if side_channels is not None and len(side_channels) != len(urls):
        raise ValueError(
            f"{len(side_channels)} {role} side channels for {len(urls)} {role} servers: "
            "give one per server, in the same order"
        )
    if dp < 1 or (dp > 1 and side_channels is None):
        raise ConfigError(
            f"{role} data parallelism {dp}: expected 1, or more for vLLM {role} servers "
            f"given their side channels (each engine's is that port plus its index)"
        )
    if side_channels is None:
        return _Pool(role, [_Instance(u.rstrip("/")) for u in urls])
    instances = [
        _Instance(
            url.rstrip("/"),
            engine=engine if dp > 1 else None,
            fixed_info={"side_channel_host": host, "side_channel_port": port + engine},
        )
        for url, (host, port) in zip(urls, side_channels, strict=True)
        for engine in range(dp)
    ]
    return _Pool(role, instances)


class ProxyRoutes:
    """The proxy's routes, its HTTP client (opened and closed by `lifespan`) and the
    background cancels it sends; each completion becomes a `_Legs`."""

    def __init__(
        self,
        prefill: _Pool,
        decode: _Pool,
        *,
        timeout_s: float,
        max_body_bytes: int,
        token: str | None,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self.token = token
        self.registry = proxy_registry()
        self.background: set[asyncio.Task[None]] = set()
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "the proxy's lifespan has not started"
        return self._client

    @contextlib.asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        # Servers close a keep-alive connection after 5 s idle (uvicorn's default, vLLM's
        # too), httpx reuses one for 5 s: a request sent into a connection the server is
        # closing fails with ReadError before the server ever saw it. Reusing only
        # connections idle under 2 s leaves the server's close no such window.
        limits = httpx.Limits(
            max_connections=1000, max_keepalive_connections=100, keepalive_expiry=2.0
        )
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as client:
            self._client = client
            yield
            for task in list(self.background):
                task.cancel()

    def router(self) -> APIRouter:
        r = APIRouter()
        r.add_api_route("/health", self.health, methods=["GET"])
        r.add_api_route("/metrics", self.metrics, methods=["GET"])
        r.add_api_route("/v1/models", self.models, methods=["GET"])
        r.add_api_route("/v1/completions", self.completions, methods=["POST"])
        r.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        return r

    async def health(self) -> Response:
        p, d = await asyncio.gather(
            asyncio.gather(*(self._backend_health(i) for i in self.prefill.instances)),
            asyncio.gather(*(self._backend_health(i) for i in self.decode.instances)),
        )
        ok = any(b["status"] == "ok" for b in p) and any(b["status"] == "ok" for b in d)
        body = {"status": "ok" if ok else "unhealthy", "role": "proxy", "prefill": p, "decode": d}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def _backend_health(self, inst: _Instance) -> dict[str, Any]:
        try:
            resp = await self.client.get(f"{inst.url}/health", timeout=2.0)
        except httpx.HTTPError as exc:
            return {"url": inst.url, "status": "unreachable", "detail": f"{type(exc).__name__}"}
        status = "ok" if resp.status_code == 200 else "unhealthy"
        return {"url": inst.url, "status": status, "http_status": resp.status_code}

    async def metrics(self) -> Response:
        for pool in (self.prefill, self.decode):
            for inst in pool.instances:
                labels = {"pool": pool.name, "url": inst.label}
                self.registry.set("kvpush_proxy_in_flight", inst.in_flight, labels=labels)
        return PlainTextResponse(self.registry.render(), media_type="text/plain; version=0.0.4")

    async def models(self) -> Response:
        errors = []
        for inst in self.decode.instances:
            try:
                resp = await self.client.get(f"{inst.url}/v1/models", timeout=5.0)
            except httpx.HTTPError as exc:
                errors.append(f"{inst.url}: {type(exc).__name__}")
                continue
            if resp.status_code == 200:
                return Response(resp.content, media_type="application/json")
            errors.append(f"{inst.url}: HTTP {resp.status_code}")
        return error_response(502, f"no decode server answered /v1/models: {'; '.join(errors)}")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "/v1/completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, "/v1/chat/completions")

    def done(self, outcome: str) -> None:
        self.registry.inc("kvpush_proxy_requests_total", labels={"outcome": outcome})

    async def _info(self, inst: _Instance, role: str, *, named: bool) -> dict[str, Any]:
        """What a server says of itself: given (`fixed_info`), or its /health, kept until
        a failure resets it. `named`: it must be a kvpush `role` server that names its
        side channel; else a /health without kvpush's fields (vLLM's) reads as {}."""
        if inst.fixed_info is not None:
            return inst.fixed_info
        if inst.info is None:
            resp = await self.client.get(f"{inst.url}/health", timeout=5.0)
            body = resp.json() if resp.content else {}
            if not isinstance(body, dict):
                body = {}
            ours = body.get("role") == role and "side_channel_port" in body
            if body.get("role") not in (None, role) or (named and not ours):
                raise RuntimeError(f"{inst.url} is not a {role} server (health: {body})")
            inst.info = body
        return inst.info

    async def _decode_side_channel(self, inst: _Instance) -> tuple[str, int] | None:
        """The decode server's side channel, where it is known (given, or from a kvpush
        serve /health; not from vLLM's)."""
        info = await self._info(inst, "decode", named=False)
        if "side_channel_port" not in info:
            return None
        return info["side_channel_host"], info["side_channel_port"]

    async def _shape(self, inst: _Instance, side_channel: tuple[str, int] | None) -> _Shape:
        """A vLLM server's tensor-parallel size and block size, from its side channel
        (once, kept until a failure resets it). Unknown (None) where it is not a vLLM
        server given to us, or its side channel does not say: the legs then name none,
        and both sides take their own."""
        if inst.fixed_info is None or side_channel is None:
            return _Shape()
        if inst.shape is not None:
            return inst.shape
        from kvpush.errors import KVPushError
        from kvpush.sidechannel.client import fetch_metadata

        host, port = side_channel
        try:
            meta = await asyncio.to_thread(fetch_metadata, host, port, 0, token=self.token)
        except KVPushError as exc:
            log.warning(
                "%s: its side channel did not say its TP and block size (%s): transfers "
                "assume both sides run the same",
                inst.url,
                exc,
            )
            return _Shape()
        heads = meta.geometry.heads
        if heads is None:
            return _Shape()
        inst.shape = _Shape(heads.tp_size, meta.geometry.block_size_tokens)
        return inst.shape

    async def _read_body(self, request: Request) -> dict[str, Any] | Response:
        """The client's body, or the answer that refuses it."""
        try:
            body = await read_json(request, self.max_body_bytes)
        except ClientDisconnected:
            self.registry.inc("kvpush_proxy_body_disconnects_total")
            return Response(status_code=499)
        except BadBody as exc:
            self.done("rejected")
            return error_response(exc.status, exc.message)
        if not isinstance(body, dict):
            self.done("rejected")
            return error_response(400, "request body must be a JSON object")
        if body.get("kv_transfer_params") is not None:
            self.done("rejected")
            return error_response(400, "kv_transfer_params is set by the proxy: leave it out")
        return body

    async def _complete(self, request: Request, path: str) -> Response:
        body = await self._read_body(request)
        if isinstance(body, Response):
            return body
        p_inst, d_inst = self.prefill.pick(), self.decode.pick()
        try:
            info = await self._info(p_inst, "prefill", named=True)
        except (httpx.HTTPError, ValueError, RuntimeError) as exc:
            p_inst.info = p_inst.shape = None
            self.done("prefill_failed")
            return error_response(502, f"prefill server {p_inst.label} is unavailable: {exc!s}")
        try:
            to_decode = await self._decode_side_channel(d_inst)
        except (httpx.HTTPError, ValueError, RuntimeError) as exc:
            self.done("decode_failed")
            return error_response(502, f"decode server {d_inst.label} is unavailable: {exc!s}")
        tid = f"xfer-{uuid.uuid4().hex}"
        # Both legs name both TP sizes: each side splits the transfer into the same
        # parts, one per pair of ranks (vLLM servers; kvpush serve runs TP 1); the decode
        # leg names the prefill's block size, the unit the decode registers in.
        p = await self._shape(p_inst, (info["side_channel_host"], info["side_channel_port"]))
        d_tp = (await self._shape(d_inst, to_decode)).tp_size
        remote = RemotePrefill(
            transfer_id=tid,
            remote_host=info["side_channel_host"],
            remote_port=info["side_channel_port"],
            remote_engine_id=info.get("engine_id"),
            tp_size=p.tp_size,
            decode_tp_size=d_tp,
            block_size=p.block_size,
        )
        d_body = {**body, "kv_transfer_params": remote.to_params()}
        # The prefill leg keeps the client's max_tokens: its checks (context length) then
        # speak of what the client asked; the prefill server computes one token anyway.
        p_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        if p_inst.fixed_info is not None:
            p_body["max_tokens"] = 1  # a vLLM prefill server computes what it is asked
        decode_host, decode_port = to_decode or (None, None)
        named = RemoteDecode(
            transfer_id=tid,
            decode_host=decode_host,
            decode_port=decode_port,
            decode_tp_size=d_tp,
        )
        p_body["kv_transfer_params"] = named.to_params()
        lease = _Lease(p_inst, d_inst)
        legs = _Legs(self, request, path, tid, body.get("stream") is True, lease)
        try:
            return await legs.run(p_inst, d_inst, p_body, d_body)
        except BaseException:
            lease.release()
            raise

    def abort_prefill(self, p_inst: _Instance, p_task: asyncio.Task[Any], tid: str) -> None:
        """The decode leg will not take this transfer: the prefill server must not hold
        its blocks for it. Its request is dropped (if still running) and its transfer
        cancelled by id (if already computed, or not even started)."""
        p_task.cancel()
        self.registry.inc("kvpush_proxy_prefill_aborts_total")
        task = asyncio.create_task(self._cancel(p_inst, tid))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _cancel(self, p_inst: _Instance, tid: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            resp = await self.client.post(
                f"{p_inst.url}/kvpush/abort",
                json={"transfer_id": tid},
                headers=bearer_headers(self.token),
                timeout=5.0,
            )
            if resp.status_code == 401:  # a token missing or wrong: say so, once per cancel
                log.warning(
                    "prefill server %s refused to cancel %s: %s", p_inst.url, tid, _error_text(resp)
                )


class _Legs:
    """One client request's two legs, sent at once: the decode server's answer is
    relayed, cut short (and the other leg dropped) when a leg fails or the client goes."""

    def __init__(
        self,
        routes: ProxyRoutes,
        request: Request,
        path: str,
        tid: str,
        stream: bool,
        lease: _Lease,
    ) -> None:
        self.routes = routes
        self.client = routes.client
        self.request = request
        self.path = path
        self.tid = tid
        self.stream = stream
        self.lease = lease
        self.p_checked = False  # the prefill leg's verdict was looked at

    async def run(
        self,
        p_inst: _Instance,
        d_inst: _Instance,
        p_body: dict[str, Any],
        d_body: dict[str, Any],
    ) -> Response:
        self.p_inst, self.d_inst = p_inst, d_inst
        self.p_task = asyncio.create_task(self._prefill_leg(p_body))
        d_req = self.client.build_request(
            "POST", f"{d_inst.url}{self.path}", json=d_body, headers=d_inst.headers
        )
        self.d_task = asyncio.create_task(self.client.send(d_req, stream=True))
        self.gone = asyncio.create_task(wait_for_disconnect(self.request))
        try:
            early = await self._wait_for_decode()
        except BaseException:
            self.gone.cancel()
            raise
        if early is not None:
            return early
        try:
            d_resp = self.d_task.result()
        except httpx.HTTPError as exc:
            self.gone.cancel()
            self._abort_prefill()
            # A restarted server may have moved its side channel, or changed its TP.
            d_inst.info = d_inst.shape = None
            self._end("decode_failed")
            return error_response(502, f"decode server {d_inst.label} failed: {exc}")
        if d_resp.status_code != 200:
            self.gone.cancel()
            return await self._refused_by_decode(d_resp)
        if self.stream:
            return StreamingResponse(self._sse(d_resp), media_type="text/event-stream")
        return await self._whole(d_resp)

    async def _prefill_leg(self, p_body: dict[str, Any]) -> tuple[int, str] | None:
        """None when the prefill server did its part; else (status, what went wrong).

        A 4xx from the prefill server is the client's mistake and keeps its status and
        message; anything else is a 502 naming the server."""
        p_inst = self.p_inst
        try:
            resp = await self.client.post(
                f"{p_inst.url}{self.path}", json=p_body, headers=p_inst.headers
            )
        except httpx.HTTPError as exc:
            p_inst.info = p_inst.shape = None
            return 502, f"prefill server {p_inst.label} failed: {type(exc).__name__}: {exc}"
        finally:
            self.lease.release(p_inst)
        if 400 <= resp.status_code < 500:
            return resp.status_code, _error_text(resp)
        if resp.status_code != 200:
            text = _error_text(resp)
            return 502, f"prefill server {p_inst.label} answered {resp.status_code}: {text}"
        return None

    async def _prefill_outcome(self) -> tuple[int, str] | None:
        """The prefill leg's failure, if it ends within a moment; else None."""
        self.p_checked = True
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            return await asyncio.wait_for(asyncio.shield(self.p_task), _PREFILL_VERDICT_S)
        return None

    def _prefill_failed_now(self, ready: set[asyncio.Future[Any]]) -> tuple[int, str] | None:
        """The prefill leg's failure, if it is among `ready` and not yet looked at."""
        if self.p_task not in ready or self.p_checked:
            return None
        self.p_checked = True
        return self.p_task.result()

    def _waiting_with(self, *futures: asyncio.Future[Any]) -> set[asyncio.Future[Any]]:
        waiting: set[asyncio.Future[Any]] = {*futures, self.gone}
        if not self.p_checked:
            waiting.add(self.p_task)
        return waiting

    def _abort_prefill(self) -> None:
        self.routes.abort_prefill(self.p_inst, self.p_task, self.tid)

    def _end(self, outcome: str) -> None:
        self.lease.release()
        self.routes.done(outcome)

    async def _drop_decode(self) -> None:
        self.d_task.cancel()
        with contextlib.suppress(BaseException):
            resp = await self.d_task
            await resp.aclose()

    async def _wait_for_decode(self) -> Response | None:
        """Wait for the decode server to answer (headers), for the prefill leg to fail,
        or for the client to go away; the answer to give in the last two cases."""
        while not self.d_task.done():
            waiting = self._waiting_with(self.d_task)
            ready, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if self.gone in ready:
                await self._drop_decode()
                self._abort_prefill()
                self._end("client_gone")
                return Response(status_code=499)
            p_error = self._prefill_failed_now(ready)
            if p_error is not None:
                await self._drop_decode()
                self._end("prefill_failed")
                return error_response(*p_error)
        return None

    async def _refused_by_decode(self, d_resp: httpx.Response) -> Response:
        with contextlib.suppress(httpx.HTTPError):
            await d_resp.aread()
        await d_resp.aclose()
        if d_resp.status_code >= 500 and not self.p_checked:
            # The decode server failed its transfer: if the prefill leg failed too,
            # that is the cause to report (a dead prefill server, say).
            p_error = await self._prefill_outcome()
            if p_error is not None:
                self._end("prefill_failed")
                return error_response(*p_error)
        self._abort_prefill()
        self._end("rejected")
        headers = {}
        if "retry-after" in d_resp.headers:
            headers["Retry-After"] = d_resp.headers["retry-after"]
        return Response(
            d_resp.content,
            status_code=d_resp.status_code,
            media_type=d_resp.headers.get("content-type"),
            headers=headers,
        )

    async def _relay(self, d_resp: httpx.Response) -> AsyncIterator[bytes]:
        """The decode server's body in whole events, cut short if the prefill leg
        fails first, the decode server fails, or the client goes away."""
        chunks = d_resp.aiter_raw().__aiter__()
        nxt: asyncio.Future[bytes] | None = None
        finished = False
        buffer = b""
        try:
            while True:
                if nxt is None:
                    nxt = asyncio.ensure_future(chunks.__anext__())
                ready, _ = await asyncio.wait(
                    self._waiting_with(nxt), return_when=asyncio.FIRST_COMPLETED
                )
                if self.gone in ready:
                    raise _ClientGone
                err = self._prefill_failed_now(ready)
                if err is not None:
                    raise _LegFailed(*err)
                if nxt not in ready:
                    continue
                chunk = self._chunk(nxt)
                nxt = None
                if chunk is None:
                    finished = True
                    if buffer:
                        yield buffer
                    return
                buffer += chunk
                if self.stream:
                    events, buffer = await self._whole_events(buffer)
                    if events:
                        yield events
        finally:
            self.gone.cancel()
            if nxt is not None:
                nxt.cancel()
            await d_resp.aclose()
            self.lease.release()
            if not finished:
                self._abort_prefill()

    def _chunk(self, nxt: asyncio.Future[bytes]) -> bytes | None:
        """The next piece of the decode server's body; None at its end."""
        try:
            return nxt.result()
        except StopAsyncIteration:
            return None
        except httpx.HTTPError as exc:
            raise _LegFailed(
                502,
                f"decode server {self.d_inst.label} failed mid-response: "
                f"{type(exc).__name__}: {exc}",
            ) from None

    async def _whole_events(self, buffer: bytes) -> tuple[bytes, bytes]:
        """`(whole events to send, the rest)`: only whole events go out, so an error event
        after a failure never lands inside a half-relayed one."""
        cut = buffer.rfind(b"\n\n")
        if cut < 0:
            return b"", buffer
        events, rest = buffer[: cut + 2], buffer[cut + 2 :]
        if b'data: {"error"' in events and not self.p_checked:
            # As when the decode server refuses: a failed prefill leg is the cause to report.
            err = await self._prefill_outcome()
            if err is not None:
                raise _LegFailed(*err)
        return events, rest

    async def _sse(self, d_resp: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._relay(d_resp):
                yield chunk
            self.routes.done("ok")
        except _LegFailed as exc:
            self.routes.done("failed")
            yield error_event(exc.status, exc.message)
            yield b"data: [DONE]\n\n"
        except _ClientGone:
            self.routes.done("client_gone")

    async def _whole(self, d_resp: httpx.Response) -> Response:
        parts: list[bytes] = []
        try:
            async for chunk in self._relay(d_resp):
                parts.append(chunk)
        except _LegFailed as exc:
            self.routes.done("failed")
            return error_response(exc.status, exc.message)
        except _ClientGone:
            self.routes.done("client_gone")
            return Response(status_code=499)
        self.routes.done("ok")
        return Response(b"".join(parts), status_code=200, media_type="application/json")


# How long a failed decode leg waits for the prefill leg's verdict, to report the cause.
_PREFILL_VERDICT_S = 2.0


class _ClientGone(Exception):
    pass


class _LegFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def run_proxy(settings: ProxySettings, host: str, port: int) -> int:
    import uvicorn

    from kvpush.net import unbracket_host

    app = create_proxy_app(settings)
    server = uvicorn.Server(
        uvicorn.Config(app, host=unbracket_host(host), port=port, log_config=None, access_log=False)
    )
    # uvicorn re-raises the SIGINT/SIGTERM it handled once it has stopped: a normal end.
    with contextlib.suppress(KeyboardInterrupt, Terminated), stopped_by_sigterm():
        server.run()
    return 0 if server.started else 1
