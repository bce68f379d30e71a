"""`kvpush doctor`: check a live prefill/decode pair, step by step, with the next action."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from kvpush.config import load_token
from kvpush.errors import AddressError, ConfigError
from kvpush.net import parse_host_port

EXIT_USAGE = 2


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="explain what is wrong with a prefill/decode pair, with the next action",
        description=__doc__
        + " Steps: addresses, side channel, compatibility, data plane, liveness and clocks, "
        "health; it stops explaining at the first step that fails. Exit 0: nothing failed "
        "(warnings allowed); 1: a step failed; 2: usage.",
    )
    p.add_argument("--prefill", metavar="HOST:PORT", help="prefill side channel")
    p.add_argument("--decode", metavar="HOST:PORT", help="decode side channel")
    p.add_argument("--prefill-http", metavar="URL", help="prefill HTTP base URL (http://H:P)")
    p.add_argument("--decode-http", metavar="URL", help="decode HTTP base URL (http://H:P)")
    p.add_argument(
        "--proxy",
        metavar="URL",
        help="instead of --prefill/--decode: every prefill/decode pair behind this kvpush proxy",
    )
    p.add_argument("--token-file", help="shared secret file (default: $KVPUSH_TOKEN, if set)")
    p.add_argument(
        "--timeout-ms",
        type=int,
        default=2000,
        help="bound on every connection and request (default 2000)",
    )
    p.add_argument(
        "--slow-round-trip-ms",
        type=float,
        default=100.0,
        help="a side-channel round trip slower than this (median) is a warning (default 100)",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvpush.doctor import DoctorOptions, Target, run_doctor
    from kvpush.doctor.http import base_url
    from kvpush.doctor.proxy import check_proxy

    try:
        if args.timeout_ms <= 0:
            raise ConfigError(f"--timeout-ms must be positive, got {args.timeout_ms}")
        if args.slow_round_trip_ms <= 0:
            raise ConfigError(
                f"--slow-round-trip-ms must be positive, got {args.slow_round_trip_ms}"
            )
        if args.proxy is not None:
            if args.prefill or args.decode or args.prefill_http or args.decode_http:
                raise ConfigError("give either --proxy, or --prefill and --decode, not both")
            base_url(args.proxy)
            placeholder = Target("prefill", "-", 0)
            targets = {"prefill": placeholder, "decode": replace(placeholder, role="decode")}
        elif args.prefill is None or args.decode is None:
            raise ConfigError("give --prefill HOST:PORT and --decode HOST:PORT, or --proxy URL")
        else:
            targets = {}
            for role in ("prefill", "decode"):
                host, port = parse_host_port(getattr(args, role))
                url = getattr(args, f"{role}_http")
                targets[role] = Target(role, host, port, base_url(url) if url else None)
        token = load_token(args.token_file)
    except (AddressError, ConfigError) as exc:
        print(f"kvpush doctor: {exc}", file=sys.stderr)
        return EXIT_USAGE
    options = DoctorOptions(
        prefill=targets["prefill"],
        decode=targets["decode"],
        token=token,
        timeout_ms=args.timeout_ms,
        slow_round_trip_ms=args.slow_round_trip_ms,
    )
    report = check_proxy(args.proxy, options) if args.proxy is not None else run_doctor(options)
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        print(report.render_text())
    sys.stdout.flush()
    return report.exit_code
