"""The NIXL data plane: one NIXL agent (UCX backend) per endpoint.

Theory of operation.

- One agent, driven by one thread at a time (the runtime's lock). NIXL's listener is
  off (metadata travels over kvpush's side channel: `metadata()` is
  `get_agent_metadata()`, `add_peer` is `add_remote_agent`). By default NIXL's
  progress thread is off too, and all progress happens when the owner calls `poll()`:
  checking transfer states and fetching notifications is what drives UCX. An idle
  endpoint therefore costs nothing, but a peer that writes to us only progresses as
  fast as both sides poll. On one host UCX runs over TCP (its shared-memory transports
  cannot detect a dead peer), so a WRITE completes only after a round trip with the
  peer's worker, and its notification goes out only then: three alternating polls,
  receiver, sender, receiver, per write (measured: `scripts/nixl-flush-ack`).
- `progress_thread_wait_ms=N` turns NIXL's UCX progress thread on, waiting in poll()
  on UCX's event fd with an N ms timeout (NIXL's Python API would make that wait 0, a
  spin of a whole core: `_nixl_import.NixlModule.make_agent`). The data plane then
  moves on its own and `poll()` only collects what happened: inside a busy engine
  (GIL-bound polls) a 1-block transfer's latency fell ~3x; but large transfers cost
  2-4x the sender CPU per GB (UCX's worker lock shared by two threads; measured on 2
  cores, docs/benchmarks.md), so it is off by default.
- Memory is registered once per region (the span of its blocks). At registration we
  prepare our local descriptor list, one descriptor per (region, block), index
  `region * num_blocks + block`; at `add_peer` the same for the peer's regions. A write
  selects indices from both prepared lists (`make_prepped_xfer`): nothing is rebuilt per
  write, and no byte of the KV cache is copied on the way. NIXL merges descriptors that
  are contiguous on both sides (measured: a 256 MiB Llama-3.1-8B-shaped write of 8192
  per-block descriptors goes out as 64, one per region, and runs ~1.4x faster than
  unmerged), so runs of consecutive blocks cost one descriptor each.
- Completion rides on the WRITE as its NIXL notification, so the peer sees it only after
  the data. Control messages are standalone notifications (`send_notif`).
- NIXL errors are translated here, once: a remote disconnect is PEER_GONE, any other
  failure of a posted write is WRITE_ERROR, a metadata that cannot be loaded is
  HANDSHAKE_FAILED. NIXL sends no notification for a failed WRITE; the runtime tells the
  peer itself.

Beside this module: `nixl_memory` prepares what is prepared once (our registered memory,
each peer's descriptor lists), `nixl_registry.Registry` holds what was registered with the
agent and loaded into it until it is released, `nixl_calls.WriteCalls` binds NIXL's
per-write calls once per agent, and `nixl_ledger.Ledger` keeps what was posted and what
became of it (writes in flight, the events owed to `poll()`, the counts of `statistics()`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpush.errors import ClosedError, FailureReason, LocalProtocolError, TransportError
from kvpush.geometry import CacheGeometry, ScratchRegion
from kvpush.transports._checks import check_region_fits, validate_scratch_write, validate_write
from kvpush.transports._nixl_import import NixlModule, load_nixl
from kvpush.transports.base import (
    MessageReceived,
    PeerLost,
    Transport,
    TransportEvent,
)
from kvpush.transports.nixl_calls import WriteCalls, release_quietly
from kvpush.transports.nixl_ledger import Ledger, NixlStatistics
from kvpush.transports.nixl_memory import NixlPeer, merged_descriptor_count, scratch_memory_type
from kvpush.transports.nixl_registry import Registry


class NixlTransport(Transport):
    """One NIXL agent with the UCX backend. See the module docstring."""

    def __init__(
        self,
        name: str,
        *,
        backend: str = "UCX",
        merge_descriptors: bool = True,
        num_threads: int = 0,
        progress_thread_wait_ms: int = 0,
    ) -> None:
        if not name:
            raise ValueError("a NIXL endpoint needs a non-empty agent name")
        if progress_thread_wait_ms < 0:
            raise ValueError(
                f"progress_thread_wait_ms must be >= 0 (0: no progress thread), "
                f"got {progress_thread_wait_ms}"
            )
        self._progress_wait_ms = progress_thread_wait_ms
        self._name = name
        self._backend = backend
        self._merge = merge_descriptors
        self._num_threads = num_threads
        self._nixl: NixlModule | None = None
        self._calls: WriteCalls | None = None
        self._agent: Any = None
        self._closed = False
        self._registry = Registry(name, backend)
        self._writes = Ledger()

    # ----------------------------------------------------------------- lifecycle
    @property
    def agent_name(self) -> str:
        return self._name

    def start(self) -> None:
        if self._closed:
            raise ClosedError(f"NIXL endpoint {self._name} was closed")
        if self._agent is not None:
            return
        nixl = load_nixl()
        config = nixl.nixl_agent_config(
            enable_prog_thread=self._progress_wait_ms > 0,
            enable_listen_thread=False,
            backends=[self._backend],
            num_threads=self._num_threads,
        )
        try:
            agent = nixl.make_agent(self._name, config, self._progress_wait_ms * 1000)
        except Exception as exc:
            raise TransportError(
                FailureReason.LOCAL_ERROR, f"cannot create NIXL agent {self._name}: {exc!r}"
            ) from exc
        if self._backend not in agent.backends:
            raise TransportError(
                FailureReason.LOCAL_ERROR,
                f"NIXL backend {self._backend} is not available here (have "
                f"{sorted(agent.backends)}; plugins {agent.plugin_list})",
            )
        self._nixl = nixl
        self._agent = agent
        self._calls = WriteCalls(nixl, agent, self._backend, self._merge)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        agent, self._agent = self._agent, None
        self._calls = None  # holds the agent too: `del agent` below must be the last one
        if agent is None:
            return
        self._writes.release_in_flight()
        self._registry.release(agent)
        self._writes.events.clear()
        del agent  # the last reference: NIXL tears the agent down here

    def _live_agent(self) -> Any:
        if self._closed:
            raise ClosedError(f"NIXL endpoint {self._name} was closed")
        if self._agent is None:
            raise LocalProtocolError(f"NIXL endpoint {self._name}: call start() first")
        return self._agent

    # ---------------------------------------------------------------- memory, peers
    def register_memory(self, geometry: CacheGeometry) -> None:
        self._registry.register_memory(self._live_agent(), geometry)

    def register_scratch(self, scratch: ScratchRegion) -> None:
        self._registry.register_scratch(self._live_agent(), scratch)

    def metadata(self) -> bytes:
        agent = self._live_agent()
        self._registry.registered_local("metadata()")
        return bytes(agent.get_agent_metadata())

    def add_peer(
        self,
        peer: str,
        metadata: bytes,
        geometry: CacheGeometry,
        *,
        messages_only: bool = False,
        ours: CacheGeometry | None = None,
    ) -> None:
        agent = self._live_agent()
        local = self._registry.registered_local("add_peer()")
        if not messages_only:
            check_region_fits(local.geometry if ours is None else ours, geometry, peer)
        if peer in self._registry.peers:
            self.remove_peer(peer)
        self._registry.add_peer(agent, peer, metadata, geometry, messages_only, ours)

    def remove_peer(self, peer: str) -> None:
        state = self._registry.take_peer(peer)
        if state is None:
            return
        self._writes.fail_peer(peer)
        self._registry.release_peer(self._agent, state)

    def has_peer(self, peer: str) -> bool:
        return peer in self._registry.peers

    # --------------------------------------------------------------------- writes
    def write_blocks(
        self,
        peer: str,
        write_id: int,
        our_blocks: Sequence[int],
        their_blocks: Sequence[int],
        notification: bytes | None,
        regions: Sequence[int] | None = None,
    ) -> None:
        self._live_agent()
        target = self._registry.peers.get(peer)
        local = self._registry.local
        if target is None or local is None:
            raise TransportError(
                FailureReason.UNKNOWN_PEER, f"write to {peer}: peer was not added (add_peer)"
            )
        if target.moves_nothing:
            # The rank pair shares no heads: the write moves nothing, and still notifies.
            validate_write(
                target.source or local.geometry,
                target.geometry,
                peer,
                our_blocks,
                their_blocks,
                regions,
                notification,
            )
            if notification is not None:
                self._send_notif(peer, bytes(notification))
            self._writes.done_at_once(write_id)
            return
        if target.dlist is None or target.descriptors is None:
            raise TransportError(
                FailureReason.UNKNOWN_PEER,
                f"write to {peer}: peer was added for messages only (its cache is incompatible)",
            )
        if write_id in self._writes:
            raise TransportError(
                FailureReason.LOCAL_ERROR, f"write id {write_id} is already in flight"
            )
        source = target.source or local.geometry
        if (
            regions is None
            and notification
            and len(our_blocks) == 1 == len(their_blocks)
            and type(ob := our_blocks[0]) is int
            and type(tb := their_blocks[0]) is int
            and 0 <= ob < source.num_blocks
            and 0 <= tb < target.geometry.num_blocks
            and len(local.region_rows)
        ):
            # The common small write, checked as validate_write would pass it: one
            # block, every region, a notification; its descriptor rows from the plans.
            source_rows = local.region_rows if target.source_rows is None else target.source_rows
            rows, their_rows = source_rows + ob, target.region_rows + tb
            self._post(target, write_id, rows, their_rows, bytes(notification), 1)
            return
        region_ids = validate_write(
            source, target.geometry, peer, our_blocks, their_blocks, regions, notification
        )
        notif = b"" if notification is None else bytes(notification)
        if not our_blocks or not region_ids:
            # Nothing to move; NIXL refuses empty transfers. The notification still goes.
            if notification is not None:
                self._send_notif(peer, notif)
            self._writes.done_at_once(write_id)
            return
        # Descriptor row of (region r, block b) is r * num_blocks + b on each side.
        nb, their_nb = source.num_blocks, target.geometry.num_blocks
        region_arr = np.asarray(region_ids, dtype=np.int64)[:, None]
        our_index = (
            (region_arr * nb + np.asarray(our_blocks, dtype=np.int64)).astype(np.int32).ravel()
        )
        their_index = (
            (region_arr * their_nb + np.asarray(their_blocks, dtype=np.int64))
            .astype(np.int32)
            .ravel()
        )
        self._post(target, write_id, our_index, their_index, notif, len(our_blocks))

    def _post(
        self,
        target: NixlPeer,
        write_id: int,
        our_index: npt.NDArray[np.int32],
        their_index: npt.NDArray[np.int32],
        notif: bytes,
        num_blocks: int,
    ) -> None:
        """Make and post one checked write of `num_blocks` blocks: the descriptor rows
        given on each side, the same regions of each block."""
        calls, local = self._calls, self._registry.local
        assert calls is not None  # set with the agent
        assert local is not None  # write_blocks checked it
        try:
            ours = local.dlist if target.source_dlist is None else target.source_dlist
            handle = calls.make(ours, our_index, target.dlist, their_index, notif)
        except Exception as exc:
            # The arguments were checked above: what fails here is the data plane.
            self._writes.posted += 1
            self._not_prepared(write_id, exc)
            return
        try:
            state = calls.post(handle, notif)
        except Exception as exc:
            release_quietly(handle)
            reason = self._reason(exc)
            self._writes.posted += 1
            self._writes.fail(write_id, reason, f"NIXL refused the write: {exc!r}")
            return
        self._writes.posted += 1
        rb = target.region_bytes
        nb = local.num_blocks if target.source is None else target.source.num_blocks
        if len(our_index) == len(rb) * num_blocks:
            nbytes = target.bytes_per_block * num_blocks
        else:
            nbytes = sum(rb[int(i) // nb] for i in our_index)
        self._writes.bytes_posted += nbytes
        self._writes.last_block_descriptors = len(our_index)
        # Descriptors of one block are in separate allocations unless regions touch: a
        # one-block write merges nothing then, and skips the count.
        merged = len(our_index)
        if self._merge and (num_blocks > 1 or local.regions_adjacent):
            assert target.descriptors is not None
            source = (
                local.descriptors
                if target.source_descriptors is None
                else target.source_descriptors
            )
            merged = merged_descriptor_count(source, target.descriptors, our_index, their_index)
        self._writes.last_descriptors = merged
        self._writes.descriptors_posted += merged
        if state == "ERR":
            release_quietly(handle)
            self._writes.fail(write_id, FailureReason.WRITE_ERROR, "NIXL failed to post the write")
            return
        self._writes.track(write_id, target.name, handle, nbytes, merged)

    def write_scratch(self, peer: str, write_id: int, nbytes: int, theirs: ScratchRegion) -> None:
        agent = self._live_agent()
        if peer not in self._registry.peers:
            raise TransportError(
                FailureReason.UNKNOWN_PEER,
                f"scratch write to {peer}: peer was not added (add_peer)",
            )
        validate_scratch_write(self._registry.scratch, theirs, peer, nbytes)
        assert self._registry.scratch is not None  # checked above
        if write_id in self._writes:
            raise TransportError(
                FailureReason.LOCAL_ERROR, f"write id {write_id} is already in flight"
            )
        our_type, our_device = scratch_memory_type(self._registry.scratch)
        their_type, their_device = scratch_memory_type(theirs)
        self._writes.posted += 1
        try:
            # Not prepared ahead: a test write is rare, and its size is the caller's.
            handle = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs(
                    [(self._registry.scratch.base_addr, nbytes, our_device)], our_type
                ),
                agent.get_xfer_descs([(theirs.base_addr, nbytes, their_device)], their_type),
                peer,
                b"",
                [self._backend],
            )
        except Exception as exc:
            self._not_prepared(write_id, exc)
            return
        try:
            state = str(agent.transfer(handle))
        except Exception as exc:
            state, detail = "ERR", f"NIXL refused the write: {exc!r}"
        else:
            detail = "NIXL failed to post the write"
        if state == "ERR":
            release_quietly(handle)
            self._writes.fail(write_id, FailureReason.WRITE_ERROR, detail)
            return
        self._writes.bytes_posted += nbytes
        self._writes.track(write_id, peer, handle, nbytes, 1)

    def _not_prepared(self, write_id: int, exc: BaseException) -> None:
        """NIXL could not prepare a write (counted as posted already): it fails."""
        self._writes.fail(write_id, self._reason(exc), f"NIXL could not prepare the write: {exc!r}")

    def description(self) -> dict[str, str]:
        out = {"transport": f"NIXL with the {self._backend} backend"}
        if self._backend == "UCX":
            # Only what is set: where neither is, UCX picks among every transport it has.
            out.update(
                {k: os.environ[k] for k in ("UCX_TLS", "UCX_NET_DEVICES") if k in os.environ}
            )
        out["memory"] = "DRAM" if self._registry.local is None else self._registry.local.mem_type
        return out

    def send_message(self, peer: str, payload: bytes) -> None:
        self._live_agent()
        if peer not in self._registry.peers:
            raise TransportError(
                FailureReason.UNKNOWN_PEER, f"message to {peer}: peer was not added (add_peer)"
            )
        self._send_notif(peer, bytes(payload))

    def _send_notif(self, peer: str, payload: bytes) -> None:
        try:
            self._agent.send_notif(peer, payload)
        except Exception as exc:
            # Fire and forget: a lost message shows up as silence; a dead peer as PeerLost.
            reason = self._reason(exc)
            self._writes.events.append(
                PeerLost(peer, reason, f"NIXL could not notify {peer}: {exc!r}")
            )
            return
        self._writes.messages_sent += 1

    # ----------------------------------------------------------------------- poll
    def poll(self) -> list[TransportEvent]:
        agent = self._live_agent()
        events = self._writes.take_events()
        calls = self._calls
        assert calls is not None  # set with the agent
        self._writes.check(calls, self._reason, events)
        try:
            notifs = agent.get_new_notifs()
        except Exception as exc:
            raise self._translate(exc, self._name, "fetch notifications") from exc
        for sender, payloads in notifs.items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            for payload in payloads:
                self._writes.messages_received += 1
                events.append(MessageReceived(name, bytes(payload)))
        return events

    def statistics(self) -> NixlStatistics:
        return self._writes.statistics()

    # --------------------------------------------------------------- error mapping
    def _reason(self, exc: BaseException) -> FailureReason:
        if self._nixl is not None and isinstance(exc, self._nixl.remote_disconnect_error):
            return FailureReason.PEER_GONE
        return FailureReason.WRITE_ERROR

    def _translate(self, exc: BaseException, peer: str, what: str) -> TransportError:
        return TransportError(self._reason(exc), f"NIXL could not {what} ({peer}): {exc!r}")
