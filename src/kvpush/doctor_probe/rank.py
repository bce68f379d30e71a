"""`kvpush doctor`'s test writes on one rank: a `RuntimeService` its runtime drives.

A check (`RankProbe.start_probe`) names a receiver by its side-channel address and a
seed. The probe looks the receiver up on a lookup pool of its own (so that a check never
waits behind, or holds up, a transfer's handshake to the same address); once its
metadata is in, the runtime lends it the peer (loaded as the protocol would load it) and
our scratch buffer is filled with `scratch.pattern(seed)`. Then the writes go out one at
a time, small ones first (`scratch.PROBE_SIZES`, `PROBE_WRITES` each), each timed from
its post to its end on the runtime's thread. A check ends `ok` after the last write,
`failed` at the first error or after `PROBE_TIMEOUT_S`, or `refused` when another was
running. Its report stays readable from any thread without waiting for the runtime (the
side channel's thread reads it).

What keeps it apart from the cache: write ids from the runtime's service range (below
zero; the protocol's are positive), a buffer that is never a KV block, and a receiver
whose published buffer overlaps its KV cache is refused before anything is written. One
check runs at a time per rank, and none starts while a write of an earlier one that timed
out is still out: the bytes a check can move are bounded.
"""

from __future__ import annotations

import functools
import itertools
import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpush.doctor_probe.scratch import PROBE_SIZES, PROBE_WRITES, ScratchBuffer, pattern
from kvpush.errors import KVPushError, LocalProtocolError, TransportError
from kvpush.geometry import ScratchRegion
from kvpush.runtime import PeerAddress
from kvpush.runtime.directory import LookupPool
from kvpush.runtime.services import RuntimeService, ServiceHost
from kvpush.sidechannel import PeerMetadata

__all__ = ["PROBE_TIMEOUT_S", "ProbeRefused", "ProbeReport", "RankProbe"]

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
    loads: bool = False  # it was lent its peer (`return_peer` at its end)
    theirs: ScratchRegion | None = None  # the receiver's buffer, once looked up
    todo: list[int] = field(default_factory=list)  # sizes still to write
    writing: tuple[int, int, float] | None = None  # (write id, bytes, posted at)
    writes: list[tuple[int, float]] = field(default_factory=list)


class RankProbe(RuntimeService):
    """The checks of one rank. `scratch`: the rank owns a scratch buffer that checks
    write from and into (else it refuses them, naming why). Its steps run on the
    runtime's thread; `start_probe`, `probe_report` and `scratch_digest` may be called
    from any thread. The writes are timed on `timer`, deadlines are on the runtime's
    clock."""

    def __init__(self, scratch: bool, *, timer: Callable[[], float] = time.perf_counter) -> None:
        self._wants_scratch = scratch
        self._timer = timer
        self._host: ServiceHost | None = None
        self._scratch: ScratchBuffer | None = None
        self._lookups: LookupPool | None = None
        self._check: _Check | None = None
        self._stale: set[int] = set()  # writes of timed-out checks, still out
        # Reports are read from any thread (the side channel's), never waiting for the
        # runtime: guarded by _lock, as is the id counter.
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._reports: dict[int, ProbeReport] = {}

    # ------------------------------------------------------------------ the service

    def start(self, host: ServiceHost) -> None:
        self._host = host
        if self._wants_scratch:
            # On the cache's device: the check crosses the data plane the KV does.
            regions = host.geometry.regions
            self._scratch = ScratchBuffer(regions[0].device if regions else "cpu")
            host.offer_scratch(self._scratch.region)
        self._lookups = LookupPool(
            host.directory,
            lambda a, m, e: host.run(functools.partial(self._on_lookup, a, m, e)),
            name=f"kvpush-doctor-{host.transport.agent_name}",
            max_workers=2,
        )
        self._lookups.start()

    def close(self, timeout: float) -> None:
        if self._lookups is not None:
            self._lookups.close(timeout)

    @property
    def busy(self) -> bool:
        """A check is running: polls are paced for it. (A write of a check that timed
        out is not: its end is found at the idle polls, so that a write the data plane
        never ends does not keep the runtime polling at its busy rate.)"""
        return self._check is not None

    # ------------------------------------------------------------------ any thread

    def start_probe(self, target: PeerAddress, seed: bytes) -> int:
        """Start a check: test writes from our scratch buffer into `target`'s. Returns
        its id at once, for `probe_report`, reported "running" until it ends; the check
        runs on the runtime's thread. Raises `ProbeRefused` (why) when this rank cannot
        run one (no scratch buffer, a bad seed, the runtime not running)."""
        if not isinstance(target, PeerAddress):
            raise LocalProtocolError(
                f"target must be a kvpush.runtime.PeerAddress(host, port, rank), got {target!r}"
            )
        if not isinstance(seed, bytes) or not 8 <= len(seed) <= 64:
            raise ProbeRefused(f"a check's seed must be 8 to 64 bytes, got {seed!r:.80}")
        host = self._host
        failure = "not started" if host is None else host.failure()
        if host is None or failure is not None:
            raise ProbeRefused(f"the runtime is not running: {failure}")
        if self._scratch is None:
            raise ProbeRefused(
                "this rank has no scratch buffer: its server was started without a token "
                "and without allowing doctor writes"
            )
        with self._lock:
            probe_id = next(self._ids)
        self._publish(_Check(probe_id, target, seed, float("inf")), "running")
        # To the runtime's thread, never the caller's: loading the peer may wait on the
        # network, and the caller is a side channel that serves others.
        host.run(functools.partial(self._start, probe_id, target, seed))
        return probe_id

    def probe_report(self, probe_id: int) -> ProbeReport | None:
        """Where check `probe_id` stands; None for an id this rank does not know (any
        more: the last few are kept). Never waits for the runtime's thread."""
        with self._lock:
            return self._reports.get(probe_id)

    def scratch_digest(self, nbytes: int) -> str:
        """The SHA-256 of our scratch buffer's first `nbytes` bytes, as they are now."""
        if self._scratch is None:
            raise ProbeRefused("this rank has no scratch buffer")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise ProbeRefused(f"expected a byte count, got {nbytes!r}")
        if not 0 < nbytes <= self._scratch.region.nbytes:
            raise ProbeRefused(f"expected 1 to {self._scratch.region.nbytes} bytes, got {nbytes}")
        return self._scratch.digest(nbytes)

    # ------------------------------------------------------------------ its steps

    def _start(self, probe_id: int, target: PeerAddress, seed: bytes) -> None:
        """Run check `probe_id`, unless one is running or a write of one that timed out
        is still out (then it ends "refused", saying which)."""
        assert self._host is not None and self._lookups is not None  # start_probe checked
        check = _Check(probe_id, target, seed, self._host.clock() + PROBE_TIMEOUT_S)
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
        self._lookups.submit(target)

    def _on_lookup(self, target: PeerAddress, meta: PeerMetadata | None, error: object) -> None:
        check, host = self._check, self._host
        if check is None or check.target != target or check.theirs is not None:
            return
        assert host is not None
        if meta is None:
            self._end(check, f"the receiver's side channel could not be used: {error}")
            return
        check.peer_agent = meta.agent_name
        if meta.agent_name == host.transport.agent_name:
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
            host.lend_peer(meta)
        except KVPushError as exc:
            why = exc.detail if isinstance(exc, TransportError) else str(exc)
            self._end(check, f"our data plane could not load {meta.agent_name}: {why}")
            return
        assert self._scratch is not None  # start_probe refuses without one
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
        if check is None or self._host is None or self._host.clock() < check.deadline:
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
        assert check.theirs is not None and self._host is not None  # set before the first
        if not check.todo:
            self._end(check, None)
            return
        nbytes = check.todo.pop(0)
        write_id = self._host.write_id()
        check.writing = (write_id, nbytes, self._timer())
        try:
            self._host.transport.write_scratch(check.peer_agent, write_id, nbytes, check.theirs)
        except KVPushError as exc:
            check.writing = None
            self._end(check, f"write {len(check.writes) + 1} ({nbytes} bytes) not started: {exc}")

    def _end(self, check: _Check, error: str | None) -> None:
        self._check = None
        self._publish(check, "failed" if error else "ok", error or "")
        if check.loads and self._host is not None:
            self._host.return_peer(check.peer_agent)

    def _publish(self, check: _Check, state: str, detail: str = "") -> None:
        host = self._host
        report = ProbeReport(
            check.probe_id,
            state,
            check.target,
            detail,
            check.peer_agent,
            check.their_device,
            tuple(check.writes),
            host.transport.description() if host is not None else {},
        )
        with self._lock:
            self._reports[check.probe_id] = report
            while len(self._reports) > _REPORTS_KEPT:
                del self._reports[min(self._reports)]
