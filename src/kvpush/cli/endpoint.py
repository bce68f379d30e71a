"""`kvpush endpoint`: register a synthetic KV cache and serve its side channel until stopped."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import threading
import uuid
from types import FrameType

from kvpush import __version__
from kvpush.config import SideChannelConfig, load_token
from kvpush.errors import ConfigError
from kvpush.net import zmq_address
from kvpush.transports.base import Transport

DEFAULT_PORT = 5600
READY_PREFIX = "kvpush endpoint ready:"


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "endpoint",
        help="serve a synthetic KV cache's side channel (what probe and bench talk to)",
        description=__doc__,
    )
    shape = p.add_argument_group("the synthetic KV cache (a --preset, or --block-bytes)")
    shape.add_argument("--preset", help="model shape: llama-3.1-8b, llama-3-70b or tiny")
    shape.add_argument("--layers", type=int, help="layers (default: the preset's, else 4)")
    shape.add_argument("--blocks", type=int, default=64, help="blocks per region (default 64)")
    shape.add_argument("--block-bytes", type=int, help="bytes of K and V of one block of one layer")
    shape.add_argument("--dtype", help="torch dtype (default: the preset's, else bfloat16)")
    shape.add_argument(
        "--layout", default="kv_separate/NHD", help="KV layout (default %(default)s)"
    )
    shape.add_argument("--block-size", type=int, help="tokens per block (default 16)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address or name to bind (default %(default)s)"
    )
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="side-channel port; 0 picks a free one"
    )
    p.add_argument("--ranks", type=int, default=1, help="serve ranks 0..N-1 (default 1)")
    p.add_argument("--role", choices=("sender", "receiver", "both"), default="both")
    p.add_argument("--engine-id", help="engine id to publish (default endpoint-HOSTNAME-PID)")
    p.add_argument("--token-file", help="shared secret file (default: $KVPUSH_TOKEN, if set)")
    p.add_argument(
        "--transport",
        choices=("none", "nixl"),
        default="none",
        help="register the cache with a NIXL agent and publish its metadata (default none)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # torch is imported here, not at the top: other commands must start fast.
    from kvpush.kvcache import synthetic_kv_cache
    from kvpush.sidechannel import MetadataServer, PeerMetadata

    if args.ranks < 1:
        raise ConfigError(f"--ranks must be at least 1, got {args.ranks}")
    if args.preset is None and args.block_bytes is None:
        args.block_bytes = 64 * 1024
    token = load_token(args.token_file)
    engine_id = args.engine_id or f"endpoint-{socket.gethostname()}-{os.getpid()}"
    incarnation = uuid.uuid4().hex
    caches = [
        synthetic_kv_cache(
            args.layers if args.layers is not None or args.preset else 4,
            args.blocks,
            block_bytes=args.block_bytes,
            preset=args.preset,
            dtype=args.dtype,
            layout=args.layout,
            block_size_tokens=args.block_size,
        )
        for _ in range(args.ranks)
    ]
    transports: list[Transport] = []
    ranks: dict[int, PeerMetadata] = {}
    stop = threading.Event()
    try:
        for rank, cache in enumerate(caches):
            agent_name, agent_metadata = "", b""
            if args.transport == "nixl":
                transport = _nixl_transport(f"{engine_id}-r{rank}-{incarnation[:8]}")
                transports.append(transport)
                transport.start()
                transport.register_memory(cache.geometry)
                agent_name, agent_metadata = transport.agent_name, transport.metadata()
            ranks[rank] = PeerMetadata(
                engine_id=engine_id,
                incarnation=incarnation,
                rank=rank,
                role=args.role,
                agent_name=agent_name,
                agent_metadata=agent_metadata,
                geometry=cache.geometry,
                kvpush_version=__version__,
            )
        config = SideChannelConfig(token=token)
        server = MetadataServer(args.host, args.port, config, ranks)

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            with server:
                geometry = caches[0].geometry
                print(
                    f"{READY_PREFIX} side channel {zmq_address(args.host, server.port)} "
                    f"port={server.port} engine_id={engine_id} incarnation={incarnation} "
                    f"ranks={args.ranks} layout={geometry.layout} dtype={geometry.dtype} "
                    f"regions={len(geometry.regions)} blocks={geometry.num_blocks} "
                    f"registered_bytes={geometry.total_bytes * args.ranks} "
                    f"auth={'token' if token else 'none'} transport={args.transport}",
                    flush=True,
                )
                while not stop.wait(3600):
                    pass
                stats = server.statistics()
            print(
                f"kvpush endpoint stopped: served {stats.served}, refused {stats.refused}, "
                f"dropped {stats.dropped}",
                flush=True,
            )
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        for transport in transports:
            transport.close()
    return 0


def _nixl_transport(name: str) -> Transport:
    """The NIXL transport, if this build of kvpush has it."""
    try:
        module = importlib.import_module("kvpush.transports.nixl")
        transport = module.NixlTransport(name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--transport nixl is not available: {exc}") from None
    if not isinstance(transport, Transport):
        raise ConfigError("kvpush.transports.nixl.NixlTransport is not a Transport")
    return transport
