"""One re-plan: the optimizer's signals, the planner, and the optimizer state converted to match.

A pure function of the optimizer state, the params and the plan in force: the controller re-plans
every ``replan_every`` steps and a hand-written training loop (e.g. the precision benchmark) does
the same; both call :func:`replan`, so the rule "convert the moments only when the policy
changed" lives in one place (docs/design.md §3 and §5).
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

from triaccel_jax.policy import PrecisionPlan
from triaccel_jax.policy import PrecisionPolicy
from triaccel_jax.precision import PlannerConfig
from triaccel_jax.precision import plan_precision
from triaccel_jax.transforms import convert_state
from triaccel_jax.transforms import signals


class Replan(NamedTuple):
    """What a re-plan decided.

    Attributes:
      plan: the planner's new :class:`triaccel_jax.policy.PrecisionPlan` (keep it for the
        next re-plan: it holds the hysteresis streaks).
      opt_state: the optimizer state, its moments converted to the new policy's state dtypes
        when the policy changed (else the state passed in, untouched).
      changed: whether the policy differs from the previous one (always, without one).
      leaves_by_dtype: ``{compute dtype: number of leaves}`` of the new policy, for the log.
    """

    plan: PrecisionPlan
    opt_state: Any
    changed: bool
    leaves_by_dtype: dict[str, int]


def replan(
    opt_state: Any,
    params: Any,
    previous: PrecisionPlan | PrecisionPolicy | None,
    *,
    loss: float | None = None,
    planner: PlannerConfig | None = None,
    hysteresis: bool = True,
    savings_needed: int | None = None,
) -> Replan:
    """Re-plans the precision policy from the optimizer's signals.

    Args:
      opt_state: an optimizer state holding a triaccel state (its signals are read).
      params: the parameters (master copy).
      previous: the plan in force, a bare policy (no hysteresis streaks yet), or None (a first
        plan, without hysteresis).
      loss: the current loss, for a relative ``budget``.
      planner: the planner's settings (default ``PlannerConfig()``).
      hysteresis: False plans as a first plan (leaves move at once, no streaks); the result is
        still compared with ``previous``'s policy.
      savings_needed: bytes memory needs saved (the planner lowers leaves only that far), or
        None (every leaf the budget allows); see :func:`triaccel_jax.plan_precision`.

    Returns:
      A :class:`Replan`.

    Example:
      >>> import jax.numpy as jnp
      >>> import triaccel_jax
      >>> from triaccel_jax.controller import replan
      >>> from triaccel_jax.precision import PlannerConfig
      >>> params = {"w": jnp.ones((64, 64))}
      >>> opt_state = triaccel_jax.triaccel(0.1).init(params)
      >>> start = triaccel_jax.PrecisionPolicy.uniform(params)
      >>> result = replan(opt_state, params, start, planner=PlannerConfig(budget=0.0))
      >>> result.changed, result.leaves_by_dtype
      (False, {'fp32': 1})

    References:
      docs/design.md §3 (the planner) and §5 (the controller).
    """
    plan = plan_precision(
        signals(opt_state),
        params,
        previous if hysteresis else None,
        loss=loss,
        savings_needed=savings_needed,
        **(planner or PlannerConfig()).options(),
    )
    before = previous.policy if isinstance(previous, PrecisionPlan) else previous
    changed = plan.policy != before
    if changed:
        opt_state = convert_state(opt_state, plan.policy)
    counts: dict[str, int] = {}
    for path in plan.policy:
        compute = plan.policy.compute(path)
        counts[compute] = counts.get(compute, 0) + 1
    return Replan(plan, opt_state, changed, counts)
