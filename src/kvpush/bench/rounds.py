"""A local run's figures over its rounds (`kvpush.bench.interleave.run_interleaved`).

Each round runs every mode on each size, one mode right after the other, so a ratio
between two modes is taken round by round: both figures of a pair come from the same
few milliseconds of a host that other work shares. A report gives each ratio as the
median of its paired rounds, with their spread: the interquartile range (the middle half
of the rounds, what the table prints), min and max, and every round's value. One mode's
figures for a size are all its counted rounds merged, as one long batch would give them.
"""

from __future__ import annotations

import statistics
from typing import Any

from kvpush.stats import percentile

# The bases every mode is compared with; and kvpush-token's MAC against plain kvpush.
BASES = ("memcpy", "nixl-raw")
EXTRA_PAIRS = {"kvpush-token": "kvpush"}
# What only a round's own figures give: when its batch started and ended (monotonic ns).
_ROUND_ONLY = ("start_ns", "end_ns")


def merge_rounds(rounds: list[tuple[dict[str, Any], list[float]]]) -> dict[str, Any]:
    """One plan's figures over every round: (a round's figures, its latencies in us) each.
    Bytes, transfers, wall time and CPU add up; percentiles are over every transfer;
    the checksums of every round are kept; `rounds` keeps each round's own figures."""
    figures = [f for f, _ in rounds]
    total = sum(f["total_bytes"] for f in figures)
    wall = sum(f["wall_s"] for f in figures)
    transfers = sum(f["transfers"] for f in figures)
    gb = total / 1e9
    sender_cpu = sum(f["sender_cpu_s_per_gb"] * f["total_bytes"] / 1e9 for f in figures)
    receiver_cpu = (
        None
        if any(f["receiver_cpu_s_per_gb"] is None for f in figures)
        else sum(f["receiver_cpu_s_per_gb"] * f["total_bytes"] / 1e9 for f in figures)
    )
    latencies = [x for _, lat in rounds for x in lat]
    sums = [f["checksums"] for f in figures]
    first = {k: v for k, v in figures[0].items() if k not in _ROUND_ONLY}
    return first | {
        "transfers": transfers,
        "total_bytes": total,
        "wall_s": wall,
        "gbps": gb / wall,
        "transfers_per_s": transfers / wall,
        "p50_us": percentile(latencies, 50),
        "p99_us": percentile(latencies, 99),
        "sender_cpu_s_per_gb": sender_cpu / gb,
        "receiver_cpu_s_per_gb": None if receiver_cpu is None else receiver_cpu / gb,
        "sender_cpu_us_per_transfer": sender_cpu / transfers * 1e6,
        "receiver_cpu_us_per_transfer": (
            None if receiver_cpu is None else receiver_cpu / transfers * 1e6
        ),
        "checksums": {
            "slots": sum(c["slots"] for c in sums),
            "src": [x for c in sums for x in c["src"]],
            "dst": [x for c in sums for x in c["dst"]],
            "match": all(c["match"] for c in sums),
        },
        "rounds": [
            {k: f[k] for k in ("gbps", "p50_us", "p99_us", "wall_s", "transfers", *_ROUND_ONLY)}
            for f in figures
        ],
    }


def spread(values: list[float]) -> dict[str, Any]:
    """The median of paired ratios; their quartiles (`q1`, `q3`: the middle half of the
    rounds lies between them, inclusive method, so that they stay within min..max),
    min and max; and every one of them."""
    q1, q3 = values[0], values[0]
    if len(values) > 1:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {
        "median": statistics.median(values),
        "q1": q1,
        "q3": q3,
        "min": min(values),
        "max": max(values),
        "rounds": values,
    }


def paired(ours: dict[str, Any] | None, base: dict[str, Any] | None, key: str) -> Any:
    """`ours[key] / base[key]` round by round, as a `spread`; None unless both ran the same
    rounds."""
    a = (ours or {}).get("rounds")
    b = (base or {}).get("rounds")
    if not a or not b or len(a) != len(b):
        return None
    values = [x[key] / y[key] for x, y in zip(a, b, strict=True) if y[key]]
    return spread(values) if values else None


def _pairs(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(mode, base) for every ratio a report gives."""
    modes = {m["mode"]: m for m in report["modes"]}
    out = [
        (mode, base)
        for base in BASES
        if modes.get(base, {}).get("sizes")
        for mode in modes
        if mode != base and modes[mode]["sizes"]
    ]
    for m in report["modes"]:
        base = m.get("vs") or EXTRA_PAIRS.get(m["mode"])
        if base and modes.get(base, {}).get("sizes") and m["sizes"]:
            out.append((m["mode"], base))
    return out


def ratios(report: dict[str, Any]) -> dict[str, dict[str, list[float | None]]]:
    """GB/s of each mode over memcpy's and nixl-raw's, size by size; and of each mode
    that names a base (`vs`: a shape, over the first shape) over that base's. Where both
    ran in rounds, the median of the paired rounds' ratios; else the ratio of the two."""
    sizes = {m["mode"]: {s["bytes"]: s for s in m["sizes"]} for m in report["modes"]}
    out: dict[str, dict[str, list[float | None]]] = {}
    for mode, base in _pairs(report):
        row: list[float | None] = []
        for size, ours in sorted(sizes[mode].items()):
            theirs = sizes[base].get(size)
            if theirs is None:
                row.append(None)
                continue
            pair = paired(ours, theirs, "gbps")
            row.append(pair["median"] if pair else ours["gbps"] / theirs["gbps"])
        out.setdefault(mode, {})[f"vs_{base}"] = row
    return out


def paired_ratios(report: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Every ratio of an interleaved run with its spread over the rounds: GB/s and p50
    latency size by size, and the 1-block latency p50 (one in flight)."""
    modes = {m["mode"]: m for m in report["modes"]}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for mode, base in _pairs(report):
        ours = {s["bytes"]: s for s in modes[mode]["sizes"]}
        theirs = {s["bytes"]: s for s in modes[base]["sizes"]}
        if not any(s.get("rounds") for s in ours.values()):
            continue
        order = sorted(ours)
        out.setdefault(mode, {})[f"vs_{base}"] = {
            "gbps": [paired(ours[b], theirs.get(b), "gbps") for b in order],
            "p50_us": [paired(ours[b], theirs.get(b), "p50_us") for b in order],
            "latency_p50_us": paired(
                modes[mode].get("latency"), modes[base].get("latency"), "p50_us"
            ),
        }
    return out
