"""What other threads hand the runtime's `Driver`: one frozen (or, for a request that
waits for its answer, mutable) dataclass per kind, in one union, `Command`, that the
driver takes off its queue for a pass, which dispatches them with `match`
(`Dispatcher._execute`).

The engine's calls (`Send` ... `RefuseRegistration`) carry arguments `PushRuntime`
checked already; the requests (`StatsRequest`, `StateRequest`, `SpokenRequest`) are
answered in a pass, their `done` set once `result` is filled in; `LookupResult` comes
from the lookup pool's threads; `Wake` and `Stop` are the driver's own.

`CommandQueue` is the queue they travel on, taken from by two threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpush.mailbox import Mailbox
from kvpush.protocol import PeerAddress, ReceiverState, SenderState, Side
from kvpush.runtime.values import RuntimeStatistics
from kvpush.sidechannel import PeerMetadata

__all__ = [
    "Abort",
    "Claim",
    "Command",
    "CommandQueue",
    "LayersReady",
    "LookupResult",
    "Receive",
    "RefuseRegistration",
    "RejectRequest",
    "RunForService",
    "Send",
    "SpokenRequest",
    "StateRequest",
    "StatsRequest",
    "Stop",
    "Wake",
]


@dataclass(frozen=True, slots=True)
class Send:
    transfer_id: str
    blocks: tuple[int, ...]
    ready_layers: tuple[int, ...] | None
    receiver: PeerAddress | None = None


@dataclass(frozen=True, slots=True)
class LayersReady:
    transfer_id: str
    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Receive:
    transfer_id: str
    sender: PeerAddress
    blocks: tuple[int, ...]
    sender_offset: int
    sender_block_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class RejectRequest:
    transfer_id: str
    sender: PeerAddress
    detail: str


@dataclass(frozen=True, slots=True)
class Abort:
    transfer_id: str


@dataclass(frozen=True, slots=True)
class Claim:
    transfer_id: str
    sender: PeerAddress


@dataclass(frozen=True, slots=True)
class RefuseRegistration:
    transfer_id: str
    detail: str


@dataclass(frozen=True, slots=True)
class LookupResult:
    """A side-channel lookup ended (on a lookup pool's thread): its metadata, or why not."""

    address: PeerAddress
    metadata: PeerMetadata | None
    error: BaseException | None


@dataclass(frozen=True, slots=True)
class RunForService:
    """A call a service asked for on the runtime's thread (`ServiceHost.run`)."""

    call: Callable[[], None]


@dataclass(slots=True)
class StatsRequest:
    done: threading.Event = field(default_factory=threading.Event)
    result: RuntimeStatistics | None = None


@dataclass(slots=True)
class StateRequest:
    transfer_id: str
    side: Side
    done: threading.Event = field(default_factory=threading.Event)
    result: SenderState | ReceiverState | None = None


@dataclass(slots=True)
class SpokenRequest:
    """Which ids under `prefixes` receivers registered for or rejected before we sent
    (and, with `claimed`, claimed)."""

    prefixes: tuple[str, ...]
    claimed: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    result: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Wake:
    """Nothing to do but look again: an engine thread left work for the thread."""


@dataclass(frozen=True, slots=True)
class Stop:
    drain_until: float  # time.monotonic(): stop waiting for writes and acks then


Command = (
    Send
    | LayersReady
    | Receive
    | RejectRequest
    | Abort
    | Claim
    | RefuseRegistration
    | LookupResult
    | RunForService
    | StatsRequest
    | StateRequest
    | SpokenRequest
    | Wake
    | Stop
)


class CommandQueue(Mailbox[Command]):
    """The driver's commands, put by any thread and taken by two: the runtime's thread,
    the one taker that waits (with a timeout: its next poll is due then), and an engine
    thread driving a pass in-step, which takes what is there and never waits. Not a
    `queue.SimpleQueue` (`kvpush.mailbox` says why): its timed get, with the engine
    thread taking the runtime thread's wake-ups or with none, could sleep until the next
    command, and the runtime's thread then stopped polling."""
