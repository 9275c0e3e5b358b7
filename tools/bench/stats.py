"""Percentiles, as ``kvpush bench`` computes them over its own span measurements (vLLM's
client computes the TTFT / TPOT ones)."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..1); NaN for no values."""
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        return math.nan
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
