"""Real NIXL between processes: bytes verified by checksum in every layout and two dtypes;
whole ranks killed with SIGKILL mid-transfer."""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.waiting import wait_until
from kvpush.kvcache import KVLayout
from nixl_procs import PeerProcess, ScriptProcess, transfer_and_check

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


# --------------------------------------------------------------------------------------
# Whole ranks in separate processes, killed with SIGKILL mid-transfer.
#
# Each process (tests/runtime_peer.py) runs a PushRuntime with a NixlTransport and its own
# side channel. Liveness and lease are short (3 s and 4 s) so deaths are noticed fast. A
# death that went unnoticed would end its transfers only at their deadline (30 s in
# runtime_peer.py): the bounds asserted are well below that, and generous for a loaded
# machine, where noticing takes the settings plus scheduling noise. Not shorter: at 1 s a
# fresh-clone CI run, its vLLM half computing beside this one, timed out a live sender
# that had gone unheard for 1.04 s, in a transfer of two blocks.

RANK_PEER = Path(__file__).with_name("runtime_peer.py")
LIVENESS_S = 3.0
LEASE_S = 4.0
TRANSFER_DEADLINE_S = 30.0  # runtime_peer.py's
NOTICED_S = TRANSFER_DEADLINE_S / 3  # noticed, not left to the deadline


class RankProcess(ScriptProcess):
    """One `runtime_peer.py` process: commands in, replies and transfer results out."""

    def __init__(
        self,
        engine_id: str,
        role: str,
        port: int = 0,
        seed: int = 0,
        token: str | None = None,
        tap: Path | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.engine_id = engine_id
        self.results: list[dict[str, Any]] = []
        self._cv = threading.Condition()
        self.port = 0
        self.incarnation = ""
        env = {k: v for k, v in os.environ.items() if k != "KVPUSH_TOKEN"}
        if token is not None:
            env["KVPUSH_TOKEN"] = token
        if tap is not None:  # what a reader of the network sees of it (helpers.tap)
            env["KVPUSH_TAP"] = str(tap)
        env["KVPUSH_HOST"] = host
        args = (engine_id, role, str(port), str(seed), str(LIVENESS_S), str(LEASE_S))
        super().__init__(RANK_PEER, *args, env=env)

    def ready(self) -> RankProcess:
        """Wait for the process to be up (start several first: they come up in parallel)."""
        if not self.port:
            hello = self._reply(timeout=60)
            self.port = hello["port"]
            self.incarnation = hello["incarnation"]
        return self

    def _line(self, kind: str, body: str) -> None:
        if kind == "@result":
            with self._cv:
                self.results.append(json.loads(body))
                self._cv.notify_all()

    def wait_results(
        self, until: Callable[[list[dict[str, Any]]], bool], timeout: float
    ) -> list[dict[str, Any]]:
        with self._cv:
            if not self._cv.wait_for(lambda: until(self.results), timeout):
                pytest.fail(f"{self.engine_id}: timed out; results so far {self.results}")
            return list(self.results)

    def result_of(self, transfer_id: str) -> list[dict[str, Any]]:
        with self._cv:
            return [r for r in self.results if r["transfer_id"] == transfer_id]

    def kill9(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)


@pytest.fixture
def ranks() -> Iterator[Callable[..., RankProcess]]:
    """Start a rank process; call `.ready()` before using it."""
    made: list[RankProcess] = []

    def start(engine_id: str, role: str, port: int = 0, seed: int = 0) -> RankProcess:
        rank = RankProcess(f"{engine_id}-{os.getpid()}", role, port, seed)
        made.append(rank)
        return rank

    yield start
    for rank in made:
        rank.close()


def ended(*transfer_ids: str) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda results: {r["transfer_id"] for r in results} >= set(transfer_ids)


def layer0_landed(
    receiver: RankProcess, sender: RankProcess, ours: list[int], theirs: list[int]
) -> Callable[[], bool]:
    """True once the sender's layer-0 regions (0 and 1) of `ours` are in `theirs`."""

    def check() -> bool:
        got = receiver.call(op="checksums", blocks=theirs)["sums"]
        want = sender.call(op="checksums", blocks=ours)["sums"]
        return all(g[:2] == w[:2] for g, w in zip(got, want, strict=True))

    return check


def test_sender_killed_mid_write_fails_receiver_once_and_it_keeps_serving(
    ranks: Callable[..., RankProcess],
) -> None:
    receiver = ranks("decode", "receiver", seed=1)
    sender = ranks("prefill", "sender", seed=2)
    fresh = ranks("prefill-b", "sender", seed=3)  # comes up now, used after the kill
    receiver.ready()
    sender.ready()
    receiver.call(op="receive", transfer_id="t1", sender_port=sender.port, blocks=[0, 1, 2, 3])
    receiver.call(op="receive", transfer_id="t2", sender_port=sender.port, blocks=[8, 9])
    # Only layer 0 is computed: the sender writes it and waits for the rest (mid-write).
    sender.call(op="send", transfer_id="t1", blocks=[4, 5, 6, 7], ready_layers=[0])
    sender.call(op="send", transfer_id="t2", blocks=[10, 11], ready_layers=[0])
    wait_until(layer0_landed(receiver, sender, [4, 5, 6, 7], [0, 1, 2, 3]), 20, "layer 0")
    before = receiver.call(op="checksums", blocks=[0, 1, 2, 3])["sums"]
    sender.kill9()
    killed = time.monotonic()
    results = receiver.wait_results(ended("t1", "t2"), timeout=TRANSFER_DEADLINE_S + 10)
    assert time.monotonic() - killed < NOTICED_S
    for tid in ("t1", "t2"):
        [result] = [r for r in results if r["transfer_id"] == tid]
        assert result["reason"] in ("peer_timeout", "peer_gone"), result
    time.sleep(2 * LIVENESS_S)  # nothing more is reported for them, ever
    assert len(receiver.result_of("t1")) == 1 and len(receiver.result_of("t2")) == 1
    stats = receiver.call(op="stats")
    assert stats["blocks_held_receiving"] == 0 and stats["duplicate_reports"] == 0
    # A dead sender writes nothing more: the blocks hold what had landed.
    assert receiver.call(op="checksums", blocks=[0, 1, 2, 3])["sums"] == before

    # The receiver keeps serving: a new sender, a new transfer, bytes checked.
    fresh.ready()
    receiver.call(op="receive", transfer_id="t3", sender_port=fresh.port, blocks=[20, 21, 22])
    fresh.call(op="send", transfer_id="t3", blocks=[1, 2, 3])
    [done] = [r for r in receiver.wait_results(ended("t3"), 20) if r["transfer_id"] == "t3"]
    assert done["reason"] is None, done
    fresh.wait_results(ended("t3"), 20)
    assert (
        receiver.call(op="checksums", blocks=[20, 21, 22])["sums"]
        == fresh.call(op="checksums", blocks=[1, 2, 3])["sums"]
    )


def test_receiver_killed_frees_the_senders_blocks_within_the_lease(
    ranks: Callable[..., RankProcess],
) -> None:
    receiver = ranks("decode", "receiver", seed=1)
    sender = ranks("prefill", "sender", seed=2)
    receiver.ready()
    sender.ready()
    receiver.call(op="receive", transfer_id="t1", sender_port=sender.port, blocks=[0, 1, 2])
    sender.call(op="send", transfer_id="t1", blocks=[3, 4, 5], ready_layers=[0])
    wait_until(layer0_landed(receiver, sender, [3, 4, 5], [0, 1, 2]), 20, "layer 0")
    assert sender.call(op="stats")["blocks_held_sending"] == 3
    receiver.kill9()
    killed = time.monotonic()
    [result] = sender.wait_results(ended("t1"), timeout=TRANSFER_DEADLINE_S + 10)
    assert time.monotonic() - killed < NOTICED_S
    assert result["reason"] is not None, result
    stats = sender.call(op="stats")
    assert stats["blocks_held_sending"] == 0 and stats["in_flight"] == 0


def test_sender_restarted_under_the_same_engine_id_is_handshaked_afresh(
    ranks: Callable[..., RankProcess],
) -> None:
    receiver = ranks("decode", "receiver", seed=1)
    sender = ranks("prefill", "sender", seed=2)
    receiver.ready()
    sender.ready()
    receiver.call(op="receive", transfer_id="t1", sender_port=sender.port, blocks=[0, 1])
    sender.call(op="send", transfer_id="t1", blocks=[2, 3])
    [first] = [r for r in receiver.wait_results(ended("t1"), 20) if r["transfer_id"] == "t1"]
    assert first["reason"] is None, first
    port = sender.port
    sender.kill9()
    # Same engine id, same side-channel port, new process (new incarnation and agent).
    restarted = RankProcess(sender.engine_id, "sender", port, seed=5).ready()
    try:
        assert restarted.incarnation != sender.incarnation
        receiver.call(op="receive", transfer_id="t2", sender_port=port, blocks=[4, 5])
        restarted.call(op="send", transfer_id="t2", blocks=[6, 7])
        [second] = [r for r in receiver.wait_results(ended("t2"), 20) if r["transfer_id"] == "t2"]
        # The receiver had nothing in flight and holds the dead agent's metadata: it looks
        # the address up again before registering, so the first transfer works.
        assert second["reason"] is None, second
        assert len(receiver.result_of("t2")) == 1
        assert (
            receiver.call(op="checksums", blocks=[4, 5])["sums"]
            == restarted.call(op="checksums", blocks=[6, 7])["sums"]
        )
    finally:
        restarted.close()
