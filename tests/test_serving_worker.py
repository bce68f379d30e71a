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
from kvpush.runtime import RuntimeStatistics, TransferResult
from kvpush.serving.checkpoint import LoadedModel, load_model, make_model
from kvpush.serving.disagg import PrefillWorker, runtime_transfer_id
from kvpush.serving.engine import Engine, SamplingParams
from kvpush.serving.metrics import serving_registry
from kvpush.serving.worker import AdmissionConfig, Done, Event, Job, Rejected

pytestmark = pytest.mark.timeout(60)


class RecordingRuntime:
    """Stands in for a PushRuntime: records calls; ends transfers when told to; shows
    the registrations a test makes (`register`) in `statistics()`, as the protocol's
    sender does when a decode server's Register arrived."""

    def __init__(self, fail_on_layer: int | None = None) -> None:
        self.fail_on_layer = fail_on_layer
        self.sent: list[tuple[str, tuple[int, ...]]] = []
        self.aborted: list[str] = []
        self.refused: list[tuple[str, str]] = []
        self._registered: set[str] = set()
        self._results: list[TransferResult] = []
        self._lock = threading.Lock()

    def register(self, transfer_id: str) -> None:
        with self._lock:
            self._registered.add(transfer_id)

    def statistics(self) -> RuntimeStatistics:
        with self._lock:
            sent = {t for t, _ in self.sent}
            states = {t: "writing" if t in sent else "registered" for t in self._registered}
            states.update({t: "awaiting_register" for t in sent - self._registered})
        return RuntimeStatistics(
            sending={},
            receiving={},
            finished=0,
            failed=0,
            failures={},
            bytes_written=0,
            blocks_held_sending=0,
            blocks_held_receiving=0,
            results_queued=0,
            peers=0,
            handshakes_in_flight=0,
            malformed_messages=0,
            transport_polls=0,
            duplicate_reports=0,
            sending_transfers=states,
        )

    def refuse(self, transfer_id: str, detail: str = "") -> None:
        with self._lock:
            if transfer_id in self._registered:
                self._registered.discard(transfer_id)
                self.refused.append((transfer_id, detail))

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
    # 64 blocks are one longest request's: only a registered one may take them.
    runtime.register(runtime_transfer_id("t1", prompt))
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


def _prefill_job(rid: str, tid: str, prompt: list[int], events: list[Event]) -> Job:
    return Job(
        rid,
        prompt,
        SamplingParams(max_tokens=4),
        events.append,
        kv_transfer_params={"do_remote_decode": True, "transfer_id": tid},
    )


@pytest.fixture
def whole_worker(engine: Engine, runtime: RecordingRuntime) -> Iterator[PrefillWorker]:
    w = PrefillWorker(
        engine,
        runtime,  # type: ignore[arg-type]
        serving_registry(),
        layerwise=False,
        admission=AdmissionConfig(queue_timeout_s=30.0),
    )
    w.start()
    yield w
    w.close()


def test_registered_prefill_requests_go_first_and_unregistered_ones_keep_the_reserve_free(
    runtime: RecordingRuntime, whole_worker: PrefillWorker
) -> None:
    # 64 blocks, one longest request's worth: a prompt nobody registered yet must wait
    # (it would hold blocks a registered decode leg's prompt may need); a registered
    # one queued after it goes first.
    first, second = list(range(1, 200)), list(range(150, 250))
    early: list[Event] = []
    late: list[Event] = []
    whole_worker.submit(_prefill_job("early", "t-early", first, early))
    assert _until(lambda: whole_worker.statistics().num_waiting == 1)
    whole_worker.submit(_prefill_job("late", "t-late", second, late))
    assert _until(lambda: whole_worker.statistics().num_waiting == 2)
    assert runtime.sent == [] and early == [] and late == []
    runtime.register(runtime_transfer_id("t-late", second))
    assert _until(lambda: any(isinstance(e, Done) for e in late))
    assert [t for t, _ in runtime.sent] == [runtime_transfer_id("t-late", second)]
    assert early == [] and whole_worker.statistics().num_waiting == 1
    runtime.register(runtime_transfer_id("t-early", first))
    assert _until(lambda: any(isinstance(e, Done) for e in early))
    assert [t for t, _ in runtime.sent][1:] == [runtime_transfer_id("t-early", first)]


def test_a_registration_of_our_transfer_id_with_another_prompt_refuses_both_legs(
    runtime: RecordingRuntime, whole_worker: PrefillWorker
) -> None:
    ours, theirs = list(range(1, 40)), list(range(41, 80))
    events: list[Event] = []
    runtime.register(runtime_transfer_id("t1", theirs))  # the decode leg's prompt
    whole_worker.submit(_prefill_job("r1", "t1", ours, events))
    assert _until(lambda: bool(runtime.refused))
    ((refused_id, why),) = runtime.refused
    assert refused_id == runtime_transfer_id("t1", theirs)
    assert "carry different prompts" in why and refused_id.rpartition("#")[2] in why
    # Our leg: refused too (409), or, if it was computed and offered first, aborted.
    assert _until(lambda: bool(events) or bool(runtime.aborted))
    done = [e for e in events if isinstance(e, Done)]
    if done:
        assert done[-1].status == 409 and done[-1].error == why
    else:
        assert runtime.aborted == [runtime_transfer_id("t1", ours)]


def test_a_prefill_request_queued_past_the_timeout_is_refused(
    engine: Engine, runtime: RecordingRuntime
) -> None:
    admission = AdmissionConfig(queue_timeout_s=0.5)
    w = PrefillWorker(engine, runtime, serving_registry(), layerwise=False, admission=admission)  # type: ignore[arg-type]
    w.start()
    try:
        events: list[Event] = []
        w.submit(_prefill_job("r1", "t1", list(range(1, 200)), events))  # never registered
        assert _until(lambda: bool(events), timeout_s=10)
        (refusal,) = events
        assert isinstance(refusal, Rejected) and refusal.status == 503
        assert refusal.retry_after_s is not None
        assert runtime.sent == [] and w.statistics().num_waiting == 0
    finally:
        w.close()
