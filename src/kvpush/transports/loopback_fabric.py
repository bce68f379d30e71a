"""The loopback "network": every `LoopbackTransport` of a process, known by agent name,
and the messages between them, with faults on demand. How it behaves is told in
`kvpush.transports.loopback`'s theory of operation; the faults it injects are kept and
chosen by a `FaultPlan` (`loopback_faults`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable

from kvpush.errors import FailureReason, LocalProtocolError, TransportError
from kvpush.geometry import CacheGeometry, ScratchRegion
from kvpush.transports.base import MessageReceived, PeerLost, TransportEvent
from kvpush.transports.loopback_faults import Fault, FaultPlan, WriteFault


@dataclasses.dataclass(slots=True)
class _Envelope:
    src: str
    payload: bytes
    due: float | None  # None: deliverable now; inf: held until released


@dataclasses.dataclass(slots=True)
class EndpointState:
    """What the fabric knows of one endpoint; its transport reads it at the handshake."""

    name: str
    incarnation: str
    geometry: CacheGeometry | None = None
    scratch: ScratchRegion | None = None
    alive: bool = True
    inbox: deque[_Envelope] = dataclasses.field(default_factory=deque)
    # Events the fabric queues for this endpoint (PeerLost on announced kills).
    fabric_events: list[TransportEvent] = dataclasses.field(default_factory=list)
    added_peers: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(frozen=True, slots=True)
class FabricStatistics:
    messages_sent: int
    messages_delivered: int
    messages_dropped: int
    messages_duplicated: int
    messages_held: int
    writes_done: int
    writes_failed: int
    bytes_written: int


class LoopbackFabric:
    """The in-process network joining `LoopbackTransport`s. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._endpoints: dict[str, EndpointState] = {}
        self._faults: FaultPlan[_Envelope] = FaultPlan()
        self._sent = self._delivered = self._dropped = self._duplicated = 0
        self._writes_done = self._writes_failed = self._bytes_written = 0

    # ----------------------------------------------------------------- fault injection
    def inject(
        self,
        src: str,
        dst: str,
        fault: Fault,
        count: int = 1,
        *,
        match: Callable[[bytes], bool] | None = None,
        delay_s: float = float("inf"),
    ) -> None:
        """Apply `fault` to the next `count` messages from `src` to `dst` that `match`.

        Write notifications are messages too. `delay_s` is for DELAY: how long (by the
        fabric's clock) the message is held; the default holds it until `release_delayed`.
        """
        with self._lock:
            self._faults.add_message_fault(src, dst, fault, count, match, delay_s)

    def drop(self, src: str, dst: str, count: int = 1) -> None:
        self.inject(src, dst, Fault.DROP, count)

    def duplicate(self, src: str, dst: str, count: int = 1) -> None:
        self.inject(src, dst, Fault.DUPLICATE, count)

    def delay(self, src: str, dst: str, delay_s: float = float("inf"), count: int = 1) -> None:
        self.inject(src, dst, Fault.DELAY, count, delay_s=delay_s)

    def reorder(self, src: str, dst: str, count: int = 1) -> None:
        self.inject(src, dst, Fault.REORDER, count)

    def fail_writes(
        self,
        src: str,
        dst: str,
        count: int = 1,
        partial: bool = True,
        reason: FailureReason = FailureReason.WRITE_ERROR,
    ) -> None:
        """Make the next `count` writes from `src` to `dst` fail (after copying about half
        of their blocks when `partial`); their notifications are never sent."""
        with self._lock:
            self._faults.add_write_fault(src, dst, count, partial, reason)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def kill(self, name: str, announce: bool = False) -> None:
        """The endpoint vanishes as under `kill -9`: its queued writes and messages never
        leave, its inbox is lost, writes to it fail with PEER_GONE."""
        with self._lock:
            ep = self._endpoint(name)
            ep.alive = False
            ep.inbox.clear()
            if announce:
                for other in self._endpoints.values():
                    if other.alive and name in other.added_peers:
                        other.fabric_events.append(
                            PeerLost(name, FailureReason.PEER_GONE, f"{name} was killed")
                        )

    def partition(self, a: str, b: str) -> None:
        """Cut `a` and `b` apart both ways: messages are lost, writes fail with PEER_GONE."""
        with self._lock:
            self._faults.cut(a, b)

    def heal(self, a: str, b: str) -> None:
        with self._lock:
            self._faults.heal(a, b)

    def release_delayed(self, src: str | None = None, dst: str | None = None) -> int:
        """Make every held message (DELAY or REORDER) on matching links deliverable now,
        in the order it was sent. Returns how many were released."""
        released = 0
        with self._lock:
            for ep in self._endpoints.values():
                if dst is not None and ep.name != dst:
                    continue
                for env in ep.inbox:
                    if env.due is not None and (src is None or env.src == src):
                        env.due = None
                        released += 1
            for (_, d), held in self._faults.release_reordered(src, dst):
                target = self._endpoints.get(d)
                for env in held:
                    if target is not None and target.alive:
                        target.inbox.append(env)
                        released += 1
        return released

    def statistics(self) -> FabricStatistics:
        with self._lock:
            held = self._faults.held_count() + sum(
                1 for ep in self._endpoints.values() for env in ep.inbox if env.due is not None
            )
            return FabricStatistics(
                messages_sent=self._sent,
                messages_delivered=self._delivered,
                messages_dropped=self._dropped,
                messages_duplicated=self._duplicated,
                messages_held=held,
                writes_done=self._writes_done,
                writes_failed=self._writes_failed,
                bytes_written=self._bytes_written,
            )

    def endpoints(self) -> list[str]:
        """Names of the endpoints that are alive."""
        with self._lock:
            return [ep.name for ep in self._endpoints.values() if ep.alive]

    # ------------------------------------------------------------ used by the endpoints
    def _endpoint(self, name: str) -> EndpointState:
        try:
            return self._endpoints[name]
        except KeyError:
            raise TransportError(
                FailureReason.UNKNOWN_PEER, f"no loopback endpoint named {name!r}"
            ) from None

    def _attach(self, name: str) -> EndpointState:
        with self._lock:
            if name in self._endpoints:
                raise LocalProtocolError(
                    f"loopback endpoint name {name!r} is already taken: agent names are "
                    "unique per process incarnation, never reused"
                )
            ep = EndpointState(name=name, incarnation=uuid.uuid4().hex)
            self._endpoints[name] = ep
            return ep

    def _detach(self, name: str) -> None:
        with self._lock:
            ep = self._endpoints.get(name)
            if ep is not None:
                ep.alive = False
                ep.inbox.clear()

    def _set_geometry(self, name: str, geometry: CacheGeometry) -> None:
        with self._lock:
            self._endpoint(name).geometry = geometry

    def _set_scratch(self, name: str, scratch: ScratchRegion) -> None:
        with self._lock:
            self._endpoint(name).scratch = scratch

    def _lookup_for_handshake(self, name: str) -> EndpointState | None:
        with self._lock:
            ep = self._endpoints.get(name)
            return ep if ep is not None and ep.alive else None

    def _note_added(self, name: str, peer: str, added: bool) -> None:
        with self._lock:
            ep = self._endpoints.get(name)
            if ep is not None:
                if added:
                    ep.added_peers.add(peer)
                else:
                    ep.added_peers.discard(peer)

    def _reachable(self, src: str, dst: str, incarnation: str) -> str | None:
        """None if a write from `src` may land in `dst` now, else why not. Caller holds lock."""
        ep = self._endpoints.get(dst)
        if ep is None or not ep.alive or ep.incarnation != incarnation:
            return f"peer {dst} is gone"
        if self._faults.is_cut(src, dst):
            return f"{src} and {dst} are partitioned"
        return None

    def _alive(self, name: str) -> bool:
        with self._lock:
            ep = self._endpoints.get(name)
            return ep is not None and ep.alive

    def _begin_write(
        self, src: str, dst: str, incarnation: str
    ) -> tuple[str | None, WriteFault | None]:
        with self._lock:
            src_ep = self._endpoints.get(src)
            if src_ep is None or not src_ep.alive:
                return "sender is dead", None
            why = self._reachable(src, dst, incarnation)
            if why is not None:
                return why, None
            return None, self._faults.write_fault((src, dst))

    def _finish_write(
        self, src: str, dst: str, incarnation: str, nbytes: int, notification: bytes | None
    ) -> str | None:
        """Account for a copied write and send its notification, atomically with the check
        that the peer is still there (so a notification never reaches a new incarnation)."""
        with self._lock:
            why = self._reachable(src, dst, incarnation)
            if why is not None:
                self._writes_failed += 1
                return why
            self._writes_done += 1
            self._bytes_written += nbytes
            if notification is not None:
                self._send_locked(src, dst, notification)
            return None

    def _count_failed_write(self) -> None:
        with self._lock:
            self._writes_failed += 1

    def _send(self, src: str, dst: str, incarnation: str, payload: bytes) -> str | None:
        """Send a message to the `incarnation` of `dst` we added. Returns why not, when
        that process is gone (killed, closed or restarted): the sender's data plane sees
        the closed connection, as UCX does. A partition loses the message silently."""
        with self._lock:
            src_ep = self._endpoints.get(src)
            target = self._endpoints.get(dst)
            cut = self._faults.is_cut(src, dst)
            if (
                not cut
                and src_ep is not None
                and src_ep.alive
                and (target is None or not target.alive or target.incarnation != incarnation)
            ):
                self._sent += 1
                self._dropped += 1
                return f"peer {dst} is gone"
            self._send_locked(src, dst, payload)
            return None

    def _send_locked(self, src: str, dst: str, payload: bytes) -> None:
        self._sent += 1
        src_ep = self._endpoints.get(src)
        target = self._endpoints.get(dst)
        if (
            src_ep is None
            or not src_ep.alive
            or target is None
            or not target.alive
            or self._faults.is_cut(src, dst)
        ):
            self._dropped += 1
            return
        link = (src, dst)
        fault = self._faults.message_fault(link, payload)
        kind = fault.fault if fault is not None else None
        if kind is Fault.DROP:
            self._dropped += 1
            return
        if kind is Fault.REORDER:
            self._faults.hold_for_reorder(link, _Envelope(src, payload, None))
            return
        if kind is Fault.DELAY:
            assert fault is not None
            due = self._clock() + fault.delay_s
            target.inbox.append(_Envelope(src, payload, due))
            return
        target.inbox.append(_Envelope(src, payload, None))
        if kind is Fault.DUPLICATE:
            self._duplicated += 1
            target.inbox.append(_Envelope(src, payload, None))
        # A message held for reordering goes right after the next one on its link.
        target.inbox.extend(self._faults.after_delivery(link))

    def _receive(self, name: str) -> list[TransportEvent]:
        with self._lock:
            ep = self._endpoints.get(name)
            if ep is None or not ep.alive:
                return []
            events: list[TransportEvent] = list(ep.fabric_events)
            ep.fabric_events.clear()
            now = self._clock()
            kept: deque[_Envelope] = deque()
            for env in ep.inbox:
                if env.due is None or env.due <= now:
                    events.append(MessageReceived(env.src, env.payload))
                    self._delivered += 1
                else:
                    kept.append(env)
            ep.inbox = kept
            return events
