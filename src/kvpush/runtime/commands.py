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

import collections
import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

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


class CommandQueue:
    """The driver's commands, put by any thread and taken by two: the runtime's thread,
    the one taker that waits (with a timeout: its next poll is due then), and an engine
    thread driving a pass in-step, which takes what is there and never waits.

    Not one `queue.SimpleQueue`, whose timed `get` breaks with a second taker: woken for
    an item the other thread took first, it recomputes its timeout, and once that is
    past it waits with a negative one, which CPython (3.11 to 3.13 at least) takes as
    forever, until the next put. In vLLM the engine thread took the runtime thread's
    wake-ups that way, then went idle: the runtime's thread stopped polling, so the
    peers' writes into this rank and its heartbeats stopped until the next request
    (seen as "sender silent" on live pairs, and a doctor's test write that never ended).
    Here the commands lie in a deque both take from, and each put also drops a token in
    a `SimpleQueue` that only the waiting taker gets from (a wait at C speed: the
    runtime's thread waits 20 us between polls right after activity). A token whose
    command the engine took is left over: it ends that thread's next wait early, once."""

    _TAKE_AT_MOST = 1024

    def __init__(self) -> None:
        self._items: collections.deque[Command] = collections.deque()
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()

    def put(self, command: Command) -> None:
        self._items.append(command)
        self._tokens.put(None)  # after the command: a woken taker finds it there

    def take(self, timeout: float = 0.0) -> list[Command]:
        """What is queued (up to `_TAKE_AT_MOST`, oldest first); with a `timeout`, on the
        one thread that waits, and nothing queued, wait up to `timeout` seconds for a put
        first. Never waits longer, whoever else takes."""
        items = self._items
        if timeout > 0:
            tokens = self._tokens
            if not items:
                with contextlib.suppress(queue.Empty):
                    tokens.get(timeout=timeout)
            # Spent tokens go before the commands are taken: a put from here on leaves
            # its token for the next wait, whose command this take or that one finds.
            while not tokens.empty():
                tokens.get_nowait()
        out: list[Command] = []
        while items and len(out) < self._TAKE_AT_MOST:
            try:
                out.append(items.popleft())
            except IndexError:  # the other taker emptied it since
                break
        return out
