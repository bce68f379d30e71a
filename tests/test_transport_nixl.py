"""The NIXL transport passes the transport conformance suite (two agents in one process)."""

from __future__ import annotations

import itertools
import os
import time

import pytest
import torch

from kvpush.transports.base import WriteDone
from kvpush.transports.nixl import NixlTransport
from transport_conformance import (
    TransportConformance,
    TransportFactory,
    make_kv,
    messages,
    pump,
)

pytestmark = pytest.mark.nixl

_ids = itertools.count()


def _name(role: str) -> str:
    return f"{role}-{os.getpid()}-{next(_ids)}"


class TestNixlConformance(TransportConformance):
    @pytest.fixture
    def transport_factory(self) -> TransportFactory:
        return NixlTransport


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu-check)")
class TestNixlConformanceOnGPU(TestNixlConformance):
    """The same suite with every KV buffer in GPU memory (NIXL VRAM)."""

    device = "cuda"


@pytest.mark.parametrize("merge", [True, False])
def test_descriptor_count_reports_merged_runs(merge: bool) -> None:
    a_kv, b_kv = make_kv(num_layers=2, num_blocks=16), make_kv(num_layers=2, num_blocks=16)
    a_kv.fill_random(4)
    a, b = NixlTransport(_name("a"), merge_descriptors=merge), NixlTransport(_name("b"))
    try:
        for t, kv in ((a, a_kv), (b, b_kv)):
            t.start()
            t.register_memory(kv.geometry)
        a.add_peer(b.agent_name, b.metadata(), b_kv.geometry)
        # Two runs (0-3 -> 8-11, 10-11 -> 2-3) and a lone block, in 4 regions.
        ours, theirs = [0, 1, 2, 3, 10, 11, 6], [8, 9, 10, 11, 2, 3, 0]
        a.write_blocks(b.agent_name, 1, ours, theirs, b"n")
        pump([a, b], lambda ev: WriteDone(1) in ev[0] and bool(messages(ev[1])))
        stats = a.statistics()
        assert stats.last_write_block_descriptors == 7 * 4
        assert stats.last_write_descriptors == (3 * 4 if merge else 7 * 4)
        for r in range(4):
            for o, t in zip(ours, theirs, strict=True):
                assert b_kv.block(r, t) == a_kv.block(r, o)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("bound", [True, False], ids=["bindings", "api-fallback"])
def test_write_calls_move_the_bytes_through_bindings_and_through_the_api(bound: bool) -> None:
    """`WriteCalls` (the per-write NIXL calls, bound once) writes the same bytes, and
    reports the same states, whether it calls NIXL's bindings directly or, for a NIXL
    whose Python API does not have them, `nixl_agent`'s own methods."""
    import dataclasses

    import numpy as np

    from kvpush.transports._nixl_import import load_nixl
    from kvpush.transports.nixl_calls import WriteCalls

    nixl = load_nixl()
    regions, blocks, size = 2, 4, 4096

    def agent(name: str) -> object:
        cfg = nixl.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]
        )
        return nixl.make_agent(name, cfg)

    def rows(bufs: list[np.ndarray]) -> np.ndarray:
        out = np.zeros((regions * blocks, 3), dtype=np.uint64)
        for r, buf in enumerate(bufs):
            out[r * blocks : (r + 1) * blocks, 0] = buf.ctypes.data + np.arange(
                blocks, dtype=np.uint64
            ) * np.uint64(size)
            out[r * blocks : (r + 1) * blocks, 1] = size
        return out

    src = [np.random.default_rng(r).integers(0, 255, blocks * size, np.uint8) for r in range(2)]
    dst = [np.zeros(blocks * size, np.uint8) for _ in range(regions)]
    a, b = agent(_name("calls-a")), agent(_name("calls-b"))
    a.register_memory([(x.ctypes.data, x.nbytes, 0, "") for x in src], "DRAM", ["UCX"])
    b.register_memory([(x.ctypes.data, x.nbytes, 0, "") for x in dst], "DRAM", ["UCX"])
    peer = a.add_remote_agent(b.get_agent_metadata())
    b_name = peer.decode() if isinstance(peer, bytes) else str(peer)
    ours = a.prep_xfer_dlist("NIXL_INIT_AGENT", rows(src), "DRAM", ["UCX"])
    theirs = a.prep_xfer_dlist(b_name, rows(dst), "DRAM", ["UCX"])
    module = nixl if bound else dataclasses.replace(nixl, api=None)
    calls = WriteCalls(module, a, "UCX", merge=True)
    assert calls.bound is bound
    # Our block 3 of both regions into their block 1.
    our_index = np.array([3, blocks + 3], dtype=np.int32)
    their_index = np.array([1, blocks + 1], dtype=np.int32)
    handle = calls.make(ours, our_index, theirs, their_index, b"landed")
    state = calls.post(handle, b"landed")
    notes: list[bytes] = []
    deadline = time.monotonic() + 10
    while state == "PROC" or not notes:
        assert time.monotonic() < deadline, f"write still {state}, notifications {notes}"
        state = calls.state(handle) if state == "PROC" else state
        notes += [m for ms in b.get_new_notifs().values() for m in ms]
    handle.release()
    assert state == "DONE"
    assert notes == [b"landed"]
    for r in range(regions):
        assert bytes(dst[r][size : 2 * size]) == bytes(src[r][3 * size : 4 * size])
        assert not dst[r][:size].any() and not dst[r][2 * size :].any()
