"""The doctor's steps, run in order against a live prefill/decode pair.

Each step reads what earlier ones found (`_Observed`) and adds findings and figures to
its `StepResult`. Once a step fails, the later ones are listed as not run: what they would
say is explained by the failure. Every network call is bounded by the timeout given, so
a stopped or hung peer makes the doctor fail, never wait. Nothing here changes a
server's state: it reads metadata, `/health` and `/metrics`, and opens TCP connections;
step 4 writes into the servers' scratch buffers only (`kvpush.doctor.data_plane`).
"""

from __future__ import annotations

import re
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from kvpush import __version__
from kvpush.doctor.addresses import (
    ResolvedAddress,
    SideAddress,
    look_up,
    pair_problems,
    where,
)
from kvpush.doctor.data_plane import check_data_plane
from kvpush.doctor.http import HttpFailed, Sample, get_health, get_metrics, total
from kvpush.doctor.report import Report, StepResult, Verdict
from kvpush.doctor.routers import behind_routers
from kvpush.errors import (
    AuthenticationRefused,
    IncompatiblePeer,
    MalformedReply,
    PeerUnreachable,
    SideChannelError,
    UnknownRank,
)
from kvpush.geometry import (
    PROTOCOL_VERSION,
    CacheGeometry,
    differing_compat_fields,
    write_views,
)
from kvpush.health import ServerHealth
from kvpush.net import is_wildcard
from kvpush.sidechannel.client import FetchResult, fetch_metadata_timed
from kvpush.topology import UnsupportedShape, rank_pairs

MAX_RANKS = 64  # ranks asked for before giving up on finding the last one
SLOW_ROUND_TRIP_MS = 100.0
CPU_WINDOW_S = 0.5
BUSY_IDLE_CPU = 0.5
ROLES = ("prefill", "decode")
_PUBLISHED_ROLE = {"prefill": ("sender", "both"), "decode": ("receiver", "both")}


@dataclass(frozen=True, slots=True)
class Target:
    """One server: its side channel, and its HTTP base URL when given."""

    role: str  # "prefill" | "decode"
    host: str
    port: int
    http: str | None = None

    @property
    def address(self) -> str:
        return where(SideAddress(self.role, self.host, self.port, ()))


@dataclass(frozen=True, slots=True)
class DoctorOptions:
    prefill: Target
    decode: Target
    token: str | None = None
    timeout_ms: int = 2000
    round_trip_samples: int = 5
    slow_round_trip_ms: float = SLOW_ROUND_TRIP_MS  # a median above it is a warning
    # The window over which a server's CPU share is read (two /health readings), and
    # the share of one core above which an idle server is a warning.
    cpu_window_s: float = CPU_WINDOW_S
    busy_idle_cpu: float = BUSY_IDLE_CPU

    def target(self, role: str) -> Target:
        return self.prefill if role == "prefill" else self.decode

    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000


@dataclass(slots=True)
class _Observed:
    """What the steps found so far, for the steps after them."""

    addresses: dict[str, SideAddress] = field(default_factory=dict)
    health: dict[str, ServerHealth] = field(default_factory=dict)
    health_status: dict[str, int] = field(default_factory=dict)
    health_read_at: dict[str, float] = field(default_factory=dict)  # time.monotonic()
    ranks: dict[str, list[FetchResult]] = field(default_factory=dict)


def run_doctor(options: DoctorOptions) -> Report:
    observed = _Observed()
    steps: list[StepResult] = []
    failed: StepResult | None = None
    for number, name, check in _STEPS:
        step = StepResult(number, name)
        if failed is not None:
            step.not_run_because = f"step {failed.number} ({failed.name}) failed"
        else:
            check(options, observed, step)
            if step.verdict is Verdict.FAIL:
                failed = step
        steps.append(step)
    return Report(options.prefill.address, options.decode.address, tuple(steps))


# ------------------------------------------------------------------------ 1: addresses


def _stopped_action(role: str, what: str) -> str:
    return (
        f"the {role} server accepts connections on its {what} but does not answer: it is "
        "stopped (SIGSTOP, a debugger), hung or overloaded. Check it with `ps -o stat= -p "
        "PID` (T: stopped; resume it with `kill -CONT PID`), or restart it; on a loaded "
        "host, raise --timeout-ms"
    )


def _addresses(options: DoctorOptions, seen: _Observed, step: StepResult) -> None:
    for role in ROLES:
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


def _http_failed(step: StepResult, role: str, exc: HttpFailed, otherwise: str) -> None:
    """An HTTP request to `role`'s server failed: a timeout means a stopped or hung server;
    anything else gets `otherwise` as its next action."""
    next_action = _stopped_action(role, "HTTP port") if exc.timed_out else otherwise
    step.add(Verdict.FAIL, str(exc), side=role, next_action=next_action)


def _read_health(
    role: str, base: str, options: DoctorOptions, seen: _Observed, step: StepResult
) -> None:
    try:
        status, body = get_health(base, options.timeout_s)
    except HttpFailed as exc:
        _http_failed(
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


def _check_advertised_port(role: str, t: Target, seen: _Observed, step: StepResult) -> None:
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
            if served_role in ROLES
            else f"point --{role}-http at the {role} server",
        )


# --------------------------------------------------------------------- 2: side channel


def _side_channel(options: DoctorOptions, seen: _Observed, step: StepResult) -> None:
    for role in ROLES:
        found = _fetch_ranks(role, options, step)
        if found is None:
            continue
        seen.ranks[role] = found
        first = found[0]
        ranks = ", ".join(str(r.metadata.rank) for r in found)
        step.add(
            Verdict.OK,
            f"{len(found)} rank{'s' * (len(found) != 1)} ({ranks}) "
            f"of engine {first.metadata.engine_id}, kvpush {first.peer_kvpush_version}, "
            f"protocol {first.peer_protocol_version} (ours {PROTOCOL_VERSION}), round trip "
            f"{first.round_trip_s * 1000:.2f} ms",
            side=role,
        )
        for r in found:
            m = r.metadata
            if m.role not in _PUBLISHED_ROLE[role]:
                step.add(
                    Verdict.FAIL,
                    f"rank {m.rank} publishes role {m.role!r}: a {role} server publishes "
                    f"{' or '.join(_PUBLISHED_ROLE[role])}",
                    side=role,
                    next_action="swap --prefill and --decode"
                    if m.role in ("sender", "receiver")
                    else f"point --{role} at the {role} server's side channel",
                )
            if not m.agent_name or not m.agent_metadata:
                step.add(
                    Verdict.FAIL,
                    f"rank {m.rank} publishes no transport agent: it cannot take part in a "
                    "transfer",
                    side=role,
                    next_action=f"check the {role} server's log for why its NIXL agent did "
                    "not start",
                )
        step.figures[role] = [
            {
                "rank": r.metadata.rank,
                "engine_id": r.metadata.engine_id,
                "incarnation": r.metadata.incarnation,
                "role": r.metadata.role,
                "kvpush_version": r.peer_kvpush_version,
                "protocol_version": r.peer_protocol_version,
                "compat_hash": r.compat_hash,
                "agent_name": r.metadata.agent_name,
                "round_trip_ms": round(r.round_trip_s * 1000, 3),
            }
            for r in found
        ]
    if len(seen.ranks) < 2:
        return
    p, d = seen.ranks["prefill"][0].metadata, seen.ranks["decode"][0].metadata
    if p.engine_id == d.engine_id:
        step.add(
            Verdict.FAIL,
            f"--prefill and --decode reach the same engine ({p.engine_id})",
            next_action="give --decode the decode server's side channel",
        )
    if options.token is not None:
        step.add(
            Verdict.OK,
            "the token is proven both ways: each side checked the doctor's proof and proved "
            "it holds the same token (so the two servers share it)",
        )
    else:
        step.add(
            Verdict.WARN,
            "no token: both side channels answer anyone who can reach them, and what they "
            "publish (agent metadata, message keys) is what a forged data-plane message needs",
            next_action="give both servers the same secret (kvpush serve --token-file FILE, or "
            "KVPUSH_TOKEN), and the doctor too",
        )


def _fetch_ranks(role: str, options: DoctorOptions, step: StepResult) -> list[FetchResult] | None:
    """Every rank the side channel serves, asked for in order until one is unknown; the
    refusal names the ranks it does serve, so a rank missing among them is named too."""
    t = options.target(role)
    found: list[FetchResult] = []
    rank = 0
    served: list[int] | None = None
    while rank <= MAX_RANKS:
        try:
            found.append(
                fetch_metadata_timed(
                    t.host, t.port, rank, timeout_ms=options.timeout_ms, token=options.token
                )
            )
        except UnknownRank as exc:
            if served is not None:  # one it named, gone since: it restarted meanwhile
                step.add(
                    Verdict.FAIL,
                    f"rank {rank} was named, then unknown: {exc}",
                    side=role,
                    next_action=f"run the doctor again once the {role} server is up",
                )
                return None
            served = served_ranks(str(exc))
            if served is None or not served or max(served) < rank:
                break
            later = [r for r in served if r > rank]
            rank = later[0]
            continue
        except SideChannelError as exc:
            step.add(
                Verdict.FAIL,
                f"{type(exc).__name__}: {exc}",
                side=role,
                next_action=_side_channel_action(role, exc, options),
            )
            return None
        rank += 1
        if served is not None:
            later = [r for r in served if r >= rank]
            if not later:
                break
            rank = later[0]
    else:
        step.add(
            Verdict.WARN,
            f"it answers for every rank the doctor asked (0..{MAX_RANKS}); the rest were not read",
            side=role,
            next_action="check the server's tensor-parallel size",
        )
    published = [r.metadata.rank for r in found]
    if not published:
        step.add(
            Verdict.FAIL,
            "it publishes no rank yet: its ranks have not started, or failed to",
            side=role,
            next_action=f"wait until the {role} server is ready (kvpush wait-ready), or read "
            "its log for why its ranks did not start",
        )
        return None
    missing = sorted(set(range(max(published) + 1)) - set(published))
    if missing:
        step.add(
            Verdict.FAIL,
            f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} "
            f"{'are' if len(missing) > 1 else 'is'} not published, while "
            f"{', '.join(map(str, published))} {'are' if len(published) > 1 else 'is'}: a "
            "transfer for a missing rank cannot start",
            side=role,
            next_action=f"read the {role} server's log for why those ranks never started "
            "(each rank publishes once its runtime runs)",
        )
        return None
    return found


def served_ranks(refusal: str) -> list[int] | None:
    """The ranks an unknown-rank refusal says the engine serves ("0, 2", "0..7", "none
    (yet)"); None when the text says nothing we can read."""
    match = re.search(r"serves ranks (.+)$", refusal)
    if match is None:
        return None
    text = match.group(1).strip()
    if text.startswith("none"):
        return []
    if span := re.fullmatch(r"(\d+)\.\.(\d+)", text):
        return list(range(int(span.group(1)), int(span.group(2)) + 1))
    try:
        return sorted(int(part) for part in text.split(","))
    except ValueError:
        return None


def _side_channel_action(role: str, exc: SideChannelError, options: DoctorOptions) -> str:
    if isinstance(exc, AuthenticationRefused):
        if options.token is None:
            return (
                f"the {role} server needs the shared token: give it to the doctor "
                "(--token-file FILE, or KVPUSH_TOKEN)"
            )
        if "none configured" in str(exc):
            return (
                f"the {role} server has no token: start it with --token-file FILE (or "
                "KVPUSH_TOKEN), the same secret as its peer"
            )
        return (
            f"the {role} server holds another token than the one given: give both servers "
            "and the doctor the same secret (kvpush serve --token-file FILE, or KVPUSH_TOKEN)"
        )
    if isinstance(exc, IncompatiblePeer):
        return "run the same kvpush version on both servers (and the doctor)"
    if isinstance(exc, PeerUnreachable):
        text = str(exc)
        if "connected, but" in text:
            return _stopped_action(role, "side channel")
        if "closed the connection" in text:
            return (
                f"check that --{role} is the side-channel port and not the HTTP port; a "
                "kvpush side channel drops only frames over its size cap"
            )
        return f"start the {role} server, or give --{role} the port its side channel uses"
    if isinstance(exc, MalformedReply):
        return f"check that --{role} names a kvpush side channel (of kvpush {__version__})"
    return f"check the {role} server's log: a rank that cannot produce its metadata is named there"


# --------------------------------------------------------------------- 3: compatibility

_FIELD_ACTION = {
    "block_size_tokens": "start both servers with the same --block-size",
    "dtype": "serve the same model dtype (and KV cache dtype) on both servers",
    "layout": "use the same KV cache layout (attention backend) on both servers",
    "mode": "run both servers in push mode",
    "protocol_version": "run the same kvpush version on both servers",
    "regions": "serve the same model, with the same tensor-parallel layout, on both servers "
    "(each rank's layers, KV heads and head size must match)",
}


def _compatibility(options: DoctorOptions, seen: _Observed, step: StepResult) -> None:
    p_ranks, d_ranks = seen.ranks["prefill"], seen.ranks["decode"]
    for p, d in _paired_ranks(p_ranks, d_ranks, step):
        pair = f"rank {p.metadata.rank}"
        if len(p_ranks) != len(d_ranks):
            pair = f"prefill rank {p.metadata.rank} -> decode rank {d.metadata.rank}"
        differences = geometry_differences(p.metadata.geometry, d.metadata.geometry)
        if not differences:
            try:
                write_views(p.metadata.geometry, d.metadata.geometry)
            except UnsupportedShape as exc:
                step.add(
                    Verdict.FAIL,
                    f"{pair}: {exc}",
                    next_action="run TP sizes of which one is a whole multiple of the other "
                    "(and a decode block size a whole multiple of the prefill's), with a KV "
                    "cache layout that holds heads one after another (LBHNC)",
                )
                continue
            step.add(Verdict.OK, f"{pair}: compatible (hash {p.compat_hash})")
            continue
        for key, text in differences:
            step.add(
                Verdict.FAIL,
                f"{pair}: {text}",
                next_action=_FIELD_ACTION.get(key, "make the two servers' caches agree"),
            )
        step.add(
            Verdict.FAIL,
            f"{pair}: a transfer would be refused (compat hash prefill {p.compat_hash}, "
            f"decode {d.compat_hash})",
            next_action="fix the fields above; kvpush refuses the pair before any write",
        )
    for role, ranks in (("prefill", p_ranks), ("decode", d_ranks)):
        step.figures[role] = [_geometry_figures(r.metadata.geometry) for r in ranks]
    if p_ranks and d_ranks and step.verdict is Verdict.OK:
        routers = behind_routers(p_ranks[0].metadata.geometry, d_ranks[0].metadata.geometry)
        step.figures["pair"] = {"routers": routers.text}
        if routers.verdict is not Verdict.OK:
            step.add(routers.verdict, routers.text, next_action=routers.next_action)


def _paired_ranks(
    p_ranks: list[FetchResult], d_ranks: list[FetchResult], step: StepResult
) -> list[tuple[FetchResult, FetchResult]]:
    """The rank pairs a transfer between the two servers uses: rank r with rank r, or,
    where every rank says how it holds KV heads (vLLM engines), `rank_pairs` of the two
    TP sizes when one is a whole multiple of the other. What cannot pair is a fail."""
    if len(p_ranks) == len(d_ranks):
        return list(zip(p_ranks, d_ranks, strict=True))
    knows_heads = all(r.metadata.geometry.heads is not None for r in (*p_ranks, *d_ranks))
    small, large = sorted((len(p_ranks), len(d_ranks)))
    if knows_heads and small and large % small == 0:
        return [(p_ranks[p], d_ranks[d]) for p, d in rank_pairs(len(p_ranks), len(d_ranks))]
    why = (
        "neither TP size is a whole multiple of the other"
        if knows_heads
        else "their caches do not say how they hold KV heads, so a transfer pairs rank r "
        "with rank r"
    )
    step.add(
        Verdict.FAIL,
        f"prefill serves {len(p_ranks)} ranks, decode {len(d_ranks)}: {why}, so some ranks "
        "would have no peer",
        next_action="run both servers with the same tensor-parallel size"
        if not knows_heads
        else "run TP sizes of which one is a whole multiple of the other",
    )
    return list(zip(p_ranks, d_ranks, strict=False))


def geometry_differences(prefill: CacheGeometry, decode: CacheGeometry) -> list[tuple[str, str]]:
    """(field, phrase) for every compatibility field that differs, naming both sides."""
    ours, theirs = prefill.compat_fields(), decode.compat_fields()
    out: list[tuple[str, str]] = []
    for key in differing_compat_fields(ours, theirs):
        a, b = ours.get(key), theirs.get(key)
        if key == "regions":
            if _same_bytes_per_token(prefill, decode) and "block_size_tokens" in dict(out):
                # Only a consequence of the block size: one field to fix, named once.
                continue
            out.append((key, _region_difference(prefill, decode)))
        else:
            out.append((key, f"{key} differs: prefill {a!r}, decode {b!r}"))
    return out


def _same_bytes_per_token(prefill: CacheGeometry, decode: CacheGeometry) -> bool:
    a, b = prefill.regions, decode.regions
    return len(a) == len(b) and all(
        (x.name, x.layer, x.block_bytes * decode.block_size_tokens)
        == (y.name, y.layer, y.block_bytes * prefill.block_size_tokens)
        for x, y in zip(a, b, strict=True)
    )


def _region_difference(prefill: CacheGeometry, decode: CacheGeometry) -> str:
    a, b = prefill.regions, decode.regions
    if len(a) != len(b):
        return (
            f"regions differ: prefill registers {len(a)} ({prefill.num_layers} layers), "
            f"decode {len(b)} ({decode.num_layers} layers)"
        )
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for name in ("name", "layer", "block_bytes"):
            if getattr(x, name) != getattr(y, name):
                return (
                    f"regions differ first at #{i} in {name}: prefill {x.name} (layer "
                    f"{x.layer}, {x.block_bytes} bytes per block), decode {y.name} (layer "
                    f"{y.layer}, {y.block_bytes} bytes per block)"
                )
    return "regions differ"


def _geometry_figures(g: CacheGeometry) -> dict[str, object]:
    return {
        "layout": g.layout,
        "dtype": g.dtype,
        "block_size_tokens": g.block_size_tokens,
        "mode": g.mode,
        "num_layers": g.num_layers,
        "regions": len(g.regions),
        "num_blocks": g.num_blocks,
        "bytes_per_block": g.bytes_per_block,
        "registered_bytes": g.total_bytes,
        "devices": sorted({r.device for r in g.regions}),
    }


# ------------------------------------------------------------------------ 4: data plane


def _data_plane(options: DoctorOptions, seen: _Observed, step: StepResult) -> None:
    check_data_plane(
        step,
        {role: [r.metadata for r in found] for role, found in seen.ranks.items()},
        {role: (options.target(role).host, options.target(role).port) for role in ROLES},
        token=options.token,
        timeout_ms=options.timeout_ms,
    )


# -------------------------------------------------------------- 5: liveness and clocks


def _liveness(options: DoctorOptions, seen: _Observed, step: StepResult) -> None:
    deadlines: dict[str, float] = {}
    for role in ROLES:
        t = options.target(role)
        samples: list[float] = []
        for _ in range(options.round_trip_samples):
            try:
                r = fetch_metadata_timed(
                    t.host, t.port, 0, timeout_ms=options.timeout_ms, token=options.token
                )
            except SideChannelError as exc:
                step.add(
                    Verdict.FAIL,
                    f"it stopped answering: {type(exc).__name__}: {exc}",
                    side=role,
                    next_action=_side_channel_action(role, exc, options),
                )
                break
            samples.append(r.round_trip_s * 1000)
        figures: dict[str, object] = {}
        if samples:
            median = statistics.median(samples)
            figures["side_channel_round_trip_ms"] = {
                "min": round(min(samples), 3),
                "median": round(median, 3),
                "max": round(max(samples), 3),
                "samples": len(samples),
            }
            text = (
                f"side-channel round trip (connect, request, reply) over {len(samples)} tries: "
                f"min {min(samples):.2f} ms, median {median:.2f} ms, max {max(samples):.2f} ms"
            )
            if median > options.slow_round_trip_ms:
                step.add(
                    Verdict.WARN,
                    text,
                    side=role,
                    next_action=f"the {role} server answers slowly (over "
                    f"{options.slow_round_trip_ms:g} ms): check its host's load and the network "
                    "path; where that is expected, raise --slow-round-trip-ms",
                )
            else:
                step.add(Verdict.OK, text, side=role)
        health = seen.health.get(role)
        for key, value in (
            ("transfer_deadline_s", health.transfer_deadline_s if health else None),
            ("queue_timeout_s", health.queue_timeout_s if health else None),
        ):
            if value is not None:
                figures[key] = value
        if "transfer_deadline_s" in figures:
            deadlines[role] = float(figures["transfer_deadline_s"])  # type: ignore[arg-type]
            shown = ", ".join(
                f"{k.replace('_s', '')} {figures[k]} s"
                for k in ("transfer_deadline_s", "queue_timeout_s")
                if k in figures
            )
            step.add(Verdict.OK, f"in force: {shown.replace('_', ' ')}", side=role)
        step.figures[role] = figures
    decode_health = seen.health.get("decode")
    queue = decode_health.queue_timeout_s if decode_health is not None else None
    if queue is not None:
        for role, deadline in deadlines.items():
            if deadline <= queue:
                step.add(
                    Verdict.WARN,
                    f"the {role} server's transfer deadline ({deadline} s) is not above the "
                    f"decode server's queue timeout ({queue} s): a request that waits in the "
                    "decode queue for KV blocks can see its transfer fail first",
                    side=role,
                    next_action=f"start the {role} server with --transfer-deadline-s above "
                    f"{queue} (the decode server's --queue-timeout-s)",
                )
    if not deadlines:
        step.add(
            Verdict.OK,
            "transfer deadlines: not known (give --prefill-http and --decode-http to read them)",
        )
    _clock_bounds(options, seen, step)


def _clock_bounds(options: DoctorOptions, seen: _Observed, step: StepResult) -> None:
    """What the prefill's leases measured of each decode rank's clock: the data plane's
    heartbeat round trip, by which a lease is taken to end sooner than it may."""
    health = seen.health.get("prefill")
    transfers = health.transfers if health is not None else None
    if transfers is None:
        why = (
            "give --prefill-http to read what the prefill's leases measured"
            if health is None
            else "the prefill server's /health does not publish what its leases measured; "
            "kvpush serve's does"
        )
        step.add(Verdict.OK, f"heartbeat round trip and clock bound: not known ({why})")
        return
    found: dict[str, object] = {}
    for r in seen.ranks.get("decode", []):
        bound = transfers.clock_bounds.get(r.metadata.agent_name)
        rank = r.metadata.rank
        if bound is None:
            step.add(
                Verdict.OK,
                f"heartbeat round trip to decode rank {rank}: not measured yet (no transfer "
                "between them since the prefill server started; its first one measures it)",
            )
            continue
        rtt_ms = bound.round_trip_s * 1000
        found[str(rank)] = {"round_trip_ms": round(rtt_ms, 3), "age_s": round(bound.age_s, 1)}
        text = (
            f"data-plane heartbeat round trip to decode rank {rank}: {rtt_ms:.2f} ms "
            f"({bound.age_s:.0f} s ago): the prefill bounds that rank's clock to "
            f"within {rtt_ms:.2f} ms, and takes each lease to end that much sooner"
        )
        if rtt_ms > options.slow_round_trip_ms:
            step.add(
                Verdict.WARN,
                text,
                side="prefill",
                next_action="heartbeats between the servers' agents are slow (over "
                f"{options.slow_round_trip_ms:g} ms): check the hosts' load and the "
                "transport UCX uses between them (UCX_TLS, UCX_NET_DEVICES); where that "
                "is expected, raise --slow-round-trip-ms",
            )
        else:
            step.add(Verdict.OK, text, side="prefill")
    if found:
        step.figures.setdefault("prefill", {})["heartbeat_round_trip_ms"] = found  # type: ignore[index]


# ---------------------------------------------------------------------------- 6: health


def _health(options: DoctorOptions, seen: _Observed, step: StepResult) -> None:
    asked = [r for r in ROLES if options.target(r).http is not None]
    if not asked:
        step.add(
            Verdict.SKIP,
            "not checked: no HTTP URLs given (--prefill-http, --decode-http)",
        )
        return
    for role in asked:
        _one_health(role, options, seen, step)


def _one_health(role: str, options: DoctorOptions, seen: _Observed, step: StepResult) -> None:
    base = options.target(role).http
    assert base is not None
    body = seen.health.get(role) or ServerHealth()
    status = body.status
    figures: dict[str, object] = {"status": status}
    if status != "ok":
        failure = body.runtime_failure or body.side_channel_failure or ""
        step.add(
            Verdict.FAIL,
            f"/health says {status!r} ({seen.health_status.get(role)}){': ' if failure else ''}"
            f"{failure}",
            side=role,
            next_action=f"restart the {role} server; its log says why it stopped serving",
        )
    try:
        samples = get_metrics(base, options.timeout_s)
    except HttpFailed as exc:
        _http_failed(step, role, exc, f"check that --{role}-http is a kvpush server")
        step.figures[role] = figures
        return
    if not any(s.name.startswith("kvpush_") for s in samples):
        step.add(
            Verdict.OK,
            f"{base}/metrics has no kvpush serving metrics (not a kvpush serve server?): "
            "blocks and transfers are not known",
            side=role,
        )
        step.figures[role] = figures
        return
    figures.update(_metric_figures(samples))
    transfers = body.transfers
    if transfers is not None:
        figures["runtime"] = msgspec.to_builtins(transfers)
    requests = body.side_channel_requests
    if requests is not None:
        figures["side_channel_requests"] = msgspec.to_builtins(requests)
    step.figures[role] = figures
    held, blocks = figures.get("kv_blocks_held"), figures.get("kv_blocks_total")
    in_flight = _in_flight(body)
    parts = [f"blocks held {_n(held)} of {_n(blocks)}"]
    if in_flight is not None:
        oldest = transfers.oldest_in_flight_s if transfers is not None else None
        parts.append(
            f"transfers in flight {in_flight}"
            + (f" (the oldest began {oldest:.1f} s ago)" if isinstance(oldest, float) else "")
        )
    parts.append(
        f"requests running {_n(figures.get('requests_running'))}, waiting "
        f"{_n(figures.get('requests_waiting'))}"
    )
    moved = figures.get("transfer_bytes")
    parts.append(
        f"transfers finished {_n(figures.get('transfers_finished'))}"
        + (f" ({_n(moved)} bytes)" if moved else "")
        + f", failed {_n(figures.get('transfers_failed'))}"
    )
    step.add(Verdict.OK, "; ".join(parts), side=role)
    failures = figures.get("transfer_failures")
    if isinstance(failures, dict) and failures:
        step.add(
            Verdict.WARN,
            "transfers have failed since it started: "
            + ", ".join(f"{k} {v:g}" for k, v in sorted(failures.items())),
            side=role,
            next_action=f"read the {role} server's log for those transfers; "
            "peer_timeout: raise --transfer-deadline-s or find the stalled peer",
        )
    forged = transfers.forged_messages if transfers is not None else None
    if forged:
        step.add(
            Verdict.WARN,
            "data-plane messages dropped unread because of who sent them: "
            + ", ".join(f"{k} {v}" for k, v in sorted(forged.items())),
            side=role,
            next_action="something that is not a verified peer is writing to this server's "
            "agent: set a token on both servers, and find that agent's host",
        )
    elif transfers is not None:
        step.add(Verdict.OK, "no forged or dropped data-plane messages", side=role)
    if requests is not None:
        bad = {k: v for k in _BAD_REQUESTS if (v := getattr(requests, k))}
        if bad:
            step.add(
                Verdict.WARN,
                "side-channel requests refused or dropped since it started: "
                + ", ".join(f"{k} {v}" for k, v in sorted(bad.items())),
                side=role,
                next_action="a client without the token, or of another kvpush version, "
                "asks this side channel: check its peers' --token-file and versions",
            )
    _cpu_share(role, base, options, seen, step, figures)


def _cpu_share(
    role: str,
    base: str,
    options: DoctorOptions,
    seen: _Observed,
    step: StepResult,
    figures: dict[str, object],
) -> None:
    """The server's CPU share between its /health of step 1 and one read now (at least
    `cpu_window_s` later, on the server's clock): an idle kvpush server should use
    almost none; one that spins is a busy-polling loop."""
    known = seen.health.get(role)
    first = known.cpu if known is not None else None
    if first is None:
        return  # not kvpush serve: its CPU is not published
    wait = options.cpu_window_s - (time.monotonic() - seen.health_read_at.get(role, 0.0))
    if wait > 0:
        time.sleep(wait)
    try:
        _, body = get_health(base, options.timeout_s)
    except HttpFailed as exc:
        _http_failed(step, role, exc, f"the {role} server stopped answering /health")
        return
    second = body.cpu if body is not None else None

    def spent(key: str) -> float | None:
        a = getattr(first, key)
        b = getattr(second, key) if second is not None else None
        return None if a is None or b is None else b - a

    window, process_s, thread_s = spent("at_s"), spent("process_s"), spent("runtime_thread_s")
    if window is None or window <= 0 or process_s is None:
        return  # an answer without these figures (or a server restarted between)
    process = process_s / window
    share: dict[str, object] = {"window_s": round(window, 3), "process": round(process, 3)}
    text = f"CPU over {window:.1f} s: the process {process:.0%} of a core"
    if thread_s is not None:
        thread = thread_s / window
        share["runtime_thread"] = round(thread, 3)
        text += f", its runtime thread {thread:.0%}"
    busy = [_in_flight(b) for b in (seen.health[role], body)]
    idle = busy == [0, 0] and figures.get("requests_running") in (0, None)
    share["idle"] = idle
    figures["cpu"] = share
    if not idle:
        step.add(Verdict.OK, f"{text} (while serving)", side=role)
    elif process > options.busy_idle_cpu:
        step.add(
            Verdict.WARN,
            f"{text}, with nothing in flight: an idle server should use almost none",
            side=role,
            next_action=f"find the thread that spins (top -H -p PID on the {role} host): "
            "NIXL's own progress thread (kvpush turns it off; a NIXL or UCX setting may "
            "turn it on) or an --idle-poll-ms near 0",
        )
    else:
        step.add(Verdict.OK, f"{text}, with nothing in flight", side=role)


def _in_flight(health: ServerHealth | None) -> int | None:
    transfers = health.transfers if health is not None else None
    return transfers.in_flight if transfers is not None else None


_BAD_REQUESTS = ("refused_auth", "malformed", "dropped", "internal_errors")


def _n(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "?" if value is None else str(value)


def _metric_figures(samples: list[Sample]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, name in (
        ("kv_blocks_total", "kvpush_kv_blocks_total"),
        ("kv_blocks_held", "kvpush_kv_blocks_held"),
        ("requests_running", "kvpush_requests_running"),
        ("requests_waiting", "kvpush_requests_waiting"),
        ("transfer_bytes", "kvpush_transfer_bytes_total"),
        ("transfers_rejected", "kvpush_transfers_rejected_total"),
    ):
        out[key] = total(samples, name)
    out["transfers_finished"] = total(samples, "kvpush_transfers_total", outcome="finished") or 0
    failures: dict[str, float] = {}
    for s in samples:
        if s.name == "kvpush_transfers_total" and s.labels.get("outcome") == "failed":
            reason = s.labels.get("reason", "unknown")
            failures[reason] = failures.get(reason, 0) + s.value
    out["transfers_failed"] = sum(failures.values())
    out["transfer_failures"] = failures
    return out


_Check = Callable[[DoctorOptions, _Observed, StepResult], None]
_STEPS: tuple[tuple[int, str, _Check], ...] = (
    (1, "addresses", _addresses),
    (2, "side channel", _side_channel),
    (3, "compatibility", _compatibility),
    (4, "data plane", _data_plane),
    (5, "liveness and clocks", _liveness),
    (6, "health", _health),
)
