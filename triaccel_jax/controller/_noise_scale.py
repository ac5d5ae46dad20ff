"""The gradient noise scale, smoothed per sample, with its uncertainty.

A step of ``B`` samples whose gradient is the mean of ``k`` sub-gradients of ``b = B / k`` samples
each (micro-batches of gradient accumulation, or the shards of data parallelism) gives two squared
norms for free: ``|g_b|^2``, the mean over the sub-gradients of each one's squared norm, and
``|g_B|^2``, the squared norm of their mean. Since ``E|g_b|^2 = |G|^2 + tr(Sigma) / b``, two
unbiased estimates follow (McCandlish et al., 2018, "An Empirical Model of Large-Batch Training",
appendix A.1):

    |G|^2     ~ (B |g_B|^2 - b |g_b|^2) / (B - b)
    tr(Sigma) ~ (|g_b|^2 - |g_B|^2) / (1/b - 1/B)

and the simple noise scale is the ratio of their means, ``B_simple = tr(Sigma) / |G|^2``.

How the means are taken decides whether the batch can be steered by it:

* **Per sample, not per step.** Each step's estimates enter exponential moving averages with the
  decay ``exp(-B / horizon)``: a step of ``B`` samples counts for ``B`` samples, so a larger batch
  does not shorten the memory of the estimate, and the horizon is a number of samples (by
  default, a few epochs of a small data set: the noise scale changes over training, slowly).
* **Numerator and denominator apart.** ``|G|^2`` and ``tr(Sigma)`` are averaged separately and the
  ratio taken last: the mean of ratios is biased and its spikes (a near-zero ``|G|^2`` estimate)
  dominate it.
* **With its uncertainty.** The same averages of the squares and the cross product give each
  mean's variance, over the effective number of estimates ``(sum w)^2 / sum w^2``; the ratio's
  standard deviation follows by the delta method, and its interval is taken on the log scale. A decision may then move only when its gain
  holds over the interval, not on one noisy figure.

Everything here is a pure function of figures the compiled step returns, kept as Python floats.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from triaccel_jax._src import validation


class NoiseScaleEstimate(NamedTuple):
    """Sample-weighted moving averages behind the gradient noise scale.

    Each average is a weighted sum; dividing by ``weight`` gives the mean (the bias correction of
    an EMA started at zero).

    Attributes:
      grad_sq: weighted sum of the ``|G|^2`` estimates.
      trace: weighted sum of the ``tr(Sigma)`` estimates.
      grad_sq_sq: weighted sum of their squares.
      trace_sq: weighted sum of the ``tr(Sigma)`` estimates' squares.
      cross: weighted sum of the products of the two.
      weight: the sum of the weights.
      weight_sq: the sum of the squared weights (for the effective number of estimates).
      samples: the samples that carried an estimate so far.
    """

    # The weighted sums of the two estimates, whose ratio is the noise scale,
    grad_sq: float = 0.0
    trace: float = 0.0
    # of their squares and product, whose spread is the noise scale's uncertainty,
    grad_sq_sq: float = 0.0
    trace_sq: float = 0.0
    cross: float = 0.0
    # and of the weights, which make the sums means and count the estimates.
    weight: float = 0.0
    weight_sq: float = 0.0
    samples: int = 0

    @property
    def effective_count(self) -> float:
        """The effective number of estimates averaged, ``(sum w)^2 / sum w^2`` (0 before any)."""
        return self.weight**2 / self.weight_sq if self.weight_sq > 0.0 else 0.0

    @property
    def simple(self) -> float | None:
        """``B_simple = tr(Sigma) / |G|^2``, or None before the first estimate.

        ``inf`` while the averaged ``|G|^2`` is not positive (all noise: no batch is too large);
        0 while the averaged ``tr(Sigma)`` is not positive.
        """
        if self.weight == 0.0:
            return None
        grad_sq, trace = self.grad_sq / self.weight, self.trace / self.weight
        if grad_sq <= 0.0:
            return math.inf
        return max(trace, 0.0) / grad_sq

    @property
    def standard_error(self) -> float | None:
        """The standard deviation of :attr:`simple` (the delta method), None before two
        estimates, ``inf`` where ``|G|^2`` is not known to be positive."""
        n = self.effective_count
        simple = self.simple
        if simple is None or n < 2.0:
            return None
        if math.isinf(simple):
            return math.inf
        g = self.grad_sq / self.weight
        t = self.trace / self.weight
        var_g = max(self.grad_sq_sq / self.weight - g * g, 0.0) / (n - 1.0)
        var_t = max(self.trace_sq / self.weight - t * t, 0.0) / (n - 1.0)
        cov = (self.cross / self.weight - g * t) / (n - 1.0)
        if t <= 0.0:
            return math.sqrt(var_t) / g
        rel = var_t / t**2 + var_g / g**2 - 2.0 * cov / (t * g)
        return simple * math.sqrt(max(rel, 0.0))

    def interval(self, z: float = 1.96) -> tuple[float, float] | None:
        """``simple * exp(-+ z * standard_error / simple)``: the interval of the log of the
        noise scale, as a ratio of two noisy means is skewed (it is never below 0 and its upper
        tail is long); None before two estimates, ``(0, inf)`` while ``|G|^2`` is not known to
        be positive."""
        simple, error = self.simple, self.standard_error
        if simple is None or error is None:
            return None
        if math.isinf(simple) or math.isinf(error) or simple <= 0.0:
            return (0.0, math.inf) if error and error > 0 else (simple, simple)
        spread = math.exp(z * error / simple)
        return simple / spread, simple * spread


def observe_noise(
    state: NoiseScaleEstimate,
    *,
    grad_sq_norm: float,
    sub_grad_sq_norm: float,
    batch: int,
    sub_batch: int,
    horizon: float,
) -> NoiseScaleEstimate:
    """Folds one step's two squared gradient norms into the sample-weighted averages.

    Args:
      state: the averages so far (``NoiseScaleEstimate()`` to start).
      grad_sq_norm: ``|g_B|^2``, the squared norm of the step's gradient over ``batch`` samples.
      sub_grad_sq_norm: ``|g_b|^2``, the mean of the sub-gradients' squared norms, all of them
        pooled (every micro-batch on every device).
      batch: the step's samples ``B``.
      sub_batch: the samples of one sub-gradient ``b``; a step of one sub-gradient
        (``sub_batch == batch``) carries no estimate and leaves ``state`` unchanged.
      horizon: the samples over which the averages forget, > 0: the old averages decay by
        ``exp(-batch / horizon)``.

    Returns:
      The new :class:`NoiseScaleEstimate` (``state`` itself when the step carries no estimate or
      a norm is not finite, as after a skipped loss-scaled step).

    Example:
      >>> from triaccel_jax.controller._noise_scale import NoiseScaleEstimate, observe_noise
      >>> # |G|^2 = 1, tr(Sigma) = 64: |g_8|^2 = 1 + 64/8 = 9, |g_32|^2 = 1 + 64/32 = 3.
      >>> state = NoiseScaleEstimate()
      >>> for _ in range(3):
      ...     state = observe_noise(
      ...         state,
      ...         grad_sq_norm=3.0,
      ...         sub_grad_sq_norm=9.0,
      ...         batch=32,
      ...         sub_batch=8,
      ...         horizon=10_000,
      ...     )
      >>> round(state.simple, 6), state.interval()
      (64.0, (64.0, 64.0))

    References:
      McCandlish et al., 2018, "An Empirical Model of Large-Batch Training", appendix A.1.
    """
    validation.check_in_range("horizon", horizon, 0.0, math.inf, low_inclusive=False)
    if sub_batch <= 0 or batch % sub_batch:
        raise ValueError(
            f"`sub_batch` must divide `batch` into equal parts, got {sub_batch} and {batch}"
        )
    if sub_batch >= batch or not (math.isfinite(grad_sq_norm) and math.isfinite(sub_grad_sq_norm)):
        return state
    grad_sq = (batch * grad_sq_norm - sub_batch * sub_grad_sq_norm) / (batch - sub_batch)
    trace = (sub_grad_sq_norm - grad_sq_norm) / (1.0 / sub_batch - 1.0 / batch)
    keep = math.exp(-batch / horizon)
    # The new estimate's weight is what the old ones lost, so that weights sum to
    # 1 - exp(-samples / horizon), as an EMA's do per step.
    w = 1.0 - keep
    return NoiseScaleEstimate(
        grad_sq=keep * state.grad_sq + w * grad_sq,
        trace=keep * state.trace + w * trace,
        grad_sq_sq=keep * state.grad_sq_sq + w * grad_sq**2,
        trace_sq=keep * state.trace_sq + w * trace**2,
        cross=keep * state.cross + w * grad_sq * trace,
        weight=keep * state.weight + w,
        weight_sq=keep**2 * state.weight_sq + w**2,
        samples=state.samples + batch,
    )
