"""Addresses: IPv6 literals are bracketed in every ZMQ address and URL, by one helper."""

from __future__ import annotations

import pytest

from kvpush.errors import AddressError
from kvpush.net import (
    bracket_host,
    http_url,
    is_ipv6_literal,
    parse_host_port,
    unbracket_host,
    zmq_address,
)


@pytest.mark.parametrize(
    ("host", "bracketed"),
    [
        ("::1", "[::1]"),
        ("[::1]", "[::1]"),
        ("fe80::1:2", "[fe80::1:2]"),
        ("2001:db8::8a2e:370:7334", "[2001:db8::8a2e:370:7334]"),
        ("::ffff:127.0.0.1", "[::ffff:127.0.0.1]"),
        ("127.0.0.1", "127.0.0.1"),
        ("prefill-0.cluster.local", "prefill-0.cluster.local"),
        ("*", "*"),
    ],
)
def test_bracket_host(host: str, bracketed: str) -> None:
    assert bracket_host(host) == bracketed
    assert bracket_host(bracketed) == bracketed  # idempotent
    assert unbracket_host(bracketed) == host.strip("[]")


def test_addresses_and_urls() -> None:
    assert zmq_address("::1", 5600) == "tcp://[::1]:5600"
    assert zmq_address("[::1]", 5600) == "tcp://[::1]:5600"
    assert zmq_address("10.0.0.2", 1) == "tcp://10.0.0.2:1"
    assert zmq_address("node-a", 0) == "tcp://node-a:0"
    assert http_url("::1", 8000, "v1/models") == "http://[::1]:8000/v1/models"
    assert http_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert is_ipv6_literal("[::1]") and not is_ipv6_literal("127.0.0.1")
    assert not is_ipv6_literal("localhost")


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("127.0.0.1:5600", ("127.0.0.1", 5600)),
        ("[::1]:5600", ("::1", 5600)),
        ("[fe80::1]:0", ("fe80::1", 0)),
        ("decode-3:65535", ("decode-3", 65535)),
    ],
)
def test_parse_host_port(text: str, parsed: tuple[str, int]) -> None:
    assert parse_host_port(text) == parsed
    host, port = parsed
    assert zmq_address(host, port) == f"tcp://{text}"  # and back again


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("::1:5600", "an IPv6 host must be bracketed, as [::1]:PORT"),
        ("[::1]5600", "expected [IPv6]:PORT"),
        ("host", "expected HOST:PORT"),
        (":5600", "expected HOST:PORT"),
        ("host:http", "bad port in 'host:http'"),
        ("host:70000", "port 70000 out of range"),
    ],
)
def test_parse_host_port_errors(text: str, error: str) -> None:
    with pytest.raises(AddressError) as exc:
        parse_host_port(text)
    assert error in str(exc.value)


def test_empty_host_and_bad_port() -> None:
    with pytest.raises(AddressError, match="empty host"):
        bracket_host("")
    with pytest.raises(AddressError, match="port -1 out of range"):
        zmq_address("::1", -1)
    # Also a ValueError, so argparse-style callers can treat it as bad input.
    with pytest.raises(ValueError, match="out of range"):
        http_url("::1", 65536)
