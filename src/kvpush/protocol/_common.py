"""What both machines of `kvpush.protocol.state` share: the values and effects they
take and return (where a transfer stands on each side included), a peer as either side
knows it, the clock, the compatibility decision, and what both sides do alike. The
theory of operation is in `state`."""

from __future__ import annotations

import collections
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar

from kvpush.config import CompatibilityPolicy, TimingConfig
from kvpush.errors import (
    FailureReason,
    LocalProtocolError,
    TransferFailed,
)
from kvpush.geometry import describe_compat_differences
from kvpush.protocol.messages import (
    Message,
    Register,
)

Side = Literal["sender", "receiver"]

# A peer heard from this recently is still the process we handshaked with: no process
# restarts (new NIXL agent, side channel bound again) faster. Older entries are looked up
# again before a Register (one side-channel round trip, while the sender computes the
# prefill, in push mode; its cost: docs/benchmarks.md, "Design notes moved from docstrings").
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


class SenderState(enum.StrEnum):
    """Where a transfer stands on the sending side (`SenderProtocol.state_of`)."""

    AWAITING_REGISTER = "awaiting_register"  # submitted, receiver not heard yet
    REGISTERED = "registered"  # receiver registered, engine has not submitted (no blocks)
    WRITING = "writing"  # both known: writes go out as layers become ready
    ENDING = "ending"  # outcome decided, waiting for in-flight writes to drain


# A sender's record of one transfer, and what is left of it once it ended.
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
    # The lease looked over on a bound of the receiver's clock measured before it did:
    # (our clock when we asked for a fresh bound, why it looked over, a Register's?).
    recheck: tuple[float, str, bool] | None = None
    # The decode server named at submit, (host, port) of its side channel (None: any),
    # and Registers from other receivers that came before submit: held, unanswered,
    # until submit says which receiver the transfer is for.
    receiver: tuple[str, int] | None = None
    held: list[tuple[str, Register]] = field(default_factory=list)
    # Submitted and not registered: it ends at this time of our clock unless a Register
    # or a receiver's claim comes first (`TimingConfig.claim_window_s`; inf: no window);
    # `claimer`: the agent whose heartbeat claimed it last.
    claim_until: float = float("inf")
    claimer: str | None = None


@dataclass(slots=True)
class _Tombstone:
    peer: str | None
    reply: Message | None  # what a late Register/Cancel/heartbeat gets
    expires: float
    # Set when the engine has not submitted yet: its submit then fails at once.
    pending_failure: tuple[FailureReason, str] | None = None


class ReceiverState(enum.StrEnum):
    """Where a transfer stands on the receiving side (`ReceiverProtocol.state_of`)."""

    HANDSHAKING = "handshaking"  # waiting for the sender's side channel; nothing registered
    WAITING = "waiting"  # registered; blocks may be written any time
    FENCING = "fencing"  # given up; blocks kept until the sender confirms or its lease ran out


# A receiver's record of one transfer.
@dataclass(slots=True)
class _Incoming:
    transfer_id: str
    address: PeerAddress
    blocks: tuple[int, ...]
    sender_offset: int
    deadline: float
    sender_block_tokens: int = 0
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
    it believes a second address that claims the same rank of that engine (see "Who
    sent it")."""

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
    """The transfer ended, once and for good; kvpush no longer holds `blocks`.

    `blocks_moved`: how many blocks a finished transfer carried (the receiver's registered
    blocks, which a prefix-cache hit makes fewer than the sender's); 0 unless finished."""

    transfer_id: str
    side: Side
    reason: FailureReason | None  # None: finished
    detail: str
    blocks: tuple[int, ...]
    blocks_moved: int = 0

    @property
    def ok(self) -> bool:
        return self.reason is None

    def raise_for_failure(self) -> None:
        if self.reason is not None:
            raise TransferFailed(self.transfer_id, self.reason, self.detail)


Effect = SendMessage | WriteBlocks | Handshake | DropPeer | TransferEnded


def ended_unreported(
    transfer_id: str, side: Side, reason: FailureReason, detail: str
) -> TransferEnded:
    """The end of a transfer whose machine did not report it, for a runtime whose data
    plane is closed (so nothing can read or write our memory any more): one whose
    command never reached the protocol before the runtime stopped, or one the protocol
    could not end because a crash broke its state. Which blocks it held is not known
    here, so `blocks` is empty."""
    return TransferEnded(transfer_id, side, reason, detail, ())


@dataclass(frozen=True, slots=True)
class PeerClock:
    """What a sender's leases know of one receiver's clock, from the newest heartbeat
    round trip it echoed: (our clock - theirs) lies in `[skew_lb_s, skew_lb_s +
    round_trip_s]`, and a lease is taken as ending at its worst case, `round_trip_s`
    sooner than it may. `measured_at`: our clock when that echo came."""

    skew_lb_s: float
    round_trip_s: float
    measured_at: float


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
    # for the same rank of the same engine, being looked up again before this one is
    # believed.
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
    skew_round_trip: float = 0.0  # sender: our clock from `skew_echo` to its echo's arrival
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
        ours, their = self._compared(theirs)
        differences = describe_compat_differences(their, ours)
        if not differences:
            return None
        return "the peer's KV cache is incompatible with ours: " + "; ".join(differences)

    def their_view(self, theirs: Mapping[str, object]) -> str:
        """What differs as the peer sees it (its values are "ours" there), to tell it."""
        ours, their = self._compared(theirs)
        return "; ".join(describe_compat_differences(ours, their))

    def _compared(
        self, theirs: Mapping[str, object]
    ) -> tuple[dict[str, object], dict[str, object]]:
        """Ours and theirs without the fields the policy lets differ."""
        allowed = self.policy.may_differ
        ours = {k: v for k, v in self.ours.items() if k not in allowed}
        their = {k: v for k, v in theirs.items() if k not in allowed}
        return ours, their

    @property
    def block_tokens(self) -> int:
        """Our block size in tokens; 0 where our fields do not say (models, tests)."""
        value = self.ours.get("block_size_tokens", 0)
        return value if isinstance(value, int) else 0


def _check_blocks(blocks: Sequence[int], call: str, transfer_id: object) -> tuple[int, ...]:
    """`blocks` as a tuple, checked; errors name `call(transfer_id)` (built only then:
    this runs once per transfer)."""
    out = tuple(blocks)
    for b in out:
        if not isinstance(b, int) or isinstance(b, bool) or b < 0:
            raise LocalProtocolError(
                f"{call}({transfer_id!r}): block id {b!r} is not a non-negative integer"
            )
    if len(out) > 1 and len(set(out)) != len(out):
        raise LocalProtocolError(f"{call}({transfer_id!r}): block ids repeat: {list(out)}")
    return out


class _Record(Protocol):
    @property
    def peer(self) -> str | None: ...  # None: not bound to an agent yet
    @property
    def deadline(self) -> float: ...  # `transfer_deadline_s` after it began; never moves


_Rec = TypeVar("_Rec", bound=_Record)


class _Side(Generic[_Rec]):
    """What both sides do alike: their transfers, by id, each with one peer."""

    _clock: _Clock
    _timing: TimingConfig
    _transfers: dict[str, _Rec]
    _peers: dict[str, _Peer]
    # Messages dropped unread because of who sent them, by reason (see "Who sent it").
    forged: collections.Counter[str]

    def in_flight(self) -> bool:
        return bool(self._transfers)

    def began(self) -> dict[str, float]:
        """When each transfer in flight began on this side, on our clock (its deadline
        runs from then)."""
        d = self._timing.transfer_deadline_s
        return {t: r.deadline - d for t, r in self._transfers.items()}

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
