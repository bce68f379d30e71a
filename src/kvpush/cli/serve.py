"""`kvpush serve`: the reference OpenAI-compatible server, in one of three roles."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvpush.errors import ConfigError


def add_parser(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (prefill, decode or both)",
        description=(
            "Serve a local Hugging Face Llama checkpoint with the reference engine. "
            "--role both serves complete requests; prefill and decode split them, with "
            "the KV cache pushed from prefill to decode through kvpush."
        ),
    )
    p.add_argument("--model", required=True, help="checkpoint directory (see make-model)")
    p.add_argument("--role", choices=("both", "prefill", "decode"), default="both")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (IPv4, IPv6, name)")
    p.add_argument(
        "--advertise-host",
        default=None,
        help="address peers are told to reach the side channel at (default: --host); for a "
        "server that listens on a wildcard, or behind an address it cannot bind",
    )
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument(
        "--side-channel-port", type=int, default=None, help="kvpush side channel (prefill/decode)"
    )
    p.add_argument("--served-model-name", default=None, help="model name (default: dir name)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks (default 1024)")
    p.add_argument("--max-batch-tokens", type=int, default=4096)
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        help="prompt-lookup draft tokens per step; 0 disables speculation (default 0)",
    )
    p.add_argument("--prompt-lookup-max", type=int, default=3)
    p.add_argument("--prompt-lookup-min", type=int, default=1)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--layerwise", action="store_true", help="push each layer as it is computed")
    p.add_argument(
        "--idle-poll-ms",
        type=float,
        default=5.0,
        help="how often an idle kvpush runtime looks for new registrations (default 5 ms)",
    )
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=1.0,
        help="Python's thread switch interval in this process (default 1 ms; Python's own: 5)",
    )
    p.add_argument(
        "--token-file",
        default=None,
        help="shared secret for the side channel (default: $KVPUSH_TOKEN, else none)",
    )
    p.add_argument(
        "--allow-doctor-writes",
        action="store_true",
        help="let `kvpush doctor` write into this server's 4 MiB scratch buffer (never a KV "
        "block) to test the data plane, though it has no token (with a token it always may: "
        "the doctor proves the token)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=512,
        help="requests that may wait for KV blocks; one more is refused with 429 (default 512)",
    )
    p.add_argument(
        "--queue-timeout-s",
        type=float,
        default=30.0,
        help="a request waiting for KV blocks longer is refused with 503 (default 30)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 * 1024 * 1024,
        help="larger request bodies are refused with 413 (default 8 MiB)",
    )
    p.add_argument(
        "--transfer-deadline-s",
        type=float,
        default=60.0,
        help="a KV transfer not finished by then fails (default 60); keep it above the "
        "decode servers' --queue-timeout-s",
    )
    p.add_argument(
        "--claim-window-s",
        type=float,
        default=10.0,
        help="a prefill gives up a KV transfer that no decode registered for or claimed "
        "(decodes claim the requests they hold queued) for this long (default 10): the "
        "bound on holding blocks for a decode that died before registering",
    )
    p.add_argument(
        "--liveness-timeout-s",
        type=float,
        default=3.0,
        help="a peer silent this long is declared gone and its KV transfers fail (default 3; "
        "heartbeats go every 0.5 s); raise it where the engine may hold the runtime's thread "
        "off for seconds",
    )
    p.add_argument(
        "--drain-s",
        type=float,
        default=10.0,
        help="on SIGTERM, after HTTP stopped, how long held KV transfers may still finish "
        "before the rest are handed back and their peers told (default 10)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvpush.serving.app import ServeOptions, serve

    if args.switch_interval_ms <= 0:
        raise ConfigError(f"--switch-interval-ms must be positive, got {args.switch_interval_ms}")
    # While the engine thread computes, each wake-up of the kvpush runtime's thread waits
    # for the GIL for up to one switch interval; at Python's 5 ms that dominated a
    # transfer's latency (scripts/runtime-latency --busy both: p50 14-26 ms at 5 ms,
    # 5-7 ms at 1 ms). Process-wide, so it is set here, never by the library.
    sys.setswitchinterval(args.switch_interval_ms / 1000)
    return serve(
        ServeOptions(
            model=args.model,
            role=args.role,
            host=args.host,
            advertise_host=args.advertise_host,
            port=args.port,
            side_channel_port=args.side_channel_port,
            served_model_name=args.served_model_name,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_batch_tokens=args.max_batch_tokens,
            speculative_tokens=args.speculative_tokens,
            prompt_lookup_max=args.prompt_lookup_max,
            prompt_lookup_min=args.prompt_lookup_min,
            prefix_caching=not args.no_prefix_caching,
            layerwise=args.layerwise,
            idle_poll_ms=args.idle_poll_ms,
            token_file=args.token_file,
            allow_doctor_writes=args.allow_doctor_writes,
            log_level=args.verbose,
            max_waiting=args.max_waiting,
            queue_timeout_s=args.queue_timeout_s,
            max_body_bytes=args.max_body_bytes,
            transfer_deadline_s=args.transfer_deadline_s,
            claim_window_s=args.claim_window_s,
            liveness_timeout_s=args.liveness_timeout_s,
            drain_s=args.drain_s,
        )
    )
