"""Host and address formatting. IPv6 literals are bracketed everywhere, by this one helper."""

from __future__ import annotations

import ipaddress

from kvpush.errors import AddressError


def is_ipv6_literal(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host.strip("[]")), ipaddress.IPv6Address)
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """`0.0.0.0`, `::` (bracketed or not) and `*`: an address to listen on, never to connect to."""
    if host == "*":
        return True
    try:
        return ipaddress.ip_address(unbracket_host(host)).is_unspecified
    except ValueError:
        return False


def bracket_host(host: str) -> str:
    """`::1` -> `[::1]`; IPv4 addresses, names and already-bracketed hosts are unchanged."""
    if not host:
        raise AddressError("empty host: expected an IPv4 or IPv6 address or a host name")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return f"[{bare}]" if is_ipv6_literal(bare) else host


def unbracket_host(host: str) -> str:
    """`[::1]` -> `::1`, for socket APIs that take a bare address."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def zmq_address(host: str, port: int, scheme: str = "tcp") -> str:
    """A ZeroMQ endpoint; sockets using an IPv6 literal also need `IPV6` set."""
    return f"{scheme}://{bracket_host(host)}:{check_port(port)}"


def http_url(host: str, port: int, path: str = "") -> str:
    if path and not path.startswith("/"):
        path = "/" + path
    return f"http://{bracket_host(host)}:{check_port(port)}{path}"


def check_port(port: int) -> int:
    if not 0 <= port <= 65535:
        raise AddressError(f"port {port} out of range: expected 0..65535")
    return port


def parse_host_port(text: str) -> tuple[str, int]:
    """Parse `host:port`, `1.2.3.4:5`, `[::1]:5`; returns the host unbracketed."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise AddressError(f"bad address {text!r}: expected [IPv6]:PORT")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise AddressError(f"bad address {text!r}: expected HOST:PORT")
        if ":" in host:
            raise AddressError(
                f"bad address {text!r}: an IPv6 host must be bracketed, as [{host}]:PORT"
            )
    try:
        port = int(port_text)
    except ValueError:
        raise AddressError(f"bad port in {text!r}: expected a number 0..65535") from None
    return host, check_port(port)
