"""Real NIXL between processes: bytes verified by checksum in every layout and two dtypes."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from kvpush.kvcache import KVLayout
from nixl_procs import PeerProcess, transfer_and_check

pytestmark = pytest.mark.nixl

DTYPES = ("bfloat16", "float32")


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[PeerProcess, PeerProcess]]:
    sender, receiver = PeerProcess(), PeerProcess()
    yield sender, receiver
    sender.close()
    receiver.close()


_keys = itertools.count(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", [layout.value for layout in KVLayout])
def test_bytes_arrive_intact(
    pair: tuple[PeerProcess, PeerProcess], layout: str, dtype: str
) -> None:
    sender, receiver = pair
    result = transfer_and_check(sender, receiver, next(_keys), layout, dtype)
    # 13 blocks in 4 regions: at most one descriptor per block per region, and fewer
    # when runs merge (blocks 20-22 are consecutive on both sides in dense layouts).
    assert 0 < result["descriptors"] <= 13 * 4
