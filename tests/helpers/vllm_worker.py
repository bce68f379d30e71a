"""The config and transport a worker-level test of `KvpushConnector` builds its ranks
with: a real `WorkerSide` per rank, over the loopback data plane (no vLLM)."""

from __future__ import annotations

from collections.abc import Callable

from kvpush.config import TimingConfig
from kvpush.integrations.vllm.params import ConnectorConfig
from kvpush.runtime import TransferResult
from kvpush.transports.base import Transport
from kvpush.transports.loopback import LoopbackFabric, LoopbackTransport

HOST = "127.0.0.1"
# Liveness 10 s: a loaded 2-core host (vLLM servers beside it) starves in-process ranks'
# threads for seconds; tests that wait on liveness pass their own.
TIMING = TimingConfig(heartbeat_interval_s=0.2, liveness_timeout_s=10.0, lease_s=3.0)


def worker_config(
    name: str,
    role: str,
    side_channel_port: int,
    *,
    total_kv_heads: int,
    block_size_tokens: int,
    tp_size: int = 1,
    use_mla: bool = False,
    token: str | None = None,
    timing: TimingConfig = TIMING,
) -> ConnectorConfig:
    """One engine's connector config, its side channel on `HOST`."""
    return ConnectorConfig(
        engine_id=f"vllm-{name}",
        role=role,
        side_channel_host=HOST,
        side_channel_port=side_channel_port,
        token=token,
        timing=timing,
        tp_size=tp_size,
        total_kv_heads=total_kv_heads,
        use_mla=use_mla,
        pp_size=1,
        dcp_size=1,
        block_size_tokens=block_size_tokens,
        handshake_timeout_ms=1000,
    )


def loopback_factory(fabric: LoopbackFabric) -> Callable[[str], Transport]:
    """A rank's transport factory: a loopback transport on `fabric`."""

    def make(agent_name: str) -> Transport:
        return LoopbackTransport(fabric, agent_name)

    return make


class RecordingStats:
    """The worker's counts as a test reads them: why requests failed (at once or a part
    ending), and the bytes each side counts as moved."""

    def __init__(self) -> None:
        self.details: list[str] = []
        self.bytes: dict[str, int] = {}  # per side: what the worker counts as moved

    def opened(self, push: str) -> None:
        pass

    def layers_announced(self, by: str, n: int) -> None:
        pass

    def registered_first(self, n: int) -> None:
        pass

    def ended_at_once(self, side: str, why: str) -> None:
        self.details.append(why)

    def ended(self, result: TransferResult, seconds: float, bytes_per_block: int) -> None:
        if not result.ok:
            self.details.append(f"{result.reason}: {result.detail}")
        moved = result.blocks_moved * bytes_per_block
        self.bytes[result.side] = self.bytes.get(result.side, 0) + moved

    def is_empty(self) -> bool:
        return not self.details and not self.bytes
