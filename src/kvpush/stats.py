"""Summary statistics that the tools report (the bench's latencies, the demo's TTFTs).

One convention everywhere: `q` is a percentage, 0..100, as in `numpy.percentile`."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile: the smallest value with at least `q` % of `values` at or
    below it (`q` in 0..100; 0 gives the smallest). Always one of `values`, never an
    interpolation; NaN when there are none."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q!r}: expected 0..100")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]
