"""The push protocol's state machines: every transition, in one place, with no I/O.

Theory of operation
===================

Two machines per rank: `SenderProtocol` (the side whose engine computed the KV blocks,
usually prefill) and `ReceiverProtocol` (the side that allocated blocks for them, usually
decode). `PushProtocol` holds both and is the one inbound entry point for wire bytes and
handshake results. They take engine calls, decoded messages, transport events, handshake
results and the current time `now` (monotonic seconds, fed by the caller), and return
lists of *effects*: `SendMessage`, `WriteBlocks`, `Handshake`, `DropPeer`,
`TransferEnded`. They import no socket, thread or clock; the runtime carries out the
effects. Every `TransferEnded` comes from here: the runtime only passes them on.

A transfer is named by its `transfer_id`, end to end. Peers are named by data-plane agent
name, which is new for every process incarnation, so a restarted peer is a new peer.
Side channels are named by `PeerAddress` (host, port, rank); a handshake looks one up
and yields a `PeerInfo` (agent, engine id, incarnation, the peer's compatibility
fields).

The happy path::

    receiver                                 sender
    expect(T, address, blocks)
      (Handshake(address) unless known)
    handshake_done(address, info)
                       --Register(T)-->      (Handshake back if new peer, then a
                       <--Heartbeat--         heartbeat whose echo sets the clock bound)
                       --Heartbeat(echo)-->
                                             submit(T, blocks) / layers_ready(T, ...)
                       <==WRITE blocks===    (one write per batch of ready layers)
                       <--Done(T)--          the last write's notification
    TransferEnded(ok)                        TransferEnded(ok) on its WriteDone

Handshakes are keyed by address: every transfer waiting for one address waits for one
lookup, lookups of different addresses are independent, and one result answers both
machines (`PushProtocol.handshake_done`). A receiver registers from a cached `PeerInfo`
without a lookup while the peer was heard from within `revalidate_after_s`; older ones
are looked up again first, so a peer restarted at the same address is found by the
lookup, not by a failed transfer. A transfer's deadline runs from `expect`/`submit`,
handshake included.

Compatibility, on both sides, by default: a `PeerInfo` whose compatibility fields
(`CacheGeometry.compat_fields()`: protocol version, layout, block size, dtype, mode,
regions) differ from ours in a field the `CompatibilityPolicy` does not allow fails
every transfer that waited for it with INCOMPATIBLE_PEER, the detail naming each field,
theirs and ours; the peer is never registered with or written to.

`Done` rides on the transfer's last write as its data-plane notification, which arrives
only after that write's bytes (NIXL's guarantee, and the loopback's): no round trip after
the data. It rides only when no other write of the transfer is in flight; otherwise, and
for a full prefix hit (nothing to write), it goes as a message once every write reported
`WriteDone`. A write that fails delivers no notification, so the sender sends `Failed`.

Registration may come before or after the sender's engine submits: whichever comes
second starts the writes. `Register.sender_offset = k` says the receiver's blocks stand
for the sender's blocks from `k` on (a prefix-cache hit); a full hit registers no blocks
and the sender answers `Done` at once without writing.

The fencing rules, which make "nothing is written after a failure" hold:

* The sender sends `Done`, `Failed` or `CancelAck` for a transfer only when none of its
  writes is in flight (a `Done` riding on the last write is delivered only after that
  write landed), and never writes for it afterwards (it keeps a tombstone). So a
  receiver that gets any of these may reuse its blocks at once.
* Silent is not dead. A sender that ends a transfer for any reason but a certainly gone
  peer (receiver silence, lease expiry, deadline, engine abort, cancel, runtime
  shutdown) first waits for every write in flight to report `WriteDone`/`WriteFailed`,
  however long that takes: the transfer stays ENDING and its blocks stay held (see
  `statistics()`), because a write that has not reported may still be reading them.
  Only the data plane's verdict ends a write; a runtime that closes reports its
  transfers only after its transport is closed (no write can read or land then).
* A receiver that gives up on its own (engine abort, deadline, silent sender, bad
  message) sends `Cancel` and *fences* its blocks: it keeps them until the sender's
  `CancelAck`/`Failed`/`Done`, or until the sender's lease has certainly run out
  (`fence_s = lease_s + 2 * liveness_timeout_s` after it stopped renewing it), and
  reports the transfer only then. `TransferEnded` therefore always means "the blocks
  are yours".
* A peer whose process is certainly gone (the data plane lost it, or its side channel
  now serves a new incarnation: a restart proven by a handshake, never by what a message
  claims) can write nothing more: its transfers end at once, and `DropPeer` tells the
  runtime to forget it, so the next transfer handshakes afresh.

Who sent it
-----------

A message is attributed to the agent the data plane says sent it (NIXL keys every
notification by the sending agent's name), never to what it says about itself, and an
agent is believed to be an engine (id and incarnation) only once that engine's side
channel (token-authenticated, when a token is configured) has named it:

* The receiver writes to, and hears from, only senders it looked up itself: a message
  from any other agent, a heartbeat that claims another engine or incarnation than the
  agent's side channel said, or a `Done`/`Failed`/`CancelAck` for a transfer registered
  with another sender is dropped and counted (`PushProtocol.forged_messages()`).
* The sender learns receivers from their `Register` (or `Reject`), which names the
  receiver's side channel. A first message from a new agent is kept unread (up to
  `_MAX_UNREAD`) while the sender asks that side channel who it serves; nothing is bound
  to the agent meanwhile. If the side channel names that agent, its messages are read
  in order; if it names another (an impostor, or a receiver that restarted meanwhile) or
  does not answer, they are dropped and counted. A verified agent's messages must claim
  the engine, incarnation and address its side channel gave, else they are dropped.
* A restart is proven only by the side channel that vouched for the old agent: the next
  lookup of that address names a new agent (PEER_RESTARTED). A second address claiming
  an engine that is vouched for elsewhere is believed only after the first address is
  looked up again (`Handshake(revalidate=True)`) and no longer serves its agent, and that
  lookup never ends the old agent's transfers by itself; what is certainly gone ends
  them (the data plane's verdict, or that address naming someone else), what merely went
  quiet ends them the safe way (liveness, lease, deadline).
* Only a transfer's own counterpart can end it: `Cancel`, `Reject`, `Done`, `Failed`,
  `CancelAck` and heartbeats act only on transfers bound to the agent they came from.
  A `Cancel` for an id its agent has not registered (yet) is remembered for that agent
  only (`_early_cancels`): it ends that agent's Register for the id when it comes, and
  a transfer of ours that nobody registered yet waits for its own receiver's Register
  or its deadline, since it names no receiver that could end it.

The data plane does not authenticate agent names: any process holding our NIXL metadata
can connect and send notifications under any name, a real peer's included (tried with
NIXL 1.5.1 over UCX: a second process that named its agent as a real peer's was reported
under that name). So the runtime also gives every incarnation a random 16-byte message
key, publishes it in its side-channel metadata, and has `PushProtocol(message_key=...)`
drop every message that does not begin with it ("bad_key"): with a token configured,
only a peer the side channel admitted can put a message in front of us at all, under
any name. Measured on one (shared, 2-core) host by `scripts/measure_message_key.py`:
checking the key costs about 0.4 us per message on top of a 0.7-1.3 us decode, against
about 4.5-5 us for an HMAC-SHA256 of the message on each side. The key travels in
clear, as the side channel's token does, so a MAC would add protection only against
someone who can read the network, and that someone can read the token (and so every
key) from the side channel anyway; hence the key, not a MAC. Without a token the side
channel serves the key to anyone who asks, and identity rests on the rules above,
which hold against any agent that does not borrow a real peer's name. What an agent
admitted by the side channel can still do: claim, under its own name and an engine id
its own side channel serves, a transfer id that no receiver has registered yet (the
sender's engine does not say which receiver a transfer is for).

Leases measured on the receiver's clock
---------------------------------------

The sender holds its blocks for a transfer under a lease that the receiver grants
(`Register`) and renews (`Heartbeat`s listing it) for `lease_s` *on the receiver's
clock*, from the message's `sent_at`. A message's arrival time proves nothing about its
age: it may have waited in the inbox of a sender that was stopped (SIGSTOP, a cgroup
freeze, swap, a long GIL hold). So the sender bounds the receiver's clock from below by
round trips: each sender `Heartbeat` carries our `sent_at`, the receiver echoes the
newest one it has read in its next heartbeat (and answers a sender heartbeat at once),
and a receiver heartbeat with `sent_at = r` and `echo = t0` proves that the receiver's
clock read `r` after ours read `t0`, so `skew = ours - theirs >= t0 - r`. The sender
keeps the bound from the newest heartbeat of its own that came back (`skew_lb`; an old
echo repeated after an idle spell is not newer, so it cannot loosen it) and holds that
a lease granted at the receiver's `s` runs out, in our clock, at `s + lease_s +
skew_lb`, which is no later
than the truth however long either process stalled (a stall only makes the bound
looser, i.e. the lease shorter). The lease is checked where every `WriteBlocks` is
issued (submit, layers_ready, Register, handshake done, a fresh echo), not only in
`tick`. Until a peer's first echo there is no bound: writes wait for it (one data-plane
round trip on first contact with a peer, not per transfer). A Register that is older
than its lease by that bound is refused with `Failed(PEER_TIMEOUT)`: nothing is written
for it.

The receiver's fence runs `lease_s + 2 * liveness_timeout_s` from when it gave up, and
it stopped renewing no later than that, so by the time it reuses the blocks the sender
has started no write for at least `2 * liveness_timeout_s` (6 s by default). What the
fence still assumes: a write the sender *issued* before its lease ran out lands (or
fails) within that margin. A process stopped in the middle of handing a write to the
data plane, or a data plane that copies in the stopped sender's own process (UCX over
shared memory or TCP progresses only when the sender polls), can land such a write late,
after the margin; a NIC doing RDMA does not stop with the process. For scale: one
host's data plane moved 1 GiB in 0.23 s (4.56 GB/s, `kvpush bench`, issue 13's figure),
so the default 6 s margin covers any write a running sender issues; only a stop of the
sender in the middle of one is outside it. Monotonic clocks of
two hosts may also drift apart: the bound is taken afresh from every echo (about every
`heartbeat_interval_s` while transfers flow), so drift counts only over an idle spell
before the next echo, far below the margin at common rates (100 ppm is 0.36 s an hour).
On one host both ends read the same monotonic clock: no drift at all.

One exception to "a lost peer ends its transfers": a receiver's first `Register` sent
from a cached `PeerInfo` that certainly reached no live sender (the runtime saw the data
plane lose the peer in the same pass that sent it, and nothing was heard from the peer
since) may be `withdraw`n: the transfer goes back to handshaking its address, once. No
byte of it can have been written, and nothing is reported for the withdrawn attempt.

Every transfer the engine handed in ends with exactly one `TransferEnded`, on each side,
within `transfer_deadline_s` plus the fence, except a sender whose data plane never
reports on a write (above). Tombstones make late, duplicate and reordered messages
harmless: a late `Register` gets the recorded answer again, a `Cancel` that overtakes its
`Register` is remembered for its agent, and that agent's `Register` then meets it.

Errors: engine misuse raises `LocalProtocolError` at the call; bytes that are not a
message raise `RemoteProtocolError` from `PushProtocol.receive_message` with no state
changed (the runtime then calls `peer_misbehaved`). A decodable message that makes no
sense for its transfer fails that transfer with MALFORMED_MESSAGE.
"""

from __future__ import annotations

import collections
import enum
import hmac
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar

import msgspec

from kvpush.config import STRICT_COMPATIBILITY, CompatibilityPolicy, TimingConfig
from kvpush.errors import (
    FailureReason,
    LocalProtocolError,
    RemoteProtocolError,
    TransferFailed,
)
from kvpush.geometry import PROTOCOL_VERSION, describe_compat_differences
from kvpush.protocol.messages import (
    Cancel,
    CancelAck,
    Done,
    Failed,
    Heartbeat,
    Message,
    Register,
    Reject,
    decode,
    encode,
)

Side = Literal["sender", "receiver"]

# A peer heard from this recently is still the process we handshaked with: no process
# restarts (new NIXL agent, side channel bound again) faster. Older entries are looked up
# again before a Register (~0.9 ms over the side channel on one host, measured; while the
# sender computes the prefill, in push mode).
REVALIDATE_AFTER_S = 0.1


# --------------------------------------------------------------------------- values


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """Where a peer's side channel answers, and which of its ranks we mean."""

    host: str
    port: int
    rank: int = 0

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port} rank {self.rank}"


@dataclass(frozen=True, slots=True, eq=False)
class PeerInfo:
    """What a handshake learned from a peer's side channel, as the protocol uses it.

    `compat` is the peer's `CacheGeometry.compat_fields()`; the protocol compares it with
    ours under its `CompatibilityPolicy` before anything is registered or written.
    `message_key` is the key the peer wants in front of every message we send it (see
    `PushProtocol`); empty: it wants none."""

    agent: str
    engine_id: str
    incarnation: str
    compat: Mapping[str, object]
    message_key: bytes = b""


# --------------------------------------------------------------------------- effects


@dataclass(frozen=True, slots=True)
class SendMessage:
    peer: str
    message: Message


@dataclass(frozen=True, slots=True)
class WriteBlocks:
    """Copy `our_blocks[i]` to the peer's `their_blocks[i]`, in the regions of `layers`
    (None: every region). Report the outcome with `write_done`/`write_failed`.

    `notification`, when set, is the transfer's `Done`: the data plane delivers it to the
    peer only after every byte of this write landed, and never if the write failed."""

    peer: str
    transfer_id: str
    write_id: int
    our_blocks: tuple[int, ...]
    their_blocks: tuple[int, ...]
    layers: tuple[int, ...] | None
    notification: Message | None = None


@dataclass(frozen=True, slots=True)
class Handshake:
    """Look up the side channel at `address` and answer with
    `PushProtocol.handshake_done(now, address, info)` or
    `PushProtocol.handshake_failed(now, address, reason, detail)`.

    `peer` is the agent we expect to find there: the agent whose `Register` named this
    address (the sender handshaking back), or None (the receiver, before it registers).
    Both machines may ask for the same address; one lookup answers both, and a machine
    asks again only after the answer came.

    `revalidate`: ask the side channel itself, even if what it said before is at hand;
    the sender checks this way that an engine still runs where it was vouched for before
    it believes a second address that claims the same engine (see "Who sent it")."""

    address: PeerAddress
    peer: str | None = None
    revalidate: bool = False

    @property
    def host(self) -> str:
        return self.address.host

    @property
    def port(self) -> int:
        return self.address.port

    @property
    def rank(self) -> int:
        return self.address.rank


@dataclass(frozen=True, slots=True)
class DropPeer:
    """Forget this peer (it is dead or restarted): the next contact handshakes afresh."""

    peer: str
    reason: FailureReason
    detail: str


@dataclass(frozen=True, slots=True)
class TransferEnded:
    """The transfer ended, once and for good; kvpush no longer holds `blocks`."""

    transfer_id: str
    side: Side
    reason: FailureReason | None  # None: finished
    detail: str
    blocks: tuple[int, ...]

    @property
    def ok(self) -> bool:
        return self.reason is None

    def raise_for_failure(self) -> None:
        if self.reason is not None:
            raise TransferFailed(self.transfer_id, self.reason, self.detail)


Effect = SendMessage | WriteBlocks | Handshake | DropPeer | TransferEnded


@dataclass(frozen=True, slots=True)
class LocalIdentity:
    """Who we are, as a receiver puts it into `Register` so the sender can call back."""

    engine_id: str
    incarnation: str
    host: str
    port: int
    rank: int


# --------------------------------------------------------------------------- shared


@dataclass(slots=True)
class _Peer:
    agent: str
    engine_id: str
    last_heard: float
    incarnation: str = ""
    # Sender: the side channel at `address` named this agent (until then its messages
    # wait in `inbox`, unread); `rival`: the address and agent of another peer vouched
    # for the same engine, being looked up again before this one is believed.
    verified: bool = True
    inbox: list[tuple[float, Message]] = field(default_factory=list)  # (when, message)
    rival: tuple[PeerAddress, str] | None = None
    last_heartbeat_sent: float = float("-inf")
    ready: bool = True
    outbox: list[Message] = field(default_factory=list)
    known_by_them: frozenset[str] | None = None  # receiver: ids in the sender's last heartbeat
    messages_heard: int = 0  # receiver: how many messages it sent us, ever
    address: PeerAddress | None = None  # sender: where to handshake back
    # Sender: lower bound on (our clock - theirs), from the round trip of our newest
    # heartbeat they echoed (`skew_echo`, our clock); None: none yet.
    skew_lb: float | None = None
    skew_echo: float = float("-inf")
    echo: float | None = None  # receiver: the newest sender `sent_at` we read


class _Clock:
    def __init__(self) -> None:
        self.now = float("-inf")

    def advance(self, now: float) -> float:
        # A clock that steps back is treated as standing still: timers never rewind.
        self.now = max(self.now, now)
        return self.now


class _Compatibility:
    """The one compatibility decision, shared by both machines of a rank."""

    def __init__(self, ours: Mapping[str, object], policy: CompatibilityPolicy) -> None:
        self.ours = dict(ours)
        self.policy = policy

    def problem(self, theirs: Mapping[str, object]) -> str | None:
        """None when `theirs` may be used with ours; else what differs, theirs and ours."""
        allowed = self.policy.may_differ
        ours = {k: v for k, v in self.ours.items() if k not in allowed}
        their = {k: v for k, v in theirs.items() if k not in allowed}
        differences = describe_compat_differences(their, ours)
        if not differences:
            return None
        return "the peer's KV cache is incompatible with ours: " + "; ".join(differences)

    def their_view(self, theirs: Mapping[str, object]) -> str:
        """What differs as the peer sees it (its values are "ours" there), to tell it."""
        allowed = self.policy.may_differ
        ours = {k: v for k, v in self.ours.items() if k not in allowed}
        their = {k: v for k, v in theirs.items() if k not in allowed}
        return "; ".join(describe_compat_differences(ours, their))


def _check_blocks(blocks: Sequence[int], what: str) -> tuple[int, ...]:
    out = tuple(blocks)
    for b in out:
        if not isinstance(b, int) or isinstance(b, bool) or b < 0:
            raise LocalProtocolError(f"{what}: block id {b!r} is not a non-negative integer")
    if len(set(out)) != len(out):
        raise LocalProtocolError(f"{what}: block ids repeat: {list(out)}")
    return out


class _Record(Protocol):
    @property
    def peer(self) -> str | None: ...  # None: not bound to an agent yet


_Rec = TypeVar("_Rec", bound=_Record)


class _Side(Generic[_Rec]):
    """What both sides do alike: their transfers, by id, each with one peer."""

    _clock: _Clock
    _transfers: dict[str, _Rec]
    _peers: dict[str, _Peer]
    # Messages dropped unread because of who sent them, by reason (see "Who sent it").
    forged: collections.Counter[str]

    def in_flight(self) -> bool:
        return bool(self._transfers)

    def _drop(self, reason: str, count: int = 1) -> list[Effect]:
        self.forged[reason] += count
        return []

    def peer_lost(self, now: float, peer: str, reason: FailureReason, detail: str) -> list[Effect]:
        """`peer` is certainly gone: it can write or confirm nothing more, so its
        transfers end now and it is forgotten."""
        now = self._clock.advance(now)
        if peer not in self._peers:
            return []
        out: list[Effect] = []
        for rec in list(self._transfers.values()):
            if rec.peer == peer:
                out += self._end_with_lost_peer(now, rec, reason, detail)
        del self._peers[peer]
        self._forget(peer)
        out.append(DropPeer(peer, reason, detail))
        return out

    def _restarted(self, now: float, address: PeerAddress, info: PeerInfo) -> list[Effect]:
        """The side channel at `address` serves `info.agent` now: every other agent it
        vouched for before is an earlier incarnation, certainly gone. Only the side
        channel that vouched for an agent can say so; another address that claims the
        same engine proves nothing about it (see "Who sent it")."""
        out: list[Effect] = []
        for old in list(self._peers.values()):
            if old.verified and old.address == address and old.agent != info.agent:
                detail = (
                    f"peer engine {old.engine_id} restarted: its side channel at {address} "
                    f"now serves incarnation {info.incarnation} (agent {info.agent}), not "
                    f"agent {old.agent}"
                )
                out += self.peer_lost(now, old.agent, FailureReason.PEER_RESTARTED, detail)
        return out

    def _forget(self, peer: str) -> None:
        pass

    def _end_with_lost_peer(
        self, now: float, rec: _Rec, reason: FailureReason, detail: str
    ) -> list[Effect]:
        raise NotImplementedError


# How many messages an agent may send before a side channel vouched for it (a real
# receiver sends a Register or Reject or two, and a heartbeat, in that time); the rest
# are dropped and counted. And how many early Cancels are remembered at once.
_MAX_UNREAD = 64
_MAX_EARLY_CANCELS = 65536


def _named_address(message: Message) -> PeerAddress | None:
    """The side channel a message names as its sender's (Register, and Reject from a
    peer that fills it in), to ask whether it vouches for the agent that sent it."""
    match message:
        case Register(receiver_host=host, receiver_port=port, receiver_rank=rank):
            return PeerAddress(host, port, rank)
        case Reject(receiver_host=host, receiver_port=port, receiver_rank=rank) if host:
            return PeerAddress(host, port, rank)
    return None


def _claims(p: _Peer, message: Message) -> bool:
    """Whether what `message` says about its sender is what `p`'s side channel said."""
    match message:
        case Register(receiver_engine_id=engine, receiver_incarnation=inc):
            return (engine, inc, _named_address(message)) == (
                p.engine_id,
                p.incarnation,
                p.address,
            )
        case Reject(receiver_engine_id=engine, receiver_incarnation=inc, receiver_host=host):
            if not host:
                return True
            return (engine, inc, _named_address(message)) == (
                p.engine_id,
                p.incarnation,
                p.address,
            )
        case Heartbeat(engine_id=engine, incarnation=inc):
            return (engine, inc) == (p.engine_id, p.incarnation)
    return True


# --------------------------------------------------------------------------- sender


class SenderState(enum.StrEnum):
    AWAITING_REGISTER = "awaiting_register"  # submitted, receiver not heard yet
    REGISTERED = "registered"  # receiver registered, engine has not submitted (no blocks)
    WRITING = "writing"  # both known: writes go out as layers become ready
    ENDING = "ending"  # outcome decided, waiting for in-flight writes to drain


@dataclass(slots=True)
class _Outgoing:
    transfer_id: str
    state: SenderState
    deadline: float
    blocks: tuple[int, ...] | None = None
    ready_layers: set[int] = field(default_factory=set)
    issued_layers: set[int] = field(default_factory=set)
    peer: str | None = None
    register: Register | None = None
    # The lease runs out at this time of the *receiver's* clock (see the module docstring).
    lease_until_theirs: float = float("-inf")
    inflight: set[int] = field(default_factory=set)
    reason: FailureReason | None = None
    detail: str = ""
    reply: Message | None = None
    done_write: int | None = None  # the write that carries our Done as its notification


@dataclass(slots=True)
class _Tombstone:
    peer: str | None
    reply: Message | None  # what a late Register/Cancel/heartbeat gets
    expires: float
    # Set when the engine has not submitted yet: its submit then fails at once.
    pending_failure: tuple[FailureReason, str] | None = None


class SenderProtocol(_Side["_Outgoing"]):
    """The sending side of every transfer of one rank. See the module docstring."""

    def __init__(
        self,
        identity: LocalIdentity,
        timing: TimingConfig,
        num_layers: int,
        compat: Mapping[str, object],
        *,
        compatibility: CompatibilityPolicy = STRICT_COMPATIBILITY,
    ) -> None:
        if num_layers < 1:
            raise LocalProtocolError(f"num_layers must be at least 1, got {num_layers}")
        self._me = identity
        self._timing = timing
        self._num_layers = num_layers
        self._compat = _Compatibility(compat, compatibility)
        self._clock = _Clock()
        self._transfers: dict[str, _Outgoing] = {}
        self._tombstones: dict[str, _Tombstone] = {}
        self._peers: dict[str, _Peer] = {}
        self._writes: dict[int, str] = {}
        self._next_write_id = 1
        self.ignored_messages = 0
        self.stale_registers = 0  # Registers refused because their lease had run out
        self.forged = collections.Counter()
        # (agent, transfer id) -> forget after: a Cancel from that agent for an id it had
        # not registered (yet). It ends that agent's Register for the id, nobody else's.
        self._early_cancels: dict[tuple[str, str], float] = {}
        self._tombstone_s = timing.transfer_deadline_s + timing.lease_s

    # ----- inspection (read-only; what statistics and tests read)

    def state_of(self, transfer_id: str) -> SenderState | None:
        rec = self._transfers.get(transfer_id)
        return rec.state if rec else None

    def held_blocks(self) -> dict[str, tuple[int, ...]]:
        return {t: r.blocks for t, r in self._transfers.items() if r.blocks is not None}

    def states(self) -> dict[str, SenderState]:
        return {t: r.state for t, r in self._transfers.items()}

    def writes_in_flight(self) -> int:
        """Writes issued whose outcome the data plane has not reported yet."""
        return len(self._writes)

    def lease_expires_at(self, transfer_id: str) -> float | None:
        """When, on our clock, the transfer's lease certainly runs out; None while the
        receiver's clock is not bounded yet (or the transfer is unknown or unregistered)."""
        rec = self._transfers.get(transfer_id)
        if rec is None or rec.peer is None:
            return None
        p = self._peers.get(rec.peer)
        if p is None or p.skew_lb is None:
            return None
        return rec.lease_until_theirs + p.skew_lb

    # ----- engine calls

    def submit(
        self,
        now: float,
        transfer_id: str,
        blocks: Sequence[int],
        ready_layers: Iterable[int] | None = None,
    ) -> list[Effect]:
        """Our blocks for `transfer_id`; `ready_layers=None`: all computed already."""
        now = self._clock.advance(now)
        ours = _check_blocks(blocks, f"submit({transfer_id!r})")
        layers = self._check_layers(transfer_id, ready_layers)
        rec = self._transfers.get(transfer_id)
        if rec is not None and rec.blocks is not None:
            raise LocalProtocolError(f"transfer {transfer_id!r} was already submitted")
        tomb = self._tombstones.get(transfer_id)
        if tomb is not None:
            if tomb.pending_failure is None:
                # The engine cannot know how long ended ids are remembered: an outcome.
                detail = (
                    f"transfer id {transfer_id!r} was already used by a transfer that ended "
                    f"less than {self._tombstone_s}s ago: use a new id per transfer"
                )
                return [
                    TransferEnded(transfer_id, "sender", FailureReason.LOCAL_ERROR, detail, ours)
                ]
            reason, detail = tomb.pending_failure
            tomb.pending_failure = None
            return [TransferEnded(transfer_id, "sender", reason, detail, ours)]
        if rec is None:
            rec = _Outgoing(
                transfer_id,
                SenderState.AWAITING_REGISTER,
                deadline=now + self._timing.transfer_deadline_s,
            )
            self._transfers[transfer_id] = rec
        rec.blocks = ours
        rec.ready_layers = layers
        if rec.register is None:
            return []
        rec.state = SenderState.WRITING
        return self._start(now, rec)

    def layers_ready(self, now: float, transfer_id: str, layers: Iterable[int]) -> list[Effect]:
        now = self._clock.advance(now)
        rec = self._transfers.get(transfer_id)
        new = self._check_layers(transfer_id, layers)
        if rec is None or rec.blocks is None:
            if transfer_id in self._tombstones:
                return []  # it already ended; the engine learns that from poll()
            raise LocalProtocolError(f"layers_ready: transfer {transfer_id!r} was not submitted")
        rec.ready_layers |= new
        if rec.state is SenderState.WRITING:
            return self._issue_writes(now, rec)
        return []

    def abort(
        self,
        now: float,
        transfer_id: str,
        reason: FailureReason = FailureReason.CANCELLED,
        detail: str = "aborted by the sending engine",
    ) -> list[Effect]:
        """End the transfer as failed (after its writes drained). Unknown or already-ended
        ids are ignored."""
        now = self._clock.advance(now)
        rec = self._transfers.get(transfer_id)
        if rec is None or rec.blocks is None or rec.state is SenderState.ENDING:
            return []
        return self._fail(now, rec, reason, detail, Failed(transfer_id, reason, detail))

    def abort_with_peer(
        self, now: float, transfer_id: str, peer: str, reason: FailureReason, detail: str
    ) -> list[Effect]:
        """Fail `transfer_id` if `peer` is its receiver (the safe way: drain, then tell)."""
        now = self._clock.advance(now)
        rec = self._transfers.get(transfer_id)
        if rec is None or rec.peer != peer or rec.state is SenderState.ENDING:
            return []
        if rec.blocks is None:
            del self._transfers[transfer_id]
            self._bury(now, transfer_id, peer, None, (reason, detail))
            return []
        return self._fail(now, rec, reason, detail, Failed(transfer_id, reason, detail))

    def shutdown(self, now: float, reason: FailureReason, detail: str) -> list[Effect]:
        """End every transfer at once, as `reason`, and forget every peer.

        Only for a runtime whose data plane can no longer read our memory (its transport
        is closed): a write still in flight would otherwise read blocks handed back here.
        A runtime that can still drain aborts its transfers first (`abort`)."""
        now = self._clock.advance(now)
        out: list[Effect] = []
        for rec in list(self._transfers.values()):
            if rec.blocks is not None:
                if rec.state is SenderState.ENDING and rec.reason is not None:
                    why, what = rec.reason, rec.detail
                else:
                    why, what = reason, detail
                out.append(TransferEnded(rec.transfer_id, "sender", why, what, rec.blocks))
        self._transfers.clear()
        self._writes.clear()
        self._peers.clear()
        return out

    # ----- handshakes back, peer and transport events

    def handshake_done(self, now: float, address: PeerAddress, info: PeerInfo) -> list[Effect]:
        """The side channel at `address` answered with `info`.

        An agent vouched for there before and not named now restarted (PEER_RESTARTED).
        An agent waiting there (its messages unread in its inbox) is believed if it is
        the one named, and its messages are read; any other is an impostor, and its
        messages are dropped and counted. A believed one whose engine another address
        was vouched for first waits until that address is looked up again. A believed
        one with an incompatible cache is refused (INCOMPATIBLE_PEER); else it is ready
        for writes."""
        now = self._clock.advance(now)
        out = self._restarted(now, address, info)
        problem = self._compat.problem(info.compat)
        for p in list(self._peers.values()):
            if p.rival is None or p.rival[0] != address:
                continue
            if info.agent == p.rival[1]:
                detail = (
                    f"agent {p.agent} claims engine {p.engine_id}, which its side channel "
                    f"at {address} still serves as agent {info.agent}"
                )
                out += self._refuse(now, p, "impostor", detail)
            else:  # that address now serves another agent: the one it vouched for is gone
                p.rival = None
                out += self._verified(now, p)
        for p in [p for p in self._peers.values() if p.address == address and not p.verified]:
            if p.rival is not None:
                continue
            if p.agent != info.agent:
                detail = f"the side channel at {address} serves agent {info.agent}, not {p.agent}"
                out += self._refuse(now, p, "impostor", detail)
                continue
            p.engine_id, p.incarnation = info.engine_id, info.incarnation
            rival = next(
                (
                    q
                    for q in self._peers.values()
                    if q.verified
                    and q.engine_id == info.engine_id
                    and q.address is not None
                    and q.address != address
                ),
                None,
            )
            if problem is None and rival is not None and rival.address is not None:
                # Two addresses claim one engine: the one that vouched first is asked
                # again, and believed if it still serves its agent.
                p.rival = (rival.address, rival.agent)
                out.append(Handshake(rival.address, rival.agent, revalidate=True))
                continue
            if problem is not None:
                out += self._incompatible(now, p, address, info, problem)
            else:
                out += self._verified(now, p)
        return out

    def handshake_failed(
        self, now: float, address: PeerAddress, reason: FailureReason, detail: str
    ) -> list[Effect]:
        """The lookup of `address` failed: the agents waiting for it are not believed
        (their messages are dropped and counted; nothing was bound to them). An agent
        waiting for a second look at a rival's address is believed: that address no
        longer vouches for the rival."""
        now = self._clock.advance(now)
        out: list[Effect] = []
        for p in list(self._peers.values()):
            if p.rival is not None and p.rival[0] == address:
                p.rival = None
                out += self._verified(now, p)
        for p in [p for p in self._peers.values() if p.address == address and not p.verified]:
            if p.rival is None:
                why = f"the side channel at {address} could not vouch for it: {detail}"
                out += self._refuse(now, p, "unverified", why)
        return out

    def _refuse(self, now: float, p: _Peer, reason: str, detail: str) -> list[Effect]:
        """`p` is not who its messages said: drop them unread, and forget it."""
        self._drop(reason, len(p.inbox))
        p.inbox.clear()
        return self.peer_lost(now, p.agent, FailureReason.UNKNOWN_PEER, detail)

    def _read_inbox(self, now: float, p: _Peer) -> list[Effect]:
        """Read what a peer just vouched for sent meanwhile, in order; what waited longer
        than `liveness_timeout_s` is dropped (a live receiver sends its Registers again
        every heartbeat interval until we list them, so nothing is lost, and a message
        that old may speak for a transfer its sender gave up since)."""
        p.verified = True
        out: list[Effect] = []
        inbox, p.inbox = p.inbox, []
        for at, m in inbox:
            if self._too_old_to_read(now, at):
                self.ignored_messages += 1
            else:
                out += self.handle(now, p.agent, m)
        return out

    def _too_old_to_read(self, now: float, arrived: float) -> bool:
        return now - arrived > self._timing.liveness_timeout_s

    def _verified(self, now: float, p: _Peer) -> list[Effect]:
        """The side channel vouched for `p`: read what it sent meanwhile, then write."""
        out = self._read_inbox(now, p)
        if p.agent in self._peers:
            out += self._peer_ready(now, p)
        return out

    def _incompatible(
        self, now: float, p: _Peer, address: PeerAddress, info: PeerInfo, problem: str
    ) -> list[Effect]:
        # Nothing was written (writes wait for the handshake): read what it sent (writes
        # still wait), then say why with a Failed per transfer, so the receiver gives its
        # blocks back now, not at its deadline.
        out = self._read_inbox(now, p)
        failure = FailureReason.INCOMPATIBLE_PEER
        view = f"sender refused our KV cache: {self._compat.their_view(info.compat)}"
        for rec in [r for r in self._transfers.values() if r.peer == p.agent]:
            out.append(SendMessage(p.agent, Failed(rec.transfer_id, failure, view)))
        detail = f"receiver at {address}: {problem}"
        return out + self.peer_lost(now, p.agent, failure, detail)

    def _peer_ready(self, now: float, p: _Peer) -> list[Effect]:
        p.ready = True
        p.last_heard = now
        out: list[Effect] = [SendMessage(p.agent, m) for m in p.outbox]
        p.outbox.clear()
        # At once, not at the next interval: its echo bounds the receiver's clock, and
        # no write starts before that (first contact only; the bound is kept).
        out += self._heartbeat(now, p, force=True)
        out += self._issue_for_peer(now, p.agent)
        return out

    def _issue_for_peer(self, now: float, peer: str) -> list[Effect]:
        out: list[Effect] = []
        for rec in list(self._transfers.values()):
            if rec.peer == peer and rec.state is SenderState.WRITING:
                out += self._issue_writes(now, rec)
        return out

    def _end_with_lost_peer(
        self, now: float, rec: _Outgoing, reason: FailureReason, detail: str
    ) -> list[Effect]:
        return self._abandon(now, rec, reason, detail)

    def write_done(self, now: float, write_id: int) -> list[Effect]:
        now = self._clock.advance(now)
        rec = self._pop_write(write_id)
        if rec is None:
            return []
        if rec.done_write == write_id:
            return self._done_delivered(now, rec)
        if rec.state is SenderState.ENDING:
            return self._end(now, rec) if not rec.inflight else []
        return self._maybe_done(now, rec)

    def write_failed(
        self, now: float, write_id: int, reason: FailureReason, detail: str
    ) -> list[Effect]:
        now = self._clock.advance(now)
        rec = self._pop_write(write_id)
        if rec is None:
            return []
        if rec.state is SenderState.ENDING:
            return self._end(now, rec) if not rec.inflight else []
        detail = f"write to {rec.peer} failed ({reason.value}): {detail}"
        # The data plane's word on why: a remote disconnect is the peer gone, whichever
        # call of the data plane saw it; anything else is a failed write.
        failure = (
            FailureReason.PEER_GONE
            if reason is FailureReason.PEER_GONE
            else FailureReason.WRITE_ERROR
        )
        return self._fail(now, rec, failure, detail, Failed(rec.transfer_id, failure, detail))

    # ----- messages (routed here by PushProtocol)

    def handle(self, now: float, peer: str, message: Message) -> list[Effect]:
        """A message from agent `peer`, as the data plane attributes it (see "Who sent
        it"): from an agent no side channel has vouched for yet it is kept unread until
        one does (a Register or Reject names the address to ask), from any other agent
        it is dropped and counted; one that claims an engine other than the one its
        agent was vouched for is dropped and counted too."""
        now = self._clock.advance(now)
        p = self._peers.get(peer)
        if p is None:
            address = _named_address(message)
            if address is not None:
                return self._note_peer(now, peer, address, message)
            if isinstance(message, Cancel):
                # Counted, and still remembered against that agent's own Register: a
                # receiver's Cancel may overtake (or outlive) its first Register.
                self._remember_cancel(now, peer, message.transfer_id)
            return self._drop("unknown_agent")
        if not p.verified:
            if len(p.inbox) >= _MAX_UNREAD:
                return self._drop("unread_overflow")
            p.inbox.append((now, message))
            return []
        if not _claims(p, message):
            return self._drop("wrong_engine")
        p.last_heard = now
        match message:
            case Register():
                return self._on_register(now, peer, message)
            case Cancel(transfer_id=tid, reason=reason, detail=detail):
                return self._on_cancel(now, peer, tid, reason, detail)
            case Reject(transfer_id=tid, detail=detail, reason=reason):
                return self._on_reject(now, peer, tid, detail, reason)
            case Heartbeat(role="receiver"):
                return self._on_heartbeat(now, peer, message)
            case _:
                self.ignored_messages += 1
                return []

    def _on_register(self, now: float, peer: str, msg: Register) -> list[Effect]:
        tid = msg.transfer_id
        out: list[Effect] = []
        if self._early_cancels.pop((peer, tid), None) is not None:
            return self._cancelled_before_register(now, peer, tid)
        tomb = self._tombstones.get(tid)
        if tomb is not None:
            if tomb.peer is None:  # it ended before any receiver registered: this one is it
                tomb.peer = peer
            if tomb.peer == peer:
                if tomb.reply is not None:
                    out += self._send(peer, tomb.reply)
            else:
                out += self._send(peer, self._id_taken(tid))
            return out
        if msg.protocol_version != PROTOCOL_VERSION:
            detail = (
                f"receiver speaks push protocol version {msg.protocol_version}, "
                f"we speak {PROTOCOL_VERSION}"
            )
            failure = FailureReason.INCOMPATIBLE_PEER
            return out + self._send(peer, Failed(tid, failure, detail))
        granted = self._granted(msg.sent_at)
        rec = self._transfers.get(tid)
        if rec is not None and rec.register is not None:
            if rec.peer == peer:
                rec.lease_until_theirs = max(rec.lease_until_theirs, granted)
                return out  # a duplicate
            return out + self._send(peer, self._id_taken(tid))
        stale = self._stale_register(now, peer, granted)
        if stale is not None:
            # It waited somewhere (our inbox, while we were stopped) past its lease: the
            # receiver may have given these blocks back already. Never write for it.
            self.stale_registers += 1
            failure = FailureReason.PEER_TIMEOUT
            if rec is None:
                self._bury(now, tid, peer, Failed(tid, failure, stale), (failure, stale))
                return out + self._send(peer, Failed(tid, failure, stale))
            rec.peer, rec.register = peer, msg
            return out + self._fail(now, rec, failure, stale, Failed(tid, failure, stale))
        if rec is None:
            rec = _Outgoing(
                tid, SenderState.REGISTERED, deadline=now + self._timing.transfer_deadline_s
            )
            self._transfers[tid] = rec
        rec.register = msg
        rec.peer = peer
        rec.lease_until_theirs = granted
        if rec.blocks is None:
            return out
        rec.state = SenderState.WRITING
        return out + self._start(now, rec)

    def _granted(self, sent_at: float | None) -> float:
        """Until when (receiver's clock) a message sent at `sent_at` renews a lease."""
        return float("-inf") if sent_at is None else sent_at + self._timing.lease_s

    def _stale_register(self, now: float, peer: str, granted: float) -> str | None:
        p = self._peers.get(peer)
        if p is None or p.skew_lb is None or now < granted + p.skew_lb:
            return None
        age = now - p.skew_lb - (granted - self._timing.lease_s)
        return (
            f"Register from {peer} is at least {age:.3f}s old on the receiver's clock, past "
            f"its {self._timing.lease_s}s lease: refused, nothing written"
        )

    def _note_peer(self, now: float, peer: str, address: PeerAddress, msg: Message) -> list[Effect]:
        """A first message from `peer`, naming the side channel at `address`: keep it
        unread and ask that side channel who it serves (`handshake_done`).

        What the message claims is not believed: nothing is bound to `peer` until the
        side channel names it, and a new incarnation of a known engine is recognised only
        when the side channel that vouched for the old one says so."""
        engine = msg.receiver_engine_id if isinstance(msg, Register | Reject) else ""
        self._peers[peer] = _Peer(
            peer,
            engine,
            last_heard=now,
            ready=False,
            address=address,
            verified=False,
            inbox=[(now, msg)],
        )
        return [Handshake(address, peer)]

    def _remember_cancel(self, now: float, peer: str, tid: str) -> None:
        if len(self._early_cancels) < _MAX_EARLY_CANCELS:
            self._early_cancels.pop((peer, tid), None)  # insertion order = expiry order
            self._early_cancels[(peer, tid)] = now + self._tombstone_s

    def _cancelled_before_register(self, now: float, peer: str, tid: str) -> list[Effect]:
        """`peer` cancelled `tid` before its Register for it came: the transfer ends
        CANCELLED for that receiver (nothing was written), and it gets its CancelAck."""
        why = "receiver cancelled before its Register arrived"
        reason = FailureReason.CANCELLED
        rec = self._transfers.get(tid)
        tomb = self._tombstones.get(tid)
        if rec is not None and rec.register is None and rec.blocks is not None:
            rec.peer = peer
            return self._fail(now, rec, reason, why, CancelAck(tid))
        if rec is None and tomb is None:
            self._bury(now, tid, peer, CancelAck(tid), (reason, why))
            return self._send(peer, CancelAck(tid))
        if tomb is not None and tomb.peer in (None, peer):
            tomb.peer = peer
            return self._send(peer, CancelAck(tid))
        # The id is another receiver's: this one's Register never bound anything.
        return self._send(peer, CancelAck(tid))

    def _on_cancel(
        self, now: float, peer: str, tid: str, reason: FailureReason, detail: str
    ) -> list[Effect]:
        rec = self._transfers.get(tid)
        why = f"receiver cancelled ({reason.value}): {detail}"
        if rec is not None and rec.peer == peer:
            if rec.blocks is None:  # registered, never submitted: nothing to drain
                del self._transfers[tid]
                self._bury(now, tid, peer, CancelAck(tid), (FailureReason.CANCELLED, why))
                return self._send(peer, CancelAck(tid))
            if rec.state is SenderState.ENDING:
                rec.reply = CancelAck(tid)  # the ack must wait for the drain too
                return []
            return self._fail(now, rec, FailureReason.CANCELLED, why, CancelAck(tid))
        tomb = self._tombstones.get(tid)
        if tomb is not None and tomb.peer == peer:
            return self._send(peer, CancelAck(tid))
        if rec is None or rec.register is None:
            # The Cancel overtook its Register (or the Register was lost): it ends that
            # receiver's Register for the id when it comes, nobody else's. (Its blocks
            # stay fenced on its side; ours, if submitted, wait for that Register or the
            # deadline: an unregistered transfer names no receiver that could end it.)
            self._remember_cancel(now, peer, tid)
            return self._send(peer, CancelAck(tid))
        return self._drop("not_counterpart")  # the transfer is another receiver's

    def _on_reject(
        self, now: float, peer: str, tid: str, detail: str, reason: FailureReason
    ) -> list[Effect]:
        rec = self._transfers.get(tid)
        failure: FailureReason
        if reason is FailureReason.INCOMPATIBLE_PEER:
            failure = reason
            why = f"receiver {peer} refused our KV cache: {detail}"
        else:
            failure = FailureReason.REJECTED
            why = f"receiver rejected the request: {detail}"
        if rec is None:
            if tid not in self._tombstones:
                self._bury(now, tid, peer, None, (failure, why))
            return []
        if rec.register is not None and rec.peer != peer:
            return self._drop("not_counterpart")
        if rec.state is SenderState.ENDING:
            return []
        if rec.blocks is None:
            del self._transfers[tid]
            self._bury(now, tid, peer, None, (failure, why))
            return []
        return self._fail(now, rec, failure, why, Failed(tid, failure, why))

    def _on_heartbeat(self, now: float, peer: str, hb: Heartbeat) -> list[Effect]:
        out: list[Effect] = []
        p = self._peers.get(peer)
        first_bound = False
        if (
            p is not None
            and hb.echo is not None
            and hb.sent_at is not None
            and p.skew_echo < hb.echo <= now  # newer than the one in use, and ours
        ):
            first_bound = p.skew_lb is None
            # The newest round trip, not the tightest ever (clocks of two hosts drift);
            # an old echo repeated later (after an idle spell) is no newer, so ignored.
            p.skew_echo = hb.echo
            p.skew_lb = hb.echo - hb.sent_at
        granted = self._granted(hb.sent_at)
        for tid in hb.transfer_ids:
            rec = self._transfers.get(tid)
            if rec is not None and rec.peer == peer:
                if rec.state is not SenderState.ENDING:
                    rec.lease_until_theirs = max(rec.lease_until_theirs, granted)
                continue
            tomb = self._tombstones.get(tid)
            if tomb is not None and tomb.peer == peer and tomb.reply is not None:
                out += self._send(peer, tomb.reply)  # it missed our Done/Failed: again
        if first_bound and p is not None and p.ready:
            out += self._issue_for_peer(now, peer)  # writes waited for the bound
        return out

    # ----- time

    def tick(self, now: float) -> list[Effect]:
        now = self._clock.advance(now)
        out: list[Effect] = []
        t = self._timing
        silent: dict[str, str] = {}
        for p in self._peers.values():
            if now - p.last_heard >= t.liveness_timeout_s:
                silent[p.agent] = f"receiver {p.agent} silent for {now - p.last_heard:.3f}s"
        for rec in list(self._transfers.values()):
            if rec.state is SenderState.ENDING:
                continue  # waits for its writes: only the data plane ends a write
            if rec.peer is not None and rec.peer in silent:
                # Silent is not dead: fail, but only once its writes reported.
                out += self._timeout(now, rec, FailureReason.PEER_TIMEOUT, silent[rec.peer])
            elif now >= rec.deadline:
                detail = f"not finished within {t.transfer_deadline_s}s"
                out += self._timeout(now, rec, FailureReason.DEADLINE_EXCEEDED, detail)
            elif self._lease_expired(now, rec):
                detail = f"lease of {t.lease_s}s not renewed by receiver {rec.peer}"
                out += self._timeout(now, rec, FailureReason.PEER_TIMEOUT, detail)
        # Oldest first: every tombstone lives the same time and `now` never goes back,
        # so insertion order is expiry order (`_bury` re-inserts). Scanning them all
        # each tick cost O(transfers of the last minute) and, at thousands of transfers
        # a second, most of the runtime thread's time.
        tombs = self._tombstones
        while tombs:
            oldest = next(iter(tombs))
            if now < tombs[oldest].expires:
                break
            del tombs[oldest]
        early = self._early_cancels
        while early:
            key = next(iter(early))
            if now < early[key]:
                break
            del early[key]
        for p in self._peers.values():
            out += self._heartbeat(now, p)
        return out

    def _lease_expired(self, now: float, rec: _Outgoing) -> bool:
        """True once the lease has certainly run out on the receiver's clock."""
        if rec.peer is None or rec.register is None:
            return False
        p = self._peers.get(rec.peer)
        if p is None or p.skew_lb is None:
            return False  # no bound yet: nothing is written either (`_issue_writes`)
        return now >= rec.lease_until_theirs + p.skew_lb

    def next_deadline(self) -> float | None:
        """When `tick` next has something to do; None while nothing is in flight."""
        times: list[float] = []
        live: set[str] = set()
        for rec in self._transfers.values():
            if rec.state is SenderState.ENDING:
                continue
            times.append(rec.deadline)
            if rec.peer is not None:
                live.add(rec.peer)
                p = self._peers.get(rec.peer)
                if p is not None and p.skew_lb is not None and rec.register is not None:
                    times.append(rec.lease_until_theirs + p.skew_lb)
        for agent in live:
            p = self._peers.get(agent)
            if p is not None:
                times.append(p.last_heard + self._timing.liveness_timeout_s)
                if p.ready:
                    times.append(p.last_heartbeat_sent + self._timing.heartbeat_interval_s)
        if self._tombstones and not times:
            times.append(next(iter(self._tombstones.values())).expires)
        return min(times) if times else None

    def _timeout(
        self, now: float, rec: _Outgoing, reason: FailureReason, detail: str
    ) -> list[Effect]:
        if rec.blocks is None:  # a registration the engine never submitted (yet)
            del self._transfers[rec.transfer_id]
            failed = Failed(rec.transfer_id, reason, detail)
            self._bury(now, rec.transfer_id, rec.peer, failed, (reason, detail))
            return self._send(rec.peer, failed) if rec.peer else []
        return self._fail(now, rec, reason, detail, Failed(rec.transfer_id, reason, detail))

    def _heartbeat(self, now: float, p: _Peer, *, force: bool = False) -> list[Effect]:
        if not p.ready:
            return []
        due = now >= p.last_heartbeat_sent + self._timing.heartbeat_interval_s
        if not (force or due):
            return []
        ids = tuple(t for t, r in self._transfers.items() if r.peer == p.agent)
        if not ids and not force:
            return []
        p.last_heartbeat_sent = now
        hb = Heartbeat("sender", self._me.engine_id, self._me.incarnation, ids, sent_at=now)
        return [SendMessage(p.agent, hb)]

    # ----- transitions

    def _start(self, now: float, rec: _Outgoing) -> list[Effect]:
        """Both sides known: check the mapping, then write (or finish on a full hit)."""
        assert rec.blocks is not None and rec.register is not None and rec.peer is not None
        reg = rec.register
        if reg.sender_offset + len(reg.block_ids) != len(rec.blocks):
            detail = (
                f"receiver registered {len(reg.block_ids)} blocks at offset "
                f"{reg.sender_offset}, but the sender has {len(rec.blocks)} blocks: expected "
                f"offset + registered blocks = {len(rec.blocks)}"
            )
            failure = FailureReason.BLOCK_MISMATCH
            return self._fail(now, rec, failure, detail, Failed(rec.transfer_id, failure, detail))
        return self._issue_writes(now, rec)

    def _issue_writes(self, now: float, rec: _Outgoing) -> list[Effect]:
        """Write the layers that became ready, if the receiver certainly still expects
        them: its handshake is done, its clock is bounded and the lease holds."""
        assert rec.blocks is not None and rec.register is not None and rec.peer is not None
        p = self._peers.get(rec.peer)
        if p is None or not p.ready:
            return []  # its handshake is not done: `_peer_ready` issues these
        if not rec.register.block_ids:
            return self._maybe_done(now, rec)  # a full prefix hit: nothing to write
        new = rec.ready_layers - rec.issued_layers
        if not new:
            return []
        if p.skew_lb is None:
            return []  # the first echo is on its way; it issues these (`_on_heartbeat`)
        if now >= rec.lease_until_theirs + p.skew_lb:
            detail = (
                f"lease of {self._timing.lease_s}s from receiver {rec.peer} ran out (on its "
                "clock) before the write could start"
            )
            return self._timeout(now, rec, FailureReason.PEER_TIMEOUT, detail)
        all_now = not rec.issued_layers and len(new) == self._num_layers
        rec.issued_layers |= new
        wid = self._next_write_id
        self._next_write_id += 1
        self._writes[wid] = rec.transfer_id
        # The last write carries Done, which the data plane delivers after its bytes: no
        # round trip after the data. Only when no other write of the transfer is in
        # flight, though (Done promises that nothing more will land): else Done goes
        # alone once the last WriteDone is in (`_maybe_done`).
        done: Done | None = None
        if not rec.inflight and len(rec.issued_layers) == self._num_layers:
            done = Done(rec.transfer_id, len(rec.register.block_ids))
            rec.done_write = wid
        rec.inflight.add(wid)
        off = rec.register.sender_offset
        return [
            WriteBlocks(
                rec.peer,
                rec.transfer_id,
                wid,
                rec.blocks[off:],
                rec.register.block_ids,
                None if all_now else tuple(sorted(new)),
                done,
            )
        ]

    def _maybe_done(self, now: float, rec: _Outgoing) -> list[Effect]:
        assert rec.register is not None and rec.peer is not None and rec.blocks is not None
        written_all = len(rec.issued_layers) == self._num_layers or not rec.register.block_ids
        if rec.inflight or not written_all:
            return []
        done = Done(rec.transfer_id, len(rec.register.block_ids))
        del self._transfers[rec.transfer_id]
        self._bury(now, rec.transfer_id, rec.peer, done)
        return [
            *self._send(rec.peer, done),
            TransferEnded(rec.transfer_id, "sender", None, "", rec.blocks),
        ]

    def _done_delivered(self, now: float, rec: _Outgoing) -> list[Effect]:
        """The write carrying our Done landed, so the receiver has its Done: the transfer
        finished, even if it was ending (an engine abort or a timeout that came too late
        to stop the write). Only a receiver that cancelled meanwhile ends it as failed:
        it is fencing and reports its own reason, so we report that one too."""
        assert rec.register is not None and rec.peer is not None and rec.blocks is not None
        done = Done(rec.transfer_id, len(rec.register.block_ids))
        if rec.state is SenderState.ENDING and isinstance(rec.reply, CancelAck):
            return self._end(now, rec)
        del self._transfers[rec.transfer_id]
        self._bury(now, rec.transfer_id, rec.peer, done)
        return [TransferEnded(rec.transfer_id, "sender", None, "", rec.blocks)]

    def _fail(
        self, now: float, rec: _Outgoing, reason: FailureReason, detail: str, reply: Message
    ) -> list[Effect]:
        """End as failed once no write is in flight; `reply` tells the receiver.

        No time bound on the drain: a write that has not reported may still read our
        blocks, so they stay held until the data plane says (`write_done`/`write_failed`,
        or `peer_lost`)."""
        rec.state = SenderState.ENDING
        rec.reason, rec.detail, rec.reply = reason, detail, reply
        if rec.inflight:
            return []
        return self._end(now, rec)

    def _end(self, now: float, rec: _Outgoing) -> list[Effect]:
        assert rec.reason is not None and rec.blocks is not None and not rec.inflight
        del self._transfers[rec.transfer_id]
        self._bury(now, rec.transfer_id, rec.peer, rec.reply)
        out: list[Effect] = []
        if rec.peer is not None and rec.reply is not None:
            out += self._send(rec.peer, rec.reply)
        out.append(TransferEnded(rec.transfer_id, "sender", rec.reason, rec.detail, rec.blocks))
        return out

    def _abandon(
        self, now: float, rec: _Outgoing, reason: FailureReason, detail: str
    ) -> list[Effect]:
        """The peer is certainly gone: end at once, tell nobody; its write events are
        ignored (a write to a process that is gone lands nowhere)."""
        del self._transfers[rec.transfer_id]
        for wid in rec.inflight:
            self._writes.pop(wid, None)
        if rec.blocks is None:
            self._bury(now, rec.transfer_id, rec.peer, None, (reason, detail))
            return []
        self._bury(now, rec.transfer_id, rec.peer, None)
        if rec.state is SenderState.ENDING and rec.reason is not None:
            reason, detail = rec.reason, rec.detail
        return [TransferEnded(rec.transfer_id, "sender", reason, detail, rec.blocks)]

    # ----- helpers

    def _check_layers(self, tid: str, layers: Iterable[int] | None) -> set[int]:
        if layers is None:
            return set(range(self._num_layers))
        out = set(layers)
        bad = [x for x in out if not isinstance(x, int) or not 0 <= x < self._num_layers]
        if bad:
            raise LocalProtocolError(
                f"transfer {tid!r}: layers {sorted(map(str, bad))} out of range: "
                f"expected 0..{self._num_layers - 1}"
            )
        return out

    def _pop_write(self, write_id: int) -> _Outgoing | None:
        tid = self._writes.pop(write_id, None)
        rec = self._transfers.get(tid) if tid is not None else None
        if rec is not None:
            rec.inflight.discard(write_id)
        return rec

    def _send(self, peer: str, message: Message) -> list[Effect]:
        p = self._peers.get(peer)
        if p is None:
            return []
        if not p.ready:
            p.outbox.append(message)
            return []
        return [SendMessage(peer, message)]

    def _bury(
        self,
        now: float,
        tid: str,
        peer: str | None,
        reply: Message | None,
        pending_failure: tuple[FailureReason, str] | None = None,
    ) -> None:
        keep = self._tombstone_s
        self._tombstones.pop(tid, None)  # keep insertion order = expiry order
        self._tombstones[tid] = _Tombstone(peer, reply, now + keep, pending_failure)

    @staticmethod
    def _id_taken(tid: str) -> Failed:
        detail = f"transfer id {tid!r} is already in use by another receiver"
        return Failed(tid, FailureReason.MALFORMED_MESSAGE, detail)


# --------------------------------------------------------------------------- receiver


class ReceiverState(enum.StrEnum):
    HANDSHAKING = "handshaking"  # waiting for the sender's side channel; nothing registered
    WAITING = "waiting"  # registered; blocks may be written any time
    FENCING = "fencing"  # given up; blocks kept until the sender confirms or its lease ran out


@dataclass(slots=True)
class _Incoming:
    transfer_id: str
    address: PeerAddress
    blocks: tuple[int, ...]
    sender_offset: int
    deadline: float
    first_attempt: bool = True
    state: ReceiverState = ReceiverState.HANDSHAKING
    peer: str | None = None  # the sender's agent, once handshaken
    register: Register | None = None
    register_sent_at: float = float("-inf")
    heard_before: int = 0  # the peer's `messages_heard` when the Register went out
    from_cache: bool = False  # registered from a cached PeerInfo, without a fresh lookup
    reason: FailureReason | None = None
    detail: str = ""
    fence_until: float = float("inf")
    cancel_sent_at: float = float("-inf")


@dataclass(slots=True)
class _Known:
    info: PeerInfo
    handshaken_at: float


@dataclass(slots=True)
class _Lookup:
    """One address being looked up: who waits for it."""

    transfers: list[str] = field(default_factory=list)
    rejects: list[tuple[str, str]] = field(default_factory=list)  # (transfer id, detail)


class ReceiverProtocol(_Side["_Incoming"]):
    """The receiving side of every transfer of one rank. See the module docstring."""

    def __init__(
        self,
        identity: LocalIdentity,
        timing: TimingConfig,
        compat: Mapping[str, object],
        *,
        compatibility: CompatibilityPolicy = STRICT_COMPATIBILITY,
        revalidate_after_s: float = REVALIDATE_AFTER_S,
    ) -> None:
        if revalidate_after_s < 0:
            raise LocalProtocolError(f"revalidate_after_s must be >= 0, got {revalidate_after_s}")
        self._me = identity
        self._timing = timing
        self._compat = _Compatibility(compat, compatibility)
        self._revalidate_after_s = revalidate_after_s
        self._clock = _Clock()
        self._transfers: dict[str, _Incoming] = {}
        self._ended: dict[str, float] = {}  # transfer id -> forget after
        self._peers: dict[str, _Peer] = {}
        self._known: dict[PeerAddress, _Known] = {}
        self._lookups: dict[PeerAddress, _Lookup] = {}
        self._heard_at: dict[str, float] = {}  # agent -> when it last sent us anything
        self.ignored_messages = 0
        self.forged = collections.Counter()

    @property
    def fence_s(self) -> float:
        """How long blocks stay fenced when the sender never confirms."""
        return self._timing.lease_s + 2 * self._timing.liveness_timeout_s

    def state_of(self, transfer_id: str) -> ReceiverState | None:
        rec = self._transfers.get(transfer_id)
        return rec.state if rec else None

    def held_blocks(self) -> dict[str, tuple[int, ...]]:
        return {t: r.blocks for t, r in self._transfers.items()}

    def states(self) -> dict[str, ReceiverState]:
        return {t: r.state for t, r in self._transfers.items()}

    def known_peers(self) -> int:
        """Side-channel addresses with a usable (compatible) handshake result cached."""
        return len(self._known)

    def lookups_in_flight(self) -> int:
        return len(self._lookups)

    # ----- engine calls

    def expect(
        self,
        now: float,
        transfer_id: str,
        sender: PeerAddress,
        blocks: Sequence[int],
        *,
        sender_offset: int = 0,
    ) -> list[Effect]:
        """Expect `transfer_id` from the sender whose side channel is `sender` into our
        `blocks`; `blocks[i]` receives the sender's block `sender_offset + i`.

        Registers at once from a cached handshake of `sender` (heard from within
        `revalidate_after_s`), else asks for a `Handshake` of `sender` first (one per
        address, however many transfers wait for it). The deadline runs from here."""
        now = self._clock.advance(now)
        ours = _check_blocks(blocks, f"expect({transfer_id!r})")
        if not isinstance(transfer_id, str) or not transfer_id:
            raise LocalProtocolError("transfer id must be a non-empty string")
        if isinstance(sender_offset, bool) or not isinstance(sender_offset, int):
            raise LocalProtocolError(f"sender_offset must be an int, got {sender_offset!r}")
        if sender_offset < 0:
            raise LocalProtocolError(f"sender_offset must be >= 0, got {sender_offset}")
        if transfer_id in self._transfers:
            raise LocalProtocolError(f"transfer id {transfer_id!r} is in flight already")
        if transfer_id in self._ended:
            # The engine cannot know how long ended ids are remembered: an outcome.
            detail = (
                f"transfer id {transfer_id!r} was already used by a transfer that ended less "
                f"than {self._timing.transfer_deadline_s + self.fence_s}s ago: use a new id "
                "per transfer"
            )
            return [TransferEnded(transfer_id, "receiver", FailureReason.LOCAL_ERROR, detail, ours)]
        rec = _Incoming(
            transfer_id,
            sender,
            ours,
            sender_offset,
            deadline=now + self._timing.transfer_deadline_s,
        )
        self._transfers[transfer_id] = rec
        known = self._known.get(sender)
        if known is not None and self._fresh(now, known):
            rec.from_cache = True
            return self._register(now, rec, known.info)
        return self._await_lookup(sender, transfer_id)

    def reject(
        self, now: float, transfer_id: str, sender: PeerAddress, detail: str
    ) -> list[Effect]:
        """Refuse a request before allocating: the sender frees its blocks at once.

        Reported here too, at once: a `TransferEnded` on the receiver side with reason
        REJECTED, our `detail` and no blocks (nothing was allocated), so the engine has
        a record of every id it refused; unless the id is in flight here, whose own
        result is its record (the Reject still goes). The id stays free for a later
        `expect`: a refused request may come again. The Reject goes once `sender` is
        known (a lookup of it goes first if it is not)."""
        self._clock.advance(now)
        why = f"rejected by this engine: {detail}" if detail else "rejected by this engine"
        ended: list[Effect] = []
        if transfer_id not in self._transfers:
            ended.append(TransferEnded(transfer_id, "receiver", FailureReason.REJECTED, why, ()))
        known = self._known.get(sender)
        if known is not None:
            return [SendMessage(known.info.agent, self._reject(transfer_id, detail)), *ended]
        lookup = self._lookups.get(sender)
        out: list[Effect] = []
        if lookup is None:
            lookup = self._lookups[sender] = _Lookup()
            out.append(Handshake(sender))
        lookup.rejects.append((transfer_id, detail))
        return out + ended

    def _reject(
        self, transfer_id: str, detail: str, reason: FailureReason = FailureReason.REJECTED
    ) -> Reject:
        """Our Reject, naming us as a Register does, so that a sender that has not heard
        from us yet can ask our side channel who we are before it believes it."""
        me = self._me
        return Reject(
            transfer_id, detail, reason, me.engine_id, me.incarnation, me.host, me.port, me.rank
        )

    def abort(
        self,
        now: float,
        transfer_id: str,
        reason: FailureReason = FailureReason.CANCELLED,
        detail: str = "aborted by the receiving engine",
    ) -> list[Effect]:
        now = self._clock.advance(now)
        rec = self._transfers.get(transfer_id)
        if rec is None or rec.state is ReceiverState.FENCING:
            return []
        if rec.state is ReceiverState.HANDSHAKING:
            # Nothing registered, nothing can be written: ours again at once. The sender
            # hears a Reject once the lookup is done, so it frees its blocks too.
            why = f"{detail} before the handshake with {rec.address} finished"
            return self._end_handshaking(now, rec, reason, why)
        return self._fence(now, rec, reason, detail)

    def _end_handshaking(
        self, now: float, rec: _Incoming, reason: FailureReason, detail: str
    ) -> list[Effect]:
        lookup = self._lookups.get(rec.address)
        if lookup is not None:
            lookup.transfers.remove(rec.transfer_id)
            lookup.rejects.append((rec.transfer_id, detail))
        return self._end(now, rec, reason, detail)

    def abort_with_peer(
        self, now: float, transfer_id: str, peer: str, reason: FailureReason, detail: str
    ) -> list[Effect]:
        rec = self._transfers.get(transfer_id)
        if rec is None or rec.peer != peer:
            return []
        return self.abort(now, transfer_id, reason, detail)

    def withdraw(self, now: float, transfer_id: str, peer: str) -> list[Effect] | None:
        """Take back a first Register, sent from a cached handshake, that certainly
        reached no live sender, and look its address up again (once).

        The caller knows the Register's own send failed: the data plane lost `peer` in
        the same pass that sent it (a sender restarted at the same address faster than
        `revalidate_after_s`). Withdrawn only if nothing at all was heard from the peer
        since the Register went out and the transfer is still waiting: then no byte of
        it can have been written. Returns None, changing nothing, otherwise (the caller
        then ends it as usual, `peer_lost`); else the effects of looking it up again.
        Nothing is reported for the withdrawn attempt."""
        now = self._clock.advance(now)
        rec = self._transfers.get(transfer_id)
        if (
            rec is None
            or rec.peer != peer
            or not rec.first_attempt
            or not rec.from_cache
            or rec.state is not ReceiverState.WAITING
        ):
            return None
        p = self._peers.get(peer)
        if p is None or p.messages_heard != rec.heard_before:
            return None
        rec.first_attempt = False
        rec.state = ReceiverState.HANDSHAKING
        rec.peer = rec.register = None
        rec.from_cache = False
        self._forget(peer)  # that cached handshake is what was stale
        return self._await_lookup(rec.address, transfer_id)

    def shutdown(self, now: float, reason: FailureReason, detail: str) -> list[Effect]:
        """End every transfer at once, as `reason`. Only for a runtime whose data plane
        can no longer write into our memory (its transport is closed)."""
        now = self._clock.advance(now)
        out: list[Effect] = []
        for rec in list(self._transfers.values()):
            if rec.state is ReceiverState.FENCING and rec.reason is not None:
                out += self._end(now, rec, rec.reason, rec.detail)
            else:
                out += self._end(now, rec, reason, detail)
        self._lookups.clear()
        self._peers.clear()
        self._known.clear()
        return out

    # ----- handshakes

    def handshake_done(self, now: float, address: PeerAddress, info: PeerInfo) -> list[Effect]:
        """The side channel at `address` answered with `info`: the transfers waiting for it
        register (if its cache is compatible with ours) or fail (INCOMPATIBLE_PEER, the
        detail naming each field that differs). A new incarnation of an engine we know
        ends what was in flight with the old one (PEER_RESTARTED)."""
        now = self._clock.advance(now)
        lookup = self._lookups.pop(address, None) or _Lookup()
        if info.engine_id == self._me.engine_id and info.incarnation == self._me.incarnation:
            return self._lookup_failed(
                now, address, lookup, FailureReason.LOCAL_ERROR, "that address is our own"
            )
        problem = self._compat.problem(info.compat)
        if problem is not None:
            self._known.pop(address, None)
            # Tell the sender, so that it frees its blocks now, not at its deadline:
            # nothing was registered, so a Reject is the whole truth.
            view = self._compat.their_view(info.compat)
            waiting = [
                tid
                for tid in lookup.transfers
                if (rec := self._transfers.get(tid)) is not None
                and rec.state is ReceiverState.HANDSHAKING
            ]
            out = self._lookup_failed(
                now, address, lookup, FailureReason.INCOMPATIBLE_PEER, problem
            )
            for tid in [*waiting, *(t for t, _ in lookup.rejects)]:
                reject = self._reject(tid, view, FailureReason.INCOMPATIBLE_PEER)
                out.append(SendMessage(info.agent, reject))
            return out
        out = self._restarted(now, address, info)
        self._known[address] = _Known(info, now)
        for tid, detail in lookup.rejects:
            out.append(SendMessage(info.agent, self._reject(tid, detail)))
        for tid in lookup.transfers:
            rec = self._transfers.get(tid)
            if rec is not None and rec.state is ReceiverState.HANDSHAKING:
                out += self._register(now, rec, info)
        return out

    def handshake_failed(
        self, now: float, address: PeerAddress, reason: FailureReason, detail: str
    ) -> list[Effect]:
        """The lookup of `address` failed: the transfers waiting for it fail with `reason`
        (nothing was registered, so nothing can be written)."""
        now = self._clock.advance(now)
        lookup = self._lookups.pop(address, None)
        if lookup is None:
            return []
        self._known.pop(address, None)
        return self._lookup_failed(now, address, lookup, reason, detail)

    def _lookup_failed(
        self,
        now: float,
        address: PeerAddress,
        lookup: _Lookup,
        reason: FailureReason,
        detail: str,
    ) -> list[Effect]:
        out: list[Effect] = []
        why = f"handshake with {address} failed: {detail}"
        for tid in lookup.transfers:
            rec = self._transfers.get(tid)
            if rec is not None and rec.state is ReceiverState.HANDSHAKING:
                out += self._end(now, rec, reason, why)
        return out  # rejects: nobody to tell; the sender's own deadline frees it

    def _await_lookup(self, address: PeerAddress, transfer_id: str) -> list[Effect]:
        lookup = self._lookups.get(address)
        if lookup is not None:
            lookup.transfers.append(transfer_id)
            return []
        self._lookups[address] = _Lookup([transfer_id])
        return [Handshake(address)]

    def _fresh(self, now: float, known: _Known) -> bool:
        """Still the process we handshaked with: heard from (or looked up) lately. Older
        ones may have restarted at that address; they are looked up again."""
        heard = self._heard_at.get(known.info.agent, known.handshaken_at)
        return now - max(heard, known.handshaken_at) <= self._revalidate_after_s

    def _forget(self, peer: str) -> None:
        self._heard_at.pop(peer, None)
        for address in [a for a, k in self._known.items() if k.info.agent == peer]:
            del self._known[address]

    def _register(self, now: float, rec: _Incoming, info: PeerInfo) -> list[Effect]:
        peer = info.agent
        p = self._peers.get(peer)
        if p is None:
            p = self._peers[peer] = _Peer(
                peer,
                info.engine_id,
                last_heard=now,
                incarnation=info.incarnation,
                address=rec.address,
            )
        elif not any(r.peer == peer for r in self._transfers.values()):
            p.last_heard = now  # idle until now: its silence so far says nothing
        me = self._me
        rec.register = Register(
            rec.transfer_id,
            me.engine_id,
            me.incarnation,
            me.host,
            me.port,
            me.rank,
            rec.blocks,
            rec.sender_offset,
            sent_at=now,
        )
        rec.peer = peer
        rec.state = ReceiverState.WAITING
        rec.register_sent_at = now
        rec.heard_before = p.messages_heard
        return [SendMessage(peer, rec.register)]

    # ----- events

    def _end_with_lost_peer(
        self, now: float, rec: _Incoming, reason: FailureReason, detail: str
    ) -> list[Effect]:
        return self._end(now, rec, reason, detail)

    def handle(self, now: float, peer: str, message: Message) -> list[Effect]:
        """A message from agent `peer`, as the data plane attributes it. Our senders are
        agents we looked up ourselves (`handshake_done`): a message from any other agent,
        one that claims another engine than its agent's side channel said, or one about
        a transfer of another sender is dropped and counted, never acted on."""
        now = self._clock.advance(now)
        p = self._peers.get(peer)
        if p is None:
            return self._drop("unknown_agent")
        if isinstance(message, Heartbeat) and (message.engine_id, message.incarnation) != (
            p.engine_id,
            p.incarnation,
        ):
            return self._drop("wrong_engine")
        p.last_heard = now
        self.heard_from(peer, now)
        match message:
            case Heartbeat(role="sender", transfer_ids=ids, sent_at=sent_at):
                p.known_by_them = frozenset(ids)
                if sent_at is not None and (p.echo is None or sent_at > p.echo):
                    p.echo = sent_at
                # Answer at once: the echo is what lets the sender write (first contact)
                # and keeps its bound on our clock tight.
                return self._resend_registers(now, peer) + self._heartbeat(now, p)
            case Done(transfer_id=tid) | Failed(transfer_id=tid) | CancelAck(transfer_id=tid):
                rec = self._transfers.get(tid)
                if rec is None:
                    self.ignored_messages += 1  # late (a resend for what already ended)
                    return []
                if rec.peer != peer:
                    return self._drop("not_counterpart")
                return self._on_sender_final(now, rec, message)
            case _:
                self.ignored_messages += 1
                return []

    def heard_from(self, peer: str, now: float | None = None) -> None:
        """`peer` sent us something (for either machine, decodable or not): it was alive
        after our Registers to it went out, so none of them can be withdrawn, and its
        cached handshake is still good."""
        p = self._peers.get(peer)
        if p is None:
            return  # not one of our senders: it proves nothing about them
        p.messages_heard += 1
        if now is not None:
            self._heard_at[peer] = now

    def _on_sender_final(self, now: float, rec: _Incoming, message: Message) -> list[Effect]:
        # Each of these promises that no write for the transfer is or will be in flight.
        if rec.state is ReceiverState.FENCING:
            assert rec.reason is not None
            return self._end(now, rec, rec.reason, rec.detail)
        match message:
            case Done(num_blocks=n) if n == len(rec.blocks):
                return self._end(now, rec, None, "")
            case Done(num_blocks=n):
                detail = f"sender wrote {n} blocks, we registered {len(rec.blocks)}"
                return self._end(now, rec, FailureReason.BLOCK_MISMATCH, detail)
            case Failed(reason=reason, detail=detail):
                return self._end(now, rec, reason, f"sender failed: {detail}")
            case _:
                detail = "sender acknowledged a cancel we never sent"
                return self._end(now, rec, FailureReason.MALFORMED_MESSAGE, detail)

    def tick(self, now: float) -> list[Effect]:
        now = self._clock.advance(now)
        t = self._timing
        out: list[Effect] = []
        for p in list(self._peers.values()):
            live = [r for r in self._transfers.values() if r.peer == p.agent]
            if live and now - p.last_heard >= t.liveness_timeout_s:
                detail = f"sender {p.agent} silent for {now - p.last_heard:.3f}s"
                for rec in live:
                    if rec.state is ReceiverState.WAITING:
                        out += self._fence(now, rec, FailureReason.PEER_TIMEOUT, detail)
                # Silent is not dead: it stays loaded (our Cancels keep going to it, and a
                # send the data plane cannot deliver proves it gone), but its cached
                # handshake is not trusted for a new transfer.
                self._forget(p.agent)
        for rec in list(self._transfers.values()):
            if rec.state is not ReceiverState.FENCING and now >= rec.deadline:
                detail = f"not finished within {t.transfer_deadline_s}s"
                if rec.state is ReceiverState.HANDSHAKING:
                    detail += f" (the handshake with {rec.address} did not finish)"
                    out += self._end_handshaking(now, rec, FailureReason.DEADLINE_EXCEEDED, detail)
                else:
                    out += self._fence(now, rec, FailureReason.DEADLINE_EXCEEDED, detail)
            elif rec.state is ReceiverState.FENCING:
                assert rec.reason is not None
                if now >= rec.fence_until:
                    out += self._end(now, rec, rec.reason, rec.detail)
                elif (
                    rec.peer in self._peers
                    and now >= rec.cancel_sent_at + t.heartbeat_interval_s
                    and rec.peer is not None
                ):
                    rec.cancel_sent_at = now
                    out += self._cancel(now, rec)
        ended = self._ended  # oldest first, as the sender's tombstones
        while ended:
            oldest = next(iter(ended))
            if now < ended[oldest]:
                break
            del ended[oldest]
        for p in self._peers.values():
            out += self._resend_registers(now, p.agent)
            if now >= p.last_heartbeat_sent + t.heartbeat_interval_s:
                out += self._heartbeat(now, p, only_if_live=True)
        return out

    def _heartbeat(self, now: float, p: _Peer, *, only_if_live: bool = False) -> list[Effect]:
        live = [r for r in self._transfers.values() if r.peer == p.agent]
        if only_if_live and not live:
            return []
        p.last_heartbeat_sent = now
        ids = tuple(r.transfer_id for r in live if r.state is ReceiverState.WAITING)
        hb = Heartbeat(
            "receiver", self._me.engine_id, self._me.incarnation, ids, sent_at=now, echo=p.echo
        )
        return [SendMessage(p.agent, hb)]

    def next_deadline(self) -> float | None:
        t = self._timing
        times: list[float] = []
        for rec in self._transfers.values():
            if rec.state is ReceiverState.HANDSHAKING:
                times.append(rec.deadline)
            elif rec.state is ReceiverState.WAITING:
                times += [rec.deadline, rec.register_sent_at + t.heartbeat_interval_s]
            else:
                times += [rec.fence_until, rec.cancel_sent_at + t.heartbeat_interval_s]
        for p in self._peers.values():
            if any(r.peer == p.agent for r in self._transfers.values()):
                times.append(p.last_heard + t.liveness_timeout_s)
                times.append(p.last_heartbeat_sent + t.heartbeat_interval_s)
        if self._ended and not times:
            times.append(next(iter(self._ended.values())))
        return min(times) if times else None

    # ----- transitions

    def _resend_registers(self, now: float, peer: str) -> list[Effect]:
        """Registrations the sender does not list (lost, or not there yet) go again,
        stamped with the time they go: a resend renews the lease it asks for.

        Never past the transfer's deadline (a receiver that was stopped reads its inbox
        before it ticks): the sender forgets an id it gave up `deadline + lease` after,
        so a Register sent later could reach a sender to which the id is new, and which
        writes, while its earlier `Failed` for that id ends the transfer here."""
        p = self._peers.get(peer)
        if p is None:
            return []
        known = p.known_by_them or frozenset()
        out: list[Effect] = []
        for rec in self._transfers.values():
            if (
                rec.peer == peer
                and rec.register is not None
                and rec.state is ReceiverState.WAITING
                and rec.transfer_id not in known
                and now >= rec.register_sent_at + self._timing.heartbeat_interval_s
                and now < rec.deadline
            ):
                rec.register_sent_at = now
                rec.register = msgspec.structs.replace(rec.register, sent_at=now)
                out.append(SendMessage(peer, rec.register))
        return out

    def _fence(
        self, now: float, rec: _Incoming, reason: FailureReason, detail: str
    ) -> list[Effect]:
        # We renewed its lease last at or before `now`, so the sender starts no write
        # after `now + lease_s` on our clock: after the fence only writes it had already
        # issued could land, and the margin is for them.
        rec.state = ReceiverState.FENCING
        rec.reason, rec.detail = reason, detail
        rec.fence_until = now + self.fence_s
        rec.cancel_sent_at = now
        return self._cancel(now, rec)

    def _cancel(self, now: float, rec: _Incoming) -> list[Effect]:
        """Our Cancel for a fenced transfer; and, while the sender has not shown that it
        has our Register, that Register again after it, unchanged (the lease it asks for
        is not renewed): a sender takes a Cancel only for a transfer that the same agent
        registered, so one whose Register was lost must get it to hear the Cancel (it
        then ends the transfer without writing)."""
        p = self._peers.get(rec.peer) if rec.peer is not None else None
        if p is None or rec.reason is None:
            return []
        out: list[Effect] = [SendMessage(p.agent, Cancel(rec.transfer_id, rec.reason, rec.detail))]
        unconfirmed = p.known_by_them is None or rec.transfer_id not in p.known_by_them
        if rec.register is not None and unconfirmed and now < rec.deadline:
            out.append(SendMessage(p.agent, rec.register))
        return out

    def _end(
        self, now: float, rec: _Incoming, reason: FailureReason | None, detail: str
    ) -> list[Effect]:
        del self._transfers[rec.transfer_id]
        self._ended.pop(rec.transfer_id, None)  # keep insertion order = expiry order
        self._ended[rec.transfer_id] = now + self._timing.transfer_deadline_s + self.fence_s
        return [TransferEnded(rec.transfer_id, "receiver", reason, detail, rec.blocks)]


# --------------------------------------------------------------------------- both


class PushProtocol:
    """Both sides of one rank, and the one inbound entry point for wire bytes and for
    handshake results.

    `compat` is our `CacheGeometry.compat_fields()`; every peer's is compared with it on
    every handshake, on both sides, under `compatibility` (default: nothing may differ).

    `message_key`: when set, every message we accept must begin with it, and anything
    else is dropped unread and counted ("bad_key"). We publish it on our side channel
    (`PeerInfo.message_key` on the other side), so only a peer that the side channel let
    read our metadata (with the token, when one is configured) can write to us at all,
    whatever agent name it uses on the data plane. `wire()` puts each peer's own key in
    front of what we send it. Why a key carried in clear and not a MAC: see "Who sent it".
    """

    def __init__(
        self,
        identity: LocalIdentity,
        timing: TimingConfig,
        num_layers: int,
        compat: Mapping[str, object],
        *,
        compatibility: CompatibilityPolicy = STRICT_COMPATIBILITY,
        revalidate_after_s: float = REVALIDATE_AFTER_S,
        message_key: bytes = b"",
    ) -> None:
        self.identity = identity
        self._key = bytes(message_key)
        self._peer_keys: dict[str, bytes] = {}  # agent -> the key it wants from us
        self._forged: collections.Counter[str] = collections.Counter()
        self.sender = SenderProtocol(
            identity, timing, num_layers, compat, compatibility=compatibility
        )
        self.receiver = ReceiverProtocol(
            identity,
            timing,
            compat,
            compatibility=compatibility,
            revalidate_after_s=revalidate_after_s,
        )
        self._compat = _Compatibility(compat, compatibility)

    def receive_message(self, now: float, peer: str, payload: bytes) -> list[Effect]:
        """Decode and route one message from agent `peer` (as the data plane names the
        sender). Without our message key in front it is dropped unread and counted.
        Raises `RemoteProtocolError` (nothing changed) when the bytes are not a message;
        the caller then calls `peer_misbehaved`."""
        key = self._key
        if key:
            if not hmac.compare_digest(payload[: len(key)], key):
                self._forged["bad_key"] += 1
                return []
            payload = payload[len(key) :]
        try:
            message = decode(payload)
        except RemoteProtocolError:
            self.receiver.heard_from(peer, now)
            raise
        match message:
            case Register() | Cancel() | Reject() | Heartbeat(role="receiver"):
                self.receiver.heard_from(peer, now)
                return self.sender.handle(now, peer, message)
            case _:
                return self.receiver.handle(now, peer, message)

    def wire(self, peer: str, message: Message) -> bytes:
        """`message` as bytes for agent `peer`: its message key (from its handshake), then
        the encoded message."""
        return self._peer_keys.get(peer, b"") + encode(message)

    def forged_messages(self) -> dict[str, int]:
        """Messages dropped unread because of who sent them, by reason: "bad_key" (not
        our message key), "unknown_agent" (an agent no side channel vouched for, naming
        none to ask), "impostor" (the side channel it named serves another agent, or the
        engine it claims still runs elsewhere), "unverified" (the side channel it named
        did not answer), "wrong_engine" (its agent was vouched for as another engine),
        "not_counterpart" (about a transfer of another peer), "unread_overflow" (too
        many before a side channel vouched for it)."""
        out = self._forged + self.sender.forged + self.receiver.forged
        return dict(out)

    def handshake_done(self, now: float, address: PeerAddress, info: PeerInfo) -> list[Effect]:
        """A `Handshake` of `address` found `info`: both machines learn it."""
        if info.message_key:
            self._peer_keys[info.agent] = bytes(info.message_key)
        return self.receiver.handshake_done(now, address, info) + self.sender.handshake_done(
            now, address, info
        )

    def handshake_failed(
        self, now: float, address: PeerAddress, reason: FailureReason, detail: str
    ) -> list[Effect]:
        """A `Handshake` of `address` failed (unreachable, refused, unloadable)."""
        return self.receiver.handshake_failed(
            now, address, reason, detail
        ) + self.sender.handshake_failed(now, address, reason, detail)

    def incompatibility(self, compat: Mapping[str, object]) -> str | None:
        """The protocol's compatibility verdict on a peer's compat fields, for a caller
        that must decide whether to load the peer on the data plane at all (None: ok)."""
        return self._compat.problem(compat)

    def peer_misbehaved(self, now: float, peer: str, detail: str) -> list[Effect]:
        """`peer` sent garbage: everything with it fails (MALFORMED_MESSAGE), safely."""
        out: list[Effect] = []
        reason = FailureReason.MALFORMED_MESSAGE
        for tid in list(self.sender.states()):
            out += self.sender.abort_with_peer(now, tid, peer, reason, detail)
        for tid in list(self.receiver.states()):
            out += self.receiver.abort_with_peer(now, tid, peer, reason, detail)
        return out

    def peer_lost(self, now: float, peer: str, reason: FailureReason, detail: str) -> list[Effect]:
        return self.sender.peer_lost(now, peer, reason, detail) + self.receiver.peer_lost(
            now, peer, reason, detail
        )

    def shutdown(self, now: float, reason: FailureReason, detail: str) -> list[Effect]:
        """End everything at once; only once the data plane can touch no memory of ours
        (see `SenderProtocol.shutdown`)."""
        return self.sender.shutdown(now, reason, detail) + self.receiver.shutdown(
            now, reason, detail
        )

    def tick(self, now: float) -> list[Effect]:
        return self.sender.tick(now) + self.receiver.tick(now)

    def in_flight(self) -> bool:
        return self.sender.in_flight() or self.receiver.in_flight()

    def next_deadline(self) -> float | None:
        times = [
            t for t in (self.sender.next_deadline(), self.receiver.next_deadline()) if t is not None
        ]
        return min(times) if times else None


__all__ = [
    "REVALIDATE_AFTER_S",
    "DropPeer",
    "Effect",
    "Handshake",
    "LocalIdentity",
    "PeerAddress",
    "PeerInfo",
    "PushProtocol",
    "ReceiverProtocol",
    "ReceiverState",
    "RemoteProtocolError",
    "SendMessage",
    "SenderProtocol",
    "SenderState",
    "Side",
    "TransferEnded",
    "WriteBlocks",
]
