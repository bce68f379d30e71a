"""What the Ray Serve backend puts in each leg, as plain values (no Ray, no vLLM).

Ray Serve LLM's P/D orchestrator runs in the decode replica. With peer binding it picks
the prefill replica first and hands the backend that replica's `replica_metadata()`;
with concurrent handoff it shapes both legs, one right after the other, and sends them
at once. So the decode leg cannot learn anything from the prefill's answer: each leg
is told everything up front, in `kvpush.transfer_params`' contract (the one the vLLM
connector reads):

- the prefill leg (`RemoteDecode`): a fresh `transfer_id`, and the decode replica's side
  channel and TP size, so only that decode may take the transfer, split for its ranks;
- the decode leg (`RemotePrefill`): the same `transfer_id`, and the prefill replica's
  side channel, engine id, TP size and block size, which it published
  (`ReplicaSideChannel.metadata`).

The decode registers its blocks as soon as vLLM allocated them, while the prefill
computes; the prefill writes each layer as it is computed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpush.errors import ConfigError
from kvpush.net import unbracket_host
from kvpush.transfer_params import MAX_TEXT_CHARS, MAX_TP_SIZE, RemoteDecode, RemotePrefill

# The key a prefill replica's `replica_metadata()` publishes its side channel under.
METADATA_KEY = "kvpush_side_channel"


@dataclass(frozen=True, slots=True)
class ReplicaSideChannel:
    """One replica's engine as its peers name it: its side channel (one port serves every
    TP rank of the engine), its engine id, TP size and block size in tokens (None: the
    engine's default, which the peer then takes to be its own)."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    block_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("engine_id", "host"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or len(value) > MAX_TEXT_CHARS:
                raise ConfigError(
                    f"the replica's {name} must be a non-empty string of at most "
                    f"{MAX_TEXT_CHARS} characters, got {value!r}"
                )
        if not _is_int(self.port) or not 0 < self.port < 65536:
            raise ConfigError(
                f"the replica's side-channel port must be in 1..65535, got {self.port!r}"
            )
        if not _is_int(self.tp_size) or not 0 < self.tp_size <= MAX_TP_SIZE:
            raise ConfigError(
                f"the replica's tp_size must be an integer in 1..{MAX_TP_SIZE}, got "
                f"{self.tp_size!r}"
            )
        if self.block_size is not None and (not _is_int(self.block_size) or self.block_size <= 0):
            raise ConfigError(
                f"the replica's block_size must be a positive integer or None, got "
                f"{self.block_size!r}"
            )

    def metadata(self) -> dict[str, Any]:
        """What a prefill replica publishes (`replica_metadata()`): a plain dict."""
        return {
            METADATA_KEY: {
                "engine_id": self.engine_id,
                "host": self.host,
                "port": self.port,
                "tp_size": self.tp_size,
                "block_size": self.block_size,
            }
        }

    @classmethod
    def from_metadata(cls, peer: Mapping[str, Any] | None) -> ReplicaSideChannel:
        """The prefill replica the orchestrator picked, from what it published; a clear
        error where it published no kvpush side channel."""
        published = (peer or {}).get(METADATA_KEY)
        if not isinstance(published, Mapping):
            raise ConfigError(
                f"the selected prefill replica published no kvpush side channel (its "
                f"replica metadata is {dict(peer or {})!r}, expected a {METADATA_KEY!r} "
                "entry): its deployment's kv_connector must be KvpushConnector too, with "
                "kvpush.integrations.ray.register() called before the app is deployed"
            )
        try:
            return cls(
                engine_id=published.get("engine_id"),  # type: ignore[arg-type]
                host=published.get("host"),  # type: ignore[arg-type]
                port=published.get("port"),  # type: ignore[arg-type]
                tp_size=published.get("tp_size", 1),
                block_size=published.get("block_size"),
            )
        except ConfigError as exc:
            raise ConfigError(f"the selected prefill replica's metadata: {exc}") from exc


def replica_port(base: int, offset: int) -> int:
    """A replica's side-channel port: `base` plus its offset (Ray's `_compute_port_offset`:
    the replica's rank times its devices, or its data-parallel rank)."""
    port = base + offset
    if not 0 < port < 65536:
        raise ConfigError(
            f"side-channel port base {base} plus this replica's offset {offset} is {port}, "
            "out of 1..65535: lower KVPUSH_SIDE_CHANNEL_PORT_BASE in experimental_configs"
        )
    return port


def prefill_leg(transfer_id: str, decode: ReplicaSideChannel) -> dict[str, Any]:
    """The prefill leg's `kv_transfer_params`: push `transfer_id` to that decode only."""
    return RemoteDecode(
        transfer_id=transfer_id,
        decode_host=decode.host,
        decode_port=decode.port,
        decode_tp_size=decode.tp_size,
    ).to_params()


def decode_leg(
    transfer_id: str, prefill: ReplicaSideChannel, decode: ReplicaSideChannel
) -> dict[str, Any]:
    """The decode leg's `kv_transfer_params`: receive `transfer_id` from that prefill."""
    return RemotePrefill(
        transfer_id=transfer_id,
        remote_host=unbracket_host(prefill.host),
        remote_port=prefill.port,
        remote_engine_id=prefill.engine_id,
        tp_size=prefill.tp_size,
        decode_tp_size=decode.tp_size,
        block_size=prefill.block_size,
    ).to_params()


class LegPairs:
    """The transfer id each prefill leg was given, until its decode leg takes it.

    The orchestrator shapes a request's prefill leg and then its decode leg from the same
    request object, with nothing in between; one backend serves every request of the
    replica, so the id is handed over by that object. At most `limit` ids wait (a leg
    never taken is dropped, oldest first)."""

    def __init__(self, limit: int = 4096) -> None:
        self._limit = limit
        self._waiting: OrderedDict[int, tuple[object, str]] = OrderedDict()

    def give(self, request: object, transfer_id: str) -> None:
        self._waiting[id(request)] = (request, transfer_id)
        while len(self._waiting) > self._limit:
            self._waiting.popitem(last=False)

    def take(self, request: object) -> str:
        entry = self._waiting.pop(id(request), None)
        if entry is None or entry[0] is not request:
            raise ConfigError(
                "a decode leg was shaped for a request whose prefill leg this backend did "
                "not shape first: KvpushConnector's Ray backend expects Ray Serve's P/D "
                "orchestrator to shape the prefill leg, then the decode leg"
            )
        return entry[1]

    def __len__(self) -> int:
        return len(self._waiting)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


__all__ = [
    "METADATA_KEY",
    "LegPairs",
    "ReplicaSideChannel",
    "decode_leg",
    "prefill_leg",
    "replica_port",
]
