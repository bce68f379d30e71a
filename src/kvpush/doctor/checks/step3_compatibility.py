"""Step 3, compatibility: each rank pair a transfer uses has caches that agree (or
the fields that differ, each with its fix), and what the routers in front can carry."""

from __future__ import annotations

from kvpush.doctor.checks.options import DoctorOptions, Observed
from kvpush.doctor.report import StepResult, Verdict
from kvpush.doctor.routers import behind_routers
from kvpush.geometry import (
    CacheGeometry,
    differing_compat_fields,
    regions_not_carried,
    write_views,
)
from kvpush.sidechannel.client import FetchResult
from kvpush.topology import UnsupportedShape, rank_pairs

_FIELD_ACTION = {
    "block_size_tokens": "start both servers with the same --block-size",
    "dtype": "serve the same model dtype (and KV cache dtype) on both servers",
    "layout": "use the same KV cache layout (attention backend) on both servers",
    "mode": "run both servers in push mode",
    "protocol_version": "run the same kvpush version on both servers",
    "regions": "serve the same model, with the same tensor-parallel layout, on both servers "
    "(each rank's layers, KV heads and head size must match)",
}


_ONE_BLOCK_SIZE = (
    "start both servers with the same --block-size: this pair's KV cache layout cannot "
    "carry blocks of two sizes, so every request would be refused, behind any router or "
    "proxy (kvpush proxy included)"
)


def check_compatibility(options: DoctorOptions, seen: Observed, step: StepResult) -> None:
    p_ranks, d_ranks = seen.ranks["prefill"], seen.ranks["decode"]
    for p, d in _paired_ranks(p_ranks, d_ranks, step):
        pair = f"rank {p.metadata.rank}"
        if len(p_ranks) != len(d_ranks):
            pair = f"prefill rank {p.metadata.rank} -> decode rank {d.metadata.rank}"
        stage = p.metadata.geometry.stage
        if stage is not None:
            pair += f" (pipeline stage {stage.rank} of {stage.size})"
        differences = geometry_differences(p.metadata.geometry, d.metadata.geometry)
        if not differences:
            try:
                write_views(p.metadata.geometry, d.metadata.geometry)
            except UnsupportedShape as exc:
                blocks = (
                    p.metadata.geometry.block_size_tokens,
                    d.metadata.geometry.block_size_tokens,
                )
                step.add(
                    Verdict.FAIL,
                    f"{pair}: {exc}",
                    # Every request is refused with this, behind any router or proxy.
                    next_action=_ONE_BLOCK_SIZE
                    if blocks[0] != blocks[1]
                    else "run TP sizes of which one is a whole multiple of the other "
                    "(and a decode block size a whole multiple of the prefill's), with a KV "
                    "cache layout that holds heads one after another (LBHNC)",
                )
                continue
            step.add(Verdict.OK, f"{pair}: compatible (hash {p.compat_hash})")
            continue
        for key, text in differences:
            step.add(
                Verdict.FAIL,
                f"{pair}: {text}",
                next_action=_FIELD_ACTION.get(key, "make the two servers' caches agree"),
            )
        step.add(
            Verdict.FAIL,
            f"{pair}: a transfer would be refused (compat hash prefill {p.compat_hash}, "
            f"decode {d.compat_hash})",
            next_action="fix the fields above; kvpush refuses the pair before any write",
        )
    for role, ranks in (("prefill", p_ranks), ("decode", d_ranks)):
        step.figures[role] = [_geometry_figures(r.metadata.geometry) for r in ranks]
    if p_ranks and d_ranks and step.verdict is Verdict.OK:
        routers = behind_routers(p_ranks[0].metadata.geometry, d_ranks[0].metadata.geometry)
        step.figures["pair"] = {"routers": routers.text}
        if routers.verdict is not Verdict.OK:
            step.add(routers.verdict, routers.text, next_action=routers.next_action)


def _paired_ranks(
    p_ranks: list[FetchResult], d_ranks: list[FetchResult], step: StepResult
) -> list[tuple[FetchResult, FetchResult]]:
    """The rank pairs a transfer between the two servers uses: rank r with rank r, or,
    where every rank says how it holds KV heads (vLLM engines), `rank_pairs` of the two
    TP sizes when one is a whole multiple of the other. A prefill of pipeline stages
    (`PipelineStage`) pairs each stage's ranks with the decode's so, as each stage sends
    its own layers. What cannot pair is a fail."""
    stages: dict[int, list[FetchResult]] = {}
    for r in p_ranks:
        stage = r.metadata.geometry.stage
        stages.setdefault(0 if stage is None else stage.rank, []).append(r)
    if len(stages) > 1:
        return [
            pair for _, ranks in sorted(stages.items()) for pair in _tp_pairs(ranks, d_ranks, step)
        ]
    return _tp_pairs(p_ranks, d_ranks, step)


def _tp_pairs(
    p_ranks: list[FetchResult], d_ranks: list[FetchResult], step: StepResult
) -> list[tuple[FetchResult, FetchResult]]:
    if len(p_ranks) == len(d_ranks):
        return list(zip(p_ranks, d_ranks, strict=True))
    knows_heads = all(r.metadata.geometry.heads is not None for r in (*p_ranks, *d_ranks))
    small, large = sorted((len(p_ranks), len(d_ranks)))
    if knows_heads and small and large % small == 0:
        return [(p_ranks[p], d_ranks[d]) for p, d in rank_pairs(len(p_ranks), len(d_ranks))]
    why = (
        "neither TP size is a whole multiple of the other"
        if knows_heads
        else "their caches do not say how they hold KV heads, so a transfer pairs rank r "
        "with rank r"
    )
    step.add(
        Verdict.FAIL,
        f"prefill serves {len(p_ranks)} ranks, decode {len(d_ranks)}: {why}, so some ranks "
        "would have no peer",
        next_action="run both servers with the same tensor-parallel size"
        if not knows_heads
        else "run TP sizes of which one is a whole multiple of the other",
    )
    return list(zip(p_ranks, d_ranks, strict=False))


def geometry_differences(prefill: CacheGeometry, decode: CacheGeometry) -> list[tuple[str, str]]:
    """(field, phrase) for every compatibility field that differs, naming both sides."""
    ours, theirs = prefill.compat_fields(), decode.compat_fields()
    out: list[tuple[str, str]] = []
    for key in differing_compat_fields(ours, theirs):
        a, b = ours.get(key), theirs.get(key)
        if key == "regions" and prefill.stage is not None and decode.stage is None:
            stage = prefill.stage
            missing = ", ".join(regions_not_carried(ours, theirs))
            out.append(
                (
                    key,
                    f"regions: pipeline stage {stage.rank} of {stage.size}'s must each be one "
                    f"of the decode's by name, with equal bytes; not carried: {missing}",
                )
            )
        elif key == "regions":
            if _same_bytes_per_token(prefill, decode) and "block_size_tokens" in dict(out):
                # Only a consequence of the block size: one field to fix, named once.
                continue
            out.append((key, _region_difference(prefill, decode)))
        else:
            out.append((key, f"{key} differs: prefill {a!r}, decode {b!r}"))
    return out


def _same_bytes_per_token(prefill: CacheGeometry, decode: CacheGeometry) -> bool:
    a, b = prefill.regions, decode.regions
    return len(a) == len(b) and all(
        (x.name, x.layer, x.block_bytes * decode.block_size_tokens)
        == (y.name, y.layer, y.block_bytes * prefill.block_size_tokens)
        for x, y in zip(a, b, strict=True)
    )


def _region_difference(prefill: CacheGeometry, decode: CacheGeometry) -> str:
    a, b = prefill.regions, decode.regions
    if len(a) != len(b):
        return (
            f"regions differ: prefill registers {len(a)} ({prefill.num_layers} layers), "
            f"decode {len(b)} ({decode.num_layers} layers)"
        )
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for name in ("name", "layer", "block_bytes"):
            if getattr(x, name) != getattr(y, name):
                return (
                    f"regions differ first at #{i} in {name}: prefill {x.name} (layer "
                    f"{x.layer}, {x.block_bytes} bytes per block), decode {y.name} (layer "
                    f"{y.layer}, {y.block_bytes} bytes per block)"
                )
    return "regions differ"


def _geometry_figures(g: CacheGeometry) -> dict[str, object]:
    return {
        "layout": g.layout,
        "dtype": g.dtype,
        "block_size_tokens": g.block_size_tokens,
        "mode": g.mode,
        "num_layers": g.num_layers,
        "regions": len(g.regions),
        "num_blocks": g.num_blocks,
        "bytes_per_block": g.bytes_per_block,
        "registered_bytes": g.total_bytes,
        "devices": sorted({r.device for r in g.regions}),
    }
