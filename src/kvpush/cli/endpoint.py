"""`kvpush endpoint`: register a synthetic KV cache and serve its side channel until stopped.

With `--transport nixl` every rank runs a real `PushRuntime` over a `NixlTransport`: the
endpoint is then a live kvpush peer (it polls its agent, answers heartbeats, can receive
and send transfers) and publishes the runtime's metadata. Rank 0 also answers the remote
bench's control requests (`kvpush.bench.endpoint_service`), so that `kvpush bench
--target` can push kvpush transfers into it and have them checked.

Threads: the side channel's server thread and each runtime's threads, all started here
and joined before exit; the main thread takes the runtimes' results until a signal.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import threading
import uuid
from types import FrameType
from typing import Any

from kvpush import __version__
from kvpush.bench.endpoint_service import BENCH_KINDS, BenchService
from kvpush.config import SideChannelConfig, load_token
from kvpush.doctor_probe import DoctorProbe
from kvpush.errors import ConfigError, SideChannelError
from kvpush.geometry import CacheGeometry
from kvpush.net import is_wildcard, zmq_address
from kvpush.node import Node, NodeIdentity, RankSettings, TransportFactory
from kvpush.runtime import PushRuntime
from kvpush.sidechannel import (
    ControlHandler,
    MetadataServer,
    PeerMetadata,
    RequestRejected,
    SideChannelStats,
)
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
        "--advertise-host",
        help="host peers reach this side channel at, sent to senders so they can handshake "
        "back (default: --host, or this machine's name when --host is a wildcard)",
    )
    p.add_argument(
        "--transport",
        choices=("none", "nixl"),
        default="none",
        help="run a kvpush runtime over NIXL on the cache and publish its metadata "
        "(default none: side channel only)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # torch is imported here, not at the top: other commands must start fast.
    from kvpush.bench.presets import synthetic_kv_cache

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
    if args.transport == "nixl":
        _nixl_transport_class()  # fail before binding anything when NIXL is missing
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with _Endpoint(args, token, engine_id, incarnation, [c.geometry for c in caches]) as ep:
            geometry = caches[0].geometry
            print(
                f"{READY_PREFIX} side channel {zmq_address(args.host, ep.port)} "
                f"port={ep.port} engine_id={engine_id} incarnation={incarnation} "
                f"ranks={args.ranks} layout={geometry.layout} dtype={geometry.dtype} "
                f"regions={len(geometry.regions)} blocks={geometry.num_blocks} "
                f"registered_bytes={geometry.total_bytes * args.ranks} "
                f"auth={'token' if token else 'none'} transport={args.transport}",
                flush=True,
            )
            ep.serve_until(stop)
        stats = ep.server_stats
        print(
            f"kvpush endpoint stopped: served {stats.served}, refused {stats.refused}, "
            f"dropped {stats.dropped}"
            + (
                f"; bench requests {stats.control_served} answered, "
                f"{stats.control_rejected} refused; transfers {ep.finished} finished, "
                f"{ep.failed} failed"
                if args.transport == "nixl"
                else ""
            ),
            flush=True,
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        del caches  # registered memory outlives every runtime: they are closed above
    return 0


class _Endpoint:
    """The side channel and, with a transport, one runtime per rank; owns them all.

    With `--transport nixl` it is a `Node` (side channel first, as a runtime's identity
    needs its port, then the ranks, then their metadata published; closed in the reverse
    order, so no control request reaches a closing runtime). Without, a side channel
    alone publishes the synthetic caches' geometries."""

    def __init__(
        self,
        args: argparse.Namespace,
        token: str | None,
        engine_id: str,
        incarnation: str,
        geometries: list[CacheGeometry],
    ) -> None:
        self._args = args
        self._token = token
        self._engine_id = engine_id
        self._incarnation = incarnation
        self._geometries = geometries
        self._runtimes: list[PushRuntime] = []
        self._bench: BenchService | None = None
        self._node: Node | None = None
        self._server: MetadataServer | None = None
        self.finished = 0
        self.failed = 0
        self.server_stats = SideChannelStats()

    @property
    def port(self) -> int:
        if self._node is not None:
            return self._node.port
        assert self._server is not None
        return self._server.port

    def __enter__(self) -> _Endpoint:
        try:
            self._start()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop()

    def _start(self) -> None:
        args = self._args
        if args.transport != "nixl":
            self._server = MetadataServer(
                args.host, args.port, SideChannelConfig(token=self._token), self._static_ranks()
            )
            self._server.start()
            return
        # The handlers are bound now and find the runtime once it exists; until then
        # (before the ready line) they refuse.
        self._node = Node(
            self._geometries,
            NodeIdentity(self._engine_id, args.role, _advertised_host(args)),
            port=args.port,
            bind_host=args.host,
            incarnation=self._incarnation,
            settings=RankSettings(token=self._token, check_compat_in_lookup=False),
            transport_factory=_nixl_transport_class(),
            control={kind: self._bench_handler(kind) for kind in BENCH_KINDS},
            # Without a scratch buffer: the doctor is told why it cannot check here.
            services=[DoctorProbe(scratch=False)],
        )
        self._node.start()
        self._runtimes = [rank.runtime for rank in self._node.ranks]
        self._bench = BenchService(self._runtimes[0], self._geometries[0])

    def _static_ranks(self) -> dict[int, PeerMetadata]:
        return {
            rank: PeerMetadata(
                engine_id=self._engine_id,
                incarnation=self._incarnation,
                rank=rank,
                role=self._args.role,
                agent_name="",
                agent_metadata=b"",
                geometry=geometry,
                kvpush_version=__version__,
            )
            for rank, geometry in enumerate(self._geometries)
        }

    def _bench_handler(self, kind: bytes) -> ControlHandler:
        def handle(body: Any) -> object:
            bench = self._bench
            if bench is None:
                raise RequestRejected("this endpoint is not ready for bench requests yet")
            return bench.handlers()[kind](body)

        return handle

    def serve_until(self, stop: threading.Event) -> None:
        """Serve until `stop` is set; raises `SideChannelError` if the side channel
        stops on its own (a dead side channel must not look like a live endpoint)."""
        wait_s = 0.2 / max(1, len(self._runtimes))
        while not stop.is_set():
            self._check_side_channel()
            if not self._runtimes:
                stop.wait(0.5)
                continue
            # Each runtime reports every transfer it ends, once; nobody else takes them.
            for runtime in self._runtimes:
                results = runtime.wait(timeout=wait_s)
                for r in results:
                    if r.ok:
                        self.finished += 1
                    else:
                        self.failed += 1
                if self._bench is not None and runtime is self._runtimes[0]:
                    self._bench.record(results)

    def _check_side_channel(self) -> None:
        if self._node is not None:
            health = self._node.health()
            healthy, failure = health.side_channel_healthy, health.side_channel_failure
        elif self._server is not None:
            healthy, failure = self._server.healthy, self._server.failure
        else:
            return
        if not healthy:
            raise SideChannelError(f"the side channel stopped serving: {failure}")

    def _stop(self) -> None:
        self._runtimes = []
        if self._node is not None:
            try:
                self._node.close()
            finally:
                self.server_stats = self._node.health().side_channel
        if self._server is not None:
            self._server.close()
            self.server_stats = self._server.statistics()


def _advertised_host(args: argparse.Namespace) -> str:
    if args.advertise_host:
        return str(args.advertise_host)
    if is_wildcard(args.host):
        return socket.gethostname()
    return str(args.host)


def _nixl_transport_class() -> TransportFactory:
    """The NIXL transport's class, if this build of kvpush has it."""
    try:
        module = importlib.import_module("kvpush.transports.nixl")
        cls = module.NixlTransport
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--transport nixl is not available: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise ConfigError("kvpush.transports.nixl.NixlTransport is not a Transport")
    return cls
