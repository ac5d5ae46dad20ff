"""Goodput: the batch the training progress per second is highest at, on figures with intervals.

Goodput is throughput times statistical efficiency (Pollux, Qiao et al., 2021):
``goodput(B) = throughput(B) * E(B)`` with ``E(B) = (B_noise + B0) / (B_noise + B)`` against the
reference batch ``B0`` the learning rate was tuned at. Both factors are estimates: the throughput
from the fitted step-time model (:mod:`._throughput`), the noise scale from the per-sample
averages (:mod:`._noise_scale`), each with an uncertainty. The rule:

* **Candidates.** The batch sizes memory allows, no smaller than the reference batch (below it
  the efficiency model extrapolates to progress per sample above 1, which no measurement
  supports; AdaptDL never goes below its initial batch either), and no larger than
  ``critical_multiple * B_noise`` (about the critical batch, beyond which more samples buy
  little: McCandlish et al., 2018, §2.2). The batch in force is always a candidate.
* **Gate scaled to the gain.** Every gain is relative to the batch in force, so its timing's
  noise enters every bound. A size is *known* once its throughput's relative standard deviation
  is at most ``margin / (2 z)``, 1.5% by default (two known sizes whose goodputs differ by twice
  the margin are then told apart by the lower bound); the batch in force need not be known
  before a decision whose bounds already clear the margin: a large gain moves on a rough
  timing, a small one waits for a fine one. Nothing moves before the batch in force has a
  timed step.
* **Move** to the candidate of the highest goodput when the lower confidence bound of its gain
  over the batch in force beats ``margin``: its throughput at the lower end, the present one at
  the upper end, and the noise scale at the end of its interval least favourable to the move.
  A candidate above every timed size is predicted by extrapolating the fitted step time, which
  a step time growing faster than linearly there (caches, memory bandwidth) makes too hopeful:
  it is *tried* instead (below), and its own timing keeps or reverts it.
* **Explore** otherwise: the nearest candidate above every timed size is tried when its gain
  may beat ``margin``. Once the batch in force is known, "may" is the gain's upper bound;
  before, the predicted gain (the optimistic prior of :mod:`._throughput` makes an unmeasured
  larger size hopeful) must clear the margin against the fast end of the present's timing,
  which stops improving once the run leaves it: a gain the trial could then show. So a rough
  timing of the present holds back only explorations of a small gain. The trial is decided as
  soon as the bounds of its gain over the size it left lie on one side of the margin (kept
  above, back below), and on the estimate once the trial is known. Sizes are tried only from
  the largest timed size and only above it: a size once timed, or lying below a timed size
  (skipped by a move: the fitted model predicts it), speaks through the figures, and after a
  trial is reverted nothing above it is tried until a move on measured figures brings the run
  back there. So on steady figures the batch changes direction at most once.

The rule never shrinks the batch because the noise scale fell: shrinking is for memory (the
controller's memory rule and out-of-memory retries).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Sequence
from typing import NamedTuple

from triaccel_jax._src import validation
from triaccel_jax.controller._throughput import StepTimes
from triaccel_jax.controller._throughput import fit_step_time


class BatchDecision(NamedTuple):
    """What :func:`decide_batch` decided.

    Attributes:
      batch: the batch to train at (the one in force when nothing clears the bar).
      kind: ``"stay"``, ``"move"`` (a gain whose lower bound clears the margin), ``"explore"``
        (a size whose throughput is not known well enough, tried because it may gain: the batch
        in force is then on trial), or, deciding a trial, ``"keep"`` (the batch in force stays)
        or ``"revert"`` (back to the batch the trial left).
      reason: why, in words, for the event log.
      figures: per candidate: efficiency, throughput and its standard deviation, goodput, and
        the gain over the batch in force with its lower and upper bounds.
    """

    batch: int
    kind: str
    reason: str
    figures: dict[int, dict[str, float]]


def efficiency(batch: int, noise_scale: float, reference: int) -> float:
    """Pollux's statistical efficiency ``(B_noise + B0) / (B_noise + B)`` (1 at infinite noise)."""
    if math.isinf(noise_scale):
        return 1.0
    return (noise_scale + reference) / (noise_scale + batch)


def decide_batch(
    current: int,
    allowed: Sequence[int],
    *,
    noise_scale: float | None,
    noise_interval: tuple[float, float] | None,
    times: Mapping[int, StepTimes],
    reference: int,
    margin: float = 0.05,
    critical_multiple: float = 1.0,
    z: float = 1.645,
    trial_from: int | None = None,
) -> BatchDecision:
    """The batch of highest goodput that the figures' intervals support.

    Args:
      current: the batch in force.
      allowed: the batch sizes memory allows, ascending, ``current`` among them.
      noise_scale: the gradient noise scale's estimate, or None before it is measured (then the
        batch stays).
      noise_interval: its ``(low, high)`` interval, or None (taken as the point estimate).
      times: the timed steps of each batch size (under the policy in force); the step-time
        model is fitted to them (:func:`~triaccel_jax.controller._throughput.fit_step_time`). A
        size is *known* by its own steps (see above); gains are predicted by the model.
      reference: ``B0``, the batch the learning rate was tuned at: the floor.
      margin: the relative goodput gain a move needs, >= 0.
      critical_multiple: the cap on the batch in units of the noise scale, > 0.
      z: the standard normal quantile of the bounds (1.645: one-sided 95%).
      trial_from: while the batch in force is on trial (an exploration not yet decided), the
        batch the run left for it; None otherwise. Once the batch in force is known, the trial
        is decided: ``"keep"`` when its goodput beats ``trial_from``'s by the margin, else
        ``"revert"`` to ``trial_from``.

    Returns:
      A :class:`BatchDecision`.

    Example:
      >>> from triaccel_jax.controller._goodput import decide_batch
      >>> from triaccel_jax.controller._throughput import StepTimes
      >>> # A GPU-like device: 10 ms a step plus 0.01 ms a sample, timed over 100 steps at 32 and
      >>> # 64 with no jitter; noise scale 500. The run is at 64.
      >>> seconds = {b: 0.010 + 0.00001 * b for b in (32, 64)}
      >>> gpu = {b: StepTimes(100, 100 * t, 100 * t * t, 100) for b, t in seconds.items()}
      >>> decision = decide_batch(
      ...     64,
      ...     (32, 64, 128, 256, 512, 1024),
      ...     noise_scale=500.0,
      ...     noise_interval=(400.0, 600.0),
      ...     times=gpu,
      ...     reference=32,
      ... )
      >>> decision.batch, decision.kind  # beyond every timed size: tried, kept on its own timing
      (256, 'explore')

    References:
      Qiao et al., 2021, "Pollux", §3-4 (goodput, the fitted throughput model); McCandlish et al.,
      2018, "An Empirical Model of Large-Batch Training" (the critical batch).
    """
    validation.check_in_range("margin", margin, 0.0, math.inf)
    validation.check_in_range(
        "critical_multiple", critical_multiple, 0.0, math.inf, low_inclusive=False
    )
    validation.check_in_range("z", z, 0.0, math.inf)
    if current not in allowed:
        raise ValueError(f"the batch in force {current} must be among the allowed {tuple(allowed)}")
    step_time = fit_step_time(times)
    if noise_scale is None or step_time is None:
        return BatchDecision(
            current, "stay", "the noise scale or step time is not measured yet", {}
        )
    low, high = noise_interval if noise_interval is not None else (noise_scale, noise_scale)
    cap = max(reference, critical_multiple * noise_scale)
    candidates = [b for b in allowed if reference <= b <= cap]
    for kept in (current, trial_from):
        if kept is not None and kept in allowed and kept not in candidates:
            candidates.append(kept)
    # Known: a relative spread at which two known sizes whose goodputs differ by twice the margin
    # are told apart by the lower bound (2m - z sqrt(2) m / (2 z) > m).
    known = margin / (2.0 * z) if z > 0 else math.inf

    def is_known(batch: int) -> bool:
        own = times.get(batch, StepTimes())
        return own.steps > 0 and math.sqrt(own.variance_of_mean) <= known * own.mean

    if times.get(current, StepTimes()).steps == 0:
        return BatchDecision(current, "stay", f"measuring {current}: no step timed yet", {})
    rate_now, sd_now = step_time.throughput(current)
    current_known = is_known(current)
    figures: dict[int, dict[str, float]] = {}
    for batch in sorted(candidates):
        rate, sd = step_time.throughput(batch)
        eff = efficiency(batch, noise_scale, reference)
        # The efficiency ratio at the noise scale least (and most) favourable to this batch.
        ratios = [
            efficiency(batch, n, reference) / efficiency(current, n, reference) for n in (low, high)
        ]
        gain = rate * eff / (rate_now * efficiency(current, noise_scale, reference)) - 1.0
        spread = math.hypot(sd / rate, sd_now / rate_now) if batch != current else 0.0
        figures[batch] = {
            "efficiency": eff,
            "samples_per_second": rate,
            "samples_per_second_sd": sd,
            "goodput": rate * eff,
            "gain": gain,
            "gain_low": rate / rate_now * (1.0 - z * spread) * min(ratios) - 1.0,
            "gain_high": rate / rate_now * (1.0 + z * spread) * max(ratios) - 1.0,
            # The gain a trial could be shown to have once it is timed: the predicted gain with
            # the batch in force at the fast end of its timing, which stops improving when the
            # run leaves it.
            "gain_reachable": (1.0 + gain) / (1.0 + z * sd_now / rate_now) - 1.0,
        }
    if trial_from is not None and trial_from in figures:
        # The trial's gain over where it left, and its bounds: decided as soon as the bounds
        # lie on one side of the margin, and on the estimate once the trial is known.
        left = figures[trial_from]
        gain = 1.0 / (1.0 + left["gain"]) - 1.0
        worst = 1.0 / (1.0 + left["gain_high"]) - 1.0
        # A lower bound at or below -100% bounds nothing: a timing that rough allows any gain.
        best = 1.0 / (1.0 + left["gain_low"]) - 1.0 if left["gain_low"] > -1.0 else math.inf
        if worst > margin or (current_known and gain > margin):
            return BatchDecision(
                current,
                "keep",
                f"goodput of the trial of {current} beats {trial_from}'s by {gain:.0%} (at least "
                f"{worst:.0%}): kept",
                figures,
            )
        if best <= margin or current_known:
            return BatchDecision(
                trial_from,
                "revert",
                f"goodput of the trial of {current} is {gain:+.0%} over {trial_from}'s (at most "
                f"{best:+.0%}), not {margin:.0%}: back",
                figures,
            )
        return BatchDecision(
            current,
            "stay",
            f"measuring the trial of {current}: its gain over {trial_from}, {gain:+.0%} in "
            f"[{worst:+.0%}, {best:+.0%}], is not yet on one side of {margin:.0%}",
            figures,
        )
    # A move needs the gain's lower bound to clear the margin, the batch in force's own timing
    # noise included: a large gain moves on a rough timing, a small one waits for a fine one.
    # Above every timed size the fitted model extrapolates, and a step time that grows faster
    # than linearly there (caches, memory bandwidth) makes its bound too hopeful: such a gain is
    # tried, and the trial's own timing keeps or reverts it. Sizes are tried only from the
    # largest timed size, so after a trial is reverted nothing above it is tried again until a
    # move on measured figures brings the run back there: the direction changes at most once on
    # steady figures.
    timed = [b for b, own in times.items() if own.steps > 0]
    frontier = max(timed)
    may_try = current >= frontier
    movable = [b for b in figures if b != current and figures[b]["gain_low"] > margin]
    beyond = [b for b in movable if b > frontier] if may_try else []
    within = [b for b in movable if b <= frontier]
    choice = max([*beyond, *within], key=lambda b: figures[b]["goodput"], default=None)
    if choice is not None:
        f = figures[choice]
        if choice > frontier:
            return BatchDecision(
                choice,
                "explore",
                f"goodput at {choice} is predicted to beat {current}'s by {f['gain']:.0%} (at "
                f"least {f['gain_low']:.0%}), beyond every timed size: trying it",
                figures,
            )
        return BatchDecision(
            choice,
            "move",
            f"goodput at {choice} beats {current} by {f['gain']:.0%} (at least "
            f"{f['gain_low']:.0%}; noise scale {noise_scale:.4g} in [{low:.4g}, {high:.4g}])",
            figures,
        )
    # The nearest first, the larger on a tie: growth is what an unmeasured size may offer.
    # Before the batch in force is known, an exploration needs a gain the trial could show:
    # the predicted gain must clear the margin even against the fast end of the present's
    # timing, so that the trial's bounds can clear it once the trial is timed. A rough present
    # then holds back only explorations of a small gain.
    # Only sizes above every timed one are explored, from the largest timed size: a size timed
    # before (a trial decided, a batch left) speaks through its own figures, and one below a
    # timed size (skipped by a move) through the model fitted to them, both by the lower bound;
    # so the direction changes at most once, and an exploration never shrinks the batch.
    for batch in sorted((b for b in figures if b != current), key=lambda b: (abs(b - current), -b)):
        f = figures[batch]
        hopeful = f["gain_high"] if current_known else f["gain_reachable"]
        if may_try and batch > frontier and hopeful > margin:
            return BatchDecision(
                batch,
                "explore",
                f"goodput at {batch} may beat {current}'s by up to {hopeful:.0%}, and its "
                "throughput is not measured yet: trying it",
                figures,
            )
    if not current_known:
        return BatchDecision(
            current,
            "stay",
            f"measuring {current}: its {times[current].steps} timed steps give its throughput "
            f"within {z * sd_now / rate_now:.1%}, too rough for any gain in sight "
            f"(noise scale {noise_scale:.4g} in [{low:.4g}, {high:.4g}])",
            figures,
        )
    return BatchDecision(
        current,
        "stay",
        f"no batch beats {current}'s goodput by {margin:.0%} at the lower bound "
        f"(noise scale {noise_scale:.4g} in [{low:.4g}, {high:.4g}], cap {cap:.4g})",
        figures,
    )
