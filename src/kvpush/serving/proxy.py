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

The backends and their pools are in `proxy_pool`; the two legs of one request, and the
relay of the decode server's answer, in `proxy_legs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from kvpush.health import (
    BackendHealth,
    ProxyHealth,
    ServerHealth,
    decode_server_health,
    encode,
)
from kvpush.serving.http import (
    DEFAULT_MAX_BODY_BYTES,
    BadBody,
    ClientDisconnected,
    Terminated,
    bearer_headers,
    error_response,
    install_error_handlers,
    read_json,
    stopped_by_sigterm,
)
from kvpush.serving.metrics import Registry
from kvpush.serving.proxy_legs import Legs, error_text
from kvpush.serving.proxy_pool import Instance, Lease, Pool, ServerShape, build_pool
from kvpush.transfer_params import RemoteDecode, RemotePrefill

log = logging.getLogger(__name__)


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
    prefill = build_pool("prefill", s.prefill_urls, s.prefill_side_channels, s.prefill_dp)
    decode = build_pool("decode", s.decode_urls, s.decode_side_channels, s.decode_dp)
    routes = ProxyRoutes(
        prefill, decode, timeout_s=s.timeout_s, max_body_bytes=s.max_body_bytes, token=s.token
    )
    app = FastAPI(title="kvpush proxy", docs_url=None, redoc_url=None, lifespan=routes.lifespan)
    install_error_handlers(app)
    app.include_router(routes.router())
    return app


class ProxyRoutes:
    """The proxy's routes, its HTTP client (opened and closed by `lifespan`) and the
    background cancels it sends; each completion becomes a `Legs`."""

    def __init__(
        self,
        prefill: Pool,
        decode: Pool,
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
        ok = any(b.status == "ok" for b in p) and any(b.status == "ok" for b in d)
        body = ProxyHealth(
            status="ok" if ok else "unhealthy", role="proxy", prefill=tuple(p), decode=tuple(d)
        )
        return Response(encode(body), status_code=200 if ok else 503, media_type="application/json")

    async def _backend_health(self, inst: Instance) -> BackendHealth:
        try:
            resp = await self.client.get(f"{inst.url}/health", timeout=2.0)
        except httpx.HTTPError as exc:
            return BackendHealth(url=inst.url, status="unreachable", detail=f"{type(exc).__name__}")
        status = "ok" if resp.status_code == 200 else "unhealthy"
        return BackendHealth(url=inst.url, status=status, http_status=resp.status_code)

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

    def done(
        self, outcome: str, failure: tuple[int, str] | None = None, tid: str | None = None
    ) -> None:
        """Count a client request's outcome. One answered with a server's failure
        (`failure`: a 5xx status and its message) is logged too, with its transfer id
        once its legs went out (both servers' logs name it); a client's own mistake
        (4xx) is told to the client alone."""
        self.registry.inc("kvpush_proxy_requests_total", labels={"outcome": outcome})
        if failure is None or failure[0] < 500:
            return
        status, message = failure
        if tid is None:
            log.warning("a request failed (%d): %s", status, message)
        else:
            log.warning("transfer %s failed (%d): %s", tid, status, message)

    def _unavailable(self, outcome: str, server: str, exc: Exception) -> Response:
        """A request failed before its legs went out: `server` did not say what the
        legs need."""
        message = f"{server} is unavailable: {exc!s}"
        self.done(outcome, (502, message))
        return error_response(502, message)

    async def _info(self, inst: Instance, role: str, *, named: bool) -> ServerHealth:
        """What a server says of itself: given (`fixed_info`), or its /health, kept until
        a failure resets it. `named`: it must be a kvpush `role` server that names its
        side channel; else a /health without kvpush's fields (vLLM's) reads as nothing
        known. A /health of kvpush's form but malformed raises `MalformedHealth`."""
        if inst.fixed_info is not None:
            return inst.fixed_info
        if inst.info is None:
            resp = await self.client.get(f"{inst.url}/health", timeout=5.0)
            health = decode_server_health(resp.content, f"{inst.url}/health") or ServerHealth()
            ours = health.role == role and health.side_channel_address is not None
            if health.role not in (None, role) or (named and not ours):
                raise RuntimeError(f"{inst.url} is not a {role} server (health: {resp.text[:300]})")
            inst.info = health
        return inst.info

    async def _decode_side_channel(self, inst: Instance) -> tuple[str, int] | None:
        """The decode server's side channel, where it is known (given, or from a kvpush
        serve /health; not from vLLM's)."""
        return (await self._info(inst, "decode", named=False)).side_channel_address

    async def _shape(self, inst: Instance, side_channel: tuple[str, int] | None) -> ServerShape:
        """A vLLM server's tensor-parallel, block and pipeline-parallel sizes (the
        decode registers every stage's parts), from its side channel
        (once, kept until a failure resets it). Unknown (None) where it is not a vLLM
        server given to us, or its side channel does not say: the legs then name none,
        and both sides take their own."""
        if inst.fixed_info is None or side_channel is None:
            return ServerShape()
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
            return ServerShape()
        heads = meta.geometry.heads
        if heads is None:
            return ServerShape()
        stage = meta.geometry.stage
        inst.shape = ServerShape(
            heads.tp_size, meta.geometry.block_size_tokens, None if stage is None else stage.size
        )
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
            return self._unavailable("prefill_failed", f"prefill server {p_inst.label}", exc)
        try:
            to_decode = await self._decode_side_channel(d_inst)
        except (httpx.HTTPError, ValueError, RuntimeError) as exc:
            return self._unavailable("decode_failed", f"decode server {d_inst.label}", exc)
        tid = f"xfer-{uuid.uuid4().hex}"
        # Both legs name both TP sizes: each side splits the transfer into the same
        # parts, one per pair of ranks (vLLM servers; kvpush serve runs TP 1); the decode
        # leg names the prefill's block size, the unit the decode registers in.
        p_side = info.side_channel_address
        assert p_side is not None  # `named`: _info refused a prefill server without one
        p = await self._shape(p_inst, p_side)
        d_tp = (await self._shape(d_inst, to_decode)).tp_size
        remote = RemotePrefill(
            transfer_id=tid,
            remote_host=p_side[0],
            remote_port=p_side[1],
            remote_engine_id=info.engine_id,
            tp_size=p.tp_size,
            decode_tp_size=d_tp,
            block_size=p.block_size,
            pp_size=p.pp_size,
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
        lease = Lease(p_inst, d_inst)
        legs = Legs(self, request, path, tid, body.get("stream") is True, lease)
        try:
            return await legs.run(p_inst, d_inst, p_body, d_body)
        except BaseException:
            lease.release()
            raise

    def abort_prefill(self, p_inst: Instance, p_task: asyncio.Task[Any], tid: str) -> None:
        """The decode leg will not take this transfer: the prefill server must not hold
        its blocks for it. Its request is dropped (if still running) and its transfer
        cancelled by id (if already computed, or not even started)."""
        p_task.cancel()
        self.registry.inc("kvpush_proxy_prefill_aborts_total")
        task = asyncio.create_task(self._cancel(p_inst, tid))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _cancel(self, p_inst: Instance, tid: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            resp = await self.client.post(
                f"{p_inst.url}/kvpush/abort",
                json={"transfer_id": tid},
                headers=bearer_headers(self.token),
                timeout=5.0,
            )
            if resp.status_code == 401:  # a token missing or wrong: say so, once per cancel
                log.warning(
                    "prefill server %s refused to cancel %s: %s", p_inst.url, tid, error_text(resp)
                )


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
