"""kvpush on Ray Serve LLM: a KV connector backend for `build_pd_openai_app`.

One call, in the driver, before the app is deployed::

    import kvpush.integrations.ray
    kvpush.integrations.ray.register()

and both deployments' engines name the connector::

    engine_kwargs={"kv_transfer_config": {"kv_connector": "KvpushConnector",
                                          "kv_role": "kv_producer"}}   # "kv_consumer"

Ray Serve LLM looks a connector's backend up by the engine's `kv_connector`
(`KVConnectorBackendFactory`, a registry in Ray's cluster store that every replica
reads); an unknown name falls back, with only a warning, to a default backend that runs
the legs in turn on ports that collide between replicas. `register()` maps the name to
`KvpushConnectorBackend` by its import path, so a replica imports it only when it
builds an engine. docs/deploy.md has the whole app.

`backend` imports Ray; `legs` (what each leg carries) does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpush.integrations.ray.backend import KvpushConnectorBackend

# The name Ray looks up: the engine's `kv_transfer_config.kv_connector`.
CONNECTOR_NAME = "KvpushConnector"
BACKEND_PATH = "kvpush.integrations.ray.backend:KvpushConnectorBackend"


def register() -> None:
    """Register `KvpushConnectorBackend` under `KvpushConnector` with Ray Serve LLM.

    Idempotent. Call it in the driver (before or after `ray.init()`); replicas read the
    registration from the cluster. Raises `ConfigError` where another backend holds the
    name, and `ImportError` where Ray Serve LLM is not installed."""
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import (
        KVConnectorBackendFactory,
    )

    from kvpush.errors import ConfigError

    if KVConnectorBackendFactory.is_registered(CONNECTOR_NAME):
        held = KVConnectorBackendFactory.get_backend_class(CONNECTOR_NAME)
        if f"{held.__module__}:{held.__qualname__}" != BACKEND_PATH:
            raise ConfigError(
                f"Ray Serve LLM already maps {CONNECTOR_NAME!r} to {held.__module__}."
                f"{held.__qualname__}, not kvpush's backend ({BACKEND_PATH}): unregister it "
                "first (KVConnectorBackendFactory.unregister_backend)"
            )
        return
    KVConnectorBackendFactory.register_backend(CONNECTOR_NAME, BACKEND_PATH)


__all__ = ["BACKEND_PATH", "CONNECTOR_NAME", "KvpushConnectorBackend", "register"]


def __getattr__(name: str) -> Any:
    if name == "KvpushConnectorBackend":
        from kvpush.integrations.ray.backend import KvpushConnectorBackend

        return KvpushConnectorBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
