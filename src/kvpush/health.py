"""The `/health` contract: what a kvpush server and a kvpush proxy say of themselves.

One frozen msgspec struct per answer, built by whoever answers (`kvpush.serving.server`
and its prefill/decode role, `kvpush.serving.proxy`) and read by field by whoever asks
(the proxy, the operators' diagnostics), never by key string. One decoder each
(`decode_server_health`, `decode_proxy_health`), and one error: `MalformedHealth`, whose
message says which field was wrong and what was expected.

The JSON (`encode`): a server's top-level field that is None is left out, so a server
says only what it knows (the role's fields only on a prefill or decode server, the
runtime's failure only when there is one); the nested figures always carry every key.
Unknown fields are ignored on reading, and new fields get defaults and go last, so a
newer server's answer reads in an older reader. The figures (`transfers`,
`cpu`, `side_channel_requests`) are read for what they are worth: one of the wrong type
reads as not known, and its reader says it does not know; a wrong identity (`status`,
`role`, the side channel's address, `healthy`, ...) is `MalformedHealth`.

Servers that are not kvpush's answer differently: vLLM's `/health` is 200 with an empty
body, which `decode_server_health` reads as None (not a kvpush answer, nothing known).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvpush.errors import KVPushError

__all__ = [
    "BackendHealth",
    "ClockBound",
    "CpuReading",
    "MalformedHealth",
    "ProxyHealth",
    "ServerHealth",
    "SideChannelRequests",
    "TransferFigures",
    "decode_proxy_health",
    "decode_server_health",
    "encode",
]

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Count = Annotated[int, msgspec.Meta(ge=0)]


class MalformedHealth(KVPushError, ValueError):
    """A `/health` answer that is JSON but not of the contract; the message says what."""


class ClockBound(msgspec.Struct, frozen=True):
    """What a sender's leases measured of one receiver's clock (`clock_bounds`)."""

    round_trip_s: float
    skew_lb_s: float
    age_s: float


class TransferFigures(msgspec.Struct, frozen=True):
    """The runtime's transfer figures (`RuntimeStatistics`), as `/health` shows them."""

    in_flight: Count = 0
    oldest_in_flight_s: float | None = None
    sending: dict[str, Count] = {}  # transfers by sender state
    receiving: dict[str, Count] = {}  # transfers by receiver state
    writes_in_flight: Count = 0
    handshakes_in_flight: Count = 0
    blocks_held_sending: Count = 0
    blocks_held_receiving: Count = 0
    claimed: Count = 0  # queued requests whose senders our heartbeats claim them from
    finished: Count = 0
    failed: Count = 0
    failures: dict[str, Count] = {}  # by failure reason
    peers: Count = 0
    forged_messages: dict[str, Count] = {}  # data-plane messages dropped unread, by reason
    malformed_messages: Count = 0
    clock_bounds: dict[str, ClockBound] = {}  # by receiver agent name


class CpuReading(msgspec.Struct, frozen=True):
    """CPU seconds so far, on the server's monotonic clock `at_s`: two readings a moment
    apart are the server's CPU share (whether an idle server is busy)."""

    at_s: float
    process_s: float
    runtime_thread_s: float | None = None


class SideChannelRequests(msgspec.Struct, frozen=True):
    """The side channel's request counts (`kvpush.sidechannel.SideChannelStats`)."""

    served: Count = 0
    refused_auth: Count = 0
    refused_unknown_rank: Count = 0
    malformed: Count = 0
    dropped: Count = 0
    unavailable: Count = 0
    control_served: Count = 0
    control_rejected: Count = 0
    internal_errors: Count = 0
    healthy: bool = True


class ServerHealth(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A `kvpush serve` server's `/health`. `status` is "ok" (HTTP 200), "unhealthy" or
    "stopped" (503); `role` is "prefill", "decode" or "both". The fields after them are a
    prefill or decode server's: its engine, its side channel as peers reach it, whether
    the side channel and the runtime serve (`healthy`: both do) and why not, the
    deadlines in force, and the figures diagnostics read."""

    status: str | None = None
    role: str | None = None
    engine_id: str | None = None
    side_channel_host: str | None = None
    side_channel_port: Port | None = None
    side_channel: str | None = None  # "ok" | "down"
    runtime: str | None = None  # "ok" | "down"
    healthy: bool | None = None
    runtime_failure: str | None = None
    side_channel_failure: str | None = None
    side_channel_internal_errors: Count | None = None
    transfer_deadline_s: float | None = None
    queue_timeout_s: float | None = None  # a decode server's
    liveness_timeout_s: float | None = None  # a peer silent this long is declared gone
    transfers: TransferFigures | None = None  # while its runtime serves
    cpu: CpuReading | None = None
    side_channel_requests: SideChannelRequests | None = None

    @property
    def side_channel_address(self) -> tuple[str, int] | None:
        """Where its side channel is, as peers reach it; None where it does not say
        (a server that is not kvpush's)."""
        if self.side_channel_host is None or self.side_channel_port is None:
            return None
        return self.side_channel_host, self.side_channel_port


class BackendHealth(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One backend in the proxy's `/health`: "ok", "unhealthy" (with the HTTP status it
    answered) or "unreachable" (with why)."""

    url: str
    status: str
    http_status: int | None = None
    detail: str | None = None


class ProxyHealth(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A `kvpush proxy`'s `/health`: "ok" while a prefill and a decode backend are."""

    status: str
    role: str  # "proxy"
    prefill: tuple[BackendHealth, ...]
    decode: tuple[BackendHealth, ...]


_SERVER_EXPECTED = (
    "a JSON object with a kvpush server's /health fields (status, role, side_channel_host, "
    "side_channel_port, ...)"
)
_PROXY_EXPECTED = (
    "a JSON object with a kvpush proxy's /health fields (status, role, and prefill and "
    "decode: lists of {url, status})"
)
_proxy_decoder = msgspec.json.Decoder(ProxyHealth)
_encoder = msgspec.json.Encoder()
_FIGURES: tuple[tuple[str, type[msgspec.Struct]], ...] = (
    ("transfers", TransferFigures),
    ("cpu", CpuReading),
    ("side_channel_requests", SideChannelRequests),
)


def encode(health: ServerHealth | ProxyHealth) -> bytes:
    return _encoder.encode(health)


def _fits(value: object, kind: type[msgspec.Struct]) -> bool:
    try:
        msgspec.convert(value, kind)
    except msgspec.ValidationError:
        return False
    return True


def _known_figures(body: dict[str, object]) -> dict[str, object]:
    """`body` less the figures that are not of their type (each clock bound, then each
    figure as a whole): what a server says of its figures is read for what it is worth,
    and one of the wrong type is not known rather than a reason to read nothing."""
    out = dict(body)
    transfers = out.get("transfers")
    if isinstance(transfers, dict) and isinstance(transfers.get("clock_bounds"), dict):
        bounds = transfers["clock_bounds"]
        known = {agent: b for agent, b in bounds.items() if _fits(b, ClockBound)}
        out["transfers"] = {**transfers, "clock_bounds": known}
    for key, kind in _FIGURES:
        if out.get(key) is not None and not _fits(out[key], kind):
            del out[key]
    return out


def decode_server_health(body: bytes | str, source: str = "/health") -> ServerHealth | None:
    """A server's `/health` body; None for one that is not a JSON object (vLLM's is
    empty): not a kvpush server, nothing known. A figure of the wrong type (`transfers`,
    one of its clock bounds, `cpu`, `side_channel_requests`) reads as not known; any
    other field of the wrong type raises `MalformedHealth`, naming `source`, the field
    and what was expected."""
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    try:
        return msgspec.convert(_known_figures(obj), ServerHealth)
    except msgspec.ValidationError as exc:
        raise MalformedHealth(f"{source}: {exc}; expected {_SERVER_EXPECTED}") from None


def decode_proxy_health(body: bytes | str, source: str = "/health") -> ProxyHealth:
    """A proxy's `/health` body. Raises `MalformedHealth`, naming `source`, for anything
    else (not JSON, or not of the contract), saying what was wrong."""
    try:
        return _proxy_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise MalformedHealth(f"{source}: {exc}; expected {_PROXY_EXPECTED}") from None
    except msgspec.DecodeError as exc:
        raise MalformedHealth(f"{source}: not JSON ({exc}); expected {_PROXY_EXPECTED}") from None
