"""Assemble and run one server process: model, engine, engine thread, HTTP app, uvicorn.

(`ServeOptions` lives in `options`, which both this module and the roles in `disagg` read.)"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from kvpush.config import load_token
from kvpush.net import unbracket_host
from kvpush.serving.checkpoint import load_model
from kvpush.serving.engine import Engine
from kvpush.serving.http import Terminated, stopped_by_sigterm
from kvpush.serving.metrics import serving_registry
from kvpush.serving.options import ServeOptions
from kvpush.serving.sampling import SpecConfig
from kvpush.serving.server import ServerSettings, create_app
from kvpush.serving.worker import EngineWorker, Jobs

log = logging.getLogger(__name__)


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
        worker = EngineWorker(engine, jobs=Jobs(options.admission()))
    settings = ServerSettings(
        model_name=name,
        role=options.role,
        vocab_size=loaded.config.vocab_size,
        max_model_len=loaded.config.max_position_embeddings,
        prepare=prepare,
        health_extra=health_extra,
        max_body_bytes=options.max_body_bytes,
        chat_template=loaded.chat_template,
        internal_token=token,
        metrics_extra=None if bridge is None else lambda: bridge.update_metrics(registry),
    )
    app = create_app(worker, loaded.tokenizer, registry, settings)
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
        # No new legs come in now (HTTP stopped): the transfers held may still finish
        # within the drain bound; closing the runtime then hands back the rest and
        # tells each peer (Failed, Cancel, Reject), so nobody waits for a deadline.
        if bridge is not None and server.started:
            with contextlib.suppress(KeyboardInterrupt):  # a second ^C: close at once
                bridge.drain(options.drain_s)
        worker.close()
        if bridge is not None:
            bridge.close()
    return 0 if server.started else 1


__all__ = ["ServeOptions", "serve"]
