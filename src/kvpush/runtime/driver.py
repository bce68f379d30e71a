"""The thread that runs the runtime's passes, and who may run one. The transport and the
protocol machines are touched by one thread at a time: in a pass, under `Driver._drive`
(on the runtime's thread, or on an engine thread driving in-step); once stopping began
(a `Stop` ran, in-step passes are refused from then on), by the runtime's thread alone
as it drains and closes; after that thread ended, by a caller reading the final state.

The runtime is split along what each part owns:

* `Driver` (here): the runtime's thread and the lookups' threads (it starts and joins
  both), the command queue, the lock, and in-step driving (`Driver.drive`): an engine
  thread runs one pass when no other thread holds the lock, else it only queues.
* `Dispatcher` (`kvpush.runtime.dispatch`): what a pass does. It takes the queued
  commands (`kvpush.runtime.commands`), polls the transport once, feeds what arrived to
  the protocol, ticks it, and carries out the effects it returns; it owns no thread.
* `Pacer` (`kvpush.runtime.pacing`): how long the thread waits before its next pass.
* `Peers` (`kvpush.runtime.peers`): lookups and the peers they load, answering with
  the protocol's effects.
* `Sink` and `WriteLedger` (`kvpush.runtime.outcomes`): every result is a
  `TransferEnded` built by the protocol, handed to `Sink.report` with what a sending
  transfer's writes measured; none of these builds one (what the protocol did not end
  when the thread stopped, the facade ends with `kvpush.protocol.ended_unreported`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvpush.errors import FailureReason
from kvpush.geometry import CacheGeometry
from kvpush.protocol import PushProtocol, ReceiverState, SenderState, Side
from kvpush.runtime.commands import Command, CommandQueue, RunForService, Stop, Wake
from kvpush.runtime.directory import PeerDirectory
from kvpush.runtime.dispatch import Dispatcher
from kvpush.runtime.outcomes import Sink
from kvpush.runtime.pacing import Pacer, tighten_timer_slack
from kvpush.runtime.peers import Peers
from kvpush.runtime.services import RuntimeService
from kvpush.runtime.values import RuntimeStatistics
from kvpush.sidechannel import PeerMetadata
from kvpush.transports.base import Transport

__all__ = ["Driver"]

log = logging.getLogger(__name__)


class Driver:
    """The half of a `PushRuntime` that owns the transport and the protocol: who runs
    their passes (`Dispatcher`), on which thread, and when; the threads it starts and
    joins. See `kvpush.runtime` for the contract."""

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
        self.commands = CommandQueue()
        # Its lookups' threads are ours to start and join; their results come back as
        # commands, for a later pass.
        self._peers = Peers(transport, geometry, protocol, directory, self.commands.put)
        # The services the runtime was given (`kvpush.runtime.services`): driven in its
        # passes, closed once the thread ended.
        self._services = tuple(services)
        self._thread: threading.Thread | None = None
        # Held by whichever thread runs a pass (the driver's, or an engine thread that
        # drives in-step): the transport and the protocol are touched under it only.
        self._drive = threading.Lock()
        self._finished = False  # set under _drive once the transport is closed
        self._in_step_crash: BaseException | None = None
        self._pacer = Pacer(idle_poll_s=idle_poll_s, max_backoff_s=max_backoff_s, spin_s=spin_s)
        self._dispatch = Dispatcher(
            transport,
            geometry,
            protocol,
            self._peers,
            sink,
            clock=clock,
            tick_interval_s=tick_interval_s,
            services=self._services,
            thread_cpu_s=self.thread_cpu_s,
        )
        self._sink = sink

    # ----------------------------------------------------------------- lifecycle

    def start(self, on_crash: Callable[[BaseException], None]) -> None:
        self._peers.start()
        self._thread = threading.Thread(
            target=self._run,
            args=(on_crash,),
            name=f"kvpush-runtime-{self._transport.agent_name}",
            daemon=True,
        )
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Drain (writes in flight for up to half of `timeout`, acknowledgements of our
        cancels briefly: `Dispatcher._begin_stop`), then close the transport and end what
        is left; join both threads."""
        start = time.monotonic()
        if self._thread is not None:
            self.commands.put(Stop(drain_until=start + timeout / 2))
            self._thread.join(timeout)
        else:  # start() failed before the thread ran: nobody else closes the transport
            self._transport.close()
        self._peers.close(max(0.0, timeout - (time.monotonic() - start)))
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
                    self._dispatch.end_everything(reason, detail)
            except Exception:
                log.exception("the protocol could not end its transfers")
            self._sink.fail_remaining(reason, detail)

    # ----------------------------------------------------------------- the loop

    def _loop(self) -> None:
        take = self.commands.take
        while True:
            if self._in_step_crash is not None:
                raise self._in_step_crash  # an engine thread's pass failed: end as a crash
            if self._dispatch.stopping and self._dispatch.drained():
                return
            commands = take(self._pacer.thread_waits())
            self._pacer.thread_woke()
            with self._drive:
                self._pass(commands)

    def _pass(self, commands: list[Command]) -> None:
        """One pass (`Dispatcher.run`), then the pace of the next. Under `_drive`, on
        whichever thread drives."""
        activity = self._dispatch.run(commands)
        self._pacer.passed(
            activity=activity, commands=bool(commands), busy=self._dispatch.in_flight()
        )

    # ----------------------------------------------------------------- in-step driving

    def drive(self, command: Command | None = None, *, engine_poll: bool = False) -> bool:
        """On an engine thread: run `command` now, after whatever was queued before it,
        and one pass (a poll of the transport), if no other thread is driving; else
        queue it for the driver's thread. True if it ran here.

        What this saves is a thread hand-off per call: inside a busy engine every
        wake-up of another thread waits for the GIL, up to the switch interval. A
        failure here ends the runtime as a crash of its thread would: the thread is
        woken to raise it. `engine_poll`: the engine's poll(), which it calls once per
        step; the thread stands by for a while after it (`Pacer.engine_polled`)."""
        if self._thread is None or not self._drive.acquire(blocking=False):
            if command is not None:
                self.commands.put(command)
            return False
        try:
            if self._finished or self._in_step_crash is not None or self._dispatch.stopping:
                if command is not None:
                    self.commands.put(command)
                return False
            commands = self.commands.take()
            if command is not None:
                commands.append(command)
            try:
                self._pass(commands)
                if engine_poll:
                    self._pacer.engine_polled()
            except BaseException as exc:
                self._in_step_crash = exc
                self.commands.put(Wake())
                return True
        finally:
            self._drive.release()
        if self._pacer.thread_should_wake():
            self.commands.put(Wake())
        return True

    # ----------------------------------------------------------------- services

    def run_for_service(self, call: Callable[[], None]) -> None:
        """Any thread: run `call` on the runtime's thread, at its next pass."""
        self.commands.put(RunForService(call))

    def service_write_id(self, service: RuntimeService) -> int:
        """A write id for `service` (below zero), whose end goes to its `write_ended`."""
        return self._dispatch.service_write_id(service)

    def lend_peer(self, meta: PeerMetadata) -> None:
        """Load a service's peer as a handshake would, unless it is loaded (`Peers.lend`)."""
        self._peers.lend(meta)

    def return_peer(self, agent: str) -> None:
        """A service is done with a lent peer (`Peers.give_back`)."""
        self._peers.give_back(agent)

    # ----------------------------------------------------------------- statistics

    def state_of(self, transfer_id: str, side: Side) -> SenderState | ReceiverState | None:
        """Read in a pass (a `StateRequest`), or once the runtime's thread ended."""
        return self._dispatch.state_of(transfer_id, side)

    def snapshot(self) -> RuntimeStatistics:
        """Read in a pass (a `StatsRequest`), or once the runtime's thread ended."""
        return self._dispatch.snapshot()
