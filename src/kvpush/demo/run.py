"""The end-to-end demo: prefill, decode and proxy processes, checked against one instance.

`run_demo(options, say)`:

1. builds the tiny model if the directory has none (`make_model`);
2. starts four processes: a prefill server, a decode server, the proxy, and a
   single-instance server (`--role both`) as the reference, and waits for each with the
   wait-ready logic (a process that dies at start-up fails the demo at once, with its
   log tail);
3. sends a concurrent, streamed workload of prompts of varied lengths through the proxy,
   and the same prompts to the single instance;
4. checks every completion token for token and the mean acceptance length of
   speculative decoding request by request, and reads the transfer counters;
5. optionally (`inject="kill-prefill"`) kills the prefill server in the middle of a second
   workload, checks that every affected request ends promptly with a reason and nothing
   hangs, restarts it and checks that new requests succeed;
6. stops everything and returns a `DemoReport` (`ok` says whether every check passed).

`say` receives the human-readable lines (the CLI prints them; the library never prints).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvpush.metrics_text import parse_metrics, series
from kvpush.procs.readiness import free_port
from kvpush.procs.server_process import ServerProcess
from kvpush.stats import percentile

Say = Callable[[str], None]

_WORDS = (
    "kv",
    "cache",
    "block",
    "prefill",
    "decode",
    "push",
    "transfer",
    "nixl",
    "layer",
    "token",
    "prompt",
    "tensor",
    "write",
    "register",
    "lease",
    "fence",
    "handshake",
    "rank",
    "engine",
    "latency",
    "throughput",
    "batch",
    "speculative",
    "draft",
    "accept",
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "that",
)


@dataclass(frozen=True, slots=True)
class DemoOptions:
    model_dir: Path
    host: str = "127.0.0.1"
    num_requests: int = 16
    concurrency: int = 8
    max_tokens: int = 32
    speculative_tokens: int = 4
    block_size: int = 16
    layerwise: bool = True
    inject: str | None = None  # "kill-prefill"
    compare_layerwise: bool = False  # rerun with layer-wise push switched, compare TTFT
    log_dir: Path | None = None
    seed: int = 0
    ready_timeout_s: float = 120.0
    request_timeout_s: float = 120.0
    decode_num_blocks: int | None = None  # the decode server's KV cache; None: its default
    prefill_num_blocks: int | None = None  # the prefill server's KV cache; None: its default
    queue_timeout_s: float | None = None  # how long servers queue a request; None: default
    # The servers' shared secret (side channels, and the proxy's cancels); None: none.
    token_file: Path | None = None
    # How long the servers let a peer be silent (`kvpush serve --liveness-timeout-s`);
    # None: their default.
    liveness_timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class RequestResult:
    index: int
    token_ids: tuple[int, ...]
    ttft_s: float | None
    itl_s: float | None  # mean inter-token latency
    latency_s: float
    acceptance: float | None  # mean acceptance length of this request
    error: str | None = None


@dataclass(slots=True)
class DemoReport:
    host: str
    requests: int = 0
    matched: int = 0
    acceptance_pd: float = 0.0
    acceptance_single: float = 0.0
    acceptance_matched: int = 0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    itl_mean_s: float = 0.0
    kv_bytes: float = 0.0
    kv_transfer_s: float = 0.0
    transfers_finished: float = 0.0
    transfers_failed: float = 0.0
    ttft_single_p50_s: float = 0.0
    ttft_single_p99_s: float = 0.0
    ttft_other_p50_s: float | None = None  # with layer-wise push switched
    ttft_other_p99_s: float | None = None
    layerwise: bool = True
    inject_failed_promptly: int | None = None
    inject_max_failure_s: float | None = None
    inject_after_restart_ok: bool | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def mean_transfer_s(self) -> float:
        return self.kv_transfer_s / self.transfers_finished if self.transfers_finished else 0.0

    def summary_lines(self) -> list[str]:
        lines = [
            f"host                      {self.host}",
            f"requests                  {self.requests}",
            f"tokens match single run   {self.matched}/{self.requests}",
            f"acceptance length (P/D)   {self.acceptance_pd:.3f}",
            f"acceptance length (single){self.acceptance_single:>6.3f}  "
            f"(per request equal: {self.acceptance_matched}/{self.requests})",
            f"TTFT p50 / p99            {self.ttft_p50_s * 1e3:.1f} ms / "
            f"{self.ttft_p99_s * 1e3:.1f} ms",
            f"TTFT single instance      {self.ttft_single_p50_s * 1e3:.1f} ms / "
            f"{self.ttft_single_p99_s * 1e3:.1f} ms",
            f"inter-token latency       {self.itl_mean_s * 1e3:.2f} ms (mean)",
            f"layer-wise push           {'on' if self.layerwise else 'off'}",
            f"KV moved                  {self.kv_bytes / 1e6:.2f} MB in "
            f"{self.transfers_finished:.0f} transfers",
            # Each transfer waits for its prefill to compute, so bytes over these times is
            # no bandwidth figure: `kvpush bench` measures that.
            f"transfer time             {self.mean_transfer_s * 1e3:.1f} ms mean, from "
            f"registration to completion (waiting for prefill compute included)",
            f"transfers failed          {self.transfers_failed:.0f}",
        ]
        if self.inject_failed_promptly is not None:
            lines.append(
                f"kill-prefill              {self.inject_failed_promptly} requests failed, "
                f"slowest after {self.inject_max_failure_s or 0:.2f} s; after restart: "
                f"{'ok' if self.inject_after_restart_ok else 'FAILED'}"
            )
        if self.ttft_other_p50_s is not None and self.ttft_other_p99_s is not None:
            lines.append(
                f"TTFT p50 / p99, layer-wise {'off' if self.layerwise else 'on'}: "
                f"{self.ttft_other_p50_s * 1e3:.1f} ms / {self.ttft_other_p99_s * 1e3:.1f} ms"
            )
        for p in self.problems:
            lines.append(f"PROBLEM: {p}")
        return lines


def make_prompts(n: int, seed: int) -> list[str]:
    """Prompts of varied lengths, some sharing a head (so the prefix cache is exercised)."""
    rng = random.Random(seed)
    shared = " ".join(rng.choice(_WORDS) for _ in range(12))
    out = []
    for i in range(n):
        length = rng.choice((1, 3, 8, 20, 40, 80))
        body = " ".join(rng.choice(_WORDS) for _ in range(length))
        out.append(f"{shared} {body}" if i % 3 == 0 else body)
    return out


def make_load_prompts(n: int, seed: int) -> list[str]:
    """Prompts for a burst: lengths from a few tokens to several hundred, mixed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.choice((1, 3, 8, 16, 30, 45))
        out.append(" ".join(rng.choice(_WORDS) for _ in range(length)))
    return out


def metric_values(text: str) -> dict[str, float]:
    """Each sample of a `/metrics` answer by its series (`name{label="value",...}`)."""
    return {series(s): s.value for s in parse_metrics(text)}


def metric_sum(values: dict[str, float], prefix: str, *must: str) -> float:
    return sum(v for k, v in values.items() if k.startswith(prefix) and all(m in k for m in must))


async def _one(
    client: httpx.AsyncClient, url: str, index: int, prompt: str, max_tokens: int
) -> RequestResult:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    start = time.monotonic()
    ids: list[int] = []
    first: float | None = None
    last = start
    acceptance: float | None = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"].get("message")))
                new = chunk["choices"][0].get("token_ids") or []
                if new:
                    now = time.monotonic()
                    first = now if first is None else first
                    last = now
                    ids.extend(new)
                stats = chunk.get("kvpush_stats")
                if stats:
                    acceptance = float(stats["mean_acceptance_length"])
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        return RequestResult(
            index, tuple(ids), None, None, time.monotonic() - start, None, str(exc)
        )
    ttft = None if first is None else first - start
    itl = (last - first) / (len(ids) - 1) if first is not None and len(ids) > 1 else None
    return RequestResult(index, tuple(ids), ttft, itl, time.monotonic() - start, acceptance)


async def _workload(
    url: str, prompts: Sequence[str], max_tokens: int, concurrency: int, timeout_s: float
) -> list[RequestResult]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def run(i: int, p: str) -> RequestResult:
            async with gate:
                return await _one(client, url, i, p, max_tokens)

        return list(await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts))))


def run_workload(
    url: str, prompts: Sequence[str], *, max_tokens: int, concurrency: int, timeout_s: float = 120
) -> list[RequestResult]:
    """Send `prompts` (streamed, greedy, `ignore_eos`) with at most `concurrency` at once."""
    return asyncio.run(_workload(url, prompts, max_tokens, concurrency, timeout_s))


class Stack:
    """Prefill, decode, proxy and single-instance servers; `start()` / `close()`.

    With `options.compare_layerwise`, a second prefill server (layer-wise push switched
    the other way) and a second proxy in front of it and the same decode server.
    """

    def __init__(self, options: DemoOptions, log_dir: Path) -> None:
        self.options = options
        self.log_dir = log_dir
        host = options.host
        model = str(options.model_dir)
        self._common = ["--model", model, "--host", host, "--block-size", str(options.block_size)]
        if options.queue_timeout_s is not None:
            # A transfer must outlive the longest wait in the decode server's queue.
            self._common += ["--queue-timeout-s", str(options.queue_timeout_s)]
            deadline = max(60.0, options.queue_timeout_s + 30)
            self._common += ["--transfer-deadline-s", str(deadline)]
        if options.liveness_timeout_s is not None:
            self._common += ["--liveness-timeout-s", str(options.liveness_timeout_s)]
        self._token = (
            [] if options.token_file is None else ["--token-file", str(options.token_file)]
        )
        self._common += self._token
        spec = ["--speculative-tokens", str(options.speculative_tokens)]
        self.layerwise = options.layerwise
        self.prefill = self._prefill("prefill", layerwise=options.layerwise)
        d_port, d_side = free_port(host), free_port(host)
        decode_args = ["serve", "--role", "decode", "--port", str(d_port)]
        decode_args += ["--side-channel-port", str(d_side), *self._common, *spec]
        if options.decode_num_blocks is not None:
            decode_args += ["--num-blocks", str(options.decode_num_blocks)]
        self.decode = ServerProcess(
            "decode",
            decode_args,
            host=host,
            port=d_port,
            log_dir=log_dir,
            side_channel_port=d_side,
        )
        s_port = free_port(host)
        self.single = ServerProcess(
            "single",
            ["serve", "--role", "both", "--port", str(s_port), *self._common, *spec],
            host=host,
            port=s_port,
            log_dir=log_dir,
        )
        self.proxy = self._proxy("proxy", self.prefill)
        self.servers = [self.prefill, self.decode, self.single, self.proxy]
        self.other_prefill: ServerProcess | None = None
        self.other_proxy: ServerProcess | None = None
        if options.compare_layerwise:
            self.other_prefill = self._prefill("prefill-other", layerwise=not options.layerwise)
            self.other_proxy = self._proxy("proxy-other", self.other_prefill)
            self.servers += [self.other_prefill, self.other_proxy]

    def _prefill(self, name: str, *, layerwise: bool) -> ServerProcess:
        host = self.options.host
        port, side = free_port(host), free_port(host)
        args = ["serve", "--role", "prefill", "--port", str(port)]
        args += ["--side-channel-port", str(side), *self._common]
        if self.options.prefill_num_blocks is not None:
            args += ["--num-blocks", str(self.options.prefill_num_blocks)]
        if layerwise:
            args.append("--layerwise")
        return ServerProcess(
            name, args, host=host, port=port, log_dir=self.log_dir, side_channel_port=side
        )

    def _proxy(self, name: str, prefill: ServerProcess) -> ServerProcess:
        host = self.options.host
        port = free_port(host)
        args = ["proxy", "--prefill", prefill.url, "--decode", self.decode.url]
        args += ["--host", host, "--port", str(port), *self._token]
        return ServerProcess(name, args, host=host, port=port, log_dir=self.log_dir)

    def start(self) -> None:
        try:
            for s in self.servers:
                s.start()
            for s in self.servers:
                s.wait_ready(self.options.ready_timeout_s)
        except BaseException:
            self.close()
            raise

    def restart_prefill(self) -> None:
        """Start the prefill server again on the same ports (after `kill()`)."""
        self.prefill.close()
        self.prefill.start()
        self.prefill.wait_ready(self.options.ready_timeout_s)

    def close(self) -> None:
        for s in reversed(self.servers):
            s.close()

    def metrics(self, server: ServerProcess) -> dict[str, float]:
        return metric_values(httpx.get(f"{server.url}/metrics", timeout=10).text)


def compare(
    report: DemoReport, pd: Sequence[RequestResult], single: Sequence[RequestResult]
) -> None:
    report.requests = len(pd)
    for a, b in zip(pd, single, strict=True):
        if a.error or b.error:
            report.problems.append(f"request {a.index} failed: {a.error or b.error}")
            continue
        if a.token_ids == b.token_ids:
            report.matched += 1
        else:
            report.problems.append(f"request {a.index}: tokens differ from the single run")
        if a.acceptance == b.acceptance:
            report.acceptance_matched += 1
        else:
            report.problems.append(
                f"request {a.index}: acceptance {a.acceptance} != single {b.acceptance}"
            )


def run_demo(options: DemoOptions, say: Say) -> DemoReport:
    from kvpush.serving.checkpoint import make_model

    model_dir = options.model_dir
    if not (model_dir / "config.json").exists():
        say(f"building the tiny model in {model_dir}")
        make_model(model_dir, seed=options.seed)
    with tempfile.TemporaryDirectory(prefix="kvpush-demo-") as tmp:
        log_dir = options.log_dir or Path(tmp)
        stack = Stack(options, log_dir)
        say(
            f"starting prefill, decode, proxy and a single instance on {options.host} "
            f"(logs in {log_dir})"
        )
        stack.start()
        try:
            return _exercise(options, stack, say)
        finally:
            stack.close()


def _exercise(options: DemoOptions, stack: Stack, say: Say) -> DemoReport:
    report = DemoReport(options.host)
    prompts = make_prompts(options.num_requests, options.seed)
    # One request each way first: handshakes and first-call costs are not what TTFT means.
    # Both see the same warm-up, so the acceptance counters stay comparable.
    _warm_up(report, stack.proxy.url, stack.single.url)
    say(f"sending {len(prompts)} requests, {options.concurrency} at a time, through the proxy")
    pd = run_workload(
        stack.proxy.url,
        prompts,
        max_tokens=options.max_tokens,
        concurrency=options.concurrency,
        timeout_s=options.request_timeout_s,
    )
    say("sending the same requests to the single instance")
    single = run_workload(
        stack.single.url,
        prompts,
        max_tokens=options.max_tokens,
        concurrency=options.concurrency,
        timeout_s=options.request_timeout_s,
    )
    compare(report, pd, single)
    d_metrics, s_metrics = stack.metrics(stack.decode), stack.metrics(stack.single)
    report.acceptance_pd = d_metrics.get("kvpush_spec_decode_mean_acceptance_length", 0.0)
    report.acceptance_single = s_metrics.get("kvpush_spec_decode_mean_acceptance_length", 0.0)
    if report.acceptance_pd != report.acceptance_single:
        report.problems.append(
            f"mean acceptance length {report.acceptance_pd} (P/D) != "
            f"{report.acceptance_single} (single)"
        )
    ttfts = [r.ttft_s for r in pd if r.ttft_s is not None]
    itls = [r.itl_s for r in pd if r.itl_s is not None]
    report.ttft_p50_s, report.ttft_p99_s = percentile(ttfts, 50), percentile(ttfts, 99)
    report.itl_mean_s = statistics.fmean(itls) if itls else 0.0
    single_ttfts = [r.ttft_s for r in single if r.ttft_s is not None]
    report.ttft_single_p50_s = percentile(single_ttfts, 50)
    report.ttft_single_p99_s = percentile(single_ttfts, 99)
    report.kv_bytes = metric_sum(d_metrics, "kvpush_transfer_bytes_total", "receiver")
    report.kv_transfer_s = metric_sum(d_metrics, "kvpush_transfer_latency_seconds_sum", "receiver")
    report.transfers_finished = metric_sum(d_metrics, "kvpush_transfers_total", "finished")
    report.transfers_failed = metric_sum(d_metrics, "kvpush_transfers_total", '"failed"')
    if report.transfers_failed:
        report.problems.append(f"{report.transfers_failed:.0f} transfers failed")
    report.layerwise = options.layerwise
    if stack.other_proxy is not None:
        say(f"the same requests with layer-wise push {'off' if options.layerwise else 'on'}")
        _warm_up(report, stack.other_proxy.url)
        other = run_workload(
            stack.other_proxy.url,
            prompts,
            max_tokens=options.max_tokens,
            concurrency=options.concurrency,
            timeout_s=options.request_timeout_s,
        )
        for a, b in zip(other, single, strict=True):
            if a.error or a.token_ids != b.token_ids:
                report.problems.append(
                    f"request {a.index} (layer-wise switched): {a.error or 'tokens differ'}"
                )
        other_ttfts = [r.ttft_s for r in other if r.ttft_s is not None]
        report.ttft_other_p50_s = percentile(other_ttfts, 50)
        report.ttft_other_p99_s = percentile(other_ttfts, 99)
    if options.inject == "kill-prefill":
        _kill_prefill(options, stack=stack, say=say, report=report, prompts=prompts, single=single)
    return report


def _warm_up(report: DemoReport, *urls: str) -> None:
    for url in urls:
        for r in run_workload(url, ["warm up"], max_tokens=2, concurrency=1):
            if r.error:
                report.problems.append(f"warm-up request to {url} failed: {r.error}")


def _kill_prefill(
    options: DemoOptions,
    *,
    stack: Stack,
    say: Say,
    report: DemoReport,
    prompts: Sequence[str],
    single: Sequence[RequestResult],
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    say("inject kill-prefill: killing the prefill server while requests are in flight")
    bound_s = 10.0  # liveness timeout (3 s) plus generous slack on a loaded machine
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            run_workload,
            stack.proxy.url,
            prompts,
            max_tokens=options.max_tokens,
            concurrency=options.concurrency,
            timeout_s=options.request_timeout_s,
        )
        time.sleep(0.2)
        stack.prefill.kill()
        results = fut.result()
    failed = [r for r in results if r.error]
    report.inject_failed_promptly = sum(1 for r in failed if r.latency_s <= bound_s)
    report.inject_max_failure_s = max((r.latency_s for r in failed), default=0.0)
    for r in failed:
        say(f"  request {r.index} failed after {r.latency_s:.2f} s: {r.error}")
        if r.latency_s > bound_s:
            report.problems.append(f"request {r.index} took {r.latency_s:.1f} s to fail")
    for r in results:
        if not r.error and r.token_ids != single[r.index].token_ids:
            report.problems.append(f"request {r.index} succeeded with wrong tokens")
    say("restarting the prefill server")
    stack.restart_prefill()
    again = run_workload(
        stack.proxy.url,
        prompts[:4],
        max_tokens=options.max_tokens,
        concurrency=options.concurrency,
        timeout_s=options.request_timeout_s,
    )
    report.inject_after_restart_ok = all(
        not r.error and r.token_ids == single[r.index].token_ids for r in again
    )
    if not report.inject_after_restart_ok:
        report.problems.append(
            "after restarting prefill: " + "; ".join(str(r.error) for r in again if r.error)
        )


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """The serving demo's options, for whichever command runs it (`kvpush demo`)."""
    p.add_argument(
        "--model", default=".kvpush/tiny-llama", help="checkpoint dir (built if missing)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address for every server (::1 works)")
    p.add_argument("--requests", type=int, default=16, help="requests in the workload")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per completion")
    p.add_argument("--speculative-tokens", type=int, default=4, help="0 disables speculation")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--no-layerwise", action="store_true", help="push whole requests only")
    p.add_argument(
        "--compare-layerwise", action="store_true", help="also measure TTFT the other way"
    )
    p.add_argument("--inject", choices=("kill-prefill",), default=None, help="fault to show")
    p.add_argument("--log-dir", default=None, help="keep server logs here")


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    return DemoOptions(
        model_dir=Path(args.model),
        host=args.host,
        num_requests=args.requests,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        speculative_tokens=args.speculative_tokens,
        block_size=args.block_size,
        layerwise=not args.no_layerwise,
        compare_layerwise=args.compare_layerwise,
        inject=args.inject,
        log_dir=Path(args.log_dir) if args.log_dir else None,
    )
