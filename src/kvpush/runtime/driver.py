"""The runtime's pass, and the thread that runs it. The transport and the protocol
machines are touched by one thread at a time: in a pass, under `Driver._drive` (on the
runtime's thread, or on an engine thread driving in-step); once stopping began (a `Stop`
ran, in-step passes are refused from then on), by the runtime's thread alone as it
drains and closes; after that thread ended, by a caller reading the final state.

A pass takes the queued commands, polls the transport once, feeds what arrived to the
protocol, ticks it, and carries out the effects it returns. The runtime's thread loops
over passes; an engine thread runs one in-step (`Driver.drive`) when no other thread
holds the lock, else it only queues its command. Every result is a `TransferEnded` built
by the protocol, handed to `Sink.report` with what a sending transfer's writes measured
(`WritesMeasured`, timed around each `write_blocks` call and each write's end as a poll
saw it); the driver builds none (what the protocol did not end when the thread stopped,
the facade ends with `kvpush.protocol.ended_unreported`).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpush.errors import (
    FailureReason,
    KVPushError,
    LocalProtocolError,
    RemoteProtocolError,
    TransportError,
)
from kvpush.geometry import BlockParts, CacheGeometry, WritePlan, write_plan, write_views
from kvpush.protocol import (
    DropPeer,
    Effect,
    Handshake,
    PeerAddress,
    PeerInfo,
    PushProtocol,
    ReceiverState,
    SenderState,
    SendMessage,
    Side,
    TransferEnded,
    WriteBlocks,
)
from kvpush.runtime.directory import LookupPool, PeerDirectory, handshake_reason
from kvpush.runtime.services import RuntimeService
from kvpush.runtime.values import RuntimeStatistics, WritesMeasured
from kvpush.sidechannel import PeerMetadata
from kvpush.topology import UnsupportedShape
from kvpush.transports.base import (
    MessageReceived,
    PeerLost,
    Transport,
    TransportEvent,
    WriteDone,
    WriteFailed,
)

log = logging.getLogger(__name__)

_SPIN_WAIT_S = 20e-6
# Linux rounds every timed wait of a thread up by its timer slack (50 us by default), and
# each write here costs about three alternating polls (receiver, sender, receiver), each
# after such a wait (figures: docs/benchmarks.md, "Third pass"). The runtime's thread
# asks for 5 us; it only waits that short right after activity.
_TIMER_SLACK_NS = 5_000
_PR_SET_TIMERSLACK = 29
# An engine that calls poll() drives the runtime itself, once per step: for this long
# after its last poll() the thread does not poll (it still takes commands at once), so
# that inside a busy engine it does not wait for the GIL, and take it, for nothing.
_STANDBY_AFTER_ENGINE_POLL_S = 0.01
# How long close() waits for senders to acknowledge our cancels: a live sender answers
# within a round trip (or once its own writes drained); a dead one never does, and its
# transfers are reported anyway once the transport is closed.
_CANCEL_ACK_WAIT_S = 0.25


def tighten_timer_slack() -> bool:
    """Set the calling thread's timer slack to `_TIMER_SLACK_NS` (Linux); False where the
    call is not available. Affects this thread only."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_TIMERSLACK, _TIMER_SLACK_NS, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


# --------------------------------------------------------------------------- commands


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
class _LookupResult:
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
    """Which ids under `prefixes` receivers registered for or rejected before we sent."""

    prefixes: tuple[str, ...]
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
    | _LookupResult
    | RunForService
    | StatsRequest
    | StateRequest
    | SpokenRequest
    | Wake
    | Stop
)


@dataclass(slots=True)
class _WriteTally:
    """One sending transfer's writes so far, for its `WritesMeasured`."""

    writes: int = 0
    descriptors: int = 0
    nbytes: int = 0
    post_s: float = 0.0
    busy_s: float = 0.0
    in_flight: int = 0
    busy_since: float = 0.0

    def posted(self, began: float, returned: float) -> None:
        """A write was handed to the data plane between `began` and `returned`."""
        self.writes += 1
        self.post_s += returned - began
        if not self.in_flight:
            self.busy_since = began
        self.in_flight += 1

    def ended(self, at: float, nbytes: int = 0, descriptors: int = 0) -> None:
        """One of its writes was seen to end at `at` (what it moved, if it completed)."""
        self.nbytes += nbytes
        self.descriptors += descriptors
        self.in_flight -= 1
        if not self.in_flight:
            self.busy_s += at - self.busy_since

    def measured(self) -> WritesMeasured:
        return WritesMeasured(self.writes, self.descriptors, self.nbytes, self.post_s, self.busy_s)


@dataclass(frozen=True, slots=True)
class Sink:
    """Where the driver's outcomes go (the facade's result queue and counters): each
    result with what its writes measured, if it wrote."""

    report: Callable[[TransferEnded, WritesMeasured | None], None]
    counters: Callable[[], dict[str, object]]  # the facade's part of a statistics snapshot
    # Last resort after the thread stopped: fail whatever the engine still waits for
    # (only if the protocol could not end it, its state broken by a crash).
    fail_remaining: Callable[[FailureReason, str], None]


# --------------------------------------------------------------------------- driver


class Driver:
    """The half of a `PushRuntime` that owns the transport and the protocol: its pass,
    its thread, its lookups. See `kvpush.runtime` for the contract."""

    def __init__(
        self,
        transport: Transport,
        geometry: CacheGeometry,
        protocol: PushProtocol,
        directory: PeerDirectory,
        sink: Sink,
        *,
        clock: Callable[[], float],
        idle_poll_s: float,
        max_backoff_s: float,
        spin_s: float,
        tick_interval_s: float,
        services: Sequence[RuntimeService] = (),
    ) -> None:
        self._transport = transport
        self._geometry = geometry
        self._protocol = protocol
        self._sink = sink
        self._clock = clock
        self._idle_poll_s = idle_poll_s
        self._max_backoff_s = max_backoff_s
        self._spin_s = spin_s
        self._tick_interval_s = tick_interval_s
        self._bytes_per_block = geometry.bytes_per_block
        self._layer_regions: dict[int, list[int]] = collections.defaultdict(list)
        for i, region in enumerate(geometry.regions):
            self._layer_regions[region.layer].append(i)
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._lookups_pool = LookupPool(
            directory,
            lambda a, m, e: self.commands.put(_LookupResult(a, m, e)),
            name=f"kvpush-handshake-{transport.agent_name}",
        )
        # The services the runtime was given (`kvpush.runtime.services`): driven in its
        # passes, their writes' ends routed back to them by write id.
        self._services = tuple(services)
        self._service_write_ids = itertools.count(-1, -1)
        self._service_writes: dict[int, RuntimeService] = {}
        self._lent_peers: set[str] = set()  # lent to a service, not (yet) the protocol's
        self._thread: threading.Thread | None = None
        # Held by whichever thread runs a pass (the driver's, or an engine thread that
        # drives in-step): the transport and the protocol below are touched under it only.
        self._drive = threading.Lock()
        self._finished = False  # set under _drive once the transport is closed
        self._in_step_crash: BaseException | None = None
        # Pacing, written by every pass and read (racily, harmlessly) to decide how long
        # to sleep: whether anything is in flight, and the spin/back-off schedule.
        self._busy = False
        self._spin_until = 0.0
        self._backoff = 0.0
        self._thread_sleeps_until = float("inf")
        self._engine_polled_at = float("-inf")  # the last poll() that drove a pass
        # Owned by whoever holds _drive.
        self._active = False  # set when the loop's pass wrote or sent something
        self._lookups: set[PeerAddress] = set()  # addresses being looked up
        self._infos: dict[str, PeerInfo] = {}  # agent -> what its handshake said
        # agent -> how our ids and its ids become the views' where block sizes differ
        self._id_maps: dict[str, tuple[BlockParts | None, BlockParts | None]] = {}
        # Transfers registered in this loop pass from a cached handshake: if the data
        # plane reports their sender gone in the same pass, the Register went nowhere.
        self._unconfirmed: list[str] = []
        self._register_retries = 0
        self._write_bytes: dict[int, int] = {}
        # Sending transfers' writes, measured (`WritesMeasured`): per transfer id, and
        # the tally of each write in flight (kept by the write, so that one ending after
        # its transfer did, the peer gone, counts into no later transfer of that id).
        self._tallies: dict[str, _WriteTally] = {}
        self._write_of: dict[int, _WriteTally] = {}
        self._bytes_written = 0
        self._malformed = 0
        self._polls = 0
        self._next_tick = float("-inf")
        self._drain_until: float | None = None  # set by Stop
        self._acks_until = 0.0  # set by Stop

    # ----------------------------------------------------------------- lifecycle

    def start(self, on_crash: Callable[[BaseException], None]) -> None:
        self._lookups_pool.start()
        self._thread = threading.Thread(
            target=self._run,
            args=(on_crash,),
            name=f"kvpush-runtime-{self._transport.agent_name}",
            daemon=True,
        )
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Drain (writes in flight for up to half of `timeout`, acknowledgements of our
        cancels for up to `_CANCEL_ACK_WAIT_S`), then close the transport and end what
        is left; join both threads."""
        start = time.monotonic()
        if self._thread is not None:
            self.commands.put(Stop(drain_until=start + timeout / 2))
            self._thread.join(timeout)
        else:  # start() failed before the thread ran: nobody else closes the transport
            self._transport.close()
        self._lookups_pool.close(max(0.0, timeout - (time.monotonic() - start)))
        for service in self._services:
            service.close(max(0.0, timeout - (time.monotonic() - start)))

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def thread_cpu_s(self) -> float | None:
        """CPU seconds the thread has used, read from any thread while it runs."""
        t = self._thread
        if t is None or t.ident is None or not t.is_alive():
            return None
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (AttributeError, OSError):  # no per-thread clocks here, or it just ended
            return None

    def _run(self, on_crash: Callable[[BaseException], None]) -> None:
        crash: BaseException | None = None
        try:
            tighten_timer_slack()
            self._loop()
        except BaseException as exc:  # becomes failed transfers, never just a log line
            log.exception("push runtime thread crashed")
            crash = exc
            on_crash(exc)
        finally:
            # Closed first: once the transport is closed no write can read or land in our
            # memory, so only then are the blocks of what is left handed back. Under
            # _drive, so that no engine thread is in a pass, and none starts one after.
            with self._drive:
                self._finished = True
                try:
                    self._transport.close()
                except Exception:
                    log.exception("closing the transport failed")
            if crash is None:
                reason, detail = (
                    FailureReason.SHUTDOWN,
                    "the push runtime was closed with the transfer in flight",
                )
            else:
                reason, detail = (
                    FailureReason.LOCAL_ERROR,
                    f"push runtime thread crashed: {crash!r}",
                )
            try:
                with self._drive:
                    self._end_everything(reason, detail)
            except Exception:
                log.exception("the protocol could not end its transfers")
            self._sink.fail_remaining(reason, detail)

    def _end_everything(self, reason: FailureReason, detail: str) -> None:
        for eff in self._protocol.shutdown(self._clock(), reason, detail):
            if isinstance(eff, TransferEnded):
                self._report(eff)

    # ----------------------------------------------------------------- the loop

    def _loop(self) -> None:
        take = self._take_commands
        while True:
            if self._in_step_crash is not None:
                raise self._in_step_crash  # an engine thread's pass failed: end as a crash
            if self._drain_until is not None and self._drained():
                return
            timeout = self.poll_delay()
            now = time.monotonic()
            standby = self._engine_polled_at + _STANDBY_AFTER_ENGINE_POLL_S - now
            # While the engine polls: wake for commands only, or once it stopped polling.
            timeout = max(timeout, standby)
            self._thread_sleeps_until = now + timeout
            commands = take(timeout)
            self._thread_sleeps_until = float("-inf")
            with self._drive:
                self._pass(commands)

    def poll_delay(self) -> float:
        """How long the next wait before a pass may be: the idle interval with nothing in
        flight; right after data-plane activity the shortest wait, for `spin_s`; else
        the back-off. Never zero while in flight: a wait drops the GIL, so the engine's
        threads (woken by a result) are not held off for the interpreter's 5 ms switch
        interval."""
        if not self._busy:
            return self._idle_poll_s
        if self._spin_until and time.monotonic() < self._spin_until:
            return _SPIN_WAIT_S
        return self._backoff

    def _pass(self, commands: list[Command]) -> None:
        """Commands, one poll of the transport, its events, the protocol's tick. Under
        `_drive`, on whichever thread drives."""
        self._active = False
        for cmd in commands:
            self._execute(cmd)
        events = self._transport.poll()
        self._polls += 1
        if events:
            self._handle_events(events)
        self._unconfirmed.clear()
        for service in self._services:
            if service.busy:
                service.tick()
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
            self._spin_until = time.monotonic() + self._spin_s
            self._backoff = 0.0
        elif commands:
            self._backoff = 0.0
        else:
            self._backoff = min(max(self._backoff * 2, 50e-6), self._max_backoff_s)
        self._busy = self._in_flight()

    # ----------------------------------------------------------------- in-step driving

    def drive(self, command: Command | None = None, *, engine_poll: bool = False) -> bool:
        """On an engine thread: run `command` now, after whatever was queued before it,
        and one pass (a poll of the transport), if no other thread is driving; else
        queue it for the driver's thread. True if it ran here.

        What this saves is a thread hand-off per call: inside a busy engine every
        wake-up of another thread waits for the GIL, up to the switch interval. A
        failure here ends the runtime as a crash of its thread would: the thread is
        woken to raise it. `engine_poll`: the engine's poll(), which it calls once per
        step; the thread stands by for a while after it (`_STANDBY_AFTER_ENGINE_POLL_S`)."""
        if self._thread is None or not self._drive.acquire(blocking=False):
            if command is not None:
                self.commands.put(command)
            return False
        try:
            if self._finished or self._in_step_crash is not None or self._drain_until:
                if command is not None:
                    self.commands.put(command)
                return False
            commands = self._take_commands(0.0)
            if command is not None:
                commands.append(command)
            try:
                self._pass(commands)
                if engine_poll:
                    self._engine_polled_at = time.monotonic()
            except BaseException as exc:
                self._in_step_crash = exc
                self.commands.put(Wake())
                return True
        finally:
            self._drive.release()
        # Work left in flight while the thread sleeps long (it slept with nothing in
        # flight): wake it, so that it paces the polls from now on (or, after an
        # engine's poll(), once the engine stops polling).
        if (
            self._busy
            and self._thread_sleeps_until
            > max(time.monotonic(), self._engine_polled_at + _STANDBY_AFTER_ENGINE_POLL_S)
            + self._max_backoff_s
        ):
            self.commands.put(Wake())
        return True

    def _drained(self) -> bool:
        """Stopping: nothing left that waiting could still settle, or out of time."""
        assert self._drain_until is not None
        now = time.monotonic()
        if now >= self._drain_until:
            return True
        if self._protocol.sender.writes_in_flight():
            return False
        if now >= self._acks_until:
            return True
        return ReceiverState.FENCING not in self._protocol.receiver.states().values()

    def _in_flight(self) -> bool:
        return (
            bool(self._lookups or self._write_bytes)
            or any(service.busy for service in self._services)
            or self._protocol.in_flight()
        )

    def _take_commands(self, timeout: float) -> list[Command]:
        # Two threads may take (this one waiting, an engine thread driving in-step), so
        # a queue seen non-empty can still be empty by the get. Looked at before each
        # get: an empty queue (most in-step passes) costs no raised exception.
        q = self.commands
        out: list[Command] = []
        try:
            if timeout > 0 and q.empty():
                out.append(q.get(timeout=timeout))
            while len(out) < 1024 and not q.empty():
                out.append(q.get_nowait())
        except queue.Empty:
            pass
        return out

    def _handle_events(self, events: list[TransportEvent]) -> None:
        now = self._clock()
        protocol = self._protocol
        for ev in events:
            match ev:
                case MessageReceived(peer=peer, payload=payload):
                    try:
                        effects = protocol.receive_message(now, peer, payload)
                    except RemoteProtocolError as exc:
                        self._malformed += 1
                        effects = protocol.peer_misbehaved(now, peer, str(exc))
                case WriteDone(write_id=wid) if wid < 0:  # a service's (`service_write_id`)
                    self._service_write_ended(wid, None)
                    continue
                case WriteFailed(write_id=wid, detail=detail) if wid < 0:
                    self._service_write_ended(wid, detail)
                    continue
                case WriteDone(write_id=wid):
                    self._bytes_written += self._write_bytes.pop(wid, 0)
                    self._write_ended(wid, ev.nbytes, ev.descriptors)
                    effects = protocol.sender.write_done(now, wid)
                case WriteFailed(write_id=wid, reason=reason, detail=detail):
                    self._write_bytes.pop(wid, None)
                    self._write_ended(wid)
                    effects = protocol.sender.write_failed(now, wid, reason, detail)
                case PeerLost(peer=peer, reason=reason, detail=detail):
                    retry: list[Effect] = []
                    for tid in self._unconfirmed:
                        again = protocol.receiver.withdraw(now, tid, peer)
                        if again is not None:
                            self._register_retries += 1
                            log.info(
                                "transfer %s: %s was gone when its Register went out; "
                                "looking its sender up again",
                                tid,
                                peer,
                            )
                            retry += again
                    # DropPeer first (forget the cached metadata), then the new lookup.
                    effects = protocol.peer_lost(now, peer, reason, detail) + retry
            if effects:
                self._apply(effects)

    # ----------------------------------------------------------------- commands

    def _execute(self, cmd: Command) -> None:
        now = self._clock()
        receiver, sender = self._protocol.receiver, self._protocol.sender
        match cmd:
            case Send(transfer_id=tid, blocks=blocks, ready_layers=layers, receiver=to):
                self._apply(sender.submit(now, tid, blocks, layers, receiver=to))
            case LayersReady(transfer_id=tid, layers=layers):
                try:
                    self._apply(sender.layers_ready(now, tid, layers))
                except LocalProtocolError:
                    # Never sent: nothing is in flight under that id, so nothing to end.
                    log.debug("layers_ready for %s, which was never sent", tid)
            case Receive(transfer_id=tid, sender=address, blocks=blocks, sender_offset=off):
                self._apply(
                    receiver.expect(
                        now,
                        tid,
                        address,
                        blocks,
                        sender_offset=off,
                        sender_block_tokens=cmd.sender_block_tokens,
                    )
                )
                if receiver.state_of(tid) is ReceiverState.WAITING:
                    self._unconfirmed.append(tid)  # registered from the cache just now
            case RejectRequest(transfer_id=tid, sender=address, detail=detail):
                self._apply(receiver.reject(now, tid, address, detail))
            case Abort(transfer_id=tid):
                self._apply(sender.abort(now, tid))
                self._apply(receiver.abort(now, tid))
            case Claim(transfer_id=tid, sender=address):
                self._apply(receiver.claim(now, tid, address))
            case RefuseRegistration(transfer_id=tid, detail=detail):
                self._apply(sender.refuse(now, tid, detail))
            case _LookupResult():
                self._on_lookup(now, cmd)
            case RunForService(call=call):
                call()
            case StatsRequest():
                cmd.result = self.snapshot()
                cmd.done.set()
            case StateRequest(transfer_id=tid, side=side):
                cmd.result = self.state_of(tid, side)
                cmd.done.set()
            case SpokenRequest(prefixes=prefixes):
                cmd.result = sender.spoken_before_submit(prefixes)
                cmd.done.set()
            case Wake():
                pass
            case Stop(drain_until=until):
                self._begin_stop(now, until)

    def _begin_stop(self, now: float, until: float) -> None:
        """close(): every transfer fails as SHUTDOWN the safe way (senders drain their
        writes, receivers cancel); what is still open at `until` ends once the transport
        is closed (`_run`)."""
        self._drain_until = until
        self._acks_until = min(until, time.monotonic() + _CANCEL_ACK_WAIT_S)
        detail = "the push runtime was closed with the transfer in flight"
        sender, receiver = self._protocol.sender, self._protocol.receiver
        for tid, state in list(sender.states().items()):
            if state is SenderState.REGISTERED:  # never sent: its receiver is told now
                self._apply(sender.refuse(now, tid, "the sender is shutting down"))
            else:
                self._apply(sender.abort(now, tid, FailureReason.SHUTDOWN, detail))
        for tid in list(receiver.states()):
            self._apply(receiver.abort(now, tid, FailureReason.SHUTDOWN, detail))
        # Requests we held queued: their senders hand their blocks back now.
        self._apply(receiver.release_claims(now, "the receiver is shutting down"))

    # ----------------------------------------------------------------- handshakes

    def _on_lookup(self, now: float, result: _LookupResult) -> None:
        address = result.address
        self._lookups.discard(address)
        meta, error = result.metadata, result.error
        if meta is None:
            reason = handshake_reason(error) if error is not None else FailureReason.LOCAL_ERROR
            self._apply(self._protocol.handshake_failed(now, address, reason, f"{error}"))
            return
        info = PeerInfo(
            meta.agent_name,
            meta.engine_id,
            meta.incarnation,
            meta.geometry.compat_fields(),
            meta.message_key,
        )
        ours = meta.agent_name == self._transport.agent_name
        compatible = self._protocol.incompatibility(info.compat) is None
        views = WritePlan(self._geometry, meta.geometry)
        if compatible and not ours:
            try:
                views = write_plan(self._geometry, meta.geometry)
            except UnsupportedShape as exc:
                reason = FailureReason.INCOMPATIBLE_PEER
                self._apply(self._protocol.handshake_failed(now, address, reason, str(exc)))
                return
        if not ours:
            # An incompatible peer is loaded for messages only: never written to, but
            # told at once why its transfers fail, so it frees its blocks now.
            try:
                if not self._transport.has_peer(meta.agent_name):
                    self._transport.add_peer(
                        meta.agent_name,
                        meta.agent_metadata,
                        views[1],
                        messages_only=not compatible,
                        ours=None if views[0] is self._geometry else views[0],
                    )
            except KVPushError as exc:
                if compatible:
                    reason = handshake_reason(exc)
                    self._apply(self._protocol.handshake_failed(now, address, reason, str(exc)))
                    return
                log.info("could not load incompatible peer %s to tell it: %s", address, exc)
            if compatible:
                self._infos[meta.agent_name] = info
                if views.our_ids is not None or views.their_ids is not None:
                    self._id_maps[meta.agent_name] = (views.our_ids, views.their_ids)
            self._lent_peers.discard(meta.agent_name)  # the protocol's from now on
        self._apply(self._protocol.handshake_done(now, address, info))

    # ----------------------------------------------------------------- services

    def run_for_service(self, call: Callable[[], None]) -> None:
        """Any thread: run `call` on the runtime's thread, at its next pass."""
        self.commands.put(RunForService(call))

    def service_write_id(self, service: RuntimeService) -> int:
        """A write id for `service` (below zero), whose end goes to its `write_ended`."""
        write_id = next(self._service_write_ids)
        self._service_writes[write_id] = service
        return write_id

    def _service_write_ended(self, write_id: int, error: str | None) -> None:
        service = self._service_writes.pop(write_id, None)
        if service is not None:
            service.write_ended(write_id, error)

    def lend_peer(self, meta: PeerMetadata) -> None:
        """Load a service's peer as `_on_lookup` would (for messages only if its cache is
        not ours), unless it is loaded already."""
        if self._transport.has_peer(meta.agent_name):
            return
        compat = meta.geometry.compat_fields()
        messages_only = self._protocol.incompatibility(compat) is not None
        views = (self._geometry, meta.geometry)
        if not messages_only:
            try:
                views = write_views(self._geometry, meta.geometry)
            except UnsupportedShape:
                messages_only = True  # the protocol never writes to it either
        self._transport.add_peer(
            meta.agent_name,
            meta.agent_metadata,
            views[1],
            messages_only=messages_only,
            ours=None if views[0] is self._geometry else views[0],
        )
        self._lent_peers.add(meta.agent_name)

    def return_peer(self, agent: str) -> None:
        """A service is done with a lent peer: forget it, unless the protocol took it since."""
        if agent in self._lent_peers:
            self._lent_peers.discard(agent)
            self._transport.remove_peer(agent)

    def _lookup(self, now: float, hs: Handshake) -> None:
        info = self._infos.get(hs.peer) if hs.peer is not None and not hs.revalidate else None
        if info is not None and self._transport.has_peer(info.agent):
            # The sender handshaking back to an agent our receiver side looked up
            # already, and just heard from: that lookup answers this one too.
            self._apply(self._protocol.handshake_done(now, hs.address, info))
        elif hs.address not in self._lookups:
            self._lookups.add(hs.address)
            self._lookups_pool.submit(hs.address)

    # ----------------------------------------------------------------- effects

    def _apply(self, effects: list[Effect]) -> None:
        if not effects:
            return
        now = self._clock()
        for eff in effects:
            match eff:
                case SendMessage(peer=peer, message=msg):
                    # Fire and forget: a lost message shows up as silence.
                    self._active = True
                    with contextlib.suppress(TransportError):
                        self._transport.send_message(peer, self._protocol.wire(peer, msg))
                case WriteBlocks():
                    self._write(now, eff)
                case Handshake():
                    self._lookup(now, eff)
                case DropPeer(peer=agent):
                    self._transport.remove_peer(agent)
                    self._infos.pop(agent, None)
                    self._id_maps.pop(agent, None)
                case TransferEnded():
                    self._report(eff)

    def _report(self, ended: TransferEnded) -> None:
        """Hand a result on, with what its writes measured (a sending one's)."""
        tally = self._tallies.pop(ended.transfer_id, None) if ended.side == "sender" else None
        self._sink.report(ended, None if tally is None else tally.measured())

    def _write_ended(self, write_id: int, nbytes: int = 0, descriptors: int = 0) -> None:
        tally = self._write_of.pop(write_id, None)
        if tally is not None:
            tally.ended(time.perf_counter(), nbytes, descriptors)

    def _write(self, now: float, w: WriteBlocks) -> None:
        if w.layers is None:
            regions: list[int] | None = None
            nbytes = self._bytes_per_block * len(w.our_blocks)
        else:
            regions = [r for layer in w.layers for r in self._layer_regions.get(layer, [])]
            per_block = sum(self._geometry.regions[r].block_bytes for r in regions)
            nbytes = per_block * len(w.our_blocks)
        our_blocks, their_blocks = w.our_blocks, w.their_blocks
        if (maps := self._id_maps.get(w.peer)) is not None:
            # Blocks of different sizes: each id is the runs of its part (`BlockParts`).
            ours, theirs = maps
            our_blocks = ours.view_ids(our_blocks) if ours is not None else our_blocks
            their_blocks = theirs.view_ids(their_blocks) if theirs is not None else their_blocks
        notification = (
            None if w.notification is None else self._protocol.wire(w.peer, w.notification)
        )
        began = time.perf_counter()
        try:
            self._transport.write_blocks(
                w.peer, w.write_id, our_blocks, their_blocks, notification, regions
            )
        except TransportError as exc:
            self._apply(self._protocol.sender.write_failed(now, w.write_id, exc.reason, exc.detail))
            return
        tally = self._tallies.get(w.transfer_id)
        if tally is None:
            tally = self._tallies[w.transfer_id] = _WriteTally()
        tally.posted(began, time.perf_counter())
        self._write_of[w.write_id] = tally
        self._active = True
        self._write_bytes[w.write_id] = nbytes

    # ----------------------------------------------------------------- statistics

    def state_of(self, transfer_id: str, side: Side) -> SenderState | ReceiverState | None:
        """Read in a pass (a `StateRequest`), or once the runtime's thread ended."""
        if side == "sender":
            return self._protocol.sender.state_of(transfer_id)
        return self._protocol.receiver.state_of(transfer_id)

    def snapshot(self) -> RuntimeStatistics:
        """Read in a pass (a `StatsRequest`), or once the runtime's thread ended."""
        sender, receiver = self._protocol.sender, self._protocol.receiver
        sending_ids = {t: s.value for t, s in sender.states().items()}
        receiving_ids = {t: s.value for t, s in receiver.states().items()}
        sending = collections.Counter(sending_ids.values())
        receiving = collections.Counter(receiving_ids.values())
        counters = self._sink.counters()
        now = self._clock()
        clocks = {
            agent: {
                "round_trip_s": c.round_trip_s,
                "skew_lb_s": c.skew_lb_s,
                "age_s": max(0.0, now - c.measured_at),
            }
            for agent, c in sender.clock_bounds().items()
        }
        began = [*sender.began().values(), *receiver.began().values()]
        return RuntimeStatistics(
            sending=dict(sending),
            receiving=dict(receiving),
            bytes_written=self._bytes_written,
            blocks_held_sending=sum(len(b) for b in sender.held_blocks().values()),
            blocks_held_receiving=sum(len(b) for b in receiver.held_blocks().values()),
            peers=receiver.known_peers(),
            handshakes_in_flight=len(self._lookups),
            malformed_messages=self._malformed,
            transport_polls=self._polls,
            register_retries=self._register_retries,
            writes_in_flight=sender.writes_in_flight(),
            stale_registers=sender.stale_registers,
            wrong_receivers=sender.wrong_receivers,
            forged_messages=self._protocol.forged_messages(),
            clock_bounds=clocks,
            thread_cpu_s=self.thread_cpu_s(),
            oldest_in_flight_s=max(0.0, now - min(began)) if began else None,
            sending_transfers=sending_ids,
            receiving_transfers=receiving_ids,
            claimed=len(receiver.claimed()),
            **counters,  # type: ignore[arg-type]
        )
