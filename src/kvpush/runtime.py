"""The push runtime: one object per rank that an engine drives.

Public engine API (every method is thread-safe and never blocks on the network)::

    rt = PushRuntime(transport, geometry, identity, directory, timing=..., clock=...)
    rt.start()                       # starts the transport, registers memory, one thread
    rt.local_metadata() -> PeerMetadata   # what to publish on this rank's side channel

    # sending side (prefill)
    rt.send(transfer_id, blocks, ready_layers=None)   # None: every layer computed already
    rt.layers_ready(transfer_id, layers)              # layer-by-layer push

    # receiving side (decode)
    rt.receive(transfer_id, sender, blocks, sender_offset=0)
        # `sender` is a PeerAddress(host, port, rank): the sender's side channel.
        # blocks[i] receives the sender's block number sender_offset + i
        # (sender_offset = number of blocks we already had from the prefix cache).
    rt.reject(transfer_id, sender, detail)            # refuse before allocating

    rt.abort(transfer_id)            # either side; the result still comes from poll()
    rt.poll() -> list[TransferResult]            # what ended since the last call
    rt.wait(timeout) -> list[TransferResult]     # the same, blocking until one ends
    rt.statistics() -> RuntimeStatistics
    rt.close()                       # in-flight transfers end as SHUTDOWN; joins threads

The contract: every transfer handed in through `send` or `receive` comes back from
`poll()`/`wait()` exactly once, as finished or failed with a `FailureReason`, within the
transfer deadline plus the fence (see `kvpush.protocol.state`). Whatever goes wrong on any
thread (handshake not done, peer unknown or unreachable, write error, peer gone or
restarted, deadline, malformed message, cancel, an exception on the background thread)
is queued as a result, never handled where it was found. When a result arrives, kvpush
no longer touches its blocks: the engine may free or reuse them (on the receiving side,
a finished transfer's blocks hold the KV data). That is why a receiver that gives up
(abort, deadline, silent sender) reports the failure only once the sender has
acknowledged its cancel, or, if the sender never answers, `lease_s + 2 *
liveness_timeout_s` later: no late write can land in blocks the engine got back.

Bounds (TimingConfig): a silent peer is declared dead after `liveness_timeout_s`; a
peer the data plane reports gone, or one that came back with a new incarnation, ends
its transfers at once; nothing lives past `transfer_deadline_s` plus the fence.

Engine misuse that can be seen at the call (a transfer id already in flight, a block id
outside the cache, a layer out of range) raises `LocalProtocolError` at once. After the
background thread died on an unexpected error, calls raise `RuntimeStopped` (its cause
chained) and every transfer that was in flight is reported as LOCAL_ERROR.

Threads: the runtime owns one background thread that owns the transport (and so the
NIXL agent) and the protocol state machines, and one handshake worker that does the
blocking side-channel lookups (`PeerDirectory`) and posts results back. Both start in
`start()` and are joined in `close()`. The background thread blocks on its command queue
while nothing is in flight (waking every `idle_poll_s`, default half a heartbeat interval,
to look for registrations: NIXL cannot wake a thread on an incoming notification), and
polls the transport with exponential backoff (50 us up to `max_backoff_s`, default 1 ms)
while transfers are in flight. Right after data-plane activity (an event in, a write or
message out) it keeps polling at the shortest wait (~60 us) for `spin_s` (default
0.5 ms): NIXL progresses only when polled, and the next event (WriteDone, the peer's
answer) is usually that close. It never polls without waiting: a hot loop would hold the
GIL from the engine's own Python threads (measured: a 2 ms spin doubled the CPU per
transfer of two runtimes in one process). Idle, nothing spins.

Latency inside a busy engine: when another thread of the process computes in Python, each
wake-up of the runtime thread (a command, the next poll) and of the thread in `wait()`
waits for the GIL up to `sys.getswitchinterval()` (5 ms by default), and a transfer
needs a few of them. Measured with `scripts/runtime-latency` (one 16-token block,
receiver first, send() 10-50 ms later): p50 send()-to-receiver-result 2.3 ms with idle
engines, 14-26 ms with a computing thread in both processes, 4-7 ms when those processes
set a switch interval of 0.2-1 ms. That setting is the engine's to choose, not ours.

Publishing: the runtime does not serve its own side channel. Pass `local_metadata()` to
a `kvpush.sidechannel.MetadataServer` (one per engine, all ranks) after `start()`; the
engine decides host, port and token there. The runtime owns the transport it is given:
`start()` starts it, `close()` closes it.

Handshakes: a receiver handshakes with the sender's address from the request before it
registers; the `Register` carries the receiver's own address (`identity`) so the sender
handshakes back before its first write. Metadata is cached per address while the peer is
heard from (heartbeats flow while transfers do); an address not heard from for
`revalidate_after_s` (default 0.1 s) is looked up again before its next Register, so a
peer restarted there (new incarnation, new agent) is handshaked afresh on the first
transfer after the restart, and everything still in flight with its old incarnation
fails with PEER_RESTARTED. A peer found dead is forgotten. The lookup costs one
side-channel round trip (~0.9 ms on one host) and only after a quiet spell; in push mode
it overlaps the sender's prefill.

A sender restarted faster than `revalidate_after_s` still gets the first Register, sent
from the cache to its dead agent. When the data plane reports that agent gone in the
same loop pass (NIXL could not deliver the notification), the Register reached nobody:
the runtime drops the cached metadata, handshakes afresh and registers once more
(`register_retries` in `statistics()`). Only once, and only while nothing was heard from
that agent since the Register went out, so never when a byte may have been written.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvpush import __version__
from kvpush.config import TimingConfig
from kvpush.errors import (
    AuthenticationRefused,
    ClosedError,
    ConfigError,
    FailureReason,
    IncompatiblePeer,
    KVPushError,
    LocalProtocolError,
    RemoteProtocolError,
    RuntimeStopped,
    TransportError,
)
from kvpush.geometry import CacheGeometry
from kvpush.protocol import (
    DropPeer,
    Effect,
    Handshake,
    LocalIdentity,
    PushProtocol,
    SendMessage,
    Side,
    TransferEnded,
    WriteBlocks,
    encode,
)
from kvpush.sidechannel import ROLES, PeerMetadata, fetch_metadata
from kvpush.transports.base import (
    MessageReceived,
    PeerLost,
    Transport,
    TransportEvent,
    WriteDone,
    WriteFailed,
)

log = logging.getLogger(__name__)

__all__ = [
    "InMemoryPeerDirectory",
    "PeerAddress",
    "PeerDirectory",
    "PushRuntime",
    "RuntimeIdentity",
    "RuntimeStatistics",
    "RuntimeStopped",
    "SideChannelPeerDirectory",
    "TransferResult",
]

_JOIN_TIMEOUT_S = 5.0
# A peer heard from this recently is still the process we handshaked with: no process
# restarts (new NIXL agent, side channel bound again) faster. Older entries are looked up
# again before a Register (~0.9 ms over the side channel on one host, measured; while the
# sender computes the prefill, in push mode), so a peer restarted at the same address is
# handshaked afresh on the first transfer, not found dead by it.
_REVALIDATE_AFTER_S = 0.1
_SPIN_WAIT_S = 20e-6  # ~60 us with the kernel's timer slack


# --------------------------------------------------------------------------- values


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """Where a peer's side channel answers, and which of its ranks we mean."""

    host: str
    port: int
    rank: int = 0


@dataclass(frozen=True, slots=True)
class RuntimeIdentity:
    """Who this rank is: sent to senders in `Register` so they can handshake back."""

    engine_id: str
    incarnation: str
    host: str  # our side channel's host, as peers can reach it
    port: int  # our side channel's port
    rank: int = 0
    role: str = "both"  # "sender" | "receiver" | "both", as published


# How one transfer ended, on one side: the protocol's own record, reported exactly once
# by `poll()`/`wait()` (`.ok`, `.reason`, `.detail`, `.blocks`, `.raise_for_failure()`).
TransferResult = TransferEnded


@dataclass(frozen=True, slots=True)
class RuntimeStatistics:
    """A snapshot. `sending`/`receiving` count in-flight transfers by state."""

    sending: dict[str, int]
    receiving: dict[str, int]
    finished: int
    failed: int
    failures: dict[str, int]  # by FailureReason value
    bytes_written: int
    blocks_held_sending: int
    blocks_held_receiving: int
    results_queued: int  # ended, not yet taken by poll()
    peers: int
    handshakes_in_flight: int
    malformed_messages: int
    transport_polls: int
    duplicate_reports: int  # a protocol bug if ever > 0: a second end for one transfer
    # Registers sent again after a fresh handshake because their first send, to cached
    # metadata, found the peer gone (a sender restarted within `revalidate_after_s`).
    register_retries: int = 0

    @property
    def in_flight(self) -> int:
        return sum(self.sending.values()) + sum(self.receiving.values())


# --------------------------------------------------------------------------- peer directory


class PeerDirectory(abc.ABC):
    """How the runtime finds a peer's metadata. Called on the handshake worker only."""

    @abc.abstractmethod
    def lookup(self, host: str, port: int, rank: int) -> PeerMetadata:
        """Raise a `SideChannelError` subclass when the peer cannot be used."""


class InMemoryPeerDirectory(PeerDirectory):
    """Metadata published in-process (tests, one-process demos). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, int, int], PeerMetadata] = {}

    def publish(self, address: PeerAddress, metadata: PeerMetadata) -> None:
        with self._lock:
            self._entries[(address.host, address.port, address.rank)] = metadata

    def withdraw(self, address: PeerAddress) -> None:
        with self._lock:
            self._entries.pop((address.host, address.port, address.rank), None)

    def lookup(self, host: str, port: int, rank: int) -> PeerMetadata:
        from kvpush.errors import PeerUnreachable, UnknownRank

        with self._lock:
            meta = self._entries.get((host, port, rank))
            known_ports = {(h, p) for h, p, _ in self._entries}
        if meta is None:
            if (host, port) in known_ports:
                raise UnknownRank(f"{host}:{port} serves no metadata for rank {rank}")
            raise PeerUnreachable(f"no peer published at {host}:{port}")
        return meta


class SideChannelPeerDirectory(PeerDirectory):
    """Asks the peer's side channel (`kvpush.sidechannel.fetch_metadata`)."""

    def __init__(
        self,
        *,
        timeout_ms: int = 2000,
        token: str | None = None,
        expect_compat_hash: str | None = None,
    ) -> None:
        self._timeout_ms = timeout_ms
        self._token = token
        self._expect = expect_compat_hash

    def lookup(self, host: str, port: int, rank: int) -> PeerMetadata:
        return fetch_metadata(
            host,
            port,
            rank,
            timeout_ms=self._timeout_ms,
            token=self._token,
            expect_compat_hash=self._expect,
        )


def _handshake_reason(exc: BaseException) -> FailureReason:
    if isinstance(exc, AuthenticationRefused):
        return FailureReason.HANDSHAKE_REFUSED
    if isinstance(exc, IncompatiblePeer):
        return FailureReason.INCOMPATIBLE_PEER
    if isinstance(exc, TransportError):
        return exc.reason
    return FailureReason.HANDSHAKE_FAILED


# --------------------------------------------------------------------------- commands


@dataclass(frozen=True, slots=True)
class _Send:
    transfer_id: str
    blocks: tuple[int, ...]
    ready_layers: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class _LayersReady:
    transfer_id: str
    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Receive:
    transfer_id: str
    sender: PeerAddress
    blocks: tuple[int, ...]
    sender_offset: int
    first_attempt: bool = True  # False: the one retry after its Register found the peer gone


@dataclass(frozen=True, slots=True)
class _Reject:
    transfer_id: str
    sender: PeerAddress
    detail: str


@dataclass(frozen=True, slots=True)
class _Abort:
    transfer_id: str


@dataclass(frozen=True, slots=True)
class _HandshakeResult:
    address: PeerAddress
    metadata: PeerMetadata | None
    error: BaseException | None


@dataclass(slots=True)
class _StatsRequest:
    done: threading.Event = field(default_factory=threading.Event)
    result: RuntimeStatistics | None = None


class _Stop:
    pass


_Command = (
    _Send | _LayersReady | _Receive | _Reject | _Abort | _HandshakeResult | _StatsRequest | _Stop
)


@dataclass(slots=True)
class _PeerEntry:
    agent: str
    engine_id: str
    handshaken_at: float


# --------------------------------------------------------------------------- runtime


class PushRuntime:
    """One rank's push runtime. See the module docstring for the engine API."""

    def __init__(
        self,
        transport: Transport,
        geometry: CacheGeometry,
        identity: RuntimeIdentity,
        directory: PeerDirectory,
        *,
        timing: TimingConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        idle_poll_s: float | None = None,
        max_backoff_s: float = 0.001,
        spin_s: float = 0.0005,
        revalidate_after_s: float = _REVALIDATE_AFTER_S,
        kvpush_version: str = __version__,
    ) -> None:
        if identity.role not in ROLES:
            raise ConfigError(f"role {identity.role!r} is not one of {', '.join(ROLES)}")
        if max_backoff_s <= 0 or (idle_poll_s is not None and idle_poll_s <= 0):
            raise ConfigError("idle_poll_s and max_backoff_s must be positive")
        if spin_s < 0:
            raise ConfigError(f"spin_s must be >= 0, got {spin_s}")
        if revalidate_after_s < 0:
            raise ConfigError(f"revalidate_after_s must be >= 0, got {revalidate_after_s}")
        self._transport = transport
        self._geometry = geometry
        self._identity = identity
        self._directory = directory
        self._timing = timing or TimingConfig()
        self._clock = clock
        self._idle_poll_s = idle_poll_s or self._timing.heartbeat_interval_s / 2
        self._max_backoff_s = max_backoff_s
        self._spin_s = spin_s
        self._active = False  # set when the loop's pass wrote or sent something
        self._revalidate_after_s = revalidate_after_s
        self._tick_interval_s = min(self._timing.heartbeat_interval_s / 4, 0.05)
        self._kvpush_version = kvpush_version
        num_layers = max(1, geometry.num_layers)
        self._layer_regions: dict[int, list[int]] = collections.defaultdict(list)
        for i, region in enumerate(geometry.regions):
            self._layer_regions[region.layer].append(i)
        self._layers = sorted(self._layer_regions) or [0]
        self._protocol = PushProtocol(
            LocalIdentity(
                identity.engine_id,
                identity.incarnation,
                identity.host,
                identity.port,
                identity.rank,
            ),
            self._timing,
            num_layers,
        )
        # Engine-facing state, guarded by _lock.
        self._lock = threading.Lock()
        self._results_cv = threading.Condition(self._lock)
        self._results: collections.deque[TransferResult] = collections.deque()
        self._live: set[tuple[Side, str]] = set()
        self._finished = 0
        self._failed = 0
        self._failures: collections.Counter[str] = collections.Counter()
        self._duplicates = 0
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._handshake_jobs: queue.SimpleQueue[PeerAddress | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._handshaker: threading.Thread | None = None
        self._started = False
        self._closed = False
        self._crash: BaseException | None = None
        self._local_metadata: PeerMetadata | None = None
        # Owned by the background thread.
        self._peers_by_address: dict[PeerAddress, _PeerEntry] = {}
        self._handshaking: dict[PeerAddress, list[_Receive | _Reject | Handshake]] = {}
        self._last_heard: dict[str, float] = {}  # agent -> when it last sent us anything
        # Registers sent in this loop pass to cached metadata, by agent: if the data plane
        # reports that agent gone in the same pass, the Register itself went nowhere.
        self._unconfirmed: dict[str, list[_Receive]] = {}
        self._register_retries = 0
        self._write_bytes: dict[int, int] = {}
        self._bytes_written = 0
        self._malformed = 0
        self._polls = 0
        self._next_tick = float("-inf")

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        with self._lock:
            if self._closed:
                raise ClosedError("this PushRuntime was closed; create a new one")
            if self._started:
                raise LocalProtocolError("PushRuntime.start() called twice")
            self._started = True
        self._transport.start()
        self._transport.register_memory(self._geometry)
        self._local_metadata = PeerMetadata(
            engine_id=self._identity.engine_id,
            incarnation=self._identity.incarnation,
            rank=self._identity.rank,
            role=self._identity.role,
            agent_name=self._transport.agent_name,
            agent_metadata=self._transport.metadata(),
            geometry=self._geometry,
            kvpush_version=self._kvpush_version,
        )
        name = self._transport.agent_name
        self._handshaker = threading.Thread(
            target=self._handshake_loop, name=f"kvpush-handshake-{name}", daemon=True
        )
        self._thread = threading.Thread(
            target=self._run, name=f"kvpush-runtime-{name}", daemon=True
        )
        self._handshaker.start()
        self._thread.start()

    def close(self, timeout: float = _JOIN_TIMEOUT_S) -> None:
        """Stop: in-flight transfers end as SHUTDOWN (poll() still returns them)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is not None:
            self._commands.put(_Stop())
            self._thread.join(timeout)
        if self._handshaker is not None:
            self._handshake_jobs.put(None)
            self._handshaker.join(timeout)
        if self._thread is None:
            self._transport.close()

    def __enter__(self) -> PushRuntime:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def local_metadata(self) -> PeerMetadata:
        """This rank's metadata, to publish on the side channel. Available after start()."""
        if self._local_metadata is None:
            raise LocalProtocolError("local_metadata(): call start() first")
        return self._local_metadata

    @property
    def agent_name(self) -> str:
        return self._transport.agent_name

    # ----------------------------------------------------------------- engine API

    def send(
        self,
        transfer_id: str,
        blocks: Sequence[int],
        *,
        ready_layers: Iterable[int] | None = None,
    ) -> None:
        """Offer our `blocks` for `transfer_id`. `ready_layers=None`: all computed; else
        only those layers are, and `layers_ready` announces the rest."""
        ours = self._check_blocks(transfer_id, blocks)
        layers = None if ready_layers is None else self._check_layers(transfer_id, ready_layers)
        self._submit(("sender", transfer_id), _Send(transfer_id, ours, layers))

    def layers_ready(self, transfer_id: str, layers: Iterable[int]) -> None:
        self._submit(None, _LayersReady(transfer_id, self._check_layers(transfer_id, layers)))

    def receive(
        self,
        transfer_id: str,
        sender: PeerAddress,
        blocks: Sequence[int],
        *,
        sender_offset: int = 0,
    ) -> None:
        """Expect `transfer_id` from `sender` into `blocks`; `blocks[i]` receives the
        sender's block `sender_offset + i`. Empty `blocks`: a full prefix-cache hit."""
        ours = self._check_blocks(transfer_id, blocks)
        if isinstance(sender_offset, bool) or not isinstance(sender_offset, int):
            raise LocalProtocolError(f"sender_offset must be an int, got {sender_offset!r}")
        if sender_offset < 0:
            raise LocalProtocolError(f"sender_offset must be >= 0, got {sender_offset}")
        self._submit(("receiver", transfer_id), _Receive(transfer_id, sender, ours, sender_offset))

    def reject(self, transfer_id: str, sender: PeerAddress, detail: str = "") -> None:
        """Refuse `transfer_id` before allocating: the sender frees its blocks at once.
        Nothing is reported for it on this side."""
        self._check_id(transfer_id)
        self._submit(None, _Reject(transfer_id, sender, detail))

    def abort(self, transfer_id: str) -> None:
        """Cancel `transfer_id` (either side). Its result still comes from poll()."""
        self._check_id(transfer_id)
        self._submit(None, _Abort(transfer_id))

    def poll(self) -> list[TransferResult]:
        """Every transfer that ended since the last call; never blocks."""
        with self._lock:
            out = list(self._results)
            self._results.clear()
            return out

    def wait(self, timeout: float | None = None) -> list[TransferResult]:
        """Like poll(), but waits up to `timeout` seconds for at least one result."""
        with self._results_cv:
            self._results_cv.wait_for(
                lambda: bool(self._results) or self._stopped_locked(), timeout
            )
            out = list(self._results)
            self._results.clear()
            return out

    def statistics(self) -> RuntimeStatistics:
        thread = self._thread
        if thread is not None and thread.is_alive():
            req = _StatsRequest()
            self._commands.put(req)
            if req.done.wait(_JOIN_TIMEOUT_S) and req.result is not None:
                return req.result
        return self._snapshot()

    # ----------------------------------------------------------------- engine-side checks

    def _stopped_locked(self) -> bool:
        return self._crash is not None or (self._closed and not self._live)

    def _submit(self, key: tuple[Side, str] | None, command: _Command) -> None:
        with self._lock:
            if self._crash is not None:
                raise RuntimeStopped(f"the push runtime stopped: {self._crash!r}") from self._crash
            if self._closed:
                raise ClosedError("this PushRuntime was closed")
            if not self._started:
                raise LocalProtocolError("call PushRuntime.start() first")
            if key is not None:
                if key in self._live:
                    raise LocalProtocolError(
                        f"transfer {key[1]!r} is already in flight on the {key[0]} side"
                    )
                self._live.add(key)
        self._commands.put(command)

    def _check_id(self, transfer_id: str) -> None:
        if not isinstance(transfer_id, str) or not transfer_id:
            raise LocalProtocolError(f"transfer id must be a non-empty str, got {transfer_id!r}")

    def _check_blocks(self, transfer_id: str, blocks: Sequence[int]) -> tuple[int, ...]:
        self._check_id(transfer_id)
        n = self._geometry.num_blocks
        out = tuple(blocks)
        bad = [b for b in out if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < n]
        if bad:
            raise LocalProtocolError(
                f"transfer {transfer_id!r}: block ids {bad[:8]} are outside the cache: "
                f"expected integers in 0..{n - 1}"
            )
        if len(set(out)) != len(out):
            raise LocalProtocolError(f"transfer {transfer_id!r}: block ids repeat: {list(out)}")
        return out

    def _check_layers(self, transfer_id: str, layers: Iterable[int]) -> tuple[int, ...]:
        out = tuple(layers)
        bad = [x for x in out if x not in self._layer_regions]
        if bad:
            raise LocalProtocolError(
                f"transfer {transfer_id!r}: layers {bad} are not in the cache: expected "
                f"some of {self._layers}"
            )
        return out

    # ----------------------------------------------------------------- background thread

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # becomes failed transfers, never just a log line
            log.exception("push runtime thread crashed")
            self._crashed(exc)
        finally:
            try:
                self._transport.close()
            except Exception:
                log.exception("closing the transport failed")

    def _loop(self) -> None:
        backoff = 0.0
        spin_until = 0.0
        take, poll = self._take_commands, self._transport.poll
        while True:
            if not self._in_flight():
                timeout = self._idle_poll_s
            elif spin_until and time.monotonic() < spin_until:
                # Just active: the next event is likely microseconds away. The shortest
                # wait, not none: a wait drops the GIL, so the engine's threads (woken
                # by a result) are not held off for the interpreter's 5 ms switch interval.
                timeout = _SPIN_WAIT_S
            else:
                timeout = backoff
            commands = take(timeout)
            busy = bool(commands)
            self._active = False
            for cmd in commands:
                if isinstance(cmd, _Stop):
                    self._shutdown()
                    return
                self._execute(cmd)
            events = poll()
            self._polls += 1
            if events:
                self._handle_events(events)
            self._unconfirmed.clear()
            now = self._clock()
            if now >= self._next_tick:
                self._next_tick = now + self._tick_interval_s
                self._apply(self._protocol.tick(now))
            if events or self._active:
                # Data-plane activity (events in, writes or messages out): poll at the
                # shortest interval for a moment, since NIXL progresses only when we poll
                # and the answer (WriteDone, the peer's next message) follows quickly.
                # Engine commands alone (statistics, a send waiting for its receiver) do
                # not spin, so an in-flight but quiet endpoint still backs off.
                spin_until = time.monotonic() + self._spin_s
                backoff = 0.0
            elif busy:
                backoff = 0.0
            else:
                backoff = min(max(backoff * 2, 50e-6), self._max_backoff_s)

    def _handle_events(self, events: list[TransportEvent]) -> None:
        now = self._clock()
        protocol = self._protocol
        for ev in events:
            match ev:
                case MessageReceived(peer=peer, payload=payload):
                    self._last_heard[peer] = now
                    try:
                        effects = protocol.receive_message(now, peer, payload)
                    except RemoteProtocolError as exc:
                        self._malformed += 1
                        effects = protocol.peer_misbehaved(now, peer, str(exc))
                case WriteDone(write_id=wid):
                    self._bytes_written += self._write_bytes.pop(wid, 0)
                    effects = protocol.sender.write_done(now, wid)
                case WriteFailed(write_id=wid, reason=reason, detail=detail):
                    self._write_bytes.pop(wid, None)
                    effects = protocol.sender.write_failed(now, wid, reason, detail)
                case PeerLost(peer=peer, reason=reason, detail=detail):
                    retry = [
                        cmd
                        for cmd in self._unconfirmed.pop(peer, [])
                        if protocol.receiver.withdraw(now, cmd.transfer_id)
                    ]
                    effects = protocol.peer_lost(now, peer, reason, detail)
                    if retry:
                        self._apply(effects)  # DropPeer: forget the cached metadata first
                        effects = []
                        self._retry_registers(peer, retry)
            if effects:
                self._apply(effects)

    def _take_commands(self, timeout: float) -> list[_Command]:
        out: list[_Command] = []
        try:
            if timeout > 0:
                out.append(self._commands.get(timeout=timeout))
            else:
                out.append(self._commands.get_nowait())
            while len(out) < 1024:
                out.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return out

    def _stale(self, now: float, entry: _PeerEntry) -> bool:
        """A peer not heard from lately may have restarted at the same address: look
        it up again (a new incarnation there ends what was in flight with the old one)."""
        heard = self._last_heard.get(entry.agent, entry.handshaken_at)
        return now - max(heard, entry.handshaken_at) > self._revalidate_after_s

    def _in_flight(self) -> bool:
        return bool(self._handshaking or self._write_bytes) or self._protocol.in_flight()

    def _execute(self, cmd: _Command) -> None:
        now = self._clock()
        match cmd:
            case _Send(transfer_id=tid, blocks=blocks, ready_layers=layers):
                self._guarded(
                    ("sender", tid),
                    blocks,
                    lambda: self._protocol.sender.submit(now, tid, blocks, layers),
                )
            case _LayersReady(transfer_id=tid, layers=layers):
                self._guarded(
                    ("sender", tid),
                    (),
                    lambda: self._protocol.sender.layers_ready(now, tid, layers),
                )
            case _Receive() | _Reject():
                entry = self._peers_by_address.get(cmd.sender)
                if entry is None or self._stale(now, entry):
                    self._handshake(cmd.sender, cmd)
                else:
                    self._on_handshaken(now, entry, cmd)
                    if isinstance(cmd, _Receive) and self._protocol.receiver.state_of(
                        cmd.transfer_id
                    ):
                        self._unconfirmed.setdefault(entry.agent, []).append(cmd)
            case _Abort(transfer_id=tid):
                if self._abort_handshaking(tid):
                    return
                self._apply(self._protocol.sender.abort(now, tid))
                self._apply(self._protocol.receiver.abort(now, tid))
            case _HandshakeResult():
                self._on_handshake_result(now, cmd)
            case _StatsRequest():
                cmd.result = self._snapshot()
                cmd.done.set()
            case _Stop():
                pass

    def _guarded(
        self, key: tuple[Side, str], blocks: tuple[int, ...], call: Callable[[], list[Effect]]
    ) -> None:
        """Misuse the engine could not see at its call becomes a failed transfer."""
        try:
            effects = call()
        except LocalProtocolError as exc:
            side, tid = key
            now = self._clock()
            machine = self._protocol.sender if side == "sender" else self._protocol.receiver
            if tid in machine.held_blocks():
                self._apply(machine.abort(now, tid, FailureReason.LOCAL_ERROR, str(exc)))
                return
            with self._lock:
                known = key in self._live
            if known and blocks:
                ended = TransferEnded(tid, side, FailureReason.LOCAL_ERROR, str(exc), blocks)
                self._apply([ended])
            elif known:
                self._report(TransferResult(tid, side, FailureReason.LOCAL_ERROR, str(exc), ()))
            return
        self._apply(effects)

    # ----------------------------------------------------------------- handshakes

    def _retry_registers(self, agent: str, withdrawn: list[_Receive]) -> None:
        """The data plane lost `agent` in the very pass that sent these first Registers
        to it from cached metadata: the agent was dead before they left (a sender
        restarted at that address within `revalidate_after_s`), so no byte of them can
        have been written. Handshake afresh and register once more; a second loss ends
        them as usual."""
        for cmd in withdrawn:
            self._register_retries += 1
            log.info(
                "transfer %s: %s was gone when its Register went out; handshaking %s:%s "
                "rank %s again",
                cmd.transfer_id,
                agent,
                cmd.sender.host,
                cmd.sender.port,
                cmd.sender.rank,
            )
            self._handshake(cmd.sender, dataclasses.replace(cmd, first_attempt=False))

    def _handshake(self, address: PeerAddress, waiter: _Receive | _Reject | Handshake) -> None:
        waiting = self._handshaking.get(address)
        if waiting is not None:
            waiting.append(waiter)
            return
        self._handshaking[address] = [waiter]
        self._handshake_jobs.put(address)

    def _handshake_loop(self) -> None:
        while True:
            address = self._handshake_jobs.get()
            if address is None:
                return
            try:
                meta = self._directory.lookup(address.host, address.port, address.rank)
            except BaseException as exc:
                self._commands.put(_HandshakeResult(address, None, exc))
            else:
                self._commands.put(_HandshakeResult(address, meta, None))

    def _on_handshake_result(self, now: float, result: _HandshakeResult) -> None:
        waiters = self._handshaking.pop(result.address, [])
        meta, error = result.metadata, result.error
        if meta is not None:
            try:
                if (
                    meta.engine_id == self._identity.engine_id
                    and meta.agent_name == self.agent_name
                ):
                    raise TransportError(FailureReason.LOCAL_ERROR, "that address is our own")
                if not self._transport.has_peer(meta.agent_name):
                    self._transport.add_peer(meta.agent_name, meta.agent_metadata, meta.geometry)
            except KVPushError as exc:
                error = exc
        if error is not None or meta is None:
            where = f"{result.address.host}:{result.address.port} rank {result.address.rank}"
            reason = _handshake_reason(error) if error is not None else FailureReason.LOCAL_ERROR
            detail = f"handshake with {where} failed: {error}"
            for w in waiters:
                match w:
                    case _Receive(transfer_id=tid, blocks=blocks):
                        self._report(TransferResult(tid, "receiver", reason, detail, blocks))
                    case Handshake(peer=agent):
                        self._apply(
                            self._protocol.sender.peer_unreachable(now, agent, reason, detail)
                        )
                    case _Reject():
                        pass  # nobody to tell; the sender's own deadline frees it
            return
        entry = _PeerEntry(meta.agent_name, meta.engine_id, now)
        self._peers_by_address[result.address] = entry
        for w in waiters:
            self._on_handshaken(now, entry, w)

    def _on_handshaken(
        self, now: float, entry: _PeerEntry, w: _Receive | _Reject | Handshake
    ) -> None:
        match w:
            case _Receive(transfer_id=tid, blocks=blocks, sender_offset=offset):
                first = w.first_attempt
                self._guarded(
                    ("receiver", tid),
                    blocks,
                    lambda: self._protocol.receiver.expect(
                        now,
                        tid,
                        entry.agent,
                        entry.engine_id,
                        blocks,
                        sender_offset=offset,
                        first_attempt=first,
                    ),
                )
            case _Reject(transfer_id=tid, detail=detail):
                self._apply(self._protocol.receiver.reject(now, tid, entry.agent, detail))
            case Handshake(peer=agent):
                if entry.agent == agent:
                    self._apply(self._protocol.sender.peer_ready(now, agent))
                else:
                    detail = (
                        f"the side channel at {w.host}:{w.port} now serves agent "
                        f"{entry.agent}, not {agent}: the receiver restarted"
                    )
                    self._apply(
                        self._protocol.sender.peer_unreachable(
                            now, agent, FailureReason.PEER_RESTARTED, detail
                        )
                    )

    def _abort_handshaking(self, tid: str) -> bool:
        for waiters in self._handshaking.values():
            for w in waiters:
                if isinstance(w, _Receive) and w.transfer_id == tid:
                    detail = "aborted by the receiving engine before the handshake finished"
                    # Once the handshake is done, tell the sender, so it frees at once.
                    waiters[waiters.index(w)] = _Reject(tid, w.sender, detail)
                    self._report(
                        TransferResult(tid, "receiver", FailureReason.CANCELLED, detail, w.blocks)
                    )
                    return True
        return False

    # ----------------------------------------------------------------- effects

    def _apply(self, effects: list[Effect]) -> None:
        now = self._clock()
        for eff in effects:
            match eff:
                case SendMessage(peer=peer, message=msg):
                    # Fire and forget: a lost message shows up as silence.
                    self._active = True
                    with contextlib.suppress(TransportError):
                        self._transport.send_message(peer, encode(msg))
                case WriteBlocks():
                    self._write(now, eff)
                case Handshake(peer=agent):
                    if self._transport.has_peer(agent):
                        self._apply(self._protocol.sender.peer_ready(now, agent))
                    else:
                        self._handshake(PeerAddress(eff.host, eff.port, eff.rank), eff)
                case DropPeer(peer=agent):
                    self._transport.remove_peer(agent)
                    self._last_heard.pop(agent, None)
                    for addr, entry in list(self._peers_by_address.items()):
                        if entry.agent == agent:
                            del self._peers_by_address[addr]
                case TransferEnded():
                    self._report(
                        TransferResult(
                            eff.transfer_id, eff.side, eff.reason, eff.detail, eff.blocks
                        )
                    )

    def _write(self, now: float, w: WriteBlocks) -> None:
        if w.layers is None:
            regions: list[int] | None = None
            nbytes = self._geometry.bytes_per_block * len(w.our_blocks)
        else:
            regions = [r for layer in w.layers for r in self._layer_regions.get(layer, [])]
            per_block = sum(self._geometry.regions[r].block_bytes for r in regions)
            nbytes = per_block * len(w.our_blocks)
        try:
            self._transport.write_blocks(
                w.peer,
                w.write_id,
                w.our_blocks,
                w.their_blocks,
                None if w.notification is None else encode(w.notification),
                regions,
            )
        except TransportError as exc:
            self._apply(self._protocol.sender.write_failed(now, w.write_id, exc.reason, exc.detail))
            return
        self._active = True
        self._write_bytes[w.write_id] = nbytes

    def _report(self, result: TransferResult) -> None:
        key = (result.side, result.transfer_id)
        with self._results_cv:
            if key not in self._live:
                self._duplicates += 1
                log.error("suppressed a second result for %s: %s", key, result)
                return
            self._live.discard(key)
            self._results.append(result)
            if result.reason is None:
                self._finished += 1
            else:
                self._failed += 1
                self._failures[result.reason.value] += 1
            self._results_cv.notify_all()

    # ----------------------------------------------------------------- ending

    def _shutdown(self) -> None:
        detail = "the push runtime was closed with the transfer in flight"
        self._fail_everything(FailureReason.SHUTDOWN, detail)

    def _crashed(self, exc: BaseException) -> None:
        with self._lock:
            self._crash = exc
        self._fail_everything(FailureReason.LOCAL_ERROR, f"push runtime thread crashed: {exc!r}")
        with self._results_cv:
            self._results_cv.notify_all()

    def _fail_everything(self, reason: FailureReason, detail: str) -> None:
        held = {("sender", t): b for t, b in self._protocol.sender.held_blocks().items()}
        held |= {("receiver", t): b for t, b in self._protocol.receiver.held_blocks().items()}
        for waiters in self._handshaking.values():
            for w in waiters:
                if isinstance(w, _Receive):
                    held[("receiver", w.transfer_id)] = w.blocks
        with self._lock:
            live = sorted(self._live)
        for side, tid in live:
            blocks = held.get((side, tid), ())
            self._report(TransferResult(tid, side, reason, detail, blocks))

    # ----------------------------------------------------------------- statistics

    def _snapshot(self) -> RuntimeStatistics:
        sending = collections.Counter(s.value for s in self._protocol.sender.states().values())
        receiving = collections.Counter(s.value for s in self._protocol.receiver.states().values())
        handshaking = sum(
            1 for ws in self._handshaking.values() for w in ws if isinstance(w, _Receive)
        )
        if handshaking:
            receiving["handshaking"] = handshaking
        with self._lock:
            return RuntimeStatistics(
                sending=dict(sending),
                receiving=dict(receiving),
                finished=self._finished,
                failed=self._failed,
                failures=dict(self._failures),
                bytes_written=self._bytes_written,
                blocks_held_sending=sum(
                    len(b) for b in self._protocol.sender.held_blocks().values()
                ),
                blocks_held_receiving=sum(
                    len(b) for b in self._protocol.receiver.held_blocks().values()
                ),
                results_queued=len(self._results),
                peers=len(self._peers_by_address),
                handshakes_in_flight=len(self._handshaking),
                malformed_messages=self._malformed,
                transport_polls=self._polls,
                duplicate_reports=self._duplicates,
                register_retries=self._register_retries,
            )
