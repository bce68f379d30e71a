"""The metadata server: one ZeroMQ ROUTER per engine, answering every rank by rank.

Theory of operation. `start()` binds the ROUTER in the caller's thread (so a bad address
or a port in use raises there, at once) and hands it to one server thread, which owns it
from then on. The thread waits on the ROUTER and on an inproc wake-up socket, never on a
timer, so an idle server costs nothing and `close()` takes effect at once. Each request
is answered, refused with a reason, or dropped; nothing a client sends can stop the loop:
any exception raised while decoding or answering one request (a `RecursionError` from a
deeply nested array included) is contained there, counted as `internal_errors`, and
answered as UNAVAILABLE when a reply can still be built. Should the thread itself ever
stop on its own, `healthy` turns false and `failure` says why, so an owner's health check
shows it; `close()` never waits on a thread that is gone.

A host that is a name is resolved here and every address it names is bound (ZeroMQ binds
only interfaces and addresses); `::1` and other IPv6 literals need the socket's IPV6
option, which is always on (an IPv4 address still binds IPv4 only).

Control requests: the server's owner may register handlers for other request kinds
(`control={b"kind": handler}`, see `kvpush.sidechannel.wire`). They run on the server
thread, after the token's proof is checked, and must be quick and thread-safe: a handler
answers with a msgpack-able value or refuses with `RequestRejected`; any other exception
is refused as UNAVAILABLE and logged, and the server keeps serving. The server knows
nothing of what a kind means: `kvpush endpoint` is where the bench's kinds live.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import zmq

from kvpush import __version__
from kvpush.config import SideChannelConfig
from kvpush.errors import ClosedError, ConfigError, SideChannelError
from kvpush.net import bracket_host, check_port, unbracket_host, zmq_address
from kvpush.sidechannel.wire import (
    MalformedRequest,
    PeerMetadata,
    Refusal,
    RequestRejected,
    Signature,
    control_kind,
    decode_control_request,
    decode_request,
    encode_control_reply,
    encode_ok,
    encode_refusal,
    reply_proof,
)

log = logging.getLogger(__name__)

RankSource = Mapping[int, PeerMetadata] | Callable[[], Mapping[int, PeerMetadata]]
ControlHandler = Callable[[Any], object]

_JOIN_TIMEOUT_S = 5.0
_server_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class SideChannelStats:
    """A snapshot of what a server has done since it started."""

    served: int = 0  # metadata replies sent
    refused_auth: int = 0  # refusals: no proof of the token, or a wrong one
    refused_unknown_rank: int = 0  # refusals: no such rank
    malformed: int = 0  # refusals: a request not of the wire's form (a token in clear too)
    dropped: int = 0  # not answered at all: wrong framing, over the size cap
    unavailable: int = 0  # refusals: the rank source raised
    control_served: int = 0  # control requests answered by their handler
    control_rejected: int = 0  # control requests refused (auth, malformed, handler refused)
    internal_errors: int = 0  # requests whose handling raised: answered UNAVAILABLE or dropped
    healthy: bool = True  # False once the server thread has stopped on its own

    @property
    def refused(self) -> int:
        return self.refused_auth + self.refused_unknown_rank + self.malformed + self.unavailable


class MetadataServer:
    """Serves `PeerMetadata` by rank on one port. Use `start()`/`close()` or `with`.

    `ranks` is a mapping, or a callable returning one, called for every request (so an
    engine can add ranks as they come up). `control` maps extra request kinds to their
    handlers (see the module docstring); without it only metadata requests are answered.
    """

    def __init__(
        self,
        host: str,
        port: int,
        config: SideChannelConfig,
        ranks: RankSource,
        *,
        control: Mapping[bytes, ControlHandler] | None = None,
    ) -> None:
        self._control = dict(control or {})
        self._host = unbracket_host(host)
        self._requested_port = check_port(port)
        self._config = config
        self._ranks = ranks
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._wake: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None
        self._endpoints: list[str] = []
        self._closed = False
        self._stats_lock = threading.Lock()
        self._counts = {
            f.name: 0 for f in dataclasses.fields(SideChannelStats) if f.type in ("int", int)
        }
        self._failure: BaseException | None = None
        # rank -> (metadata object, encoded reply): encoding is skipped while it is unchanged
        self._cache: dict[int, tuple[PeerMetadata, tuple[bytes, bytes]]] = {}

    # --- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        if self._closed:
            raise ClosedError("this MetadataServer was closed; create a new one")
        if self._thread is not None:
            raise SideChannelError("MetadataServer.start() called twice")
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.IPV6, 1)
        # Larger frames make ZeroMQ drop the connection before we see a byte of them.
        router.setsockopt(zmq.MAXMSGSIZE, self._config.max_frame_bytes)
        # A client that never reads its replies must not make us queue without bound:
        # past this, ROUTER drops replies to that client.
        router.setsockopt(zmq.SNDHWM, 1000)
        try:
            self._bind(router)
        except BaseException:
            router.close(linger=0)
            context.term()
            raise
        wake_addr = f"inproc://kvpush-sidechannel-wake-{next(_server_ids)}"
        wake_recv = context.socket(zmq.PAIR)
        wake_recv.bind(wake_addr)
        wake_send = context.socket(zmq.PAIR)
        wake_send.setsockopt(zmq.LINGER, 0)
        wake_send.connect(wake_addr)
        self._context, self._wake = context, wake_send
        self._thread = threading.Thread(
            target=self._serve,
            args=(router, wake_recv),
            name=f"kvpush-sidechannel-{self._port}",
            daemon=True,
        )
        self._thread.start()
        log.info("side channel serving on %s", ", ".join(self._endpoints))

    def close(self) -> None:
        """Stop serving and release the port. Idempotent; never blocks for long.

        Joins the thread (at most a few seconds). A thread that stopped on its own is not
        an error here: its `failure` was shown by `healthy` while it was gone."""
        if self._closed:
            return
        self._closed = True
        thread, wake, context = self._thread, self._wake, self._context
        if thread is not None and wake is not None:
            if thread.is_alive():
                # NOBLOCK: a PAIR whose peer is gone would block a plain send forever.
                with contextlib.suppress(zmq.ZMQError):
                    wake.send(b"stop", zmq.NOBLOCK)
                thread.join(_JOIN_TIMEOUT_S)
                if thread.is_alive():
                    log.error("side channel thread did not stop within %.0f s", _JOIN_TIMEOUT_S)
            wake.close(linger=0)
        if context is not None and (thread is None or not thread.is_alive()):
            context.term()

    def __enter__(self) -> MetadataServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- what it shows ---------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound port (the one picked when constructed with port 0)."""
        if self._port is None:
            raise SideChannelError("the side channel is not started: no port is bound yet")
        return self._port

    @property
    def endpoints(self) -> list[str]:
        """The ZeroMQ addresses bound, one per address the host names."""
        return list(self._endpoints)

    @property
    def healthy(self) -> bool:
        """True while started and serving; False before start, after close, or when the
        server thread stopped on its own (then `failure` says why)."""
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._closed

    @property
    def failure(self) -> str | None:
        """Why the server thread stopped on its own; None if it did not."""
        failure = self._failure
        return None if failure is None else f"{type(failure).__name__}: {failure}"

    def statistics(self) -> SideChannelStats:
        with self._stats_lock:
            counts = dict(self._counts)
        return SideChannelStats(**counts, healthy=self._failure is None)

    # --- inside ---------------------------------------------------------------------

    def _bind(self, router: zmq.Socket[bytes]) -> None:
        addresses = _bind_addresses(self._host)
        port = self._requested_port
        for address in addresses:
            endpoint = zmq_address(address, port) if port else _any_port(address)
            try:
                router.bind(endpoint)
            except zmq.ZMQError as exc:
                raise SideChannelError(
                    f"cannot serve the side channel on {endpoint}: {exc.strerror}"
                ) from None
            bound = router.getsockopt(zmq.LAST_ENDPOINT)
            assert isinstance(bound, bytes)
            port = int(bound.decode().rsplit(":", 1)[1])
            self._endpoints.append(zmq_address(address, port))
        self._port = port

    def _count(self, field: str) -> None:
        with self._stats_lock:
            self._counts[field] += 1

    def _serve(self, router: zmq.Socket[bytes], wake: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if wake in ready:
                    return
                # Drain what is queued before polling again: cheaper under load.
                for _ in range(256):
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    self._handle(router, frames)
        except BaseException as exc:
            # Not a client's fault (each request's errors stay in _handle): a bug or the
            # process going down. Serving stops; `healthy` and `failure` show it.
            log.exception("side channel thread stopped by an unexpected error")
            self._failure = exc
        finally:
            router.close(linger=0)
            wake.close(linger=0)

    def _handle(self, router: zmq.Socket[bytes], frames: list[bytes]) -> None:
        # ROUTER prepends the client's identity: [identity, request]; DEALER and REQ-less
        # clients send exactly one frame. REQ clients add an empty delimiter: accept it.
        if len(frames) == 3 and frames[1] == b"":
            identity, delimiter, body = frames[0], [b""], frames[2]
        elif len(frames) == 2:
            identity, delimiter, body = frames[0], [], frames[1]
        else:
            self._count("dropped")
            return
        if len(body) > self._config.max_frame_bytes:
            self._count("dropped")
            return
        try:
            reply = self._reply_to(body)
        except Exception as exc:
            # One request's failure is contained here, whatever it is: it is counted and
            # answered, and the loop serves the next one.
            log.warning("side channel request not handled: %s", _describe(exc))
            self._count("internal_errors")
            try:
                reply = encode_refusal(
                    Refusal.UNAVAILABLE,
                    f"the server could not handle this request ({type(exc).__name__})",
                    __version__,
                )
            except Exception:
                return
        try:
            router.send_multipart([identity, *delimiter, *reply], zmq.NOBLOCK)
        except zmq.Again:
            self._count("dropped")
        except zmq.ZMQError as exc:
            log.debug("side channel reply not sent: %s", exc)

    def _reply_to(self, body: bytes) -> tuple[bytes, ...]:
        if self._control and control_kind(body) in self._control:
            return self._control_reply(body)
        try:
            rank, signature = decode_request(body)
        except MalformedRequest as exc:
            self._count("malformed")
            return encode_refusal(Refusal.MALFORMED_REQUEST, str(exc), __version__)
        refusal = self._auth_refusal(signature)
        if refusal is not None:
            self._count("refused_auth")
            return refusal
        try:
            ranks = self._ranks() if callable(self._ranks) else self._ranks
            meta = ranks.get(rank)
            served = sorted(ranks)
        except Exception as exc:
            log.exception("side channel rank source failed")
            self._count("unavailable")
            return encode_refusal(
                Refusal.UNAVAILABLE, f"metadata not available: {exc}", __version__
            )
        if meta is None:
            self._count("refused_unknown_rank")
            return encode_refusal(
                Refusal.UNKNOWN_RANK,
                f"no rank {rank} here: this engine serves ranks {_ranks_text(served)}",
                __version__,
            )
        cached = self._cache.get(rank)
        if cached is None or cached[0] is not meta:
            cached = (meta, encode_ok(meta, __version__))
            self._cache[rank] = cached
        self._count("served")
        return self._proven(signature, cached[1])

    def _auth_refusal(self, signature: Signature | None) -> tuple[bytes, bytes] | None:
        token = self._config.token
        if token is None or (signature is not None and signature.made_with(token)):
            return None
        # "wrong token": the request's proof was made with another one (or with none).
        problem = "no token given" if signature is None else "wrong token"
        return encode_refusal(
            Refusal.AUTH_REFUSED,
            f"{problem}: this side channel needs the shared token (--token-file or KVPUSH_TOKEN)",
            __version__,
        )

    def _proven(self, signature: Signature | None, reply: tuple[bytes, bytes]) -> tuple[bytes, ...]:
        """`reply`, with our proof of the token when the request proved it too."""
        token = self._config.token
        if token is None or signature is None:
            return reply
        return (*reply, reply_proof(token, signature.nonce, *reply))

    def _control_reply(self, frame: bytes) -> tuple[bytes, ...]:
        try:
            kind, body, signature = decode_control_request(frame)
        except MalformedRequest as exc:
            self._count("control_rejected")
            return encode_refusal(Refusal.MALFORMED_REQUEST, str(exc), __version__)
        refusal = self._auth_refusal(signature)
        if refusal is not None:
            self._count("control_rejected")
            return refusal
        try:
            answer = self._control[kind](body)
            reply = encode_control_reply(answer, __version__)
        except RequestRejected as exc:
            self._count("control_rejected")
            return encode_refusal(Refusal.REJECTED, str(exc), __version__)
        except Exception as exc:
            log.exception("side channel control handler for %r failed", kind)
            self._count("control_rejected")
            return encode_refusal(
                Refusal.UNAVAILABLE, f"{kind.decode(errors='replace')} failed: {exc}", __version__
            )
        self._count("control_served")
        return self._proven(signature, reply)


def _describe(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"[:300]
    except Exception:
        return type(exc).__name__


def _ranks_text(ranks: list[int]) -> str:
    if not ranks:
        return "none (yet)"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}..{ranks[-1]}"
    return ", ".join(str(r) for r in ranks)


def _any_port(address: str) -> str:
    return f"tcp://{bracket_host(address)}:*"


def _bind_addresses(host: str) -> list[str]:
    """The addresses to bind for `host`: itself when a literal or `*`, else what it names."""
    if host in ("*", "0.0.0.0", "::"):
        return [host]
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        return [host]
    except OSError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot resolve side-channel host {host!r}: {exc.strerror}") from None
    addresses: list[str] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        address = str(sockaddr[0])
        if address not in addresses:
            addresses.append(address)
    return addresses
