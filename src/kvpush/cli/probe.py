"""`kvpush probe`: does this side channel answer with valid, compatible metadata for a rank?"""

from __future__ import annotations

import argparse
import json
import sys

import msgspec

from kvpush.config import load_token
from kvpush.errors import KVPushError, SideChannelError
from kvpush.geometry import CacheGeometry
from kvpush.net import parse_host_port, zmq_address
from kvpush.sidechannel.client import FetchResult, fetch_metadata, fetch_metadata_timed


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "probe",
        help="check a side channel: exit 0 only on valid, compatible metadata",
        description=__doc__,
    )
    p.add_argument("--host", default="127.0.0.1", help="IPv4, IPv6 or name (default %(default)s)")
    p.add_argument("--port", type=int, required=True, help="side-channel port")
    p.add_argument("--rank", type=int, default=0, help="rank to ask for (default 0)")
    p.add_argument(
        "--timeout-ms", type=int, default=2000, help="give up after this long (default 2000)"
    )
    p.add_argument("--token-file", help="shared secret file (default: $KVPUSH_TOKEN, if set)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    expect = p.add_mutually_exclusive_group()
    expect.add_argument(
        "--expect-compat-hash", metavar="HASH", help="refuse a peer whose hash differs"
    )
    expect.add_argument(
        "--expect-peer",
        metavar="HOST:PORT",
        help="refuse a peer incompatible with the engine at HOST:PORT (same rank)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.timeout_ms <= 0:
        raise SideChannelError(f"--timeout-ms must be positive, got {args.timeout_ms}")
    token = load_token(args.token_file)
    try:
        expect_geometry = _reference_geometry(args, token)
        result = fetch_metadata_timed(
            args.host,
            args.port,
            args.rank,
            timeout_ms=args.timeout_ms,
            token=token,
            expect_compat_hash=args.expect_compat_hash,
            expect_geometry=expect_geometry,
        )
    except KVPushError as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": type(exc).__name__, "message": str(exc)}))
        raise
    if args.json:
        print(json.dumps(_as_json(args, result)))
    else:
        print(_as_text(args, result))
    sys.stdout.flush()
    return 0


def _reference_geometry(args: argparse.Namespace, token: str | None) -> CacheGeometry | None:
    if args.expect_peer is None:
        return None
    host, port = parse_host_port(args.expect_peer)
    try:
        meta = fetch_metadata(host, port, args.rank, timeout_ms=args.timeout_ms, token=token)
    except SideChannelError as exc:
        raise type(exc)(f"the reference peer --expect-peer {args.expect_peer}: {exc}") from None
    return meta.geometry


def _as_json(args: argparse.Namespace, result: FetchResult) -> dict[str, object]:
    meta = result.metadata
    geometry = meta.geometry
    return {
        "ok": True,
        "address": zmq_address(args.host, args.port),
        "rank": meta.rank,
        "round_trip_ms": round(result.round_trip_s * 1000, 3),
        "engine_id": meta.engine_id,
        "incarnation": meta.incarnation,
        "role": meta.role,
        "kvpush_version": meta.kvpush_version,
        "protocol_version": result.peer_protocol_version,
        "compat_hash": result.compat_hash,
        "agent_name": meta.agent_name,
        "agent_metadata_bytes": len(meta.agent_metadata),
        "layout": geometry.layout,
        "dtype": geometry.dtype,
        "block_size_tokens": geometry.block_size_tokens,
        "num_layers": geometry.num_layers,
        "num_blocks": geometry.num_blocks,
        "bytes_per_block": geometry.bytes_per_block,
        "registered_bytes": geometry.total_bytes,
        "regions": msgspec.to_builtins(geometry.regions),
    }


def _as_text(args: argparse.Namespace, result: FetchResult) -> str:
    meta = result.metadata
    g = meta.geometry
    agent = (
        f"{meta.agent_name} ({len(meta.agent_metadata)} bytes of metadata)"
        if meta.agent_name
        else "none (no transport agent published)"
    )
    return "\n".join(
        [
            f"{zmq_address(args.host, args.port)} rank {meta.rank}: OK, round trip "
            f"{result.round_trip_s * 1000:.3f} ms",
            f"  engine       {meta.engine_id} (incarnation {meta.incarnation}, role {meta.role})",
            f"  kvpush       {meta.kvpush_version}, protocol {result.peer_protocol_version}, "
            f"compat hash {result.compat_hash}",
            f"  agent        {agent}",
            f"  cache        {g.layout}, {g.dtype}, {g.block_size_tokens} tokens per block, "
            f"{g.num_layers} layers",
            f"  regions      {len(g.regions)} x {g.num_blocks} blocks, {g.bytes_per_block} bytes "
            f"per block id, {g.total_bytes} bytes registered ({_human(g.total_bytes)})",
        ]
    )


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{n} B"
        size /= 1024
    return f"{n} B"
