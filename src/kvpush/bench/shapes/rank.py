"""One rank of a shape, in its own process: its heads of the model's cache, a `Rank`
over NIXL (`ShapeRank`), and, for every rank but the lead, the orders it obeys
(`rank_main`)."""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpush.bench.common import BenchFailed, ModeUnavailable, check_deadline
from kvpush.bench.runner import (
    PIPE_TIMEOUT_S,
    child_process,
    close_quietly,
    cpu_seconds,
    recv_message,
    start_busy_engine,
)
from kvpush.bench.shapes.shape import (
    HOST,
    LAYOUT,
    Shape,
    head_bytes,
    model_layer,
    slots,
    transfer_id,
)
from kvpush.bench.workload import Transfer, Workload
from kvpush.roles import runtime_role
from kvpush.topology import (
    RankHeads,
    rank_heads,
    transfer_parts,
)


class ShapeRank:
    """One rank of one engine: its heads of the model's cache, a `Rank` over NIXL, and,
    on rank 0, the engine's side channel."""

    def __init__(self, workload: Workload, shape: Shape, role: str, rank: int) -> None:
        self.workload = workload
        self.shape = shape
        self.role = role  # "prefill" | "decode"
        self.rank = rank
        tp = shape.prefill_tp if role == "prefill" else shape.decode_tp
        self.tp = tp
        self.heads: RankHeads = rank_heads(rank, tp, workload.kv_heads, False)
        self.layers: list[npt.NDArray[np.uint8]] = []
        self.published: dict[int, Any] = {}
        self.server: Any = None
        self.node_rank: Any = None

    def allocate(self) -> None:
        """Prefill: our heads of the model's cache; decode: zeros."""
        w, h = self.workload, self.heads
        for layer in range(w.layers):
            if self.role == "prefill":
                arr = model_layer(w, layer)[:, h.first_head : h.stop].copy()
            else:
                arr = np.zeros((w.num_blocks, h.num_heads, head_bytes(w)), dtype=np.uint8)
            self.layers.append(arr)

    def geometry(self) -> Any:
        """Our cache as vLLM's worker registers it: packed tensors and our `KVHeads`."""
        try:
            import torch

            from kvpush.geometry import KVHeads
            from kvpush.integrations.vllm.kvcache import register_vllm_kv_caches
        except ImportError as exc:
            raise ModeUnavailable(f"not available: {exc}") from None
        w = self.workload
        dtype = getattr(torch, w.dtype)
        shape = (w.num_blocks, self.heads.num_heads, w.block_size_tokens, 2 * w.head_dim)
        tensors = {
            f"model.layers.{i}.self_attn.attn": torch.from_numpy(arr).view(dtype).view(shape)
            for i, arr in enumerate(self.layers)
        }
        heads = KVHeads(
            total=w.kv_heads, per_rank=self.heads.num_heads, tp_size=self.tp, tp_rank=self.rank
        )
        geometry = register_vllm_kv_caches(tensors, w.block_size_tokens, heads)
        if geometry.layout != LAYOUT:
            raise BenchFailed(f"registered layout {geometry.layout}, expected {LAYOUT}")
        return geometry

    def serve_side_channel(self) -> int:
        """Rank 0: bind the engine's side channel (port 0); its port."""
        from kvpush.config import SideChannelConfig
        from kvpush.sidechannel import MetadataServer

        self.server = MetadataServer(HOST, 0, SideChannelConfig(), self.published)
        self.server.start()
        return int(self.server.port)

    def start(self, port: int) -> Any:
        """Start our `Rank` (its metadata served on `port`); our metadata."""
        try:
            from kvpush.node import NodeIdentity, Rank, RankSettings, nixl_transport
            from kvpush.transports import nixl  # noqa: F401  (NIXL missing: mode unavailable)
        except ImportError as exc:
            raise ModeUnavailable(f"not available: {exc}") from None
        identity = NodeIdentity(f"bench-{self.role}", runtime_role(self.role), HOST)
        self.node_rank = Rank(
            self.geometry(),
            identity,
            port=port,
            rank=self.rank,
            settings=RankSettings(lookup_timeout_ms=2000),
            transport_factory=nixl_transport,
        )
        self.node_rank.start()
        meta = self.node_rank.metadata()
        if self.server is not None:
            self.published[self.rank] = meta
        return meta

    @property
    def runtime(self) -> Any:
        return self.node_rank.runtime

    def transport_counts(self) -> dict[str, int]:
        """The NIXL transport's counters (writes, descriptors after merging, bytes) and
        how often the runtime polled it."""
        from kvpush.transports.nixl import NixlTransport

        counts = {"polls": self.runtime.statistics().transport_polls}
        transport = self.node_rank.transport
        if isinstance(transport, NixlTransport):
            s = transport.statistics()
            counts |= {
                "writes": s.writes_posted,
                "descriptors": s.descriptors_posted,
                "bytes": s.bytes_posted,
            }
        return counts

    def parts(self, transfers: Sequence[Transfer]) -> dict[str, tuple[int, int]]:
        """Our parts of `transfers`: part id -> (tag, the other side's rank)."""
        ours: dict[str, tuple[int, int]] = {}
        for t in transfers:
            for p, d, pid in transfer_parts(transfer_id(t.tag), *self.tp_pair):
                if (p if self.role == "prefill" else d) == self.rank:
                    ours[pid] = (t.tag, d if self.role == "prefill" else p)
        return ours

    @property
    def tp_pair(self) -> tuple[int, int]:
        return self.shape.prefill_tp, self.shape.decode_tp

    def head_crcs(self, blocks: Sequence[int]) -> dict[int, int]:
        """Global head -> CRC-32 of that head over `blocks`, layer by layer."""
        out: dict[int, int] = {}
        for i in range(self.heads.num_heads):
            crc = 0
            for arr in self.layers:
                for b in blocks:
                    crc = zlib.crc32(arr[b, i].data, crc)
            out[self.heads.first_head + i] = crc
        return out

    def zero(self, blocks: Sequence[int]) -> None:
        idx = np.asarray(blocks, dtype=np.int64)
        for arr in self.layers:
            arr[idx] = 0

    def results(self, deadline: float, what: str) -> list[Any]:
        check_deadline(deadline, what)
        results = self.runtime.wait(timeout=0.2)
        for r in results:
            if not r.ok:
                raise BenchFailed(f"{what}: part {r.transfer_id} failed ({r.reason}): {r.detail}")
        return list(results)

    # ---- decode side

    def arm(self, transfers: Sequence[tuple[int, tuple[int, ...]]], prefill_port: int) -> Any:
        """Zero the destination blocks, register every part that comes to us; what
        `collect` waits for: part id -> tag."""
        from kvpush.runtime import PeerAddress

        for _, dst in transfers:
            self.zero(dst)
        expected: dict[str, int] = {}
        for tag, dst in transfers:
            for p, d, pid in transfer_parts(transfer_id(tag), *self.tp_pair):
                if d == self.rank:
                    self.runtime.receive(pid, PeerAddress(HOST, prefill_port, p), list(dst))
                    expected[pid] = tag
        return expected

    def collect(self, expected: dict[str, int], deadline: float) -> dict[str, int]:
        """Part id -> monotonic ns when that part to us was received."""
        done: dict[str, int] = {}
        while len(done) < len(expected):
            results = self.results(deadline, f"decode rank {self.rank}")
            now = time.monotonic_ns()
            for r in results:
                if r.transfer_id in expected:
                    done[r.transfer_id] = now
        return done

    # ---- prefill side

    def prepare(self, transfers: Sequence[Transfer], deadline: float) -> None:
        """Untimed: wait until the decode ranks' registrations of our parts reached us."""
        count = len(self.parts(transfers))
        while self.runtime.statistics().sending.get("registered", 0) < count:
            check_deadline(deadline, f"prefill rank {self.rank} waiting for registrations")
            time.sleep(0.001)

    def push(self, transfers: Sequence[Transfer], inflight: int, deadline: float) -> dict[int, int]:
        """`send()` our parts of every transfer, at most `inflight` transfers open; tag ->
        "blocks ready" for our parts (see `modes.Sender.run_batch`)."""
        parts: dict[int, list[str]] = {}
        for pid, (tag, _) in self.parts(transfers).items():
            parts.setdefault(tag, []).append(pid)
        submitted: dict[int, int] = {}
        pending = [t for t in reversed(transfers) if t.tag in parts]
        open_parts: dict[str, int] = {}
        open_count: dict[int, int] = {}
        while pending or open_parts:
            ready = time.monotonic_ns()
            while pending and len(open_count) < inflight:
                t = pending.pop()
                submitted[t.tag] = ready
                open_count[t.tag] = len(parts[t.tag])
                for pid in parts[t.tag]:
                    self.runtime.send(pid, list(t.src_blocks))
                    open_parts[pid] = t.tag
            for r in self.results(deadline, f"prefill rank {self.rank}"):
                if r.transfer_id not in open_parts:
                    continue
                tag = open_parts.pop(r.transfer_id)
                open_count[tag] -= 1
                if not open_count[tag]:
                    del open_count[tag]
        return submitted

    def close(self) -> None:
        if self.server is not None:
            close_quietly(self.server)
        if self.node_rank is not None:
            self.node_rank.close()


def counts_since(before: dict[str, int], rank: ShapeRank) -> dict[str, int]:
    after = rank.transport_counts()
    return {k: after[k] - before.get(k, 0) for k in after}


def rank_main(shape: Shape, workload: Workload, role: str, rank: int, lead: Connection) -> None:
    """Every rank but the lead: obeys the lead's orders on `lead` until told to stop."""
    with child_process(lead, prefix=f"{role} rank {rank}: ") as stack:
        if workload.busy_engine:
            start_busy_engine(stack)
        ours = ShapeRank(workload, shape, role, rank)
        stack.callback(close_quietly, ours)
        ours.allocate()
        if role == "decode" and rank == 0:
            lead.send(("port", ours.serve_side_channel()))
        _, port = recv_message(lead, PIPE_TIMEOUT_S, "the engine's side-channel port")
        lead.send(("meta", ours.start(port)))
        prefill_port = 0
        transfers: list[Transfer] = []
        while True:
            msg = recv_message(lead, PIPE_TIMEOUT_S * 5, f"{role} rank {rank} waiting for orders")
            if msg[0] == "publish":
                ours.published[msg[1]] = msg[2]
            elif msg[0] == "prefill-port":
                prefill_port = msg[1]
            elif msg[0] == "arm":
                expected = ours.arm(msg[1], prefill_port)
                lead.send(("armed",))
                before = ours.transport_counts()
                cpu0 = cpu_seconds()
                done = ours.collect(expected, time.monotonic() + PIPE_TIMEOUT_S)
                cpu = cpu_seconds() - cpu0
                polls = counts_since(before, ours)["polls"]
                crcs = {dst: ours.head_crcs(dst) for dst in {dst for _, dst in msg[1]}}
                lead.send(("done", done, cpu, polls, crcs))
            elif msg[0] == "prepare":
                transfers = msg[1]
                crcs = {t.dst_blocks: ours.head_crcs(t.src_blocks) for t in slots(transfers)}
                ours.prepare(transfers, time.monotonic() + PIPE_TIMEOUT_S)
                lead.send(("prepared", crcs))
            elif msg[0] == "go":
                before = ours.transport_counts()
                cpu0 = cpu_seconds()
                submitted = ours.push(transfers, msg[1], time.monotonic() + PIPE_TIMEOUT_S)
                cpu = cpu_seconds() - cpu0
                lead.send(("pushed", submitted, cpu, counts_since(before, ours)))
            elif msg[0] == "stop":
                break
