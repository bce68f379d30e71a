"""An insider: a rank that holds the token registers the transfer ids it predicts before
the real decode does (issue 22).

Three real ranks (`tests/runtime_peer.py`, each a Node over NIXL with its own side
channel, all with the same token): the prefill, the real decode and the insider, which
is a decode rank of its own and registers each id first. Where the prefill names the
decode the transfer is for (`send(receiver=...)`, as the proxy does), the insider's
Register is refused and nothing is written into its blocks; the real decode gets the
transfer, bytes compared. Where it does not, the first receiver admitted takes the
transfer: that is what an unnamed transfer trusts (README, "Trust model"), and it shows
the insider's Registers did reach the prefill first.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from helpers.waiting import wait_until
from test_nixl_multiprocess import RankProcess, ended

pytestmark = pytest.mark.nixl

TOKEN = "insider-test-token"
BLOCKS = 2
NAMED = [f"named-{i}" for i in range(3)]
UNNAMED = "unnamed-0"


@pytest.fixture(params=["127.0.0.1", "::1"])
def three(request: pytest.FixtureRequest) -> Iterator[tuple[RankProcess, ...]]:
    host: str = request.param
    tag = os.getpid()
    made = (
        RankProcess(f"prefill-{tag}", "sender", seed=1, token=TOKEN, host=host),
        RankProcess(f"decode-{tag}", "receiver", seed=2, token=TOKEN, host=host),
        RankProcess(f"insider-{tag}", "receiver", seed=3, token=TOKEN, host=host),
    )
    try:
        yield tuple(rank.ready() for rank in made)
    finally:
        for rank in made:
            rank.close()


def _blocks(i: int, base: int) -> list[int]:
    return list(range(base + i * BLOCKS, base + (i + 1) * BLOCKS))


def _registered(prefill: RankProcess, n: int) -> bool:
    return prefill.call(op="stats")["sending"].get("registered", 0) >= n


def _sums(rank: RankProcess, blocks: list[int]) -> Any:
    return rank.call(op="checksums", blocks=blocks)["sums"]


def _only(rank: RankProcess, tid: str) -> dict[str, Any]:
    [result] = rank.result_of(tid)
    return result


def test_an_insider_that_registers_first_gets_nothing_when_the_sender_names_its_decode(
    three: tuple[RankProcess, RankProcess, RankProcess],
) -> None:
    prefill, decode, insider = three
    tids = [*NAMED, UNNAMED]
    # The insider registers every id first, and the prefill holds its Registers.
    for i, tid in enumerate(tids):
        insider.call(op="receive", transfer_id=tid, sender_port=prefill.port, blocks=_blocks(i, 0))
    wait_until(lambda: _registered(prefill, len(tids)), 30, "the insider's Registers")
    named_blocks = [b for i in range(len(NAMED)) for b in _blocks(i, 0)]
    insider_before = _sums(insider, named_blocks)
    for i, tid in enumerate(tids):
        decode.call(op="receive", transfer_id=tid, sender_port=prefill.port, blocks=_blocks(i, 16))
    for i, tid in enumerate(NAMED):
        prefill.call(op="send", transfer_id=tid, blocks=_blocks(i, 8), receiver_port=decode.port)
    prefill.call(op="send", transfer_id=UNNAMED, blocks=_blocks(len(NAMED), 8))

    decode.wait_results(ended(*tids), 60)
    insider.wait_results(ended(*tids), 60)
    prefill.wait_results(ended(*tids), 60)
    for i, tid in enumerate(NAMED):
        assert _only(prefill, tid)["reason"] is None, prefill.result_of(tid)
        assert _only(decode, tid)["reason"] is None, decode.result_of(tid)
        assert _sums(decode, _blocks(i, 16)) == _sums(prefill, _blocks(i, 8))
        refused = _only(insider, tid)
        assert refused["reason"] is not None, refused
    assert prefill.call(op="stats")["wrong_receivers"] == len(NAMED)
    # Nothing the prefill sent landed in the insider's blocks for a named transfer.
    assert _sums(insider, named_blocks) == insider_before

    # Unnamed, the first receiver admitted takes it: the insider, whose Register came
    # first; the real decode is told the id is taken.
    assert _only(insider, UNNAMED)["reason"] is None, insider.result_of(UNNAMED)
    assert _sums(insider, _blocks(len(NAMED), 0)) == _sums(prefill, _blocks(len(NAMED), 8))
    assert _only(decode, UNNAMED)["reason"] is not None, decode.result_of(UNNAMED)

    for rank in three:
        stats = rank.call(op="stats")
        assert stats["blocks_held_sending"] == stats["blocks_held_receiving"] == 0, stats
        assert stats["in_flight"] == 0, stats
