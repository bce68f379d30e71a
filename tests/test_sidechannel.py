"""The side channel in one process: a real MetadataServer and real clients over loopback."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator, Mapping

import msgspec
import pytest
import zmq

from kvpush.bench.presets import synthetic_kv_cache
from kvpush.config import SideChannelConfig
from kvpush.errors import (
    AuthenticationRefused,
    ClosedError,
    ConfigError,
    IncompatiblePeer,
    MalformedReply,
    PeerUnreachable,
    SideChannelError,
    UnknownRank,
)
from kvpush.geometry import PROTOCOL_VERSION, CacheGeometry
from kvpush.net import zmq_address
from kvpush.sidechannel import (
    GET_META_MSG,
    MetadataServer,
    PeerMetadata,
    control_request,
    fetch_metadata,
    fetch_metadata_timed,
)
from kvpush.sidechannel.wire import (
    REQUEST_FORM,
    Refusal,
    ReplyHeader,
    decode_header,
    encode_request,
    new_nonce,
)

pytestmark = pytest.mark.timeout(30)

HOSTS = ["127.0.0.1", "::1"]


def _geometry(**kwargs: object) -> CacheGeometry:
    return synthetic_kv_cache(num_blocks=4, fill=None, **kwargs).geometry  # type: ignore[arg-type]


# Kept alive for the whole module: the geometry's addresses point into it.
_TINY = synthetic_kv_cache(preset="tiny", num_blocks=4, fill=None)


def _meta(rank: int = 0, geometry: CacheGeometry | None = None) -> PeerMetadata:
    return PeerMetadata(
        engine_id="engine-a",
        incarnation=f"inc-{rank}",
        rank=rank,
        role="both",
        agent_name=f"agent-{rank}",
        agent_metadata=bytes(range(256)) * 4,
        geometry=geometry or _TINY.geometry,
        kvpush_version="0.1.0",
    )


@pytest.fixture(params=HOSTS)
def host(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def served(host: str) -> Iterator[MetadataServer]:
    ranks = {0: _meta(0), 1: _meta(1)}
    with MetadataServer(host, 0, SideChannelConfig(), ranks) as server:
        yield server


def test_each_rank_gets_its_own_metadata(host: str, served: MetadataServer) -> None:
    for rank in (0, 1):
        result = fetch_metadata_timed(host, served.port, rank)
        assert result.metadata == _meta(rank)
        assert result.compat_hash == _meta(rank).geometry.compat_hash()
        assert result.peer_protocol_version == PROTOCOL_VERSION
        assert result.round_trip_s > 0
    assert served.statistics().served == 2
    assert served.endpoints == [zmq_address(host, served.port)]


def test_unknown_rank_is_refused_and_named(host: str, served: MetadataServer) -> None:
    with pytest.raises(UnknownRank, match="no rank 7 here: this engine serves ranks 0, 1"):
        fetch_metadata(host, served.port, 7)
    assert served.statistics().refused_unknown_rank == 1


def test_token_is_required_when_configured(host: str) -> None:
    config = SideChannelConfig(token="s3cret")
    with MetadataServer(host, 0, config, {0: _meta()}) as server:
        with pytest.raises(AuthenticationRefused, match="no token given"):
            fetch_metadata(host, server.port)
        with pytest.raises(AuthenticationRefused, match="wrong token"):
            fetch_metadata(host, server.port, token="guess")
        # Refused before the rank is even looked at: no hint which ranks exist.
        with pytest.raises(AuthenticationRefused):
            fetch_metadata(host, server.port, 5, token="guess")
        assert fetch_metadata(host, server.port, token="s3cret") == _meta()
        stats = server.statistics()
    assert (stats.refused_auth, stats.served, stats.refused_unknown_rank) == (3, 1, 0)


def test_the_token_never_travels_and_a_side_channel_without_it_is_refused(host: str) -> None:
    """Issue 11: a forged Register can name any side channel. One that does not hold the
    token sees only a proof of it, and nothing it answers is used: not the real server's
    answer replayed, not a made-up proof, not an answer with no proof."""
    token = "the-shared-token-1234"
    with MetadataServer(host, 0, SideChannelConfig(token=token), {0: _meta()}) as real:
        with _dealer(host, real.port) as sock:  # an exchange an eavesdropper saw
            sock.send(encode_request(0, token, new_nonce()))
            captured = sock.recv_multipart()
        assert len(captured) == 3
        seen: list[bytes] = []
        answers = [captured[:2], captured, [*captured[:2], bytes(32)]]

        def impostor(request: bytes) -> list[bytes]:
            seen.append(request)
            return answers[len(seen) - 1]

        with _fake_server(impostor, host) as port:
            with pytest.raises(AuthenticationRefused, match="without proving that it holds"):
                fetch_metadata(host, port, token=token)
            for _replayed_or_made_up in range(2):
                with pytest.raises(
                    AuthenticationRefused, match="proof of the shared token is wrong"
                ):
                    fetch_metadata(host, port, token=token)
        assert len(seen) == 3
        assert all(token.encode() not in request for request in seen), "the token travelled"
        assert fetch_metadata(host, real.port, token=token) == _meta()


def test_a_client_with_a_token_refuses_a_side_channel_configured_without_one(host: str) -> None:
    with MetadataServer(host, 0, SideChannelConfig(), {0: _meta()}) as open_server:
        with pytest.raises(AuthenticationRefused, match="it has none configured"):
            fetch_metadata(host, open_server.port, token="s3cret")
        assert fetch_metadata(host, open_server.port) == _meta()


def test_the_proof_covers_the_request_byte_for_byte(host: str) -> None:
    """A signed request changed on the way (rank 0 made rank 1) is refused."""
    with MetadataServer(
        host, 0, SideChannelConfig(token="s3cret"), {0: _meta(0), 1: _meta(1)}
    ) as server:
        frame = bytearray(encode_request(0, "s3cret", new_nonce()))
        rank_at = frame.index(GET_META_MSG) + len(GET_META_MSG)
        assert frame[rank_at] == 0
        frame[rank_at] = 1
        with _dealer(host, server.port) as sock:
            sock.send(bytes(frame))
            header = decode_header(sock.recv_multipart()[0])
        assert (header.status, header.refusal) == ("refused", Refusal.AUTH_REFUSED)
        assert "wrong token" in header.detail
        assert server.statistics().refused_auth == 1


def test_control_requests_prove_the_token_both_ways(host: str) -> None:
    calls: list[object] = []

    def echo(body: object) -> object:
        calls.append(body)
        return body

    control = {b"kvpush_test_echo": echo}
    config = SideChannelConfig(token="s3cret")
    with MetadataServer(host, 0, config, {0: _meta()}, control=control) as server:
        assert control_request(host, server.port, b"kvpush_test_echo", [1], token="s3cret") == [1]
        with pytest.raises(AuthenticationRefused, match="wrong token"):
            control_request(host, server.port, b"kvpush_test_echo", [2], token="guess")
        with pytest.raises(AuthenticationRefused, match="no token given"):
            control_request(host, server.port, b"kvpush_test_echo", [3])
    assert calls == [[1]]
    open_server = MetadataServer(host, 0, SideChannelConfig(), {0: _meta()}, control=control)
    with open_server, pytest.raises(AuthenticationRefused, match="it has none configured"):
        control_request(host, open_server.port, b"kvpush_test_echo", [4], token="s3cret")
    assert calls == [[1], [4]]  # it ran there, but its answer was not believed


def test_a_peer_of_an_older_protocol_is_told_apart_from_a_wrong_token() -> None:
    """A protocol-3 server cannot read our proof: the refusal says the versions differ."""
    old = ReplyHeader("refused", 3, "", "0.0.9", Refusal.MALFORMED_REQUEST, "an array of 4")
    with (
        _fake_server(lambda _r: [msgspec.msgpack.encode(old), b""]) as port,
        pytest.raises(IncompatiblePeer, match="protocol version differs: theirs 3"),
    ):
        fetch_metadata("127.0.0.1", port, token="s3cret")


def test_incompatible_peer_is_refused_naming_what_differs(
    host: str, served: MetadataServer
) -> None:
    ours = _geometry(preset="tiny", dtype="float16", block_size_tokens=32)
    with pytest.raises(IncompatiblePeer) as exc:
        fetch_metadata(host, served.port, expect_geometry=ours)
    message = str(exc.value)
    assert "block_size_tokens: theirs 16, ours 32" in message
    assert "dtype: theirs 'bfloat16', ours 'float16'" in message
    assert "regions differ first at #0" in message  # block bytes follow from both

    with pytest.raises(IncompatiblePeer, match=r"theirs [0-9a-f]{32}, ours 0000.*layout kv_sep"):
        fetch_metadata(host, served.port, expect_compat_hash="0000")
    same = _geometry(preset="tiny")
    assert fetch_metadata(host, served.port, expect_geometry=same) == _meta(0)


def test_closed_port_fails_at_once(host: str) -> None:
    port = _closed_port(host)
    with pytest.raises(PeerUnreachable, match="connection refused"):
        # A long timeout: a refused connection must not wait for it.
        fetch_metadata(host, port, timeout_ms=60_000)


def test_a_name_that_does_not_resolve_is_named() -> None:
    with pytest.raises(PeerUnreachable, match=r"cannot resolve host 'no-such-host\.invalid'"):
        fetch_metadata("no-such-host.invalid", 5600, timeout_ms=60_000)
    server = MetadataServer("no-such-host.invalid", 0, SideChannelConfig(), {})
    with pytest.raises(ConfigError, match="cannot resolve side-channel host"):
        server.start()
    server.close()


def test_a_server_that_never_answers_times_out(host: str) -> None:
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.IPV6, 1)
    port = silent.bind_to_random_port(f"tcp://{'[::1]' if ':' in host else host}")
    try:
        with pytest.raises(PeerUnreachable, match="connected, but no answer within 200 ms"):
            fetch_metadata(host, port, timeout_ms=200)
    finally:
        silent.close(linger=0)


@pytest.mark.parametrize(
    ("frames", "error"),
    [
        ([b"not msgpack", b""], "rank 0: reply header is not a side-channel header"),
        ([b"\x93\xa2ok\x01\xa0"], "expected a reply of 2 frames, got 1"),
        ([msgspec.msgpack.encode(["maybe", 1, "", "0"]), b""], "unknown status 'maybe'"),
        ([msgspec.msgpack.encode(["ok", PROTOCOL_VERSION, "h", "0"]), b"\xc1"], "not valid peer"),
    ],
)
def test_malformed_replies_are_named(frames: list[bytes], error: str) -> None:
    with _fake_server(lambda _request: frames) as port, pytest.raises(MalformedReply, match=error):
        fetch_metadata("127.0.0.1", port, timeout_ms=2000)


def test_a_reply_whose_payload_contradicts_its_header_is_refused() -> None:
    meta = _meta(0)
    header = msgspec.msgpack.encode(["ok", PROTOCOL_VERSION, "f" * 32, "0.1.0"])
    payload = msgspec.msgpack.encode(meta)
    with (
        _fake_server(lambda _r: [header, payload]) as port,
        pytest.raises(MalformedReply, match="does not match the payload's geometry"),
    ):
        fetch_metadata("127.0.0.1", port)
    good = msgspec.msgpack.encode(["ok", PROTOCOL_VERSION, meta.geometry.compat_hash(), "0.1.0"])
    with (
        _fake_server(lambda _r: [good, payload]) as port,
        pytest.raises(MalformedReply, match="asked for rank 3, the reply is for rank 0"),
    ):
        fetch_metadata("127.0.0.1", port, 3)


def test_another_protocol_version_is_incompatible() -> None:
    header = msgspec.msgpack.encode(["ok", PROTOCOL_VERSION + 1, "h", "9.9.9"])
    with (
        _fake_server(lambda _r: [header, b""]) as port,
        pytest.raises(
            IncompatiblePeer,
            match=rf"protocol version differs: theirs {PROTOCOL_VERSION + 1} \(kvpush",
        ),
    ):
        fetch_metadata("127.0.0.1", port)


def test_ranks_from_a_callable_are_read_per_request() -> None:
    ranks: dict[int, PeerMetadata] = {}
    with MetadataServer("127.0.0.1", 0, SideChannelConfig(), lambda: ranks) as server:
        with pytest.raises(UnknownRank, match=r"serves ranks none \(yet\)"):
            fetch_metadata("127.0.0.1", server.port)
        ranks[0] = _meta(0)
        assert fetch_metadata("127.0.0.1", server.port).rank == 0


def test_a_failing_rank_source_is_reported_and_serving_goes_on() -> None:
    calls = 0

    def ranks() -> Mapping[int, PeerMetadata]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("engine not initialised")
        return {0: _meta(0)}

    with MetadataServer("127.0.0.1", 0, SideChannelConfig(), ranks) as server:
        with pytest.raises(SideChannelError, match=r"unavailable.*engine not initialised"):
            fetch_metadata("127.0.0.1", server.port)
        assert fetch_metadata("127.0.0.1", server.port).rank == 0
        assert server.statistics().unavailable == 1


def test_malformed_requests_get_an_error_reply_saying_what_was_expected() -> None:
    with MetadataServer("127.0.0.1", 0, SideChannelConfig(), {0: _meta()}) as server:
        cases = {
            b"\xff\xfe": "not a msgpack",
            msgspec.msgpack.encode((GET_META_MSG,)): "got an array of 1",
            msgspec.msgpack.encode(("get_meta_msg", 0)): "got a first element 'get_meta_msg'",
            msgspec.msgpack.encode((GET_META_MSG, -1)): "got rank -1",
            msgspec.msgpack.encode((GET_META_MSG, True)): "got rank True",
            msgspec.msgpack.encode((GET_META_MSG, 0, b"tok")): "1 extra element(s)",
            msgspec.msgpack.encode((GET_META_MSG, 0, "tok")): "token in clear text",
            msgspec.msgpack.encode((GET_META_MSG, 0, b"n", bytes(32))): "nonce that is not",
            msgspec.msgpack.encode((GET_META_MSG, 0, bytes(16), b"p")): "proof that is not",
            msgspec.msgpack.encode({"rank": 0}): "not a msgpack",
        }
        with _dealer("127.0.0.1", server.port) as sock:
            for request, expected in cases.items():
                sock.send(request)
                header_frame, payload = sock.recv_multipart()
                header = decode_header(header_frame)
                assert (header.status, header.refusal, payload) == (
                    "refused",
                    "malformed_request",
                    b"",
                )
                assert expected in header.detail
                assert REQUEST_FORM in header.detail
        assert server.statistics().malformed == len(cases)


def test_req_sockets_like_other_engines_use_are_answered() -> None:
    """vLLM-style clients use REQ, which adds an empty delimiter frame."""
    with MetadataServer("127.0.0.1", 0, SideChannelConfig(), {0: _meta()}) as server:
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        try:
            sock.connect(f"tcp://127.0.0.1:{server.port}")
            sock.send(msgspec.msgpack.encode((GET_META_MSG, 0)))
            header, payload = sock.recv_multipart()
        finally:
            sock.close(linger=0)
    assert decode_header(header).status == "ok"
    assert msgspec.msgpack.decode(payload, type=PeerMetadata) == _meta()


def test_oversize_and_badly_framed_requests_are_dropped_and_serving_goes_on() -> None:
    config = SideChannelConfig(max_frame_bytes=1024)
    with MetadataServer("127.0.0.1", 0, config, {0: _meta()}) as server:
        with _dealer("127.0.0.1", server.port) as sock:
            sock.send_multipart([b"a", b"b", b"c"])  # wrong framing: dropped, not answered
            sock.send(b"x" * 2048)  # over the cap: ZeroMQ closes this connection
        assert fetch_metadata("127.0.0.1", server.port) == _meta()
        stats = server.statistics()
    assert stats.served == 1
    assert stats.dropped <= 1  # the framing one, if it arrived before the oversize frame


def test_close_releases_the_port_and_joins_the_thread() -> None:
    server = MetadataServer("127.0.0.1", 0, SideChannelConfig(), {0: _meta()})
    with pytest.raises(SideChannelError, match="not started"):
        _ = server.port
    server.start()
    port = server.port
    ours = [t for t in threading.enumerate() if t.name == f"kvpush-sidechannel-{port}"]
    assert len(ours) == 1
    with pytest.raises(SideChannelError, match="called twice"):
        server.start()
    server.close()
    server.close()  # idempotent
    assert not ours[0].is_alive()
    with pytest.raises(ClosedError):
        server.start()
    with pytest.raises(PeerUnreachable, match="connection refused"):
        fetch_metadata("127.0.0.1", port)
    with MetadataServer("127.0.0.1", port, SideChannelConfig(), {0: _meta()}) as again:
        assert again.port == port


def test_a_port_in_use_is_reported_at_start() -> None:
    with MetadataServer("127.0.0.1", 0, SideChannelConfig(), {}) as first:
        second = MetadataServer("127.0.0.1", first.port, SideChannelConfig(), {})
        with pytest.raises(SideChannelError, match=r"cannot serve .*:\d+: Address already in use"):
            second.start()
        second.close()


def test_a_host_name_binds_every_address_it_names() -> None:
    expected = {info[4][0] for info in socket.getaddrinfo("localhost", None)}
    with MetadataServer("localhost", 0, SideChannelConfig(), {0: _meta()}) as server:
        assert {zmq_address(a, server.port) for a in expected} == set(server.endpoints)
        assert fetch_metadata("localhost", server.port) == _meta()


# --- helpers ---------------------------------------------------------------------------


def _closed_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class _dealer:
    def __init__(self, host: str, port: int) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)
        self.sock.connect(zmq_address(host, port))

    def __enter__(self) -> zmq.Socket[bytes]:
        return self.sock

    def __exit__(self, *exc: object) -> None:
        self.sock.close(linger=0)


class _fake_server:
    """A ROUTER that answers every request with `reply(request)`: a misbehaving peer."""

    def __init__(self, reply: object, host: str = "127.0.0.1") -> None:
        self.reply = reply
        self.host = host
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IPV6, 1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def __enter__(self) -> int:
        port = self.sock.bind_to_random_port(f"tcp://{'[::1]' if ':' in self.host else self.host}")
        self.thread.start()
        return port

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(20):
                identity, request = self.sock.recv_multipart()
                self.sock.send_multipart([identity, *self.reply(request)])  # type: ignore[operator]

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(linger=0)
