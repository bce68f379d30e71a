"""The `kvpush` mode: the whole kvpush path, as an engine would drive it.

Each side wraps the bench's cache regions as torch tensors, registers them with
`kvpush.kvcache.register_kv_cache`, and runs a `PushRuntime` over a `NixlTransport`, with
its metadata published on a real side channel on 127.0.0.1, port 0, and peers found
through it: a `kvpush.node.Node`.

Per batch: the receiver calls `receive()` for every transfer (the decode side allocated
its blocks and registered them, as in serving), and the sender waits, untimed, until all
those registrations have reached it. Then the timed part: the sender calls `send()` as
"blocks ready" (at most `inflight` open at once), and each transfer counts as finished
when the receiver's `wait()` hands back its result: protocol, writes, completion message
and result delivery are all inside the figure.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from kvpush.bench.common import SENDER_FILL_SEED, BenchFailed, ModeUnavailable, check_deadline
from kvpush.bench.workload import CacheBuffers, Transfer, Workload

HOST = "127.0.0.1"


class BenchRuntime:
    """One kvpush end as the bench runs it: a `PushRuntime` over a `NixlTransport`, its
    metadata on its own side channel, and the bench's transfers named `<prefix><tag>`.
    The local `kvpush` mode runs two of these; remote `kvpush` runs the sending one."""

    def __init__(self, id_prefix: str) -> None:
        self.id_prefix = id_prefix
        self.runtime: Any = None
        self.node: Any = None

    def transfer_id(self, tag: int) -> str:
        return f"{self.id_prefix}{tag}"

    def tag(self, transfer_id: str) -> int:
        return int(transfer_id.removeprefix(self.id_prefix))

    def start(
        self,
        geometry: Any,
        *,
        host: str,
        role: str,
        engine_id: str,
        token: str | None = None,
        lookup_timeout_ms: int | None = None,
    ) -> int:
        """Start the side channel on `host` (port 0) and the runtime; our port."""
        try:
            from kvpush.node import Node, NodeIdentity, RankSettings, nixl_transport
            from kvpush.transports import nixl  # noqa: F401  (NIXL missing: mode unavailable)
        except ImportError as exc:
            raise ModeUnavailable(f"not available: {exc}") from None
        settings = RankSettings(
            token=token,
            lookup_timeout_ms=2000 if lookup_timeout_ms is None else lookup_timeout_ms,
            check_compat_in_lookup=False,
        )
        self.node = Node(
            [geometry],
            NodeIdentity(engine_id, role, host),
            settings=settings,
            transport_factory=nixl_transport,
        )
        self.node.start()
        self.runtime = self.node.runtime
        return int(self.node.port)

    def results(self, deadline: float, what: str) -> list[Any]:
        """The runtime's next results (waits up to 0.2 s); a failed transfer is an error."""
        check_deadline(deadline, what)
        results = self.runtime.wait(timeout=0.2)
        for r in results:
            if not r.ok:
                raise BenchFailed(
                    f"kvpush {what}: transfer {r.transfer_id} failed ({r.reason}): {r.detail}"
                )
        return list(results)

    def wait_registered(self, count: int, deadline: float, what: str) -> None:
        """Untimed: wait until `count` registrations from the receiver have reached us."""
        while self.runtime.statistics().sending.get("registered", 0) < count:
            check_deadline(deadline, f"kvpush sender waiting for {what}'s registrations")
            time.sleep(0.001)

    def push(
        self, transfers: Sequence[Transfer], inflight: int, deadline: float
    ) -> tuple[dict[int, int], dict[int, int]]:
        """`send()` every transfer, at most `inflight` open; tag -> monotonic ns when
        submitted ("blocks ready") and when our runtime reported it finished."""
        submitted: dict[int, int] = {}
        finished: dict[int, int] = {}
        pending = list(reversed(transfers))
        open_: dict[str, int] = {}
        while pending or open_:
            ready = time.monotonic_ns()  # "blocks ready": see `modes.Sender.run_batch`
            while pending and len(open_) < inflight:
                t = pending.pop()
                tid = self.transfer_id(t.tag)
                submitted[t.tag] = ready
                self.runtime.send(tid, list(t.src_blocks))
                open_[tid] = t.tag
            results = self.results(deadline, "sender")
            now = time.monotonic_ns()
            for r in results:
                tag = open_.pop(r.transfer_id, None)
                if tag is not None:
                    finished[tag] = now
        return submitted, finished

    def close(self) -> None:
        if self.node is not None:
            self.node.close()
            self.node = None
        self.runtime = None


class _KvpushSide:
    # The side-channel token both ends hold (kvpush-token: every message carries a MAC).
    token: str | None = None

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.buffers = CacheBuffers(workload)
        self.end = BenchRuntime("bench-")

    def _start(self, role: str, fill_seed: int | None) -> int:
        """Allocate, register, start the runtime and its side channel; our port."""
        try:
            import torch

            from kvpush.kvcache import register_kv_cache
        except ImportError as exc:
            raise ModeUnavailable(f"not available: {exc}") from None
        w = self.workload
        self.buffers.allocate(fill_seed)
        heads = w.kv_heads
        if w.block_bytes != w.block_size_tokens * heads * w.head_dim * w.dtype_bytes:
            heads = 1
        head_dim = w.block_bytes // (w.block_size_tokens * heads * w.dtype_bytes)
        shape = (w.num_blocks, w.block_size_tokens, heads, head_dim)
        dtype = getattr(torch, w.dtype)

        def tensor(i: int) -> Any:
            return torch.from_numpy(self.buffers.regions[i]).view(dtype).view(shape)

        kv = {f"model.layers.{i}.attn": (tensor(2 * i), tensor(2 * i + 1)) for i in range(w.layers)}
        geometry = register_kv_cache(kv, "kv_separate/NHD", w.block_size_tokens)
        got = [(r.base_addr, r.block_bytes, r.block_stride) for r in geometry.regions]
        want = [(b, w.block_bytes, w.block_bytes) for b in self.buffers.bases()]
        if got != want:
            raise BenchFailed("register_kv_cache derived regions that are not the bench's")
        return self.end.start(
            geometry, host=HOST, role=role, engine_id=f"bench-{role}", token=self.token
        )

    def close(self) -> None:
        self.end.close()


class KvpushReceiver(_KvpushSide):
    def __init__(self, workload: Workload) -> None:
        super().__init__(workload)
        self.sender_port = 0

    def setup(self, peer: Connection) -> object:
        return {"port": self._start("receiver", None)}

    def peer_info(self, info: object) -> None:
        assert isinstance(info, dict)
        self.sender_port = int(info["port"])

    def arm(self, transfers: list[tuple[int, tuple[int, ...]]], deadline: float) -> None:
        from kvpush.runtime import PeerAddress

        if not self.sender_port:
            raise BenchFailed("kvpush receiver: armed before the sender said where it is")
        sender = PeerAddress(HOST, self.sender_port, 0)
        for tag, dst in transfers:
            self.end.runtime.receive(self.end.transfer_id(tag), sender, list(dst))

    def wait(self, tags: set[int], deadline: float) -> dict[int, int]:
        done: dict[int, int] = {}
        while len(done) < len(tags):
            results = self.end.results(deadline, "receiver")
            now = time.monotonic_ns()
            for r in results:
                done[self.end.tag(r.transfer_id)] = now
        return done

    def idle(self, seconds: float) -> None:
        # An idle endpoint: the runtime's own threads run; the engine thread sleeps.
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))
            check_deadline(end + 1, "kvpush receiver idling")


class KvpushSender(_KvpushSide):
    def setup(self, peer_meta: object, peer: Connection) -> None:
        port = self._start("sender", SENDER_FILL_SEED)
        peer.send(("peer-info", {"port": port}))

    def prepare(self, transfers: Sequence[Transfer], deadline: float) -> None:
        self.end.wait_registered(len(transfers), deadline, "the receiver")

    def run_batch(
        self, transfers: Sequence[Transfer], inflight: int, deadline: float
    ) -> dict[int, int]:
        # Finished is the receiver's `wait()`; our own results only free in-flight slots.
        submitted, _ = self.end.push(transfers, inflight, deadline)
        return submitted


# Both ends of the bench's own loopback pair; nothing else ever holds it.
_BENCH_TOKEN = "kvpush-bench-token"


class KvpushTokenReceiver(KvpushReceiver):
    token = _BENCH_TOKEN


class KvpushTokenSender(KvpushSender):
    token = _BENCH_TOKEN
