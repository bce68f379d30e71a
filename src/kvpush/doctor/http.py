"""A server's `/health` (JSON, `kvpush.health`) and `/metrics` (Prometheus text,
`kvpush.metrics_text`), each fetched once with a deadline. No HTTP library but the
standard one: the doctor runs where the serving extras are not installed.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvpush.errors import AddressError
from kvpush.health import (
    MalformedHealth,
    ProxyHealth,
    ServerHealth,
    decode_proxy_health,
    decode_server_health,
)
from kvpush.metrics_text import MalformedMetrics, Sample, parse_metrics


def base_url(url: str) -> str:
    """`http://h:p` from `http://h:p`, `http://h:p/` or `http://h:p/health`."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise AddressError(f"bad HTTP URL {url!r}: expected http://HOST:PORT")
    return f"{parts.scheme}://{parts.netloc}"


class HttpFailed(Exception):
    """No usable answer; the message says why (timeout, refused, not JSON)."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True, slots=True)
class HttpAnswer:
    status: int
    body: str
    ms: float


def get(url: str, timeout_s: float) -> HttpAnswer:
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            status, body = reply.status, reply.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:  # a 503 from /health still has a body to read
        status, body = exc.code, exc.read().decode(errors="replace")
    except TimeoutError:
        raise HttpFailed(
            f"GET {url}: no answer within {timeout_s * 1000:.0f} ms", timed_out=True
        ) from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, TimeoutError):
            raise HttpFailed(
                f"GET {url}: no answer within {timeout_s * 1000:.0f} ms", timed_out=True
            ) from None
        text = getattr(reason, "strerror", None) or str(reason)
        raise HttpFailed(f"GET {url}: {text}") from None
    except (OSError, ValueError) as exc:
        raise HttpFailed(f"GET {url}: {exc}") from None
    return HttpAnswer(status, body, (time.perf_counter() - started) * 1000)


def get_health(base: str, timeout_s: float) -> tuple[int, ServerHealth | None]:
    """The status and `/health` of a server; None for a body that is not a JSON object
    (vLLM's `/health` answers 200 with an empty body). A JSON object that is not of the
    contract is an `HttpFailed` saying which field was wrong."""
    answer = get(f"{base}/health", timeout_s)
    try:
        return answer.status, decode_server_health(answer.body, f"GET {base}/health")
    except MalformedHealth as exc:
        raise HttpFailed(str(exc)) from None


def get_proxy_health(base: str, timeout_s: float) -> ProxyHealth:
    """A `kvpush proxy`'s `/health`: `HttpFailed` without an answer, `MalformedHealth`
    (saying what was wrong) for an answer that is not a proxy's."""
    answer = get(f"{base}/health", timeout_s)
    return decode_proxy_health(answer.body, f"GET {base}/health")


def get_metrics(base: str, timeout_s: float) -> list[Sample]:
    """The samples of `/metrics` (`kvpush.metrics_text`); an answer that is not of the
    Prometheus text format is an `HttpFailed` saying what was wrong."""
    answer = get(f"{base}/metrics", timeout_s)
    if answer.status != 200:
        raise HttpFailed(f"GET {base}/metrics answered {answer.status}")
    try:
        return parse_metrics(answer.body)
    except MalformedMetrics as exc:
        raise HttpFailed(f"GET {base}/metrics: {exc}") from None
