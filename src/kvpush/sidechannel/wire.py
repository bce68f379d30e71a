"""The side channel's wire format. Pure encoding and decoding: no sockets, no threads.

Request (one ZeroMQ frame, at most `SideChannelConfig.max_frame_bytes`):

    msgpack array  (b"get_meta_msg", rank)                -- no authentication
                   (b"get_meta_msg", rank, nonce, proof)  -- with the shared token

Reply (two frames, three when the request carried a proof and this server has a token):

    frame 1  msgpack array  [status, protocol_version, compat_hash, kvpush_version,
                             refusal, detail]
    frame 2  msgpack map    PeerMetadata (empty when status is "refused")
    frame 3  32 bytes       the server's proof (see below)

The client reads frame 1 first and checks the protocol version and the compatibility
hash before it decodes frame 2. Fields are only ever appended (old peers ignore them).

The token never travels. Each side proves it holds it, in the one round trip:

- the client picks a random `nonce` (16 bytes) and sends `proof` = HMAC-SHA256(token,
  "kvpush side-channel request" || the request frame with its proof field zeroed), so the
  proof covers the kind, the rank or body and the nonce, byte for byte;
- the server answers only a proof made with its own token, and appends frame 3 =
  HMAC-SHA256(token, "kvpush side-channel reply" || nonce || len(frame 1) || frame 1 ||
  frame 2), which binds its answer to this request;
- a client that has a token uses an answer only with a right frame 3. A side channel
  that does not hold the token (an impostor whose address a forged data-plane message
  named, or a peer configured without it) is refused, and learns nothing it could reuse.

What this does not give: secrecy. Metadata, message keys and control bodies travel in
clear, so someone who can read the network learns them, and can replay a request it saw.
Peers of protocol 3 and older sent the token itself (a str third element); such a
request is refused, saying so.

Control requests (optional; a server answers them only for the kinds its owner
registered, see `MetadataServer(control=...)`; any other kind stays a malformed request):

    msgpack array  (kind: bytes, body: any msgpack value[, nonce, proof])

    reply  frame 1  the same header, compat_hash "" (a control reply carries no metadata)
           frame 2  msgpack: the handler's answer (empty when refused)
           frame 3  the server's proof, as above

A handler refuses a body it cannot use by raising `RequestRejected`; the reply is then
refused with `Refusal.REJECTED` and the handler's message as the detail. The token is
checked exactly as for metadata, before the handler sees anything. Refusals carry no
proof: they carry nothing a client uses but their reason.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
from typing import Any, NamedTuple

import msgspec

from kvpush.errors import MalformedReply, SideChannelError
from kvpush.geometry import (
    PROTOCOL_VERSION,
    CacheGeometry,
    ScratchRegion,
    describe_compat_differences,
)

GET_META_MSG = b"get_meta_msg"

REQUEST_FORM = '(b"get_meta_msg", rank: int >= 0[, nonce: bytes, proof: bytes])'

NONCE_BYTES = 16
PROOF_BYTES = 32  # HMAC-SHA256
_REQUEST_LABEL = b"kvpush side-channel request\0"
_REPLY_LABEL = b"kvpush side-channel reply\0"
_LEGACY_TOKEN = (
    "a token in clear text (kvpush protocol 3 and older); this side channel takes only "
    "a proof of it (protocol 4): upgrade that peer"
)


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
    # A buffer beside the KV cache, never a KV block, that peers may test-write into (a
    # service of the rank offered it: `kvpush.runtime.services`); None: the rank has none.
    scratch: ScratchRegion | None = None
    # Where the service that test-writes into `scratch` is served, when not on this side
    # channel: the port of a side channel of the rank's own on the same host, behind the
    # same token (a vLLM worker's: its engine's side channel is served by another
    # process). None: on this side channel.
    probe_port: int | None = None
    # Append new fields with defaults only.


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


class Signature(NamedTuple):
    """A request's proof that its sender holds the token (see the module docstring)."""

    nonce: bytes
    proof: bytes
    signed: bytes  # the request frame with its proof zeroed: what `proof` is a MAC of

    def made_with(self, token: str) -> bool:
        return hmac.compare_digest(self.proof, _mac(token, _REQUEST_LABEL, self.signed))


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _mac(token: str, label: bytes, data: bytes) -> bytes:
    return hmac.new(token.encode(), label + data, hashlib.sha256).digest()


def _encode_signed(items: tuple[Any, ...], token: str | None, nonce: bytes) -> bytes:
    if token is None:
        return _encoder.encode(items)
    blank = _encoder.encode((*items, nonce, bytes(PROOF_BYTES)))
    # The proof is the frame's last element, so its bytes are the frame's last bytes.
    return blank[:-PROOF_BYTES] + _mac(token, _REQUEST_LABEL, blank)


def _signature(frame: bytes, extra: tuple[Any, ...], form: str) -> Signature | None:
    """The signature in the elements after a request's own (`extra`), or None if none."""
    if not extra:
        return None
    if len(extra) == 1 and isinstance(extra[0], str):
        raise MalformedRequest(f"expected {form}, got {_LEGACY_TOKEN}")
    if len(extra) != 2:
        raise MalformedRequest(
            f"expected {form}, got {len(extra)} extra element(s) where a nonce and a proof go"
        )
    nonce, proof = extra
    if not isinstance(nonce, bytes) or not NONCE_BYTES <= len(nonce) <= 64:
        raise MalformedRequest(f"expected {form}, got a nonce that is not 16-64 bytes")
    if not isinstance(proof, bytes) or len(proof) != PROOF_BYTES or not frame.endswith(proof):
        raise MalformedRequest(f"expected {form}, got a proof that is not {PROOF_BYTES} bytes")
    return Signature(nonce, proof, frame[:-PROOF_BYTES] + bytes(PROOF_BYTES))


def reply_proof(token: str, nonce: bytes, header: bytes, payload: bytes) -> bytes:
    """Frame 3 of a reply to a request that carried `nonce` (see the module docstring)."""
    size = len(header).to_bytes(4, "big")
    return _mac(token, _REPLY_LABEL, nonce + size + header + payload)


def encode_request(rank: int, token: str | None = None, nonce: bytes = b"") -> bytes:
    """A metadata request; with `token`, signed over `nonce` (from `new_nonce()`)."""
    return _encode_signed((GET_META_MSG, rank), token, nonce)


def decode_request(frame: bytes) -> tuple[int, Signature | None]:
    """(rank, signature) of a request, or `MalformedRequest` saying what is wrong with it."""
    items = _decode_items(frame, REQUEST_FORM)
    if len(items) < 2:
        raise MalformedRequest(f"expected {REQUEST_FORM}, got an array of {len(items)}")
    if items[0] != GET_META_MSG:
        raise MalformedRequest(f"expected {REQUEST_FORM}, got a first element {_short(items[0])}")
    rank = items[1]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise MalformedRequest(f"expected {REQUEST_FORM}, got rank {_short(rank)}")
    return rank, _signature(frame, items[2:], REQUEST_FORM)


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

CONTROL_FORM = "(kind: bytes, body[, nonce: bytes, proof: bytes])"


class RequestRejected(SideChannelError):
    """A control request's body was refused by its handler; the message says why.

    Raised by handlers on the server (the detail travels back) and by
    `kvpush.sidechannel.control_request` on the client."""


def encode_control_request(
    kind: bytes, body: object, token: str | None = None, nonce: bytes = b""
) -> bytes:
    return _encode_signed((kind, body), token, nonce)


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


def decode_control_request(frame: bytes) -> tuple[bytes, Any, Signature | None]:
    """(kind, body, signature), or `MalformedRequest` saying what is wrong."""
    items = _decode_items(frame, CONTROL_FORM)
    if len(items) < 2 or not isinstance(items[0], bytes):
        raise MalformedRequest(f"expected {CONTROL_FORM}, got an array of {len(items)}")
    return items[0], items[1], _signature(frame, items[2:], CONTROL_FORM)


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
