"""Statistics of the study: mean and sample spread, the paired t-interval, time to a target."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import scipy.stats


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; 0 for a single value)."""
    values = list(values)
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def paired_interval(
    a: Sequence[float], b: Sequence[float], confidence: float = 0.95
) -> tuple[float, float, float]:
    """Mean of ``a - b`` paired by index and its two-sided Student-t confidence interval.

    ``half = t_{(1 + confidence) / 2, n - 1} * sd(a - b) / sqrt(n)``: the interval of the mean
    per-pair difference, which removes the variation the pairs share (same seed: same
    initialisation and data order).

    Returns:
      ``(mean, low, high)``; with one pair the interval is infinite.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"need two equally long, non-empty samples, got {len(a)} and {len(b)}")
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    mean, sd = mean_std(diffs)
    if len(diffs) < 2:
        return mean, -math.inf, math.inf
    half = (
        float(scipy.stats.t.ppf((1 + confidence) / 2, len(diffs) - 1)) * sd / math.sqrt(len(diffs))
    )
    return mean, mean - half, mean + half


def first_reaching(evals: Sequence[dict[str, float]], target: float) -> dict[str, float] | None:
    """The first evaluation whose accuracy is at least ``target`` (None: never reached)."""
    return next((e for e in evals if e["accuracy"] >= target), None)
