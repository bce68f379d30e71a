"""Two real runtimes over NIXL, in separate processes, set up as the README shows
(`SideChannelPeerDirectory` with its defaults; in the dtype case the caches are torch
tensors registered with `register_kv_cache`, in the layout case a `CacheGeometry` that
names its layout, which spares two torch imports), whose caches differ in one field that
changes what the bytes mean but not how many there are. Every block has the same size
on both sides, so only a compatibility check can tell: the transfer must fail on both
sides as INCOMPATIBLE_PEER, say which field differs (ours and theirs), and write no byte
into the receiver."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator

import pytest

from chaos_procs import ChaosRank, close_all, ended
from helpers.waiting import wait_until

pytestmark = pytest.mark.nixl

DEADLINE_S = 10.0  # the transfer deadline: a side never told about the mismatch ends by it
MARGIN_S = 10.0  # scheduling noise on a shared 2-core machine, never a speed claim
RECEIVER_BLOCKS = [0, 1, 2, 3]
SENDER_BLOCKS = [4, 5, 6, 7]


@pytest.fixture
def ranks() -> Iterator[Callable[..., ChaosRank]]:
    made: list[ChaosRank] = []

    def start(engine_id: str, role: str, *options: str) -> ChaosRank:
        rank = ChaosRank(
            f"{engine_id}-{os.getpid()}", role, "--deadline", str(DEADLINE_S), *options
        )
        made.append(rank)
        return rank

    yield start
    close_all(made)


def names(detail: str, value: str) -> bool:
    """`value` appears as a word of its own (so "float16" is not found in "bfloat16")."""
    return re.search(rf"(?<![\w/]){re.escape(value)}(?![\w/])", detail) is not None


@pytest.mark.parametrize(
    ("host", "cache", "field", "receiver_value", "sender_value"),
    [
        ("127.0.0.1", "--torch", "dtype", "bfloat16", "float16"),
        ("::1", "--numpy", "layout", "kv_separate/NHD", "kv_separate/HND"),
    ],
    ids=["dtype-ipv4", "layout-ipv6"],
)
def test_caches_that_differ_only_in_meaning_never_transfer(
    ranks: Callable[..., ChaosRank],
    host: str,
    cache: str,
    field: str,
    receiver_value: str,
    sender_value: str,
) -> None:
    options = ("--host", host, cache, f"--{field}")
    receiver = ranks("decode", "receiver", *options, receiver_value)
    sender = ranks("prefill", "sender", *options, sender_value)
    receiver.ready()
    sender.ready()
    before = receiver.call(op="checksums", blocks=RECEIVER_BLOCKS)["sums"]
    receiver.call(op="receive", transfer_id="t1", sender_port=sender.port, blocks=RECEIVER_BLOCKS)
    sender.call(op="send", transfer_id="t1", blocks=SENDER_BLOCKS)

    for rank, ours, theirs in (
        (receiver, receiver_value, sender_value),
        (sender, sender_value, receiver_value),
    ):
        [result] = rank.wait_results(ended("t1"), DEADLINE_S + MARGIN_S)
        assert result["reason"] == "incompatible_peer", (rank.engine_id, result)
        detail = result["detail"]
        assert field in detail, detail
        assert names(detail, ours) and names(detail, theirs), detail
        assert "ours" in detail and "theirs" in detail, detail

    # No byte of the sender's landed: the blocks held what they held when the receiver
    # gave them back, and nothing was written into them (canaries) once it had.
    [result] = receiver.result_of("t1")
    assert result["at_end"] == before, "the sender wrote into the receiver's blocks"
    wait_until(
        lambda: (
            sender.call(op="stats")["in_flight"] == 0
            and sender.call(op="stats")["writes_in_flight"] == 0
        ),
        MARGIN_S,
        "the sender to hold nothing",
    )
    check = receiver.call(op="check")
    assert check["canaries_checked"] == len(RECEIVER_BLOCKS), check
    assert check["canaries_overwritten"] == [], check
    assert sender.call(op="stats")["writes_posted"] == 0
