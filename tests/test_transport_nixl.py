"""The NIXL transport passes the transport conformance suite (two agents in one process)."""

from __future__ import annotations

import itertools
import os

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
