"""Turns a bench report into text (a table, returned as a string) and a plot file."""

from __future__ import annotations

import math
from typing import Any

# Printed under every ratio against nixl-raw: kvpush moves its bytes with NIXL, so a
# ratio above 1 is a statement about the floor's code, never about NIXL itself.
NIXL_RAW_CAVEAT = (
    "vs_nixl-raw: nixl-raw is the simplest correct NIXL code, which busy-polls (both sides\n"
    "locally, yielding at each turn); on a host with few cores its polling takes CPU from its\n"
    "own transfers. kvpush also moves its bytes with NIXL: a ratio above 1 means that simple\n"
    "code lost CPU, not that kvpush is faster than NIXL."
)

# Under the ratios of an interleaved run: how they were taken.
PAIRED_NOTE = (
    "Paired rounds: after a warm-up round (one window of every plan, not counted), each\n"
    "round runs every size on every mode one right after the other, in an order that\n"
    "reverses from round to round; a ratio is taken within each round and the table gives\n"
    "the median of those, with the middle half of the rounds in brackets (the JSON report\n"
    "has min, max and every round: paired_ratios)."
)

# Under the table when `--shapes` ran.
SHAPES_NOTE = (
    "kvpush tpP:D: a prefill engine of P ranks into a decode engine of D ranks, every rank\n"
    "its own process, vLLM's packed layout (one region per layer, heads outermost); the\n"
    "prefill ranks send their parts at once. GB/s: bytes landed in the decode's cache /\n"
    "(last part received - first blocks ready). Latency: each part from its own prefill\n"
    "rank's blocks ready, a transfer's that of its slowest part. descs: NIXL descriptors\n"
    "per transfer, every part, after merging. Bytes checked head by head."
)

# In the plot's legend, so that the figure alone cannot be read as kvpush beating NIXL.
PLOT_LABELS = {"nixl-raw": "nixl-raw (simplest NIXL code; busy-polls)"}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _num(v: float | None, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, fmt)


def _latency_end(report: dict[str, Any]) -> str:
    end = report.get("latency_end", "receiver reports finished")
    if isinstance(end, dict):  # remote: each mode's latency ends somewhere else
        return "; ".join(f"{mode}: {text}" for mode, text in end.items())
    return str(end)


def format_table(report: dict[str, Any]) -> str:
    """The whole report as a fixed-width table, one row per (mode, size)."""
    w = report["workload"]
    target = f" against {report['target']}" if report.get("target") else ""
    lines = [
        f"kvpush bench{target}: preset {w['preset']}, {w['layers']} layers x 2 regions, "
        f"{w['block_size_tokens']}-token blocks of {human_bytes(w['block_bytes'])} per region "
        f"({human_bytes(w['bytes_per_block'])} per block id, "
        f"{human_bytes(w['bytes_per_token'])}/token), {w['inflight']} in flight"
        + (
            ", busy engine (a Python thread computing in every process)"
            if w.get("busy_engine")
            else ""
        ),
        "GB/s = bytes of a batch / wall time of the whole batch (10^9 B/s). "
        f"Latency: blocks ready -> {_latency_end(report)}.",
        *_host_line(report),
        "",
    ]
    head = (
        f"{'mode':<12} {'size':>10} {'descs':>7} {'xfers':>6} {'GB/s':>8} "
        f"{'p50 us':>9} {'p99 us':>9} {'tx cpu s/GB':>11} {'rx cpu s/GB':>11} {'bytes':>6}"
    )
    lines += [head, "-" * len(head)]
    for m in report["modes"]:
        if m["status"] != "ok" and not m["sizes"]:
            lines.append(f"{m['mode']:<12} {m['status'].upper()}: {m['reason']}")
            continue
        for s in m["sizes"]:
            lines.append(
                f"{m['mode']:<12} {human_bytes(s['bytes']):>10} {s['descriptors']:>7.0f} "
                f"{s['transfers']:>6} {s['gbps']:>8.2f} {s['p50_us']:>9.0f} "
                f"{s['p99_us']:>9.0f} {_num(s['sender_cpu_s_per_gb'], '11.3f'):>11} "
                f"{_num(s['receiver_cpu_s_per_gb'], '11.3f'):>11} "
                f"{'ok' if s['checksums']['match'] else 'BAD':>6}"
            )
        if m["status"] != "ok":
            lines.append(f"{m['mode']:<12} {m['status'].upper()}: {m['reason']}")
    if any(m.get("shape") for m in report["modes"]):
        lines.append(SHAPES_NOTE)
    lines += [
        "",
        "1-block transfers: latency with one in flight; rate with "
        f"{w.get('rate_inflight', w['inflight'])} in flight, its CPU per transfer; idle endpoint:",
    ]
    head2 = (
        f"{'mode':<12} {'1x p50 us':>9} {'1x p99 us':>9} {'xfers/s':>8} {'p50 us':>8} "
        f"{'p99 us':>8} {'tx cpu us':>9} {'rx cpu us':>9} {'idle CPU %core':>15}"
    )
    lines += [head2, "-" * len(head2)]
    for m in report["modes"]:
        r, lat = m.get("rate"), m.get("latency")
        if r is None and lat is None:
            why = m["reason"] or "no rate measured"
            lines.append(f"{m['mode']:<12} {'-':>9}  ({why})")
            continue
        r = r or {}
        lat = lat or {}
        lines.append(
            f"{m['mode']:<12} {_num(lat.get('p50_us'), '9.0f'):>9} "
            f"{_num(lat.get('p99_us'), '9.0f'):>9} {_num(r.get('transfers_per_s'), '8.0f'):>8} "
            f"{_num(r.get('p50_us'), '8.0f'):>8} {_num(r.get('p99_us'), '8.0f'):>8} "
            f"{_num(r.get('sender_cpu_us_per_transfer'), '9.0f'):>9} "
            f"{_num(r.get('receiver_cpu_us_per_transfer'), '9.0f'):>9} "
            f"{_num(m.get('idle_cpu_percent'), '15.1f'):>15}"
        )
    lines += _latency_ratio_lines(report)
    ratios = report.get("ratios") or {}
    paired = report.get("paired_ratios") or {}
    if ratios:
        rounds = report["workload"].get("rounds", 1)
        lines += [
            "",
            "GB/s ratios, size by size"
            + (f": the median of {rounds} paired rounds [interquartile range]" if paired else "")
            + ":",
        ]
        sizes: list[dict[str, Any]] = next((m["sizes"] for m in report["modes"] if m["sizes"]), [])
        cell = 17 if paired else 9
        labels = " ".join(f"{human_bytes(s['bytes']):>{cell}}" for s in sizes)
        width = max(22, *(len(f"{m} {b}") for m, bases in ratios.items() for b in bases))
        lines.append(f"{'':<{width}} {labels}")
        for mode, bases in ratios.items():
            for base, row in bases.items():
                spreads = (paired.get(mode, {}).get(base) or {}).get("gbps") or [None] * len(row)
                cells = " ".join(
                    _ratio_cell(v, sp, cell) for v, sp in zip(row, spreads, strict=False)
                )
                lines.append(f"{mode + ' ' + base:<{width}} {cells}")
        p50 = paired.get("kvpush", {}).get("vs_nixl-raw", {}).get("p50_us")
        if p50:
            cells = " ".join(_ratio_cell(sp["median"] if sp else None, sp, cell) for sp in p50)
            lines.append(f"{'kvpush / nixl-raw p50 us':<{width}} {cells}")
        if paired:
            lines += ["", PAIRED_NOTE]
        if any("vs_nixl-raw" in bases for bases in ratios.values()):
            lines += ["", NIXL_RAW_CAVEAT]
    return "\n".join(lines)


def _host_line(report: dict[str, Any]) -> list[str]:
    """The host's CPUs and its load average as the run started and ended: ratios taken
    at different loads are not comparable on a shared host."""
    host = report.get("host") or {}
    if "load_start" not in host:
        return []
    end = host.get("load_end")
    return [
        f"Host: {host['cpus']} CPUs, 1-minute load average {host['load_start']:.1f} at the "
        f"start, {_num(end, '.1f')} at the end, {report.get('elapsed_s', 0):.0f} s."
    ]


def _ratio_cell(value: float | None, spread: dict[str, Any] | None, width: int) -> str:
    if spread is None:
        return f"{_num(value, '.2f'):>{width}}"
    text = f"{spread['median']:.2f} [{spread['q1']:.2f}-{spread['q3']:.2f}]"
    return f"{text:>{width}}"


def _latency_ratio_lines(report: dict[str, Any]) -> list[str]:
    """The 1-block latency p50 ratios: kvpush over nixl-raw, and kvpush-token over kvpush
    (the cost of the data-plane MAC); from paired rounds where the run had them."""
    lines = []
    for mode, base, why in (
        ("kvpush", "nixl-raw", ""),
        ("kvpush-token", "kvpush", " (the cost of the data-plane MAC)"),
    ):
        spread = (report.get("paired_ratios") or {}).get(mode, {}).get(f"vs_{base}", {})
        spread = spread.get("latency_p50_us") if spread else None
        head = f"1-block latency p50 (one in flight), {mode} / {base}: "
        if spread:
            lines.append(
                f"{head}{spread['median']:.2f} (median of {len(spread['rounds'])} paired "
                f"rounds, interquartile {spread['q1']:.2f}-{spread['q3']:.2f}, "
                f"min-max {spread['min']:.2f}-{spread['max']:.2f}){why}"
            )
            continue
        ratio = _latency_ratio(report, mode, base)
        if ratio:
            lines.append(f"{head}{ratio:.2f}{why}")
    return lines


def _latency_ratio(
    report: dict[str, Any], mode: str = "kvpush", base_mode: str = "nixl-raw"
) -> float | None:
    by_mode = {m["mode"]: m.get("latency") for m in report["modes"]}
    ours, base = by_mode.get(mode), by_mode.get(base_mode)
    if not ours or not base or not base.get("p50_us"):
        return None
    return float(ours["p50_us"]) / float(base["p50_us"])


def write_plot(report: dict[str, Any], path: str) -> None:
    """GB/s against transfer size, one line per mode, log-scale x (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for m in report["modes"]:
        if not m["sizes"]:
            continue
        xs = [s["bytes"] for s in m["sizes"]]
        ys = [s["gbps"] for s in m["sizes"]]
        ax.plot(xs, ys, marker="o", label=PLOT_LABELS.get(m["mode"], m["mode"]))
    ax.set_xscale("log", base=2)
    sizes = sorted({s["bytes"] for m in report["modes"] for s in m["sizes"]})
    if sizes:
        ax.set_xticks(sizes, [human_bytes(b) for b in sizes])
        ax.minorticks_off()
    ax.set_xlabel("transfer size")
    ax.set_ylabel("aggregate GB/s (bytes / wall time of the batch)")
    w = report["workload"]
    ax.set_title(
        f"kvpush bench: {w['preset']} x{w['layers']} layers, {w['inflight']} in flight, "
        f"{report['host']['cpus']} CPUs"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
