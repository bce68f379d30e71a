"""Foreign NIXL agents forging every push-protocol message beside real traffic (issue 11).

Two real ranks (`tests/runtime_peer.py`: PushRuntime + NixlTransport + side channel, each
in its own process) run real transfers while `tests/forger.py`, in a third process, sends
both of them every message kind (Register, Reject with and without an address, Cancel,
Heartbeat from either role, Done, Failed, CancelAck, and garbage) with the real engine
ids, incarnations and side-channel addresses and the very transfer ids the ranks use,
before the transfers start and while they run. Some come from an agent of its own with
the right message key (the side channel gave it, as no token is set), some from agents
that carry the real ranks' agent names but no key.

Zero real transfers lost (both sides ok, bytes compared), and every forged message
counted: in `forged_messages` (the ones with the key, under the reason the protocol
found, and the others as "bad_key") or, for the garbage, in `malformed_messages`.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from kvpush.sidechannel import fetch_metadata
from nixl_procs import ScriptProcess
from test_nixl_multiprocess import RankProcess

pytestmark = pytest.mark.nixl

FORGER = Path(__file__).with_name("forger.py")
EAVESDROPPER = Path(__file__).with_name("eavesdropper.py")
SQUATTER = Path(__file__).with_name("squatter.py")
TRANSFERS = 8
BLOCKS_PER_TRANSFER = 2
COUNTED_WITHIN_S = 30.0  # a loaded 2-core machine; counting is done in well under 1 s


class Driven(ScriptProcess):
    """forger.py or squatter.py: its first reply says it is up."""

    call_timeout_s = 60.0

    def __init__(self, script: Path, *args: str) -> None:
        super().__init__(script, *args)
        self.hello = self._reply(60)


class Forger(Driven):
    def __init__(self, sender_port: int, receiver_port: int) -> None:
        super().__init__(FORGER, str(sender_port), str(receiver_port))
        self.agents = self.hello["agents"]

    def burst(self, transfer_ids: list[str], rival: bool) -> dict[str, dict[str, int]]:
        reply = self.call(
            op="burst", transfer_ids=transfer_ids, num_blocks=BLOCKS_PER_TRANSFER, rival=rival
        )
        sent: dict[str, dict[str, int]] = reply["sent"]
        return sent


def _add(total: dict[str, int], more: dict[str, int]) -> None:
    for k, v in more.items():
        total[k] = total.get(k, 0) + v


def _blocks(i: int, base: int) -> list[int]:
    return list(range(base + i * BLOCKS_PER_TRANSFER, base + (i + 1) * BLOCKS_PER_TRANSFER))


def _run(sender: RankProcess, receiver: RankProcess, tids: list[str], src: int, dst: int) -> None:
    """Real transfers `tids` from the sender's blocks `src + ...` into the receiver's
    `dst + ...`; half the receivers come first, half the senders."""
    for i, tid in enumerate(tids):
        first, second = (receiver, sender) if i % 2 else (sender, receiver)
        for rank in (first, second):
            if rank is sender:
                sender.call(op="send", transfer_id=tid, blocks=_blocks(i, src))
            else:
                receiver.call(
                    op="receive", transfer_id=tid, sender_port=sender.port, blocks=_blocks(i, dst)
                )


def _check(sender: RankProcess, receiver: RankProcess, tids: list[str], src: int, dst: int) -> None:
    """Every one of `tids` ended ok on both sides, with the sender's bytes."""
    want = {*tids}
    for rank in (sender, receiver):
        results = rank.wait_results(lambda rs: want <= {r["transfer_id"] for r in rs}, 60)
        mine = [r for r in results if r["transfer_id"] in want]
        assert [r for r in mine if r["reason"] is not None] == [], mine
        assert len(mine) == len(tids), mine
    for i, tid in enumerate(tids):
        ours = sender.call(op="checksums", blocks=_blocks(i, src))["sums"]
        theirs = receiver.call(op="checksums", blocks=_blocks(i, dst))["sums"]
        assert ours == theirs, tid


def test_forged_messages_from_foreign_agents_lose_no_real_transfer_and_are_all_counted() -> None:
    sender = RankProcess("engine-p", "sender", seed=1)
    receiver = RankProcess("engine-d", "receiver", seed=2)
    forger: Forger | None = None
    try:
        sender.ready()
        receiver.ready()
        forger = Forger(sender.port, receiver.port)
        first = [f"req-{i}" for i in range(TRANSFERS)]
        second = [f"req-{i}" for i in range(TRANSFERS, 2 * TRANSFERS)]
        sent: dict[str, dict[str, int]] = {"sender": {}, "receiver": {}}

        def burst(tids: list[str], rival: bool) -> None:
            for side, counts in forger.burst(tids, rival).items():  # type: ignore[union-attr]
                _add(sent[side], counts)

        # Before the real transfers: the ids are predicted, the engines not started.
        half = TRANSFERS * BLOCKS_PER_TRANSFER  # 16 of each rank's 32 blocks
        burst(first, rival=False)
        _run(sender, receiver, first, 0, half)
        burst(first, rival=False)  # and while they run
        _check(sender, receiver, first, 0, half)
        # Now that the sender knows engine-d, a rival side channel that serves a new
        # "incarnation" of it is checked against engine-d's own, which still runs.
        _run(sender, receiver, second, half, 0)  # other blocks: other bytes
        burst(second, rival=True)
        _check(sender, receiver, second, half, 0)

        # Every forged message counted, once, on the rank it was sent to.
        for side, rank in (("sender", sender), ("receiver", receiver)):
            want = sent[side]
            end = time.monotonic() + COUNTED_WITHIN_S
            while True:
                stats = rank.call(op="stats")
                forged = dict(stats["forged_messages"])
                bad_key = forged.pop("bad_key", 0)
                counted = (sum(forged.values()), bad_key, stats["malformed_messages"])
                if counted == (want["keyed"], want["unkeyed"], want["garbage"]):
                    break
                assert time.monotonic() < end, (side, want, stats["forged_messages"], stats)
                time.sleep(0.1)
            assert stats["failed"] == 0 and stats["finished"] == 2 * TRANSFERS, stats
            assert stats["blocks_held_sending"] == stats["blocks_held_receiving"] == 0, stats
    finally:
        if forger is not None:
            forger.close()
        sender.close()
        receiver.close()


@pytest.mark.parametrize("squatter_host", ["127.0.0.1", "::1"])
def test_a_squatter_without_the_token_gets_no_transfer_and_never_sees_the_token(
    squatter_host: str,
) -> None:
    """Issues 11 and 22: the sender's metadata, message key included, was seen on the
    network by a process without the side channel's token. It registers the predicted
    transfer ids first, naming a side channel of its own that answers as a compatible
    receiver. It cannot seal a message for any pair of ranks, so each `Register` is
    dropped unread ("bad_mac"): the sender never asks its side channel anything, writes
    nothing there and never sends the token; the real transfers all finish."""
    token = "the-shared-token-0123"
    sender = RankProcess("engine-p", "sender", seed=3, token=token)
    receiver = RankProcess("engine-d", "receiver", seed=4, token=token)
    squatter: Driven | None = None
    try:
        sender.ready()
        receiver.ready()
        seen = fetch_metadata("127.0.0.1", sender.port, token=token)  # what the network saw
        squatter = Driven(SQUATTER)
        tids = [f"req-{i}" for i in range(TRANSFERS)]
        squatted = squatter.call(
            op="squat",
            sender=msgspec.msgpack.encode(seen).hex(),
            transfer_ids=tids,
            num_blocks=BLOCKS_PER_TRANSFER,
            host=squatter_host,
        )
        assert squatted["sent"] == TRANSFERS
        end = time.monotonic() + COUNTED_WITHIN_S
        while (stats := sender.call(op="stats"))["forged_messages"] != {"bad_mac": TRANSFERS}:
            assert time.monotonic() < end, f"the squatter's registers were not all counted: {stats}"
            squatter.call(op="report", token=token)  # its UCX worker moves only when polled
        half = TRANSFERS * BLOCKS_PER_TRANSFER
        _run(sender, receiver, tids, 0, half)
        for rank in (sender, receiver):
            rank.wait_results(lambda rs: {*tids} <= {r["transfer_id"] for r in rs}, 60)
        report = squatter.call(op="report", token=token)
        # Counted before the real transfers ran: had a register reached the identity
        # gate, the side channel it names would have been asked by now.
        assert report["requests"] == 0, f"the sender asked the squatter's side channel: {report}"
        assert not report["token_seen"], "the token travelled to the squatter"
        assert report["bytes_written"] == 0, f"KV written into the squatter's memory: {report}"
        _check(sender, receiver, tids, 0, half)
        stats = sender.call(op="stats")
        assert stats["forged_messages"] == {"bad_mac": TRANSFERS}, stats
        assert stats["failed"] == 0 and stats["finished"] == TRANSFERS, stats
        assert stats["blocks_held_sending"] == 0, stats
    finally:
        if squatter is not None:
            squatter.close()
        sender.close()
        receiver.close()


class Eavesdropper(Driven):
    def __init__(self, sender: RankProcess, receiver: RankProcess, taps: list[Path]) -> None:
        super().__init__(EAVESDROPPER, *map(str, taps), str(sender.port), str(receiver.port))

    def burst(self, transfer_ids: list[str]) -> dict[str, int]:
        reply = self.call(op="burst", transfer_ids=transfer_ids, num_blocks=BLOCKS_PER_TRANSFER)
        sent: dict[str, int] = reply["sent"]
        return sent


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_what_a_network_reader_saw_makes_no_message_that_counts(tmp_path: Path, host: str) -> None:
    """Issue 22: with a token set, an attacker holds everything a reader of the network
    saw (both side channels' metadata answers, message keys, every message so far) and
    sends under the real ranks' agent names: every message kind for live and predicted
    ids, in clear or with a copied MAC trailer, and replays of real messages, changed and
    not. Zero real transfers lost or changed, and every message it sent is counted
    ("bad_mac" or "replayed"), none as a malformed message of a real peer."""
    token = "the-shared-token-0123"
    taps = [tmp_path / "sender.tap", tmp_path / "receiver.tap"]
    sender = RankProcess("engine-p", "sender", seed=5, token=token, tap=taps[0], host=host)
    receiver = RankProcess("engine-d", "receiver", seed=6, token=token, tap=taps[1], host=host)
    attacker: Eavesdropper | None = None
    try:
        sender.ready()
        receiver.ready()
        attacker = Eavesdropper(sender, receiver, taps)
        first = [f"req-{i}" for i in range(TRANSFERS)]
        second = [f"req-{i}" for i in range(TRANSFERS, 2 * TRANSFERS)]
        sent = {"sender": 0, "receiver": 0}

        def burst(tids: list[str]) -> None:
            for side, n in attacker.burst(tids).items():  # type: ignore[union-attr]
                sent[side] += n

        half = TRANSFERS * BLOCKS_PER_TRANSFER
        burst(first)  # predicted ids, before any real message to replay
        _run(sender, receiver, first, 0, half)
        burst(first + second)  # live ones, the next ones, and replays of what went by
        _check(sender, receiver, first, 0, half)
        _run(sender, receiver, second, half, 0)
        burst(second)
        _check(sender, receiver, second, half, 0)
        burst(first + second)  # replays of everything, after the fact

        for side, rank in (("sender", sender), ("receiver", receiver)):
            end = time.monotonic() + COUNTED_WITHIN_S
            while True:
                stats = rank.call(op="stats")
                forged = stats["forged_messages"]
                if sum(forged.values()) == sent[side]:
                    break
                assert time.monotonic() < end, (side, sent[side], forged, stats)
                time.sleep(0.1)
            assert set(forged) == {"bad_mac", "replayed"}, forged
            assert stats["malformed_messages"] == 0, stats
            assert stats["failed"] == 0 and stats["finished"] == 2 * TRANSFERS, stats
            assert stats["blocks_held_sending"] == stats["blocks_held_receiving"] == 0, stats
    finally:
        if attacker is not None:
            attacker.close()
        sender.close()
        receiver.close()
