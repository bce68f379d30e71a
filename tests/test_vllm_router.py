"""kvpush behind the routers vLLM users run, with nothing kvpush-specific in the requests
(issue 35): vLLM prefill and decode servers with KvpushConnector, against a single vLLM
instance, token for token.

- Behind the vLLM project's router (`vllm-router` 0.1.17, the wheel `make test`
  installs), which runs the legs in turn and rebuilds the decode leg's params in vLLM's
  push dialect (`remote_engine_id`, `remote_host`, `remote_port`, `tp_size`,
  `remote_request_id`), dropping `transfer_id`: 24 requests at once, several rounds;
  at TP 1 into 1, TP 2 into 1 and TP 1 into 2, no leg naming the decode's TP size.
- Behind a router that sends both legs at once in that dialect, as llm-d's routing
  sidecar does with a push connector's "push identity" (`kvpush_lab.routers`): the
  decode registers while the prefill computes, which the prefill counts
  (`vllm:kvpush_sends_registered_first_total`).
- Two requests under one `X-Request-Id` (a router bug, or a replay), dispatched at once:
  with different prompts each is served its own KV; with the same prompt (the same KV)
  the second is refused, never served from the other's transfer (and vLLM, which aborts
  by the client's id, usually fails the first with it).

Each side names a transfer the router did not name from the request's own id and a
digest of its prompt (`kvpush.integrations.vllm.params.pairing_id`). Servers come from
the vLLM venv (`make vllm-venv`); its absence is a failure, never a skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import secrets
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from helpers.vllm_e2e import HOST, MAX_TOKENS, PROMPTS, TIMING, warm_up
from kvpush.cli import main as cli_main
from kvpush.config import SideChannelConfig, load_token
from kvpush.doctor_probe import DOCTOR_DIGEST, PROBE_TIMEOUT_S
from kvpush.doctor_probe.scratch import LARGE_WRITE, SMALL_WRITE
from kvpush.errors import AuthenticationRefused, ConfigError
from kvpush.procs.readiness import free_port
from kvpush.sidechannel import MetadataServer, control_request, fetch_metadata
from kvpush_lab.routers import concurrent_legs, push_identity, start_vllm_router
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
    servers_said,
    vllm_python,
    wait_quiescent,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ROUNDS = 3
SHAPE_ROUNDS = 2  # per TP shape: each starts servers of its own (~75 s at TP 2 here)
AT_ONCE = 24  # requests per round, sent together
# vLLM's stats reach /metrics a step or so after the transfer ended; counters are
# polled this long (and read this long before a test, to take what is still coming).
METRICS_WAIT_S = 15.0
# How long after a request's decode leg its prefill leg goes, where both go at once.
PREFILL_AFTER_S = 0.5

_REFERENCE: dict[str, Outcome] = {}


@dataclass
class Stack:
    model: str
    prefill: VllmServer
    decode: VllmServer
    router: subprocess.Popen[bytes]
    router_url: str
    token_file: Path | None = None

    @property
    def servers(self) -> list[VllmServer]:
        return [self.prefill, self.decode]


def _spec(name: str, role: str | None, tp: int = 1, token_file: Path | None = None) -> ServerSpec:
    tp_args = ("--tensor-parallel-size", str(tp)) if tp > 1 else ()
    # Without a token, the doctor's test writes are allowed outright (its checks below).
    token = {"allow_doctor_writes": True} if token_file is None else {"token_file": str(token_file)}
    if role is None:
        return ServerSpec(name, HOST, free_port(HOST), extra_args=tp_args)
    return ServerSpec(
        name=name,
        host=HOST,
        port=free_port(HOST),
        connector="KvpushConnector",
        kv_role=role,
        side_channel_port=free_port(HOST),
        extra_config={**TIMING, "handshake_timeout_ms": 10000, **token},
        extra_args=tp_args,
    )


def _python() -> Path:
    try:
        return vllm_python()
    except ConfigError as exc:
        pytest.fail(f"the router end-to-end test cannot run: {exc}", pytrace=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllm-model") / "tiny-llama")


def _stack(
    model: Path, log_dir: Path, prefill_tp: int, decode_tp: int, token_file: Path | None = None
) -> Iterator[Stack]:
    """A prefill and a decode server of these TP sizes behind vllm-router (and, the first
    time, a single instance for the reference answers); `token_file`: both servers'."""
    python = _python()
    prefill = VllmServer(
        _spec("prefill", "kv_producer", prefill_tp, token_file),
        model=model,
        log_dir=log_dir,
        python=python,
    )
    decode = VllmServer(
        _spec("decode", "kv_consumer", decode_tp, token_file),
        model=model,
        log_dir=log_dir,
        python=python,
    )
    servers = [prefill, decode]
    single = None
    if not _REFERENCE:
        single = VllmServer(_spec("single", None), model=model, log_dir=log_dir, python=python)
        servers.append(single)
    router: subprocess.Popen[bytes] | None = None
    try:
        for server in servers:  # all at once: a start is mostly waiting
            server.start()
        for server in servers:
            server.wait_ready()
        warm_up(model, servers)
        if single is not None:
            _reference(str(model), single)
            single.stop()
        router, router_url = start_vllm_router(prefill, decode, log_dir)
        yield Stack(str(model), prefill, decode, router, router_url, token_file)
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def stack(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """TP 1 into TP 1, with a token (so the doctor's test writes are served)."""
    log_dir = tmp_path_factory.mktemp("vllm-router")
    token_file = log_dir / "token"
    token_file.write_text(secrets.token_hex(16))
    yield from _stack(model, log_dir, 1, 1, token_file)


def _reference(model: str, single: VllmServer) -> None:
    async def run() -> list[Outcome]:
        async with client() as http:
            return [
                await complete(http, single.url, completion_body(p, model, MAX_TOKENS))
                for p in PROMPTS
            ]

    for outcome in asyncio.run(run()):
        assert outcome.ok, f"the single instance failed {outcome.prompt!r}: {outcome.error}"
        _REFERENCE[outcome.prompt] = outcome


def _round_prompts() -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(AT_ONCE)]


async def _counter(url: str, name: str, above: float) -> float:
    """A counter of `url`'s /metrics once it is above `above`, or its last value."""
    deadline = time.monotonic() + METRICS_WAIT_S
    async with client() as http:
        while True:
            value = await metric(http, url, name)
            if value > above or time.monotonic() > deadline:
                return value
            await asyncio.sleep(1.0)


def _quiescent(st: Stack) -> None:
    async def run() -> tuple[bool, float, dict[str, dict[str, float]]]:
        async with client() as http:
            return await wait_quiescent(http, [s.url for s in st.servers], 60)

    ok, _, state = asyncio.run(run())
    assert ok, f"requests or KV blocks still held: {state}\n{servers_said(st.servers)}"


def _through_router(st: Stack, rounds: int, what: str) -> None:
    """Rounds of 24 requests at once through the router: every answer has the single
    instance's tokens; the decode received KV; nothing is held afterwards."""

    async def run() -> list[Outcome]:
        async with client() as http:
            return await batch(
                [
                    complete(http, st.router_url, completion_body(p, st.model, MAX_TOKENS))
                    for p in _round_prompts()
                ]
            )

    for n in range(rounds):
        outcomes = asyncio.run(run())
        check_identical(outcomes, _REFERENCE, f"{what}, round {n}", st.servers)
    received = asyncio.run(
        _counter(st.decode.url, "vllm:kvpush_transfers_total", rounds * AT_ONCE - 1)
    )
    # Requests whose prompt the decode held whole in its prefix cache move nothing.
    assert received >= AT_ONCE, f"the decode received {received} transfers"
    _quiescent(st)


TP_SHAPES = [(2, 1), (1, 2)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), TP_SHAPES, ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_behind_vllm_router_across_tp_sizes(
    model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    prefill_tp: int,
    decode_tp: int,
) -> None:
    """Prefill and decode of different TP sizes behind a router that knows nothing of
    kvpush: the decode registers the parts of its own TP, and the prefill splits the
    transfer as the registrations say. Its own servers, stopped after it (these tests
    come first, so that the TP 1 stack of the others is not up beside them)."""
    log_dir = tmp_path_factory.mktemp(f"vllm-router-tp{prefill_tp}-to-tp{decode_tp}")
    gen = _stack(model, log_dir, prefill_tp, decode_tp)
    st = next(gen)
    try:
        _through_router(st, SHAPE_ROUNDS, f"vllm-router, TP {prefill_tp} into {decode_tp}")
        _doctor_writes_across_ranks(st, prefill_tp, decode_tp)
    finally:
        gen.close()


def _doctor_writes_across_ranks(st: Stack, prefill_tp: int, decode_tp: int) -> None:
    """`kvpush doctor` on a pair of two TP sizes (no token; allow_doctor_writes): every
    decode rank is written into by a prefill rank, each worker serving its checks on its
    own port; the pair is said to work behind vLLM's routers."""
    args = ["doctor", "--json"]
    for role, server in (("prefill", st.prefill), ("decode", st.decode)):
        args += [
            f"--{role}",
            f"{HOST}:{server.spec.side_channel_port}",
            f"--{role}-http",
            server.url,
        ]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = cli_main(args)
    report = json.loads(out.getvalue())
    # Joined, not a list: pytest prints a message whole, a list's repr cut to a line.
    texts = "\n".join(f["text"] for s in report["steps"] for f in s["findings"])
    data = next(s for s in report["steps"] if s["name"] == "data plane")
    assert data["verdict"] == "ok", texts
    assert sorted(data["figures"]) == [f"prefill0->decode{d}" for d in range(decode_tp)], data
    for figures in data["figures"].values():
        assert figures["verified_bytes"] == LARGE_WRITE, figures
    compat = next(s for s in report["steps"] if s["name"] == "compatibility")
    assert compat["verdict"] == "ok", texts
    assert "vllm-router" in compat["figures"]["pair"]["routers"], compat
    # No token: the one warning (prefill_tp, decode_tp name the shape in the message).
    assert code == 0, (prefill_tp, decode_tp, texts)


def test_behind_vllm_router(stack: Stack) -> None:
    """vllm-router rebuilds the decode leg's params in vLLM's push dialect (the first
    request in turn, then, with the prefill's push identity cached, both legs at once)."""
    _through_router(stack, ROUNDS, "vllm-router")


def test_concurrent_legs_in_push_dialect(stack: Stack) -> None:
    """Both legs at once, as llm-d's sidecar sends them with a push identity (the
    decode leg first, the prefill leg a moment later): the answers are the single
    instance's, and decodes registered before their prefill offered the KV."""
    name = "vllm:kvpush_sends_registered_first_total"
    before = asyncio.run(_counter(stack.prefill.url, name, float("inf")))

    async def run() -> list[Outcome]:
        async with client() as http:
            identity = await push_identity(http, stack.prefill.url, stack.model)
            outcomes = await batch(
                [
                    concurrent_legs(
                        http,
                        stack.prefill.url,
                        stack.decode.url,
                        completion_body(p, stack.model, MAX_TOKENS),
                        identity,
                        prefill_after_s=PREFILL_AFTER_S,
                    )
                    for p in _round_prompts()
                ]
            )
            return outcomes

    for n in range(ROUNDS):
        outcomes = asyncio.run(run())
        check_identical(outcomes, _REFERENCE, f"concurrent legs, round {n}", stack.servers)
    after = asyncio.run(_counter(stack.prefill.url, name, before))
    assert after > before, (
        f"no decode registered before its prefill offered the KV ({name}: {after})\n"
        f"{servers_said(stack.servers)}"
    )
    _quiescent(stack)


def test_one_request_id_for_two_requests(stack: Stack) -> None:
    """Two requests under one X-Request-Id, both legs of both at once. Different
    prompts: each gets its own KV (tokens identical). The same prompt: the second is
    refused (its transfer id is taken), never served from the first's transfer."""
    different = (PROMPTS[0], PROMPTS[2])
    same = (PROMPTS[4], PROMPTS[4])

    async def run(prompts: tuple[str, str]) -> list[Outcome]:
        rid = f"reused-{uuid.uuid4().hex}"
        async with client() as http:
            identity = await push_identity(http, stack.prefill.url, stack.model)
            return await batch(
                [
                    concurrent_legs(
                        http,
                        stack.prefill.url,
                        stack.decode.url,
                        completion_body(p, stack.model, MAX_TOKENS),
                        identity,
                        request_id=rid,
                    )
                    for p in prompts
                ]
            )

    for n in range(ROUNDS):
        check_identical(
            asyncio.run(run(different)), _REFERENCE, f"reused id, round {n}", stack.servers
        )
        outcomes = asyncio.run(run(same))
        served = [o for o in outcomes if o.ok]
        # One transfer: at most one is served, with the right tokens. The second is
        # refused by kvpush; vLLM then aborts every request under that X-Request-Id
        # (its API server aborts by the client's id), often the first one too.
        assert len(served) <= 1, f"both were served from one transfer: {served}"
        check_identical(served, _REFERENCE, f"reused id and prompt, round {n}", stack.servers)
        for o in outcomes:
            assert o.ok or (o.error is not None and "HTTP 500" in o.error), o.error
    _quiescent(stack)


def test_the_doctor_measures_the_data_plane_between_the_two_vllm_servers(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvpush doctor` on the pair (its side channels and HTTP servers, and the token):
    each worker rank serves the doctor's checks on a port of its own that it publishes
    with its metadata, so the prefill's NIXL agent really writes into the decode's
    scratch buffer; the bytes land intact and the figures are the writes' own. The check
    ports take only what the token signs: a request without it is refused there."""
    assert stack.token_file is not None
    args = ["doctor", "--token-file", str(stack.token_file)]
    for role, server in (("prefill", stack.prefill), ("decode", stack.decode)):
        args += [
            f"--{role}",
            f"{HOST}:{server.spec.side_channel_port}",
            f"--{role}-http",
            server.url,
        ]
    started = time.monotonic()
    code = cli_main([*args, "--json"])
    took = time.monotonic() - started
    report = json.loads(capsys.readouterr().out)
    step = next(s for s in report["steps"] if s["name"] == "data plane")
    texts = [f["text"] for s in report["steps"] for f in s["findings"]]
    assert step["verdict"] == "ok", texts
    assert code == report["exit_code"] == 0, texts
    [finding] = step["findings"]
    assert finding["text"].startswith("prefill rank 0 -> decode rank 0: "), finding
    assert (
        f"the {LARGE_WRITE // (1024 * 1024)} MiB landed intact (sha256 compared)"
        in (finding["text"])
    ), finding
    figures = step["figures"]["prefill0->decode0"]
    assert figures["verified_bytes"] == LARGE_WRITE, figures
    for size in (SMALL_WRITE, LARGE_WRITE):
        timed = figures["sizes"][str(size)]
        assert timed["writes"] > 0 and 0 < timed["seconds"] < PROBE_TIMEOUT_S, figures
        assert timed["gb_per_s"] > 0, figures
    assert "UCX" in figures["transport"]["transport"], figures
    # The checks are served where each rank says, behind the engine's token.
    token = load_token(stack.token_file)
    for server in stack.servers:
        port = server.spec.side_channel_port
        assert port is not None
        meta = fetch_metadata(HOST, port, 0, token=token)
        assert meta.scratch is not None and meta.probe_port not in (None, port), meta
        with pytest.raises(AuthenticationRefused):
            control_request(HOST, meta.probe_port, DOCTOR_DIGEST, {"rank": 0, "bytes": 16})
        answer = control_request(
            HOST, meta.probe_port, DOCTOR_DIGEST, {"rank": 0, "bytes": 16}, token=token
        )
        assert isinstance(answer, dict) and len(answer["sha256"]) == 64, answer
    # vLLM's own series and the connector's, from each server's /metrics.
    health = next(s for s in report["steps"] if s["name"] == "health")
    for role in ("prefill", "decode"):
        [line] = [
            f["text"]
            for f in health["findings"]
            if f["side"] == role and f["text"].startswith("vLLM's /metrics: requests running")
        ]
        assert "kvpush transfers finished" in line, line
        # Transfers that did not finish (the reused-id test before this one makes some:
        # the refused second request, the first that vLLM aborts with it) are counted
        # from the connector's series, and warned about with the next action.
        figures = health["figures"][role]
        not_finished = sum(figures["transfer_failures"].values())
        assert f"not finished {not_finished:g}" in line, (line, figures)
        warned = [f for f in health["findings"] if f["side"] == role and f["verdict"] == "warn"]
        faults = sum(
            v
            for k, v in figures["transfer_failures"].items()
            if k.rsplit("/", 1)[-1] not in ("cancelled", "rejected", "shutdown")
        )
        bad = faults or figures["nixl_failed_parts"] or figures["nixl_expired"]
        assert bool(warned) == bool(bad), (warned, figures)
        assert all(f["next_action"] for f in warned), warned
    assert cli_main(args) == code
    print(f"doctor on the vLLM pair took {took:.1f} s\n{capsys.readouterr().out}")


def test_the_doctor_names_the_refusal_a_pair_of_two_block_sizes_meets(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    """A decode whose blocks are twice the prefill's. vLLM-CPU's layout (each head's K
    of a block transposed) cannot carry blocks of two sizes, so the prefill refuses every
    request such a decode registers, behind any router: the doctor fails the pair with
    that refusal and the next action. It is pointed at the real prefill and at a side
    channel on loopback that publishes the real decode's rank as it would be at that
    block size (the verdict reads the two ranks' published caches; a second vLLM decode
    would cost minutes). Layouts that do carry them, and the routers' verdict there:
    tests/test_doctor_routers.py."""
    assert stack.token_file is not None
    token = load_token(stack.token_file)
    port = stack.decode.spec.side_channel_port
    assert port is not None
    real = fetch_metadata(HOST, port, 0, token=token)
    g = real.geometry
    assert not g.groups, g
    doubled = msgspec.structs.replace(
        g,
        block_size_tokens=2 * g.block_size_tokens,
        regions=[
            msgspec.structs.replace(
                r, block_bytes=2 * r.block_bytes, block_stride=2 * r.block_stride,
                num_blocks=r.num_blocks // 2,
            )
            for r in g.regions
        ],
    )  # fmt: skip
    decode = MetadataServer(
        HOST,
        0,
        SideChannelConfig(token=token),
        {0: msgspec.structs.replace(real, geometry=doubled)},
    )
    with decode:
        args = [
            "doctor",
            "--token-file",
            str(stack.token_file),
            "--prefill",
            f"{HOST}:{stack.prefill.spec.side_channel_port}",
            "--decode",
            f"{HOST}:{decode.port}",
            "--json",
        ]
        code = cli_main(args)
    report = json.loads(capsys.readouterr().out)
    step = next(s for s in report["steps"] if s["name"] == "compatibility")
    texts = [f["text"] for f in step["findings"]]
    assert step["verdict"] == "fail", texts
    [failed] = [f for f in step["findings"] if f["verdict"] == "fail"]
    p, d = g.block_size_tokens, 2 * g.block_size_tokens
    assert failed["text"].startswith(
        f"rank 0: TP 1 rank 0 ({p}-token blocks) and TP 1 rank 0 ({d}-token blocks): "
        "vLLM-CPU's attention keeps each head's K of a block transposed"
    ), failed
    assert failed["next_action"].startswith("start both servers with the same --block-size"), failed
    assert "behind any router or proxy" in failed["next_action"], failed
    assert code == report["exit_code"] == 1, report["verdict"]
