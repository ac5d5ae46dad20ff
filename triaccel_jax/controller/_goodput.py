"""Goodput: how much training a batch size buys per second, from the gradient noise scale.

A step of ``B`` samples made of micro-batches of ``b`` gives two squared gradient norms for free:
``|g_b|^2`` (the mean over micro-batches of each one's squared norm) and ``|g_B|^2`` (the squared
norm of their average). Since ``E|g_b|^2 = |G|^2 + tr(Sigma) / b`` for a batch of ``b`` samples,
the two are unbiased estimates of the true gradient's squared norm and of the per-sample gradient
variance (McCandlish et al., 2018, "An Empirical Model of Large-Batch Training", appendix A):

    |G|^2     ~ (B |g_B|^2 - b |g_b|^2) / (B - b)
    tr(Sigma) ~ (|g_b|^2 - |g_B|^2) / (1/b - 1/B)

Each is smoothed by an exponential moving average before the ratio is taken (the ratio of the
means, not the mean of the ratios, which is biased and noisy), and their ratio is the simple noise
scale ``B_simple = tr(Sigma) / |G|^2``: the batch at which a step is about half as useful per sample
as at batch 1, about the critical batch. Pollux's statistical efficiency of batch ``B`` against a
reference ``B0`` follows from it (Qiao et al., 2021, "Pollux", eq. 5):

    E(B) = (B_noise + B0) / (B_noise + B)

the fraction of a sample's worth of progress a sample brings at ``B``; goodput is throughput (samples
per second) times ``E(B)``. Everything here is a pure function of measured figures, kept as Python
floats on the host: the norms are computed inside the compiled step, and the smoothing costs a few
float operations per step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Sequence
from typing import NamedTuple

from triaccel_jax._src import validation


class NoiseScale(NamedTuple):
    """The smoothed estimates behind the gradient noise scale.

    Attributes:
      grad_sq: EMA of the unbiased estimates of ``|G|^2`` (bias not yet corrected).
      trace: EMA of the unbiased estimates of ``tr(Sigma)`` (bias not yet corrected).
      weight: ``1 - decay**n`` after ``n`` estimates: what the EMAs are divided by.
    """

    grad_sq: float = 0.0
    trace: float = 0.0
    weight: float = 0.0

    @property
    def simple(self) -> float | None:
        """``B_simple = tr(Sigma) / |G|^2``, or None before the first estimate.

        ``inf`` while the smoothed ``|G|^2`` is not positive (the gradient is all noise: no
        batch is too large); 0 while ``tr(Sigma)`` is not positive.
        """
        if self.weight == 0.0:
            return None
        grad_sq, trace = self.grad_sq / self.weight, self.trace / self.weight
        if grad_sq <= 0.0:
            return math.inf
        return max(trace, 0.0) / grad_sq


def update_noise_scale(
    state: NoiseScale,
    *,
    grad_sq_norm: float,
    micro_grad_sq_norm: float,
    batch: int,
    micro: int,
    decay: float = 0.95,
) -> NoiseScale:
    """Folds one step's two squared gradient norms into the smoothed estimates.

    Args:
      state: the estimates so far (``NoiseScale()`` to start).
      grad_sq_norm: ``|g_B|^2``, the squared norm of the step's gradient over ``batch`` samples.
      micro_grad_sq_norm: ``|g_b|^2``, the mean of the micro-batches' squared norms.
      batch: the step's samples ``B``.
      micro: the micro-batch ``b``; a step of one micro-batch (``micro == batch``) carries no
        estimate and leaves ``state`` unchanged.
      decay: the EMA's decay, in [0, 1).

    Returns:
      The new :class:`NoiseScale` (``state`` itself when the step carries no estimate or a norm
      is not finite, as after a skipped loss-scaled step).

    Example:
      >>> from triaccel_jax.controller._goodput import NoiseScale, update_noise_scale
      >>> # |G|^2 = 1, tr(Sigma) = 64: |g_8|^2 = 1 + 64/8 = 9, |g_32|^2 = 1 + 64/32 = 3.
      >>> state = update_noise_scale(
      ...     NoiseScale(), grad_sq_norm=3.0, micro_grad_sq_norm=9.0, batch=32, micro=8
      ... )
      >>> round(state.simple, 6)
      64.0

    References:
      McCandlish et al., 2018, "An Empirical Model of Large-Batch Training", appendix A.
    """
    validation.check_in_range("decay", decay, 0.0, 1.0, high_inclusive=False)
    if micro >= batch or not (math.isfinite(grad_sq_norm) and math.isfinite(micro_grad_sq_norm)):
        return state
    grad_sq = (batch * grad_sq_norm - micro * micro_grad_sq_norm) / (batch - micro)
    trace = (micro_grad_sq_norm - grad_sq_norm) / (1.0 / micro - 1.0 / batch)
    return NoiseScale(
        decay * state.grad_sq + (1.0 - decay) * grad_sq,
        decay * state.trace + (1.0 - decay) * trace,
        decay * state.weight + (1.0 - decay),
    )


def efficiency(batch: int, noise_scale: float, reference: int) -> float:
    """Pollux's statistical efficiency of ``batch`` against ``reference``: ``(B_noise + B0) /
    (B_noise + B)``, the progress per sample at ``batch`` relative to ``reference``.

    Example:
      >>> from triaccel_jax.controller._goodput import efficiency
      >>> efficiency(64, 64.0, 8), efficiency(8, 64.0, 8), efficiency(64, float("inf"), 8)
      (0.5625, 1.0, 1.0)

    References:
      Qiao et al., 2021, "Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized Deep
      Learning", eq. 5.
    """
    if math.isinf(noise_scale):
        return 1.0
    return (noise_scale + reference) / (noise_scale + batch)


class GoodputChoice(NamedTuple):
    """What :func:`choose_by_goodput` decided.

    Attributes:
      bucket: the bucket to train at (the current one when nothing beats it by the margin).
      reason: why, in words, for the event log.
      figures: per bucket considered, its efficiency, throughput (measured or modelled) and
        goodput, for the event log.
    """

    bucket: int
    reason: str
    figures: dict[int, dict[str, float | str]]


def choose_by_goodput(
    current: int,
    allowed: Sequence[int],
    *,
    noise_scale: float | None,
    throughput: Mapping[int, float],
    reference: int,
    margin: float = 0.05,
    min_efficiency: float = 0.5,
    model: str = "measured",
    measurable: bool = True,
) -> GoodputChoice:
    """The bucket of highest goodput (throughput x statistical efficiency) memory allows.

    A bucket is a candidate when memory allows it (``allowed``, the current bucket among them)
    and its efficiency is at least ``min_efficiency`` (0.5: at most the critical batch,
    ``B <= B_noise + 2 B0``). Its throughput is the measured one where there is one; otherwise
    ``model`` says: ``"measured"`` explores one bucket at a time: the unmeasured bucket next to
    the measured ones is modelled by the trend of the two nearest measured buckets (a power law
    through them), or, with one measured bucket, with samples per second in proportion to the
    batch (the hopeful guess, so that it is tried); buckets beyond it are not candidates yet,
    and once tried its measurement decides, so exploration goes on only while throughput rises;
    ``"linear"`` takes every bucket's samples per second in proportion to its batch, measured
    or not (an under-used accelerator: statistical efficiency alone decides). The best candidate is chosen when its goodput beats the current bucket's by
    ``margin``.

    Args:
      current: the bucket in force.
      allowed: the buckets memory allows, ascending (the current one among them).
      noise_scale: the gradient noise scale, or None before it is measured (then nothing moves).
      throughput: measured samples per second by bucket (under the policy in force).
      reference: the batch the learning rate was tuned at (Pollux's ``B0``).
      margin: relative goodput gain a move needs, >= 0.
      min_efficiency: the lowest statistical efficiency a bucket may have, in (0, 1].
      model: ``"measured"`` or ``"linear"`` (see above).
      measurable: whether a step at ``current`` measures the noise scale (a step of one odd
        micro-batch cannot be split in halves and does not). Without a noise scale, an
        unmeasurable bucket gives way to the next larger allowed bucket, where it is measured;
        a measurable one waits for its estimate.

    Returns:
      A :class:`GoodputChoice`.

    Example:
      >>> from triaccel_jax.controller._goodput import choose_by_goodput
      >>> # Noise scale 100 and throughput rising with the batch: grow to 128, not to 256
      >>> # (efficiency (100 + 16) / (100 + 256) = 0.33 < 0.5).
      >>> choose_by_goodput(
      ...     16,
      ...     (16, 32, 64, 128, 256),
      ...     noise_scale=100.0,
      ...     throughput={16: 1000.0},
      ...     reference=16,
      ...     model="linear",
      ... ).bucket
      128

    References:
      Qiao et al., 2021, "Pollux", §3 (goodput); McCandlish et al., 2018 (the critical batch).
    """
    validation.check_in_range("margin", margin, 0.0, math.inf)
    validation.check_in_range("min_efficiency", min_efficiency, 0.0, 1.0, low_inclusive=False)
    validation.check_choice("model", model, ("measured", "linear"))
    if current not in allowed:
        raise ValueError(f"the current bucket {current} must be among the allowed {allowed}")
    larger = [b for b in allowed if b > current]
    if noise_scale is None and not measurable and larger:
        return GoodputChoice(
            larger[0],
            f"a step of micro-batch {current} cannot measure the noise scale (it cannot be "
            f"split in halves): to {larger[0]} to measure it",
            {},
        )
    if noise_scale is None or current not in throughput:
        return GoodputChoice(current, "the noise scale or throughput is not measured yet", {})
    figures: dict[int, dict[str, float | str]] = {}
    measured = sorted(throughput)
    position = {bucket: i for i, bucket in enumerate(allowed)}
    known = [position[b] for b in measured if b in position]
    for bucket in allowed:
        if model == "linear":
            rate, source = throughput[current] * bucket / current, "in proportion to the batch"
        elif bucket in throughput:
            rate, source = throughput[bucket], "measured"
        elif min(abs(position[bucket] - i) for i in known) == 1:
            rate, source = _extrapolate(bucket, throughput)
        else:
            continue  # not a candidate before the bucket next to it is measured
        eff = efficiency(bucket, noise_scale, reference)
        figures[bucket] = {
            "efficiency": eff,
            "samples_per_second": rate,
            "goodput": rate * eff,
            "throughput_from": source,
        }
    present = float(figures[current]["goodput"])
    candidates = [b for b in figures if float(figures[b]["efficiency"]) >= min_efficiency]
    if current not in candidates:
        candidates.append(current)
    best = max(candidates, key=lambda b: (float(figures[b]["goodput"]), -abs(b - current)))
    gain = float(figures[best]["goodput"]) / present - 1.0 if present > 0 else math.inf
    if best == current or gain <= margin:
        return GoodputChoice(
            current,
            f"goodput {present:.4g} samples/s at {current} is within {margin:.0%} of the best",
            figures,
        )
    return GoodputChoice(
        best,
        f"goodput {float(figures[best]['goodput']):.4g} at {best} beats {present:.4g} at "
        f"{current} by {gain:.0%} (noise scale {noise_scale:.4g}, efficiency "
        f"{float(figures[best]['efficiency']):.2f})",
        figures,
    )


def _extrapolate(bucket: int, throughput: Mapping[int, float]) -> tuple[float, str]:
    """Samples per second at an unmeasured ``bucket``: along the power law through the two
    nearest measured buckets, or in proportion to the batch from the one measured."""
    nearest = sorted(throughput, key=lambda b: (abs(b - bucket), b))
    first = nearest[0]
    if len(nearest) < 2:
        return throughput[first] * bucket / first, f"in proportion to the batch from {first}"
    second = nearest[1]
    slope = math.log(throughput[first] / throughput[second]) / math.log(first / second)
    rate = throughput[first] * (bucket / first) ** slope
    return rate, f"the trend through {min(first, second)} and {max(first, second)}"
