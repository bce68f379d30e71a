"""The kvpush side of one prefill or decode server: a one-rank `Node` over the engine's
KV cache, its drain at shutdown, and what it says in `/health` and `/metrics`."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import TYPE_CHECKING

from kvpush.doctor_probe import DoctorProbe
from kvpush.health import (
    ClockBound,
    CpuReading,
    ServerHealth,
    SideChannelRequests,
    TransferFigures,
)
from kvpush.kvcache import KVLayout, register_kv_cache
from kvpush.node import Node, NodeIdentity, RankSettings, TransportFactory, nixl_transport
from kvpush.roles import runtime_role
from kvpush.serving.engine import Engine
from kvpush.serving.metrics import Registry
from kvpush.serving.paged import KV_LAYOUT

if TYPE_CHECKING:
    from kvpush.runtime import PushRuntime
    from kvpush.serving.options import ServeOptions

log = logging.getLogger(__name__)


class KVBridge:
    """The kvpush side of one server: a one-rank `Node` (runtime, transport and side
    channel) over the engine's KV cache. `transport_factory`: NIXL unless given."""

    def __init__(
        self,
        options: ServeOptions,
        engine: Engine,
        token: str | None,
        *,
        transport_factory: TransportFactory = nixl_transport,
    ) -> None:
        self.options = options
        self.engine = engine
        self.token = token
        self.engine_id = f"{options.role}-{uuid.uuid4().hex[:8]}"
        self._transport_factory = transport_factory
        self.node: Node | None = None

    @property
    def runtime(self) -> PushRuntime | None:
        """The runtime, once started."""
        return self.node.runtime if self.node is not None and self.node.ranks else None

    def start(self) -> PushRuntime:
        opts = self.options
        assert opts.side_channel_port is not None
        geometry = register_kv_cache(
            self.engine.kv_cache.by_layer(), KVLayout(KV_LAYOUT), self.engine.block_size
        )
        self.node = Node(
            [geometry],
            NodeIdentity(
                self.engine_id,
                runtime_role(opts.role),
                opts.side_channel_host,
            ),
            port=opts.side_channel_port,
            bind_host=opts.host,
            settings=RankSettings(
                token=self.token,
                timing=opts.timing(),
                idle_poll_s=opts.idle_poll_ms / 1000,
            ),
            transport_factory=self._transport_factory,
            # `kvpush doctor`'s test writes go into a scratch buffer, never a KV block: on
            # with a token (the doctor proves it), else only when the operator allows them.
            services=[DoctorProbe(scratch=self.token is not None or opts.allow_doctor_writes)],
        )
        self.node.start()
        return self.node.runtime

    def drain(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Told to stop, with no new legs coming in: wait up to `timeout_s` for the
        transfers in flight to end (a decode registering for what we hold, KV arriving
        for what we wait for). True if none is left; `close()` ends the rest, telling
        each peer. Returns at once when the runtime is not running."""
        runtime = self.runtime
        until = time.monotonic() + timeout_s
        while runtime is not None and runtime.failure is None:
            stats = runtime.statistics()
            left = len(stats.sending_transfers) + len(stats.receiving_transfers)
            if left == 0:
                return True
            if time.monotonic() >= until:
                log.info("drain: %d transfers still in flight after %.1fs", left, timeout_s)
                return False
            time.sleep(poll_s)
        return True

    def close(self) -> None:
        if self.node is not None:
            self.node.close()

    def health(self) -> ServerHealth:
        """What `/health` says for this role (the server adds its status and role);
        `healthy=False` makes it answer 503. It asks the runtime's thread for a snapshot:
        call it off an event loop."""
        side_ok = False
        runtime_failure: str | None = "not started"
        side_failure: str | None = None
        internal_errors: int | None = None
        requests: SideChannelRequests | None = None
        if self.node is not None:
            h = self.node.health()
            side_ok = h.side_channel_healthy
            runtime_failure = h.runtime_failure
            side_failure = h.side_channel_failure
            internal_errors = h.side_channel.internal_errors
            requests = SideChannelRequests(**dataclasses.asdict(h.side_channel))
        # What `kvpush doctor` reads besides: the deadlines in force, the runtime's
        # transfer figures and the side channel's request counts.
        transfers: TransferFigures | None = None
        cpu: CpuReading | None = None
        runtime = self.runtime
        if runtime is not None and runtime.failure is None:
            s = runtime.statistics()
            transfers = TransferFigures(
                in_flight=s.in_flight,
                oldest_in_flight_s=s.oldest_in_flight_s,
                sending=s.sending,
                receiving=s.receiving,
                writes_in_flight=s.writes_in_flight,
                handshakes_in_flight=s.handshakes_in_flight,
                blocks_held_sending=s.blocks_held_sending,
                blocks_held_receiving=s.blocks_held_receiving,
                claimed=s.claimed,
                finished=s.finished,
                failed=s.failed,
                failures=s.failures,
                peers=s.peers,
                forged_messages=s.forged_messages,
                malformed_messages=s.malformed_messages,
                clock_bounds={
                    agent: ClockBound(**bound) for agent, bound in s.clock_bounds.items()
                },
            )
            # Two readings of these, a moment apart, are the server's CPU share (the doctor
            # warns when an idle server is busy): its clock, the process, the runtime thread.
            cpu = CpuReading(
                at_s=time.monotonic(),
                process_s=time.process_time(),
                runtime_thread_s=s.thread_cpu_s,
            )
        return ServerHealth(
            engine_id=self.engine_id,
            side_channel_host=self.options.side_channel_host,
            side_channel_port=self.options.side_channel_port,
            side_channel="ok" if side_ok else "down",
            runtime="ok" if runtime_failure is None else "down",
            healthy=side_ok and runtime_failure is None,
            runtime_failure=runtime_failure,
            side_channel_failure=side_failure,
            side_channel_internal_errors=internal_errors,
            transfer_deadline_s=self.options.transfer_deadline_s,
            queue_timeout_s=self.options.queue_timeout_s if self.options.role == "decode" else None,
            liveness_timeout_s=self.options.liveness_timeout_s,
            transfers=transfers,
            cpu=cpu,
            side_channel_requests=requests,
        )

    def update_metrics(self, registry: Registry) -> None:
        """The runtime's counts of dropped data-plane messages, into `registry` (at each
        /metrics scrape; it asks the runtime's thread for a snapshot)."""
        runtime = self.runtime
        if runtime is None or runtime.failure is not None:
            return
        s = runtime.statistics()
        for reason, n in s.forged_messages.items():
            registry.set("kvpush_forged_messages_total", n, labels={"reason": reason})
        registry.set("kvpush_malformed_messages_total", s.malformed_messages)
