"""`kvpush doctor`'s test writes (`kvpush.doctor_probe.RankProbe`, a service each runtime
is given) between two PushRuntimes on the loopback transport: real threads, real byte
copies, the receiver's buffer read back and both KV caches compared before and after.
The protocol's clock is a fake (deadlines); writes are timed on the real one."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator

import msgspec
import pytest

from helpers.fakes import FakeClock
from helpers.waiting import wait_until
from kvpush.config import TimingConfig
from kvpush.doctor_probe import PROBE_TIMEOUT_S, ProbeRefused, ProbeReport, RankProbe
from kvpush.doctor_probe.scratch import PROBE_SIZES, PROBE_WRITES, SCRATCH_BYTES, digest, pattern
from kvpush.geometry import ScratchRegion
from kvpush.runtime import (
    InMemoryPeerDirectory,
    PeerAddress,
    PushRuntime,
    RuntimeIdentity,
    RuntimeSettings,
)
from kvpush.sidechannel import PeerMetadata
from kvpush.transports.loopback import LoopbackFabric, LoopbackTransport
from transport_conformance import KVBuffers, make_kv

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
TIMING = TimingConfig(heartbeat_interval_s=0.5, liveness_timeout_s=3.0, lease_s=5.0)


class HeldScratchTransport(LoopbackTransport):
    """A loopback endpoint whose scratch writes are taken and never complete: a data
    plane that accepts a write and then goes quiet (a peer behind a black hole)."""

    def __init__(self, fabric: LoopbackFabric, name: str) -> None:
        super().__init__(fabric, name)
        self.held: list[int] = []

    def write_scratch(self, peer: str, write_id: int, nbytes: int, theirs: ScratchRegion) -> None:
        self.held.append(write_id)


class ProbedRank:
    """A runtime and the doctor's probe it was given: what the checks are asked of."""

    def __init__(self, runtime: PushRuntime, probe: RankProbe) -> None:
        self.runtime = runtime
        self.probe = probe

    def local_metadata(self) -> PeerMetadata:
        return self.runtime.local_metadata()

    def start_probe(self, target: PeerAddress, seed: bytes) -> int:
        return self.probe.start_probe(target, seed)

    def probe_report(self, probe_id: int) -> ProbeReport | None:
        return self.probe.probe_report(probe_id)

    def scratch_digest(self, nbytes: int) -> str:
        return self.probe.scratch_digest(nbytes)


class Pair:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.fabric = LoopbackFabric(clock=self.clock)
        self.directory = InMemoryPeerDirectory()
        self.runtimes: list[PushRuntime] = []
        self.kv: dict[str, KVBuffers] = {}

    def add(
        self,
        agent: str,
        port: int,
        *,
        scratch: bool = True,
        transport: LoopbackTransport | None = None,
    ) -> tuple[ProbedRank, PeerAddress]:
        kv = make_kv(num_layers=2, num_blocks=8, block_bytes=64)
        kv.fill_random(port)
        probe = RankProbe(scratch)
        rt = PushRuntime(
            transport or LoopbackTransport(self.fabric, agent),
            kv.geometry,
            RuntimeIdentity(f"engine-{agent}", agent, HOST, port),
            self.directory,
            RuntimeSettings(timing=TIMING),
            clock=self.clock,
            services=[probe],
        )
        rt.start()
        address = PeerAddress(HOST, port)
        self.directory.publish(address, rt.local_metadata())
        self.runtimes.append(rt)
        self.kv[agent] = kv
        return ProbedRank(rt, probe), address

    def cache(self, agent: str) -> list[bytes]:
        kv = self.kv[agent]
        return [
            kv.block(r, b)
            for r in range(len(kv.geometry.regions))
            for b in range(kv.geometry.num_blocks)
        ]

    def close(self) -> None:
        for rt in self.runtimes:
            rt.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def finished(rt: ProbedRank, probe: int, advance: FakeClock | None = None) -> ProbeReport:
    """The check's report once it is no longer running (moving the fake clock if given)."""

    def ended() -> bool:
        if advance is not None:
            advance.advance(1.0)
        report = rt.probe_report(probe)
        return report is not None and report.state != "running"

    wait_until(ended, timeout=20)
    report = rt.probe_report(probe)
    assert report is not None
    return report


def test_a_check_writes_the_pattern_into_the_receivers_scratch_and_no_kv_block(
    pair: Pair,
) -> None:
    sender, _ = pair.add("prefill", 7001)
    receiver, decode = pair.add("decode", 7002)
    before = {a: pair.cache(a) for a in pair.kv}
    seed = secrets.token_bytes(16)
    assert receiver.scratch_digest(SCRATCH_BYTES) == digest(bytes(SCRATCH_BYTES))  # zeroed

    report = finished(sender, sender.start_probe(decode, seed))

    assert report.state == "ok", report.detail
    assert report.peer_agent == "decode"
    assert report.their_device == "cpu"
    assert [n for n, _ in report.writes] == [n for n in PROBE_SIZES for _ in range(PROBE_WRITES)]
    assert all(s > 0 for _, s in report.writes)
    figures = report.as_dict()["sizes"]
    assert isinstance(figures, dict)
    assert sorted(figures) == sorted(str(n) for n in PROBE_SIZES)
    assert figures[str(SCRATCH_BYTES)]["gb_per_s"] > 0
    assert report.transport == {"transport": "LoopbackTransport"}
    # The receiver's buffer holds the bytes the seed stands for; no KV byte moved.
    assert receiver.scratch_digest(SCRATCH_BYTES) == digest(pattern(seed, SCRATCH_BYTES))
    assert {a: pair.cache(a) for a in pair.kv} == before
    # A check loads its peer only for its own writes: the transport forgets it after.
    assert pair.fabric.statistics().writes_done == PROBE_WRITES * len(PROBE_SIZES)


def test_a_second_check_uses_a_new_seed_and_the_digest_follows(pair: Pair) -> None:
    sender, _ = pair.add("prefill", 7001)
    receiver, decode = pair.add("decode", 7002)
    for _ in range(2):
        seed = secrets.token_bytes(16)
        assert finished(sender, sender.start_probe(decode, seed)).state == "ok"
        assert receiver.scratch_digest(SCRATCH_BYTES) == digest(pattern(seed, SCRATCH_BYTES))


def test_a_receiver_without_a_scratch_buffer_is_named_and_nothing_is_written(
    pair: Pair,
) -> None:
    sender, _ = pair.add("prefill", 7001)
    receiver, decode = pair.add("decode", 7002, scratch=False)
    assert receiver.local_metadata().scratch is None

    report = finished(sender, sender.start_probe(decode, secrets.token_bytes(16)))

    assert report.state == "failed"
    assert "decode publishes no scratch buffer" in report.detail
    assert pair.fabric.statistics().writes_done == 0
    with pytest.raises(ProbeRefused, match="no scratch buffer"):
        receiver.scratch_digest(1024)


def test_a_sender_without_a_scratch_buffer_refuses_to_start(pair: Pair) -> None:
    sender, _ = pair.add("prefill", 7001, scratch=False)
    _, decode = pair.add("decode", 7002)
    with pytest.raises(ProbeRefused, match="no scratch buffer: its server was started"):
        sender.start_probe(decode, secrets.token_bytes(16))


def test_a_published_scratch_buffer_over_the_kv_cache_is_refused(pair: Pair) -> None:
    """A receiver whose metadata puts its scratch buffer on its KV cache (a forged or
    buggy publisher) gets no write: the doctor never touches a KV block."""
    sender, _ = pair.add("prefill", 7001)
    receiver, decode = pair.add("decode", 7002)
    region = receiver.local_metadata().geometry.regions[1]
    forged = msgspec.structs.replace(
        receiver.local_metadata(),
        scratch=ScratchRegion(region.base_addr + region.block_stride, 65536),
    )
    pair.directory.publish(decode, forged)
    before = pair.cache("decode")

    report = finished(sender, sender.start_probe(decode, secrets.token_bytes(16)))

    assert report.state == "failed"
    # The first region it overlaps is named: in an interleaved layout a buffer one
    # block into this region lies in another region too (seen: "... region
    # model.layers.0.k" for a buffer placed in ...0.v).
    named = re.search(r"overlaps its KV region (\S+): nothing was written", report.detail)
    regions = {r.name for r in receiver.local_metadata().geometry.regions}
    assert named is not None and named[1] in regions, report.detail
    assert pair.cache("decode") == before
    assert pair.fabric.statistics().writes_done == 0


def test_an_unreachable_receiver_fails_the_check_with_the_data_planes_reason(
    pair: Pair,
) -> None:
    sender, _ = pair.add("prefill", 7001)
    _, decode = pair.add("decode", 7002)
    pair.fabric.partition("prefill", "decode")

    report = finished(sender, sender.start_probe(decode, secrets.token_bytes(16)))

    assert report.state == "failed"
    assert report.detail == "write 1 (65536 bytes) failed: prefill and decode are partitioned"
    assert report.writes == ()


def test_an_unknown_address_fails_the_check_at_its_lookup(pair: Pair) -> None:
    sender, _ = pair.add("prefill", 7001)
    report = finished(sender, sender.start_probe(PeerAddress(HOST, 7999), b"0123456789abcdef"))
    assert report.state == "failed"
    assert report.detail.startswith("the receiver's side channel could not be used: ")


def test_a_write_that_never_completes_times_out_and_blocks_the_next_check(
    pair: Pair,
) -> None:
    held = HeldScratchTransport(pair.fabric, "prefill")
    sender, _ = pair.add("prefill", 7001, transport=held)
    _, decode = pair.add("decode", 7002)
    probe = sender.start_probe(decode, secrets.token_bytes(16))
    wait_until(lambda: bool(held.held), timeout=10)
    # Running: the same rank takes no second check meanwhile.
    second = finished(sender, sender.start_probe(decode, secrets.token_bytes(16)))
    assert (second.state, second.detail) == ("refused", f"check {probe} is still running here")
    running = sender.probe_report(probe)
    assert running is not None and running.state == "running"

    report = finished(sender, probe, advance=pair.clock)

    assert report.state == "failed"
    assert report.detail == f"write 1 (65536 bytes) did not complete within {PROBE_TIMEOUT_S:g} s"
    # Its write is still out: no new check may add to it.
    third = finished(sender, sender.start_probe(decode, secrets.token_bytes(16)))
    assert third.state == "refused"
    assert third.detail.startswith("1 write(s) of a check that timed out are still out")
    assert held.held == [-1]  # one write taken, none after


def test_bad_arguments_are_refused_with_what_was_expected(pair: Pair) -> None:
    sender, _ = pair.add("prefill", 7001)
    _, decode = pair.add("decode", 7002)
    with pytest.raises(ProbeRefused, match="seed must be 8 to 64 bytes"):
        sender.start_probe(decode, b"short")
    with pytest.raises(ProbeRefused, match=f"expected 1 to {SCRATCH_BYTES} bytes, got 0"):
        sender.scratch_digest(0)
    assert sender.probe_report(12345) is None
