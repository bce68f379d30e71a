"""The transport conformance suite: what every `Transport` must do, checked on real bytes.

Use it by subclassing `TransportConformance` in a test module and overriding the
`transport_factory` fixture with one that returns a callable `name -> Transport` (not
started). Each test builds two or three endpoints, registers real memory (torch tensors),
handshakes them and checks what lands where, byte for byte.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import torch

from kvpush.doctor_probe.scratch import ScratchBuffer, digest, pattern
from kvpush.errors import ClosedError, FailureReason, KVPushError, TransportError
from kvpush.geometry import (
    CacheGeometry,
    KVHeads,
    Region,
    sub_block_ids,
    write_plan,
    write_views,
)
from kvpush.transports.base import (
    MessageReceived,
    PeerLost,
    Transport,
    TransportEvent,
    WriteDone,
    WriteFailed,
)

TransportFactory = Callable[[str], Transport]

POLL_TIMEOUT_S = 10.0
HEAD_BYTES = 128  # one KV head of one block, in the tests of parts of blocks


class _AnyDetail(str):
    """Equal to any detail text: tests compare events, not their wording."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, str)

    def __hash__(self) -> int:
        return 0


ANY_DETAIL = _AnyDetail("<any detail>")


@dataclass
class KVBuffers:
    """A KV cache made of torch tensors, one per region, plus its geometry."""

    tensors: list[torch.Tensor]
    geometry: CacheGeometry

    def block(self, region: int, block: int) -> bytes:
        r = self.geometry.regions[region]
        t = self.tensors[region].view(torch.uint8).reshape(r.num_blocks, -1)
        return bytes(t[block, : r.block_bytes].cpu().numpy())

    def fill_random(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for t in self.tensors:
            flat = t.view(torch.uint8).reshape(-1)
            flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
        if self.tensors and self.tensors[0].is_cuda:
            torch.cuda.synchronize()

    def zero(self) -> None:
        for t in self.tensors:
            t.view(torch.uint8).zero_()


def make_kv(
    num_layers: int = 2,
    num_blocks: int = 8,
    block_bytes: int = 256,
    *,
    padding: int = 0,
    device: str = "cpu",
    name_prefix: str = "model.layers",
) -> KVBuffers:
    """K and V regions per layer; each block `block_bytes` long, `padding` bytes apart
    (padding > 0 makes a strided region whose blocks are not contiguous)."""
    tensors: list[torch.Tensor] = []
    regions: list[Region] = []
    stride = block_bytes + padding
    for layer in range(num_layers):
        for kv in ("k", "v"):
            t = torch.zeros((num_blocks, stride), dtype=torch.uint8, device=device)
            tensors.append(t)
            regions.append(
                Region(
                    name=f"{name_prefix}.{layer}.{kv}",
                    layer=layer,
                    base_addr=t.data_ptr(),
                    block_bytes=block_bytes,
                    block_stride=stride,
                    num_blocks=num_blocks,
                    device=str(t.device) if t.is_cuda else "cpu",
                )
            )
    geometry = CacheGeometry(
        layout="kv_separate/NHD",
        block_size_tokens=16,
        dtype="uint8",
        regions=tuple(regions),
    )
    return KVBuffers(tensors, geometry)


def pump(
    transports: Sequence[Transport],
    until: Callable[[list[list[TransportEvent]]], bool],
    timeout_s: float = POLL_TIMEOUT_S,
    events: list[list[TransportEvent]] | None = None,
) -> list[list[TransportEvent]]:
    """Poll every transport until `until(events_so_far)` holds; fail the test on timeout."""
    seen = events if events is not None else [[] for _ in transports]
    deadline = time.monotonic() + timeout_s
    while True:
        for i, t in enumerate(transports):
            seen[i].extend(t.poll())
        if until(seen):
            return seen
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting; events so far: {seen}")
        time.sleep(0.0005)


def settle(transports: Sequence[Transport], duration_s: float) -> list[list[TransportEvent]]:
    """Poll for a while and return everything that happened."""
    seen: list[list[TransportEvent]] = [[] for _ in transports]
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        for i, t in enumerate(transports):
            seen[i].extend(t.poll())
        time.sleep(0.001)
    return seen


def messages(events: list[TransportEvent]) -> list[MessageReceived]:
    return [e for e in events if isinstance(e, MessageReceived)]


def write_results(events: list[TransportEvent]) -> list[WriteDone | WriteFailed]:
    return [e for e in events if isinstance(e, WriteDone | WriteFailed)]


@dataclass
class Pair:
    sender: Transport
    receiver: Transport
    sender_kv: KVBuffers
    receiver_kv: KVBuffers


@dataclass
class ScratchPair:
    pair: Pair
    ours: ScratchBuffer  # the sender's
    theirs: ScratchBuffer  # the receiver's


class TransportConformance:
    """Subclass and override `transport_factory`."""

    # Where the KV buffers live: "cpu", or "cuda" for the GPU run (scripts/gpu-check).
    device = "cpu"

    def kv(self, **kwargs: Any) -> KVBuffers:
        return make_kv(device=self.device, **kwargs)

    @pytest.fixture
    def transport_factory(self) -> TransportFactory:
        raise NotImplementedError("override the transport_factory fixture")

    @pytest.fixture
    def endpoints(self, transport_factory: TransportFactory) -> Iterator[list[Transport]]:
        """Every transport a test creates through `new_endpoint`, closed at the end."""
        made: list[Transport] = []
        yield made
        for t in made:
            t.close()

    @pytest.fixture
    def new_endpoint(
        self, transport_factory: TransportFactory, endpoints: list[Transport]
    ) -> Callable[[str, KVBuffers], Transport]:
        counter = iter(range(1_000_000))

        def make(role: str, kv: KVBuffers) -> Transport:
            t = transport_factory(f"{role}-{next(counter)}-{time.monotonic_ns()}")
            endpoints.append(t)
            t.start()
            t.register_memory(kv.geometry)
            return t

        return make

    @pytest.fixture
    def pair(self, new_endpoint: Callable[[str, KVBuffers], Transport]) -> Pair:
        sender_kv = self.kv()
        receiver_kv = self.kv()
        sender_kv.fill_random(1)
        sender = new_endpoint("sender", sender_kv)
        receiver = new_endpoint("receiver", receiver_kv)
        sender.add_peer(receiver.agent_name, receiver.metadata(), receiver_kv.geometry)
        receiver.add_peer(sender.agent_name, sender.metadata(), sender_kv.geometry)
        return Pair(sender, receiver, sender_kv, receiver_kv)

    # ------------------------------------------------------------------ writes
    def test_write_copies_blocks_and_notifies_after_the_data(self, pair: Pair) -> None:
        ours, theirs = [1, 2, 3, 6], [5, 6, 7, 0]
        pair.sender.write_blocks(pair.receiver.agent_name, 7, ours, theirs, b"done-7")
        landed: dict[str, bool] = {}

        def until(ev: list[list[TransportEvent]]) -> bool:
            got = [m for m in messages(ev[1]) if m.payload == b"done-7"]
            if got and "checked" not in landed:
                # The notification is here: every byte must be here too.
                landed["checked"] = all(
                    pair.receiver_kv.block(r, t) == pair.sender_kv.block(r, o)
                    for r in range(len(pair.sender_kv.geometry.regions))
                    for o, t in zip(ours, theirs, strict=True)
                )
            return bool(got) and WriteDone(7) in ev[0]

        ev = pump([pair.sender, pair.receiver], until)
        assert landed["checked"], "notification arrived before the data"
        assert write_results(ev[0]) == [WriteDone(7)]
        assert messages(ev[1]) == [MessageReceived(pair.sender.agent_name, b"done-7")]
        # Blocks not named by the write are untouched.
        zero = bytes(pair.sender_kv.geometry.regions[0].block_bytes)
        for r in range(len(pair.receiver_kv.geometry.regions)):
            for b in (1, 2, 3, 4):
                assert pair.receiver_kv.block(r, b) == zero

    def test_a_completed_write_says_what_it_moved(self, pair: Pair) -> None:
        """`WriteDone` carries the bytes the write moved and the contiguous copies it
        took: blocks 1-3 go to 5-7 as one run per region, block 6 as one more; the
        one-block write takes one per region. Regions are tensors of their own, never
        contiguous with the blocks of the next here, so nothing merges across them."""
        geometry = pair.sender_kv.geometry
        regions = len(geometry.regions)
        pair.sender.write_blocks(pair.receiver.agent_name, 1, [1, 2, 3, 6], [5, 6, 7, 0], b"a")
        pair.sender.write_blocks(pair.receiver.agent_name, 2, [4], [4], b"b")
        ev = pump([pair.sender, pair.receiver], lambda ev: len(write_results(ev[0])) == 2)
        done = {e.write_id: e for e in write_results(ev[0]) if isinstance(e, WriteDone)}
        assert (done[1].nbytes, done[1].descriptors) == (4 * geometry.bytes_per_block, 2 * regions)
        assert (done[2].nbytes, done[2].descriptors) == (geometry.bytes_per_block, regions)

    def test_write_without_notification_sends_no_message(self, pair: Pair) -> None:
        pair.sender.write_blocks(pair.receiver.agent_name, 1, [0, 1], [2, 3], None)
        ev = pump([pair.sender, pair.receiver], lambda ev: WriteDone(1) in ev[0])
        # A barrier, not a sleep: a notification of write 1 would come before it.
        pair.sender.write_blocks(pair.receiver.agent_name, 2, [4], [4], b"barrier")
        pump([pair.sender, pair.receiver], lambda ev: bool(messages(ev[1])), events=ev)
        assert messages(ev[1]) == [MessageReceived(pair.sender.agent_name, b"barrier")]
        for r in range(len(pair.sender_kv.geometry.regions)):
            assert pair.receiver_kv.block(r, 2) == pair.sender_kv.block(r, 0)
            assert pair.receiver_kv.block(r, 3) == pair.sender_kv.block(r, 1)

    def test_write_only_the_given_regions(self, pair: Pair) -> None:
        pair.sender.write_blocks(pair.receiver.agent_name, 2, [4], [4], b"layer", regions=[1, 2])
        pump(
            [pair.sender, pair.receiver],
            lambda ev: WriteDone(2) in ev[0] and bool(messages(ev[1])),
        )
        zero = bytes(pair.sender_kv.geometry.regions[0].block_bytes)
        for r in range(len(pair.sender_kv.geometry.regions)):
            expected = pair.sender_kv.block(r, 4) if r in (1, 2) else zero
            assert pair.receiver_kv.block(r, 4) == expected, f"region {r}"

    def test_many_writes_in_flight_complete_once_each(self, pair: Pair) -> None:
        n = pair.sender_kv.geometry.num_blocks
        for i in range(n):
            pair.sender.write_blocks(
                pair.receiver.agent_name, 100 + i, [i], [n - 1 - i], f"w{i}".encode()
            )
        ev = pump(
            [pair.sender, pair.receiver],
            lambda ev: len(write_results(ev[0])) == n and len(messages(ev[1])) == n,
        )
        # A barrier, not a sleep: a second report of any write would come before its end.
        # It rewrites what the last write wrote, so the bytes checked below stay the same.
        pair.sender.write_blocks(pair.receiver.agent_name, 99, [n - 1], [0], b"barrier")
        pump(
            [pair.sender, pair.receiver],
            lambda ev: (
                WriteDone(99) in ev[0] and b"barrier" in [m.payload for m in messages(ev[1])]
            ),
            events=ev,
        )
        assert sorted(write_results(ev[0]), key=lambda e: e.write_id) == [
            WriteDone(99),
            *(WriteDone(100 + i) for i in range(n)),
        ]
        assert sorted(m.payload for m in messages(ev[1])) == sorted(
            [b"barrier", *(f"w{i}".encode() for i in range(n))]
        )
        for i in range(n):
            for r in range(len(pair.sender_kv.geometry.regions)):
                assert pair.receiver_kv.block(r, n - 1 - i) == pair.sender_kv.block(r, i)

    def test_empty_write_completes_and_notifies(self, pair: Pair) -> None:
        pair.sender.write_blocks(pair.receiver.agent_name, 3, [], [], b"nothing")
        ev = pump(
            [pair.sender, pair.receiver],
            lambda ev: WriteDone(3) in ev[0] and bool(messages(ev[1])),
        )
        assert messages(ev[1]) == [MessageReceived(pair.sender.agent_name, b"nothing")]

    def test_strided_regions(self, new_endpoint: Callable[[str, KVBuffers], Transport]) -> None:
        a_kv, b_kv = self.kv(padding=64), self.kv(padding=32)
        a_kv.fill_random(5)
        b_kv.fill_random(6)
        a, b = new_endpoint("a", a_kv), new_endpoint("b", b_kv)
        a.add_peer(b.agent_name, b.metadata(), b_kv.geometry)
        before = [[b_kv.block(r, x) for x in range(8)] for r in range(4)]
        pads = [
            bytes(t.view(torch.uint8).reshape(8, -1)[:, 256:].cpu().numpy()) for t in b_kv.tensors
        ]
        a.write_blocks(b.agent_name, 1, [0, 1, 2, 5], [3, 4, 5, 1], b"s")
        pump([a, b], lambda ev: WriteDone(1) in ev[0] and bool(messages(ev[1])))
        for r in range(4):
            for x in range(8):
                src = {3: 0, 4: 1, 5: 2, 1: 5}.get(x)
                want = a_kv.block(r, src) if src is not None else before[r][x]
                assert b_kv.block(r, x) == want, (r, x)
            # The padding between blocks is never touched.
            pad_now = bytes(b_kv.tensors[r].view(torch.uint8).reshape(8, -1)[:, 256:].cpu().numpy())
            assert pad_now == pads[r], f"padding of region {r} was overwritten"

    def test_both_directions(self, pair: Pair) -> None:
        pair.receiver_kv.fill_random(9)
        pair.sender.write_blocks(pair.receiver.agent_name, 1, [0], [1], b"to-receiver")
        pair.receiver.write_blocks(pair.sender.agent_name, 2, [7], [6], b"to-sender")
        ev = pump(
            [pair.sender, pair.receiver],
            lambda ev: (
                WriteDone(1) in ev[0]
                and WriteDone(2) in ev[1]
                and bool(messages(ev[0]))
                and bool(messages(ev[1]))
            ),
        )
        assert [m.payload for m in messages(ev[0])] == [b"to-sender"]
        assert [m.payload for m in messages(ev[1])] == [b"to-receiver"]
        assert pair.receiver_kv.block(0, 1) == pair.sender_kv.block(0, 0)
        assert pair.sender_kv.block(3, 6) == pair.receiver_kv.block(3, 7)

    # ------------------------------------------------ parts of blocks (other TP sizes)
    def _head_pair(
        self,
        new_endpoint: Callable[[str, KVBuffers], Transport],
        sender_heads: KVHeads,
        receiver_heads: KVHeads,
    ) -> tuple[Pair, CacheGeometry, CacheGeometry]:
        """Two ranks of one model at other TP sizes (blocks of `HEAD_BYTES` per head),
        the sender's cache random, each loaded with the views `write_views` gives."""

        def ranks_kv(heads: KVHeads) -> KVBuffers:
            kv = self.kv(block_bytes=HEAD_BYTES * heads.per_rank)
            kv.geometry = msgspec.structs.replace(
                kv.geometry, layout="vllm_packed/BHNC", heads=heads
            )
            return kv

        sender_kv, receiver_kv = ranks_kv(sender_heads), ranks_kv(receiver_heads)
        sender_kv.fill_random(3)
        sender = new_endpoint("sender", sender_kv)
        receiver = new_endpoint("receiver", receiver_kv)
        ours, theirs = write_views(sender_kv.geometry, receiver_kv.geometry)
        sender.add_peer(receiver.agent_name, receiver.metadata(), theirs, ours=ours)
        back_ours, back_theirs = write_views(receiver_kv.geometry, sender_kv.geometry)
        receiver.add_peer(sender.agent_name, sender.metadata(), back_theirs, ours=back_ours)
        return Pair(sender, receiver, sender_kv, receiver_kv), ours, theirs

    @pytest.mark.parametrize(
        ("sender_rank", "receiver_rank", "source", "destination"),
        [
            # prefill TP 2 -> decode TP 1: each prefill rank fills its half of the heads
            (KVHeads(4, 2, 2, 0), KVHeads(4, 4, 1, 0), (0, 2), (0, 2)),
            (KVHeads(4, 2, 2, 1), KVHeads(4, 4, 1, 0), (0, 2), (2, 4)),
            # prefill TP 1 -> decode TP 2: each decode rank takes its half of the heads
            (KVHeads(4, 4, 1, 0), KVHeads(4, 2, 2, 1), (2, 4), (0, 2)),
        ],
        ids=["tp2-rank0-to-tp1", "tp2-rank1-to-tp1", "tp1-to-tp2-rank1"],
    )
    def test_a_write_between_views_moves_exactly_the_heads_they_name(
        self,
        new_endpoint: Callable[[str, KVBuffers], Transport],
        sender_rank: KVHeads,
        receiver_rank: KVHeads,
        source: tuple[int, int],
        destination: tuple[int, int],
    ) -> None:
        pair, _, _ = self._head_pair(new_endpoint, sender_rank, receiver_rank)
        ours, theirs = [1, 2, 3], [5, 6, 0]
        pair.sender.write_blocks(pair.receiver.agent_name, 4, ours, theirs, b"heads")
        pump(
            [pair.sender, pair.receiver],
            lambda ev: WriteDone(4) in ev[0] and bool(messages(ev[1])),
        )
        (s0, s1), (d0, d1) = source, destination
        for r in range(len(pair.sender_kv.geometry.regions)):
            for o, t in zip(ours, theirs, strict=True):
                got = pair.receiver_kv.block(r, t)
                sent = pair.sender_kv.block(r, o)
                assert (
                    got[d0 * HEAD_BYTES : d1 * HEAD_BYTES]
                    == sent[s0 * HEAD_BYTES : s1 * HEAD_BYTES]
                ), f"region {r} block {t}: the heads did not land where the plan says"
                rest = got[: d0 * HEAD_BYTES] + got[d1 * HEAD_BYTES :]
                assert rest == bytes(len(rest)), f"region {r} block {t}: other heads written"
            for b in (1, 2, 3, 4, 7):
                assert pair.receiver_kv.block(r, b) == bytes(len(pair.receiver_kv.block(r, b)))

    # ------------------------------------------------ blocks of other sizes
    @pytest.mark.parametrize(
        ("ratio", "heads", "layout"),
        [
            (2, 1, "kv_separate/HND"),
            (4, 2, "kv_separate/HND"),
            (2, 2, "kv_separate/NHD"),
        ],
        ids=["x2-1head-hnd", "x4-2heads-hnd", "x2-2heads-nhd"],
    )
    def test_a_write_of_smaller_blocks_lands_in_parts_of_larger_ones(
        self,
        new_endpoint: Callable[[str, KVBuffers], Transport],
        ratio: int,
        heads: int,
        layout: str,
    ) -> None:
        """A prefill of 16-token blocks into a decode of `ratio` times larger ones,
        through `write_plan`'s views and ids, as the runtime writes them: each run of a
        prefill block (a head's tokens where heads are outermost, the whole block where
        tokens are) lands in its part of the same run of a decode block, in token order,
        and nothing else of the decode's cache is written."""
        runs = heads if layout.endswith("/HND") else 1

        def rank_kv(tokens: int) -> KVBuffers:
            kv = self.kv(block_bytes=HEAD_BYTES * heads * tokens // 16)
            kv.geometry = msgspec.structs.replace(
                kv.geometry,
                layout=layout,
                block_size_tokens=tokens,
                heads=KVHeads(heads, heads, 1, 0),
            )
            return kv

        sender_kv, receiver_kv = rank_kv(16), rank_kv(16 * ratio)
        sender_kv.fill_random(5)
        sender = new_endpoint("sender", sender_kv)
        receiver = new_endpoint("receiver", receiver_kv)
        plan = write_plan(sender_kv.geometry, receiver_kv.geometry)
        assert plan.our_ids is not None and plan.their_ids is not None
        sender.add_peer(receiver.agent_name, receiver.metadata(), plan.theirs, ours=plan.ours)
        # The request's five prefill blocks, into decode blocks 6 and 2 (and 5 for ratio 2).
        decode_blocks = [6, 2, 5][: -(-5 // ratio)]
        parts = sub_block_ids(decode_blocks, ratio, 5)
        prefill_blocks = [3, 0, 7, 1, 4]
        sender.write_blocks(
            receiver.agent_name,
            9,
            plan.our_ids.view_ids(prefill_blocks),
            plan.their_ids.view_ids(parts),
            b"parts",
        )
        pump([sender, receiver], lambda ev: WriteDone(9) in ev[0] and bool(messages(ev[1])))
        run = HEAD_BYTES * heads // runs  # one run of one prefill block
        for r in range(len(sender_kv.geometry.regions)):
            expected = {b: bytearray(len(receiver_kv.block(r, b))) for b in range(8)}
            for i, src in enumerate(prefill_blocks):
                block, part = divmod(i, ratio)
                sent = sender_kv.block(r, src)
                for q in range(runs):
                    at = (q * ratio + part) * run
                    expected[decode_blocks[block]][at : at + run] = sent[q * run : (q + 1) * run]
            for b in range(8):
                assert receiver_kv.block(r, b) == bytes(expected[b]), (
                    f"region {r} decode block {b}: not the prefill blocks the parts name"
                )

    def test_a_rank_pair_that_shares_no_heads_moves_nothing_and_still_notifies(
        self, new_endpoint: Callable[[str, KVBuffers], Transport]
    ) -> None:
        # Prefill TP 2 over 1 KV head: rank 1 holds a copy, which decode TP 1 takes
        # from rank 0; rank 1's part is empty.
        pair, ours, theirs = self._head_pair(new_endpoint, KVHeads(1, 1, 2, 1), KVHeads(1, 1, 1, 0))
        assert {r.block_bytes for r in ours.regions + theirs.regions} == {0}
        pair.sender.write_blocks(pair.receiver.agent_name, 5, [1, 2], [3, 4], b"nothing")
        ev = pump(
            [pair.sender, pair.receiver],
            lambda ev: WriteDone(5) in ev[0] and bool(messages(ev[1])),
        )
        assert messages(ev[1]) == [MessageReceived(pair.sender.agent_name, b"nothing")]
        for r in range(len(pair.receiver_kv.geometry.regions)):
            for b in range(8):
                assert pair.receiver_kv.block(r, b) == bytes(HEAD_BYTES)

    # ---------------------------------------------------------------- messages
    def test_messages_both_ways(self, pair: Pair) -> None:
        for i in range(5):
            pair.sender.send_message(pair.receiver.agent_name, f"ping {i}".encode())
            pair.receiver.send_message(pair.sender.agent_name, f"pong {i}".encode())
        ev = pump(
            [pair.sender, pair.receiver],
            lambda ev: len(messages(ev[0])) == 5 and len(messages(ev[1])) == 5,
        )
        assert sorted(m.payload for m in messages(ev[1])) == [
            f"ping {i}".encode() for i in range(5)
        ]
        assert {m.peer for m in messages(ev[1])} == {pair.sender.agent_name}
        assert {m.peer for m in messages(ev[0])} == {pair.receiver.agent_name}

    def test_binary_message_payload_survives(self, pair: Pair) -> None:
        payload = bytes(range(256)) * 4
        pair.sender.send_message(pair.receiver.agent_name, payload)
        ev = pump([pair.sender, pair.receiver], lambda ev: bool(messages(ev[1])))
        assert messages(ev[1])[0].payload == payload

    def test_idle_poll_returns_nothing(self, pair: Pair) -> None:
        assert settle([pair.sender, pair.receiver], 0.1) == [[], []]

    # ----------------------------------------------------------------- errors
    def test_write_to_unknown_peer_is_refused(self, pair: Pair) -> None:
        with pytest.raises(TransportError) as info:
            pair.sender.write_blocks("nobody", 1, [0], [0], b"x")
        assert info.value.reason is FailureReason.UNKNOWN_PEER
        with pytest.raises(TransportError) as info:
            pair.sender.send_message("nobody", b"x")
        assert info.value.reason is FailureReason.UNKNOWN_PEER

    @pytest.mark.parametrize(
        "case",
        [
            ([0, 1], [0], None, b"x", "destination"),
            ([8], [0], None, b"x", "out of range"),
            ([0], [-1], None, b"x", "out of range"),
            ([0], [0], [4], b"x", "region index"),
            ([0], [0], [1, 1], b"x", "repeat"),
            ([0], [0], None, b"", "notification is empty"),
        ],
        ids=["lengths", "our-range", "their-range", "region", "repeat", "empty-notification"],
    )
    def test_bad_write_arguments_are_refused(
        self, pair: Pair, case: tuple[list[int], list[int], list[int] | None, bytes, str]
    ) -> None:
        ours, theirs, regions, notification, words = case
        with pytest.raises(TransportError) as info:
            pair.sender.write_blocks(
                pair.receiver.agent_name, 1, ours, theirs, notification, regions
            )
        assert info.value.reason is FailureReason.LOCAL_ERROR
        assert words in str(info.value)
        # Nothing was started: the same write id is free, and the transport still works.
        pair.sender.write_blocks(pair.receiver.agent_name, 1, [0], [0], None)
        pump([pair.sender, pair.receiver], lambda ev: WriteDone(1) in ev[0])

    def test_write_id_in_flight_is_refused(self, pair: Pair) -> None:
        pair.sender.write_blocks(pair.receiver.agent_name, 5, [0], [0], None)
        with pytest.raises(TransportError) as info:
            pair.sender.write_blocks(pair.receiver.agent_name, 5, [1], [1], None)
        assert info.value.reason is FailureReason.LOCAL_ERROR
        ev = pump([pair.sender, pair.receiver], lambda ev: WriteDone(5) in ev[0])
        assert write_results(ev[0]) == [WriteDone(5)]

    def test_garbage_metadata_fails_the_handshake(
        self, new_endpoint: Callable[[str, KVBuffers], Transport]
    ) -> None:
        kv = self.kv()
        a = new_endpoint("a", kv)
        with pytest.raises(TransportError) as info:
            a.add_peer("b", b"\x00not metadata at all", self.kv().geometry)
        assert info.value.reason is FailureReason.HANDSHAKE_FAILED
        assert not a.has_peer("b")

    def test_metadata_of_another_agent_fails_the_handshake(
        self, new_endpoint: Callable[[str, KVBuffers], Transport]
    ) -> None:
        a_kv, b_kv = self.kv(), self.kv()
        a, b = new_endpoint("a", a_kv), new_endpoint("b", b_kv)
        with pytest.raises(TransportError) as info:
            a.add_peer("someone-else", b.metadata(), b_kv.geometry)
        assert info.value.reason is FailureReason.HANDSHAKE_FAILED
        assert "someone-else" in str(info.value)
        assert not a.has_peer("someone-else")
        # The failed attempt left nothing behind: the right name still works.
        a.add_peer(b.agent_name, b.metadata(), b_kv.geometry)
        a.write_blocks(b.agent_name, 1, [0], [0], b"ok")
        pump([a, b], lambda ev: WriteDone(1) in ev[0] and bool(messages(ev[1])))

    def test_incompatible_geometry_is_refused(
        self, new_endpoint: Callable[[str, KVBuffers], Transport]
    ) -> None:
        a_kv, b_kv = self.kv(block_bytes=256), self.kv(block_bytes=128)
        a, b = new_endpoint("a", a_kv), new_endpoint("b", b_kv)
        with pytest.raises(TransportError) as info:
            a.add_peer(b.agent_name, b.metadata(), b_kv.geometry)
        assert info.value.reason is FailureReason.INCOMPATIBLE_PEER
        assert "128" in str(info.value) and "256" in str(info.value)
        assert not a.has_peer(b.agent_name)

    def test_remove_peer(self, pair: Pair) -> None:
        name = pair.receiver.agent_name
        assert pair.sender.has_peer(name)
        pair.sender.remove_peer(name)
        assert not pair.sender.has_peer(name)
        pair.sender.remove_peer(name)  # unknown peers are ignored
        pair.sender.remove_peer("never-heard-of")
        with pytest.raises(TransportError) as info:
            pair.sender.write_blocks(name, 1, [0], [0], None)
        assert info.value.reason is FailureReason.UNKNOWN_PEER
        with pytest.raises(TransportError) as info:
            pair.sender.send_message(name, b"to a removed peer")
        assert info.value.reason is FailureReason.UNKNOWN_PEER
        # Added again, it works again.
        pair.sender.add_peer(name, pair.receiver.metadata(), pair.receiver_kv.geometry)
        pair.sender.write_blocks(name, 1, [2], [2], b"again")
        pump(
            [pair.sender, pair.receiver],
            lambda ev: WriteDone(1) in ev[0] and bool(messages(ev[1])),
        )
        assert pair.receiver_kv.block(0, 2) == pair.sender_kv.block(0, 2)

    def test_restarted_peer_is_a_new_peer(
        self, pair: Pair, new_endpoint: Callable[[str, KVBuffers], Transport]
    ) -> None:
        old = pair.receiver.agent_name
        pair.receiver.close()
        pair.sender.remove_peer(old)
        fresh_kv = self.kv()
        fresh = new_endpoint("receiver-restarted", fresh_kv)
        pair.sender.add_peer(fresh.agent_name, fresh.metadata(), fresh_kv.geometry)
        fresh.add_peer(pair.sender.agent_name, pair.sender.metadata(), pair.sender_kv.geometry)
        pair.sender.write_blocks(fresh.agent_name, 9, [3], [4], b"hello again")
        ev = pump(
            [pair.sender, fresh],
            lambda ev: WriteDone(9) in ev[0] and bool(messages(ev[1])),
        )
        assert messages(ev[1]) == [MessageReceived(pair.sender.agent_name, b"hello again")]
        assert fresh_kv.block(1, 4) == pair.sender_kv.block(1, 3)

    def test_a_peer_that_went_away(self, pair: Pair) -> None:
        gone = pair.receiver.agent_name
        pair.receiver.close()
        pair.sender.write_blocks(gone, 1, [0], [0], b"late")
        ev = pump([pair.sender], lambda ev: bool(write_results(ev[0])))
        assert write_results(ev[0]) == [WriteFailed(1, FailureReason.PEER_GONE, ANY_DETAIL)]
        assert [e for e in ev[0] if not isinstance(e, WriteFailed | PeerLost)] == []

    def test_messages_to_a_peer_that_went_away_are_reported(self, pair: Pair) -> None:
        """Fire and forget, but not into the void: a message to a peer that is gone never
        raises at the call, and a later poll reports the peer lost (PEER_GONE). A data
        plane may miss the first (NIXL does, before UCX saw the connection close), so we
        keep sending, as a runtime's heartbeats would, until one is reported."""
        gone = pair.receiver.agent_name
        pair.receiver.close()
        events: list[TransportEvent] = []
        sends = 0
        deadline = time.monotonic() + POLL_TIMEOUT_S
        while not any(isinstance(e, PeerLost) for e in events):
            if time.monotonic() > deadline:
                pytest.fail(f"{sends} messages to {gone}, which is gone: none was reported")
            pair.sender.send_message(gone, b"anyone there?")
            sends += 1
            events += settle([pair.sender], 0.01)[0]
        for e in events:
            assert isinstance(e, PeerLost), events
            assert e.peer == gone and e.reason is FailureReason.PEER_GONE, e

    def test_close_is_idempotent_and_final(self, pair: Pair) -> None:
        pair.sender.close()
        pair.sender.close()
        with pytest.raises(KVPushError):
            pair.sender.write_blocks(pair.receiver.agent_name, 1, [0], [0], None)
        with pytest.raises(ClosedError):
            pair.sender.poll()

    def test_calls_before_start_are_refused(self, transport_factory: TransportFactory) -> None:
        t = transport_factory(f"unstarted-{time.monotonic_ns()}")
        try:
            with pytest.raises(KVPushError, match="start"):
                t.register_memory(self.kv().geometry)
        finally:
            t.close()

    # ------------------------------------------------------------------ scratch writes
    @pytest.fixture
    def scratch_pair(self, new_endpoint: Callable[[str, KVBuffers], Transport]) -> ScratchPair:
        """A pair whose endpoints registered a scratch buffer each (after the KV cache,
        before their metadata went out, as a runtime does)."""
        kv = [self.kv(), self.kv()]
        kv[0].fill_random(3)
        buffers = [ScratchBuffer(self.device, 256 * 1024) for _ in kv]
        sender, receiver = new_endpoint("sender", kv[0]), new_endpoint("receiver", kv[1])
        for t, b in zip((sender, receiver), buffers, strict=True):
            t.register_scratch(b.region)
        sender.add_peer(receiver.agent_name, receiver.metadata(), kv[1].geometry)
        receiver.add_peer(sender.agent_name, sender.metadata(), kv[0].geometry)
        return ScratchPair(Pair(sender, receiver, kv[0], kv[1]), buffers[0], buffers[1])

    def test_a_scratch_write_copies_its_bytes_and_no_kv_block(
        self, scratch_pair: ScratchPair
    ) -> None:
        p, ours, theirs = scratch_pair.pair, scratch_pair.ours, scratch_pair.theirs
        data = pattern(b"conformance-seed", 100_000)
        ours.fill(data)
        kv_before = [p.receiver_kv.block(r, b) for r in range(4) for b in range(8)]
        p.sender.write_scratch(p.receiver.agent_name, -1, 100_000, theirs.region)
        ev = pump([p.sender, p.receiver], lambda ev: bool(write_results(ev[0])))
        assert write_results(ev[0]) == [WriteDone(-1)]
        assert theirs.digest(100_000) == digest(data)
        # Only the bytes asked for: the rest of the buffer is still zero.
        assert theirs.digest(256 * 1024) == digest(data + bytes(256 * 1024 - 100_000))
        assert [p.receiver_kv.block(r, b) for r in range(4) for b in range(8)] == kv_before
        assert messages(ev[1]) == []  # no notification

    def test_a_scratch_write_to_a_peer_loaded_for_messages_only(
        self, new_endpoint: Callable[[str, KVBuffers], Transport]
    ) -> None:
        kv = self.kv()
        ours, theirs = ScratchBuffer(self.device, 4096), ScratchBuffer(self.device, 4096)
        sender, receiver = new_endpoint("sender", kv), new_endpoint("receiver", self.kv())
        sender.register_scratch(ours.region)
        receiver.register_scratch(theirs.region)
        other = self.kv(block_bytes=128)  # an incompatible cache: messages only
        sender.add_peer(
            receiver.agent_name, receiver.metadata(), other.geometry, messages_only=True
        )
        ours.fill(b"\x5a" * 4096)
        sender.write_scratch(receiver.agent_name, -7, 4096, theirs.region)
        ev = pump([sender, receiver], lambda ev: bool(write_results(ev[0])))
        assert write_results(ev[0]) == [WriteDone(-7)]
        assert theirs.digest(4096) == digest(b"\x5a" * 4096)

    def test_scratch_writes_that_cannot_start_are_refused(
        self, scratch_pair: ScratchPair, new_endpoint: Callable[[str, KVBuffers], Transport]
    ) -> None:
        p, theirs = scratch_pair.pair, scratch_pair.theirs.region
        with pytest.raises(TransportError, match="peer was not added") as unknown:
            p.sender.write_scratch("nobody", -1, 16, theirs)
        assert unknown.value.reason is FailureReason.UNKNOWN_PEER
        with pytest.raises(TransportError, match="do not fit") as big:
            p.sender.write_scratch(p.receiver.agent_name, -1, 256 * 1024 + 1, theirs)
        assert big.value.reason is FailureReason.LOCAL_ERROR
        with pytest.raises(TransportError, match="expected a positive byte count"):
            p.sender.write_scratch(p.receiver.agent_name, -1, 0, theirs)
        bare = new_endpoint("bare", self.kv())
        bare.add_peer(p.receiver.agent_name, p.receiver.metadata(), p.receiver_kv.geometry)
        with pytest.raises(TransportError, match="no scratch buffer is registered here"):
            bare.write_scratch(p.receiver.agent_name, -1, 16, theirs)
        with pytest.raises(KVPushError, match="registered once"):
            p.sender.register_scratch(scratch_pair.ours.region)

    def test_a_scratch_write_into_memory_the_peer_never_registered_fails(
        self, scratch_pair: ScratchPair
    ) -> None:
        p = scratch_pair.pair
        stray = ScratchBuffer(self.device, 4096)  # ours, never registered by the receiver
        p.sender.write_scratch(p.receiver.agent_name, -3, 4096, stray.region)
        ev = pump([p.sender, p.receiver], lambda ev: bool(write_results(ev[0])))
        [result] = write_results(ev[0])
        assert isinstance(result, WriteFailed) and result.write_id == -3
        assert stray.digest(4096) == digest(bytes(4096))
