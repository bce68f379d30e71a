"""The prefill role's engine thread, driven with a recording runtime (no NIXL needed).

A layer-wise request is offered to the runtime after its first layer, so its blocks may
be read by writes in flight from then on: whatever ends the request early, its blocks
must stay held until the runtime reports that the transfer ended (issue 9).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from kvpush.errors import FailureReason
from kvpush.runtime import TransferResult
from kvpush.serving.checkpoint import LoadedModel, load_model, make_model
from kvpush.serving.disagg import PrefillWorker, runtime_transfer_id
from kvpush.serving.engine import Engine, SamplingParams
from kvpush.serving.metrics import serving_registry
from kvpush.serving.worker import Done, Event, Job

pytestmark = pytest.mark.timeout(60)


class RecordingRuntime:
    """Stands in for a PushRuntime: records calls; ends transfers when told to."""

    def __init__(self, fail_on_layer: int | None = None) -> None:
        self.fail_on_layer = fail_on_layer
        self.sent: list[tuple[str, tuple[int, ...]]] = []
        self.aborted: list[str] = []
        self._results: list[TransferResult] = []
        self._lock = threading.Lock()

    def send(self, transfer_id: str, blocks: Sequence[int], *, ready_layers: object = None) -> None:
        self.sent.append((transfer_id, tuple(blocks)))

    def layers_ready(self, transfer_id: str, layers: Sequence[int]) -> None:
        if self.fail_on_layer in layers:
            raise RuntimeError("injected: the engine step fails after its first layer")

    def abort(self, transfer_id: str) -> None:
        self.aborted.append(transfer_id)

    def reject(self, transfer_id: str, sender: object, detail: str = "") -> None:
        raise AssertionError("a prefill server never rejects")

    def poll(self) -> list[TransferResult]:
        with self._lock:
            out, self._results = self._results, []
        return out

    def end(self, transfer_id: str, blocks: tuple[int, ...]) -> None:
        result = TransferResult(transfer_id, "sender", FailureReason.CANCELLED, "test", blocks)
        with self._lock:
            self._results.append(result)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path: Path = tmp_path_factory.mktemp("worker-model")
    make_model(path, seed=4)
    return load_model(path)


@pytest.fixture
def engine(tiny: LoadedModel) -> Engine:
    return Engine(tiny.model, num_blocks=64, block_size=8)


def _until(predicate: Callable[[], bool], timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


@pytest.fixture
def runtime() -> RecordingRuntime:
    return RecordingRuntime(fail_on_layer=1)


@pytest.fixture
def worker(engine: Engine, runtime: RecordingRuntime) -> Iterator[PrefillWorker]:
    w = PrefillWorker(engine, runtime, serving_registry(), layerwise=True)  # type: ignore[arg-type]
    w.start()
    yield w
    w.close()


def test_a_failed_layerwise_step_keeps_the_blocks_until_the_runtime_reports_the_end(
    engine: Engine, runtime: RecordingRuntime, worker: PrefillWorker
) -> None:
    events: list[Event] = []
    prompt = list(range(1, 60))  # 8 blocks
    worker.submit(
        Job(
            "r1",
            prompt,
            SamplingParams(max_tokens=4),
            events.append,
            kv_transfer_params={"do_remote_decode": True, "transfer_id": "t1"},
        )
    )
    assert _until(lambda: any(isinstance(e, Done) for e in events))
    done = events[-1]
    assert isinstance(done, Done) and done.error is not None and "engine error" in done.error
    tid = runtime_transfer_id("t1", prompt)
    assert [t for t, _ in runtime.sent] == [tid]  # offered after layer 0
    assert runtime.aborted == [tid]
    # The writes of layer 0 may still be in flight: the request holds its blocks.
    assert _until(lambda: worker.statistics().num_held == 1)
    assert worker.statistics().num_free_blocks < engine.allocator.num_blocks
    runtime.end(tid, runtime.sent[0][1])
    assert _until(lambda: worker.statistics().num_free_blocks == engine.allocator.num_blocks)
