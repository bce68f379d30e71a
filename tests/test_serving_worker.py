"""The prefill and decode roles' engine threads over the loopback transport.

Each role is built the way `kvpush serve` builds it (`build_role`: a `KVBridge` with a
real `PushRuntime` and side channel on 127.0.0.1), only with loopback transports on one
fabric instead of NIXL, so the two legs of a request really pair, register and write.

A layer-wise request is offered to the runtime after its first layer, so its blocks may
be read by writes in flight from then on: whatever ends the request early, its blocks
must stay held until the runtime reports that the transfer ended (issue 9).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.fakes import HeldWritesTransport
from helpers.waiting import wait_until
from kvpush.errors import FailureReason
from kvpush.node import TransportFactory
from kvpush.protocol import Cancel, encode
from kvpush.runtime import PushRuntime
from kvpush.serving.checkpoint import LoadedModel, load_model
from kvpush.serving.disagg import KVBridge, build_role
from kvpush.serving.engine import Engine
from kvpush.serving.metrics import Registry, serving_registry
from kvpush.serving.options import ServeOptions
from kvpush.serving.sampling import SamplingParams
from kvpush.serving.transfers import runtime_transfer_id
from kvpush.serving.worker import Accepted, Done, EngineWorker, Event, Job, Rejected, Tokens
from kvpush.sidechannel import fetch_metadata
from kvpush.transports.base import Transport
from kvpush.transports.loopback import LoopbackFabric, LoopbackTransport

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def tiny(model_dir: Path) -> LoadedModel:
    return load_model(model_dir)


@dataclass
class Role:
    worker: EngineWorker
    bridge: KVBridge
    engine: Engine
    registry: Registry

    @property
    def runtime(self) -> PushRuntime:
        assert self.bridge.runtime is not None
        return self.bridge.runtime

    @property
    def side_channel_port(self) -> int:
        assert self.bridge.node is not None
        return self.bridge.node.port


StartRole = Callable[..., Role]


@pytest.fixture
def fabric() -> LoopbackFabric:
    return LoopbackFabric()


@pytest.fixture
def start_role(tiny: LoadedModel, model_dir: Path, fabric: LoopbackFabric) -> Iterator[StartRole]:
    """Start a role as `kvpush serve` does, over loopback; every one is closed at the end.

    An engine of 64 blocks of 8 tokens is one longest request's worth: only a request
    a decode server registered may take the last of them."""
    started: list[Role] = []

    def start(
        role: str,
        *,
        num_blocks: int = 64,
        transport: type[LoopbackTransport] = LoopbackTransport,
        token: str | None = None,
        **options: object,
    ) -> Role:
        engine = Engine(tiny.model, num_blocks=num_blocks, block_size=8)
        opts = ServeOptions(
            model=str(model_dir), role=role, host=HOST, side_channel_port=0, **options
        )

        def make(name: str) -> Transport:
            return transport(fabric, name)

        factory: TransportFactory = make
        registry = serving_registry()
        worker, bridge, _, _ = build_role(opts, engine, registry, token, transport_factory=factory)
        r = Role(worker, bridge, engine, registry)
        started.append(r)
        worker.start()
        return r

    yield start
    for r in started:
        r.worker.close()
        r.bridge.close()


def prefill_job(
    rid: str, tid: str, prompt: list[int], events: list[Event], decode: Role | None = None
) -> Job:
    """A prefill leg; with `decode`, it names that decode server, as the proxy does."""
    kvp: dict[str, object] = {"do_remote_decode": True, "transfer_id": tid}
    if decode is not None:
        kvp |= {"decode_host": HOST, "decode_port": decode.side_channel_port}
    return Job(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS), events.append, kvp)


def decode_job(rid: str, tid: str, prompt: list[int], prefill: Role, events: list[Event]) -> Job:
    return Job(
        rid,
        prompt,
        SamplingParams(max_tokens=MAX_TOKENS),
        events.append,
        kv_transfer_params={
            "do_remote_prefill": True,
            "transfer_id": tid,
            "remote_host": HOST,
            "remote_port": prefill.side_channel_port,
        },
    )


def done(events: list[Event]) -> Done | None:
    return next((e for e in events if isinstance(e, Done)), None)


def tokens(events: list[Event]) -> list[int]:
    return [t for e in events if isinstance(e, Tokens) for t in e.token_ids]


def single_instance_tokens(tiny: LoadedModel, prompt: list[int]) -> list[int]:
    worker = EngineWorker(Engine(tiny.model, num_blocks=256, block_size=8))
    worker.start()
    try:
        events: list[Event] = []
        worker.submit(Job("alone", prompt, SamplingParams(max_tokens=MAX_TOKENS), events.append))
        wait_until(lambda: done(events) is not None, what="the single-instance run")
        return tokens(events)
    finally:
        worker.close()


def test_a_failed_layerwise_step_keeps_the_blocks_until_the_runtime_reports_the_end(
    start_role: StartRole,
) -> None:
    # The prefill's writes stay in flight until released, as a slow data plane's would.
    prefill = start_role("prefill", layerwise=True, transport=HeldWritesTransport)
    decode = start_role("decode", num_blocks=256)
    failing = prefill.engine.on_layer_done
    assert failing is not None

    def fail_after_the_first_layer(layer: int, request_ids: list[str]) -> None:
        failing(layer, request_ids)
        if layer == 1:
            raise RuntimeError("injected: the engine step fails after its first layer")

    prefill.engine.on_layer_done = fail_after_the_first_layer
    prompt = list(range(1, 60))  # 8 blocks
    tid = runtime_transfer_id("t1", prompt)
    decode_events: list[Event] = []
    decode.worker.submit(decode_job("d1", "t1", prompt, prefill, decode_events))
    wait_until(
        lambda: prefill.runtime.statistics().sending_transfers.get(tid) == "registered",
        what="the decode server's registration at the prefill server",
    )
    events: list[Event] = []
    prefill.worker.submit(prefill_job("r1", "t1", prompt, events))
    wait_until(lambda: done(events) is not None, what="the prefill request's end")
    failed = done(events)
    assert failed is not None and failed.error is not None and "engine error" in failed.error
    assert prefill.bridge.node is not None
    transport = prefill.bridge.node.rank(0).transport
    assert (
        isinstance(transport, HeldWritesTransport) and transport.held() >= 1
    )  # layer 0, in flight
    # The engine aborted the transfer; the runtime drains the write before it ends it.
    wait_until(
        lambda: prefill.runtime.statistics().sending_transfers.get(tid) == "ending",
        what="the abort to reach the runtime",
    )
    stats = prefill.worker.statistics()
    assert stats.num_held == 1
    assert stats.num_free_blocks < prefill.engine.allocator.num_blocks
    transport.release()
    wait_until(
        lambda: prefill.worker.statistics().num_free_blocks == prefill.engine.allocator.num_blocks,
        what="the prefill blocks to come back once the transfer ended",
    )
    assert prefill.worker.statistics().num_held == 0
    # The decode leg fails with the transfer, and gives its blocks back too.
    wait_until(lambda: done(decode_events) is not None, what="the decode request's end")
    decode_end = done(decode_events)
    assert decode_end is not None and decode_end.status == 502
    assert decode_end.error is not None and tid in decode_end.error
    wait_until(
        lambda: decode.worker.statistics().num_free_blocks == decode.engine.allocator.num_blocks,
        what="the decode blocks to come back",
    )


def test_registered_prefill_requests_go_first_and_unregistered_ones_keep_the_reserve_free(
    start_role: StartRole, tiny: LoadedModel
) -> None:
    # A prompt nobody registered yet must wait (it would hold blocks a registered decode
    # leg's prompt may need); a registered one queued after it goes first.
    prefill = start_role("prefill", queue_timeout_s=30.0)
    decode = start_role("decode", num_blocks=256)
    first, second = list(range(1, 200)), list(range(150, 250))
    early_tid, late_tid = (
        runtime_transfer_id("t-early", first),
        runtime_transfer_id("t-late", second),
    )
    early: list[Event] = []
    late: list[Event] = []
    prefill.worker.submit(prefill_job("early", "t-early", first, early))
    wait_until(lambda: prefill.worker.statistics().num_waiting == 1, what="early to queue")
    prefill.worker.submit(prefill_job("late", "t-late", second, late))
    wait_until(lambda: prefill.worker.statistics().num_waiting == 2, what="late to queue")
    assert early == [] and late == [] and prefill.runtime.statistics().sending_transfers == {}

    late_decode: list[Event] = []
    decode.worker.submit(decode_job("d-late", "t-late", second, prefill, late_decode))
    wait_until(lambda: done(late) is not None, what="the registered (late) prefill request")
    wait_until(lambda: done(late_decode) is not None, what="the late decode leg")
    late_end = done(late_decode)
    assert late_end is not None and late_end.error is None, late_end
    assert tokens(late_decode) == single_instance_tokens(tiny, second)
    # The unregistered one never started: nothing of it reached the runtime.
    assert early == [] and prefill.worker.statistics().num_waiting == 1
    assert early_tid not in prefill.runtime.statistics().sending_transfers
    assert prefill.runtime.statistics().finished == 1

    early_decode: list[Event] = []
    decode.worker.submit(decode_job("d-early", "t-early", first, prefill, early_decode))
    wait_until(lambda: done(early) is not None, what="the early prefill request")
    wait_until(lambda: done(early_decode) is not None, what="the early decode leg")
    assert tokens(early_decode) == single_instance_tokens(tiny, first)
    stats = prefill.runtime.statistics()
    assert stats.finished == 2 and stats.failed == 0
    assert late_tid not in stats.sending_transfers and early_tid not in stats.sending_transfers


def test_a_registration_of_our_transfer_id_with_another_prompt_refuses_both_legs(
    start_role: StartRole,
) -> None:
    prefill = start_role("prefill", queue_timeout_s=30.0)
    decode = start_role("decode", num_blocks=256)
    ours, theirs = list(range(1, 40)), list(range(41, 80))
    their_tid = runtime_transfer_id("t1", theirs)
    decode_events: list[Event] = []
    decode.worker.submit(decode_job("d1", "t1", theirs, prefill, decode_events))  # its prompt
    wait_until(
        lambda: prefill.runtime.statistics().sending_transfers.get(their_tid) == "registered",
        what="the decode leg's registration",
    )
    events: list[Event] = []
    prefill.worker.submit(prefill_job("r1", "t1", ours, events))
    wait_until(lambda: done(decode_events) is not None, what="the decode leg's refusal")
    decode_end = done(decode_events)
    assert decode_end is not None and decode_end.error is not None
    assert "carry different prompts" in decode_end.error
    assert their_tid.rpartition("#")[2] in decode_end.error
    # Our leg: refused too (409) with the same reason.
    wait_until(lambda: done(events) is not None, what="the prefill leg's refusal")
    prefill_end = done(events)
    assert prefill_end is not None and prefill_end.status == 409
    assert prefill_end.error is not None and prefill_end.error in decode_end.error
    wait_until(
        lambda: (
            prefill.worker.statistics().num_free_blocks == prefill.engine.allocator.num_blocks
            and decode.worker.statistics().num_free_blocks == decode.engine.allocator.num_blocks
        ),
        what="both legs' blocks to come back",
    )


def test_a_prefill_request_queued_past_the_timeout_is_refused(start_role: StartRole) -> None:
    prefill = start_role("prefill", queue_timeout_s=0.5)
    events: list[Event] = []
    prefill.worker.submit(prefill_job("r1", "t1", list(range(1, 200)), events))  # never registered
    wait_until(lambda: bool(events), what="the refusal")
    (refusal,) = events
    assert isinstance(refusal, Rejected) and refusal.status == 503
    assert refusal.retry_after_s is not None
    assert prefill.worker.statistics().num_waiting == 0
    stats = prefill.runtime.statistics()
    assert stats.sending_transfers == {} and stats.finished == stats.failed == 0


def test_a_decode_leg_is_accepted_once_its_blocks_are_registered(
    start_role: StartRole, tiny: LoadedModel
) -> None:
    # The decode role answers Accepted only after it registered; the KV then arrives and
    # decoding continues from it, token for token as one instance would.
    prefill = start_role("prefill")
    decode = start_role("decode", num_blocks=256)
    prompt = list(range(3, 70))
    decode_events: list[Event] = []
    decode.worker.submit(decode_job("d1", "t1", prompt, prefill, decode_events))
    wait_until(lambda: bool(decode_events), what="the decode leg's acceptance")
    assert isinstance(decode_events[0], Accepted)
    events: list[Event] = []
    prefill.worker.submit(prefill_job("r1", "t1", prompt, events))
    wait_until(lambda: done(decode_events) is not None, what="the decode leg's end")
    end = done(decode_events)
    assert end is not None and end.error is None, end
    assert tokens(decode_events) == single_instance_tokens(tiny, prompt)
    received = decode.runtime.statistics()
    assert received.finished == 1 and received.bytes_written == 0  # it only receives
    sent = prefill.runtime.statistics()
    assert sent.finished == 1 and sent.bytes_written > 0


def test_a_prefix_hit_at_the_decode_is_counted_as_the_bytes_that_moved_on_both_sides(
    start_role: StartRole, tiny: LoadedModel
) -> None:
    # The second request's prompt is in the decode server's prefix cache: it registers
    # only the blocks it lacks (none), and the prefill writes only those. Both sides count what
    # moved, not what the prefill held.
    prefill = start_role("prefill")
    decode = start_role("decode", num_blocks=256, prefix_caching=True)
    prompt = list(range(5, 70))  # 65 tokens: 8 whole blocks of 8
    bytes_per_block = prefill.engine.kv_cache.bytes_per_block
    for n, rid in enumerate(("first", "again"), start=1):
        decode_events: list[Event] = []
        decode.worker.submit(decode_job(f"d-{rid}", rid, prompt, prefill, decode_events))
        events: list[Event] = []
        prefill.worker.submit(prefill_job(f"p-{rid}", rid, prompt, events))
        wait_until(lambda e=decode_events: done(e) is not None, what=f"the {rid} decode leg")
        end = done(decode_events)
        assert end is not None and end.error is None, end
        assert tokens(decode_events) == single_instance_tokens(tiny, prompt)
        wait_until(lambda n=n: prefill.runtime.statistics().finished == n, what="the prefill's end")

    def counted(role: Role, side: str) -> float:
        return role.registry.value("kvpush_transfer_bytes_total", {"side": side})

    sent, received = counted(prefill, "sender"), counted(decode, "receiver")
    assert sent == received == prefill.runtime.statistics().bytes_written
    # The first moved every block; the second, a full hit at the decode, moved none.
    assert sent == prefill.engine.transfer_block_count(len(prompt)) * bytes_per_block


def test_a_prefill_leg_that_names_its_decode_server_goes_to_that_one_only(
    start_role: StartRole, tiny: LoadedModel
) -> None:
    # Another decode server registers the id first (an insider that predicted it); the
    # prefill leg names the real one, which gets the KV and decodes as one instance
    # would; the other is refused.
    prefill = start_role("prefill")
    real = start_role("decode", num_blocks=256)
    other = start_role("decode", num_blocks=256)
    prompt = list(range(7, 60))
    other_events: list[Event] = []
    other.worker.submit(decode_job("o1", "t1", prompt, prefill, other_events))
    wait_until(
        lambda: prefill.runtime.statistics().sending.get("registered", 0) == 1,
        what="the other decode's Register at the prefill",
    )
    real_events: list[Event] = []
    real.worker.submit(decode_job("d1", "t1", prompt, prefill, real_events))
    prefill.worker.submit(prefill_job("p1", "t1", prompt, [], decode=real))
    wait_until(lambda: done(real_events) is not None, what="the real decode leg's end")
    end = done(real_events)
    assert end is not None and end.error is None, end
    assert tokens(real_events) == single_instance_tokens(tiny, prompt)
    wait_until(lambda: done(other_events) is not None, what="the other decode leg's end")
    refused = done(other_events)
    assert refused is not None and refused.error is not None, refused
    assert other.runtime.statistics().failed == 1


def test_forged_data_plane_messages_are_counted_by_reason_in_metrics(
    start_role: StartRole, fabric: LoopbackFabric
) -> None:
    # A reader of the network with no token: it has the prefill's metadata answer (the
    # agent name and message key in it), not the token.
    token = "metrics-test-token"
    prefill = start_role("prefill", token=token)
    seen = fetch_metadata(HOST, prefill.side_channel_port, token=token)
    reader = LoopbackTransport(fabric, "reader")
    reader.start()
    try:
        reader.register_memory(seen.geometry)
        reader.add_peer(seen.agent_name, seen.agent_metadata, seen.geometry, messages_only=True)
        cancel = encode(Cancel("t1", FailureReason.CANCELLED, "forged"))
        reader.send_message(seen.agent_name, cancel)  # no key
        reader.send_message(seen.agent_name, seen.message_key + cancel)  # the key, no MAC
        reader.send_message(seen.agent_name, seen.message_key + cancel + bytes(40))  # a bad tag
        wait_until(
            lambda: sum(prefill.runtime.statistics().forged_messages.values()) == 3,
            what="the three forgeries counted",
        )
        prefill.bridge.update_metrics(prefill.registry)
        forged = {
            reason: prefill.registry.value("kvpush_forged_messages_total", {"reason": reason})
            for reason in ("bad_key", "bad_mac")
        }
        assert forged == {"bad_key": 1, "bad_mac": 2}
        assert 'kvpush_forged_messages_total{reason="bad_mac"} 2' in prefill.registry.render()
    finally:
        reader.close()
