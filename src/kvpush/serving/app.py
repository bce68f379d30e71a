"""Assemble and run one server process: model, engine, engine thread, HTTP app, uvicorn."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from kvpush.config import TimingConfig, load_token
from kvpush.errors import ConfigError
from kvpush.net import check_port, unbracket_host
from kvpush.serving.checkpoint import load_model
from kvpush.serving.engine import Engine, SpecConfig
from kvpush.serving.http import DEFAULT_MAX_BODY_BYTES, Terminated, stopped_by_sigterm
from kvpush.serving.metrics import serving_registry
from kvpush.serving.server import create_app
from kvpush.serving.worker import AdmissionConfig, EngineWorker

log = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class ServeOptions:
    model: str
    role: str = "both"
    host: str = "127.0.0.1"
    port: int = 8000
    side_channel_port: int | None = None
    served_model_name: str | None = None
    block_size: int = 16
    num_blocks: int = 1024
    max_batch_tokens: int = 4096
    speculative_tokens: int = 0
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    prefix_caching: bool = True
    layerwise: bool = False
    idle_poll_ms: float = 5.0
    # The side channel's secret (else $KVPUSH_TOKEN, else none); /kvpush/abort needs it too.
    token_file: str | None = None
    log_level: int = 0
    max_waiting: int = 512  # requests queued for KV blocks; one more gets 429
    queue_timeout_s: float = 30.0  # a request queued longer gets 503
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    # A transfer not finished by then fails; keep it above the other side's queue timeout.
    transfer_deadline_s: float = TimingConfig().transfer_deadline_s

    def admission(self) -> AdmissionConfig:
        return AdmissionConfig(max_waiting=self.max_waiting, queue_timeout_s=self.queue_timeout_s)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role {self.role!r}: expected one of {', '.join(ROLES)}")
        check_port(self.port)
        if self.role != "both" and self.side_channel_port is None:
            raise ConfigError(f"--role {self.role} needs --side-channel-port")
        for name in ("block_size", "num_blocks", "max_batch_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_waiting < 0 or self.queue_timeout_s <= 0 or self.max_body_bytes <= 0:
            raise ConfigError(
                "max_waiting must be 0 or more, queue_timeout_s and max_body_bytes positive"
            )
        if self.transfer_deadline_s <= 0:
            raise ConfigError(
                f"transfer_deadline_s must be positive, got {self.transfer_deadline_s}"
            )
        if self.idle_poll_ms <= 0:
            raise ConfigError(f"idle_poll_ms must be positive, got {self.idle_poll_ms}")
        if self.speculative_tokens < 0:
            raise ConfigError("speculative_tokens must be 0 (off) or positive")
        if self.speculative_tokens and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max")


def serve(options: ServeOptions) -> int:
    """Run a server until interrupted; returns the process exit code."""
    import uvicorn

    loaded = load_model(options.model)
    spec = (
        SpecConfig(
            num_speculative_tokens=options.speculative_tokens,
            prompt_lookup_max=options.prompt_lookup_max,
            prompt_lookup_min=options.prompt_lookup_min,
        )
        if options.speculative_tokens
        else None
    )
    engine = Engine(
        loaded.model,
        num_blocks=options.num_blocks,
        block_size=options.block_size,
        max_batch_tokens=options.max_batch_tokens,
        spec=spec,
        enable_prefix_caching=options.prefix_caching,
    )
    token = load_token(options.token_file)
    name = options.served_model_name or Path(options.model).resolve().name
    registry = serving_registry()
    bridge = None
    prepare = None
    health_extra = None
    worker: EngineWorker
    if options.role != "both":
        from kvpush.serving.disagg import build_role

        worker, bridge, prepare, health_extra = build_role(options, engine, registry, token)
    else:
        worker = EngineWorker(engine, admission=options.admission())
    app = create_app(
        worker,
        loaded.tokenizer,
        registry,
        model_name=name,
        role=options.role,
        vocab_size=loaded.config.vocab_size,
        max_model_len=loaded.config.max_position_embeddings,
        prepare=prepare,
        health_extra=health_extra,
        max_body_bytes=options.max_body_bytes,
        chat_template=loaded.chat_template,
        internal_token=token,
    )
    config = uvicorn.Config(
        app,
        host=unbracket_host(options.host),
        port=options.port,
        log_config=None,
        access_log=options.log_level >= 2,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    worker.start()
    try:
        with stopped_by_sigterm():
            server.run()
    except (KeyboardInterrupt, Terminated):
        # uvicorn re-raises the SIGINT or SIGTERM it captured once it has shut down
        # gracefully: being stopped is this command's normal end.
        pass
    finally:
        worker.close()
        if bridge is not None:
            bridge.close()
    return 0 if server.started else 1
