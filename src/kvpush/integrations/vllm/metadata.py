"""What the connector's two halves tell each other through vLLM, as vLLM's types.

- `StepPlan` (scheduler -> every worker, once per engine step, as vLLM's connector
  metadata): `kvpush.integrations.vllm.plan.StepPlan`, as a `KVConnectorMetadata`.
- `RankMetadata` (worker -> scheduler, once, after the KV cache is registered, as vLLM's
  handshake metadata): the rank's `PeerMetadata`, msgpack-encoded, for the one side
  channel that serves every rank of the engine.

Both cross process boundaries inside vLLM (pickled), so they hold only plain values.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from kvpush.integrations.vllm import plan
from kvpush.integrations.vllm.plan import Claim, Receive, Refuse, Send
from kvpush.sidechannel import PeerMetadata

__all__ = ["Claim", "RankMetadata", "Receive", "Refuse", "Send", "StepPlan"]


@dataclass
class StepPlan(plan.StepPlan, KVConnectorMetadata):
    """The step's plan, as the metadata vLLM hands every worker."""


@dataclass
class RankMetadata(KVConnectorHandshakeMetadata):
    encoded: bytes

    @classmethod
    def of(cls, metadata: PeerMetadata) -> RankMetadata:
        return cls(msgspec.msgpack.encode(metadata))

    def decode(self) -> PeerMetadata:
        return msgspec.msgpack.decode(self.encoded, type=PeerMetadata)
