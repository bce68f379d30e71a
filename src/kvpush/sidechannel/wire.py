"""The side channel's wire format. Pure encoding and decoding: no sockets, no threads.

Request (one ZeroMQ frame, at most `SideChannelConfig.max_frame_bytes`):

    msgpack array  (b"get_meta_msg", rank)          -- no authentication
                   (b"get_meta_msg", rank, token)   -- token: str, the shared secret

The token travels in clear text: it keeps strangers and misconfigured peers from reading
a cache's addresses, it does not protect against someone who can read the network.

Reply (two frames):

    frame 1  msgpack array  [status, protocol_version, compat_hash, kvpush_version,
                             refusal, detail]
    frame 2  msgpack map    PeerMetadata (empty when status is "refused")

The client reads frame 1 first and checks the protocol version and the compatibility
hash before it decodes frame 2. Fields are only ever appended (old peers ignore them).

Control requests (optional; a server answers them only for the kinds its owner
registered, see `MetadataServer(control=...)`; any other kind stays a malformed request):

    msgpack array  (kind: bytes, body: any msgpack value[, token: str])

    reply  frame 1  the same header, compat_hash "" (a control reply carries no metadata)
           frame 2  msgpack: the handler's answer (empty when refused)

A handler refuses a body it cannot use by raising `RequestRejected`; the reply is then
refused with `Refusal.REJECTED` and the handler's message as the detail. The token is
checked exactly as for metadata, before the handler sees anything.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from kvpush.errors import MalformedReply, SideChannelError
from kvpush.geometry import PROTOCOL_VERSION, CacheGeometry, describe_compat_differences

GET_META_MSG = b"get_meta_msg"

REQUEST_FORM = '(b"get_meta_msg", rank: int >= 0[, token: str])'


class PeerMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """What one rank of an engine publishes on its side channel."""

    engine_id: str
    incarnation: str  # changes on every start of the process
    rank: int
    role: str  # "sender" | "receiver" | "both"
    agent_name: str  # transport agent name; "" when no agent
    agent_metadata: bytes  # what a peer's Transport.add_peer needs; b"" when no agent
    geometry: CacheGeometry
    kvpush_version: str
    # The key every data-plane message to this rank must begin with (random per
    # incarnation; see `kvpush.protocol.PushProtocol`). Served only to requests the
    # token admits, as the rest of the metadata. Empty: this rank checks none.
    message_key: bytes = b""
    # Append new fields with defaults only.


ROLES = ("sender", "receiver", "both")


class Refusal(enum.StrEnum):
    """Why a server answered without metadata. Travels on the wire: append only."""

    UNKNOWN_RANK = "unknown_rank"
    AUTH_REFUSED = "auth_refused"
    MALFORMED_REQUEST = "malformed_request"
    UNAVAILABLE = "unavailable"  # the server could not produce its metadata right now
    REJECTED = "rejected"  # a control request's handler refused its body (detail says why)


class ReplyHeader(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=False):
    status: str  # "ok" | "refused"
    protocol_version: int
    compat_hash: str  # "" when refused
    kvpush_version: str
    refusal: str = ""  # a Refusal value when refused
    detail: str = ""  # human-readable, for the refused peer's error message


class MalformedRequest(Exception):
    """A request that is not `REQUEST_FORM`; the message says what was wrong."""


def _decode_items(frame: bytes, form: str) -> tuple[Any, ...]:
    """The top-level array of a request. Anything the decoder raises is the sender's
    fault, not only `DecodeError`: a 1000-deep array raises `RecursionError`, a huge
    declared length may raise `MemoryError`. All of them become `MalformedRequest`."""
    try:
        return _request_decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise MalformedRequest(f"not a msgpack {form}: {exc}") from None
    except RecursionError:
        raise MalformedRequest(f"not a msgpack {form}: nested too deeply") from None
    except (MemoryError, ValueError, TypeError, OverflowError) as exc:
        raise MalformedRequest(f"not a msgpack {form}: {type(exc).__name__}") from None


_encoder = msgspec.msgpack.Encoder()
# Requests are at most max_frame_bytes, so decoding any msgpack in them is cheap and
# bounded; the element types are checked by hand to give a precise reason.
_request_decoder = msgspec.msgpack.Decoder(tuple[Any, ...])
_header_decoder = msgspec.msgpack.Decoder(ReplyHeader)
_metadata_decoder = msgspec.msgpack.Decoder(PeerMetadata)


def encode_request(rank: int, token: str | None = None) -> bytes:
    if token is None:
        return _encoder.encode((GET_META_MSG, rank))
    return _encoder.encode((GET_META_MSG, rank, token))


def decode_request(frame: bytes) -> tuple[int, str | None]:
    """(rank, token) of a request, or `MalformedRequest` saying what is wrong with it."""
    items = _decode_items(frame, REQUEST_FORM)
    if len(items) not in (2, 3):
        raise MalformedRequest(f"expected {REQUEST_FORM}, got an array of {len(items)}")
    if items[0] != GET_META_MSG:
        raise MalformedRequest(f"expected {REQUEST_FORM}, got a first element {_short(items[0])}")
    rank = items[1]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise MalformedRequest(f"expected {REQUEST_FORM}, got rank {_short(rank)}")
    token = items[2] if len(items) == 3 else None
    if token is not None and not isinstance(token, str):
        raise MalformedRequest(f"expected {REQUEST_FORM}, got a token of type bytes")
    return rank, token


def _short(value: object) -> str:
    try:
        text = repr(value)
    except RecursionError:
        return f"a deeply nested {type(value).__name__}"
    return text if len(text) <= 40 else text[:37] + "..."


def encode_ok(meta: PeerMetadata, kvpush_version: str) -> tuple[bytes, bytes]:
    header = ReplyHeader(
        status="ok",
        protocol_version=PROTOCOL_VERSION,
        compat_hash=meta.geometry.compat_hash(),
        kvpush_version=kvpush_version,
    )
    return _encoder.encode(header), _encoder.encode(meta)


def encode_refusal(refusal: Refusal, detail: str, kvpush_version: str) -> tuple[bytes, bytes]:
    header = ReplyHeader(
        status="refused",
        protocol_version=PROTOCOL_VERSION,
        compat_hash="",
        kvpush_version=kvpush_version,
        refusal=refusal.value,
        detail=detail,
    )
    return _encoder.encode(header), b""


def decode_header(frame: bytes) -> ReplyHeader:
    try:
        header = _header_decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise MalformedReply(f"reply header is not a side-channel header: {exc}") from None
    if header.status not in ("ok", "refused"):
        raise MalformedReply(f"reply header has unknown status {_short(header.status)}")
    return header


def decode_metadata(frame: bytes) -> PeerMetadata:
    try:
        return _metadata_decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise MalformedReply(f"reply payload is not valid peer metadata: {exc}") from None


def decode_geometry_leniently(frame: bytes) -> CacheGeometry | None:
    """Only the geometry of a payload, for explaining an incompatibility; None if unreadable."""

    class _GeometryOnly(msgspec.Struct, forbid_unknown_fields=False):
        geometry: CacheGeometry

    try:
        return msgspec.msgpack.decode(frame, type=_GeometryOnly).geometry
    except msgspec.DecodeError:
        return None


def describe_differences(theirs: CacheGeometry, ours: CacheGeometry) -> list[str]:
    """What differs between two geometries' compatibility fields, one phrase per field."""
    return describe_compat_differences(theirs.compat_fields(), ours.compat_fields())


# --------------------------------------------------------------------------- control requests

CONTROL_FORM = "(kind: bytes, body[, token: str])"


class RequestRejected(SideChannelError):
    """A control request's body was refused by its handler; the message says why.

    Raised by handlers on the server (the detail travels back) and by
    `kvpush.sidechannel.control_request` on the client."""


def encode_control_request(kind: bytes, body: object, token: str | None = None) -> bytes:
    if token is None:
        return _encoder.encode((kind, body))
    return _encoder.encode((kind, body, token))


def control_kind(frame: bytes) -> bytes | None:
    """The first element of a request when it is bytes other than `GET_META_MSG`, else None
    (so the metadata path keeps its own, precise diagnostics)."""
    try:
        items = _decode_items(frame, CONTROL_FORM)
    except MalformedRequest:
        return None
    if not items or not isinstance(items[0], bytes) or items[0] == GET_META_MSG:
        return None
    return items[0]


def decode_control_request(frame: bytes) -> tuple[bytes, Any, str | None]:
    """(kind, body, token), or `MalformedRequest` saying what is wrong."""
    items = _decode_items(frame, CONTROL_FORM)
    if len(items) not in (2, 3) or not isinstance(items[0], bytes):
        raise MalformedRequest(f"expected {CONTROL_FORM}, got an array of {len(items)}")
    token = items[2] if len(items) == 3 else None
    if token is not None and not isinstance(token, str):
        raise MalformedRequest(f"expected {CONTROL_FORM}, got a token of type bytes")
    return items[0], items[1], token


def encode_control_reply(body: object, kvpush_version: str) -> tuple[bytes, bytes]:
    header = ReplyHeader(
        status="ok",
        protocol_version=PROTOCOL_VERSION,
        compat_hash="",
        kvpush_version=kvpush_version,
    )
    return _encoder.encode(header), _encoder.encode(body)


def decode_control_reply(frame: bytes) -> Any:
    try:
        return msgspec.msgpack.decode(frame)
    except msgspec.DecodeError as exc:
        raise MalformedReply(f"control reply payload is not msgpack: {exc}") from None
