"""The role vocabularies, each defined once.

- A rank's role in transfers (`RUNTIME_ROLES`): "sender" (a prefill's), "receiver" (a
  decode's) or "both". A runtime is started with one, and peers read it from its
  side-channel metadata.
- A server's role (`SERVER_ROLES`): "both", "prefill" or "decode", as `kvpush serve
  --role` takes it; `PAIR_ROLES` are the two sides of a pair, as the tools that check or
  measure a pair name them. `runtime_role` maps a prefill or decode server to its ranks' role.
- vLLM's `kv_role` (`VLLM_KV_ROLES`): "kv_producer", "kv_consumer" or "kv_both", each
  with the runtime role its connector runs.
"""

from __future__ import annotations

RUNTIME_ROLES = ("sender", "receiver", "both")
SERVER_ROLES = ("both", "prefill", "decode")
PAIR_ROLES = ("prefill", "decode")
VLLM_KV_ROLES = {"kv_producer": "sender", "kv_consumer": "receiver", "kv_both": "both"}

_RUNTIME_ROLE_OF_SERVER = {"prefill": "sender", "decode": "receiver", "both": "both"}


def runtime_role(server_role: str) -> str:
    """The role in transfers of a server's ranks: a prefill's send, a decode's receive."""
    try:
        return _RUNTIME_ROLE_OF_SERVER[server_role]
    except KeyError:
        raise ValueError(
            f"server role {server_role!r}: expected one of {', '.join(SERVER_ROLES)}"
        ) from None
