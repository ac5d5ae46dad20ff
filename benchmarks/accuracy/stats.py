"""Statistics of the study: mean and sample spread, the paired t-interval, time to a target
(and, paired by seed, to a reference row's final accuracy)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

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


def median_or_none(values: Sequence[float]) -> float | None:
    """The median; None when there are no values or the median is infinite."""
    if not values:
        return None
    value = statistics.median(values)
    return None if math.isinf(value) else float(value)


def to_reference(
    runs: Sequence[dict[str, Any]],
    reference: Sequence[dict[str, Any]],
    margin: float = 0.0,
    figures: Sequence[str] = ("step", "seconds"),
) -> dict[str, Any]:
    """A row's figures (steps, seconds) to the reference's final accuracy, paired by seed.

    Per seed the target is the reference run's final accuracy (``accuracy``) less ``margin``;
    each figure is read at the run's first evaluation (``evals``) at or above it, and the ratio
    is taken to the reference run's own figure at its first evaluation at or above it (the
    reference may reach its final accuracy before its end). A seed the row never reaches counts
    as an infinite ratio.

    Returns:
      ``reached`` (seeds reaching), ``n``, ``per_seed``, and per figure the median over the
      seeds that reached (``figure``) and the median of the per-seed ratios (``figure_ratio``),
      each None when there is none or it is infinite.

    Raises:
      KeyError: a run's seed has no reference run.
    """
    by_seed = {r["seed"]: r for r in reference}
    per_seed = []
    for run in runs:
        ref = by_seed[run["seed"]]
        target = ref["accuracy"] - margin
        per_seed.append(
            {
                "seed": run["seed"],
                "target": target,
                "row": first_reaching(run["evals"], target),
                "reference": first_reaching(ref["evals"], target),
            }
        )
    out: dict[str, Any] = {
        "reached": sum(p["row"] is not None for p in per_seed),
        "n": len(per_seed),
        "per_seed": per_seed,
    }
    for figure in figures:
        values = [p["row"][figure] for p in per_seed if p["row"] is not None]
        ratios = [
            math.inf
            if p["row"] is None or p["reference"] is None
            else p["row"][figure] / max(p["reference"][figure], 1e-12)
            for p in per_seed
        ]
        out[figure] = median_or_none(values)
        out[f"{figure}_ratio"] = median_or_none(ratios)
    return out
