"""`KvpushConnectorBackend`: the class Ray Serve LLM builds in every replica whose
engine's `kv_connector` is `KvpushConnector` (`kvpush.integrations.ray.register()`).

Ray calls `setup()` in each replica before vLLM starts: it gives the replica its side
channel (the Ray node's address; a port from a base plus the replica's offset), a unique
engine id, and the connector's module path, all in the engine's `kv_transfer_config`.
A prefill replica then publishes that side channel (`replica_metadata()`); the decode
replica's orchestrator shapes both legs of each request (`legs`) and runs them at once.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any

import ray
from ray.llm._internal.serve.engines.vllm.kv_transfer.base import (
    BaseConnectorBackend,
    clamp_request_to_single_token,
)

from kvpush.errors import ConfigError
from kvpush.integrations.ray.legs import (
    LegPairs,
    ReplicaSideChannel,
    decode_leg,
    prefill_leg,
    replica_port,
)

if TYPE_CHECKING:
    from ray.llm._internal.serve.engines.vllm.kv_transfer.base import RequestType

log = logging.getLogger(__name__)

CONNECTOR_MODULE = "kvpush.integrations.vllm"
# experimental_configs key: the first replica's side-channel port.
PORT_BASE_KEY = "KVPUSH_SIDE_CHANNEL_PORT_BASE"
# Defaults per role, apart so that prefill and decode replicas on one node never collide;
# each leaves room for a thousand replicas of TP 2.
DEFAULT_PORT_BASES = {"kv_producer": 25000, "kv_consumer": 27000, "kv_both": 29000}


class KvpushConnectorBackend(BaseConnectorBackend):
    """Peer binding and concurrent handoff: the decode leg names the prefill replica
    the orchestrator picked, so both legs go at once and the decode registers while the
    prefill computes."""

    requires_peer_binding = True
    concurrent_handoff = True

    def __init__(self, llm_config: Any) -> None:
        super().__init__(llm_config)
        self._ours: ReplicaSideChannel | None = None
        self._pairs = LegPairs()

    # ------------------------------------------------------------------ replica set-up

    def setup(self) -> None:
        if self._ours is not None:
            return
        kv = self.kv_transfer_config
        role = kv.get("kv_role")
        if role not in DEFAULT_PORT_BASES:
            raise ConfigError(
                f"kv_transfer_config.kv_role is {role!r}: KvpushConnector's Ray backend "
                f"expects one of {', '.join(DEFAULT_PORT_BASES)}"
            )
        module = kv.setdefault("kv_connector_module_path", CONNECTOR_MODULE)
        if module != CONNECTOR_MODULE:
            raise ConfigError(
                f"kv_transfer_config.kv_connector_module_path is {module!r}: KvpushConnector "
                f"lives in {CONNECTOR_MODULE!r} (leave it out: the backend sets it)"
            )
        extra = kv.setdefault("kv_connector_extra_config", {})
        if "side_channel_port" in extra:
            raise ConfigError(
                "kv_connector_extra_config.side_channel_port is set: under Ray Serve every "
                f"replica gets its own port, a base plus its offset; set the base as "
                f"experimental_configs[{PORT_BASE_KEY!r}] instead"
            )
        base = int(
            self.llm_config.experimental_configs.get(PORT_BASE_KEY, DEFAULT_PORT_BASES[role])
        )
        port = replica_port(base, self._compute_port_offset())
        # The node's cluster address, which every node reaches (Ray's own NIXL backend
        # does the same), unless the deployment names one.
        host = str(extra.setdefault("side_channel_host", ray.util.get_node_ip_address()))
        extra["side_channel_port"] = port
        engine_kwargs = self.llm_config.engine_kwargs
        engine_id = f"{kv.get('engine_id') or 'kvpush'}-{host}-{port}"
        kv["engine_id"] = engine_id
        block_size = engine_kwargs.get("block_size")
        # The connector adds the data-parallel index to its port (as vLLM's NIXL
        # connectors do): the side channel a peer reaches is that one.
        self._ours = ReplicaSideChannel(
            engine_id=engine_id,
            host=host,
            port=port + self._dp_rank(),
            tp_size=int(engine_kwargs.get("tensor_parallel_size") or 1),
            block_size=int(block_size) if block_size is not None else None,
        )
        log.info(
            "kvpush: replica engine %s (%s), side channel %s:%d",
            engine_id,
            role,
            host,
            self._ours.port,
        )

    def _dp_rank(self) -> int:
        rank = self.llm_config.engine_kwargs.get("data_parallel_rank")
        return rank if isinstance(rank, int) and rank >= 0 else 0

    def _our_side_channel(self) -> ReplicaSideChannel:
        if self._ours is None:
            raise ConfigError(
                "KvpushConnector's Ray backend was used before setup(): Ray Serve calls it "
                "when the replica's engine starts"
            )
        return self._ours

    def replica_metadata(self) -> dict[str, Any]:
        """A prefill replica's side channel, for the decode replicas that pick it."""
        return self._our_side_channel().metadata()

    # ------------------------------------------------------------------ request shaping

    def prepare_prefill_request(
        self, *, request: RequestType, peer: dict[str, Any] | None
    ) -> RequestType:
        ours = self._our_side_channel()
        ReplicaSideChannel.from_metadata(peer)  # refused here, before either leg goes
        transfer_id = f"{ours.engine_id}-{uuid.uuid4().hex}"
        prefill_request = request.model_copy(deep=True)
        prefill_request.kv_transfer_params = prefill_leg(transfer_id, ours)
        clamp_request_to_single_token(prefill_request)
        self._pairs.give(request, transfer_id)
        return prefill_request

    def prepare_decode_request(
        self,
        *,
        request: RequestType,
        peer: dict[str, Any] | None,
        prefill_response: Any | None,
    ) -> RequestType:
        transfer_id = self._pairs.take(request)
        decode_request = request.model_copy(deep=True)
        decode_request.kv_transfer_params = decode_leg(
            transfer_id, ReplicaSideChannel.from_metadata(peer), self._our_side_channel()
        )
        return decode_request


__all__ = ["CONNECTOR_MODULE", "DEFAULT_PORT_BASES", "PORT_BASE_KEY", "KvpushConnectorBackend"]
