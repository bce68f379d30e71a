"""One client request's two legs, sent at once by the proxy: the decode server's answer is
relayed, streamed or whole, and cut short (the other leg dropped) when a leg fails or the
client goes away. A failed prefill leg is the cause reported where both fail."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvpush.serving.http import error_event, error_response, wait_for_disconnect
from kvpush.serving.proxy_pool import Instance, Lease


def error_text(resp: httpx.Response) -> str:
    """What a backend's error answer says: its OpenAI-style message, else its first bytes."""
    try:
        body = resp.json()
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


class LegsOwner(Protocol):
    """What the legs ask of the proxy that sent them: its HTTP client, the cancel of a
    prefill leg the decode leg will not take, and the count of each request's outcome."""

    @property
    def client(self) -> httpx.AsyncClient: ...

    def abort_prefill(self, p_inst: Instance, p_task: asyncio.Task[Any], tid: str) -> None: ...

    def done(
        self, outcome: str, failure: tuple[int, str] | None = None, tid: str | None = None
    ) -> None: ...


class Legs:
    """One client request's two legs, sent at once: the decode server's answer is
    relayed, cut short (and the other leg dropped) when a leg fails or the client goes."""

    def __init__(
        self,
        routes: LegsOwner,
        request: Request,
        path: str,
        tid: str,
        stream: bool,
        lease: Lease,
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
        p_inst: Instance,
        d_inst: Instance,
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
            return self._failed("decode_failed", 502, f"decode server {d_inst.label} failed: {exc}")
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
            return resp.status_code, error_text(resp)
        if resp.status_code != 200:
            text = error_text(resp)
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

    def _end(self, outcome: str, failure: tuple[int, str] | None = None) -> None:
        self.lease.release()
        self.routes.done(outcome, failure, self.tid)

    def _failed(self, outcome: str, status: int, message: str) -> Response:
        """End the request with the error answer `status`, `message`."""
        self._end(outcome, (status, message))
        return error_response(status, message)

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
                return self._failed("prefill_failed", *p_error)
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
                return self._failed("prefill_failed", *p_error)
        self._abort_prefill()
        status = d_resp.status_code
        self._end(
            "rejected",
            (status, f"decode server {self.d_inst.label} answered {status}: {error_text(d_resp)}"),
        )
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
            self.routes.done("failed", (exc.status, exc.message), self.tid)
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
            self.routes.done("failed", (exc.status, exc.message), self.tid)
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
