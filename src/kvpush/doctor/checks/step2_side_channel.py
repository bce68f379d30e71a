"""Step 2, side channel: every rank each server publishes, read with the token; the
roles and agents they publish; the token proven both ways."""

from __future__ import annotations

import re

from kvpush import __version__
from kvpush.doctor.checks.options import MAX_RANKS, DoctorOptions, Observed, stopped_action
from kvpush.doctor.report import StepResult, Verdict
from kvpush.errors import (
    AuthenticationRefused,
    IncompatiblePeer,
    MalformedReply,
    PeerUnreachable,
    SideChannelError,
    UnknownRank,
)
from kvpush.geometry import PROTOCOL_VERSION
from kvpush.roles import PAIR_ROLES
from kvpush.sidechannel.client import FetchResult, fetch_metadata_timed

# What a prefill or decode server's ranks publish as their role.
_PUBLISHED_ROLE = {"prefill": ("sender", "both"), "decode": ("receiver", "both")}


def check_side_channel(options: DoctorOptions, seen: Observed, step: StepResult) -> None:
    for role in PAIR_ROLES:
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
                next_action=side_channel_action(role, exc, options),
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


def side_channel_action(role: str, exc: SideChannelError, options: DoctorOptions) -> str:
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
            return stopped_action(role, "side channel")
        if "closed the connection" in text:
            return (
                f"check that --{role} is the side-channel port and not the HTTP port; a "
                "kvpush side channel drops only frames over its size cap"
            )
        return f"start the {role} server, or give --{role} the port its side channel uses"
    if isinstance(exc, MalformedReply):
        return f"check that --{role} names a kvpush side channel (of kvpush {__version__})"
    return f"check the {role} server's log: a rank that cannot produce its metadata is named there"
