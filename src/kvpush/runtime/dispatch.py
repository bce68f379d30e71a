"""What one pass of the runtime does (`Dispatcher`): commands and transport events go
into the protocol machines, the effects they return go out onto the transport (writes,
messages, lookups through `Peers`), and every `TransferEnded` goes to the `Sink` with
what its writes measured. It owns no thread and takes no lock: the `Driver` decides
which thread runs a pass, and when, and runs it under its lock; everything here is
touched only by that thread (or, once the runtime's thread ended, by a caller reading
the final state).

Stopping is a state of the pass too: a `Stop` command ends every transfer the safe way
(`_begin_stop`), and `drained` says when waiting can settle nothing more.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence

from kvpush.errors import (
    FailureReason,
    LocalProtocolError,
    RemoteProtocolError,
    TransportError,
)
from kvpush.geometry import CacheGeometry
from kvpush.protocol import (
    DropPeer,
    Effect,
    Handshake,
    PushProtocol,
    ReceiverState,
    SenderState,
    SendMessage,
    Side,
    TransferEnded,
    WriteBlocks,
)
from kvpush.runtime.commands import (
    Abort,
    Claim,
    Command,
    LayersReady,
    LookupResult,
    Receive,
    RefuseRegistration,
    RejectRequest,
    RunForService,
    Send,
    SpokenRequest,
    StateRequest,
    StatsRequest,
    Stop,
    Wake,
)
from kvpush.runtime.outcomes import Sink, WriteLedger
from kvpush.runtime.peers import Peers
from kvpush.runtime.services import RuntimeService
from kvpush.runtime.values import RuntimeStatistics
from kvpush.transports.base import (
    MessageReceived,
    PeerLost,
    Transport,
    TransportEvent,
    WriteDone,
    WriteFailed,
)

__all__ = ["Dispatcher"]

log = logging.getLogger(__name__)

# How long close() waits for senders to acknowledge our cancels: a live sender answers
# within a round trip (or once its own writes drained); a dead one never does, and its
# transfers are reported anyway once the transport is closed.
_CANCEL_ACK_WAIT_S = 0.25


class Dispatcher:
    """One runtime's pass: the protocol, the transport it drives, the lookups and the
    services' writes, and the counters a statistics snapshot reads."""

    def __init__(
        self,
        transport: Transport,
        geometry: CacheGeometry,
        protocol: PushProtocol,
        peers: Peers,
        sink: Sink,
        *,
        clock: Callable[[], float],
        tick_interval_s: float,
        services: Sequence[RuntimeService],
        thread_cpu_s: Callable[[], float | None],
    ) -> None:
        """`peers`: the driver's (it starts and joins their lookups' threads);
        `thread_cpu_s`: read for a statistics snapshot."""
        self._transport = transport
        self._geometry = geometry
        self._protocol = protocol
        self._sink = sink
        self._clock = clock
        self._tick_interval_s = tick_interval_s
        self._thread_cpu_s = thread_cpu_s
        self._bytes_per_block = geometry.bytes_per_block
        self._layer_regions: dict[int, list[int]] = collections.defaultdict(list)
        for i, region in enumerate(geometry.regions):
            self._layer_regions[region.layer].append(i)
        self._peers = peers
        # The services the runtime was given (`kvpush.runtime.services`): driven in its
        # passes, their writes' ends routed back to them by write id.
        self._services = tuple(services)
        self._service_write_ids = itertools.count(-1, -1)
        self._service_writes: dict[int, RuntimeService] = {}
        self._active = False  # set when the pass wrote or sent something
        # Transfers registered in this pass from a cached handshake: if the data plane
        # reports their sender gone in the same pass, the Register went nowhere.
        self._unconfirmed: list[str] = []
        self._register_retries = 0
        self._writes = WriteLedger()  # the protocol's writes, measured (`WritesMeasured`)
        self._malformed = 0
        self._polls = 0
        self._next_tick = float("-inf")
        self._drain_until: float | None = None  # set by Stop
        self._acks_until = 0.0  # set by Stop

    def run(self, commands: list[Command]) -> bool:
        """Commands, one poll of the transport, its events, the protocol's tick. True if
        the data plane was active (events in, writes or messages out)."""
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
        return bool(events) or self._active

    @property
    def stopping(self) -> bool:
        """A `Stop` ran: no engine thread drives a pass from now on."""
        return self._drain_until is not None

    def drained(self) -> bool:
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

    def in_flight(self) -> bool:
        """Anything a later pass must poll for: lookups, writes, services, transfers."""
        return (
            bool(self._peers.lookups_in_flight or self._writes.in_flight)
            or any(service.busy for service in self._services)
            or self._protocol.in_flight()
        )

    def end_everything(self, reason: FailureReason, detail: str) -> None:
        """The thread ended and the transport is closed: the protocol ends what is left."""
        for eff in self._protocol.shutdown(self._clock(), reason, detail):
            if isinstance(eff, TransferEnded):
                self._report(eff)

    # ----------------------------------------------------------------- events

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
                    self._writes.done(wid, ev.nbytes, ev.descriptors)
                    effects = protocol.sender.write_done(now, wid)
                case WriteFailed(write_id=wid, reason=reason, detail=detail):
                    self._writes.failed(wid)
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
            case LookupResult():
                self._apply(self._peers.looked_up(now, cmd))
            case RunForService(call=call):
                call()
            case StatsRequest():
                cmd.result = self.snapshot()
                cmd.done.set()
            case StateRequest(transfer_id=tid, side=side):
                cmd.result = self.state_of(tid, side)
                cmd.done.set()
            case SpokenRequest(prefixes=prefixes, claimed=claimed):
                cmd.result = sender.spoken_before_submit(prefixes)
                if claimed:
                    cmd.result += sender.claimed_before_submit(prefixes)
                cmd.done.set()
            case Wake():
                pass
            case Stop(drain_until=until):
                self._begin_stop(now, until)

    def _begin_stop(self, now: float, until: float) -> None:
        """close(): every transfer fails as SHUTDOWN the safe way (senders drain their
        writes, receivers cancel); what is still open at `until` ends once the transport
        is closed (`Driver._run`)."""
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

    # ----------------------------------------------------------------- services

    def service_write_id(self, service: RuntimeService) -> int:
        """A write id for `service` (below zero), whose end goes to its `write_ended`."""
        write_id = next(self._service_write_ids)
        self._service_writes[write_id] = service
        return write_id

    def _service_write_ended(self, write_id: int, error: str | None) -> None:
        service = self._service_writes.pop(write_id, None)
        if service is not None:
            service.write_ended(write_id, error)

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
                    self._apply(self._peers.lookup(now, eff))
                case DropPeer(peer=agent):
                    self._peers.drop(agent)
                case TransferEnded():
                    self._report(eff)

    def _report(self, ended: TransferEnded) -> None:
        """Hand a result on, with what its writes measured (a sending one's)."""
        measured = self._writes.measured(ended.transfer_id) if ended.side == "sender" else None
        self._sink.report(ended, measured)

    def _write(self, now: float, w: WriteBlocks) -> None:
        if w.layers is None:
            regions: list[int] | None = None
            nbytes = self._bytes_per_block * len(w.our_blocks)
        else:
            regions = [r for layer in w.layers for r in self._layer_regions.get(layer, [])]
            per_block = sum(self._geometry.regions[r].block_bytes for r in regions)
            nbytes = per_block * len(w.our_blocks)
        our_blocks, their_blocks = w.our_blocks, w.their_blocks
        if (maps := self._peers.id_map(w.peer)) is not None:
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
        self._writes.posted(w.transfer_id, w.write_id, nbytes, began, time.perf_counter())
        self._active = True

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
            bytes_written=self._writes.bytes_written,
            blocks_held_sending=sum(len(b) for b in sender.held_blocks().values()),
            blocks_held_receiving=sum(len(b) for b in receiver.held_blocks().values()),
            peers=receiver.known_peers(),
            handshakes_in_flight=self._peers.lookups_in_flight,
            malformed_messages=self._malformed,
            transport_polls=self._polls,
            register_retries=self._register_retries,
            writes_in_flight=sender.writes_in_flight(),
            stale_registers=sender.stale_registers,
            wrong_receivers=sender.wrong_receivers,
            forged_messages=self._protocol.forged_messages(),
            clock_bounds=clocks,
            thread_cpu_s=self._thread_cpu_s(),
            oldest_in_flight_s=max(0.0, now - min(began)) if began else None,
            sending_transfers=sending_ids,
            receiving_transfers=receiving_ids,
            claimed=len(receiver.claimed()),
            **counters,  # type: ignore[arg-type]
        )
