"""The two halves of every benchmarked transfer layer, run inside the bench's children.

Each mode has a `Receiver` (allocates and registers the destination cache, then reports
when each transfer has landed) and a `Sender` (allocates the source cache, then writes
batches of transfers). Both are constructed in the child process and driven by
`kvpush.bench.runner`; timestamps are `time.monotonic_ns()`, which on Linux is one clock
for every process on the host, so a sender's "blocks ready" and a receiver's "finished"
can be subtracted.

Every mode copies the same blocks through the same descriptors (one per block per region,
from `workload.descriptor_arrays`). The raw modes are deliberately the simplest correct
code an engine author would write against that library.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, Protocol

from kvpush.bench.common import SENDER_FILL_SEED, BenchFailed, ModeUnavailable, check_deadline
from kvpush.bench.workload import CacheBuffers, Transfer, Workload, descriptor_arrays
from kvpush.errors import TransportError
from kvpush.transports._nixl_import import NixlModule, load_nixl


class Receiver(Protocol):
    buffers: CacheBuffers

    def setup(self, peer: Connection) -> object:
        """Allocate and register; return what the sender needs (picklable)."""

    def peer_info(self, info: object) -> None:
        """What the sender sent us after its own setup (its address, for kvpush)."""

    def arm(self, transfers: list[tuple[int, tuple[int, ...]]], deadline: float) -> None:
        """Get ready for these (tag, destination blocks), before the batch is timed."""

    def wait(self, tags: set[int], deadline: float) -> dict[int, int]:
        """Block until every tag's transfer is reported finished; tag -> monotonic ns."""

    def idle(self, seconds: float) -> None:
        """Sit as an idle endpoint (ready to receive, nothing arriving) for `seconds`."""

    def close(self) -> None: ...


class Sender(Protocol):
    buffers: CacheBuffers

    def setup(self, peer_meta: object, peer: Connection) -> None: ...

    def prepare(self, transfers: Sequence[Transfer], deadline: float) -> None:
        """Called once the receiver is armed, before the batch is timed."""

    def run_batch(
        self, transfers: Sequence[Transfer], inflight: int, deadline: float
    ) -> dict[int, int]:
        """Write every transfer, at most `inflight` at once; tag -> "blocks ready", ns.

        "Blocks ready" is when the window had room for the transfer: one time for every
        transfer admitted in the same pass, taken before any of them is posted. A post
        may do the copy itself (UCX over CMA copies inside NIXL's `transfer()`: 12 ms for
        64 MiB here), and a clock started after the posts before it would leave out the
        time a transfer queued behind them."""

    def close(self) -> None: ...


def nixl_or_unavailable() -> NixlModule:
    """NIXL as kvpush loads it (`kvpush.transports._nixl_import.load_nixl`: the same
    package search and the same UCX environment), so that the raw baseline and kvpush run
    over one UCX set-up; a host without NIXL makes the mode unavailable."""
    try:
        return load_nixl()
    except TransportError as exc:
        raise ModeUnavailable(exc.detail) from None


# --------------------------------------------------------------------------- memcpy


class MemcpyPair:
    """Source and destination in one process; one memmove per descriptor."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.buffers = CacheBuffers(workload)
        self.dst = CacheBuffers(workload)

    def setup(self) -> None:
        self.buffers.allocate(SENDER_FILL_SEED)
        self.dst.allocate(None)

    def run_batch(self, transfers: Sequence[Transfer]) -> tuple[dict[int, int], dict[int, int]]:
        memmove = ctypes.memmove
        src_bases, dst_bases = self.buffers.bases(), self.dst.bases()
        submitted: dict[int, int] = {}
        done: dict[int, int] = {}
        for t in transfers:
            submitted[t.tag] = time.monotonic_ns()
            src, dst = descriptor_arrays(self.workload, src_bases, dst_bases, t)
            length = self.workload.block_bytes
            for s, d in zip(src[:, 0].tolist(), dst[:, 0].tolist(), strict=True):
                memmove(d, s, length)
            done[t.tag] = time.monotonic_ns()
        return submitted, done


# --------------------------------------------------------------------------- nixl-raw


def nixl_register(agent: Any, buffers: CacheBuffers) -> Any:
    descs = [(int(r.ctypes.data), int(r.nbytes), 0, "") for r in buffers.regions]
    reg = agent.register_memory(descs, "DRAM")
    if reg is None:
        raise BenchFailed("NIXL register_memory returned nothing (no backend took DRAM)")
    return reg


def nixl_agent_over(buffers: CacheBuffers, name: str) -> tuple[Any, Any]:
    """(agent, registration): a UCX agent without a progress thread, `buffers` registered."""
    nixl = nixl_or_unavailable()
    agent = nixl.nixl_agent(
        f"{name}-{time.monotonic_ns()}",
        nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]),
    )
    return agent, nixl_register(agent, buffers)


class NixlRawReceiver:
    """Two-agent NIXL over UCX, no progress thread; completion by notification.

    Both ends poll NIXL in a loop that yields the CPU at each turn (`os.sched_yield`): on
    a host with fewer free cores than spinning processes, a sender and a receiver that
    share a core would otherwise each wait out the other's time slice (docs/benchmarks.md,
    "Interleaved rounds")."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.buffers = CacheBuffers(workload)
        self.agent: Any = None
        self.reg: Any = None
        self.early: dict[int, int] = {}

    def setup(self, peer: Connection) -> object:
        self.buffers.allocate(None)
        self.agent, self.reg = nixl_agent_over(self.buffers, "bench-rx")
        return {"agent_md": self.agent.get_agent_metadata(), "bases": self.buffers.bases()}

    def _poll(self, into: dict[int, int]) -> None:
        notifs = self.agent.get_new_notifs()
        if notifs:
            now = time.monotonic_ns()
            for msgs in notifs.values():
                for m in msgs:
                    into[int(m)] = now

    def peer_info(self, info: object) -> None:
        pass

    def arm(self, transfers: list[tuple[int, tuple[int, ...]]], deadline: float) -> None:
        pass

    def wait(self, tags: set[int], deadline: float) -> dict[int, int]:
        done = {t: ns for t, ns in self.early.items() if t in tags}
        while len(done) < len(tags):
            self._poll(done)
            os.sched_yield()
            check_deadline(deadline, f"nixl-raw receiver: {len(tags) - len(done)} notifications")
        return done

    def idle(self, seconds: float) -> None:
        # The same loop as `wait`: an endpoint ready to receive polls for notifications.
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._poll(self.early)
            os.sched_yield()
            check_deadline(end + 1, "nixl-raw receiver idling")

    def close(self) -> None:
        if self.agent is not None and self.reg is not None:
            self.agent.deregister_memory(self.reg)
            self.reg = None


class NixlRawSender:
    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.buffers = CacheBuffers(workload)
        self.agent: Any = None
        self.reg: Any = None
        self.peer_name = ""
        self.peer_bases: list[int] = []
        self.peer_strides: list[int] | None = None

    def setup(self, peer_meta: object, peer: Connection) -> None:
        assert isinstance(peer_meta, dict)
        self.buffers.allocate(SENDER_FILL_SEED)
        self.agent, self.reg = nixl_agent_over(self.buffers, "bench-tx")
        self.peer_name = self.agent.add_remote_agent(peer_meta["agent_md"])
        self.peer_bases = list(peer_meta["bases"])
        self.peer_strides = peer_meta.get("strides")

    def prepare(self, transfers: Sequence[Transfer], deadline: float) -> None:
        pass

    def run_batch(
        self,
        transfers: Sequence[Transfer],
        inflight: int,
        deadline: float,
        completed: dict[int, int] | None = None,
        notify: bool = True,
    ) -> dict[int, int]:
        """Post every WRITE; `completed`, if given, gets each one's local DONE time.

        `notify=False` sends no NIXL notification with the WRITEs: a live kvpush endpoint
        would take them for (malformed) kvpush messages."""
        agent = self.agent
        bases = self.buffers.bases()
        pending = deque(transfers)
        active: dict[int, Any] = {}
        submitted: dict[int, int] = {}
        while pending or active:
            ready = time.monotonic_ns()  # "blocks ready": see `Sender.run_batch`
            while pending and len(active) < inflight:
                t = pending.popleft()
                submitted[t.tag] = ready
                src, dst = descriptor_arrays(
                    self.workload, bases, self.peer_bases, t, self.peer_strides
                )
                handle = agent.initialize_xfer(
                    "WRITE",
                    agent.get_xfer_descs(src, "DRAM"),
                    agent.get_xfer_descs(dst, "DRAM"),
                    self.peer_name,
                    str(t.tag).encode() if notify else b"",
                )
                if agent.transfer(handle) == "ERR":
                    raise BenchFailed(f"nixl-raw: posting transfer {t.tag} failed")
                active[t.tag] = handle
            for tag, handle in list(active.items()):
                state = agent.check_xfer_state(handle)
                if state == "DONE":
                    if completed is not None:
                        completed[tag] = time.monotonic_ns()
                    agent.release_xfer_handle(handle)
                    del active[tag]
                elif state == "ERR":
                    raise BenchFailed(f"nixl-raw: transfer {tag} failed")
            os.sched_yield()
            check_deadline(deadline, "nixl-raw sender batch")
        return submitted

    def read_back(self, blocks: tuple[int, ...], into: CacheBuffers, deadline: float) -> None:
        """NIXL READ of the peer's `blocks` into the same block ids of `into` (registered
        here by the caller): how a remote bench checks what landed."""
        agent = self.agent
        t = Transfer(tag=0, src_blocks=blocks, dst_blocks=blocks)
        local, remote = descriptor_arrays(
            self.workload, into.bases(), self.peer_bases, t, self.peer_strides
        )
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(local, "DRAM"),
            agent.get_xfer_descs(remote, "DRAM"),
            self.peer_name,
        )
        state = agent.transfer(handle)
        while state == "PROC":
            check_deadline(deadline, "nixl-raw read-back")
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise BenchFailed("nixl-raw: reading back the written blocks failed")

    def close(self) -> None:
        if self.agent is not None:
            if self.peer_name:
                self.agent.remove_remote_agent(self.peer_name)
                self.peer_name = ""
            if self.reg is not None:
                self.agent.deregister_memory(self.reg)
                self.reg = None


# --------------------------------------------------------------------------- mooncake


MOONCAKE_MAX_OUTSTANDING = 1024


def load_mooncake() -> Any:
    # Its INFO lines (one per batch) would drown the bench's own output. This runs in a
    # bench child process only, before Mooncake's library is loaded.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ModeUnavailable(
            f"Mooncake is not importable ({exc}); install mooncake-transfer-engine-non-cuda "
            "(needs libibverbs1 and libnuma1)"
        ) from None
    return TransferEngine


def _mooncake_engine(buffers: CacheBuffers) -> tuple[Any, str]:
    engine = load_mooncake()()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise ModeUnavailable(f"Mooncake TransferEngine.initialize(tcp, P2PHANDSHAKE) -> {rc}")
    for r in buffers.regions:
        rc = engine.register_memory(int(r.ctypes.data), int(r.nbytes), "cpu:0")
        if rc != 0:
            raise ModeUnavailable(f"Mooncake register_memory -> {rc}")
    return engine, f"127.0.0.1:{engine.get_rpc_port()}"


def _mooncake_release(engine: Any, buffers: CacheBuffers) -> None:
    if engine is not None:
        for r in buffers.regions:
            engine.unregister_memory(int(r.ctypes.data))


class MooncakeReceiver:
    """Mooncake over TCP has no write notification: the sender tells us on the pipe,
    as SGLang's and vLLM's Mooncake connectors do over ZMQ after the write returns."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.buffers = CacheBuffers(workload)
        self.engine: Any = None
        self.peer: Connection | None = None

    def setup(self, peer: Connection) -> object:
        self.buffers.allocate(None)
        self.engine, session = _mooncake_engine(self.buffers)
        self.peer = peer
        return {"session": session, "bases": self.buffers.bases()}

    def peer_info(self, info: object) -> None:
        pass

    def arm(self, transfers: list[tuple[int, tuple[int, ...]]], deadline: float) -> None:
        pass

    def wait(self, tags: set[int], deadline: float) -> dict[int, int]:
        assert self.peer is not None
        done: dict[int, int] = {}
        while len(done) < len(tags):
            if not self.peer.poll(max(0.0, deadline - time.monotonic())):
                raise BenchFailed("mooncake receiver: completion messages never came")
            msg = self.peer.recv()
            if msg[0] != "landed":
                raise BenchFailed(f"mooncake receiver: unexpected message {msg[0]!r}")
            now = time.monotonic_ns()
            for tag in msg[1]:
                done[tag] = now
        return done

    def idle(self, seconds: float) -> None:
        assert self.peer is not None
        self.peer.poll(seconds)

    def close(self) -> None:
        _mooncake_release(self.engine, self.buffers)
        self.engine = None


class MooncakeSender:
    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.buffers = CacheBuffers(workload)
        self.engine: Any = None
        self.session = ""
        self.peer_bases: list[int] = []
        self.peer: Connection | None = None

    def setup(self, peer_meta: object, peer: Connection) -> None:
        assert isinstance(peer_meta, dict)
        self.buffers.allocate(SENDER_FILL_SEED)
        self.engine, _ = _mooncake_engine(self.buffers)
        self.session = peer_meta["session"]
        self.peer_bases = list(peer_meta["bases"])
        self.peer = peer

    def prepare(self, transfers: Sequence[Transfer], deadline: float) -> None:
        pass

    def run_batch(
        self, transfers: Sequence[Transfer], inflight: int, deadline: float
    ) -> dict[int, int]:
        assert self.peer is not None
        engine = self.engine
        bases = self.buffers.bases()
        length = self.workload.block_bytes
        # Mooncake's TCP lane rejects work once about 1024 slices are queued (it logs
        # "queue-full rejection" and fails the batch), so it gets at most that many
        # descriptors outstanding, in sub-batches; waits are in submission order.
        cap = MOONCAKE_MAX_OUTSTANDING
        pending = deque(transfers)
        active: deque[tuple[int, int, int, bool]] = deque()  # tag, batch, descs, last
        outstanding = 0
        transfers_open: set[int] = set()
        submitted: dict[int, int] = {}
        chunks: deque[tuple[int, list[int], list[int], bool]] = deque()
        while pending or active or chunks:
            ready = time.monotonic_ns()  # "blocks ready": see `Sender.run_batch`
            while (pending or chunks) and (len(transfers_open) < inflight or chunks):
                if not chunks:
                    t = pending.popleft()
                    submitted[t.tag] = ready
                    transfers_open.add(t.tag)
                    src, dst = descriptor_arrays(self.workload, bases, self.peer_bases, t)
                    s_all, d_all = src[:, 0].tolist(), dst[:, 0].tolist()
                    for i in range(0, len(s_all), cap):
                        last = i + cap >= len(s_all)
                        chunks.append((t.tag, s_all[i : i + cap], d_all[i : i + cap], last))
                tag, s_part, d_part, last = chunks[0]
                if outstanding + len(s_part) > cap and active:
                    break
                chunks.popleft()
                batch = engine.batch_transfer_async_write(
                    self.session, s_part, d_part, [length] * len(s_part)
                )
                if batch == 0:
                    raise BenchFailed(f"mooncake: batch_transfer_async_write({tag}) failed")
                active.append((tag, batch, len(s_part), last))
                outstanding += len(s_part)
            # Blocks until the oldest batch completes (0) or fails/times out (< 0).
            tag, batch, n, last = active.popleft()
            rc = engine.get_batch_transfer_status([batch])
            outstanding -= n
            if rc != 0:
                raise BenchFailed(f"mooncake: transfer {tag} failed (status {rc})")
            if last:
                transfers_open.discard(tag)
                self.peer.send(("landed", [tag]))
            check_deadline(deadline, "mooncake sender batch")
        return submitted

    def close(self) -> None:
        _mooncake_release(self.engine, self.buffers)
        self.engine = None


ReceiverFactory = Callable[[Workload], Receiver]
SenderFactory = Callable[[Workload], Sender]


def factories(mode: str) -> tuple[ReceiverFactory, SenderFactory]:
    if mode == "nixl-raw":
        return NixlRawReceiver, NixlRawSender
    if mode == "mooncake":
        return MooncakeReceiver, MooncakeSender
    if mode == "kvpush":
        from kvpush.bench import kvpush_mode as kvpush_mode_

        return kvpush_mode_.KvpushReceiver, kvpush_mode_.KvpushSender
    if mode == "kvpush-token":
        from kvpush.bench import kvpush_mode as kvpush_mode_

        return kvpush_mode_.KvpushTokenReceiver, kvpush_mode_.KvpushTokenSender
    raise BenchFailed(f"no two-process implementation for mode {mode!r}")
