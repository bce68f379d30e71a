"""Thousands of malformed side-channel messages: refused or dropped, and serving goes on."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from conftest import Endpoint, run_kvpush
from kvpush.config import SideChannelConfig
from kvpush.kvcache import synthetic_kv_cache
from kvpush.net import zmq_address
from kvpush.sidechannel import GET_META_MSG, MetadataServer, PeerMetadata, fetch_metadata
from kvpush.sidechannel.wire import decode_header

pytestmark = pytest.mark.timeout(60)

MESSAGES = 10_000
_CACHE = synthetic_kv_cache(preset="tiny", num_blocks=2, fill=None)


def _random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.randrange(-(2**63), 2**64)
    if kind == 1:
        return rng.random() * 1e6
    if kind == 2:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(20)))
    if kind == 3:
        return rng.randbytes(rng.randrange(20))
    if kind == 4:
        return rng.choice([None, True, False, GET_META_MSG, "get_meta_msg"])
    if kind == 5:
        return msgspec.msgpack.Ext(rng.randrange(128), rng.randbytes(rng.randrange(8)))
    if kind in (6, 7):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(6))]
    return {str(rng.random()): _random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def malformed_messages(seed: int, count: int) -> Iterator[list[bytes]]:
    """Garbage, near misses and bad framing; none is a valid, authorised request."""
    rng = random.Random(seed)
    encode = msgspec.msgpack.encode
    near_misses = [
        (GET_META_MSG,),
        ("get_meta_msg", 0),
        (b"GET_META_MSG", 0),
        (GET_META_MSG, -1),
        (GET_META_MSG, 1.0),
        (GET_META_MSG, "0"),
        (GET_META_MSG, None),
        (GET_META_MSG, 0, b"token-as-bytes"),
        (GET_META_MSG, 0, 17),
        (GET_META_MSG, 0, "wrong-token"),
        (GET_META_MSG, 0),  # no token, to a server that wants one
        (GET_META_MSG, 0, "wrong-token", "extra"),
        {"get_meta_msg": 0},
    ]
    for i in range(count):
        kind = i % 6
        if kind == 0:
            yield [rng.randbytes(rng.randrange(0, 300))]
        elif kind == 1:
            yield [encode(_random_value(rng))]
        elif kind == 2:
            yield [encode(rng.choice(near_misses))]
        elif kind == 3:
            valid = encode((GET_META_MSG, rng.randrange(4), "wrong-token"))
            yield [valid[: rng.randrange(len(valid))]]  # truncated
        elif kind == 4:
            yield [rng.randbytes(8) for _ in range(rng.randrange(2, 5))]  # bad framing
        else:
            yield [encode([_random_value(rng) for _ in range(rng.randrange(2, 4))])]


def _blast(address: str, seed: int, count: int, sockets: int = 4) -> list[zmq.Socket[bytes]]:
    ctx = zmq.Context.instance()
    socks = []
    for _ in range(sockets):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(address)
        socks.append(sock)
    for i, frames in enumerate(malformed_messages(seed, count)):
        socks[i % sockets].send_multipart(frames)
    return socks


def _oversize(address: str, frames: int) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, 1)
    sock.connect(address)
    for _ in range(frames):
        sock.send(b"\x92" + b"\xff" * 70_000)  # over the default 64 KiB cap
    time.sleep(0.1)
    sock.close(linger=0)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_malformed_flood_is_refused_or_dropped_and_a_valid_request_still_answers(
    host: str,
) -> None:
    meta = PeerMetadata(
        engine_id="fuzzed",
        incarnation="1",
        rank=0,
        role="receiver",
        agent_name="",
        agent_metadata=b"",
        geometry=_CACHE.geometry,
        kvpush_version="0.1.0",
    )
    config = SideChannelConfig(token="the-real-token")
    with MetadataServer(host, 0, config, {0: meta}) as server:
        address = zmq_address(host, server.port)
        _oversize(address, 20)
        socks = _blast(address, seed=1, count=MESSAGES)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                stats = server.statistics()
                if stats.refused + stats.dropped >= MESSAGES:
                    break
                time.sleep(0.05)
            replies = _drain(socks)
        finally:
            for sock in socks:
                sock.close(linger=0)
        stats = server.statistics()
        assert stats.served == 0
        assert stats.refused + stats.dropped == MESSAGES
        assert stats.dropped >= MESSAGES // 6  # the badly framed sixth
        assert stats.refused_auth > 0 and stats.malformed > 0
        # Every answer was a refusal: not one carried metadata.
        assert replies, "no refusal came back at all"
        for header, payload in replies:
            assert decode_header(header).status == "refused"
            assert payload == b""

        assert fetch_metadata(host, server.port, token="the-real-token") == meta
        assert server.statistics().served == 1


def _drain(socks: list[zmq.Socket[bytes]]) -> list[tuple[bytes, bytes]]:
    replies: list[tuple[bytes, bytes]] = []
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < 0.3:
        got = False
        for sock in socks:
            try:
                header, payload = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            replies.append((header, payload))
            got = True
        if got:
            quiet_since = time.monotonic()
        else:
            time.sleep(0.01)
    return replies


def test_a_live_endpoint_survives_a_flood_and_kvpush_probe_still_exits_0(
    tiny_endpoint: Endpoint,
) -> None:
    address = zmq_address(tiny_endpoint.host, tiny_endpoint.port)
    _oversize(address, 5)
    socks = _blast(address, seed=2, count=MESSAGES)
    for sock in socks:
        sock.close(linger=0)
    result = run_kvpush(
        "probe", "--host", tiny_endpoint.host, "--port", str(tiny_endpoint.port), "--rank", "1"
    )
    assert result.returncode == 0, result.stderr
    assert "rank 1: OK" in result.stdout
    assert tiny_endpoint.process.poll() is None
