"""Step 1, addresses: each side channel's host resolves and answers TCP, on the address
it advertises too; each server's `/health` (when its URL is given) names the same side
channel and role; the two servers can reach each other."""

from __future__ import annotations

import socket
import time

from kvpush.doctor.addresses import ResolvedAddress, SideAddress, look_up, pair_problems, where
from kvpush.doctor.checks.options import DoctorOptions, Observed, Target, http_failed
from kvpush.doctor.http import HttpFailed, get_health
from kvpush.doctor.report import StepResult, Verdict
from kvpush.health import ServerHealth
from kvpush.net import is_wildcard
from kvpush.roles import PAIR_ROLES


def check_addresses(options: DoctorOptions, seen: Observed, step: StepResult) -> None:
    for role in PAIR_ROLES:
        t = options.target(role)
        try:
            side = look_up(role, t.host, t.port, options.timeout_s)
        except socket.gaierror as exc:
            step.add(
                Verdict.FAIL,
                f"cannot resolve {t.host!r}: {exc.strerror}",
                side=role,
                next_action=f"give --{role} an IPv4 or IPv6 address, or a name this host "
                "resolves (check /etc/hosts and DNS)",
            )
            continue
        if not side.resolved:
            step.add(
                Verdict.FAIL,
                f"{t.host!r} resolves to no IPv4 or IPv6 address",
                side=role,
                next_action=f"give --{role} an IPv4 or IPv6 address",
            )
            continue
        _report_tcp(side, step)
        if t.http is not None:
            _read_health(role, t.http, options, seen, step)
            known = seen.health.get(role)
            advertised = known.side_channel_host if known is not None else None
            if advertised is not None:
                side = SideAddress(role, side.host, side.port, side.resolved, advertised)
            _check_advertised_port(role, t, seen, step)
        told = _check_advertised_address(side, options.timeout_s, step)
        seen.addresses[role] = side
        step.figures[role] = {
            "host": side.host,
            "port": side.port,
            "advertised_host": side.advertised_host,
            "addresses": [a.as_json() for a in side.resolved],
            "advertised_addresses": [a.as_json() for a in told],
        }
    if len(seen.addresses) == 2:
        for role, peer_role in (("prefill", "decode"), ("decode", "prefill")):
            for problem, action in pair_problems(seen.addresses[role], seen.addresses[peer_role]):
                step.add(Verdict.FAIL, problem, side=role, next_action=action)


def _check_advertised_address(
    side: SideAddress, timeout_s: float, step: StepResult
) -> tuple[ResolvedAddress, ...]:
    """Peers connect to the address a server advertises, not to the one the doctor was
    given: where they differ, the advertised one must answer TCP too (a side channel bound
    to loopback but advertised under another address answers the doctor and no peer).
    Returns the advertised addresses tried beyond those step 1 already tried."""
    advertised = side.advertised_host
    if advertised is None or is_wildcard(advertised):  # a wildcard is `pair_problems`'
        return ()
    try:
        tried = frozenset(a.ip for a in side.resolved)
        told = look_up(side.role, advertised, side.port, timeout_s, tried=tried)
    except socket.gaierror as exc:
        step.add(
            Verdict.FAIL,
            f"it advertises its side channel as {advertised}, a name this host cannot "
            f"resolve ({exc.strerror}): its peers are told an address they may not resolve",
            side=side.role,
            next_action=f"start the {side.role} server with --advertise-host set to an "
            "address its peers can resolve and reach",
        )
        return ()
    new = told.resolved
    if not new:
        return ()
    answering = [a for a in new if a.tcp_ms is not None]
    if answering:
        step.add(
            Verdict.OK,
            f"it advertises its side channel as {where(told)}: TCP answers on "
            f"{_connect_times(answering)}",
            side=side.role,
        )
        return new
    why = "; ".join(f"{a.ip}: {a.tcp_error}" for a in new)
    every = "::" if new[0].family == "IPv6" else "0.0.0.0"
    step.add(
        Verdict.FAIL,
        f"the doctor reached its side channel at {where(side)}, but it advertises "
        f"{where(told)}, where nothing answers TCP ({why}): it does not listen on the "
        "address its peers are told",
        side=side.role,
        next_action=f"start the {side.role} server listening where it advertises: --host "
        f"{advertised}, or --host {every} with --advertise-host {advertised} (vLLM binds "
        "and advertises the same kv_connector_extra_config side_channel_host)",
    )
    return new


def _connect_times(answering: list[ResolvedAddress]) -> str:
    return ", ".join(f"{a.ip} in {a.tcp_ms:.2f} ms" for a in answering)


def _report_tcp(side: SideAddress, step: StepResult) -> None:
    answering = [a for a in side.resolved if a.tcp_ms is not None]
    silent = [a for a in side.resolved if a.tcp_ms is None]
    described = ", ".join(
        f"{a.ip} ({a.family}{', loopback' if a.loopback else ''}"
        f"{', this host' if a.local and not a.loopback else ''})"
        for a in side.resolved
    )
    if not answering:
        why = "; ".join(f"{a.ip}: {a.tcp_error}" for a in silent)
        step.add(
            Verdict.FAIL,
            f"{where(side)} resolves to {described}; nothing answers TCP on port "
            f"{side.port} ({why})",
            side=side.role,
            next_action=f"start the {side.role} server, or give --{side.role} the port its "
            "side channel listens on (kvpush serve --side-channel-port; vLLM: "
            "kv_connector_extra_config side_channel_port)",
        )
        return
    step.add(
        Verdict.OK,
        f"{where(side)} resolves to {described}; TCP answers on {_connect_times(answering)}",
        side=side.role,
    )
    if silent:
        step.add(
            Verdict.WARN,
            f"{side.host} also resolves to "
            + ", ".join(f"{a.ip} ({a.tcp_error})" for a in silent)
            + f", where port {side.port} does not answer: a peer that tries that address "
            "first fails or waits",
            side=side.role,
            next_action=f"give the {side.role} server's peers and the doctor "
            f"{answering[0].ip} instead of the name, or make the server listen on every "
            "address the name resolves to",
        )


def _read_health(
    role: str, base: str, options: DoctorOptions, seen: Observed, step: StepResult
) -> None:
    try:
        status, body = get_health(base, options.timeout_s)
    except HttpFailed as exc:
        http_failed(
            step,
            role,
            exc,
            f"start the {role} server, or give --{role}-http its HTTP base URL "
            "(http://HOST:PORT, the port of /v1/completions)",
        )
        return
    seen.health_status[role] = status
    if body is None:
        # Not a `kvpush serve` server (vLLM's /health says nothing but its status): what
        # it advertises and the deadlines in force are unknown, its status is all there is.
        seen.health[role] = ServerHealth(status="ok" if status == 200 else f"HTTP {status}")
        step.add(
            Verdict.OK,
            f"{base}/health answers {status}, without kvpush's fields (not a kvpush serve "
            "server?): its advertised address and deadlines are not known",
            side=role,
        )
        return
    seen.health[role] = body
    seen.health_read_at[role] = time.monotonic()
    step.add(Verdict.OK, f"{base}/health answers {status}", side=role)


def _check_advertised_port(role: str, t: Target, seen: Observed, step: StepResult) -> None:
    body = seen.health.get(role)
    if body is None:
        return
    port = body.side_channel_port
    if port is not None and port != t.port:
        step.add(
            Verdict.FAIL,
            f"{t.http} is a server whose side channel is on port {port}, not {t.port}: "
            f"--{role} and --{role}-http name different servers",
            side=role,
            next_action=f"give --{role} and --{role}-http the two ports of the same server "
            f"(its /health says side_channel_port {port})",
        )
    served_role = body.role
    if served_role is not None and served_role not in (role, "both"):
        step.add(
            Verdict.FAIL,
            f"{t.http} serves the {served_role} role, not {role}",
            side=role,
            next_action="swap --prefill and --decode (and their -http URLs)"
            if served_role in PAIR_ROLES
            else f"point --{role}-http at the {role} server",
        )
