"""vLLM's `kv_load_failure_policy: "recompute"`, and fp8 KV caches, with KvpushConnector
(issue 36), on one pair of real vLLM servers whose caches are fp8 (`--kv-cache-dtype
fp8_e4m3`, which vLLM-CPU runs on x86 with AVX-512 or AMX).

- fp8 KV: each side channel names the cache as the compatibility check sees it (format
  and per-layer scales), every request of every round, moved fp8 bytes included, has a
  single fp8 instance's tokens and logprobs, and a third server, a decode storing
  fp8_e5m2, is refused by the handshake, naming both caches
  (`tests/test_vllm_worker_fp8.py` has other scales and unquantized peers too).
- Recompute on failure: the prefill is killed (SIGKILL, the whole server) in the
  middle of a batch, and every request still answers 200 with the single instance's
  tokens, the decode computing the prompt of each one whose transfer failed; a block
  that a failed transfer was given is never served from the decode's prefix cache
  (docs/vllm.md, "Failures and vLLM's failure policy"); after a restart of the
  prefill, a round with shared prefixes matches again, and neither server holds a
  request or a KV block at the end.
- Drain (issue 39): the prefill, run with vLLM's `--shutdown-timeout`, is stopped with
  SIGTERM while it holds sends no decode has asked for yet and while the decode waits on
  registrations it has not prefilled. vLLM's engine takes no new request and keeps
  stepping while its connector holds blocks for a transfer: the decodes that register
  during the drain are pushed their KV, the rest hear that the prefill is shutting down
  (and recompute), within seconds, not at a deadline; the prefill then exits on its own.

No reference server: the reference answers come from the prefill server before anything
moves, each prompt alone and without `kv_transfer_params`, so it computes the whole
request itself, as a single instance does (same model, flags, cache dtype and threads;
its connector takes no part in a request that names no transfer).

The kill round sends, at once, a decode leg for each of 24 requests (each registers its
transfer with the prefill), in three waves of 8: the first wave's prefill legs are
served and its answers checked (their KV moved); then the second wave's prefill legs
go, and the prefill is killed as soon as the first of them answers, so transfers still
in flight fail wherever they are; the third wave's prompts (sharing a prefix of their
own, never sent before) never reach the prefill. Every failed transfer's request fails
over to vLLM's recompute within the liveness bound. After the restart, one request
under that prefix, alone, is served its first blocks from the decode's own prefix cache
(blocks only the recompute computed) and the rest from the prefill, token for token
right; then a round of 24 legs in turn.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from helpers.vllm_e2e import HOST, LIVENESS_BOUND_S, MAX_TOKENS, PROMPTS, TIMING, warm_up
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
    metric,
    sequential,
    servers_said,
    vllm_python,
    wait_quiescent,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

AT_ONCE = 24
WAVE = 8  # the kill round's requests in three waves (see the module)
# Prompts only the kill round's unprefilled requests carry before the restart: their
# shared prefix (two 32-token blocks and more) is computed on the decode by vLLM's
# recompute alone, and later requests under it are served it from the decode's cache.
RECOMPUTED_PREFIX = "Nobody pushed this prefix: the prefill died first, so the decode computed it, "
RECOMPUTED = [RECOMPUTED_PREFIX + f"variant {i} of the request, ending {'.' * i}" for i in range(8)]
LATER = [RECOMPUTED_PREFIX + f"and a later request, number {i}, shares it." for i in range(4)]
KILL_ROUND = [*PROMPTS, *PROMPTS, *RECOMPUTED]
AFTER_ROUND = [*PROMPTS, *LATER, *RECOMPUTED[:4], *PROMPTS[:4], *LATER]
assert len(KILL_ROUND) == AT_ONCE and len(AFTER_ROUND) == AT_ONCE
# The whole 32-token blocks of RECOMPUTED_PREFIX (its tokens are its bytes, after BOS).
PREFIX_BLOCKS = (1 + len(RECOMPUTED_PREFIX.encode())) // 32
# vLLM's stats reach /metrics a step or so after a transfer ended.
METRICS_WAIT_S = 15.0
# The prefill's `--shutdown-timeout`: how long vLLM's engine may drain after SIGTERM.
DRAIN_S = 20
HELD = 4  # the drain test's held sends, and its registrations never prefilled
TRANSFERS = "vllm:kvpush_transfers_total"


@dataclass
class Pair:
    model: str
    prefill: VllmServer
    decode: VllmServer
    reference: dict[str, Outcome]
    # A decode server whose cache is another fp8 format (stopped by the test using it).
    other_decode: VllmServer

    @property
    def servers(self) -> list[VllmServer]:
        return [self.prefill, self.decode]


# vLLM's fp8 format of the pair's caches, and what each side channel must call them.
CACHE_DTYPE = "fp8_e4m3"
CACHE_NAMED = f"uint8 holding {CACHE_DTYPE} (k_scale 1.0, v_scale 1.0 in every layer)"


OTHER_CACHE_DTYPE = "fp8_e5m2"


def _spec(
    name: str,
    role: str,
    policy: str = "fail",
    cache_dtype: str = CACHE_DTYPE,
    extra_args: tuple[str, ...] = (),
) -> ServerSpec:
    return ServerSpec(
        name=name,
        host=HOST,
        port=free_port(HOST),
        connector="KvpushConnector",
        kv_role=role,
        side_channel_port=free_port(HOST),
        extra_config={**TIMING, "handshake_timeout_ms": 10000},
        failure_policy=policy,
        extra_args=("--kv-cache-dtype", cache_dtype, *extra_args),
    )


def _reference(model: str, server: VllmServer) -> dict[str, Outcome]:
    """Each distinct prompt alone, computed whole by `server`."""
    prompts = sorted(set(KILL_ROUND) | set(AFTER_ROUND))

    async def run() -> list[Outcome]:
        async with client() as http:
            return [
                await complete(http, server.url, completion_body(p, model, MAX_TOKENS))
                for p in prompts
            ]

    out = {}
    for outcome in asyncio.run(run()):
        assert outcome.ok, f"the reference failed {outcome.prompt!r}: {outcome.error}"
        out[outcome.prompt] = outcome
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    try:
        python = vllm_python()
    except ConfigError as exc:
        pytest.fail(f"the recompute end-to-end test cannot run: {exc}", pytrace=False)
    model = make_tiny_model(tmp_path_factory.mktemp("vllm-model") / "tiny-llama")
    log_dir = tmp_path_factory.mktemp("vllm-recompute")
    prefill = VllmServer(
        _spec("prefill", "kv_producer", extra_args=("--shutdown-timeout", str(DRAIN_S))),
        model=model,
        log_dir=log_dir,
        python=python,
    )
    decode = VllmServer(
        _spec("decode", "kv_consumer", policy="recompute"),
        model=model,
        log_dir=log_dir,
        python=python,
    )
    other = VllmServer(
        _spec("decode-e5m2", "kv_consumer", cache_dtype=OTHER_CACHE_DTYPE),
        model=model,
        log_dir=log_dir,
        python=python,
    )
    servers = [prefill, decode, other]
    try:
        for server in servers:  # all at once: a start is mostly waiting
            server.start()
        for server in servers:
            server.wait_ready()
        warm_up(str(model), [prefill, decode])
        reference = _reference(str(model), prefill)
        yield Pair(str(model), prefill, decode, reference, other)
    finally:
        for server in servers:
            server.stop()


async def _counter(
    http: httpx.AsyncClient, url: str, name: str, at_least: float, **labels: str
) -> float:
    """A counter of `url`'s /metrics once it reached `at_least`, or its last value."""
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        value = await metric(http, url, name, **labels)
        if value >= at_least or time.monotonic() > deadline:
            return value
        await asyncio.sleep(1.0)


async def _receives(http: httpx.AsyncClient, url: str, at_least: float = 0.0) -> dict[str, float]:
    """The decode's receives ended, finished and failed (once their total reached
    `at_least`, or METRICS_WAIT_S passed)."""
    name = "vllm:kvpush_transfers_total"
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        got = {
            outcome: await metric(http, url, name, side="receiver", outcome=outcome)
            for outcome in ("finished", "failed")
        }
        got["total"] = got["finished"] + got["failed"]
        if got["total"] >= at_least or time.monotonic() > deadline:
            return got
        await asyncio.sleep(1.0)


def _decode_leg(
    pair: Pair, http: httpx.AsyncClient, prompt: str, tid: str
) -> asyncio.Task[Outcome]:
    """A decode leg that names its transfer and the prefill (started, not awaited: vLLM
    registers it with the prefill as soon as it schedules it)."""
    params = {
        "do_remote_prefill": True,
        "remote_host": pair.prefill.spec.host,
        "remote_port": pair.prefill.spec.side_channel_port,
        "tp_size": 1,
        "transfer_id": tid,
    }
    body = completion_body(prompt, pair.model, MAX_TOKENS, kv_transfer_params=params)
    return asyncio.ensure_future(complete(http, pair.decode.url, body))


def _prefill_leg(
    pair: Pair, http: httpx.AsyncClient, prompt: str, tid: str
) -> asyncio.Task[Outcome]:
    params = {"do_remote_decode": True, "transfer_id": tid}
    body = completion_body(prompt, pair.model, 1, kv_transfer_params=params)
    return asyncio.ensure_future(complete(http, pair.prefill.url, body))


def test_each_side_channel_names_the_fp8_cache_with_its_scales(
    pair: Pair, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvpush probe` on both servers: the cache the compatibility check compares is
    vLLM's fp8 format in uint8 tensors, with the scales read from vLLM's attention
    layers (1.0: this checkpoint has none)."""
    for server in pair.servers:
        assert server.spec.side_channel_port is not None
        code = cli_main(
            ["probe", "--host", HOST, "--port", str(server.spec.side_channel_port), "--json"]
        )
        said = json.loads(capsys.readouterr().out)
        assert code == 0, said
        assert said["dtype"] == CACHE_NAMED, said


def test_a_decode_of_another_fp8_format_is_refused_naming_both(pair: Pair) -> None:
    """A decode server storing fp8_e5m2 asks the fp8_e4m3 prefill for a request's KV:
    the handshake refuses the pair before anything is written, the decode's log naming
    both caches, its transfer counted failed as an incompatible peer, and the request
    fails (this decode's policy is vLLM's default, `fail`). The server is stopped
    afterwards, before the kill test."""
    other = pair.other_decode
    prompt = PROMPTS[0]
    tid = f"fp8-mismatch-{time.monotonic_ns()}"
    name = "vllm:kvpush_transfers_total"
    labels = {"side": "receiver", "outcome": "failed", "reason": "incompatible_peer"}

    async def run() -> tuple[Outcome, float]:
        async with client() as http:
            params = {
                "do_remote_prefill": True,
                "remote_host": HOST,
                "remote_port": pair.prefill.spec.side_channel_port,
                "tp_size": 1,
                "transfer_id": tid,
            }
            body = completion_body(prompt, pair.model, MAX_TOKENS, kv_transfer_params=params)
            decode_leg = asyncio.ensure_future(complete(http, other.url, body))
            prefill_leg = _prefill_leg(pair, http, prompt, tid)
            assert (await prefill_leg).ok
            outcome = await decode_leg
            return outcome, await _counter(http, other.url, name, 1.0, **labels)

    try:
        outcome, refused = asyncio.run(run())
        assert not outcome.ok, "a decode of another fp8 format was served the prefill's KV"
        assert refused == 1.0
        said = other.log_path.read_text(errors="replace")
        ours = f"uint8 holding {OTHER_CACHE_DTYPE} (k_scale 1.0, v_scale 1.0 in every layer)"
        assert f"differs in dtype: theirs {CACHE_NAMED!r}, ours {ours!r}" in said, servers_said(
            [other]
        )
    finally:
        other.stop()


def test_prefill_killed_mid_batch_every_request_recomputed_right_then_shared_prefixes(
    pair: Pair,
) -> None:
    """The kill round (see the module): all 24 requests answer 200 with the reference's
    tokens and logprobs, at least the 8 never prefilled through a failed transfer and
    vLLM's recompute, within the liveness bound; then the prefill restarts and a round
    of 24 legs in turn (vLLM's example proxy), 8 of them under the prefix the decode
    computed itself, matches again with prefix-cache hits on the decode; nothing is
    held afterwards on either server."""
    hits = "vllm:prefix_cache_hits_total"

    async def kill_round() -> tuple[list[Outcome], float, dict[str, float]]:
        async with client() as http:
            before = await _receives(http, pair.decode.url)
            stamp = time.monotonic_ns()
            tids = [f"recompute-{i}-{stamp}" for i in range(AT_ONCE)]
            decode_legs = [
                _decode_leg(pair, http, p, t) for p, t in zip(KILL_ROUND, tids, strict=True)
            ]
            # The first wave moves its KV before anything goes wrong.
            for outcome in await batch(
                [_prefill_leg(pair, http, KILL_ROUND[i], tids[i]) for i in range(WAVE)]
            ):
                assert outcome.ok, f"a prefill leg before the kill failed: {outcome.error}"
            first = await batch(decode_legs[:WAVE])
            check_identical(first, pair.reference, "first wave, before the kill", pair.servers)
            # The second is killed in flight; the third never reaches the prefill.
            second = [
                _prefill_leg(pair, http, KILL_ROUND[i], tids[i]) for i in range(WAVE, 2 * WAVE)
            ]
            await asyncio.wait(second, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.to_thread(pair.prefill.kill)
            killed_at = time.monotonic()
            rest = await batch(decode_legs[WAVE:])
            waited = time.monotonic() - killed_at
            await batch(second)  # those not answered fail with the server: nothing to check
            after = await _receives(http, pair.decode.url, at_least=before["total"] + AT_ONCE)
            return rest, waited, {k: after[k] - before[k] for k in after}

    rest, waited, receives = asyncio.run(kill_round())
    check_identical(rest, pair.reference, "kill round, after the kill", pair.servers)
    # The failure is heard within the liveness bound; the recompute and decode of the
    # whole batch come after it.
    assert waited < LIVENESS_BOUND_S + 30, f"the kill round took {waited:.1f}s after the kill"
    # Every request's transfer ended once: the first wave's finished (the KV moved),
    # the third's failed (recomputed), the second's either way.
    assert receives["total"] == AT_ONCE, receives
    assert receives["finished"] >= WAVE and receives["failed"] >= WAVE, (
        f"decode receives in the kill round: {receives}\n{servers_said(pair.servers)}"
    )

    pair.prefill.start()
    pair.prefill.wait_ready()
    warm_up(pair.model, [pair.prefill])

    async def after_round() -> tuple[Outcome, float, list[Outcome]]:
        async with client() as http:

            def legs(prompt: str) -> Any:
                body = completion_body(prompt, pair.model, MAX_TOKENS)
                return sequential(http, pair.prefill.url, pair.decode.url, body)

            # One request under the prefix only the recompute computed, alone: the
            # decode's prefix-cache hits it adds are that prefix's blocks.
            before = await metric(http, pair.decode.url, hits)
            later = await legs(LATER[0])
            hit = await _counter(http, pair.decode.url, hits, before + PREFIX_BLOCKS * 32)
            return later, hit - before, await batch([legs(p) for p in AFTER_ROUND])

    later, hit, outcomes = asyncio.run(after_round())
    check_identical([later], pair.reference, "under the recomputed prefix", pair.servers)
    assert hit >= PREFIX_BLOCKS * 32, (
        f"the decode served {hit:.0f} tokens from its prefix cache for a prompt under the "
        f"prefix it recomputed, expected its {PREFIX_BLOCKS} blocks"
    )
    check_identical(outcomes, pair.reference, "round after the restart", pair.servers)

    async def drained() -> tuple[bool, float, dict[str, dict[str, float]]]:
        async with client() as http:
            return await wait_quiescent(http, [s.url for s in pair.servers], timeout_s=60)

    quiet, waited, state = asyncio.run(drained())
    assert quiet, (
        f"requests or KV blocks still held after {waited:.0f}s: {state}\n"
        f"{servers_said(pair.servers)}"
    )


def test_prefill_stopped_with_sigterm_drains_its_held_transfers(pair: Pair) -> None:
    """The drain (see the module), after the restart above: `HELD` sends held (their
    prefill legs answered, no decode asked yet) and `HELD` decode legs registered with
    the prefill, never prefilled. SIGTERM to the prefill's server process, as an
    orchestrator stops it; then the held sends' decode legs. Those are pushed their KV
    (the decode's receives finished); the never-prefilled ones fail over to a recompute,
    the decode told at the prefill's close rather than at a deadline or its liveness
    bound; all 2 x `HELD` answer the single instance's tokens; the prefill exits within
    its drain bound, its engine having drained; the decode holds nothing."""
    held, waiting = PROMPTS[:HELD], RECOMPUTED[:HELD]

    refused = {"side": "receiver", "outcome": "failed", "reason": "rejected"}

    async def drain() -> tuple[list[Outcome], float, float, dict[str, float]]:
        async with client() as http:
            before = await _receives(http, pair.decode.url)
            before["refused"] = await metric(http, pair.decode.url, TRANSFERS, **refused)
            stamp = time.monotonic_ns()
            held_tids = [f"drain-held-{i}-{stamp}" for i in range(HELD)]
            waiting_legs = [
                _decode_leg(pair, http, p, f"drain-waiting-{i}-{stamp}")
                for i, p in enumerate(waiting)
            ]
            for outcome in await batch(
                [_prefill_leg(pair, http, p, t) for p, t in zip(held, held_tids, strict=True)]
            ):
                assert outcome.ok, f"a prefill leg before the drain failed: {outcome.error}"
            # The waiting legs are queued on the decode (registered with the prefill).
            deadline = time.monotonic() + METRICS_WAIT_S
            while await metric(http, pair.decode.url, "vllm:num_requests_waiting") < HELD:
                assert time.monotonic() < deadline, "the decode never queued the waiting legs"
                await asyncio.sleep(0.2)
            assert pair.prefill.pid is not None
            os.kill(pair.prefill.pid, signal.SIGTERM)
            stopped_at = time.monotonic()
            held_legs = [
                _decode_leg(pair, http, p, t) for p, t in zip(held, held_tids, strict=True)
            ]
            outcomes = await batch([*held_legs, *waiting_legs])
            answered = time.monotonic() - stopped_at
            while pair.prefill.alive():
                assert time.monotonic() - stopped_at < DRAIN_S + 30, (
                    f"the prefill still runs {DRAIN_S + 30} s after SIGTERM"
                )
                await asyncio.sleep(0.2)
            exited = time.monotonic() - stopped_at
            after = await _receives(http, pair.decode.url, at_least=before["total"] + 2 * HELD)
            after["refused"] = await metric(http, pair.decode.url, TRANSFERS, **refused)
            return outcomes, answered, exited, {k: after[k] - before[k] for k in after}

    outcomes, answered, exited, receives = asyncio.run(drain())
    check_identical(outcomes, pair.reference, "legs around the drain", pair.servers)
    said = servers_said(pair.servers)
    # The never-prefilled ones refused by the closing prefill, as its side channel says.
    assert receives == {"finished": HELD, "failed": HELD, "total": 2 * HELD, "refused": HELD}, (
        f"decode receives around the drain: {receives}\n{said}"
    )
    # Told at the close, not by silence: well inside the liveness bound.
    assert answered < DRAIN_S, f"the legs took {answered:.1f} s after SIGTERM to answer"
    assert exited < DRAIN_S + 30, exited
    log = pair.prefill.log_path.read_text(errors="replace")
    assert "[shutdown] EngineCore: start mode=drain" in log, said

    async def quiet() -> tuple[bool, float, dict[str, dict[str, float]]]:
        async with client() as http:
            return await wait_quiescent(http, [pair.decode.url], timeout_s=60)

    drained, waited, state = asyncio.run(quiet())
    assert drained, f"the decode still holds work {waited:.0f} s on: {state}\n{said}"
