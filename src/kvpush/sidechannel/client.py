"""The side-channel client: fetch one rank's metadata, check it, never block past a deadline.

Each fetch uses its own DEALER socket and a socket monitor, so that a refused connection
(nothing listening) fails at once instead of waiting out the timeout while ZeroMQ retries
in the background, and a server that drops us (a frame over its size cap) is noticed too.
"""

from __future__ import annotations

import hmac
import socket
import time
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpush.errors import (
    AuthenticationRefused,
    IncompatiblePeer,
    MalformedReply,
    PeerUnreachable,
    SideChannelError,
    UnknownRank,
)
from kvpush.geometry import PROTOCOL_VERSION, CacheGeometry, differing_compat_fields
from kvpush.net import is_ipv6_literal, unbracket_host, zmq_address
from kvpush.roles import RUNTIME_ROLES
from kvpush.sidechannel.wire import (
    PeerMetadata,
    Refusal,
    ReplyHeader,
    RequestRejected,
    decode_control_reply,
    decode_geometry_leniently,
    decode_header,
    decode_metadata,
    describe_differences,
    encode_control_request,
    encode_request,
    new_nonce,
    reply_proof,
)

_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED


@dataclass(frozen=True, slots=True)
class FetchResult:
    metadata: PeerMetadata
    round_trip_s: float  # from connect to reply, as the caller saw it
    compat_hash: str
    peer_protocol_version: int
    peer_kvpush_version: str


def fetch_metadata(
    host: str,
    port: int,
    rank: int = 0,
    *,
    timeout_ms: int = 2000,
    token: str | None = None,
    expect_compat_hash: str | None = None,
    expect_geometry: CacheGeometry | None = None,
) -> PeerMetadata:
    """Fetch and check one rank's metadata from an engine's side channel.

    With `token`, the request proves we hold it and the answer is used only if it proves
    the server holds it too; the token itself is never sent (see `kvpush.sidechannel.wire`).

    Raises `PeerUnreachable` (refused, closed on us, or no answer within `timeout_ms`),
    `AuthenticationRefused` (they refused our proof, or gave none of their own),
    `IncompatiblePeer` (naming what differs), `UnknownRank` or `MalformedReply`.
    """
    return fetch_metadata_timed(
        host,
        port,
        rank,
        timeout_ms=timeout_ms,
        token=token,
        expect_compat_hash=expect_compat_hash,
        expect_geometry=expect_geometry,
    ).metadata


def fetch_metadata_timed(
    host: str,
    port: int,
    rank: int = 0,
    *,
    timeout_ms: int = 2000,
    token: str | None = None,
    expect_compat_hash: str | None = None,
    expect_geometry: CacheGeometry | None = None,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
) -> FetchResult:
    """`fetch_metadata`, also returning the round trip and what the header said."""
    if timeout_ms <= 0:
        raise SideChannelError(f"timeout_ms must be positive, got {timeout_ms}")
    if rank < 0:
        raise UnknownRank(f"rank must be >= 0, got {rank}")
    address = zmq_address(host, port)
    where = f"{address} rank {rank}"
    nonce = new_nonce()
    started = time.perf_counter()
    frames = _exchange(
        context,
        host,
        port,
        encode_request(rank, token, nonce),
        where=where,
        timeout_ms=timeout_ms,
    )
    round_trip = time.perf_counter() - started
    return _check_reply(
        _proven_frames(frames, token, nonce, where),
        where=where,
        rank=rank,
        round_trip=round_trip,
        expect_compat_hash=expect_compat_hash,
        expect_geometry=expect_geometry,
    )


def _exchange(
    context: zmq.Context[zmq.Socket[bytes]] | None,
    host: str,
    port: int,
    request: bytes,
    *,
    where: str,
    timeout_ms: int,
) -> list[bytes]:
    """One request on a fresh DEALER socket, and the reply's frames, by the deadline."""
    ctx = context if context is not None else zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    monitor: zmq.Socket[bytes] | None = None
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
        try:
            sock.connect(zmq_address(host, port))
        except zmq.ZMQError as exc:
            raise PeerUnreachable(f"{where}: cannot connect: {exc.strerror}") from None
        sock.send(request)
        return _await_reply(
            sock,
            host=unbracket_host(host),
            monitor=monitor,
            deadline=time.perf_counter() + timeout_ms / 1000,
            where=where,
            timeout_ms=timeout_ms,
        )
    finally:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
        sock.close(linger=0)


def control_request(
    host: str,
    port: int,
    kind: bytes,
    body: object,
    *,
    timeout_ms: int = 2000,
    token: str | None = None,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
) -> Any:
    """Send one control request (see `kvpush.sidechannel.wire`) and return the answer.

    The token is proven both ways, as for `fetch_metadata`.

    Raises `PeerUnreachable`, `AuthenticationRefused`, `RequestRejected` (the handler
    refused the body; the message says why), `MalformedReply` or `SideChannelError`.
    """
    if timeout_ms <= 0:
        raise SideChannelError(f"timeout_ms must be positive, got {timeout_ms}")
    address = zmq_address(host, port)
    where = f"{address} {kind.decode(errors='replace')}"
    nonce = new_nonce()
    frames = _exchange(
        context,
        host,
        port,
        encode_control_request(kind, body, token, nonce),
        where=where,
        timeout_ms=timeout_ms,
    )
    frames = _proven_frames(frames, token, nonce, where)
    if len(frames) != 2:
        raise MalformedReply(f"{where}: expected a reply of 2 frames, got {len(frames)}")
    try:
        header = decode_header(frames[0])
    except MalformedReply as exc:
        raise MalformedReply(f"{where}: {exc}") from None
    if header.status == "refused":
        if header.refusal == Refusal.REJECTED:
            raise RequestRejected(f"{where}: {header.detail}")
        _raise_refusal(header, where)
    try:
        return decode_control_reply(frames[1])
    except MalformedReply as exc:
        raise MalformedReply(f"{where}: {exc}") from None


def _proven_frames(frames: list[bytes], token: str | None, nonce: bytes, where: str) -> list[bytes]:
    """A reply's frames 1 and 2, once its frame 3 proved that the server holds `token`.

    Without a token there is nothing to prove. A refusal needs no proof: it is used only
    for its reason, and a forged one can do no more than the silence of a wrong address.
    An answer without a right proof is refused whole."""
    if token is None or len(frames) < 2:
        return frames
    try:
        refused = decode_header(frames[0]).status == "refused"
    except MalformedReply:
        return frames  # reported as malformed by the caller
    if refused:
        return frames[:2]
    if len(frames) != 3:
        raise AuthenticationRefused(
            f"{where}: the side channel answered without proving that it holds the shared "
            "token: it has none configured, or it is not the peer it claims to be; nothing "
            "it sent is used"
        )
    if not hmac.compare_digest(frames[2], reply_proof(token, nonce, frames[0], frames[1])):
        raise AuthenticationRefused(
            f"{where}: the side channel's proof of the shared token is wrong: it holds "
            "another token, or it is not the peer it claims to be; nothing it sent is used"
        )
    return frames[:2]


def _why_not_connected(host: str) -> str:
    """ZeroMQ reports a name it cannot resolve like a refused connection: tell them apart."""
    if not is_ipv6_literal(host):
        try:
            socket.inet_aton(host)
        except OSError:
            try:
                socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                return f"cannot resolve host {host!r}: {exc.strerror}"
    return "connection refused (is the endpoint running?)"


def _await_reply(
    sock: zmq.Socket[bytes],
    *,
    host: str,
    monitor: zmq.Socket[bytes],
    deadline: float,
    where: str,
    timeout_ms: int,
) -> list[bytes]:
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    connected = False
    while True:
        left_ms = int((deadline - time.perf_counter()) * 1000)
        if left_ms <= 0:
            state = "connected, but" if connected else "could not connect and"
            raise PeerUnreachable(f"{where}: {state} no answer within {timeout_ms} ms")
        ready = dict(poller.poll(left_ms))
        if sock in ready:
            return sock.recv_multipart()
        if monitor in ready:
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                connected = True
            elif event == zmq.EVENT_CONNECT_RETRIED and not connected:
                raise PeerUnreachable(f"{where}: {_why_not_connected(host)}")
            elif event == zmq.EVENT_DISCONNECTED:
                if connected:
                    raise PeerUnreachable(
                        f"{where}: the peer closed the connection before answering"
                    )
                raise PeerUnreachable(f"{where}: could not connect (no route to the host?)")


def _check_reply(
    frames: list[bytes],
    *,
    where: str,
    rank: int,
    round_trip: float,
    expect_compat_hash: str | None,
    expect_geometry: CacheGeometry | None,
) -> FetchResult:
    if len(frames) != 2:
        raise MalformedReply(f"{where}: expected a reply of 2 frames, got {len(frames)}")
    try:
        header = decode_header(frames[0])
    except MalformedReply as exc:
        raise MalformedReply(f"{where}: {exc}") from None
    if header.status == "refused":
        _raise_refusal(header, where)
    if header.protocol_version != PROTOCOL_VERSION:
        raise IncompatiblePeer(
            f"{where}: protocol version differs: theirs {header.protocol_version} "
            f"(kvpush {header.kvpush_version}), ours {PROTOCOL_VERSION}"
        )
    expected = expect_compat_hash
    if expected is None and expect_geometry is not None:
        expected = expect_geometry.compat_hash()
    if (
        expected is not None
        and header.compat_hash != expected
        and not _one_stage_compatible(frames[1], expect_geometry)
    ):
        raise IncompatiblePeer(
            _incompatibility(header, frames[1], where, expected, expect_geometry)
        )
    try:
        meta = decode_metadata(frames[1])
    except MalformedReply as exc:
        raise MalformedReply(f"{where}: {exc}") from None
    if meta.geometry.compat_hash() != header.compat_hash:
        raise MalformedReply(
            f"{where}: the header's compat hash {header.compat_hash} does not match the "
            f"payload's geometry ({meta.geometry.compat_hash()})"
        )
    if meta.rank != rank:
        raise MalformedReply(f"{where}: asked for rank {rank}, the reply is for rank {meta.rank}")
    if meta.role not in RUNTIME_ROLES:
        raise MalformedReply(
            f"{where}: unknown role {meta.role!r}: expected one of {RUNTIME_ROLES}"
        )
    return FetchResult(
        metadata=meta,
        round_trip_s=round_trip,
        compat_hash=header.compat_hash,
        peer_protocol_version=header.protocol_version,
        peer_kvpush_version=header.kvpush_version,
    )


def _raise_refusal(header: ReplyHeader, where: str) -> None:
    message = f"{where}: {header.detail or header.refusal}"
    if header.protocol_version != PROTOCOL_VERSION and header.refusal in (
        Refusal.MALFORMED_REQUEST,
        Refusal.AUTH_REFUSED,
    ):
        raise IncompatiblePeer(
            f"{where}: protocol version differs: theirs {header.protocol_version} "
            f"(kvpush {header.kvpush_version}), ours {PROTOCOL_VERSION}; they refused our "
            f"request: {header.detail or header.refusal}"
        )
    if header.refusal == Refusal.AUTH_REFUSED:
        raise AuthenticationRefused(message)
    if header.refusal == Refusal.UNKNOWN_RANK:
        raise UnknownRank(message)
    if header.refusal == Refusal.MALFORMED_REQUEST:
        raise SideChannelError(f"{where}: the peer could not read our request: {header.detail}")
    raise SideChannelError(f"{where}: refused ({header.refusal}): {header.detail}")


def _one_stage_compatible(payload: bytes, ours: CacheGeometry | None) -> bool:
    """Whether a peer whose hash differs from ours is compatible all the same: a hash
    cannot say that a pipeline stage's regions are a subset of a whole model's, so
    where exactly one side is a stage, the fields themselves are compared
    (`differing_compat_fields`), as the runtime compares them on every handshake."""
    if ours is None:
        return False
    theirs = decode_geometry_leniently(payload)
    if theirs is None or (theirs.stage is None) == (ours.stage is None):
        return False
    return not differing_compat_fields(theirs.compat_fields(), ours.compat_fields())


def _incompatibility(
    header: ReplyHeader,
    payload: bytes,
    where: str,
    expected: str,
    ours: CacheGeometry | None,
) -> str:
    head = f"{where}: compatibility hash differs: theirs {header.compat_hash}, ours {expected}"
    # Their geometry is read only to explain the refusal; none of their metadata is used.
    theirs = decode_geometry_leniently(payload)
    if theirs is None:
        return head
    if ours is None:
        return (
            f"{head}; theirs is layout {theirs.layout}, dtype {theirs.dtype}, block size "
            f"{theirs.block_size_tokens} tokens, {len(theirs.regions)} regions, mode {theirs.mode}"
        )
    differences = describe_differences(theirs, ours)
    return f"{head}; differs in {'; '.join(differences) or 'nothing we can name'}"
