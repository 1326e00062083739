"""Small statistics over timings: percentiles and a summary of one series."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile of ``values`` (0 to 1), linearly interpolated."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Summary:
    """A series of durations in milliseconds."""

    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float

    @classmethod
    def of_seconds(cls, seconds: Sequence[float]) -> Summary:
        ms = [value * 1000 for value in seconds]
        if not ms:
            return cls(0, *([math.nan] * 6))
        return cls(
            count=len(ms),
            p50_ms=percentile(ms, 0.5),
            p90_ms=percentile(ms, 0.9),
            p99_ms=percentile(ms, 0.99),
            mean_ms=statistics.fmean(ms),
            min_ms=min(ms),
            max_ms=max(ms),
        )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator
