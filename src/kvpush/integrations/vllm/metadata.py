"""What the connector's two halves tell each other through vLLM.

- `StepPlan` (scheduler -> every worker, once per engine step, as vLLM's connector
  metadata): the transfers to start, refuse or abort on this step. Each worker rank
  carries out the same plan with its own runtime, towards the same rank of the peer.
- `RankMetadata` (worker -> scheduler, once, after the KV cache is registered, as vLLM's
  handshake metadata): the rank's `PeerMetadata`, msgpack-encoded, for the one side
  channel that serves every rank of the engine.

Both cross process boundaries inside vLLM (pickled), so they hold only plain values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from kvpush.sidechannel import PeerMetadata


@dataclass(frozen=True, slots=True)
class Receive:
    """Decode side: expect `transfer_id` from the sender's side channel into `blocks`;
    `blocks[i]` receives the sender's block `sender_offset + i`."""

    request_id: str
    transfer_id: str
    host: str
    port: int
    blocks: tuple[int, ...]
    sender_offset: int


@dataclass(frozen=True, slots=True)
class Refuse:
    """Decode side: tell the sender at once that `transfer_id` will never be received,
    so it frees its blocks (a request aborted before it was scheduled, a full local
    prefix-cache hit)."""

    transfer_id: str
    host: str
    port: int
    detail: str


@dataclass(frozen=True, slots=True)
class Send:
    """Prefill side: offer `blocks` (all layers computed) for `transfer_id`. With
    `cancel`, the request ended without its KV (aborted): the transfer is opened with
    no layer ready and aborted at once, so the receiver hears of it now, nothing is
    written, and the blocks come back through the runtime's result like any other.
    With `layerwise`, this step computes the prompt's last tokens: the transfer is
    opened with no layer ready before the first layer's KV is saved, and each layer is
    announced once this step computed it (`save_kv_layer`; all by `wait_for_save`)."""

    request_id: str
    transfer_id: str
    blocks: tuple[int, ...]
    cancel: bool = False
    layerwise: bool = False


@dataclass
class StepPlan(KVConnectorMetadata):
    receives: list[Receive] = field(default_factory=list)
    refusals: list[Refuse] = field(default_factory=list)
    sends: list[Send] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # transfer ids
    # Nothing is computed on this step: the worker may wait a little for a transfer to
    # end instead of returning at once (an engine that only waits must not spin).
    idle: bool = False


@dataclass
class RankMetadata(KVConnectorHandshakeMetadata):
    encoded: bytes

    @classmethod
    def of(cls, metadata: PeerMetadata) -> RankMetadata:
        return cls(msgspec.msgpack.encode(metadata))

    def decode(self) -> PeerMetadata:
        return msgspec.msgpack.decode(self.encoded, type=PeerMetadata)
