"""The `kv_transfer_params` contract: what a request and its answer say about a transfer.

One typed struct per shape, one parser per request shape, one set of error messages; the
proxy, the serving stack and the vLLM connector all use these. The fields are vLLM's NIXL
connectors' (a proxy written for `NixlConnector` sends the same), plus `transfer_id`,
which pairs the prefill's and the decode's halves of one transfer end to end.

- `RemotePrefill`: a decode request's (`do_remote_prefill`): where its KV comes from.
- `RemoteDecode`: a prefill request's (`do_remote_decode`): the transfer's id, if given, and
  the decode server's side channel, which alone may take it, if the proxy knows it.
- `PrefillAnswer`: what a vLLM prefill server answers (every NIXL connector field).
- `PrefillComputed`: what a kvpush serving prefill server answers.

Ports: `remote_port` is an integer in 1..65535, or such an integer written in decimal
digits (`"5600"`). The string form is accepted because proxies written for vLLM's NIXL
connectors may forward the port as text; it is read as the integer it spells, and every
answer carries the integer. Strings (`transfer_id`, `remote_host`) are non-empty and at
most `MAX_TEXT_CHARS` characters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from kvpush.errors import ConfigError
from kvpush.net import unbracket_host

MAX_TEXT_CHARS = 256
# Tensor-parallel sizes in params beyond any deployment: refused, not planned for.
MAX_TP_SIZE = 1024
# Block sizes in params beyond any engine's (vLLM's largest is a few thousand tokens).
MAX_BLOCK_SIZE = 1 << 20

# The flags that say which shape a request's params have.
REMOTE_PREFILL = "do_remote_prefill"
REMOTE_DECODE = "do_remote_decode"


class BadTransferParams(ConfigError):
    """A request's `kv_transfer_params` cannot be used: the message names the field, what
    it was and what was expected."""


class RemotePrefill(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A decode request's params: its KV comes from the prefill server whose side channel
    is `remote_host`:`remote_port`, as the transfer `transfer_id`."""

    transfer_id: str
    remote_host: str
    remote_port: int
    remote_engine_id: str | None = None
    tp_size: int | None = None  # the prefill's tensor-parallel size
    # The decode TP the prefill split the transfer for (its parts, one per rank pair);
    # None: not said, the decode's own (a prefill not told it learns it from the parts
    # the decode registers).
    decode_tp_size: int | None = None
    # The prefill's block size in tokens (None: not said; taken to be the decode's).
    block_size: int | None = None
    # The prefill's pipeline-parallel size: each stage sends its own layers (None: 1).
    pp_size: int | None = None

    def to_params(self) -> dict[str, Any]:
        return {REMOTE_PREFILL: True, **msgspec.to_builtins(self)}


class RemoteDecode(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A prefill request's params: its KV goes to a decode server, as `transfer_id`
    (None: not given; a vLLM prefill server then names the transfer in its answer).

    `decode_host`:`decode_port`: that decode server's side channel, when the proxy knows
    it: only a receiver that side channel serves may take the transfer (None: the first
    one the prefill's side channel admits; see the README's trust model).

    `decode_tp_size`: that decode server's tensor-parallel size, which the prefill splits
    the transfer for (None: the prefill's own)."""

    transfer_id: str | None = None
    decode_host: str | None = None
    decode_port: int | None = None
    decode_tp_size: int | None = None

    def to_params(self) -> dict[str, Any]:
        return {REMOTE_DECODE: True, **msgspec.to_builtins(self)}

    def decode_server(self) -> tuple[str, int] | None:
        """The named decode server's side channel (host, port), or None."""
        if self.decode_host is None or self.decode_port is None:
            return None
        return self.decode_host, self.decode_port


class PrefillAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """A vLLM prefill server's answer: every field vLLM's NIXL connectors return (so
    routers that forward it to the decode server route kvpush unchanged), plus
    `transfer_id`. Read back by `parse_remote_prefill`."""

    do_remote_prefill: bool
    do_remote_decode: bool
    remote_block_ids: list[int]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    tp_size: int
    dcp_size: int
    pp_size: int
    remote_num_tokens: int
    transfer_mode: str
    transfer_id: str
    # The decode TP the transfer was split for; None: the decode's own, whichever it is
    # (the prefill learns it from the decode's registration).
    decode_tp_size: int | None
    block_size: int  # the prefill's, in tokens: the unit the decode registers in

    def to_params(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


class PrefillComputed(msgspec.Struct, frozen=True, kw_only=True):
    """A kvpush serving prefill server's answer: the prompt is computed and its KV is
    offered as `transfer_id`, `num_blocks` blocks, for the prompt `prompt_fingerprint`."""

    transfer_id: str
    num_blocks: int
    prompt_fingerprint: str

    def to_params(self) -> dict[str, Any]:
        return {REMOTE_DECODE: True, **msgspec.to_builtins(self)}


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """Whether a request's KV comes from a prefill server (a decode request)."""
    return bool(params and params.get(REMOTE_PREFILL))


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Whether a request's KV goes to a decode server (a prefill request)."""
    return bool(params and params.get(REMOTE_DECODE))


def parse_remote_prefill(
    params: Mapping[str, Any], *, pairing_id: str | None = None
) -> RemotePrefill:
    """A decode request's params, checked; raises `BadTransferParams` naming the field.

    `pairing_id`: the transfer's id where the params name none, as routers that speak
    vLLM's push dialect send them (`remote_engine_id`, `remote_host`, `remote_port`,
    `tp_size`, `remote_request_id`): the engine derives it from the request itself, as
    the prefill did (`kvpush.integrations.vllm.params.pairing_id`)."""
    if params.get("transfer_id") is None and pairing_id is not None:
        tid = pairing_id
    else:
        tid = _text(params, "transfer_id", "the prefill server's answer carries it")
    host = _text(params, "remote_host", "the prefill server's side-channel host")
    port = _port(params, "remote_port")
    engine_id = params.get("remote_engine_id")
    return RemotePrefill(
        transfer_id=tid,
        remote_host=unbracket_host(host),
        remote_port=port,
        remote_engine_id=engine_id if isinstance(engine_id, str) else None,
        tp_size=_tp_size(params, "tp_size", "the prefill's tensor-parallel size"),
        decode_tp_size=_tp_size(
            params, "decode_tp_size", "the decode TP the prefill split the transfer for"
        ),
        block_size=_block_size(params),
        pp_size=_stages(params),
    )


def parse_remote_decode(
    params: Mapping[str, Any], *, require_transfer_id: bool = False
) -> RemoteDecode:
    """A prefill request's params, checked; raises `BadTransferParams` naming the field.
    Without `require_transfer_id`, a missing `transfer_id` is None."""
    tid = None
    if params.get("transfer_id") is not None or require_transfer_id:
        tid = _text(params, "transfer_id", "the proxy sets it")
    decode_tp = _tp_size(params, "decode_tp_size", "the decode server's tensor-parallel size")
    if params.get("decode_host") is None and params.get("decode_port") is None:
        return RemoteDecode(transfer_id=tid, decode_tp_size=decode_tp)
    hint = "the decode server's side-channel host, given with decode_port"
    host = _text(params, "decode_host", hint)
    return RemoteDecode(
        transfer_id=tid,
        decode_host=unbracket_host(host),
        decode_port=_port(params, "decode_port"),
        decode_tp_size=decode_tp,
    )


def _tp_size(params: Mapping[str, Any], key: str, hint: str) -> int | None:
    value = params.get(key)
    if value is None or (_is_int(value) and 0 < value <= MAX_TP_SIZE):
        return value
    raise BadTransferParams(
        f"kv_transfer_params.{key} must be an integer in 1..{MAX_TP_SIZE} ({hint}), got "
        f"{type(value).__name__} {value!r}"
    )


def _stages(params: Mapping[str, Any]) -> int | None:
    """The prefill's pipeline-parallel size; 1, which every vLLM prefill answer says,
    is read as unnamed (None): no stages."""
    pp_size = _tp_size(params, "pp_size", "the prefill's pipeline-parallel size")
    return None if pp_size == 1 else pp_size


def _block_size(params: Mapping[str, Any]) -> int | None:
    value = params.get("block_size")
    if value is None or (_is_int(value) and 0 < value <= MAX_BLOCK_SIZE):
        return value
    raise BadTransferParams(
        f"kv_transfer_params.block_size must be an integer in 1..{MAX_BLOCK_SIZE} (the "
        f"prefill's block size in tokens), got {type(value).__name__} {value!r}"
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(params: Mapping[str, Any], key: str, hint: str) -> str:
    value = params.get(key)
    if isinstance(value, str) and value and len(value) <= MAX_TEXT_CHARS:
        return value
    shown = value[:40] if isinstance(value, str) else value
    what = "missing" if key not in params else f"{type(value).__name__} {shown!r}"
    raise BadTransferParams(
        f"kv_transfer_params.{key} must be a non-empty string of at most {MAX_TEXT_CHARS} "
        f"characters ({hint}), got {what}"
    )


def _port(params: Mapping[str, Any], key: str) -> int:
    value = params.get(key)
    port = int(value) if isinstance(value, str) and value.isascii() and value.isdigit() else value
    if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
        return port
    what = "missing" if key not in params else f"{type(value).__name__} {value!r}"
    raise BadTransferParams(
        f"kv_transfer_params.{key} must be a port number (an integer in 1..65535, or one "
        f"written in decimal digits), got {what}"
    )


__all__ = [
    "MAX_TEXT_CHARS",
    "REMOTE_DECODE",
    "REMOTE_PREFILL",
    "BadTransferParams",
    "PrefillAnswer",
    "PrefillComputed",
    "RemoteDecode",
    "RemotePrefill",
    "parse_remote_decode",
    "parse_remote_prefill",
    "wants_remote_decode",
    "wants_remote_prefill",
]
