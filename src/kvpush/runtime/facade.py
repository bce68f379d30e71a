"""`PushRuntime`: what the engine calls. Argument checks (every one at the call, by
`CallChecks`), the lock, the result queue (`ResultQueue`); everything else goes to the
`Driver` as a command, run by its thread or, in-step, by the calling thread in a pass of
its own (`Driver.drive`)."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial

from kvpush import __version__
from kvpush.errors import (
    ClosedError,
    ConfigError,
    LocalProtocolError,
    RuntimeStopped,
)
from kvpush.geometry import CacheGeometry, ScratchRegion
from kvpush.protocol import (
    LocalIdentity,
    PeerAddress,
    PushProtocol,
    ReceiverState,
    SenderState,
    Side,
)
from kvpush.protocol.auth import MessageAuth
from kvpush.roles import RUNTIME_ROLES
from kvpush.runtime.checks import CallChecks
from kvpush.runtime.commands import (
    Abort,
    Claim,
    Command,
    LayersReady,
    Receive,
    RefuseRegistration,
    RejectRequest,
    Send,
    SpokenRequest,
    StateRequest,
    StatsRequest,
)
from kvpush.runtime.directory import PeerDirectory
from kvpush.runtime.driver import Driver
from kvpush.runtime.outcomes import Sink
from kvpush.runtime.results import ResultQueue
from kvpush.runtime.services import RuntimeService, ServiceHost
from kvpush.runtime.values import (
    RuntimeIdentity,
    RuntimeSettings,
    RuntimeStatistics,
    TransferResult,
)
from kvpush.sidechannel import PeerMetadata
from kvpush.transports.base import Transport

__all__ = ["PushRuntime"]

_JOIN_TIMEOUT_S = 5.0


class PushRuntime:
    """One rank's push runtime. See `kvpush.runtime` for the engine API and contract."""

    def __init__(
        self,
        transport: Transport,
        geometry: CacheGeometry,
        identity: RuntimeIdentity,
        directory: PeerDirectory,
        settings: RuntimeSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        services: Sequence[RuntimeService] = (),
    ) -> None:
        """`settings`: how it runs (checked when they were built; a `RankSettings` is
        one); `clock`: the protocol's time; `services`: what tools run on this rank
        (`kvpush.runtime.services`), started with it."""
        if identity.role not in RUNTIME_ROLES:
            raise ConfigError(f"role {identity.role!r} is not one of {', '.join(RUNTIME_ROLES)}")
        settings = settings or RuntimeSettings()
        self._transport = transport
        self._geometry = geometry
        self._checks = CallChecks(geometry)
        self._identity = identity
        self._drive_in_step = settings.drive_in_step
        self._timing = settings.timing
        # Random per incarnation, published with our metadata: the data plane does not
        # authenticate agent names, so a message without it is dropped unread.
        self._message_key = secrets.token_bytes(16)
        protocol = PushProtocol(
            LocalIdentity(
                identity.engine_id,
                identity.incarnation,
                identity.host,
                identity.port,
                identity.rank,
            ),
            self._timing,
            max(1, geometry.num_layers),
            geometry.compat_fields(),
            compatibility=settings.compatibility,
            revalidate_after_s=settings.revalidate_after_s,
            message_key=self._message_key,
            # With a token, messages are authenticated per pair of ranks (never opt-in).
            auth=(
                MessageAuth(settings.token, transport.agent_name, identity.incarnation)
                if settings.token
                else None
            ),
        )
        self._services = tuple(services)
        self._directory = directory
        self._clock = clock
        self._scratch: ScratchRegion | None = None  # one a service offered
        # Engine-facing state, guarded by _lock: the results (`ResultQueue`), and the
        # flags below.
        self._lock = threading.Lock()
        self._queue = ResultQueue(self._lock)
        self._driver = Driver(
            transport,
            geometry,
            protocol,
            directory,
            Sink(self._queue.report, self._queue.counters, self._queue.fail_remaining),
            clock=clock,
            idle_poll_s=settings.idle_poll_s or self._timing.heartbeat_interval_s / 2,
            max_backoff_s=settings.max_backoff_s,
            spin_s=settings.spin_s,
            tick_interval_s=min(self._timing.heartbeat_interval_s / 4, 0.05),
            services=self._services,
        )
        self._started = False
        self._closed = False
        self._crash: BaseException | None = None
        self._local_metadata: PeerMetadata | None = None

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
        for service in self._services:
            service.start(self._service_host(service))
        self._local_metadata = PeerMetadata(
            engine_id=self._identity.engine_id,
            incarnation=self._identity.incarnation,
            rank=self._identity.rank,
            role=self._identity.role,
            agent_name=self._transport.agent_name,
            agent_metadata=self._transport.metadata(),
            geometry=self._geometry,
            kvpush_version=__version__,
            message_key=self._message_key,
            scratch=self._scratch,
        )
        self._driver.start(self._crashed)

    def close(self, timeout: float = _JOIN_TIMEOUT_S) -> None:
        """Stop. In-flight transfers end as SHUTDOWN (poll() still returns them).

        Senders wait for their writes in flight (up to half of `timeout`) and receivers
        for their senders' acknowledgements (briefly: a live sender answers within a
        round trip); then the transport is closed and what is left is reported (no
        write can read our blocks once it is closed).
        A receiver's transfer still fenced then may yet be written by a sender whose
        lease has not run out: an engine that keeps running should not reuse those
        blocks for `lease_s + 2 * liveness_timeout_s`. Threads are joined within
        `timeout`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._driver.stop(timeout)  # closes the transport too, started or not

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
        receiver: PeerAddress | None = None,
    ) -> None:
        """Offer our `blocks` for `transfer_id`. `ready_layers=None`: all computed; else
        only those layers are, and `layers_ready` announces the rest.

        `receiver`: the decode server the transfer is for, by its side channel's host and
        port (its rank is not compared: any rank that side channel serves). A Register
        for the id from any other receiver is refused, and the transfer waits for the
        named one. None: the first receiver the side channel admits that registers the
        id takes it (see `kvpush.protocol.state`, "Who sent it")."""
        ours = self._checks.blocks(transfer_id, blocks)
        layers = None if ready_layers is None else self._checks.layers(transfer_id, ready_layers)
        if receiver is not None:
            self._checks.address(receiver, "receiver")
        self._submit(("sender", transfer_id), Send(transfer_id, ours, layers, receiver))

    def layers_ready(self, transfer_id: str, layers: Iterable[int]) -> None:
        """Announce more computed `layers` of a transfer handed to `send`.

        Raises `LocalProtocolError` for a transfer this side is not sending: never sent,
        or ended with its result already taken by `poll()`/`wait()` (its blocks may have
        been reused since: computing into them was the engine's bug). While the result
        is still waiting in `poll()` the call is accepted and does nothing, as the
        engine could not know yet."""
        self._checks.transfer_id(transfer_id)
        ready = self._checks.layers(transfer_id, layers)
        with self._lock:
            known = self._queue.sending_locked(transfer_id)
        if not known:
            raise LocalProtocolError(
                f"layers_ready({transfer_id!r}): no such transfer is being sent: it was "
                "never passed to send(), or it ended and poll()/wait() returned its result"
            )
        self._submit(None, LayersReady(transfer_id, ready))

    def receive(
        self,
        transfer_id: str,
        sender: PeerAddress,
        blocks: Sequence[int],
        *,
        sender_offset: int = 0,
        sender_block_tokens: int | None = None,
    ) -> None:
        """Expect `transfer_id` from `sender` into `blocks`; `blocks[i]` receives the
        sender's block `sender_offset + i`. Empty `blocks`: a full prefix-cache hit.

        `sender_block_tokens`: the sender's block size, where ours is a whole multiple
        `k` of it (None: ours). `blocks` and `sender_offset` then count in its blocks:
        our block `b` is `b * k ... b * k + k - 1` (`kvpush.geometry.sub_block_ids`). The
        sender refuses the registration if its blocks are of another size."""
        ratio = self._checks.block_ratio(transfer_id, sender_block_tokens)
        ours = self._checks.blocks(transfer_id, blocks, ratio)
        self._checks.address(sender)
        self._checks.sender_offset(sender_offset)
        self._submit(
            ("receiver", transfer_id),
            Receive(transfer_id, sender, ours, sender_offset, sender_block_tokens),
        )

    def claim(self, transfer_id: str, sender: PeerAddress) -> None:
        """Receiver side: we hold `transfer_id`'s request, queued, and will `receive` or
        `reject` it once it has blocks. Until then our heartbeats to `sender` claim it, so
        a sender with a claim window (`TimingConfig.claim_window_s`) keeps it instead of
        giving it up as a receiver that died before registering. Nothing is reported for
        a claim; `receive`, `reject` or `abort` of the id ends it, and so does `close()`,
        which tells the sender with a Reject."""
        self._checks.transfer_id(transfer_id)
        self._checks.address(sender)
        self._submit(None, Claim(transfer_id, sender))

    def reject(self, transfer_id: str, sender: PeerAddress, detail: str = "") -> None:
        """Refuse `transfer_id` before allocating: the sender frees its blocks at once.

        Reported on this side too: `poll()` returns a result for it on the receiver
        side, reason REJECTED, its detail saying "rejected by this engine", no blocks;
        unless the id is in flight on the receiver side, whose own result stays its
        one record (the Reject is still sent)."""
        self._checks.transfer_id(transfer_id)
        self._checks.address(sender)
        key: tuple[Side, str] = ("receiver", transfer_id)
        with self._lock:
            in_flight = key in self._queue.live
        self._submit(None if in_flight else key, RejectRequest(transfer_id, sender, detail))

    def refuse(self, transfer_id: str, detail: str = "") -> None:
        """Sender side: refuse a receiver's registration of `transfer_id`, which this
        engine will never `send` (its request is not the one the receiver has): the
        receiver's transfer fails at once (REJECTED, with `detail`) instead of at its
        deadline. Ignored unless registered and not sent; nothing is reported here."""
        self._checks.transfer_id(transfer_id)
        self._submit(None, RefuseRegistration(transfer_id, detail[:1024]))

    def abort(self, transfer_id: str) -> None:
        """Cancel `transfer_id` (either side). Its result still comes from poll()."""
        self._checks.transfer_id(transfer_id)
        self._submit(None, Abort(transfer_id))

    def poll(self) -> list[TransferResult]:
        """Every transfer that ended since the last call; never blocks.

        It also drives the runtime one pass on the caller's thread (the data plane
        polled, what arrived handled) when no other thread is doing so: an engine that
        polls once per step gets what arrived by then without waiting for a hand-off
        to the runtime's thread. While the engine keeps polling (at least every 10 ms),
        the runtime's thread leaves the polling to it and wakes only for commands:
        inside a busy engine every wake-up of another thread waits for the GIL."""
        if self._can_drive():
            self._driver.drive(engine_poll=True)
        with self._lock:
            return self._queue.take_locked()

    def wait(self, timeout: float | None = None) -> list[TransferResult]:
        """Like poll(), but waits up to `timeout` seconds for at least one result.

        It drives one pass first, as poll() does, even with results already in (that
        pass is also what moves the data plane of the transfers still in flight); then
        it waits for the runtime's thread to report, without polling the data plane
        itself (why: docs/benchmarks.md, "Design notes moved from docstrings")."""
        if self._can_drive():
            self._driver.drive()
        with self._queue.changed:
            self._queue.changed.wait_for(
                lambda: self._queue.waiting_locked() or self._stopped_locked(), timeout
            )
            return self._queue.take_locked()

    def _can_drive(self) -> bool:
        return self._drive_in_step and self._started and not self._closed and self._crash is None

    def transfer_state(self, transfer_id: str, side: Side) -> SenderState | ReceiverState | None:
        """Where `transfer_id` stands on our `side` ("sender" or "receiver"): its
        `SenderState`/`ReceiverState` while in flight, None once it ended (its result is
        in, or was taken from, `poll()`) or if it was never handed in. Answered on the
        runtime's thread, like `statistics()`."""
        self._checks.transfer_id(transfer_id)
        if side not in ("sender", "receiver"):
            raise LocalProtocolError(f"side must be 'sender' or 'receiver', got {side!r}")
        with self._lock:
            if (side, transfer_id) not in self._queue.live:
                return None
        if self._driver.alive():
            req = StateRequest(transfer_id, side)
            self._driver.commands.put(req)
            if req.done.wait(_JOIN_TIMEOUT_S):
                return req.result
        return self._driver.state_of(transfer_id, side)

    def spoken_before_send(self, prefixes: Iterable[str], *, claimed: bool = False) -> list[str]:
        """Transfer ids starting with one of `prefixes` that a receiver registered for,
        or rejected, before we sent them: an engine that lets the receiver say how the
        transfer is split (its TP size, in the part ids of `kvpush.topology.part_id`)
        reads what it said here. With `claimed`, also those a receiver's heartbeats
        claim (`claim`: it holds the request queued) and we have not sent, which name
        the same parts. Answered on the runtime's thread; [] once it ended."""
        wanted = tuple(prefixes)
        if not wanted or not self._driver.alive():
            return []
        req = SpokenRequest(wanted, claimed)
        self._driver.commands.put(req)
        return req.result if req.done.wait(_JOIN_TIMEOUT_S) else []

    @property
    def failure(self) -> str | None:
        """None while the runtime can serve (or has not started yet); else why it cannot:
        its thread crashed (every transfer was reported LOCAL_ERROR) or it was closed.
        What a server's health check reports."""
        with self._lock:
            if self._crash is not None:
                return f"push runtime thread crashed: {self._crash!r}"
            if self._closed:
                return "push runtime closed"
            return None

    def statistics(self) -> RuntimeStatistics:
        if self._driver.alive():
            req = StatsRequest()
            self._driver.commands.put(req)
            if req.done.wait(_JOIN_TIMEOUT_S) and req.result is not None:
                return req.result
        return self._driver.snapshot()

    # ----------------------------------------------------------------- services

    def _service_host(self, service: RuntimeService) -> ServiceHost:
        driver = self._driver
        return ServiceHost(
            transport=self._transport,
            geometry=self._geometry,
            directory=self._directory,
            clock=self._clock,
            run=driver.run_for_service,
            write_id=partial(driver.service_write_id, service),
            lend_peer=driver.lend_peer,
            return_peer=driver.return_peer,
            offer_scratch=self._offer_scratch,
            failure=self._service_failure,
        )

    def _offer_scratch(self, region: ScratchRegion) -> None:
        if self._local_metadata is not None or self._scratch is not None:
            raise LocalProtocolError(
                "a scratch buffer is offered once per rank, by a service as the runtime starts"
            )
        self._transport.register_scratch(region)
        self._scratch = region

    def _service_failure(self) -> str | None:
        if not self._driver.alive() or self.failure is not None:
            return self.failure or "not started"
        return None

    # ----------------------------------------------------------------- submitting

    def _stopped_locked(self) -> bool:
        return self._crash is not None or (self._closed and not self._queue.live)

    def _submit(self, key: tuple[Side, str] | None, command: Command) -> None:
        with self._lock:
            if self._crash is not None:
                raise RuntimeStopped(f"the push runtime stopped: {self._crash!r}") from self._crash
            if self._closed:
                raise ClosedError("this PushRuntime was closed")
            if not self._started:
                raise LocalProtocolError("call PushRuntime.start() first")
            if key is not None:
                if key in self._queue.live:
                    raise LocalProtocolError(
                        f"transfer {key[1]!r} is already in flight on the {key[0]} side"
                    )
                self._queue.live.add(key)
        if self._drive_in_step:
            # Run on this thread now when no other thread is driving: no hand-off.
            self._driver.drive(command)
        else:
            self._driver.commands.put(command)

    # ----------------------------------------------------------------- the driver's thread

    def _crashed(self, exc: BaseException) -> None:
        with self._queue.changed:
            self._crash = exc
            self._queue.changed.notify_all()
