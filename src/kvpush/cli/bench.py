"""`kvpush bench`: memcpy, raw NIXL, kvpush and Mooncake, side by side on the same bytes
(and kvpush between engines of different tensor parallelism, `--shapes`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

# Only light imports here: every `kvpush` command builds this parser. numpy and the
# bench's machinery are imported by `run`.
from kvpush.bench import ALL_MODES, DEFAULT_MODES, DEFAULT_ROUNDS, QUICK_ROUNDS
from kvpush.bench.presets import PRESETS
from kvpush.errors import ConfigError


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "bench",
        help="measure KV transfer throughput, latency and CPU, every mode in one run",
        description=__doc__,
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.1-8b")
    p.add_argument("--layers", type=int, help="layers to keep (default: all; 8 with --quick)")
    p.add_argument("--block-size", type=int, help="tokens per block (default: preset, 16)")
    p.add_argument("--block-bytes", help="bytes of one block of one region (default: preset)")
    p.add_argument("--context", type=int, help="largest transfer as a context length in tokens")
    p.add_argument("--max-size", help="largest transfer, e.g. 1G (default 1G; 64M with --quick)")
    p.add_argument("--sizes", help="explicit comma-separated transfer sizes, e.g. 2M,64M,1G")
    p.add_argument("--inflight", type=int, default=4, help="transfers in flight (default 4)")
    p.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated subset of {','.join(ALL_MODES)}",
    )
    p.add_argument(
        "--shapes",
        metavar="P:D,...",
        help="run the kvpush mode once per deployment shape, PREFILL_TP:DECODE_TP (e.g. "
        "1:1,2:1), every rank its own process, in vLLM's packed layout; each shape's GB/s "
        "is also given over the first's",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small run: 8 layers, up to 64 MiB, about 40 s with two modes",
    )
    p.add_argument(
        "--rounds",
        type=int,
        help="counted rounds of the local modes, after a warm-up round that is not counted: "
        "in each, every size runs on every mode one right after the other, the order "
        "reversed from one round to the next; each ratio is the median of its paired "
        "rounds, with their interquartile range (default "
        f"{DEFAULT_ROUNDS}; {QUICK_ROUNDS} with --quick)",
    )
    p.add_argument(
        "--busy-engine",
        action="store_true",
        help="run a Python thread that computes all the time in each process (as an "
        "engine's model loop does), at Python's default switch interval: what kvpush "
        "costs inside a busy serving process",
    )
    p.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot GB/s against transfer size")
    p.add_argument(
        "--target",
        metavar="HOST:PORT",
        help="bench a `kvpush endpoint --transport nixl` (modes nixl-raw and kvpush; this "
        "machine sends, the endpoint receives)",
    )
    p.add_argument("--token-file", help="side-channel secret for --target (default $KVPUSH_TOKEN)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)


class _ProgressBar:
    """A one-line tqdm bar on stderr, shown only once the run has lasted a couple of
    seconds; the bench reports steps (`ProgressFn`), the bar draws them."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None

    def __call__(self, label: str, step: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=sys.stderr, delay=2.0, unit="step", leave=True)
        self.bar.set_description_str(label, refresh=False)
        self.bar.update(min(step, total) - self.bar.n)

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args: argparse.Namespace) -> int:
    from kvpush.bench.interleave import run_bench
    from kvpush.bench.workload import make_workload, parse_size

    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown or not modes:
        raise ConfigError(f"--modes {args.modes!r}: expected a subset of {','.join(ALL_MODES)}")
    if args.target is not None:
        if args.shapes:
            raise ConfigError("--shapes runs both engines here: leave out --target")
        return _run_remote(args, modes)
    workload = make_workload(
        preset=args.preset,
        layers=args.layers,
        block_size_tokens=args.block_size,
        block_bytes=parse_size(args.block_bytes) if args.block_bytes else None,
        context_tokens=args.context,
        max_size_bytes=parse_size(args.max_size) if args.max_size else None,
        sizes_bytes=[parse_size(s) for s in args.sizes.split(",")] if args.sizes else None,
        inflight=args.inflight,
        quick=args.quick,
        busy_engine=args.busy_engine,
        rounds=(QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
        if args.rounds is None
        else args.rounds,
    )
    instead = None
    if args.shapes:
        from kvpush.bench.shapes import parse_shapes, shape_runs

        if "kvpush" not in modes:
            raise ConfigError("--shapes runs the kvpush mode once per shape: add kvpush to --modes")
        # Each shape runs on its own, every round's transfers in one.
        whole = dataclasses.replace(workload, rounds=1)
        instead = {"kvpush": shape_runs(parse_shapes(args.shapes, whole), whole)}
    _check_outputs(args)
    bar = _ProgressBar(enabled=not args.no_progress)
    try:
        report = run_bench(workload, modes, on_progress=bar, instead=instead)
    finally:
        bar.finish()
    return _emit(report, args)


def _check_outputs(args: argparse.Namespace) -> None:
    for path in (args.json, args.plot):
        if path and not Path(path).resolve().parent.is_dir():
            raise ConfigError(f"cannot write {path}: its directory does not exist")


def _run_remote(args: argparse.Namespace, modes: tuple[str, ...]) -> int:
    from kvpush.bench.remote import check_target, run_remote
    from kvpush.bench.workload import parse_size
    from kvpush.config import load_token

    check_target(args.target)
    _check_outputs(args)
    bar = _ProgressBar(enabled=not args.no_progress)
    try:
        report = run_remote(
            args.target,
            load_token(args.token_file),
            max_size_bytes=parse_size(args.max_size) if args.max_size else None,
            inflight=args.inflight,
            quick=args.quick,
            modes=modes,
            on_progress=bar,
        )
    finally:
        bar.finish()
    return _emit(report, args)


def _emit(report: dict[str, Any], args: argparse.Namespace) -> int:
    from kvpush.bench.report import format_table, write_plot

    report["argv"] = ["kvpush", *sys.argv[1:]]
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        write_plot(report, args.plot)
    bad = [
        m["mode"]
        for m in report["modes"]
        if m["status"] == "failed" or any(not s["checksums"]["match"] for s in m["sizes"])
    ]
    return 1 if bad else 0
