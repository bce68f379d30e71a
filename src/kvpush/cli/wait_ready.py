"""`kvpush wait-ready`: wait for a freshly started server, failing at once if it dies.

Every round checks the process first (its exit status is printed when it is our child:
`server & exec kvpush wait-ready --pid $!` makes it so), then the HTTP endpoint (any 2xx)
and the side channel, each with its own deadline.
"""

from __future__ import annotations

import argparse
import urllib.parse

from kvpush.config import load_token
from kvpush.errors import ConfigError
from kvpush.net import parse_host_port
from kvpush.procs.readiness import DEFAULT_POLL_INTERVAL_S, wait_ready


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "wait-ready",
        help="wait for a started server: its process, HTTP endpoint and side channel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--pid", type=int, required=True, help="the server's process id")
    p.add_argument("--http", metavar="URL", help="an HTTP URL that must answer 2xx")
    p.add_argument("--side-channel", metavar="HOST:PORT", help="a side channel that must answer")
    p.add_argument("--rank", type=int, default=0, help="rank to ask the side channel for")
    p.add_argument("--token-file", help="shared secret file (default: $KVPUSH_TOKEN, if set)")
    p.add_argument(
        "--timeout", type=float, default=60.0, help="deadline of each check, s (default 60)"
    )
    p.add_argument("--http-timeout", type=float, help="deadline of the HTTP check, s")
    p.add_argument("--side-channel-timeout", type=float, help="deadline of the side channel, s")
    p.add_argument(
        "--poll-interval",
        type=float,
        default=DEFAULT_POLL_INTERVAL_S,
        help="seconds between rounds (default %(default)s)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.pid <= 0:
        raise ConfigError(f"--pid must be a positive process id, got {args.pid}")
    for name in ("timeout", "http_timeout", "side_channel_timeout", "poll_interval"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.http is not None:
        _check_http_url(args.http)
    side_channel = parse_host_port(args.side_channel) if args.side_channel else None
    token = load_token(args.token_file) if side_channel else None
    report = wait_ready(
        args.pid,
        http_url=args.http,
        side_channel=side_channel,
        rank=args.rank,
        token=token,
        timeout_s=args.timeout,
        http_timeout_s=args.http_timeout,
        side_channel_timeout_s=args.side_channel_timeout,
        poll_interval_s=args.poll_interval,
    )
    parts = [f"process {report.pid} running"]
    if report.http_status is not None:
        parts.append(f"HTTP {args.http} answered {report.http_status}")
    if report.side_channel is not None:
        meta = report.side_channel.metadata
        rtt_ms = report.side_channel.round_trip_s * 1000
        parts.append(
            f"side channel {args.side_channel} rank {meta.rank} answered "
            f"(engine {meta.engine_id}, round trip {rtt_ms:.2f} ms)"
        )
    print(f"ready after {report.elapsed_s:.2f} s ({report.rounds} rounds): " + "; ".join(parts))
    return 0


def _check_http_url(url: str) -> None:
    """A URL that can never answer is refused now, not waited for until the deadline."""
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        raise ConfigError(f"--http {url!r}: bad port: expected http://HOST:PORT/PATH") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--http {url!r} is not an HTTP URL: expected http://HOST:PORT/PATH")
