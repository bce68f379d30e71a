"""`kvpush proxy`: split each completion into a prefill leg and a decode leg, at once."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "proxy",
        help="OpenAI-compatible proxy in front of prefill and decode servers",
        description=(
            "Send each /v1/completions request to a prefill server and a decode server "
            "concurrently (push mode) and relay the decode server's answer."
        ),
    )
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers")
    p.add_argument(
        "--prefill-side-channel",
        nargs="+",
        metavar="HOST:PORT",
        help=(
            "the side channel of each --prefill server, in the same order, for servers "
            "whose /health does not tell it (vLLM with KvpushConnector)"
        ),
    )
    p.add_argument(
        "--decode-side-channel",
        nargs="+",
        metavar="HOST:PORT",
        help=(
            "the side channel of each --decode server, in the same order, for servers "
            "whose /health does not tell it (vLLM with KvpushConnector): each transfer "
            "then goes only to the decode it is for"
        ),
    )
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--{role}-dp",
            type=int,
            default=1,
            metavar="N",
            help=(
                f"the data-parallel size of every --{role} server (vLLM's "
                "--data-parallel-size): each leg goes to one engine, named by the "
                "X-data-parallel-rank header, and names that engine's side channel (the "
                f"given --{role}-side-channel port plus its index); default 1"
            ),
        )
    p.add_argument(
        "--token-file",
        default=None,
        help=(
            "the servers' shared secret, sent with the proxy's cancels (POST /kvpush/abort) "
            "(default: $KVPUSH_TOKEN, else none)"
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvpush.config import load_token
    from kvpush.errors import ConfigError
    from kvpush.net import check_port, parse_host_port
    from kvpush.serving.proxy import ProxySettings, run_proxy

    for url in [*args.prefill, *args.decode]:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"bad server URL {url!r}: expected http://HOST:PORT")

    def side_channels(role: str) -> list[tuple[str, int]] | None:
        given, servers = getattr(args, f"{role}_side_channel"), getattr(args, role)
        if given is None:
            return None
        if len(given) != len(servers):
            raise ConfigError(
                f"{len(given)} --{role}-side-channel for {len(servers)} --{role} servers: "
                "expected one per server"
            )
        return [parse_host_port(text) for text in given]

    settings = ProxySettings(
        prefill_urls=args.prefill,
        decode_urls=args.decode,
        prefill_side_channels=side_channels("prefill"),
        decode_side_channels=side_channels("decode"),
        token=load_token(args.token_file),
        prefill_dp=args.prefill_dp,
        decode_dp=args.decode_dp,
    )
    return run_proxy(settings, args.host, check_port(args.port))
