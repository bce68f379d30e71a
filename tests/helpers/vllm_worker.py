"""The config and transport a worker-level test of `KvpushConnector` builds its ranks
with: a real `WorkerSide` per rank, over the loopback data plane (no vLLM)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, Protocol

from kvpush.config import SideChannelConfig, TimingConfig
from kvpush.errors import FailureReason
from kvpush.integrations.vllm.params import ConnectorConfig
from kvpush.integrations.vllm.plan import StepPlan, StepResults
from kvpush.runtime import TransferResult
from kvpush.sidechannel import MetadataServer
from kvpush.transports.base import Transport
from kvpush.transports.loopback import LoopbackFabric, LoopbackTransport

if TYPE_CHECKING:
    import torch

    from kvpush.integrations.vllm.worker import WorkerSide
    from kvpush.sidechannel import PeerMetadata

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
    pp_size: int = 1,
    model_layers: int | None = None,
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
        pp_size=pp_size,
        model_layers=model_layers,
        dcp_size=1,
        block_size_tokens=block_size_tokens,
        handshake_timeout_ms=1000,
    )


def loopback_factory(fabric: LoopbackFabric) -> Callable[[str], Transport]:
    """A rank's transport factory: a loopback transport on `fabric`."""

    def make(agent_name: str) -> Transport:
        return LoopbackTransport(fabric, agent_name)

    return make


class EngineRanks:
    """One engine as a worker-level test starts it: the scheduler's side channel (a real
    `MetadataServer` on `HOST`) and its ranks, each a real `WorkerSide` over `fabric`'s
    loopback data plane, started as vLLM starts them (caches registered, the rank's
    metadata handed to the side channel) and shut down with `stack`. What the caches
    hold, and how the engine steps, are the test's."""

    def __init__(self, stack: ExitStack, fabric: LoopbackFabric, *, token: str | None = None):
        self.stack, self.fabric = stack, fabric
        self.ranks: dict[int, PeerMetadata] = {}  # by side-channel rank
        self.server = stack.enter_context(
            MetadataServer(HOST, 0, SideChannelConfig(token=token), self.ranks)
        )

    @property
    def port(self) -> int:
        return self.server.port

    def start_rank(
        self,
        config: ConnectorConfig,
        rank: int,
        caches: dict[str, torch.Tensor],
        *,
        scales: Mapping[str, tuple[float, float]] | None = None,
        **worker_options: Any,
    ) -> WorkerSide[RecordingStats]:
        """Rank `rank`'s worker (`worker_options`: `WorkerSide`'s groups, state layers,
        stage), its `caches` registered, its metadata on the side channel."""
        from kvpush.integrations.vllm.worker import WorkerSide

        worker: WorkerSide[RecordingStats] = WorkerSide(
            config,
            rank,
            new_stats=RecordingStats,
            transport_factory=loopback_factory(self.fabric),
            **worker_options,
        )
        self.stack.callback(worker.shutdown)
        worker.register_kv_caches(caches, scales)
        meta = worker.handshake_metadata()
        assert meta is not None
        self.ranks[meta.rank] = meta
        return worker


class RecordingStats:
    """The worker's counts as a test reads them (what vLLM's `TransferStats` holds, plain):
    pushes opened by kind, layers announced, requests registered first, why requests
    failed (at once, or a part ending), the bytes each side counts as moved, and each
    part's id as it ended."""

    def __init__(self) -> None:
        self.pushes: Counter[str] = Counter()
        self.announced: Counter[str] = Counter()
        self.registered_first_total = 0
        self.failed_at_once: list[str] = []
        # Every failure in order: (reason, detail) of a part, (None, why) of one at once.
        self.failed: list[tuple[FailureReason | None, str]] = []
        self.details: list[str] = []  # the same, as text
        self.bytes: dict[str, int] = {}  # per side: what the worker counts as moved
        self.parts_ended: list[str] = []

    def opened(self, push: str) -> None:
        self.pushes[push] += 1

    def layers_announced(self, by: str, n: int) -> None:
        self.announced[by] += n

    def registered_first(self, n: int) -> None:
        self.registered_first_total += n

    def ended_at_once(self, side: str, why: str) -> None:
        self.failed_at_once.append(why)
        self.failed.append((None, why))
        self.details.append(why)

    def ended(self, result: TransferResult, seconds: float, bytes_per_block: int) -> None:
        self.parts_ended.append(result.transfer_id)
        if not result.ok:
            self.failed.append((result.reason, result.detail))
            self.details.append(f"{result.reason}: {result.detail}")
        moved = result.blocks_moved * bytes_per_block
        self.bytes[result.side] = self.bytes.get(result.side, 0) + moved

    def is_empty(self) -> bool:
        return not (
            self.pushes
            or self.announced
            or self.registered_first_total
            or self.failed
            or self.bytes
            or self.parts_ended
        )


class SteppedEngine(Protocol):
    """A test engine of worker ranks that `step()` runs one engine step on, each rank's
    results collected in `ended`."""

    ended: Any

    def step(self) -> None: ...


def run_until(done: Callable[[], bool], *engines: SteppedEngine, seconds: float = 30) -> None:
    """Step every engine in turn until `done()`, or fail after `seconds` naming what each
    engine's ranks had ended."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if done():
            return
        for engine in engines:
            engine.step()
        time.sleep(0.002)
    raise AssertionError(f"not ended in {seconds} s: {[e.ended for e in engines]}")


def run_until_ended(prefill: SteppedEngine, decode: SteppedEngine, seconds: float = 30) -> None:
    """Until every prefill rank sent "req-p" and every decode rank received "req-d"."""
    run_until(
        lambda: (
            all("req-p" in e.finished_sending for e in prefill.ended)
            and all("req-d" in e.finished_recving for e in decode.ended)
        ),
        prefill,
        decode,
        seconds=seconds,
    )


def step_each(
    workers: Sequence[WorkerSide], ended: Sequence[StepResults], plan: StepPlan | None
) -> list[StepResults]:
    """One engine step on every worker, each given `plan` (or an idle step), as vLLM hands
    every worker the scheduler's connector metadata; each worker's ends are added to its
    `ended`, and returned as that step's."""
    outs = []
    for worker, so_far in zip(workers, ended, strict=True):
        step = plan or StepPlan(idle=True)
        worker.start_step(step)
        worker.step_saved(step)
        out = worker.transfer_results()
        so_far.finished_recving |= out.finished_recving
        so_far.failed_recving |= out.failed_recving
        so_far.finished_sending |= out.finished_sending
        outs.append(out)
    return outs
