"""A fake wire between real `PushProtocol` state machines, for sans-IO protocol tests.

`Wire` carries the effects of one `PushProtocol` to another: messages go through a
queue the test controls (deliver, drop, duplicate, reorder), writes really copy bytes
between per-endpoint block memories when the test lets them land. Each endpoint is named
by its agent name, as on the data plane, so a restart is a new endpoint with the same
engine id. The `wire` fixture (conftest.py) is one with p-1 and d-1 on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpush.config import CompatibilityPolicy, TimingConfig
from kvpush.errors import FailureReason
from kvpush.protocol import (
    DropPeer,
    Effect,
    Handshake,
    Heartbeat,
    LocalIdentity,
    Message,
    PeerAddress,
    PeerInfo,
    PushProtocol,
    Register,
    SendMessage,
    TransferEnded,
    WriteBlocks,
    decode,
    encode,
)
from kvpush.protocol.auth import TRAILER_BYTES, MessageAuth

TIMING = TimingConfig(
    heartbeat_interval_s=0.5, liveness_timeout_s=3.0, lease_s=5.0, transfer_deadline_s=60.0
)
NUM_LAYERS = 2
NUM_BLOCKS = 16
# What every endpoint's cache agrees on unless a test says otherwise (the fields of
# CacheGeometry.compat_fields()).
COMPAT: dict[str, object] = {
    "protocol_version": 2,
    "layout": "kv_separate/NHD",
    "block_size_tokens": 16,
    "dtype": "bfloat16",
    "mode": "push",
    "regions": [("L0", 0, 64), ("L1", 1, 64)],
}


@dataclass
class InFlightWrite:
    src: str
    write: WriteBlocks
    issued_at: float


class Wire:
    """Endpoints plus the network between them, driven step by step by a test."""

    def __init__(
        self, timing: TimingConfig = TIMING, num_layers: int = NUM_LAYERS, token: str = ""
    ) -> None:
        # With a token every endpoint authenticates its messages (`PushProtocol(auth=)`),
        # and what travels is what `PushProtocol.wire` makes.
        self.token = token
        self.timing = timing
        self.num_layers = num_layers
        self.now = 0.0
        self.ends: dict[str, PushProtocol] = {}
        self.engine_of: dict[str, str] = {}
        self.memory: dict[str, list[list[bytes]]] = {}
        self.queue: list[tuple[str, str, bytes]] = []
        self.writes: list[InFlightWrite] = []
        self.results: dict[str, list[TransferEnded]] = {}
        self.dropped_peers: dict[str, list[DropPeer]] = {}
        self.handshakes: list[tuple[str, Handshake]] = []
        self.dead: set[str] = set()
        self.auto_handshake = True
        self.write_log: list[tuple[str, str, str, tuple[int, ...]]] = []  # src, dst, tid, blocks
        # Checks every test gets for free: which live transfer owns each receiver block,
        # what each side was asked to do, and which transfers each side has ended.
        self.owner: dict[str, dict[int, str]] = {}
        self.expected: dict[tuple[str, str], tuple[str, int]] = {}  # (d, tid) -> (p, offset)
        self.submitted: dict[tuple[str, str], tuple[int, ...]] = {}  # (p, tid) -> blocks
        self.renewed: dict[tuple[str, str], float] = {}  # (p, tid) -> last lease renewal
        # Side channels: an engine keeps its address across restarts; the agent serving
        # an address is the one added there last.
        self.address_of: dict[str, PeerAddress] = {}
        self.serving: dict[PeerAddress, str] = {}
        self.info_of: dict[str, PeerInfo] = {}

    # ----- endpoints

    def add(
        self,
        agent: str,
        engine_id: str,
        incarnation: str = "1",
        compat: dict[str, object] | None = None,
        compatibility: CompatibilityPolicy | None = None,
        rank: int = 0,
    ) -> PushProtocol:
        """An agent of `engine_id`'s rank `rank`: a restart where that rank was added
        before, else the engine's side channel (one per engine, serving every rank)."""
        engine = [a for a, e in self.engine_of.items() if e == engine_id]
        same_rank = [a for a in engine if self.address_of[a].rank == rank]
        if same_rank:  # a restart: the same side channel address, a new agent
            address = self.address_of[same_rank[-1]]
        elif engine:  # another rank of the engine: its side channel, that rank
            address = PeerAddress("127.0.0.1", self.address_of[engine[0]].port, rank)
        else:
            address = PeerAddress("127.0.0.1", 5000 + len(self.ends), rank)
        ident = LocalIdentity(engine_id, incarnation, address.host, address.port, rank)
        compat = COMPAT if compat is None else compat
        policy = compatibility or CompatibilityPolicy()
        auth = MessageAuth(self.token, agent, incarnation) if self.token else None
        proto = PushProtocol(
            ident, self.timing, self.num_layers, compat, compatibility=policy, auth=auth
        )
        self.ends[agent] = proto
        self.engine_of[agent] = engine_id
        self.address_of[agent] = address
        self.serving[address] = agent
        self.info_of[agent] = PeerInfo(agent, engine_id, incarnation, compat)
        # Block b of layer l holds a pattern naming its owner, so content checks are exact.
        self.memory[agent] = [
            [f"{agent}:L{layer}:B{b}".encode() for b in range(NUM_BLOCKS)]
            for layer in range(self.num_layers)
        ]
        self.results[agent] = []
        self.dropped_peers[agent] = []
        self.owner[agent] = {}
        return proto

    def kill(self, agent: str) -> None:
        self.dead.add(agent)
        self.queue = [m for m in self.queue if m[0] != agent]
        self.writes = [w for w in self.writes if w.src != agent]

    # ----- effects

    def apply(self, src: str, effects: Sequence[Effect]) -> None:
        for eff in effects:
            match eff:
                case SendMessage(peer=peer, message=msg):
                    self.queue.append((src, peer, self.bytes_of(src, peer, msg)))
                case WriteBlocks():
                    ended = [r for r in self.results[src] if r.side == "sender"]
                    assert eff.transfer_id not in {r.transfer_id for r in ended}, (
                        f"write issued after the sender ended: {eff}"
                    )
                    self.writes.append(InFlightWrite(src, eff, self.now))
                case Handshake():
                    self.handshakes.append((src, eff))
                    if self.auto_handshake:
                        self.answer_handshake(src, eff)
                case DropPeer():
                    self.dropped_peers[src].append(eff)
                case TransferEnded():
                    seen = [r for r in self.results[src] if r.transfer_id == eff.transfer_id]
                    assert not [r for r in seen if r.side == eff.side], f"reported twice: {eff}"
                    self.results[src].append(eff)
                    if eff.side == "sender":
                        # The engine reuses the blocks the moment they are handed back,
                        # so a write still reading them copies something else.
                        for layer in self.memory[src]:
                            for b in eff.blocks:
                                layer[b] = f"{src}:reused:{eff.transfer_id}".encode()
                    if eff.side == "receiver":
                        if eff.ok:
                            self.check_content(src, eff.transfer_id, eff.blocks)
                        for b in eff.blocks:
                            assert self.owner[src].pop(b, None) == eff.transfer_id

    def answer_handshake(self, src: str, hs: Handshake) -> None:
        """The side channel at the address answers, as the agent serving it now."""
        agent = self.serving.get(hs.address)
        proto = self.ends[src]
        if agent is None or agent in self.dead:
            effects = proto.handshake_failed(
                self.now, hs.address, FailureReason.HANDSHAKE_FAILED, "nobody answers there"
            )
        else:
            effects = proto.handshake_done(self.now, hs.address, self.info_of[agent])
        self.apply(src, effects)

    # ----- engine calls, as effects applied at once

    def expect(
        self,
        d: str,
        tid: str,
        p: str,
        blocks: Sequence[int],
        offset: int = 0,
        sender_block_tokens: int | None = None,
    ) -> None:
        for b in blocks:
            owner = self.owner[d].get(b)
            assert owner is None, f"test bug: block {b} of {d} is in use"
        effects = self.ends[d].receiver.expect(
            self.now,
            tid,
            self.address_of[p],
            blocks,
            sender_offset=offset,
            sender_block_tokens=sender_block_tokens,
        )
        self.expected[(d, tid)] = (p, offset)
        for b in blocks:
            self.owner[d][b] = tid
        self.apply(d, effects)

    def submit(
        self,
        p: str,
        tid: str,
        blocks: Sequence[int],
        layers: Sequence[int] | None = None,
        receiver: PeerAddress | None = None,
    ) -> None:
        self.submitted[(p, tid)] = tuple(blocks)
        for layer, memory in enumerate(self.memory[p]):  # the engine computed them anew
            for b in blocks:
                memory[b] = f"{p}:L{layer}:B{b}".encode()
        effects = self.ends[p].sender.submit(self.now, tid, blocks, layers, receiver=receiver)
        self.apply(p, effects)

    # ----- the network

    def deliver(self, index: int = 0) -> None:
        src, dst, payload = self.queue.pop(index)
        if dst in self.dead:
            return
        match self.message_of(payload):  # what renews a sender's lease, for the lease invariant
            case Register(transfer_id=tid):
                self.renewed[(dst, tid)] = self.now
            case Heartbeat(role="receiver", transfer_ids=ids):
                for tid in ids:
                    self.renewed[(dst, tid)] = self.now
            case _:
                pass
        self.apply(dst, self.ends[dst].receive_message(self.now, src, payload))

    def deliver_register(self) -> None:
        """Deliver the first queued Register, then the heartbeat round trip a first
        contact takes before any write (the echo that bounds the receiver's clock)."""
        queued = self.queue
        [i, *_] = [i for i, m in enumerate(queued) if isinstance(self.message_of(m[2]), Register)]
        self.deliver(i)
        while hb := [
            i for i, m in enumerate(queued) if isinstance(self.message_of(m[2]), Heartbeat)
        ]:
            self.deliver(hb[0])

    def complete_write(self, index: int = 0, ok: bool = True) -> None:
        w = self.writes.pop(index)
        wb = w.write
        if wb.peer in self.dead:
            ok = False  # the receiving process is gone: the data plane reports an error
        if ok:
            for b in wb.their_blocks:
                owner = self.owner.get(wb.peer, {}).get(b)
                assert owner == wb.transfer_id, (
                    f"write for {wb.transfer_id} landed in block {b} of {wb.peer}, "
                    f"which is now {'owned by ' + owner if owner else 'released'}"
                )
            layers = range(self.num_layers) if wb.layers is None else wb.layers
            for layer in layers:
                for ours, theirs in zip(wb.our_blocks, wb.their_blocks, strict=True):
                    self.memory[wb.peer][layer][theirs] = self.memory[w.src][layer][ours]
            self.write_log.append((w.src, wb.peer, wb.transfer_id, wb.their_blocks))
            if wb.notification is not None:  # after the data, as the data plane does
                self.queue.append((w.src, wb.peer, self.bytes_of(w.src, wb.peer, wb.notification)))
            self.apply(w.src, self.ends[w.src].sender.write_done(self.now, wb.write_id))
        else:
            effects = self.ends[w.src].sender.write_failed(
                self.now, wb.write_id, FailureReason.WRITE_ERROR, "injected"
            )
            self.apply(w.src, effects)

    def settle(self, max_steps: int = 1000) -> None:
        """Deliver every message and land every write, until nothing moves."""
        for _ in range(max_steps):
            if self.queue:
                self.deliver()
            elif self.writes:
                self.complete_write()
            else:
                return
        raise AssertionError("the wire did not settle")

    def advance(self, dt: float, settle: bool = True) -> None:
        self.now += dt
        for agent, proto in self.ends.items():
            if agent not in self.dead:
                self.apply(agent, proto.tick(self.now))
        if settle:
            self.settle()

    def run_for(self, seconds: float, step: float = 0.25) -> None:
        end = self.now + seconds
        while self.now < end:
            self.advance(step)

    def run_only(self, agent: str, seconds: float, step: float = 0.25) -> None:
        """Time passes and only `agent` runs: every other endpoint is stopped (SIGSTOP),
        so it neither ticks nor reads its inbox, and no write lands or fails."""
        end = self.now + seconds
        while self.now < end:
            self.now += step
            self.apply(agent, self.ends[agent].tick(self.now))
            while mine := [i for i, m in enumerate(self.queue) if m[1] == agent]:
                self.deliver(mine[0])

    def check_content(self, d: str, tid: str, blocks: tuple[int, ...]) -> None:
        """A receiver that finished holds exactly the sender's blocks, layer by layer."""
        p, offset = self.expected[(d, tid)]
        sent = self.submitted[(p, tid)]
        for layer in range(self.num_layers):
            for i, b in enumerate(blocks):
                want = f"{p}:L{layer}:B{sent[offset + i]}".encode()
                assert self.memory[d][layer][b] == want, f"{tid}: block {b} layer {layer}"

    def ended(self, agent: str, tid: str) -> TransferEnded:
        [r] = [r for r in self.results[agent] if r.transfer_id == tid]
        return r

    def sent(self, src: str, kind: type) -> list[object]:
        return [
            msg
            for m in self.queue
            if m[0] == src and isinstance(msg := self.message_of(m[2]), kind)
        ]

    # ----- the bytes on the wire

    def bytes_of(self, src: str, dst: str, message: Message) -> bytes:
        """What `src` puts on the wire for `dst`: the encoded message, sealed for `dst`
        when the endpoints authenticate."""
        if not self.token:
            return encode(message)
        return self.ends[src].wire(dst, message)

    def message_of(self, payload: bytes) -> Message:
        """The message in `payload` (its MAC trailer, if any, left unchecked)."""
        return decode(payload[:-TRAILER_BYTES] if self.token else payload)


def assert_block_copied(w: Wire, p: str, our: int, d: str, their: int) -> None:
    for layer in range(w.num_layers):
        assert w.memory[d][layer][their] == f"{p}:L{layer}:B{our}".encode()
