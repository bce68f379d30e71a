"""kvpush inside vLLM: an out-of-tree KV connector (push mode, over NIXL).

Load it with::

    python -m vllm.entrypoints.openai.api_server --model M ... \\
      --kv-transfer-config '{"kv_connector": "KvpushConnector",
        "kv_connector_module_path": "kvpush.integrations.vllm",
        "kv_role": "kv_producer",            # prefill; "kv_consumer" for decode
        "kv_connector_extra_config": {"side_channel_port": 5600}}'

The package is split where vLLM splits the connector: `connector` (the class vLLM
builds, forwarding only), `scheduler` (which requests move KV, their blocks, the side
channel), `worker` (one `PushRuntime` per rank), `kvcache` (vLLM's packed KV tensors as
regions), `groups` (a hybrid model's KV-cache groups: which blocks move), `plan` (what
the halves send each other, as plain values), `metadata` (the same as vLLM's types),
`params` (`kv_transfer_params` and settings), `stats` (logging and Prometheus), `compat`
(supported vLLM releases). docs/vllm.md is the user's guide.
`KvpushConnector` imports vLLM when first named (vLLM's loader does
`getattr(module, "KvpushConnector")`); `kvcache`, `params`, `plan` and `worker` do not,
so they are usable, and tested, without vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpush.integrations.vllm.connector import KvpushConnector

__all__ = ["KvpushConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvpushConnector":
        from kvpush.integrations.vllm.connector import KvpushConnector

        return KvpushConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
