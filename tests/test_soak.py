"""Soak: 10,000 one-block transfers between two runtimes, with 5% injected faults.

Real threads, real clock, the loopback fabric copying real bytes. Every transfer must end
exactly once on each side (lost = 0, reported twice = 0), every block must come back
(leaked = 0), and every transfer the receiver reports as finished must hold the bytes the
sender stamped into its block for that transfer. The transfers/second it sustained is
printed (run with `-s` to see it); it is measured here, never asserted.

    .venv/bin/pytest -s tests/test_soak.py
"""

from __future__ import annotations

import collections
import random
import time

import pytest

from kvpush.config import TimingConfig
from kvpush.errors import FailureReason
from kvpush.runtime import (
    InMemoryPeerDirectory,
    PeerAddress,
    PushRuntime,
    RuntimeIdentity,
    RuntimeSettings,
    TransferResult,
)
from kvpush.transports.loopback import LoopbackFabric, LoopbackTransport
from transport_conformance import make_kv

TRANSFERS = 10_000
FAULT_RATE = 0.05
WINDOW = 128
NUM_BLOCKS = 512
# Short enough that lost messages are repaired quickly, long enough that a busy shared
# machine does not look like a dead peer.
TIMING = TimingConfig(
    heartbeat_interval_s=0.05, liveness_timeout_s=1.5, lease_s=2.0, transfer_deadline_s=10.0
)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_soak_ten_thousand_transfers_with_faults() -> None:
    rng = random.Random(20261129)
    fabric = LoopbackFabric()
    directory = InMemoryPeerDirectory()
    kv = {name: make_kv(num_layers=1, num_blocks=NUM_BLOCKS, block_bytes=64) for name in "pd"}
    p_addr, d_addr = PeerAddress("127.0.0.1", 7001), PeerAddress("127.0.0.1", 7002)
    p = PushRuntime(
        LoopbackTransport(fabric, "p-1"),
        kv["p"].geometry,
        RuntimeIdentity("engine-p", "1", p_addr.host, p_addr.port),
        directory,
        RuntimeSettings(timing=TIMING),
    )
    d = PushRuntime(
        LoopbackTransport(fabric, "d-1"),
        kv["d"].geometry,
        RuntimeIdentity("engine-d", "1", d_addr.host, d_addr.port),
        directory,
        RuntimeSettings(timing=TIMING),
    )
    faults = [
        lambda: fabric.drop("d-1", "p-1"),
        lambda: fabric.drop("p-1", "d-1"),
        lambda: fabric.duplicate("d-1", "p-1"),
        lambda: fabric.duplicate("p-1", "d-1"),
        lambda: fabric.reorder("d-1", "p-1"),
        lambda: fabric.delay("p-1", "d-1", delay_s=0.05),
        lambda: fabric.fail_writes("p-1", "d-1"),
        "abort-receiver",
        "abort-sender",
    ]
    with p, d:
        directory.publish(p_addr, p.local_metadata())
        directory.publish(d_addr, d.local_metadata())
        free = {"p": list(range(NUM_BLOCKS)), "d": list(range(NUM_BLOCKS))}
        stamp: dict[str, int] = {}  # transfer id -> byte stamped into its sender block
        results: dict[str, list[TransferResult]] = collections.defaultdict(list)
        live: set[tuple[str, str]] = set()
        injected = 0
        corrupt = 0

        def collect(rt: PushRuntime, side: str, wait: float) -> None:
            nonlocal corrupt
            got = rt.wait(wait) if wait else rt.poll()
            for r in got:
                results[r.transfer_id].append(r)
                live.discard((side, r.transfer_id))
                if side == "d" and r.ok:
                    want = bytes([stamp[r.transfer_id]]) * 64
                    corrupt += kv["d"].block(0, r.blocks[0]) != want
                free[side].extend(r.blocks)

        start = time.perf_counter()
        started = 0
        while started < TRANSFERS or live:
            while started < TRANSFERS and len(live) < 2 * WINDOW and free["p"] and free["d"]:
                tid = f"t{started}"
                pb, db = free["p"].pop(), free["d"].pop()
                stamp[tid] = started % 251
                for t in kv["p"].tensors:
                    t[pb].fill_(stamp[tid])
                fault = rng.choice(faults) if rng.random() < FAULT_RATE else None
                if callable(fault):
                    fault()
                injected += fault is not None
                p.send(tid, [pb])
                d.receive(tid, p_addr, [db])
                live |= {("p", tid), ("d", tid)}
                if fault == "abort-receiver":
                    d.abort(tid)
                elif fault == "abort-sender":
                    p.abort(tid)
                started += 1
            collect(p, "p", 0)
            collect(d, "d", 0.002)
            if time.perf_counter() - start > 120:
                break
        elapsed = time.perf_counter() - start
        fabric.clear_faults()
        fabric.release_delayed()
        p_stats, d_stats = p.statistics(), d.statistics()

    lost = TRANSFERS * 2 - sum(len(rs) for rs in results.values())
    twice = sum(
        1
        for rs in results.values()
        for side in ("sender", "receiver")
        if len([r for r in rs if r.side == side]) > 1
    )
    leaked = (2 * NUM_BLOCKS - len(set(free["p"])) - len(set(free["d"]))) + (
        p_stats.blocks_held_sending + d_stats.blocks_held_receiving
    )
    finished = sum(1 for rs in results.values() for r in rs if r.ok and r.side == "receiver")
    reasons = collections.Counter(
        r.reason.value for rs in results.values() for r in rs if r.reason is not None
    )
    print(
        f"\nsoak: {TRANSFERS} transfers, {injected} faults injected, {elapsed:.2f}s, "
        f"{TRANSFERS / elapsed:.0f} transfers/s (1 block, both sides ended); "
        f"lost={lost} reported_twice={twice} leaked_blocks={leaked} corrupt={corrupt} "
        f"finished_on_receiver={finished} failures={dict(reasons)}"
    )
    assert lost == 0 and twice == 0 and leaked == 0 and corrupt == 0
    assert p_stats.duplicate_reports == 0 and d_stats.duplicate_reports == 0
    assert finished >= TRANSFERS * (1 - 3 * FAULT_RATE)
    assert set(reasons) <= {r.value for r in FailureReason}
