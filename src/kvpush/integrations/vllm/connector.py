"""`KvpushConnector`: the class vLLM instantiates, twice per engine.

vLLM builds one in the scheduler's process (`KVConnectorRole.SCHEDULER`) and one in each
worker (`KVConnectorRole.WORKER`); each forwards to its half (`SchedulerSide` or
`WorkerSide`) and nothing else. The protocol, its timeouts and its failure handling are
kvpush's (`PushRuntime`); this class only translates vLLM's calls.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpush.errors import ConfigError
from kvpush.geometry import KVCacheGroup
from kvpush.integrations.vllm.compat import check_vllm
from kvpush.integrations.vllm.metadata import RankMetadata, StepPlan
from kvpush.integrations.vllm.params import ConnectorConfig
from kvpush.integrations.vllm.scheduler import SchedulerSide
from kvpush.integrations.vllm.side_channel import EngineSideChannel
from kvpush.integrations.vllm.stats import KvpushPromMetrics, TransferStats
from kvpush.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


log = logging.getLogger(__name__)


class KvpushConnector(KVConnectorBase_V1, SupportsHMA):
    """Push-mode KV transfer through kvpush. See `kvpush.integrations.vllm`."""

    # What vLLM's `vllm:prompt_tokens_cached_by_source` calls the tokens this connector
    # loads: KV moved from another vLLM instance, as vLLM's NIXL connectors say. Beside
    # an offload tier in a MultiConnector, vLLM then counts each request's tokens under
    # the child that loaded them (`get_external_cache_hit_sources`).
    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._config = ConnectorConfig.from_vllm(vllm_config)
        groups = kv_cache_groups(kv_cache_config, self._config)
        check_vllm(
            vllm.__version__, KVConnectorBase_V1, allow_untested=self._config.allow_untested_vllm
        )
        self._scheduler: SchedulerSide | None = None
        self._side_channel: EngineSideChannel | None = None
        self._worker: WorkerSide[TransferStats] | None = None
        refused = self._config.layerwise_refused()
        if self._config.layerwise and not hasattr(KVConnectorBase_V1, "bind_kv_cache_manager"):
            # The scheduler reads a running request's blocks through the cache manager.
            refused = "this vLLM does not bind its KV cache manager to connectors"
        if refused is not None and role == KVConnectorRole.SCHEDULER:
            log.warning("KvpushConnector: layer-wise push is off (%s): requests go whole", refused)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self._config, groups)
            self._side_channel = EngineSideChannel(self._config)
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            self._worker = WorkerSide(
                self._config,
                get_tp_group().rank_in_group,
                new_stats=TransferStats,
                groups=groups,
                state_layers=state_layers(kv_cache_config),
                stage=get_pp_group().rank_in_group,
            )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Whether vLLM must drop full CUDA graphs for piecewise ones: only where
        `"push": "layerwise"` is set explicitly.

        Layer-wise push runs Python in `save_kv_layer`, which a replayed full graph skips;
        the step's end then announces every layer, so the KV still moves whole and right,
        only not pipelined. vLLM asks this of the class with `kv_connector_extra_config`
        alone, before any connector exists, so the role (a decode server never saves KV)
        and async scheduling (which turns layer-wise push off) cannot be seen here. Forcing
        piecewise graphs by default would slow every decode server for nothing; a prefill
        server that wants each layer announced as computed under full graphs says so.
        """
        return "push" in (extra_config or {}) and extra_config["push"] == "layerwise"

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33+: sleep mode remaps the KV cache, and the runtime's NIXL
        registrations live as long as the engine, so it is refused."""
        return False

    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on a worker connector"
        return self._scheduler

    def _work(self) -> WorkerSide[TransferStats]:
        assert self._worker is not None, "a worker-side call on a scheduler connector"
        return self._worker

    # ----------------------------------------------------------------- scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.bind_block_ids(kv_cache_manager.get_block_ids)

    def on_new_request(self, request: Request) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # We move the request's own blocks, every group of them.
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM without its hybrid KV-cache manager: one group."""
        return self._sched().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request's blocks of every KV-cache group; those that move (a sliding
        window's last ones) are held until the transfer ended."""
        return self._sched().request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Every worker's metadata, keyed by (pipeline rank, tensor-parallel rank): the
        side channel answers for each as rank `pp_rank * tp_size + tp_rank` (what the
        worker registered as, `WorkerSide`), so each pipeline stage is a rank of its own."""
        tp = self._config.tp_size
        self.set_xfer_handshake_metadata(
            {pp_rank * tp + tp_rank: meta for (pp_rank, tp_rank), meta in metadata.items()}
        )

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        ranks: dict[int, RankMetadata] = {}
        for rank, meta in metadata.items():
            if not isinstance(meta, RankMetadata):
                raise ConfigError(
                    f"rank {rank} handed handshake metadata of type {type(meta).__name__}: "
                    "expected KvpushConnector's (are all workers running KvpushConnector?)"
                )
            ranks[rank] = meta
        assert self._side_channel is not None, "a scheduler-side call on a worker connector"
        self._side_channel.serve(ranks)

    # ----------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._config.pp_size > 1:
            self._check_stage_layers(kv_caches)
        self._work().register_kv_caches(kv_caches, kv_scales(self._vllm_config, kv_caches))

    def _check_stage_layers(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """A pipeline stage must hold one KV cache per layer of its slice: what makes the
        stages' regions, together, the model's layers (`PipelineStage.model_regions`),
        which a decode's must number. A hybrid model's state or window groups, a draft
        model's layers or an indexer's cache break that count: refused, naming it."""
        from vllm.distributed.parallel_state import get_pp_group
        from vllm.distributed.utils import get_pp_indices

        cfg, stage = self._config, get_pp_group().rank_in_group
        assert cfg.model_layers is not None  # set wherever pp_size > 1 (`from_vllm`)
        start, end = get_pp_indices(cfg.model_layers, stage, cfg.pp_size)
        if len(kv_caches) != end - start:
            raise ConfigError(
                f"pipeline stage {stage} of {cfg.pp_size} holds layers {start}..{end - 1} "
                f"({end - start}) but vLLM hands it {len(kv_caches)} KV caches: "
                "KvpushConnector carries a pipeline-parallel prefill only for a model with "
                "one KV cache per layer (no hybrid, draft-model or indexer caches). "
                "Next: run this prefill with --pipeline-parallel-size 1"
            )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        meta = self._worker.handshake_metadata() if self._worker is not None else None
        return RankMetadata.of(meta) if meta is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._connector_metadata
        assert isinstance(plan, StepPlan)
        self._work().start_step(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """KV arrives before the request is scheduled at all: nothing to wait for."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Layer-wise push: this layer is computed for this step's requests."""
        plan = self._connector_metadata
        assert isinstance(plan, StepPlan)
        self._work().layer_saved(plan, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """Every layer of this step is computed: announce what save_kv_layer did not.
        Writes read the blocks asynchronously; vLLM keeps them until finished_sending."""
        plan = self._connector_metadata
        assert isinstance(plan, StepPlan)
        self._work().step_saved(plan)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        ended = self._work().transfer_results()
        out = KVConnectorTransferResults()
        out.finished_recving |= ended.finished_recving
        out.failed_recving |= ended.failed_recving
        out.finished_sending |= ended.finished_sending
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        """None, ever: a failed receive fails its whole request, in `failed_recving`.

        That alone keeps every block a failed transfer touched out of vLLM's prefix
        cache: a request loading asynchronously holds blocks allocated uncached
        (`delay_cache_blocks`), and vLLM caches them only when the load ended without
        failure; a failed one, under `kv_load_failure_policy: "recompute"`, restarts
        from no computed token and frees its blocks unhashed, so nothing can match
        them (docs/vllm.md, "Failures and vLLM's failure policy"). Naming the blocks
        here as well would add nothing (its computed tokens are already none), and
        vLLM refuses block-level errors outright for a model of several KV-cache
        groups (a RuntimeError in its scheduler)."""
        return set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return TransferStats(data=data) if data is not None else TransferStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KvpushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._side_channel is not None:
            self._side_channel.close()


# vLLM's MultiConnector rebuilds its children's stats in the API server by connector
# *name*, from the factory's registry (multi_connector.py:677,
# `KVConnectorFactory.get_connector_class_by_name`), where only vLLM's own connectors
# are; with KvpushConnector unregistered, its first stats under a MultiConnector killed
# the server ("Connector 'KvpushConnector' is not registered"). The API server loads
# this class (by `kv_connector_module_path`) when its Prometheus logger builds each
# child's metrics at start-up, before any stats arrive: registered here, the name is
# there in time.
with contextlib.suppress(ValueError):  # registered already (a second import)
    KVConnectorFactory.register_connector(
        KvpushConnector.__name__, "kvpush.integrations.vllm", KvpushConnector.__name__
    )


def kv_cache_groups(
    kv_cache_config: KVCacheConfig, config: ConnectorConfig
) -> tuple[KVCacheGroup, ...]:
    """The model's KV-cache groups as kvpush moves them (`kvpush.integrations.vllm.groups`):
    empty for one group that is not a sliding window (every block of a request moves, as
    ever). Groups kvpush cannot carry are refused here, at start-up, naming them."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    specs = [g.kv_cache_spec for g in getattr(kv_cache_config, "kv_cache_groups", None) or ()]
    if len(specs) == 1 and not isinstance(specs[0], (SlidingWindowSpec, MambaSpec)):
        return ()
    groups: list[KVCacheGroup] = []
    refused: list[str] = []
    for index, spec in enumerate(specs):
        block_size = int(getattr(spec, "block_size", 0))
        if type(spec) is SlidingWindowSpec:
            groups.append(KVCacheGroup("sliding_window", block_size, int(spec.sliding_window)))
        elif type(spec) is FullAttentionSpec:
            groups.append(KVCacheGroup("full_attention", block_size))
        elif isinstance(spec, MambaSpec):
            if spec.num_speculative_blocks:
                refused.append(
                    f"group {index} (Mamba) keeps {spec.num_speculative_blocks} speculative "
                    "state blocks per request (speculative decoding), expected none"
                )
                continue
            groups.append(KVCacheGroup("mamba", block_size, state=_state(spec, config)))
            continue  # its block size is vLLM's for states (max_model_len without caching)
        else:
            refused.append(f"group {index} is {type(spec).__name__}")
            continue
        if block_size != config.block_size_tokens:
            refused.append(
                f"group {index} has {block_size}-token blocks, the engine "
                f"{config.block_size_tokens}"
            )
    shapes = ", ".join(g.describe() for g in groups) or "none"
    if refused:
        raise ConfigError(
            f"KvpushConnector cannot carry this model's {len(specs)} KV-cache groups: "
            f"{'; '.join(refused)}; it carries full-attention and sliding-window groups "
            f"of the engine's block size and Mamba groups without speculative blocks "
            f"(carried here: {shapes})"
        )
    return tuple(groups)


def _state(spec: Any, config: ConnectorConfig) -> str:
    """A Mamba group's state as two engines must have it alike: its tensors' shapes
    (oriented as vLLM stores them, so a conv state of the other layout differs) and
    dtypes on one rank, which depend on the TP size."""
    tensors = ", ".join(
        f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
    )
    return f"{spec.mamba_type.name.lower()} {tensors} per rank of TP {config.tp_size}"


def kv_scales(
    vllm_config: VllmConfig, kv_caches: dict[str, torch.Tensor]
) -> dict[str, tuple[float, float]]:
    """Each cache layer's (k_scale, v_scale), where its attention layer keeps them:
    what a quantized (fp8) cache's bytes were scaled by, static in vLLM 0.32 (from the
    checkpoint, else 1.0), and part of what a peer must have alike."""
    layers = vllm_config.compilation_config.static_forward_context
    out: dict[str, tuple[float, float]] = {}
    for name in kv_caches:
        layer = layers.get(name)
        k, v = getattr(layer, "_k_scale_float", None), getattr(layer, "_v_scale_float", None)
        if k is not None and v is not None:
            out[name] = (float(k), float(v))
    return out


def state_layers(kv_cache_config: KVCacheConfig) -> frozenset[str]:
    """The layers whose cache is a Mamba state (an untyped page in vLLM's tensors)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    return frozenset(
        name
        for group in getattr(kv_cache_config, "kv_cache_groups", None) or ()
        if isinstance(group.kv_cache_spec, MambaSpec)
        for name in group.layer_names
    )
