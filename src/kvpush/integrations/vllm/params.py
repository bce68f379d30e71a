"""The connector's settings, read once, typed; and `kv_transfer_params` as vLLM sees them.

The params themselves are `kvpush.transfer_params`'s contract (shared with the serving
stack and the proxy): requests reach vLLM with the fields vLLM's NIXL connectors expect,
plus `transfer_id`, which pairs the prefill's and the decode's halves of one transfer end
to end. The prefill's answer keeps every field the NIXL connectors return, so routers
that forward it to the decode server route kvpush unchanged.

Routers that speak vLLM's push dialect (vllm-router, llm-d's push identity, Dynamo's
overlapped dispatch) rebuild the decode leg's params and drop `transfer_id`; they send
both legs under one `X-Request-Id`. Each side then names the transfer itself, the same
way (`pairing_id`): from the request's own id as the client gave it (vLLM's id before
the random suffix it adds, which vLLM always adds unless told not to, so it is cut
exactly) and a digest of what the KV is computed from (the prompt's tokens, the cache
salt, the LoRA adapter). Two requests that share an `X-Request-Id` but not a prompt
get two transfers; two that share both compute the same KV, and the second of them is
refused while the first is in flight or remembered (its id is taken), never served
from the other's blocks. Holding the id alone gives nothing: the transfer's id is
known only to whoever knows the prompt, which is what its KV is made of. See
docs/vllm.md ("Behind routers").
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.config import TimingConfig, load_token
from kvpush.errors import ConfigError
from kvpush.roles import VLLM_KV_ROLES
from kvpush.transfer_params import (
    BadTransferParams,
    PrefillAnswer,
    RemoteDecode,
    parse_remote_decode,
)

log = logging.getLogger(__name__)

TIMING_KEYS = (
    "heartbeat_interval_s",
    "liveness_timeout_s",
    "lease_s",
    "transfer_deadline_s",
    "claim_window_s",
)
# How long a prefill holds a transfer no decode registered for nor claimed (decodes
# claim every request they hold queued): what a decode that died before registering
# costs it, instead of the transfer deadline. 60 heartbeat intervals and ten liveness
# timeouts: a living decode that claims never loses a transfer to it unless its
# heartbeats stop that long, nor one whose decode leg reaches the decode's engine that
# long after the prefill offered it (a router's time between its legs, the decode
# server's time to add the request). Null in `kv_connector_extra_config`: off (the
# deadline), for decodes of kvpush before claims, which register only once vLLM gives
# the request blocks (docs/vllm.md, "A decode that dies").
DEFAULT_CLAIM_WINDOW_S = 30.0
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
        "allow_doctor_writes",
        *TIMING_KEYS,
    }
)


def pipeline_refusal(kv_role: str, pp_size: int, tp_size: int) -> str:
    """Why a server that may receive KV (`kv_consumer`, `kv_both`) cannot run
    KvpushConnector at pipeline parallelism `pp_size`, what does run, and what to do
    instead (raised at start-up).

    A prefill's pipeline stages each push their own layers into a decode that holds
    every layer (`kvpush.geometry.PipelineStage`). A decode of several stages would
    have each stage register only its layers, and every prefill stage (or rank) pair
    with the decode stages holding its layers: not built, and carried by none of
    vLLM's NIXL connectors either (its NixlPushConnector counts completions per
    consumer rank and refuses a PP consumer)."""
    workers = pp_size * tp_size
    return (
        f"pipeline_parallel_size is {pp_size} on a server with kv_role {kv_role!r}: "
        "KvpushConnector carries a pipeline-parallel prefill into a decode without "
        "pipeline stages, not a decode (or kv_both server) with them; expected 1. "
        f"Found: kv_role {kv_role!r}, {pp_size} pipeline stages of "
        f"tensor_parallel_size {tp_size} ({workers} workers). "
        "Supported: a kv_producer at any pipeline_parallel_size into a kv_consumer at "
        "pipeline_parallel_size 1, with the tensor-parallel sizes docs/vllm.md lists under "
        '"Deployment shapes". '
        f"Next: start this server with --pipeline-parallel-size 1 (to keep {workers} "
        f"workers: --tensor-parallel-size {workers}, if the model's attention heads "
        f"divide by {workers}); a decode with pipeline stages is carried by none of vLLM's "
        "NIXL connectors either (its NixlPushConnector refuses a kv_consumer at "
        "pipeline_parallel_size > 1)."
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
    # vLLM's `--kv-cache-dtype` ("auto": the model's dtype). A quantized one (fp8*) is
    # named in the compatibility check with its scales (`kvcache.cache_dtype_name`).
    cache_dtype: str = "auto"
    # The model's layers, every pipeline stage's together (vLLM's total hidden layers):
    # with stages, what a decode must hold as many regions as (`PipelineStage`). None
    # where the engine has no stages.
    model_layers: int | None = None
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
    # Whether vLLM adds its random suffix to request ids (unless
    # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION): `pairing_id` cuts it off.
    request_ids_randomized: bool = True
    # Whether each rank takes `kvpush doctor`'s test writes (a scratch buffer beside its
    # KV cache, `integrations.vllm.doctor`) without a token; with one it always does.
    allow_doctor_writes: bool = False

    @property
    def doctor_writes(self) -> bool:
        """Whether the ranks take the doctor's test writes."""
        return self.token is not None or self.allow_doctor_writes

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> ConnectorConfig:
        from vllm import envs

        kv = vllm_config.kv_transfer_config
        if kv.kv_role not in VLLM_KV_ROLES:
            raise ConfigError(
                f"kv_role {kv.kv_role!r} is not supported by KvpushConnector: expected "
                f"one of {', '.join(VLLM_KV_ROLES)}"
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
        timing = _timing(extra)
        parallel = vllm_config.parallel_config
        pp_size = int(parallel.pipeline_parallel_size)
        if pp_size > 1 and kv.kv_role != "kv_producer":
            raise ConfigError(pipeline_refusal(kv.kv_role, pp_size, parallel.tensor_parallel_size))
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
            role=VLLM_KV_ROLES[kv.kv_role],
            side_channel_host=str(extra.get("side_channel_host", envs.VLLM_NIXL_SIDE_CHANNEL_HOST)),
            side_channel_port=port,
            token=load_token(Path(token_file) if token_file else None),
            timing=timing,
            tp_size=int(parallel.tensor_parallel_size),
            # MLA's cache is one latent per token, whatever the model's head count.
            total_kv_heads=1 if use_mla else int(vllm_config.model_config.get_total_num_kv_heads()),
            use_mla=use_mla,
            pp_size=pp_size,
            model_layers=(
                int(vllm_config.model_config.get_total_num_hidden_layers()) if pp_size > 1 else None
            ),
            dcp_size=int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
            block_size_tokens=int(vllm_config.cache_config.block_size),
            cache_dtype=str(getattr(vllm_config.cache_config, "cache_dtype", "auto")),
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
            request_ids_randomized=not bool(
                getattr(envs, "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", False)
            ),
            allow_doctor_writes=bool(extra.get("allow_doctor_writes", False)),
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


def _timing(extra: Mapping[str, Any]) -> TimingConfig:
    """`kv_connector_extra_config`'s timing keys over kvpush's defaults, with the claim
    window on (`DEFAULT_CLAIM_WINDOW_S`) unless set, or set to null (off)."""
    values: dict[str, float | None] = {"claim_window_s": DEFAULT_CLAIM_WINDOW_S}
    for key in TIMING_KEYS:
        if key not in extra:
            continue
        value = extra[key]
        if value is None and key == "claim_window_s":
            values[key] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ConfigError(
                f"kv_connector_extra_config.{key} is {value!r}: expected a number of seconds"
                + (" (or null: off)" if key == "claim_window_s" else "")
            )
        try:
            values[key] = float(value)
        except ValueError:
            raise ConfigError(
                f"kv_connector_extra_config.{key} is {value!r}: expected a number of seconds"
            ) from None
    return TimingConfig(**values)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class PrefillTransfer:
    """What a prefill request's params say of its transfer."""

    transfer_id: str  # the proxy's, or a fresh one the prefill answers with
    decode: tuple[str, int] | None  # the decode server's side channel, if named
    # The decode TP to split the transfer for; None: not named (a router that speaks
    # vLLM's push dialect): the worker learns it from the decode's registration.
    decode_tp_size: int | None


# vLLM's suffix on every request id: "-" and the first 8 characters of a uuid4's hex.
_VLLM_SUFFIX = re.compile(r"-[0-9a-f]{8}\Z")
# How much of the client's id a pairing id shows (for logs); the digest covers all of it.
_SHOWN_ID_CHARS = 120


def client_request_id(request_id: str, config: ConnectorConfig) -> str:
    """A request's id as its client gave it (for the OpenAI API: `cmpl-` or `chatcmpl-`
    and the `X-Request-Id` header), without the suffix vLLM adds."""
    if config.request_ids_randomized and _VLLM_SUFFIX.search(request_id):
        return request_id[:-9]
    return request_id


def pairing_id(
    client_id: str,
    prompt_token_ids: Sequence[int],
    *,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> str:
    """The transfer id both sides of a request give it when no `transfer_id` names it:
    the client's request id and a digest of it and of everything the request's KV is
    computed from, so requests that share an id but not a prompt never share a transfer.
    Both sides must call it before vLLM changes the prompt (a Mamba prefill drops its
    last token): the scheduler does, when vLLM adds the request."""
    digest = hashlib.blake2b(digest_size=16)
    for part in (client_id, cache_salt or "", lora_name or ""):
        data = part.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little") + data)
    digest.update(len(prompt_token_ids).to_bytes(8, "little"))
    digest.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in prompt_token_ids))
    return f"{client_id[:_SHOWN_ID_CHARS]}@{digest.hexdigest()}"


def prefill_transfer(
    params: Mapping[str, Any], config: ConnectorConfig, pairing: str | None = None
) -> PrefillTransfer:
    """A prefill request's transfer, from its params: the id they name, else `pairing`
    (the request's `pairing_id`), else a fresh one. Params that cannot be read (vLLM
    cannot refuse a request at this point) give a fresh id, no decode and our TP: the
    decode server refuses a transfer split for another TP than its own, saying so."""
    try:
        params_read = parse_remote_decode(params)
    except BadTransferParams as exc:
        log.warning("%s: the transfer gets a fresh id", exc)
        params_read = RemoteDecode()
        pairing = None
    return PrefillTransfer(
        params_read.transfer_id or pairing or f"{config.engine_id}-{uuid.uuid4().hex}",
        params_read.decode_server(),
        params_read.decode_tp_size,
    )


def prefill_answer(
    config: ConnectorConfig,
    *,
    transfer_id: str,
    request_id: str,
    block_ids: list[int],
    num_tokens: int,
    decode_tp_size: int | None,
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
    "DEFAULT_CLAIM_WINDOW_S",
    "EXTRA_CONFIG_KEYS",
    "ConnectorConfig",
    "PrefillTransfer",
    "client_request_id",
    "pairing_id",
    "pipeline_refusal",
    "prefill_answer",
    "prefill_transfer",
]
