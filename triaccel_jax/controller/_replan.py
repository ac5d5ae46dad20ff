"""One re-plan: the optimizer's signals, the planner, and the optimizer state converted to match.

A pure function of the optimizer state, the params and the plan in force: the controller re-plans
every ``replan_every`` steps and a hand-written training loop (e.g. the precision benchmark) does
the same; both call :func:`replan`, so the rule "convert the moments only when the policy
changed" lives in one place (docs/design.md §3 and §5).

:func:`decide_replan` is the controller's re-plan decision on top of it, as pure as the bucket
and goodput rules: from the measured figures (peak and limit bytes, samples per second) and the
precision rule it asks the planner for a plan, and says why the policy changes and whether the
new one goes on a speed trial. Its tracker is :class:`._precision_schedule.PrecisionSchedule`;
the controller only applies the decision (compiles, converts the state, logs the event).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

from triaccel_jax.controller import _precision_speed as precision_speed
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


class ReplanDecision(NamedTuple):
    """What the controller's re-plan decided (:func:`decide_replan`), for the controller to apply.

    Attributes:
      plan: the planner's new :class:`triaccel_jax.policy.PrecisionPlan`: the plan to switch
        to when ``changed``, else the plan in force with its hysteresis streaks moved on.
      opt_state: the optimizer state converted to ``plan``'s policy when ``changed`` (else the
        state passed in).
      changed: whether the policy changes.
      reason: why, for the event log (empty when not ``changed``).
      figures: the decision's figures for the event log; ``figures["speed_trial"]`` is True
        when the new policy goes on a speed trial (the flag travels with the figures through a
        background compile to the switch).
    """

    plan: PrecisionPlan
    opt_state: Any
    changed: bool
    reason: str
    figures: dict[str, Any]


def decide_replan(
    opt_state: Any,
    params: Any,
    previous: PrecisionPlan,
    *,
    loss: float | None,
    planner: PlannerConfig | None,
    precision_rule: str,
    first: bool,
    for_memory: bool,
    tries_for_speed: bool,
    micro: int,
    num_micro: int,
    peak_bytes: int | None,
    limit_bytes: int | None,
    target: float,
    throughput: Mapping[tuple[int, int, str], float],
) -> ReplanDecision:
    """The controller's re-plan: the plan to switch to, why, and whether it goes on trial.

    With ``precision_rule="memory"`` the planner lowers every leaf the accuracy budget allows.
    With ``"speed"`` (:mod:`._precision_speed`) it lowers leaves only as far as memory needs
    (:func:`._precision_speed.savings_needed` bytes), unless a lower precision may still prove
    faster here (``tries_for_speed``): then the budget's plan is taken, and when it lowers some
    leaf it goes on a speed trial (timed, kept only if faster). ``for_memory`` (a memory check
    found the step over the high-water mark) plans for memory alone and without hysteresis:
    relief cannot wait ``patience`` re-plans; a ``first`` re-plan has no hysteresis either (it
    leaves the all-fp32 start at once: there is no earlier plan to flip back to).

    Args:
      opt_state: the optimizer state in force (its signals are read).
      params: the parameters.
      previous: the plan in force.
      loss: the last finite loss, for a relative accuracy budget.
      planner: the planner's settings (``ControllerConfig.planner``).
      precision_rule: ``"speed"`` or ``"memory"`` (``ControllerConfig.precision_rule``).
      first: whether this is the run's first re-plan (``ControllerConfig.is_first_replan``).
      for_memory: whether memory pressure asked for it (``"speed"`` only).
      tries_for_speed: whether a lower precision may still prove faster
        (:attr:`._precision_schedule.PrecisionSchedule.tries_for_speed`).
      micro: the bucket in force.
      num_micro: micro-batches per step at ``micro``.
      peak_bytes: the step's known peak at ``micro`` under the policy in force, or None.
      limit_bytes: the memory limit, or None.
      target: the fraction of the limit a step should stay under (``ControllerConfig.target``).
      throughput: measured samples per second by ``(micro-batch, micro-batches, signature)``.

    Returns:
      A :class:`ReplanDecision`.

    Example:
      >>> import jax.numpy as jnp
      >>> import triaccel_jax
      >>> from triaccel_jax.controller._replan import decide_replan
      >>> from triaccel_jax.policy import PrecisionPlan
      >>> params = {"w": jnp.ones((64, 64))}
      >>> opt_state = triaccel_jax.triaccel(0.1).init(params)
      >>> start = PrecisionPlan(triaccel_jax.PrecisionPolicy.uniform(params), {})
      >>> decision = decide_replan(
      ...     opt_state,
      ...     params,
      ...     start,
      ...     loss=None,
      ...     planner=None,
      ...     precision_rule="speed",
      ...     first=True,
      ...     for_memory=False,
      ...     tries_for_speed=False,
      ...     micro=8,
      ...     num_micro=1,
      ...     peak_bytes=1_000,
      ...     limit_bytes=10_000,
      ...     target=0.85,
      ...     throughput={},
      ... )
      >>> decision.changed, decision.figures["savings_needed_bytes"]  # memory needs nothing
      (False, 0)
    """
    figures: dict[str, Any] = {"precision_rule": precision_rule}
    speed = precision_rule == "speed"
    savings = None
    if speed:
        needed = precision_speed.savings_needed(
            previous.policy, params, peak_bytes=peak_bytes, limit_bytes=limit_bytes, target=target
        )
        if for_memory or not tries_for_speed:
            savings = needed
        figures.update(
            savings_needed_bytes=needed,
            peak_bytes=peak_bytes,
            limit_bytes=limit_bytes,
            samples_per_second={
                signature: rate
                for (m, n, signature), rate in throughput.items()
                if (m, n) == (micro, num_micro)
            },
        )
    result = replan(
        opt_state,
        params,
        previous,
        loss=loss,
        planner=planner,
        # Hysteresis guards against flipping back and forth between plans: the first plan has
        # no earlier one, and memory's relief cannot wait for a streak.
        hysteresis=not (first or for_memory),
        savings_needed=savings,
    )
    if not result.changed:
        return ReplanDecision(result.plan, result.opt_state, False, "", figures)
    figures.update(leaves_by_dtype=result.leaves_by_dtype, loss=loss)
    reason = "the planner chose another policy"
    if for_memory or (savings is not None and savings > 0):
        reason = f"memory needs {figures['savings_needed_bytes']} B saved at micro-batch {micro}"
    elif speed and savings is None and precision_speed.lowers(previous.policy, result.plan.policy):
        figures["speed_trial"] = True
        reason = "the accuracy budget allows lower precision: a trial times it against fp32"
    return ReplanDecision(result.plan, result.opt_state, True, reason, figures)
