"""Throughput as a fitted model of step time, from sums of seconds and samples per batch size.

The goodput rule (Pollux: goodput = throughput x statistical efficiency) is only as good as its
throughput figures. Averaging per-step rates is biased upwards (a mean of ratios, dominated by
the shortest intervals), and extrapolating a power law through two noisy points amplifies their
noise. Instead, as AdaptDL's ``goodput.py`` does (Qiao et al., 2021, §4.1), each batch size keeps
*sums*: steps, seconds, and the sum of squared step seconds, timed at device completion, with the
steps right after a move or a compile left out by the caller. Steps are added in blocks of consecutive
steps, and the spread of the block means gives each mean's uncertainty. A model of step time is
fitted over the sizes measured:

    T(B) = fixed + per_sample * B

(a fixed cost per step, such as dispatch and the optimizer's update, plus a cost per sample), by
weighted least squares with each size's mean weighted by the inverse of its variance, both
coefficients kept non-negative. Throughput at any size is ``B / T(B)``, with an interval from the
fit's covariance (the delta method). With one size measured the model is *optimistic*: all of the
time is taken as fixed, so throughput is predicted to grow in proportion to the batch, with an
uncertainty as wide as that guess, so that the next size is tried and its measurement decides.
There is no power-law extrapolation.

Everything here is a pure function of the sums, evaluated on the host with Python floats.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

# A step time's noise is never taken as below this fraction of its mean: a size timed over a few
# identical steps would otherwise carry an infinite weight in the fit.
NOISE_FLOOR = 0.02


class StepTimes(NamedTuple):
    """Sums of the timed steps at one batch size (under one precision policy), added in blocks.

    A block is a run of consecutive steps timed together (the controller's are the steps between
    two memory checks). Its mean is what the spread is measured on: a step's own seconds are an
    interval between host reads, and with steps in flight a long wait at a flush is followed by
    short reads, so single steps vary far more than their sums do; blocks of consecutive steps
    average that out, and their spread gives the mean's (the batch-means estimate of a
    correlated series' variance).

    Attributes:
      steps: how many steps were timed.
      seconds: their total seconds, each from dispatch to device completion.
      seconds_sq: the sum over blocks of ``block steps x (block's mean step seconds)**2``.
      blocks: how many blocks were added.
    """

    steps: int = 0
    seconds: float = 0.0
    seconds_sq: float = 0.0
    blocks: int = 0

    def add(self, seconds: float, steps: int = 1) -> StepTimes:
        """These sums with a block of ``steps`` consecutive steps taking ``seconds`` in all
        (non-finite or negative seconds, or fewer than one step: refused)."""
        if not (math.isfinite(seconds) and seconds >= 0.0):
            raise ValueError(f"a step's seconds must be finite and >= 0, got {seconds!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"a block holds a whole number of steps >= 1, got {steps!r}")
        return StepTimes(
            self.steps + steps,
            self.seconds + seconds,
            self.seconds_sq + seconds**2 / steps,
            self.blocks + 1,
        )

    def scaled(self, factor: float) -> StepTimes:
        """The same steps each ``factor`` times as long."""
        return StepTimes(
            self.steps, self.seconds * factor, self.seconds_sq * factor**2, self.blocks
        )

    @property
    def mean(self) -> float:
        """The mean step seconds (nan before the first step)."""
        return self.seconds / self.steps if self.steps else math.nan

    @property
    def variance_of_mean(self) -> float:
        """The variance of :attr:`mean`: the blocks' sample variance (weighted by their steps)
        over their number, floored at ``(NOISE_FLOOR * mean)**2 / steps``; with one block,
        ``mean**2`` over its steps (one block says little about its own noise)."""
        if not self.steps:
            return math.inf
        mean = self.mean
        floor = (NOISE_FLOOR * mean) ** 2 / self.steps
        if self.blocks < 2:
            return max(floor, mean**2 / self.steps)
        spread = max(self.seconds_sq / self.steps - mean**2, 0.0) / (self.blocks - 1)
        return max(spread, floor)


class StepTimeModel(NamedTuple):
    """``T(B) = fixed + per_sample * B``, fitted, with the covariance of the two coefficients.

    Attributes:
      fixed: seconds per step that do not depend on the batch.
      per_sample: seconds per sample.
      covariance: ``((var fixed, cov), (cov, var per_sample))``.
      sizes: how many batch sizes the fit used (1: the optimistic guess).
    """

    fixed: float
    per_sample: float
    covariance: tuple[tuple[float, float], tuple[float, float]]
    sizes: int

    def step_seconds(self, batch: int) -> tuple[float, float]:
        """The predicted seconds of a step of ``batch`` samples, and their standard deviation."""
        (v_ff, v_fp), (_, v_pp) = self.covariance
        mean = self.fixed + self.per_sample * batch
        return mean, math.sqrt(max(v_ff + 2.0 * batch * v_fp + batch**2 * v_pp, 0.0))

    def throughput(self, batch: int) -> tuple[float, float]:
        """Samples per second at ``batch``, and their standard deviation (the delta method)."""
        seconds, spread = self.step_seconds(batch)
        if seconds <= 0.0:
            return math.inf, math.inf
        return batch / seconds, batch * spread / seconds**2


def fit_step_time(times: Mapping[int, StepTimes]) -> StepTimeModel | None:
    """Fits ``T(B) = fixed + per_sample * B`` to the mean step seconds of each batch size.

    Args:
      times: the :class:`StepTimes` of each batch size measured (sizes without a step are
        ignored).

    Returns:
      The :class:`StepTimeModel`, or None before any step is timed. With one size, the
      optimistic model: all of its time fixed (throughput in proportion to the batch), with the
      per-sample cost's standard deviation as large as the whole time per sample, so that the
      prediction elsewhere is known to be a guess. With several, weighted least squares (weights:
      the inverse variance of each mean), the coefficients kept >= 0 (a negative one is set to 0
      and the other refitted), the covariance scaled up by the residuals' reduced chi-squared
      when the line fits worse than the timing noise says.

    Example:
      >>> from triaccel_jax.controller._throughput import StepTimes, fit_step_time
      >>> times = {16: StepTimes(), 64: StepTimes()}
      >>> for _ in range(10):  # 1 ms fixed + 0.1 ms a sample, exactly
      ...     times = {b: t.add(0.001 + 0.0001 * b) for b, t in times.items()}
      >>> model = fit_step_time(times)
      >>> round(model.fixed, 6), round(model.per_sample, 7)
      (0.001, 0.0001)
      >>> round(model.throughput(32)[0])
      7619

    References:
      Qiao et al., 2021, "Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized Deep
      Learning", §4.1 (the throughput model fitted to measured step times).
    """
    points = [(b, t.mean, t.variance_of_mean) for b, t in sorted(times.items()) if t.steps > 0]
    if not points:
        return None
    if len(points) == 1:
        batch, mean, variance = points[0]
        # fixed = mean - per_sample * batch: the guess is uncertain away from the size measured,
        # not at it (var T(B) = variance + (B - batch)**2 * var per_sample).
        v_pp = (mean / batch) ** 2
        return StepTimeModel(
            fixed=mean,
            per_sample=0.0,
            covariance=((variance + batch**2 * v_pp, -batch * v_pp), (-batch * v_pp, v_pp)),
            sizes=1,
        )
    return _weighted_line(points)


def _weighted_line(points: list[tuple[int, float, float]]) -> StepTimeModel:
    """Weighted least squares of ``mean = fixed + per_sample * batch``, both kept >= 0."""
    weights = [1.0 / v for _, _, v in points]
    s = sum(weights)
    sx = sum(w * b for w, (b, _, _) in zip(weights, points, strict=True))
    sy = sum(w * y for w, (_, y, _) in zip(weights, points, strict=True))
    sxx = sum(w * b * b for w, (b, _, _) in zip(weights, points, strict=True))
    sxy = sum(w * b * y for w, (b, y, _) in zip(weights, points, strict=True))
    det = s * sxx - sx * sx
    fixed = (sxx * sy - sx * sxy) / det
    per_sample = (s * sxy - sx * sy) / det
    # The unconstrained fit's covariance is kept when a coefficient is clipped: the clip moves
    # the line within its own uncertainty, and a measured size stays as well known as it is.
    cov = ((sxx / det, -sx / det), (-sx / det, s / det))
    if per_sample < 0.0:  # time falls with the batch: noise; the best non-negative line is flat
        fixed, per_sample = sy / s, 0.0
    elif fixed < 0.0:  # a line through the origin: throughput the same at every size
        fixed, per_sample = 0.0, sxy / sxx
    residual = sum(
        w * (y - fixed - per_sample * b) ** 2 for w, (b, y, _) in zip(weights, points, strict=True)
    )
    dof = len(points) - 2
    scale = max(1.0, residual / dof) if dof > 0 else 1.0
    return StepTimeModel(
        fixed=fixed,
        per_sample=per_sample,
        covariance=(
            (cov[0][0] * scale, cov[0][1] * scale),
            (cov[1][0] * scale, cov[1][1] * scale),
        ),
        sizes=len(points),
    )
