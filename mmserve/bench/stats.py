"""Summary statistics of latency samples: mean, median, p90, p99 (as in `vllm bench serve`)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of already sorted values."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """``{"mean", "median", "p90", "p99", "count"}``; NaN statistics for no samples."""
    ordered = sorted(values)
    mean = sum(ordered) / len(ordered) if ordered else math.nan
    return {"mean": mean, "median": percentile(ordered, 50), "p90": percentile(ordered, 90),
            "p99": percentile(ordered, 99), "count": len(ordered)}
