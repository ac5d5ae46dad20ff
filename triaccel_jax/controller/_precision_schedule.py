"""``PrecisionSchedule``: the plan in force, its trials and when the next re-plan runs.

It holds the controller's precision state (docs/design.md §5), private and changed only by its own
methods: the :class:`triaccel_jax.policy.PrecisionPlan` in force (the policy and the planner's
hysteresis streaks), a lower-precision policy on trial and whether a lower precision measured
slower this run (``precision_rule="speed"``, :mod:`._precision_speed`), and a re-plan that came
due while a background compile was waiting. The decisions stay pure functions
(:func:`._replan.decide_replan`, :func:`._precision_speed.judge_trial`); this part keeps what
they decide from, says when a re-plan runs (:meth:`PrecisionSchedule.start_replan`), takes a
switch (:meth:`PrecisionSchedule.switch`) and returns the trials' verdicts for the controller to
log and act on. The plan is saved
(:meth:`PrecisionSchedule.state_dict`, the ``"precision"`` part of the controller's state); a
trial and a waiting re-plan are not: a restore calls them off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from triaccel_jax.controller import _agreement as agreement
from triaccel_jax.controller import _precision_speed as precision_speed
from triaccel_jax.controller import _state_record as state_record
from triaccel_jax.policy import PrecisionPlan
from triaccel_jax.policy import PrecisionPolicy


def signature_of(plan: PrecisionPlan | None) -> str:
    """The policy signature of ``plan`` (``"none"`` without one): the key of its measurements."""
    return "none" if plan is None else plan.policy.signature


class PrecisionSchedule:
    """The precision plan in force, a speed trial, and a re-plan waiting for a compile.

    Args:
      speed_trials: whether a lower precision the accuracy budget allows is tried for speed
        (``ControllerConfig.speed_trials``, resolved for the backend).

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax import PrecisionPolicy
      >>> from triaccel_jax.controller._precision_schedule import PrecisionSchedule
      >>> schedule = PrecisionSchedule(speed_trials=True)
      >>> schedule.set_policy(PrecisionPolicy.uniform({"w": jnp.ones(4)}))
      >>> schedule.signature == schedule.policy.signature, schedule.waiting
      (True, False)
      >>> schedule.defer(12)
      >>> schedule.take_due(20)
      12
    """

    def __init__(self, *, speed_trials: bool) -> None:
        self._plan: PrecisionPlan | None = None
        self._trial: precision_speed.PolicyTrial | None = None
        # A lower precision measured slower this run: then it is only taken where memory needs.
        self._lower_is_slower = False
        self._speed_trials = speed_trials
        # The step a re-plan came due at while a background compile was waiting (None: none
        # waits); it runs as soon as that compile is taken.
        self._due_at: int | None = None

    @property
    def plan(self) -> PrecisionPlan | None:
        """The plan in force (None when precision is not planned)."""
        return self._plan

    @property
    def policy(self) -> PrecisionPolicy | None:
        """The policy in force (None when precision is not planned)."""
        return None if self._plan is None else self._plan.policy

    @property
    def signature(self) -> str:
        """The signature of the policy in force (``"none"`` without one)."""
        return signature_of(self._plan)

    @property
    def trial(self) -> precision_speed.PolicyTrial | None:
        """The lower-precision policy on trial, or None."""
        return self._trial

    @property
    def tries_for_speed(self) -> bool:
        """Whether a lower precision may still prove faster here (then the budget's plan is
        tried), rather than lowered only as far as memory needs."""
        return self._speed_trials and not self._lower_is_slower

    @property
    def waiting(self) -> bool:
        """Whether a re-plan came due while a background compile was waiting."""
        return self._due_at is not None

    def set_plan(self, plan: PrecisionPlan | None) -> None:
        """Puts ``plan`` in force (a re-plan's, a rollback's or a restore's)."""
        self._plan = plan

    def set_policy(self, policy: PrecisionPolicy | None) -> None:
        """Puts ``policy`` in force with no pending streaks (they were for the policy replaced)."""
        self._plan = None if policy is None else PrecisionPlan(policy, {})

    def defer(self, step: int) -> None:
        """Notes that the re-plan due at ``step`` waits for a background compile (the first
        such step is kept)."""
        if self._due_at is None:
            self._due_at = step

    def take_due(self, step: int) -> int:
        """The step the re-plan now running came due at (a deferred one's, else ``step``)."""
        due = step if self._due_at is None else self._due_at
        self._due_at = None
        return due

    def start_replan(self, step: int, *, compiling: bool, for_memory: bool) -> int | None:
        """Whether a re-plan asked for at ``step`` runs now: the step it came due at, or None.

        It does not run while a background compile waits to be taken (a scheduled re-plan is
        then deferred until that compile is taken; one for memory is not: the shrink goes on),
        nor, unless for memory, while a speed trial waits for its verdict.

        Args:
          step: the step count now.
          compiling: whether a background compile waits to be taken.
          for_memory: whether memory pressure asks for the re-plan.

        Returns:
          The step the re-plan came due at (a deferred one's, else ``step``), or None.
        """
        if compiling:
            if not for_memory:
                self.defer(step)
            return None
        if self._trial is not None and not for_memory:
            return None  # the trial's verdict comes first (only the speed rule starts trials)
        return self.take_due(step)

    def switch(self, plan: PrecisionPlan, *, trial_at: tuple[int, int] | None = None) -> None:
        """Puts a re-plan's ``plan`` in force (or the plan a failed trial goes back to); with
        ``trial_at`` ``(micro, num_micro)`` its policy goes on a speed trial there, against the
        policy it replaces."""
        if trial_at is not None:
            self.start_trial(self._plan, plan, *trial_at)
        self._plan = plan

    def call_off(self) -> None:
        """Forgets a trial and a waiting re-plan (``set_policy`` and a restore set the policy
        themselves)."""
        self._trial, self._due_at = None, None

    def start_trial(
        self, previous: PrecisionPlan | None, plan: PrecisionPlan, micro: int, num_micro: int
    ) -> None:
        """Starts timing ``plan``'s policy against ``previous`` (in force before it) at
        ``micro`` x ``num_micro``."""
        self._trial = precision_speed.PolicyTrial(
            previous, signature_of(previous), signature_of(plan), micro, num_micro
        )

    def time_trial(self, key: tuple[int, int, str], samples: int, seconds: float) -> None:
        """Counts a step of ``samples`` in ``seconds`` at ``key`` towards the trial when it ran
        the trial's policy at the trial's batch."""
        trial = self._trial
        if trial is not None and (trial.micro, trial.num_micro, trial.signature) == key:
            self._trial = trial.add(samples, seconds)

    def judge_trial(
        self,
        *,
        micro: int,
        min_steps: int,
        margin: float,
        rate: Callable[[tuple[int, int, str]], float | None],
    ) -> tuple[precision_speed.PolicyTrial, precision_speed.TrialVerdict] | None:
        """Ends the trial when it has run ``min_steps`` steps or the bucket moved off its batch
        (``micro`` is the bucket in force), with :func:`._precision_speed.judge_trial`'s verdict.

        Args:
          micro: the bucket in force.
          min_steps: timed steps a trial runs before it is judged (``check_every``).
          margin: the speed-up a lower precision must show.
          rate: the measured samples per second at a key (the incumbent's).

        Returns:
          ``(trial, verdict)`` when the trial ended with a verdict, else None (no trial, a trial
          left behind by a policy change, or one still running).
        """
        trial = self._trial
        if trial is None:
            return None
        if self.signature != trial.signature:
            self._trial = None  # a rollback, set_policy or a load left the trial's policy
            return None
        moved = micro != trial.micro
        if trial.steps < min_steps and not moved:
            return None
        incumbent = None
        if not moved:
            incumbent = rate((trial.micro, trial.num_micro, trial.previous_signature))
        # Every host keeps or leaves the trial alike: each rate is the slowest process's.
        trial_rate, incumbent = agreement.agree_on_rates([trial.rate, incumbent])
        if trial_rate is not None and trial.rate is not None:
            trial = trial._replace(seconds=trial.samples / trial_rate)
        verdict = precision_speed.judge_trial(trial, incumbent, margin)
        self._trial = None
        if not verdict.keep and incumbent is not None:
            self._lower_is_slower = True
        return trial, verdict

    def saved_state(self) -> PrecisionScheduleState:
        """The schedule's saved state (:meth:`state_dict` encodes it)."""
        plan = self._plan
        return PrecisionScheduleState(
            policy=None if plan is None else plan.policy,
            pending={} if plan is None else dict(plan.pending),
        )

    def load_saved_state(self, saved: PrecisionScheduleState) -> None:
        """Continues from :meth:`saved_state`'s output; a saved state without a policy keeps the
        plan in force. A trial or waiting re-plan is called off."""
        if saved.policy is not None:
            self._plan = PrecisionPlan(saved.policy, dict(saved.pending))
        self.call_off()

    def state_dict(self) -> dict[str, Any]:
        """The policy in force (its JSON document, or None) and the planner's pending streaks
        ``{path: [compute dtype, count]}``, JSON-ready."""
        return state_record.encode(self.saved_state())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from :meth:`state_dict`'s output (see :meth:`load_saved_state`).

        Raises:
          ValueError: the state is malformed (the field named); nothing is changed then.
        """
        self.load_saved_state(state_record.decode(PrecisionScheduleState, state, "precision"))


@dataclasses.dataclass(frozen=True)
class PrecisionScheduleState:
    """What a :class:`PrecisionSchedule` saves, the ``"precision"`` part of the controller's
    state.

    Attributes:
      policy: the policy in force (saved as its JSON document), or None.
      pending: the planner's pending streaks ``{path: (compute dtype, count)}``.
    """

    policy: PrecisionPolicy | None
    pending: dict[str, tuple[str, int]]
