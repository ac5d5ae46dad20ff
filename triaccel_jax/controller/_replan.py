"""One re-plan: the optimizer's signals, the planner, and the optimizer state converted to match.

The controller re-plans every ``replan_every`` steps and a hand-written training loop (e.g. the
precision benchmark) does the same; both call :func:`replan`, so the rule "convert the moments
only when the policy changed" lives in one place (docs/design.md §3 and §5).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

from triaccel_jax.controller import _background_compile as background_compile
from triaccel_jax.precision import _planner as planner
from triaccel_jax.precision import _policy as policy_lib
from triaccel_jax.transforms import _signals as signals_lib
from triaccel_jax.transforms import _state_conversion as state_conversion


class Replan(NamedTuple):
    """What a re-plan decided.

    Attributes:
      plan: the planner's new :class:`triaccel_jax.precision.PrecisionPlan` (keep it for the
        next re-plan: it holds the hysteresis streaks).
      opt_state: the optimizer state, its moments converted to the new policy's state dtypes
        when the policy changed (else the state passed in, untouched).
      changed: whether the policy differs from the previous one (always, without one).
      leaves_by_dtype: ``{compute dtype: number of leaves}`` of the new policy, for the log.
    """

    plan: policy_lib.PrecisionPlan
    opt_state: Any
    changed: bool
    leaves_by_dtype: dict[str, int]


def replan(
    opt_state: Any,
    params: Any,
    previous: policy_lib.PrecisionPlan | policy_lib.PrecisionPolicy | None,
    *,
    loss: float | None = None,
    planner_options: Mapping[str, Any] | None = None,
    hysteresis: bool = True,
) -> Replan:
    """Re-plans the precision policy from the optimizer's signals.

    Args:
      opt_state: an optimizer state holding a triaccel state (its signals are read).
      params: the parameters (master copy).
      previous: the plan in force, a bare policy (no hysteresis streaks yet), or None (a first
        plan, without hysteresis).
      loss: the current loss, for a relative ``budget``.
      planner_options: the other keyword arguments of :func:`triaccel_jax.plan_precision`.
      hysteresis: False plans as a first plan (leaves move at once, no streaks); the result is
        still compared with ``previous``'s policy.

    Returns:
      A :class:`Replan`.

    Example:
      >>> import jax.numpy as jnp
      >>> import triaccel_jax
      >>> from triaccel_jax.controller import replan
      >>> params = {"w": jnp.ones((64, 64))}
      >>> opt_state = triaccel_jax.triaccel(0.1).init(params)
      >>> start = triaccel_jax.PrecisionPolicy.uniform(params)
      >>> result = replan(opt_state, params, start, planner_options={"budget": 0.0})
      >>> result.changed, result.leaves_by_dtype
      (False, {'fp32': 1})

    References:
      docs/design.md §3 (the planner) and §5 (the controller).
    """
    plan = planner.plan_precision(
        signals_lib.signals(opt_state),
        params,
        previous if hysteresis else None,
        loss=loss,
        **dict(planner_options or {}),
    )
    before = previous.policy if isinstance(previous, policy_lib.PrecisionPlan) else previous
    changed = plan.policy != before
    if changed:
        opt_state = state_conversion.convert_state(opt_state, plan.policy)
    counts: dict[str, int] = {}
    for path in plan.policy:
        compute = plan.policy.compute(path)
        counts[compute] = counts.get(compute, 0) + 1
    return Replan(plan, opt_state, changed, counts)


def replan_controller(controller: Any) -> None:
    """:func:`replan` for a :class:`triaccel_jax.controller.Controller`, logged as an event.

    A changed policy replaces the optimizer state (converted) and forgets the measured peaks,
    which were for the old policy. With ``compile_in_background`` the new policy's step compiles
    on a worker thread first and the switch comes at the first step after it is ready
    (:mod:`triaccel_jax.controller._background_compile`); a re-plan that comes due while another
    background compile is waiting runs at the first step after that one is done.

    Args:
      controller: the controller (its steps in flight read, so its last loss is current).
    """
    background = controller._background
    if background.busy:
        if background.replan_due_at is None:
            background.replan_due_at = controller.step_count
        return
    due = controller.step_count if background.replan_due_at is None else background.replan_due_at
    background.replan_due_at = None
    result = replan(
        controller.opt_state,
        controller.params,
        controller.plan,
        loss=controller._last_loss,
        planner_options=controller.config.planner_options,
        # The first plan leaves the all-fp32 start at once: hysteresis guards against flipping
        # back and forth between plans, and there is no earlier plan yet.
        hysteresis=not controller.config.is_first_replan(due),
    )
    if not result.changed:
        controller.plan = result.plan  # the hysteresis streaks move on
        return
    figures = {"leaves_by_dtype": result.leaves_by_dtype, "loss": controller._last_loss}
    micro = controller._micro
    key = (micro, controller._num_micro(micro), result.plan.policy)
    cached = controller._compiled.get(key) is not None
    if controller.config.compile_in_background and not cached:
        background.start_replan(controller, result.plan, result.opt_state, figures)
        return
    background_compile.switch_policy(
        controller,
        result.plan,
        "the planner chose another policy",
        figures,
        opt_state=result.opt_state,
    )
