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
regions), `metadata` (what the halves send each other), `params` (`kv_transfer_params`
and settings), `stats` (logging and Prometheus), `compat` (supported vLLM releases).
docs/vllm.md is the user's guide. Importing this package imports vLLM.
"""

from kvpush.integrations.vllm.connector import KvpushConnector

__all__ = ["KvpushConnector"]
