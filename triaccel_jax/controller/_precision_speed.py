"""Precision by measured speed and memory: a lower precision is kept where memory needs it or
where the controller measured its steps faster, never only because the accuracy budget allows it.

Whether a bf16 step is faster than an fp32 one is a property of the hardware: a GPU's matrix
units run bf16 at twice the fp32 rate or more, XLA:CPU converts bf16 through float32 and runs a
step slower. So the planner's policy is two policies (``precision_rule="speed"``):

* what memory needs: the planner lowers leaves, cheapest predicted loss increase per byte
  first, only until the step fits the memory target (:func:`savings_needed` bytes; none when it
  fits);
* what the accuracy budget allows: every leaf the budget lets go lower. It is tried for a while
  (a *trial*) and its steps are timed against the policy before it at the same batch
  (:func:`judge_trial`); it stays only when it is faster by a margin. Once a lower precision
  measured slower, the controller stops trying it for speed for the rest of the run.

Everything here is a pure function of measured figures (docs/design.md §5).
"""

from __future__ import annotations

import math
from typing import Any
from typing import NamedTuple

from triaccel_jax import policy as policy_lib


class PolicyTrial(NamedTuple):
    """A lower-precision policy on trial: what it replaced and its steps' time so far.

    Attributes:
      previous: the plan in force before the trial (a :class:`triaccel_jax.policy.PrecisionPlan`),
        restored when the trial's steps measure slower.
      previous_signature: its policy signature (the key of its measured throughput).
      signature: the trial policy's signature.
      micro: the micro-batch the trial runs at (its steps are compared at this batch).
      num_micro: micro-batches per step.
      samples: samples trained by the trial's timed steps.
      seconds: those steps' seconds (compiles and out-of-memory retries excluded).
      steps: how many timed steps.
    """

    previous: Any
    previous_signature: str
    signature: str
    micro: int
    num_micro: int
    samples: int = 0
    seconds: float = 0.0
    steps: int = 0

    def add(self, samples: int, seconds: float) -> PolicyTrial:
        """The trial with one more timed step."""
        return self._replace(
            samples=self.samples + samples,
            seconds=self.seconds + seconds,
            steps=self.steps + 1,
        )

    @property
    def rate(self) -> float | None:
        """Samples per second of the trial's timed steps, or None before the first."""
        return self.samples / self.seconds if self.seconds > 0 else None


class TrialVerdict(NamedTuple):
    """What :func:`judge_trial` decided: keep the trial policy or go back, why, and the figures."""

    keep: bool
    reason: str
    figures: dict[str, float | None]


def judge_trial(trial: PolicyTrial, incumbent_rate: float | None, margin: float) -> TrialVerdict:
    """Keeps the trial's policy only when its steps were faster than the policy before it.

    Args:
      trial: the trial, with its timed steps.
      incumbent_rate: the previous policy's measured samples per second at the trial's batch,
        or None (not measured: the trial cannot be compared, and is not kept).
      margin: the relative speed-up a lower precision must show, >= 0.

    Returns:
      A :class:`TrialVerdict`.

    Example:
      >>> from triaccel_jax.controller._precision_speed import PolicyTrial, judge_trial
      >>> trial = PolicyTrial(None, "fp32", "bf16", 64, 1).add(640, 1.0)  # 640 samples/s
      >>> judge_trial(trial, incumbent_rate=800.0, margin=0.05).keep
      False
      >>> judge_trial(trial, incumbent_rate=500.0, margin=0.05).keep
      True
    """
    rate = trial.rate
    figures = {
        "trial_samples_per_second": rate,
        "previous_samples_per_second": incumbent_rate,
        "trial_steps": float(trial.steps),
        "margin": margin,
    }
    if rate is None or incumbent_rate is None or incumbent_rate <= 0:
        return TrialVerdict(
            False, "the trial's steps could not be compared with the policy before it", figures
        )
    speedup = rate / incumbent_rate - 1.0
    figures["speedup"] = speedup
    if speedup > margin:
        return TrialVerdict(
            True,
            f"lower precision measured {speedup:.0%} faster ({rate:.4g} against "
            f"{incumbent_rate:.4g} samples/s over {trial.steps} steps at micro-batch "
            f"{trial.micro})",
            figures,
        )
    return TrialVerdict(
        False,
        f"lower precision measured not faster by {margin:.0%} ({rate:.4g} against "
        f"{incumbent_rate:.4g} samples/s over {trial.steps} steps at micro-batch {trial.micro}): "
        "back to the policy before it, and no more speed trials this run",
        figures,
    )


def savings_needed(
    policy: policy_lib.PrecisionPolicy,
    params: Any,
    *,
    peak_bytes: int | None,
    limit_bytes: int | None,
    target: float,
) -> int:
    """Bytes of compute copies memory needs saved against all-fp32, in the planner's accounting.

    The step's peak under ``policy`` is ``peak_bytes``; reaching ``target * limit_bytes`` needs
    ``peak - target * limit`` bytes more saved, on top of what ``policy`` already saves against
    fp32 (``(4 - carried itemsize) x size`` per leaf, as :func:`triaccel_jax.plan_precision`
    counts). 0 when the figures are unknown or the step fits.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax import PrecisionPolicy
      >>> from triaccel_jax.controller._precision_speed import savings_needed
      >>> params = {"w": jnp.ones((64, 64))}  # 16 KiB in fp32
      >>> fp32 = PrecisionPolicy.uniform(params)
      >>> savings_needed(fp32, params, peak_bytes=100_000, limit_bytes=100_000, target=0.9)
      10000
      >>> savings_needed(fp32, params, peak_bytes=50_000, limit_bytes=100_000, target=0.9)
      0
    """
    if peak_bytes is None or limit_bytes is None:
        return 0
    saved = 0
    for path, leaf in policy_lib.trainable_paths(params):
        width = policy_lib.carried_itemsize("fp32") - policy_lib.carried_itemsize(
            policy.compute(path)
        )
        saved += width * math.prod(leaf.shape)
    return max(0, math.ceil(saved + peak_bytes - target * limit_bytes))


def lowers(before: policy_lib.PrecisionPolicy, after: policy_lib.PrecisionPolicy) -> bool:
    """Whether ``after`` computes some leaf in fewer bytes than ``before`` does: a policy the
    speed rule may only keep after a trial.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax import PrecisionPolicy
      >>> from triaccel_jax.controller._precision_speed import lowers
      >>> params = {"w": jnp.ones(4)}
      >>> fp32, bf16 = PrecisionPolicy.uniform(params), PrecisionPolicy.uniform(params, "bf16")
      >>> lowers(fp32, bf16), lowers(bf16, fp32)
      (True, False)
    """
    return any(
        policy_lib.carried_itemsize(after.compute(path))
        < policy_lib.carried_itemsize(before.compute(path))
        for path in after
    )
