"""What the engine hands the runtime and gets back: plain, frozen values."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvpush.config import STRICT_COMPATIBILITY, CompatibilityPolicy, TimingConfig
from kvpush.errors import ConfigError
from kvpush.protocol import REVALIDATE_AFTER_S, PeerAddress, TransferEnded

__all__ = [
    "PeerAddress",
    "RuntimeIdentity",
    "RuntimeSettings",
    "RuntimeStatistics",
    "TransferResult",
    "WritesMeasured",
]


@dataclass(frozen=True, slots=True)
class RuntimeIdentity:
    """Who this rank is: sent to senders in `Register` so they can handshake back.

    `engine_id` must be unique among the engines that talk to each other (a second
    engine claiming a running one's id is refused as an impostor); `incarnation` must
    be new on every start of the process."""

    engine_id: str
    incarnation: str
    host: str  # our side channel's host, as peers can reach it
    port: int  # our side channel's port
    rank: int = 0
    role: str = "both"  # "sender" | "receiver" | "both", as published


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeSettings:
    """How a runtime runs, checked when built: the shared secret, the protocol's timing,
    how its thread paces its polls, how long a handshake is trusted, which cache fields
    may differ between peers, and whether engine calls drive it in-step.
    `kvpush.node.RankSettings` is these and how a rank looks its peers up."""

    # With a token, data-plane messages are authenticated per pair of ranks (never
    # opt-in); the side channel proves the same token.
    token: str | None = None
    timing: TimingConfig = field(default_factory=TimingConfig)
    # NIXL cannot wake the runtime when a registration arrives: an idle runtime finds it
    # at its next poll, so this bounds the delay a transfer sees. None: half of
    # `timing.heartbeat_interval_s`.
    idle_poll_s: float | None = None
    # While in flight: the longest wait between polls (the back-off doubles up to it),
    # and how long after data-plane activity the thread polls at its shortest wait.
    max_backoff_s: float = 0.00025
    spin_s: float = 0.0005
    # How long a peer's cached handshake answers a new transfer's lookup of its address.
    revalidate_after_s: float = REVALIDATE_AFTER_S
    # Which cache fields may differ between peers (none, unless an explicit policy says
    # which and why).
    compatibility: CompatibilityPolicy = STRICT_COMPATIBILITY
    # Engine calls run the runtime's pass on the calling thread when no other thread is
    # (`PushRuntime.poll`); False: they only queue commands for the runtime's thread.
    drive_in_step: bool = True

    def __post_init__(self) -> None:
        if self.max_backoff_s <= 0 or (self.idle_poll_s is not None and self.idle_poll_s <= 0):
            raise ConfigError("idle_poll_s and max_backoff_s must be positive")
        if self.spin_s < 0:
            raise ConfigError(f"spin_s must be >= 0, got {self.spin_s}")
        if self.revalidate_after_s < 0:
            raise ConfigError(f"revalidate_after_s must be >= 0, got {self.revalidate_after_s}")
        if not isinstance(self.compatibility, CompatibilityPolicy):
            raise ConfigError(
                "compatibility must be a kvpush.config.CompatibilityPolicy, "
                f"got {self.compatibility!r}"
            )


@dataclass(frozen=True, slots=True)
class WritesMeasured:
    """What the data plane did for one sending transfer, measured while it ran.

    `writes` posted (one for a whole push; one per batch of layers announced for a
    layer-wise one), and of those that completed, the `nbytes` they moved in
    `descriptors` contiguous copies (`kvpush.transports.base.WriteDone`). `post_s`: time
    spent in the transport's `write_blocks` calls, handing the writes over. `busy_s`:
    time during which at least one of its writes was in flight, from the start of its
    post to the poll that saw it end; a layer-wise transfer's gaps between layers (no
    write in flight, the engine computing) are not in it, so `nbytes / busy_s` is the
    rate at which the data plane moved it. Real time (`time.perf_counter`), whatever
    clock drives the protocol."""

    writes: int
    descriptors: int
    nbytes: int
    post_s: float
    busy_s: float


@dataclass(frozen=True, slots=True)
class TransferResult(TransferEnded):
    """How one transfer ended, on one side, reported exactly once by `poll()`/`wait()`
    (`.ok`, `.reason`, `.detail`, `.blocks`, `.raise_for_failure()`): the protocol's own
    record (`TransferEnded`), with what its writes measured (`writes`: a sending
    transfer that posted at least one write; None on the receiving side, and for a send
    that wrote nothing)."""

    writes: WritesMeasured | None = None

    @classmethod
    def of(cls, ended: TransferEnded, writes: WritesMeasured | None = None) -> TransferResult:
        """`ended` as the protocol built it, with `writes`."""
        fields = {f.name: getattr(ended, f.name) for f in dataclasses.fields(TransferEnded)}
        return cls(**fields, writes=writes)


@dataclass(frozen=True, slots=True)
class RuntimeStatistics:
    """A snapshot. `sending`/`receiving` count in-flight transfers by state (the
    protocol's `SenderState`/`ReceiverState` values, "handshaking" included)."""

    sending: dict[str, int]
    receiving: dict[str, int]
    finished: int
    failed: int
    failures: dict[str, int]  # by FailureReason value
    bytes_written: int
    blocks_held_sending: int
    blocks_held_receiving: int
    results_queued: int  # ended, not yet taken by poll()
    peers: int  # side-channel addresses with a usable handshake cached
    handshakes_in_flight: int  # side-channel lookups running, one per address
    malformed_messages: int
    transport_polls: int
    # An assertion, not a feature: every result comes from the protocol, once; a second
    # one for the same transfer would be a bug, counted here (and dropped) if ever.
    duplicate_reports: int
    # Registers sent again after a fresh handshake because their first send, to cached
    # metadata, found the peer gone (a sender restarted within `revalidate_after_s`).
    register_retries: int = 0
    writes_in_flight: int = 0  # writes whose outcome the data plane has not reported
    stale_registers: int = 0  # Registers refused because their lease had already run out
    wrong_receivers: int = 0  # Registers refused: the transfer is for another decode (send)
    # The in-flight transfers themselves: transfer id -> state (the values counted above).
    sending_transfers: dict[str, str] = field(default_factory=dict)
    receiving_transfers: dict[str, str] = field(default_factory=dict)
    # Data-plane messages dropped unread because of who sent them, by reason: see
    # `kvpush.protocol.PushProtocol.forged_messages` (a message without our message key,
    # from an agent no side channel vouched for, about another peer's transfer, ...).
    forged_messages: dict[str, int] = field(default_factory=dict)
    # Sending: per receiver agent whose clock our leases bound, from the newest heartbeat
    # round trip it echoed (`kvpush.protocol.PeerClock`): "round_trip_s" (how much
    # sooner than it may a lease is taken to end), "skew_lb_s" (our clock - theirs is at
    # least this) and "age_s" (since that echo came).
    clock_bounds: dict[str, dict[str, float]] = field(default_factory=dict)
    # CPU seconds the runtime's own thread has used since it started (None where the
    # platform cannot read a thread's clock): near nothing while no transfer is in flight.
    thread_cpu_s: float | None = None
    # How long ago the oldest transfer in flight (either side) began; None: none in flight.
    oldest_in_flight_s: float | None = None
    # Receiving: requests held queued whose senders our heartbeats claim them from
    # (`PushRuntime.claim`), not received, rejected or aborted yet.
    claimed: int = 0

    @property
    def in_flight(self) -> int:
        return sum(self.sending.values()) + sum(self.receiving.values())
