"""What every kvpush HTTP server shares: OpenAI-shaped errors and a hardened body reader.

Every error any of our servers answers, 404 and 405 included, has OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`), and a refusal that may succeed later
(429, 503) carries `Retry-After`. A request body is read with a size cap (413), parsed
as strict JSON (`NaN`/`Infinity` refused, as OpenAI does), and checked for lone
surrogates and runaway nesting, so no input reaches a handler that could make it answer
500 or echo something unencodable.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import signal
import threading
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# Deeper JSON than this is nobody's completion request: refused before it costs anything.
MAX_JSON_DEPTH = 64


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    if status == 404:
        return "not_found_error"
    return "invalid_request_error"


def error_response(
    status: int,
    message: str,
    kind: str | None = None,
    *,
    param: str | None = None,
    retry_after_s: float | None = None,
) -> JSONResponse:
    """The one way our servers answer an error."""
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    body = {
        "error": {
            "message": message,
            "type": kind or error_type(status),
            "param": param,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


def error_event(status: int, message: str) -> bytes:
    """An error as one server-sent event, for a stream that already started."""
    body = {"error": {"message": message, "type": error_type(status), "code": status}}
    return f"data: {json.dumps(body)}\n\n".encode()


def bearer_headers(token: str | None) -> dict[str, str]:
    """The headers that carry `token` to a kvpush server's internal endpoints."""
    return {} if token is None else {"Authorization": f"Bearer {token}"}


def check_bearer(request: Request, token: str | None) -> JSONResponse | None:
    """None when `request` may use an internal endpoint; else the 401 to answer.

    With a token configured (the side channel's: `--token-file` or `$KVPUSH_TOKEN`),
    the request must carry it as `Authorization: Bearer <token>`; without one, the
    endpoint is as open as the side channel is."""
    if token is None:
        return None
    given = request.headers.get("authorization", "")
    scheme, _, value = given.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode()):
        return None
    what = "no token" if not given else "a wrong token"
    return error_response(
        401,
        f"{request.url.path} needs this server's token (the side channel's): the request "
        f"carried {what}; expected the header 'Authorization: Bearer <token>'",
        param="authorization",
    )


class ClientDisconnected(Exception):
    """The client went away while its request body was read: there is nobody to answer.
    Servers count it (`*_body_disconnects_total`); it is no crash and no log line."""


class BadBody(Exception):
    """A request body we refuse before looking at its fields."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _refuse_constant(name: str) -> Any:
    raise BadBody(400, f"{name} is not valid JSON: expected a finite number")


def _depth_and_strings(value: object) -> None:
    """Refuses nesting deeper than MAX_JSON_DEPTH and strings with lone surrogates (which
    no UTF-8 encoder can write back). Iterative: deep input cannot exhaust the stack."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadBody(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, dict):
            for k, v in item.items():
                _check_text(k)
                stack.append((v, depth + 1))


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadBody(
            400,
            f"request body has a lone surrogate (\\u{ord(text[exc.start]):04x}) in a string: "
            "expected valid Unicode text",
        ) from None


def parse_json_body(raw: bytes) -> object:
    """Strict JSON of a request body, or `BadBody(400, why)`."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except BadBody:
        raise
    except RecursionError:
        raise BadBody(400, "request body is nested too deeply to be a request") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both
        raise BadBody(400, f"request body is not valid JSON: {exc}") from None
    _depth_and_strings(body)
    return body


async def read_json(request: Request, max_bytes: int) -> object:
    """The request's JSON body, read with a cap and parsed off the event loop. Raises
    `BadBody` for a body we refuse, `ClientDisconnected` when the client left first."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BadBody(
            413, f"request body of {int(declared)} bytes is over the {max_bytes}-byte limit"
        )
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise BadBody(413, f"request body is over the {max_bytes}-byte limit")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientDisconnected from None
    raw = b"".join(chunks)
    if len(raw) < 64 * 1024:
        return parse_json_body(raw)
    return await asyncio.to_thread(parse_json_body, raw)


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone away. Only once the body has been read."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped answers for what the framework itself refuses (404, 405, ...), and
    for a bug: a handler's exception is a 500 in the same shape, never a traceback."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = "no such route: see /v1/completions, /v1/models, /health, /metrics"
        elif exc.status_code == 405:
            message = f"method not allowed here: {exc.detail}"
        return error_response(exc.status_code, message)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, f"invalid request: {exc.errors()!s:.300}")

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request handler failed")
        return error_response(500, f"internal error: {type(exc).__name__}")


class Terminated(Exception):
    """SIGTERM arrived: the process stops the way it does on SIGINT."""


@contextlib.contextmanager
def stopped_by_sigterm() -> Iterator[None]:
    """While inside, SIGTERM raises `Terminated` instead of killing the process, so the
    `finally` that closes the runtime runs. uvicorn captures SIGTERM itself while it
    serves and re-raises it once it has stopped: this handler is what it re-raises to."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
