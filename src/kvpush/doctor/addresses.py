"""Step 1's facts about an address: what a name resolves to, whether each address is
loopback or belongs to this host, and whether its port answers TCP.

`pair_problems` decides, from those facts alone (no I/O), whether one side's address
cannot be reached by the other: a loopback address is reachable only from its own host.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass

from kvpush.net import bracket_host, is_wildcard, unbracket_host


@dataclass(frozen=True, slots=True)
class ResolvedAddress:
    ip: str
    family: str  # "IPv4" | "IPv6"
    loopback: bool
    local: bool  # an address of the host the doctor runs on
    tcp_ms: float | None = None  # connect time; None when it did not answer
    tcp_error: str | None = None

    def as_json(self) -> dict[str, object]:
        return {
            "ip": self.ip,
            "family": self.family,
            "loopback": self.loopback,
            "local": self.local,
            "tcp_ms": self.tcp_ms,
            "tcp_error": self.tcp_error,
        }


@dataclass(frozen=True, slots=True)
class SideAddress:
    """One server's side-channel address, as given to the doctor and as it advertises it."""

    role: str
    host: str
    port: int
    resolved: tuple[ResolvedAddress, ...]
    advertised_host: str | None = None  # from its /health, when known

    @property
    def on_loopback(self) -> bool:
        return bool(self.resolved) and all(a.loopback for a in self.resolved)

    @property
    def on_this_host(self) -> bool:
        return bool(self.resolved) and all(a.local or a.loopback for a in self.resolved)


def resolve(host: str, port: int) -> list[tuple[str, str]]:
    """(ip, family) for every address `host` resolves to, in resolver order, no repeats.

    Raises `socket.gaierror` when it does not resolve."""
    out: list[tuple[str, str]] = []
    for family, _, _, _, sockaddr in socket.getaddrinfo(
        unbracket_host(host), port, type=socket.SOCK_STREAM
    ):
        item = (str(sockaddr[0]), "IPv6" if family == socket.AF_INET6 else "IPv4")
        if item not in out:
            out.append(item)
    return out


def is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(unbracket_host(ip).split("%")[0]).is_loopback
    except ValueError:
        return False


def is_local(ip: str, family: str) -> bool:
    """Whether `ip` is an address of this host: only then can a socket bind to it."""
    fam = socket.AF_INET6 if family == "IPv6" else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def tcp_answers(
    ip: str, family: str, port: int, timeout_s: float
) -> tuple[float | None, str | None]:
    """(connect time in ms, None) if the port accepts a TCP connection, else (None, why)."""
    fam = socket.AF_INET6 if family == "IPv6" else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        started = time.perf_counter()
        try:
            s.connect((ip, port))
        except TimeoutError:
            return None, f"no answer to a TCP connect within {timeout_s * 1000:.0f} ms"
        except OSError as exc:
            return None, (exc.strerror or type(exc).__name__).lower()
        return (time.perf_counter() - started) * 1000, None


def look_up(
    role: str, host: str, port: int, timeout_s: float, *, tried: frozenset[str] = frozenset()
) -> SideAddress:
    """Resolve `host` and try its port on every address but those already `tried` (left
    out). Raises `socket.gaierror`."""
    found = []
    for ip, family in resolve(host, port):
        if ip in tried:
            continue
        ms, error = tcp_answers(ip, family, port, timeout_s)
        found.append(
            ResolvedAddress(
                ip=ip,
                family=family,
                loopback=is_loopback(ip),
                local=is_local(ip, family),
                tcp_ms=ms,
                tcp_error=error,
            )
        )
    return SideAddress(role, host, port, tuple(found))


def where(side: SideAddress) -> str:
    return f"{bracket_host(side.host)}:{side.port}"


def pair_problems(side: SideAddress, peer: SideAddress) -> list[tuple[str, str]]:
    """(problem, next action) for each reason `peer` cannot reach `side`'s side channel.

    Peers connect to the address a server advertises (for `kvpush serve`, its --host),
    so a loopback address on one side works only when the other side is on the same host.
    """
    out: list[tuple[str, str]] = []
    advertised = side.advertised_host
    if advertised is not None and is_wildcard(advertised):
        out.append(
            (
                f"its side channel is advertised as {advertised}, a wildcard that peers "
                "cannot connect to",
                f"start the {side.role} server with --advertise-host (or --host) set to "
                f"an address the {peer.role} server can reach (not 0.0.0.0 or ::)",
            )
        )
        return out
    advertised_loopback = advertised is not None and is_loopback(advertised)
    if advertised_loopback and not side.on_loopback:
        out.append(
            (
                f"the doctor reached it at {where(side)}, but it advertises its side channel "
                f"as {advertised} (loopback): peers are told an address that names their own host",
                f"start the {side.role} server with --host {side.host} (or another address "
                f"the {peer.role} server can reach)",
            )
        )
    loopback = advertised_loopback or (advertised is None and side.on_loopback)
    if loopback and peer.resolved and not peer.on_this_host:
        shown = advertised or side.host
        out.append(
            (
                f"its side channel is on loopback ({shown}) while the {peer.role} server "
                f"({where(peer)}) is on another host: the {peer.role} server cannot reach it",
                f"start the {side.role} server with --host set to an address of its host "
                f"that {peer.host} can reach (vLLM: kv_connector_extra_config "
                "side_channel_host), and give the doctor that address",
            )
        )
    return out
