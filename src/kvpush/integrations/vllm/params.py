"""The connector's settings, read once, typed; and `kv_transfer_params` as vLLM sees them.

The params themselves are `kvpush.transfer_params`'s contract (shared with the serving
stack and the proxy): requests reach vLLM with the fields vLLM's NIXL connectors expect,
plus `transfer_id`, which pairs the prefill's and the decode's halves of one transfer end
to end (never a request-id suffix). The prefill's answer keeps every field the NIXL
connectors return, so routers that forward it to the decode server route kvpush unchanged.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.config import TimingConfig, load_token
from kvpush.errors import ConfigError
from kvpush.transfer_params import (
    BadTransferParams,
    PrefillAnswer,
    RemoteDecode,
    parse_remote_decode,
)

log = logging.getLogger(__name__)

ROLES = {"kv_producer": "sender", "kv_consumer": "receiver", "kv_both": "both"}
TIMING_KEYS = ("heartbeat_interval_s", "liveness_timeout_s", "lease_s", "transfer_deadline_s")
PUSH_MODES = ("layerwise", "whole")
# Every key `kv_connector_extra_config` may hold (docs/vllm.md lists them); others are refused.
EXTRA_CONFIG_KEYS = frozenset(
    {
        "side_channel_host",
        "side_channel_port",
        "token_file",
        "idle_wait_s",
        "handshake_timeout_ms",
        "allow_untested_vllm",
        "idle_poll_ms",
        "switch_interval_ms",
        "push",
        *TIMING_KEYS,
    }
)


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Everything the connector reads from vLLM's `KVTransferConfig`, checked once."""

    engine_id: str
    role: str  # the runtime's: "sender" | "receiver" | "both"
    side_channel_host: str
    side_channel_port: int
    token: str | None
    timing: TimingConfig
    tp_size: int
    # The model's KV heads (all ranks together), and whether every rank holds them all
    # (MLA's latent cache): with tp_size, how a rank's blocks hold heads.
    total_kv_heads: int
    use_mla: bool
    pp_size: int
    dcp_size: int
    block_size_tokens: int
    # How long an idle engine step (nothing scheduled, a transfer in flight) may wait
    # for a transfer to end. It returns as soon as one ends, so transfers lose nothing;
    # a request arriving meanwhile waits up to this long. Without it vLLM's loop comes
    # straight back, and its worker busy-polls its queue holding the GIL, starving the
    # runtime's thread (heartbeats late enough, on a loaded host, to look like death).
    idle_wait_s: float = 0.02
    # How long one side-channel lookup may take before the handshake fails. The side
    # channel is served from vLLM's busy engine-core process: 2 s went by unanswered
    # there on a loaded host.
    handshake_timeout_ms: int = 5000
    # NIXL cannot wake the runtime when a registration arrives: an idle runtime finds it
    # at its next poll, so this bounds the delay a transfer sees (as `kvpush serve`).
    idle_poll_ms: float = 5.0
    allow_untested_vllm: bool = False
    # The worker process's thread switch interval (sys.setswitchinterval), when set:
    # vLLM's worker spins on its queue holding the GIL, and the runtime's thread waits
    # up to one interval (5 ms by default) for it at every wake-up. None: vLLM's.
    switch_interval_ms: float | None = None
    # When a prefill's blocks are offered. "layerwise": on the step that computes the
    # prompt's last tokens, each layer as soon as vLLM computed it (`save_kv_layer`),
    # so a decode server that registered already receives layer 0 while the prefill
    # computes layer 1; for requests that end on that step (max_tokens 1, as proxies
    # send), others are offered whole. "whole": when the request finished, all layers
    # at once (what vLLM's NIXL connectors do).
    push: str = "layerwise"
    # vLLM's scheduler schedules the next step before the last one's output is in:
    # a request could then be preempted (its blocks freed) between the step that
    # computed it and the one that finishes it, so layer-wise push is not used.
    async_scheduling: bool = False

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> ConnectorConfig:
        from vllm import envs

        kv = vllm_config.kv_transfer_config
        if kv.kv_role not in ROLES:
            raise ConfigError(
                f"kv_role {kv.kv_role!r} is not supported by KvpushConnector: expected "
                f"one of {', '.join(ROLES)}"
            )
        extra: Mapping[str, Any] = kv.kv_connector_extra_config or {}
        unknown = sorted(set(extra) - EXTRA_CONFIG_KEYS)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config has unknown keys {unknown}: expected any of "
                f"{sorted(EXTRA_CONFIG_KEYS)}"
            )
        push = extra.get("push", "layerwise")
        if push not in PUSH_MODES:
            raise ConfigError(
                f"kv_connector_extra_config.push is {push!r}: expected one of "
                f"{', '.join(repr(m) for m in PUSH_MODES)}"
            )
        timing = TimingConfig(**{k: float(extra[k]) for k in TIMING_KEYS if k in extra})
        parallel = vllm_config.parallel_config
        pp_size = int(parallel.pipeline_parallel_size)
        if pp_size > 1:
            raise ConfigError(
                f"pipeline_parallel_size is {pp_size}: KvpushConnector pairs ranks by their "
                "tensor-parallel rank, which the stages of a pipeline share; expected 1 "
                "(pipeline parallelism is not supported yet)"
            )
        # vLLM's NIXL connectors take the side channel from these variables; so do we,
        # so a deployment keeps its ports when it switches connector. Each data-parallel
        # engine gets its own port, as there: base + data_parallel_index, never the rank,
        # which vLLM resets to 0 in every engine of a dense model (tests/test_vllm_e2e_dp.py).
        port = int(extra.get("side_channel_port", envs.VLLM_NIXL_SIDE_CHANNEL_PORT))
        port += int(getattr(parallel, "data_parallel_index", 0) or 0)
        token_file = extra.get("token_file")
        use_mla = bool(getattr(vllm_config.model_config, "use_mla", False))
        return cls(
            engine_id=str(kv.engine_id),
            role=ROLES[kv.kv_role],
            side_channel_host=str(extra.get("side_channel_host", envs.VLLM_NIXL_SIDE_CHANNEL_HOST)),
            side_channel_port=port,
            token=load_token(Path(token_file) if token_file else None),
            timing=timing,
            tp_size=int(parallel.tensor_parallel_size),
            # MLA's cache is one latent per token, whatever the model's head count.
            total_kv_heads=1 if use_mla else int(vllm_config.model_config.get_total_num_kv_heads()),
            use_mla=use_mla,
            pp_size=pp_size,
            dcp_size=int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
            block_size_tokens=int(vllm_config.cache_config.block_size),
            idle_wait_s=float(extra.get("idle_wait_s", 0.02)),
            handshake_timeout_ms=int(extra.get("handshake_timeout_ms", 5000)),
            idle_poll_ms=float(extra.get("idle_poll_ms", 5.0)),
            allow_untested_vllm=bool(extra.get("allow_untested_vllm", False)),
            switch_interval_ms=(
                float(extra["switch_interval_ms"]) if "switch_interval_ms" in extra else None
            ),
            push=str(push),
            async_scheduling=bool(
                getattr(vllm_config.scheduler_config, "async_scheduling", False) or False
            ),
        )

    @property
    def layerwise(self) -> bool:
        """Whether prefill requests that end on the step computing them are pushed
        layer by layer (see `push`): only where nothing can free their blocks before
        they finish (no async scheduling, no pipeline stages in flight)."""
        return (
            self.push == "layerwise"
            and self.sends
            and not self.async_scheduling
            and self.pp_size == 1
        )

    def layerwise_refused(self) -> str | None:
        """Why layer-wise push was asked for but is not used, if it is not."""
        if self.push != "layerwise" or not self.sends or self.layerwise:
            return None
        if self.async_scheduling:
            return "vLLM's async scheduling is on"
        return f"pipeline parallel size is {self.pp_size}"

    @property
    def sends(self) -> bool:
        return self.role in ("sender", "both")

    @property
    def receives(self) -> bool:
        return self.role in ("receiver", "both")


@dataclass(frozen=True, slots=True)
class PrefillTransfer:
    """What a prefill request's params say of its transfer."""

    transfer_id: str  # the proxy's, or a fresh one the prefill answers with
    decode: tuple[str, int] | None  # the decode server's side channel, if named
    decode_tp_size: int  # the decode TP to split the transfer for (default: ours)


def prefill_transfer(params: Mapping[str, Any], config: ConnectorConfig) -> PrefillTransfer:
    """A prefill request's transfer, from its params. Params that cannot be read (vLLM
    cannot refuse a request at this point) give a fresh id, no decode and our TP: the
    decode server refuses a transfer split for another TP than its own, saying so."""
    try:
        params_read = parse_remote_decode(params)
    except BadTransferParams as exc:
        log.warning("%s: the transfer gets a fresh id", exc)
        params_read = RemoteDecode()
    return PrefillTransfer(
        params_read.transfer_id or f"{config.engine_id}-{uuid.uuid4().hex}",
        params_read.decode_server(),
        params_read.decode_tp_size or config.tp_size,
    )


def prefill_answer(
    config: ConnectorConfig,
    *,
    transfer_id: str,
    request_id: str,
    block_ids: list[int],
    num_tokens: int,
    decode_tp_size: int,
) -> dict[str, Any]:
    """What the prefill server returns: the NIXL connectors' fields, plus transfer_id."""
    return PrefillAnswer(
        do_remote_prefill=True,
        do_remote_decode=False,
        remote_block_ids=list(block_ids),
        remote_engine_id=config.engine_id,
        remote_request_id=request_id,
        remote_host=config.side_channel_host,
        remote_port=config.side_channel_port,
        tp_size=config.tp_size,
        dcp_size=config.dcp_size,
        pp_size=config.pp_size,
        remote_num_tokens=num_tokens,
        transfer_mode="push",
        transfer_id=transfer_id,
        decode_tp_size=decode_tp_size,
        block_size=config.block_size_tokens,
    ).to_params()


__all__ = [
    "EXTRA_CONFIG_KEYS",
    "ConnectorConfig",
    "PrefillTransfer",
    "prefill_answer",
    "prefill_transfer",
]
