"""kvpush under NVIDIA Dynamo's vLLM worker: the one registry entry it needs.

Dynamo's vLLM prefill handler (`dynamo.vllm.handlers.PrefillWorkerHandler`, ai-dynamo
1.6.1) asks `dynamo.vllm.kv_connector_protocols.make_kv_connector_protocol` for the
protocol of the engine's `kv_connector`, looked up by name in `KV_CONNECTOR_PROTOCOLS`,
and refuses a name that is not there ("Unsupported kv_connector='KvpushConnector' for
PD ... add it to KV_CONNECTOR_PROTOCOLS"). The protocol gives the prefill request's
`kv_transfer_params`, and, from the prefill engine's output, the decode request's; the
prefill handler returns the latter and Dynamo hands it to the decode worker, which puts
it on its request unchanged. The legs run in turn.

`KvpushConnector` speaks that dialect as vLLM's `NixlConnector` does
(`kvpush.integrations.vllm.params`): a prefill request asking `do_remote_decode` (the
NIXL protocol's other fields None) gets a fresh transfer id, its answer carries every
NIXL connector field plus `transfer_id`, and a decode request that carries the answer
unchanged receives that transfer. So Dynamo's own `NixlConnectorProtocol` is kvpush's
protocol, and the entry maps the name to it.

`register_with_dynamo()` adds the entry to the registry of the running process, leaving
Dynamo's files alone. Only the prefill worker resolves protocols, per request: call it
in that process before it serves (docs/deploy.md shows a launcher).
"""

from __future__ import annotations

from typing import Any

# The name Dynamo looks up: the engine's `kv_transfer_config.kv_connector`.
CONNECTOR_NAME = "KvpushConnector"


def register_with_dynamo() -> type[Any]:
    """Map `KvpushConnector` to Dynamo's NIXL protocol in `KV_CONNECTOR_PROTOCOLS`;
    returns the protocol class the name now resolves to.

    Idempotent. An entry Dynamo already has for the name is kept (a Dynamo release that
    knows kvpush knows best). Raises `ImportError` where Dynamo's vLLM package is not
    installed."""
    from dynamo.vllm.kv_connector_protocols import (
        KV_CONNECTOR_PROTOCOLS,
        NixlConnectorProtocol,
    )

    protocol: type[Any] = KV_CONNECTOR_PROTOCOLS.setdefault(CONNECTOR_NAME, NixlConnectorProtocol)
    return protocol


__all__ = ["CONNECTOR_NAME", "register_with_dynamo"]
