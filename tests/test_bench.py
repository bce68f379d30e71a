"""`kvpush bench`: the report's shape and the integrity of the bytes, never the speed.

One real `kvpush bench --quick` run (real child processes, real NIXL over UCX, real
Mooncake where installed) is shared by the tests of its report.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from conftest import Endpoint, free_port, start_endpoint
from kvpush.bench import QUICK_ROUNDS

MODES = ("memcpy", "nixl-raw", "kvpush", "mooncake")


def _kvpush(
    *args: str, timeout: float = 90.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`kvpush ARGS`; one that runs past `timeout` dumps every thread's stack (Python's
    faulthandler, on SIGABRT) into the failure's message, so that a stall says where."""
    full_env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    argv = [sys.executable, "-m", "kvpush", *args]
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            raise AssertionError(
                f"{' '.join(argv)} ran past {timeout}s; it printed:\n{out[-2000:]}\n{err[-8000:]}"
            ) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


# The module's `--quick` runs of several modes take 8 rounds: what they check holds in
# any number of rounds, and `--quick`'s own 48 take about 100 s here with every default
# mode (Mooncake's rounds are slow). The default is checked on its own, with memcpy alone.
FIXTURE_ROUNDS = 8


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    json_path, plot_path = out / "report.json", out / "bench.png"
    proc = _kvpush(
        "bench",
        "--quick",
        "--rounds",
        str(FIXTURE_ROUNDS),
        "--no-progress",
        "--json",
        str(json_path),
        "--plot",
        str(plot_path),
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return {
        "report": json.loads(json_path.read_text()),
        "stdout": proc.stdout,
        "plot": plot_path,
    }


@pytest.mark.nixl
def test_every_mode_has_a_figure_or_a_reason(quick_run: dict[str, Any]) -> None:
    report = quick_run["report"]
    assert {"workload", "modes", "ratios", "host", "elapsed_s", "versions", "argv"} <= set(report)
    assert report["argv"][:2] == ["kvpush", "bench"]
    assert [m["mode"] for m in report["modes"]] == list(MODES)
    for m in report["modes"]:
        assert m["status"] in ("ok", "skipped", "failed"), m
        if m["status"] == "ok":
            assert m["reason"] is None
            assert [s["bytes"] for s in m["sizes"]] == report["workload"]["sizes_bytes"]
        else:
            assert isinstance(m["reason"], str) and m["reason"], m
    by_mode = {m["mode"]: m for m in report["modes"]}
    # The two baselines must always run: without them no ratio means anything.
    assert by_mode["memcpy"]["status"] == "ok", by_mode["memcpy"]
    assert by_mode["nixl-raw"]["status"] == "ok", by_mode["nixl-raw"]
    # Mooncake may be skipped only because its library cannot be loaded on this host.
    if by_mode["mooncake"]["status"] != "ok":
        assert by_mode["mooncake"]["status"] == "skipped", by_mode["mooncake"]
        assert "Mooncake is not importable" in by_mode["mooncake"]["reason"]
    assert by_mode["kvpush"]["status"] == "ok", by_mode["kvpush"]


@pytest.mark.nixl
def test_bytes_arrived_intact_in_every_mode(quick_run: dict[str, Any]) -> None:
    for m in quick_run["report"]["modes"]:
        for s in m["sizes"] + [x for x in (m["latency"], m["rate"]) if x]:
            sums = s["checksums"]
            assert sums["slots"] >= 1
            assert sums["src"] == sums["dst"], (m["mode"], s["bytes"])
            assert sums["match"] is True


@pytest.mark.nixl
def test_throughput_is_bytes_over_batch_wall_time(quick_run: dict[str, Any]) -> None:
    """GB/s must come from the whole batch's wall time, never from summed per-transfer rates."""
    report = quick_run["report"]
    per_block = report["workload"]["bytes_per_block"]
    regions = report["workload"]["regions"]
    for m in report["modes"]:
        for s in m["sizes"]:
            assert s["total_bytes"] == s["bytes"] * s["transfers"]
            assert math.isclose(s["gbps"], s["total_bytes"] / s["wall_s"] / 1e9, rel_tol=1e-9)
            assert s["descriptors"] == s["blocks"] * regions
            assert s["bytes"] == s["blocks"] * per_block
            assert 0 < s["p50_us"] <= s["p99_us"]
            # The batch cannot take less wall time than its slowest single transfer.
            assert s["wall_s"] * 1e6 >= s["p99_us"] * 0.999
        if m["status"] == "ok" and m["mode"] != "memcpy":
            assert m["rate"]["blocks"] == 1
            assert m["rate"]["inflight"] == report["workload"]["rate_inflight"] == 8
            assert m["latency"]["blocks"] == 1 and m["latency"]["inflight"] == 1
            for run in (m["rate"], m["latency"]):
                # CPU per transfer is the batch's CPU over its transfers, on each side.
                assert math.isclose(
                    run["sender_cpu_us_per_transfer"],
                    run["sender_cpu_s_per_gb"] * run["total_bytes"] / 1e9 / run["transfers"] * 1e6,
                    rel_tol=1e-6,
                )
                assert run["receiver_cpu_us_per_transfer"] is not None
            assert m["idle_cpu_percent"] is not None and m["idle_cpu_percent"] >= 0


def test_quick_runs_48_counted_rounds_of_64_mib_batches(tmp_path: Path) -> None:
    """`--quick` alone runs `QUICK_ROUNDS` (48) counted rounds, enough to span a shared
    host's slow spells (`kvpush.bench.QUICK_ROUNDS` says why), each a batch of at least
    `ROUND_MIN_BYTES` per size: memcpy, one size, as the CLI builds it."""
    from kvpush.bench.workload import ROUND_MIN_BYTES

    json_path = tmp_path / "report.json"
    proc = _kvpush(
        "bench", "--quick", "--modes", "memcpy", "--sizes", "512K", "--no-progress",
        "--json", str(json_path), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    report = json.loads(json_path.read_text())
    assert report["workload"]["rounds"] == QUICK_ROUNDS == 48
    (size,) = report["modes"][0]["sizes"]
    assert len(size["rounds"]) == QUICK_ROUNDS
    assert all(r["transfers"] * size["bytes"] >= ROUND_MIN_BYTES for r in size["rounds"])
    assert size["checksums"]["match"]


@pytest.mark.nixl
def test_the_modes_take_turns_size_by_size_in_every_round(quick_run: dict[str, Any]) -> None:
    """Each round runs each size on every mode, one mode right after the other, and the
    next round runs them in the reverse order: no two batches overlap, every mode's batch
    of a size in round r comes before any of round r + 1, and the order alternates."""
    report = quick_run["report"]
    rounds = report["workload"]["rounds"]
    assert rounds == FIXTURE_ROUNDS
    ok = [m for m in report["modes"] if m["status"] == "ok"]
    spans: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
    for m in ok:
        for s in [*m["sizes"], m["latency"], m["rate"]]:
            if s is None:
                continue
            assert len(s["rounds"]) == rounds, (m["mode"], s["label"])
            assert sum(r["transfers"] for r in s["rounds"]) == s["transfers"]
            assert math.isclose(sum(r["wall_s"] for r in s["rounds"]), s["wall_s"])
            for i, r in enumerate(s["rounds"]):
                spans.setdefault((s["label"], i), []).append(
                    (r["start_ns"], r["end_ns"], m["mode"])
                )
    names = [m["mode"] for m in ok]
    for (label, i), batches in spans.items():
        batches.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(batches)), (label, i)
        assert [mode for *_, mode in batches] == (names if i % 2 == 0 else names[::-1]), (
            label,
            i,
        )
        if (label, i + 1) in spans:
            assert batches[-1][1] <= min(start for start, *_ in spans[(label, i + 1)])


@pytest.mark.nixl
def test_each_ratio_is_the_median_of_its_paired_rounds(quick_run: dict[str, Any]) -> None:
    """kvpush over nixl-raw, size by size: each round's GB/s and p50 over the other mode's
    in the same round; the report's ratio is their median, with min and max; and the
    1-block latency p50 the same way. The table prints them with their spread."""
    report = quick_run["report"]
    by_mode = {m["mode"]: m for m in report["modes"]}
    ours, base = by_mode["kvpush"], by_mode["nixl-raw"]
    paired = report["paired_ratios"]["kvpush"]["vs_nixl-raw"]
    for i, (a, b) in enumerate(zip(ours["sizes"], base["sizes"], strict=True)):
        for key in ("gbps", "p50_us"):
            per_round = [x[key] / y[key] for x, y in zip(a["rounds"], b["rounds"], strict=True)]
            spread = paired[key][i]
            assert spread["rounds"] == per_round
            assert spread["median"] == statistics.median(per_round)
            assert (spread["min"], spread["max"]) == (min(per_round), max(per_round))
            q1, _, q3 = statistics.quantiles(per_round, n=4, method="inclusive")
            assert (spread["q1"], spread["q3"]) == (q1, q3)
        assert report["ratios"]["kvpush"]["vs_nixl-raw"][i] == paired["gbps"][i]["median"]
    lat = paired["latency_p50_us"]
    assert lat["rounds"] == [
        x["p50_us"] / y["p50_us"]
        for x, y in zip(ours["latency"]["rounds"], base["latency"]["rounds"], strict=True)
    ]
    assert (
        f"kvpush / nixl-raw: {lat['median']:.2f} (median of 8 paired rounds, interquartile "
        f"{lat['q1']:.2f}-{lat['q3']:.2f}" in quick_run["stdout"]
    )
    assert "the median of 8 paired rounds [interquartile range]" in quick_run["stdout"]


class _ScriptedMode:
    """A mode of an interleaved run without processes (`interleave.ModeProcesses`): it logs
    every order, and measures each batch at the GB/s that `speed(mode, round)` says, its
    transfers one after the other on a shared counter clock (ns)."""

    def __init__(
        self,
        mode: str,
        workload: Any,
        log: list[tuple[str, tuple[Any, ...] | None]],
        speed: Any,
        clock: list[int],
    ) -> None:
        from kvpush.bench.runner import empty_result

        self.mode, self.workload, self.log, self.speed, self.clock = (
            mode,
            workload,
            log,
            speed,
            clock,
        )
        self.result = empty_result(mode)
        self.ended: str | None = None

    @property
    def ok(self) -> bool:
        return self.ended is None

    def ask(self, order: tuple[Any, ...] | None, want: str, timeout: float) -> Any:
        from kvpush.bench.runner import Measured, batch_result
        from kvpush.bench.workload import plans

        self.log.append((self.mode, order))
        if order is None:
            return ("ready",)
        if order[0] == "idle":
            return ("idle", 1.0)
        if order[0] == "stop":
            return ("finished",)
        _, label, round_index, limit = order
        plan = next(p for p in plans(self.workload, round_index) if p.label == label)
        transfers = plan.transfers[:limit] if limit is not None else plan.transfers
        plan.transfers = transfers
        each_ns = round(
            plan.blocks * self.workload.bytes_per_block / self.speed(self.mode, round_index)
        )
        submitted, finished = {}, {}
        for t in transfers:
            submitted[t.tag] = self.clock[0]
            self.clock[0] += each_ns
            finished[t.tag] = self.clock[0]
        crcs = {t.dst_blocks: 0 for t in plan.slots}
        measured = Measured(submitted, finished, 0.001, 0.001, crcs, crcs)
        figures = batch_result(self.workload, plan, measured)
        span = {"start_ns": min(submitted.values()), "end_ns": max(finished.values())}
        return ("batch", figures | span, [each_ns / 1e3] * len(transfers))

    def end(self, status: str, reason: str | None) -> None:
        self.log.append((self.mode, ("end",)))
        self.ended = self.ended or status


def test_modes_alternate_their_order_round_by_round_after_an_uncounted_warm_up() -> None:
    """The parent's orders, as three scripted modes receive them: every mode set up, then a
    warm-up round (each plan's first window) in the given order, then every counted round
    size by size with the modes one right after the other, the order reversed from one
    round to the next. Ratios are the median of the counted rounds' pairs, with their
    quartiles; the warm-up's figures (a thousand times faster here) count nowhere."""
    from kvpush.bench.interleave import run_bench
    from kvpush.bench.workload import make_workload

    workload = make_workload(layers=1, sizes_bytes=[64 * 1024, 256 * 1024], quick=True, rounds=5)
    log: list[tuple[str, tuple[Any, ...] | None]] = []
    clock = [1_000_000]
    # kvpush's GB/s over nixl-raw's in counted round r (1..5): 0.5, 0.6, 0.7, 0.8, 0.9.
    per_round = {1: 0.5, 2: 0.6, 3: 0.7, 4: 0.8, 5: 0.9}

    def speed(mode: str, round_index: int) -> float:
        if round_index == 0:
            return 1000.0
        if mode == "memcpy":
            return 4.0
        return 2.0 * (per_round[round_index] if mode == "kvpush" else 1.0)

    modes = ("memcpy", "nixl-raw", "kvpush")
    report = run_bench(
        workload, modes, start=lambda mode, w: _ScriptedMode(mode, w, log, speed, clock)
    )

    labels = ["size:1", "size:4", "latency", "rate"]
    windows = {"size:1": 4, "size:4": 4, "latency": 1, "rate": 8}
    expected: list[tuple[str, tuple[Any, ...] | None]] = [(m, None) for m in modes]
    expected += [(m, ("plan", label, 0, windows[label])) for label in labels for m in modes]
    for r in range(1, 6):
        order = modes if r % 2 == 1 else modes[::-1]
        expected += [(m, ("plan", label, r, None)) for label in labels for m in order]
    expected += [(m, o) for m in modes for o in (("idle",), ("stop",))]
    expected += [(m, ("end",)) for m in modes]
    assert log == expected

    # Transfer times are whole nanoseconds: the figures agree to a part in 10^4.
    def close(a: list[float], b: list[float]) -> bool:
        return len(a) == len(b) and all(
            math.isclose(x, y, rel_tol=1e-4) for x, y in zip(a, b, strict=True)
        )

    ratios = list(per_round.values())
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    paired = report["paired_ratios"]["kvpush"]["vs_nixl-raw"]
    assert len(paired["gbps"]) == len(paired["p50_us"]) == 2
    for gbps, p50 in zip(paired["gbps"], paired["p50_us"], strict=True):
        assert close(gbps["rounds"], ratios)
        assert close([gbps["median"], gbps["q1"], gbps["q3"]], [0.7, q1, q3])
        assert close([gbps["min"], gbps["max"]], [0.5, 0.9])
        assert close(p50["rounds"], [1 / x for x in ratios])
    assert close(paired["latency_p50_us"]["rounds"], [1 / x for x in ratios])
    assert close(report["ratios"]["kvpush"]["vs_nixl-raw"], [0.7, 0.7])
    for mode in report["modes"]:
        for size in [*mode["sizes"], mode["latency"], mode["rate"]]:
            assert len(size["rounds"]) == 5
            assert size["gbps"] < 10  # the warm-up's 1000 GB/s is in no figure


@pytest.mark.nixl
def test_table_and_plot_are_written(quick_run: dict[str, Any]) -> None:
    stdout = quick_run["stdout"]
    for mode in MODES:
        assert mode in stdout
    assert "GB/s" in stdout and "p99 us" in stdout
    assert quick_run["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The load the run saw, at both ends: ratios from runs at other loads differ.
    host = quick_run["report"]["host"]
    assert host["load_start"] >= 0 and host["load_end"] >= 0
    assert (
        f"Host: {host['cpus']} CPUs, 1-minute load average {host['load_start']:.1f} at the "
        f"start, {host['load_end']:.1f} at the end" in stdout
    )


def test_a_mode_whose_library_cannot_load_is_skipped_with_the_reason(tmp_path: Path) -> None:
    """A `mooncake` package that fails to import, ahead of the real one on the path: both
    of the mode's processes find it, and the mode is reported skipped (not failed), with
    the loader's reason, while the other modes run."""
    shadow = tmp_path / "shadow"
    (shadow / "mooncake").mkdir(parents=True)
    (shadow / "mooncake" / "__init__.py").write_text('raise ImportError("shadowed by the test")\n')
    path = os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH")) if p)
    report_path = tmp_path / "report.json"
    proc = _kvpush(
        "bench", "--quick", "--modes", "memcpy,mooncake", "--sizes", "1M", "--no-progress",
        "--json", str(report_path),
        env={**os.environ, "PYTHONPATH": path}, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    memcpy, mooncake = json.loads(report_path.read_text())["modes"]
    assert memcpy["status"] == "ok" and memcpy["sizes"], memcpy
    assert mooncake["status"] == "skipped", mooncake
    assert "Mooncake is not importable (shadowed by the test)" in mooncake["reason"]
    assert mooncake["sizes"] == [] and mooncake["rate"] is None
    assert "SKIPPED: Mooncake is not importable" in proc.stdout


def test_presets_span_one_block_to_a_gibibyte() -> None:
    from kvpush.bench.workload import GIB, KIB, make_workload

    for preset, per_token in (("llama-3.1-8b", 128 * KIB), ("llama-3-70b", 320 * KIB)):
        w = make_workload(preset=preset)
        assert w.bytes_per_token == per_token
        assert w.sizes_blocks[0] == 1
        assert w.sizes_blocks[-1] * w.bytes_per_block >= GIB
        assert w.num_blocks >= w.sizes_blocks[-1]
    scaled = make_workload(preset="llama-3-70b", layers=20, context_tokens=8192)
    assert scaled.bytes_per_token == 80 * KIB
    assert scaled.sizes_blocks[-1] == 8192 // 16


@pytest.mark.parametrize("rounds", [1, QUICK_ROUNDS, 32, 100])
def test_more_rounds_add_batches_and_never_shrink_them(rounds: int) -> None:
    """Whatever the rounds, each round's batch of a size is no smaller than with
    `--quick`'s rounds, and moves at least `ROUND_MIN_BYTES` (or the largest batch the run
    allows); its 1-block runs make at least `ROUND_MIN_TRANSFERS`: more rounds measure
    the same batches more often. A run's bytes divided among 32 rounds made `--quick`'s
    batches at 512 KiB six transfers, where 8 rounds made 24."""
    from kvpush.bench import workload

    w = workload.make_workload(quick=True, rounds=rounds)
    quick = workload.make_workload(quick=True, rounds=QUICK_ROUNDS)
    for blocks in w.sizes_blocks:
        assert w.iterations(blocks) >= quick.iterations(blocks), (rounds, blocks)
    for count in (w.latency_transfers, w.rate_transfers):
        assert w.round_share(count) >= quick.round_share(count), (rounds, count)
    for blocks in w.sizes_blocks:
        moved = w.iterations(blocks) * blocks * w.bytes_per_block
        largest = w.max_iters * blocks * w.bytes_per_block
        assert moved >= min(workload.ROUND_MIN_BYTES, largest)
        assert w.iterations(blocks) >= w.min_iters
    assert w.round_share(w.latency_transfers) >= workload.ROUND_MIN_TRANSFERS
    assert w.round_share(w.rate_transfers) >= workload.ROUND_MIN_TRANSFERS
    assert w.round_share(3) == 3  # a count under the minimum runs whole, once
    fewer = workload.make_workload(quick=True, rounds=1)
    for blocks in w.sizes_blocks:
        assert w.iterations(blocks) <= fewer.iterations(blocks)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--modes", "memcpy,rdma"], "--modes 'memcpy,rdma': expected a subset of"),
        (["--layers", "0"], "--layers 0 out of range"),
        (["--max-size", "lots"], "bad size 'lots'"),
        (["--inflight", "0"], "--inflight 0: expected 1..256"),
        (["--rounds", "0"], "--rounds 0: expected 1..100"),
        (["--block-bytes", "100"], "--block-bytes 100: expected a positive multiple of 32"),
        (["--context", "4"], "--context 4 tokens is less than one block"),
        (["--sizes", "8G"], "exceeds 4 GiB per side"),
        (["--target", "::1:5000"], "an IPv6 host must be bracketed"),
        (["--json", "/nonexistent-dir/x.json"], "its directory does not exist"),
        (["--shapes", "2-1"], "expected comma-separated PREFILL_TP:DECODE_TP pairs"),
        (["--shapes", "3:1"], "--shapes 3:1: prefill TP 3 (8 KV heads"),
        (["--shapes", "2:1", "--modes", "memcpy"], "add kvpush to --modes"),
        (["--shapes", "2:1", "--block-bytes", "64K"], "leave out --block-bytes"),
    ],
)
def test_bad_input_is_refused_with_the_reason(args: list[str], expected: str) -> None:
    proc = _kvpush("bench", "--quick", *args, timeout=30)
    assert proc.returncode == 1, proc.stderr
    assert expected in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_unknown_preset_is_a_usage_error(tmp_path: Path) -> None:
    proc = _kvpush("bench", "--preset", "gpt-5", timeout=30)
    assert proc.returncode == 2
    assert "invalid choice: 'gpt-5'" in proc.stderr


def test_remote_target_without_a_data_plane_is_refused(tiny_endpoint: Endpoint) -> None:
    proc = _kvpush("bench", "--target", tiny_endpoint.address, timeout=30)
    assert proc.returncode == 1, proc.stderr
    assert "publishes no transport metadata" in proc.stderr
    assert "--transport nixl" in proc.stderr


def test_remote_target_that_is_not_listening_fails_fast() -> None:
    port = free_port()
    proc = _kvpush("bench", "--target", f"127.0.0.1:{port}", timeout=30)
    assert proc.returncode == 1
    assert proc.stderr.startswith("PeerUnreachable:"), proc.stderr


def _zeros_crc(nbytes: int) -> int:
    return zlib.crc32(bytes(nbytes))


@pytest.mark.nixl
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("host", "sig"), [("127.0.0.1", signal.SIGTERM), ("::1", signal.SIGINT)])
def test_remote_bench_pushes_kvpush_transfers_into_a_live_endpoint(
    tmp_path: Path, host: str, sig: int
) -> None:
    """This machine sends, a real `kvpush endpoint` process receives: both the raw NIXL
    writes and kvpush's transfers land, the endpoint reports each kvpush transfer finished
    and its own checksums of what landed match ours; it then exits 0 on a signal."""
    token = tmp_path / "token"
    token.write_text("remote-bench-secret\n")
    ep = start_endpoint(
        "--preset", "tiny", "--blocks", "64", "--transport", "nixl", "--token-file", str(token),
        host=host,
    )  # fmt: skip
    try:
        report_path = tmp_path / "remote.json"
        try:
            proc = _kvpush(
                "bench", "--target", ep.address, "--token-file", str(token), "--quick",
                "--no-progress", "--json", str(report_path),
                timeout=60,
            )  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nthe endpoint printed:\n{ep.printed()[-4000:]}") from None
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        report = json.loads(report_path.read_text())
    finally:
        status = ep.stop(sig)
    assert status == 0, ep.output
    assert report["target"] == ep.address
    assert [m["mode"] for m in report["modes"]] == ["nixl-raw", "kvpush"]
    assert set(report["latency_end"]) == {"nixl-raw", "kvpush"}
    sizes = report["workload"]["sizes_bytes"]
    for m in report["modes"]:
        assert m["status"] == "ok" and m["reason"] is None, m
        assert [s["bytes"] for s in m["sizes"]] == sizes
        for s in [*m["sizes"], m["latency"], m["rate"]]:
            sums = s["checksums"]
            assert sums["slots"] >= 1 and sums["match"] is True
            assert sums["src"] == sums["dst"], (m["mode"], s["bytes"])
            # The endpoint zeroes the blocks before each batch: a sum of zeros here
            # would mean nothing landed.
            assert _zeros_crc(s["bytes"]) not in sums["dst"], (m["mode"], s["bytes"])
            assert math.isclose(s["gbps"], s["total_bytes"] / s["wall_s"] / 1e9, rel_tol=1e-9)
            assert 0 < s["p50_us"] <= s["p99_us"]
    kvpush = report["modes"][1]
    for s in kvpush["sizes"]:
        # The endpoint's own report of every transfer came after our runtime's.
        assert s["endpoint_confirmed_s"] * 1e6 >= s["p99_us"] * 0.999
        assert s["receiver_cpu_s_per_gb"] is not None and s["receiver_cpu_s_per_gb"] >= 0
    assert kvpush["idle_cpu_percent"] is not None and kvpush["idle_cpu_percent"] >= 0
    assert report["ratios"]["kvpush"]["vs_nixl-raw"]
    # Every kvpush transfer (warm-up, sizes, latency, rate) ended finished at the
    # endpoint, too.
    warmup = max(4, report["workload"]["inflight"])
    total = (
        warmup
        + sum(s["transfers"] for s in kvpush["sizes"])
        + kvpush["latency"]["transfers"]
        + kvpush["rate"]["transfers"]
    )
    last = ep.output[-1].strip().splitlines()[-1]
    assert last.startswith("kvpush endpoint stopped: ")
    assert f"transfers {total} finished, 0 failed" in last, last
    assert "0 refused" in last


def test_remote_bench_refuses_modes_it_cannot_run_remotely(tiny_endpoint: Endpoint) -> None:
    proc = _kvpush("bench", "--target", tiny_endpoint.address, "--modes", "memcpy", timeout=30)
    assert proc.returncode == 1
    assert "--target runs only nixl-raw and kvpush" in proc.stderr, proc.stderr


def test_the_transfers_a_window_admits_together_start_their_clock_together() -> None:
    """nixl-raw at 4 in flight: NIXL's transfer() over UCX/CMA copies inside the call, so
    a clock started at each post would leave out the time a transfer waited behind the
    posts before it (and compare nixl-raw's one-copy latency with kvpush's queued one).
    Both agents live in a child process, never in the test's."""
    out = subprocess.run(
        [sys.executable, "-c", _WINDOW_STAMPS],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    window, solo = got["window"], got["solo"]
    first_window = window[:4]
    assert len(set(first_window)) == 1, first_window
    assert min(window) == first_window[0]
    # One in flight: each transfer is admitted only once the one before it is done.
    assert solo == sorted(solo) and len(set(solo)) == 3, solo


_WINDOW_STAMPS = """
import json, os, threading, time
from kvpush.bench.modes import NixlRawReceiver, NixlRawSender
from kvpush.bench.workload import make_plan, make_workload

w = make_workload(layers=1, block_bytes=256 * 1024, sizes_bytes=[512 * 1024], quick=True)
rx, tx = NixlRawReceiver(w), NixlRawSender(w)
meta = rx.setup(None)  # nixl-raw's setup uses no pipe: both ends are here
tx.setup(meta, None)
stop = threading.Event()

def receiver_polls():  # the receiver's agent must progress for the writes to complete
    while not stop.is_set():
        rx.idle(0.01)

poller = threading.Thread(target=receiver_polls)
poller.start()
try:
    plan = make_plan(w, "window", blocks=4, count=8, first_tag=1)
    stamps = tx.run_batch(plan.transfers, 4, time.monotonic() + 60)
    solo = tx.run_batch(plan.transfers[:3], 1, time.monotonic() + 60)
finally:
    stop.set()
    poller.join(10)
tx.close()
rx.close()
print(json.dumps({
    "window": [stamps[t.tag] for t in plan.transfers],
    "solo": [solo[t.tag] for t in plan.transfers[:3]],
}), flush=True)
# Two raw agents connected to each other in one process crash NIXL's teardown at
# interpreter exit (SIGSEGV, seen every time); the figures are out, so skip it.
os._exit(0)
"""


@pytest.mark.nixl
def test_the_token_mode_moves_the_same_bytes_and_reports_the_macs_cost(tmp_path: Path) -> None:
    """`--modes kvpush,kvpush-token`: both intact, side by side, and the ratio printed."""
    report_path = tmp_path / "report.json"
    proc = _kvpush(
        "bench", "--quick", "--rounds", str(FIXTURE_ROUNDS), "--modes", "kvpush,kvpush-token",
        "--sizes", "1M", "--no-progress", "--json", str(report_path), timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    modes = json.loads(report_path.read_text())["modes"]
    assert [m["mode"] for m in modes] == ["kvpush", "kvpush-token"]
    for m in modes:
        assert m["status"] == "ok", m
        for s in m["sizes"] + [x for x in (m["latency"], m["rate"]) if x]:
            assert s["checksums"]["match"] is True, (m["mode"], s)
    assert "kvpush-token / kvpush: " in proc.stdout, proc.stdout


def test_the_mac_cost_is_measured_for_every_message_kind() -> None:
    from kvpush.bench.auth_cost import measure

    rows = measure(n=50, rounds=1)  # each opened frame is checked to be the body
    assert [r["kind"] for r in rows][:2] == ["register (1 block)", "register (512 blocks)"]
    for r in rows:
        assert r["bytes"] > 0 and r["seal_us"] > 0 and r["open_us"] > 0, r
        assert r["mac_us"] == r["seal_us"] + r["open_us"], r


@pytest.mark.nixl
@pytest.mark.timeout(200)  # eight processes, three shapes in turn: minutes on a loaded 2-core host
def test_shapes_carry_the_same_bytes_between_engines_of_different_tp(tmp_path: Path) -> None:
    """`--shapes 1:1,2:1,1:2`: TP 1 -> TP 1, TP 2 -> TP 1 (both prefill ranks writing their
    halves of the heads into the one decode rank at once) and TP 1 -> TP 2 (the decode's
    rank 0 serving its rank 1's metadata), every rank its own process, the same bytes,
    side by side. Every head of every destination block holds the model's bytes, the
    decode's blocks were zeroed before each batch (so nothing stale passes), NIXL was
    handed every byte once, in twice the descriptors (a half block per part), and each
    shape's GB/s is given over 1:1's."""
    report_path = tmp_path / "report.json"
    proc = _kvpush(
        "bench", "--quick", "--modes", "kvpush", "--shapes", "1:1,2:1,1:2", "--sizes", "1M,4M",
        "--no-progress", "--json", str(report_path), timeout=190,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    report = json.loads(report_path.read_text())
    one, *others = report["modes"]
    assert [m["mode"] for m in report["modes"]] == [
        "kvpush tp1:1",
        "kvpush tp2:1",
        "kvpush tp1:2",
    ]
    assert one["shape"]["parts_per_transfer"] == 1 and "vs" not in one
    w = report["workload"]
    # One KV head of one block of one layer: 16 tokens of K and V, 128 bf16 values each.
    head_bytes = w["block_size_tokens"] * 2 * 128 * 2
    for m in report["modes"]:
        assert m["status"] == "ok", m
        assert [s["bytes"] for s in m["sizes"]] == w["sizes_bytes"]
        for s in [*m["sizes"], m["latency"], m["rate"]]:
            sums = s["checksums"]
            assert sums["heads"] == sums["slots"] * 8, s  # every head of every slot
            assert sums["src"] == sums["dst"] and sums["match"] is True, (m["mode"], s)
            zeros = _zeros_crc(head_bytes * w["layers"] * s["blocks"])
            assert zeros not in sums["dst"], (m["mode"], s["label"])
            assert s["bytes_posted"] == s["total_bytes"], s
            assert s["writes_per_transfer"] == m["shape"]["parts_per_transfer"]
            assert s["polls_per_s"]["prefill"] > 0 and s["polls_per_s"]["decode"] > 0
            assert math.isclose(s["gbps"], s["total_bytes"] / s["wall_s"] / 1e9, rel_tol=1e-9)
            assert 0 < s["p50_us"] <= s["p99_us"] <= s["wall_s"] * 1e6
    # Shuffled block ids merge nothing: one descriptor per block per layer per part.
    for a in one["sizes"]:
        assert a["descriptors"] == a["blocks"] * w["layers"]
    for m in others:
        assert m["shape"]["parts_per_transfer"] == 2 and m["vs"] == "kvpush tp1:1"
        pairs = list(zip(one["sizes"], m["sizes"], strict=True))
        assert all(b["descriptors"] == 2 * a["descriptors"] for a, b in pairs)
        ratio = report["ratios"][m["mode"]]["vs_kvpush tp1:1"]
        assert ratio == [b["gbps"] / a["gbps"] for a, b in pairs]
        assert f"{m['mode']} vs_kvpush tp1:1" in proc.stdout


def test_one_percentile_convention_for_every_tool() -> None:
    """Nearest rank, q in 0..100: always one of the values, never an interpolation; the
    bench's latencies and the demo's TTFTs are both read this way."""
    from kvpush import stats
    from kvpush.bench import runner
    from kvpush.demo import run

    assert runner.percentile is run.percentile is stats.percentile
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [stats.percentile(values, q) for q in (0, 20, 21, 50, 99, 100)] == [1, 1, 2, 3, 5, 5]
    assert stats.percentile(list(range(1, 101)), 99) == 99
    assert math.isnan(stats.percentile([], 50))
    with pytest.raises(ValueError, match=r"percentile 150: expected 0\.\.100"):
        stats.percentile(values, 150)


def _sleep_a_while() -> None:
    import time

    time.sleep(30)


def test_each_child_of_a_mode_runs_on_a_cpu_of_its_own() -> None:
    """`pin_one_per_cpu`, on real child processes: the i-th on the i-th CPU we may use
    (cycling), so every mode's receiver and sender sit on the same two cores; a child
    gone already is skipped, not an error."""
    import multiprocessing as mp

    from kvpush.bench.interleave import pin_one_per_cpu

    cpus = sorted(os.sched_getaffinity(0))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_sleep_a_while) for _ in range(3)]
    for p in procs:
        p.start()
    try:
        procs[2].kill()
        procs[2].join()
        pin_one_per_cpu(procs)
        got = [os.sched_getaffinity(p.pid) for p in procs[:2] if p.pid is not None]
    finally:
        for p in procs:
            p.kill()
            p.join()
    if len(cpus) < 2:
        assert got == [set(cpus), set(cpus)], got  # one CPU: nothing to choose
    else:
        assert got == [{cpus[0]}, {cpus[1]}], got
