"""kvpush inside real vLLM: prefill and decode servers with KvpushConnector, against a
single vLLM instance, token for token, on 127.0.0.1 and on ::1.

The two address families also split the connector's two push modes, so neither costs
servers of its own: on 127.0.0.1 the prefill pushes layer by layer (the default), on ::1
whole requests (`"push": "whole"`). Decode servers and the single instance run n-gram
speculative decoding, so every round also checks that speculation over pushed KV gives
the same tokens, and one test compares each request's drafts and accepted tokens: on
127.0.0.1 the decode server runs a constant speculation schedule, under which vLLM does
not pad a request's first step with placeholder drafts, and they must be equal; on ::1
the plain config, where vLLM pads it, and they must differ by exactly that step.

The decode servers run with vLLM's `--shutdown-timeout`: each family's last test stops
its decode with SIGTERM while requests wait on it for their KV, and it must drain them.

Servers come from the vLLM venv (`make vllm-venv`; `make test` builds it). Its absence
is a failure, never a skip: this file is the only proof that the connector works. Each
vLLM server costs ~3 GB and 35-70 s to start on this kind of host, so servers are shared
by every test of one address family (module-scoped), started together, and the
reference answers are computed once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.vllm_e2e import LIVENESS_BOUND_S, MAX_TOKENS, TIMING, warm_up
from helpers.vllm_e2e import PROMPTS as COMMON_PROMPTS
from kvpush.cli import main as cli_main
from kvpush.errors import ConfigError
from kvpush.integrations.vllm.affinity import cpu_list
from kvpush.net import bracket_host
from kvpush.procs.readiness import free_port
from kvpush_lab.vllm_servers import (
    NGRAM_SPEC_TOKENS,
    NGRAM_SPECULATION,
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
    metric_in,
    ngram_speculation,
    sequential,
    servers_said,
    speculation,
    start_kvpush_proxy,
    vllm_python,
    wait_quiescent,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [
    *COMMON_PROMPTS,
    # Repeated n-grams. After the first, this tiny model's greedy output loops, so n-gram
    # drafts are proposed and accepted (5 tokens; "short" gets 1); the second gets none:
    # the test asks the single instance for at least two prompts with drafts accepted.
    "abcabcabcabc",
    "ab ab ab ab ab ab ab ab",
]
# Push mode per address family (see the module's docstring); None: the default.
PUSH = {"127.0.0.1": None, "::1": "whole"}
# Whether the decode server's speculation is unpadded, per address family (ditto).
UNPADDED = {"127.0.0.1": True, "::1": False}
# The decode's `--shutdown-timeout`: how long vLLM's engine may drain after SIGTERM.
DRAIN_S = 20


@dataclass
class Family:
    host: str
    model: str
    prefill: VllmServer
    decode: VllmServer
    proxy: subprocess.Popen[bytes]
    proxy_url: str
    log_dir: Path
    push: str  # the prefill's push mode
    unpadded: bool  # the decode server's speculation (see UNPADDED)

    def prefill_side_channel(self) -> tuple[str, int]:
        assert self.prefill.spec.side_channel_port is not None
        return self.host, self.prefill.spec.side_channel_port


_REFERENCE: dict[str, Outcome] = {}
# Per prompt, run alone on the single instance: (drafts, draft tokens, accepted tokens).
_REFERENCE_SPEC: dict[str, tuple[float, ...]] = {}


def _require_vllm() -> Path:
    try:
        return vllm_python()
    except ConfigError as exc:
        pytest.fail(f"the vLLM end-to-end test cannot run: {exc}", pytrace=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllm-model") / "tiny-llama")


def _kvpush_spec(
    name: str,
    host: str,
    role: str,
    *,
    push: str | None = None,
    extra_args: tuple[str, ...] = (),
) -> ServerSpec:
    extra: dict[str, object] = {**TIMING, "handshake_timeout_ms": 10000}
    if push is not None:
        extra["push"] = push
    return ServerSpec(
        name=name,
        host=host,
        port=free_port(host),
        connector="KvpushConnector",
        kv_role=role,
        side_channel_port=free_port(host),
        # The side channel answers from vLLM's engine-core process, busy stepping: 2 s
        # went by unanswered under load; a lookup that times out fails its transfer.
        extra_config=extra,
        extra_args=extra_args,
    )


def _reference(model: Path, server: VllmServer) -> None:
    """Each prompt alone (so the speculation counters around it are its own)."""

    async def run() -> list[tuple[Outcome, tuple[float, ...]]]:
        async with client() as http:
            out = []
            for p in PROMPTS:
                before = await speculation(http, server.url)
                outcome = await complete(
                    http, server.url, completion_body(p, str(model), MAX_TOKENS)
                )
                after = await speculation(http, server.url)
                out.append((outcome, tuple(a - b for a, b in zip(after, before, strict=True))))
            return out

    for outcome, spec in asyncio.run(run()):
        assert outcome.ok, f"the single instance failed {outcome.prompt!r}: {outcome.error}"
        _REFERENCE[outcome.prompt] = outcome
        _REFERENCE_SPEC[outcome.prompt] = spec


@pytest.fixture(scope="module", params=["127.0.0.1", "::1"], ids=["ipv4", "ipv6"])
def family(
    request: pytest.FixtureRequest, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Family]:
    python = _require_vllm()
    host: str = request.param
    log_dir = tmp_path_factory.mktemp(f"vllm-{'v6' if ':' in host else 'v4'}")
    push = PUSH[host]
    prefill = VllmServer(
        _kvpush_spec("prefill", host, "kv_producer", push=push),
        model=model,
        log_dir=log_dir,
        python=python,
    )
    decode = VllmServer(
        _kvpush_spec(
            "decode",
            host,
            "kv_consumer",
            extra_args=(
                *ngram_speculation(unpadded=UNPADDED[host]),
                "--shutdown-timeout",
                str(DRAIN_S),
            ),
        ),
        model=model,
        log_dir=log_dir,
        python=python,
    )
    servers = [prefill, decode]
    single = None
    if not _REFERENCE:
        single = VllmServer(
            ServerSpec("single", host, free_port(host), extra_args=NGRAM_SPECULATION),
            model=model,
            log_dir=log_dir,
            python=python,
        )
        servers.append(single)
    proxy: subprocess.Popen[bytes] | None = None
    try:
        for server in servers:  # all at once: a start is mostly waiting
            server.start()
        for server in servers:
            server.wait_ready()
        warm_up(model, [prefill, decode])
        if single is not None:
            _reference(model, single)
            single.stop()
        proxy, proxy_url = start_kvpush_proxy(prefill, decode, log_dir)
        yield Family(
            host,
            str(model),
            prefill,
            decode,
            proxy,
            proxy_url,
            log_dir,
            push or "layerwise",
            UNPADDED[host],
        )
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for server in servers:
            server.stop()


def _check_identical(fam: Family, outcomes: list[Outcome], what: str) -> None:
    check_identical(outcomes, _REFERENCE, what, [fam.prefill, fam.decode])


def _bodies(fam: Family) -> list[dict[str, object]]:
    return [completion_body(p, fam.model, MAX_TOKENS) for p in PROMPTS]


async def _metrics(fam: Family, http: httpx.AsyncClient) -> dict[str, float]:
    """The decode server's."""
    return {
        "hits": await metric(http, fam.decode.url, "vllm:prefix_cache_hits_total"),
        "received": await metric(http, fam.decode.url, "vllm:kvpush_transfers_total"),
        "waiting": await metric(http, fam.decode.url, "vllm:num_requests_waiting"),
        "running": await metric(http, fam.decode.url, "vllm:num_requests_running"),
    }


async def _push_metrics(fam: Family, http: httpx.AsyncClient) -> dict[str, float]:
    """The prefill server's: how it offered its transfers."""
    p_url = fam.prefill.url
    return {
        "layerwise": await metric(http, p_url, "vllm:kvpush_sends_total", push="layerwise"),
        "whole": await metric(http, p_url, "vllm:kvpush_sends_total", push="whole"),
        "by_layer": await metric(
            http, p_url, "vllm:kvpush_layers_announced_total", by="save_kv_layer"
        ),
        "by_step": await metric(
            http, p_url, "vllm:kvpush_layers_announced_total", by="wait_for_save"
        ),
    }


def test_rounds_through_kvpush_proxy_match_a_single_instance(family: Family) -> None:
    """20 rounds through `kvpush proxy` (both legs at once): every token identical."""

    async def run() -> tuple[dict[str, float], dict[str, float]]:
        async with client() as http:
            before = await _metrics(family, http) | await _push_metrics(family, http)
            for i in range(20):
                outcomes = await batch(
                    [complete(http, family.proxy_url, b) for b in _bodies(family)]
                )
                _check_identical(family, outcomes, f"round {i + 1} via kvpush proxy")
            return before, await _metrics(family, http) | await _push_metrics(family, http)

    before, after = asyncio.run(run())
    d = {k: after[k] - before[k] for k in after}
    # Every request's KV came through kvpush (metrics are exported every few seconds,
    # so at least the earlier rounds must show), and some reused the decode's own
    # prefix cache for their first blocks.
    assert d["received"] > 0
    assert d["hits"] > 0, "no decode-side prefix-cache hit happened"
    # The prefill pushed the way its family asks: layer-wise sends announced every
    # layer from save_kv_layer, as vLLM computed it (none left for the step's end).
    other = "whole" if family.push == "layerwise" else "layerwise"
    assert d[family.push] > 0 and d[other] == 0, f"push {family.push!r}: {d}"
    if family.push == "layerwise":
        assert d["by_layer"] > 0 and d["by_step"] == 0, f"layers announced: {d}"
    else:
        assert d["by_layer"] == d["by_step"] == 0, f"layers announced: {d}"


# The series of vLLM's NixlPromMetrics that dashboards for its NIXL connectors read, and
# their types (docs/vllm.md, "Metrics").
NIXL_SERIES = {
    "vllm:nixl_xfer_time_seconds": "histogram",
    "vllm:nixl_post_time_seconds": "histogram",
    "vllm:nixl_bytes_transferred": "histogram",
    "vllm:nixl_num_descriptors": "histogram",
    "vllm:nixl_num_failed_transfers": "counter",
    "vllm:nixl_num_kv_expired_reqs": "counter",
}
# vLLM's NixlKVConnectorStats.reduce() fields, in its order, less "Num notifs after
# expiry" (no kvpush counterpart).
KV_TRANSFER_FIELDS = [
    "Num successful transfers",
    "Avg xfer time (ms)",
    "P90 xfer time (ms)",
    "Avg post time (ms)",
    "P90 post time (ms)",
    "Avg MB per transfer",
    "Throughput (MB/s)",
    "Avg number of descriptors",
    "Num failed transfers",
    "Num KV expired reqs",
]


async def _nixl(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    """One scrape of a server: what a dashboard reads from the vllm:nixl_* series (and
    whether each is there, of its type), beside kvpush's own transfer counts."""
    text = (await http.get(f"{url}/metrics", timeout=10)).text
    # (The text format names a counter's family after its sample, `_total` included.)
    out = {
        f"{name} is a {kind}": float(
            f"# TYPE {name}{'_total' if kind == 'counter' else ''} {kind}\n" in text
        )
        for name, kind in NIXL_SERIES.items()
    }
    for name, kind in NIXL_SERIES.items():
        short = name.removeprefix("vllm:nixl_")
        if kind == "histogram":
            out[f"{short} count"] = metric_in(text, f"{name}_count")
            out[f"{short} sum"] = metric_in(text, f"{name}_sum")
        else:
            out[short] = metric_in(text, f"{name}_total")
    out["xfer under 5 s"] = metric_in(text, "vllm:nixl_xfer_time_seconds_bucket", le="5.0")
    out["sends ended"] = metric_in(text, "vllm:kvpush_transfers_total", side="sender")
    out["sends finished"] = metric_in(
        text, "vllm:kvpush_transfers_total", side="sender", outcome="finished"
    )
    for side in ("sender", "receiver"):
        out[f"{side} bytes"] = metric_in(text, "vllm:kvpush_transfer_bytes_total", side=side)
    return out


def _geometry(server: VllmServer) -> tuple[int, int]:
    """(bytes per block, regions) of rank 0's registered cache, from its log."""
    found = re.search(
        r"kvpush rank 0: \d+ layers in (\d+) regions, \d+ blocks of (\d+) bytes",
        server.log_path.read_text(errors="replace"),
    )
    assert found, f"no registration line in {server.log_path}"
    return int(found[2]), int(found[1])


def _kv_transfer_lines(server: VllmServer) -> list[dict[str, str]]:
    """vLLM's periodic "KV Transfer metrics" lines in a server's log, as fields."""
    out = []
    for line in server.log_path.read_text(errors="replace").splitlines():
        _, sep, fields = line.partition("KV Transfer metrics: ")
        if sep:
            out.append(dict(f.split("=", 1) for f in fields.split(", ")))
    return out


def test_the_nixl_series_a_dashboard_reads_count_the_transfers_run(family: Family) -> None:
    """A dashboard built for vLLM's NixlConnector reads vllm:nixl_*. After one round
    through the proxy, each is on both servers' /metrics, of vLLM's type, with the
    round's transfers: one observation per send the prefill finished (it posts the
    writes; the decode posts none), bytes that are whole blocks and what the decode's
    blocks received, times positive and each under 5 s, no failure; and the prefill's
    log gets vLLM's "KV Transfer metrics" line with vLLM's fields."""
    bytes_per_block, regions = _geometry(family.prefill)
    servers = {"prefill": family.prefill.url, "decode": family.decode.url}
    lines_before = len(_kv_transfer_lines(family.prefill))

    async def settled(http: httpx.AsyncClient) -> dict[str, dict[str, float]]:
        # vLLM exports a step's connector stats with the transfers it reports, and a
        # prefill's sends end just after its decode answered: read the counters once
        # both servers hold no request and no block (the step that frees a send's
        # blocks exports its end), so that no earlier round's sends end inside this one.
        quiet, waited, state = await wait_quiescent(http, list(servers.values()), 30)
        assert quiet, f"the pair still busy after {waited:.1f} s: {state}"
        return {role: await _nixl(http, url) for role, url in servers.items()}

    async def run() -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]], float]:
        async with client() as http:
            before = await settled(http)
            started = time.monotonic()
            outcomes = await batch([complete(http, family.proxy_url, b) for b in _bodies(family)])
            took = time.monotonic() - started
            _check_identical(family, outcomes, "the round the nixl series count")
            # Quiescent is not always exported: a run here read 1 send ended of 10 at
            # once. Read again, up to 30 s, until the round's sends are all counted.
            deadline = time.monotonic() + 30
            after = await settled(http)
            while (
                after["prefill"]["sends ended"] - before["prefill"]["sends ended"] < len(PROMPTS)
                and time.monotonic() < deadline
            ):
                await asyncio.sleep(0.5)
                after = await settled(http)
            return before, after, took

    before, after, took = asyncio.run(run())
    for role in servers:
        missing = [k for k, v in after[role].items() if " is a " in k and not v]
        assert not missing, f"the {role} server's /metrics lacks: {missing}"
    d = {r: {k: after[r][k] - before[r][k] for k in after[r]} for r in servers}
    p, dec = d["prefill"], d["decode"]
    assert p["sends ended"] == len(PROMPTS), (
        f"{p['sends ended']} sends ended ({p['sends finished']} finished), "
        f"num_failed_transfers {p['num_failed_transfers']}: {p}"
    )
    n = p["sends finished"]
    assert n > 0, p
    assert n == p["xfer_time_seconds count"] == p["post_time_seconds count"], p
    assert n == p["bytes_transferred count"] == p["num_descriptors count"], p
    # Bytes the prefill's data plane moved = its blocks moved x bytes per block = what
    # the decode's registered blocks received.
    assert p["bytes_transferred sum"] == p["sender bytes"] == dec["receiver bytes"], d
    assert p["bytes_transferred sum"] % bytes_per_block == 0
    blocks = p["bytes_transferred sum"] // bytes_per_block
    assert n <= blocks and n <= p["num_descriptors sum"] <= blocks * regions, p
    # Each in flight for a while, but none longer than 5 s (histogram buckets); the
    # round took `took` seconds.
    assert 0 < p["post_time_seconds sum"] <= p["xfer_time_seconds sum"], p
    assert p["xfer under 5 s"] == n, (took, p)
    assert p["num_failed_transfers"] == p["num_kv_expired_reqs"] == 0, p
    assert dec["xfer_time_seconds count"] == dec["num_failed_transfers"] == 0, dec
    assert dec["num_kv_expired_reqs"] == 0, dec
    # vLLM logs every 10 s what its interval saw.
    deadline = time.monotonic() + 15
    while len(new := _kv_transfer_lines(family.prefill)[lines_before:]) == 0:
        assert time.monotonic() < deadline, "no KV Transfer metrics line in the prefill's log"
        time.sleep(0.5)
    fields = new[-1]
    assert list(fields)[: len(KV_TRANSFER_FIELDS)] == KV_TRANSFER_FIELDS, fields
    assert int(fields["Num successful transfers"]) > 0 and float(fields["Avg xfer time (ms)"]) > 0
    assert fields["Num failed transfers"] == fields["Num KV expired reqs"] == "0", fields


def _doctor(
    family: Family, capsys: pytest.CaptureFixture[str], swap: bool = False
) -> tuple[int, dict[str, Any], str]:
    """`kvpush doctor` on the family's pair, as an operator runs it (with both HTTP
    servers, vLLM's); `swap`: --prefill and --decode given the wrong way round. The exit
    code, the JSON report and the text report."""
    sides = {
        role: (f"{bracket_host(family.host)}:{server.spec.side_channel_port}", server.url)
        for role, server in (("prefill", family.prefill), ("decode", family.decode))
    }
    if swap:
        sides = {"prefill": sides["decode"], "decode": sides["prefill"]}
    args = ["doctor"]
    for role, (side_channel, url) in sides.items():
        args += [f"--{role}", side_channel, f"--{role}-http", url]
    code = cli_main([*args, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert cli_main(args) == code
    return code, report, capsys.readouterr().out


def test_the_doctor_reads_a_healthy_vllm_pair_and_names_swapped_roles(
    family: Family, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 23 against vLLM with KvpushConnector: the healthy pair passes every step it
    checks (vLLM's /health and /metrics are read for their status only; no token here is
    the one warning), and the same pair named the wrong way round fails the side-channel
    step with the next action to swap them."""
    code, report, text = _doctor(family, capsys)
    verdicts = {s["name"]: s["verdict"] for s in report["steps"]}
    assert (report["verdict"], code) == ("warn", report["exit_code"]), text
    assert verdicts == {
        "addresses": "ok",
        "side channel": "warn",
        "compatibility": "ok",
        "data plane": "skip",
        "liveness and clocks": "ok",
        "health": "ok",
    }, text
    warnings = [f["text"] for s in report["steps"] for f in s["findings"] if f["verdict"] == "warn"]
    assert len(warnings) == 1 and warnings[0].startswith("no token:"), text
    # The connector's ranks register no scratch buffer: step 4 says it did not check.
    assert "prefill rank 0 -> decode rank 0: not checked: the prefill rank registers no " in text
    # What the connector's ranks measure is not on vLLM's /health: said, not guessed.
    assert (
        "heartbeat round trip and clock bound: not known (the prefill server's /health does "
        "not publish what its leases measured" in text
    ), text
    for role in ("prefill", "decode"):
        [rank] = next(s for s in report["steps"] if s["name"] == "side channel")["figures"][role]
        assert rank["role"] == ("sender" if role == "prefill" else "receiver"), rank
    code, report, text = _doctor(family, capsys, swap=True)
    assert code == 1, text
    fails = [
        f for s in report["steps"] if s["name"] == "side channel"
        for f in s["findings"] if f["verdict"] == "fail"
    ]  # fmt: skip
    assert fails and {f["next_action"] for f in fails} == {"swap --prefill and --decode"}, text


def _affinities(pid: int) -> dict[int, set[int]]:
    """Each thread of process `pid`: the CPUs it may run on."""
    out: dict[int, set[int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended since
            out[int(tid)] = os.sched_getaffinity(int(tid))
    return out


def test_the_ranks_threads_run_on_the_engines_cpus_not_the_workers_one_core(
    family: Family,
) -> None:
    """vLLM-CPU binds a worker's main thread to one core (its OpenMP binding); the
    connector starts its rank's threads (the runtime's, NIXL's) on every CPU of the
    engine's process, as its start logs, and vLLM's own threads stay where vLLM put them.
    Before, the rank's threads shared the compute's one core, where a fresh-clone run
    saw threads there go unscheduled for seconds."""
    engine = os.sched_getaffinity(0)  # no one binds the test or the engine's process
    if len(engine) < 2:
        pytest.fail(f"needs a host where vLLM-CPU binds a worker to fewer CPUs than {engine}")
    for server in (family.prefill, family.decode):
        [worker] = [p for p in server.pids() if Path(f"/proc/{p}/comm").read_text().strip()
                    == "VLLM::Worker"]  # fmt: skip
        threads = _affinities(worker)
        assert threads[worker] < engine, f"{server.spec.name}: vLLM no longer binds {threads}"
        assert any(cpus == engine for cpus in threads.values()), threads
        log = server.log_path.read_text(errors="replace")
        assert f"its threads on CPUs {cpu_list(engine)}, the engine's" in log


def test_rounds_through_a_sequential_proxy_match_a_single_instance(family: Family) -> None:
    """20 rounds the way vLLM's example proxy runs them: prefill (max_tokens=1,
    do_remote_decode), then decode with the prefill's kv_transfer_params (transfer_id
    among them): every token identical."""

    async def run() -> None:
        async with client() as http:
            for i in range(20):
                outcomes = await batch(
                    [
                        sequential(http, family.prefill.url, family.decode.url, b)
                        for b in _bodies(family)
                    ]
                )
                _check_identical(family, outcomes, f"round {i + 1} via sequential proxy")

    asyncio.run(run())


# vLLM's scheduler pads a new request that has a single token to compute (its KV came
# from a connector) with `num_speculative_tokens` placeholder drafts (-1), "to preserve
# full cudagraph" (vllm/v1/core/sched/scheduler.py:1131-1153, placeholders at 1371-1375;
# on CPU too), unless speculation has a schedule (`dynamic_sd_lookup`), and counts them
# as drafts (2116): that step is one draft of that many tokens, none accepted, whatever
# the connector (vLLM's NixlConnector too: docs/vllm.md).
_PADDED_STEP = (1.0, float(NGRAM_SPEC_TOKENS), 0.0)


def test_speculative_acceptance_per_request_matches_a_single_instance(family: Family) -> None:
    """n-gram speculation on the decode server over pushed KV: each request's drafts,
    draft tokens and accepted tokens equal the single instance's, so its acceptance
    length (1 + accepted / drafts, as vLLM reports it) does too (one request at a time,
    the decode server's counters read around each); on the family whose decode server
    runs the plain config, vLLM's padded first step is exactly one draft more."""
    accepted = sorted(p for p, spec in _REFERENCE_SPEC.items() if spec[2] > 0)
    assert len(accepted) >= 2, (
        f"n-gram drafts were accepted for {accepted} only on the single instance: "
        "the comparison would prove little"
    )

    async def run() -> dict[str, tuple[float, ...]]:
        async with client() as http:
            out = {}
            for body in _bodies(family):
                before = await speculation(http, family.decode.url)
                outcome = await complete(http, family.proxy_url, body)
                _check_identical(family, [outcome], "speculative decoding, one request at a time")
                after = await speculation(http, family.decode.url)
                out[outcome.prompt] = tuple(a - b for a, b in zip(after, before, strict=True))
            return out

    got = asyncio.run(run())
    padding = (0.0, 0.0, 0.0) if family.unpadded else _PADDED_STEP
    want = {
        p: tuple(a + b for a, b in zip(spec, padding, strict=True))
        for p, spec in _REFERENCE_SPEC.items()
    }
    differ = {p: (got[p], w) for p, w in want.items() if got[p] != w}
    assert not differ, (
        "(drafts, draft tokens, accepted) on the decode server vs the single instance's"
        f"{'' if family.unpadded else ' plus the padded step'}: {differ}; "
        f"all single: {_REFERENCE_SPEC}"
    )


def test_prefill_killed_mid_batch_fails_the_waiting_requests_in_bound_then_recovers(
    family: Family,
) -> None:
    """Decode legs of a batch registered; the prefill serves the first half, then is
    killed (-9, whole process group): the other half must fail within the liveness
    bound, the decode server must be left with nothing waiting, and after a restart on
    the same ports the next round succeeds."""
    host, sc_port = family.prefill_side_channel()
    bodies = _bodies(family)
    half = len(bodies) // 2

    async def run() -> tuple[list[Outcome], float, dict[str, float]]:
        async with client() as http:
            decode_nixl = await _nixl(http, family.decode.url)
            decode_legs = []
            prefill_legs = []
            for i, body in enumerate(bodies):
                tid = f"kill-test-{i}-{time.monotonic_ns()}"
                d_body = {
                    **body,
                    "kv_transfer_params": {
                        "do_remote_prefill": True,
                        "remote_host": host,
                        "remote_port": sc_port,
                        "tp_size": 1,
                        "transfer_id": tid,
                    },
                }
                decode_legs.append(asyncio.ensure_future(complete(http, family.decode.url, d_body)))
                if i < half:
                    p_body = {
                        **body,
                        "max_tokens": 1,
                        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid},
                    }
                    prefill_legs.append(complete(http, family.prefill.url, p_body))
            for p in await batch(prefill_legs):
                assert p.ok, f"prefill leg before the kill failed: {p.error}"
            first_half = await batch(decode_legs[:half])
            _check_identical(family, first_half, "before the kill")
            await asyncio.to_thread(family.prefill.kill)
            killed_at = time.monotonic()
            rest = await batch(decode_legs[half:])
            return rest, time.monotonic() - killed_at, decode_nixl

    rest, waited, decode_nixl = asyncio.run(run())
    for outcome in rest:
        assert not outcome.ok, f"{outcome.prompt!r} succeeded without its prefill"
    assert waited < LIVENESS_BOUND_S, (
        f"the waiting requests took {waited:.1f}s to fail\n{servers_said([family.decode])}"
    )

    async def decode_drained() -> dict[str, float]:
        async with client() as http:
            return await _metrics(family, http)

    m = asyncio.run(decode_drained())
    assert m["waiting"] + m["running"] == 0, (
        f"decode server still holds requests: {m}\n{servers_said([family.decode])}"
    )

    async def decode_failures() -> dict[str, float]:
        """What a dashboard reads on the decode: exactly the transfers the kill failed
        (each a request's one part here); none expired, a prefill's count."""
        async with client() as http:
            deadline = time.monotonic() + 15
            while True:
                now = await _nixl(http, family.decode.url)
                failed = now["num_failed_transfers"] - decode_nixl["num_failed_transfers"]
                if failed >= len(rest) or time.monotonic() > deadline:
                    return {k: now[k] - decode_nixl[k] for k in now}
                await asyncio.sleep(0.2)

    f = asyncio.run(decode_failures())
    assert (f["num_failed_transfers"], f["num_kv_expired_reqs"]) == (len(rest), 0), f

    family.prefill.start()
    family.prefill.wait_ready()
    # As at the first start: its first request's lazy set-up would land inside the
    # liveness window of the first transfers (seen with two CI runs on 2 cores: the
    # restarted prefill silent for 8 s, nine of ten transfers timed out).
    warm_up(Path(family.model), [family.prefill])

    async def after_restart() -> None:
        async with client() as http:
            outcomes = await batch([complete(http, family.proxy_url, b) for b in bodies])
            _check_identical(family, outcomes, "first round after the restart")
            outcomes = await batch(
                [sequential(http, family.prefill.url, family.decode.url, b) for b in bodies]
            )
            _check_identical(family, outcomes, "sequential round after the restart")

    asyncio.run(after_restart())


def test_decode_stopped_with_sigterm_drains_the_requests_waiting_for_their_kv(
    family: Family,
) -> None:
    """The family's last test (its decode stays down). Decode legs of four requests
    queued on the decode, registered with the prefill, their prefill legs not sent yet;
    SIGTERM to the decode's server process, as an orchestrator stops it; then their
    prefill legs. vLLM's engine drains (`--shutdown-timeout`): the decode takes the KV
    pushed into it and answers each with the single instance's tokens, the prefill holds
    nothing afterwards, and the decode exits on its own within its drain bound."""
    host, sc_port = family.prefill_side_channel()
    bodies = _bodies(family)[:4]

    async def run() -> tuple[list[Outcome], float]:
        async with client() as http:
            stamp = time.monotonic_ns()
            tids = [f"drain-{i}-{stamp}" for i in range(len(bodies))]
            decode_legs = []
            for body, tid in zip(bodies, tids, strict=True):
                params = {
                    "do_remote_prefill": True,
                    "remote_host": host,
                    "remote_port": sc_port,
                    "tp_size": 1,
                    "transfer_id": tid,
                }
                d_body = {**body, "kv_transfer_params": params}
                decode_legs.append(asyncio.ensure_future(complete(http, family.decode.url, d_body)))
            deadline = time.monotonic() + 30
            while await metric(http, family.decode.url, "vllm:num_requests_waiting") < len(bodies):
                assert time.monotonic() < deadline, "the decode never queued the legs"
                await asyncio.sleep(0.2)
            assert family.decode.pid is not None
            os.kill(family.decode.pid, signal.SIGTERM)
            stopped_at = time.monotonic()
            prefill_legs = [
                complete(
                    http,
                    family.prefill.url,
                    {
                        **body,
                        "max_tokens": 1,
                        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid},
                    },
                )
                for body, tid in zip(bodies, tids, strict=True)
            ]
            for p in await batch(prefill_legs):
                assert p.ok, f"a prefill leg during the decode's drain failed: {p.error}"
            outcomes = await batch(decode_legs)
            while family.decode.alive():
                assert time.monotonic() - stopped_at < DRAIN_S + 30, (
                    f"the decode still runs {DRAIN_S + 30} s after SIGTERM; its legs: "
                    f"{[o.error or 'ok' for o in outcomes]}\n{servers_said([family.decode])}"
                )
                await asyncio.sleep(0.2)
            return outcomes, time.monotonic() - stopped_at

    outcomes, exited = asyncio.run(run())
    _check_identical(family, outcomes, "requests the decode drained")
    assert exited < DRAIN_S + 30, exited
    log = family.decode.log_path.read_text(errors="replace")
    assert "[shutdown] EngineCore: start mode=drain" in log

    async def prefill_quiet() -> tuple[bool, float, dict[str, dict[str, float]]]:
        async with client() as http:
            return await wait_quiescent(http, [family.prefill.url], timeout_s=60)

    quiet, waited, state = asyncio.run(prefill_quiet())
    assert quiet, f"the prefill still holds work {waited:.0f} s on: {state}"
