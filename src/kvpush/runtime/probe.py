"""`kvpush doctor`'s test writes, run by the driver beside the protocol's transfers.

A check (`Probes.submit`, then `start` on the driver) names a receiver by its
side-channel address and a seed. The driver looks the receiver up on a lookup pool of
its own; once its metadata is in, the peer is loaded on the transport (as the protocol
would load it) and our scratch buffer is filled with `scratch.pattern(seed)`. Then the
writes go out one at a time, small ones first (`scratch.PROBE_SIZES`, `PROBE_WRITES`
each), each timed from its post to its `WriteDone` on the driver's thread. A check ends
`ok` after the last write, `failed` at the first error or after `PROBE_TIMEOUT_S`, or
`refused` when another was running. Its report stays readable from any thread without
waiting for the driver (the side channel's thread reads it).

What keeps it apart from the cache: write ids below zero (the protocol's are positive),
a buffer that is never a KV block, and a receiver whose published buffer overlaps its
KV cache is refused before anything is written. One check runs at a time per rank, and
none starts while a write of an earlier one that timed out is still out: the bytes a
check can move are bounded.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpush.errors import KVPushError, TransportError
from kvpush.geometry import ScratchRegion
from kvpush.protocol import PeerAddress
from kvpush.runtime.scratch import PROBE_SIZES, PROBE_WRITES, ScratchBuffer, pattern
from kvpush.sidechannel import PeerMetadata
from kvpush.transports.base import Transport

__all__ = ["PROBE_TIMEOUT_S", "ProbeRefused", "ProbeReport", "Probes"]

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 10.0
_REPORTS_KEPT = 16


class ProbeRefused(KVPushError):
    """A check cannot start here; the message says why."""


@dataclass(frozen=True, slots=True)
class ProbeReport:
    """Where a check stands: "running", "ok", "failed" or "refused" (another check
    was running: nothing was written); `detail` says why for the last two."""

    probe_id: int
    state: str
    target: PeerAddress
    detail: str = ""
    peer_agent: str = ""
    their_device: str = ""
    writes: tuple[tuple[int, float], ...] = ()  # (bytes, seconds) of each write done
    transport: dict[str, str] = field(default_factory=dict)  # ours, as it describes itself

    def seconds(self, nbytes: int) -> float | None:
        """The median time of the writes of `nbytes`, or None if none completed."""
        times = [s for n, s in self.writes if n == nbytes]
        return statistics.median(times) if times else None

    def as_dict(self) -> dict[str, object]:
        """What the side channel answers (plain msgpack-able values)."""
        sizes: dict[str, object] = {}
        for n in PROBE_SIZES:
            s = self.seconds(n)
            if s is not None:
                sizes[str(n)] = {
                    "seconds": s,
                    "gb_per_s": n / s / 1e9 if s > 0 else None,
                    "writes": sum(1 for m, _ in self.writes if m == n),
                }
        return {
            "probe": self.probe_id,
            "state": self.state,
            "detail": self.detail,
            "peer_agent": self.peer_agent,
            "their_device": self.their_device,
            "sizes": sizes,
            "transport": dict(self.transport),
        }


@dataclass(slots=True)
class _Check:
    probe_id: int
    target: PeerAddress
    seed: bytes
    deadline: float
    peer_agent: str = ""
    their_device: str = ""
    loads: bool = False  # it asked for its peer to be loaded (`release` at its end)
    theirs: ScratchRegion | None = None  # the receiver's buffer, once looked up
    todo: list[int] = field(default_factory=list)  # sizes still to write
    writing: tuple[int, int, float] | None = None  # (write id, bytes, posted at)
    writes: list[tuple[int, float]] = field(default_factory=list)


class Probes:
    """The checks of one rank. Touched only by whichever thread drives the runtime,
    but for `submit` and `report`, which any thread may call.

    `lookup` asks for a receiver's metadata (its answer comes back as `on_lookup`);
    `load` puts a looked-up peer on the transport unless it is there (raising
    `KVPushError` if it cannot be); `release`, at the check's end, lets go of it unless
    someone else (the protocol) had it or took it meanwhile. Deadlines are on `clock`
    (the runtime's), the writes are timed on `timer`."""

    def __init__(
        self,
        transport: Transport,
        scratch: ScratchBuffer | None,
        *,
        lookup: Callable[[PeerAddress], None],
        load: Callable[[PeerMetadata], None],
        release: Callable[[str], None],
        clock: Callable[[], float],
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._transport = transport
        self._scratch = scratch
        self._lookup = lookup
        self._load = load
        self._release = release
        self._clock = clock
        self._timer = timer
        self._ids = itertools.count(1)
        self._write_ids = itertools.count(-1, -1)
        self._check: _Check | None = None
        self._stale: set[int] = set()  # writes of timed-out checks, still out
        # Reports are read from any thread (the side channel's), never waiting for the
        # driver: guarded by _lock, as is the id counter.
        self._lock = threading.Lock()
        self._reports: dict[int, ProbeReport] = {}

    @property
    def busy(self) -> bool:
        """A check is running: polls are paced for it. (A write of a check that timed
        out is not: its end is found at the idle polls, so that a write the data plane
        never ends does not keep the runtime polling at its busy rate.)"""
        return self._check is not None

    def submit(self, target: PeerAddress, seed: bytes) -> int:
        """Any thread: a new check's id, reported "running" until the driver takes it
        (`start`). Raises `ProbeRefused` on a rank without a scratch buffer."""
        if self._scratch is None:
            raise ProbeRefused(
                "this rank has no scratch buffer: its server was started without a token "
                "and without allowing doctor writes"
            )
        with self._lock:
            probe_id = next(self._ids)
        self._publish(_Check(probe_id, target, seed, float("inf")), "running")
        return probe_id

    def start(self, probe_id: int, target: PeerAddress, seed: bytes) -> None:
        """On the driver: run check `probe_id`, unless one is running or a write of one
        that timed out is still out (then it ends "refused", saying which)."""
        check = _Check(probe_id, target, seed, self._clock() + PROBE_TIMEOUT_S)
        if self._check is not None:
            self._publish(check, "refused", f"check {self._check.probe_id} is still running here")
            return
        if self._stale:
            self._publish(
                check,
                "refused",
                f"{len(self._stale)} write(s) of a check that timed out are still out on the "
                "data plane; no new check starts until they end",
            )
            return
        self._check = check
        self._lookup(target)

    def report(self, probe_id: int) -> ProbeReport | None:
        """Any thread: where check `probe_id` stands (the last few are kept)."""
        with self._lock:
            return self._reports.get(probe_id)

    # ------------------------------------------------------------------ its steps

    def on_lookup(self, target: PeerAddress, meta: PeerMetadata | None, error: object) -> None:
        check = self._check
        if check is None or check.target != target or check.theirs is not None:
            return
        if meta is None:
            self._end(check, f"the receiver's side channel could not be used: {error}")
            return
        check.peer_agent = meta.agent_name
        if meta.agent_name == self._transport.agent_name:
            self._end(check, "that address serves this rank itself")
            return
        theirs = meta.scratch
        if theirs is None:
            self._end(
                check,
                f"{meta.agent_name} publishes no scratch buffer: its server was started "
                "without a token and without allowing doctor writes, or runs a kvpush "
                "without them",
            )
            return
        overlap = theirs.overlapping_region(meta.geometry)
        if overlap is not None:
            self._end(
                check,
                f"{meta.agent_name}'s scratch buffer overlaps its KV region {overlap.name}: "
                "nothing was written",
            )
            return
        check.their_device = theirs.device
        check.loads = True
        try:
            self._load(meta)
        except KVPushError as exc:
            why = exc.detail if isinstance(exc, TransportError) else str(exc)
            self._end(check, f"our data plane could not load {meta.agent_name}: {why}")
            return
        assert self._scratch is not None  # start() refuses without one
        self._scratch.fill(pattern(check.seed, max(PROBE_SIZES)))
        check.theirs = theirs
        check.todo = [n for n in PROBE_SIZES for _ in range(PROBE_WRITES)]
        self._next_write(check)

    def write_ended(self, write_id: int, error: str | None) -> None:
        if write_id in self._stale:
            self._stale.discard(write_id)
            return
        check = self._check
        if check is None or check.writing is None or check.writing[0] != write_id:
            return
        _, nbytes, posted = check.writing
        check.writing = None
        if error is not None:
            self._end(check, f"write {len(check.writes) + 1} ({nbytes} bytes) failed: {error}")
            return
        check.writes.append((nbytes, self._timer() - posted))
        self._next_write(check)

    def tick(self) -> None:
        check = self._check
        if check is None or self._clock() < check.deadline:
            return
        if check.writing is not None:
            self._stale.add(check.writing[0])
            what = f"write {len(check.writes) + 1} ({check.writing[1]} bytes) did not complete"
        elif check.theirs is None:
            what = "the receiver's side channel did not answer"
        else:
            what = "the check did not finish"
        self._end(check, f"{what} within {PROBE_TIMEOUT_S:g} s")

    def _next_write(self, check: _Check) -> None:
        assert check.theirs is not None  # set before the first write
        if not check.todo:
            self._end(check, None)
            return
        nbytes = check.todo.pop(0)
        write_id = next(self._write_ids)
        check.writing = (write_id, nbytes, self._timer())
        try:
            self._transport.write_scratch(check.peer_agent, write_id, nbytes, check.theirs)
        except KVPushError as exc:
            check.writing = None
            self._end(check, f"write {len(check.writes) + 1} ({nbytes} bytes) not started: {exc}")

    def _end(self, check: _Check, error: str | None) -> None:
        self._check = None
        self._publish(check, "failed" if error else "ok", error or "")
        if check.loads:
            self._release(check.peer_agent)

    def _publish(self, check: _Check, state: str, detail: str = "") -> None:
        report = ProbeReport(
            check.probe_id,
            state,
            check.target,
            detail,
            check.peer_agent,
            check.their_device,
            tuple(check.writes),
            self._transport.description(),
        )
        with self._lock:
            self._reports[check.probe_id] = report
            while len(self._reports) > _REPORTS_KEPT:
                del self._reports[min(self._reports)]
