"""Growing the batch or re-planning without stalling: the next step compiles in a background thread.

Growing needs the bigger bucket's compiled step, and its compiled peak decides whether the grow
is safe; a new precision policy needs its own step. Compiled synchronously, either compile stalls
training for seconds. Here the decision is logged (``"grow_decided"`` or ``"replan_decided"``),
the step is compiled on a worker thread while the controller keeps stepping on the current
executable, and at the first step after the compile is ready the switch is made:

* a grow checks the compiled peak first: the bucket switches (``"grow"``) or the grow is refused
  (``"reject"``);
* a re-plan converts the optimizer state *as it is then* (it kept training meanwhile) to the new
  policy and switches (``"replan"``).

The compile is the same one the synchronous path runs and is cached under the same key, so the
number of compiles is unchanged (docs/design.md §5 and §8). One job runs at a time: while one is
waiting, further grows are not decided, and a re-plan that comes due waits for it to finish.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any
from typing import NamedTuple

from triaccel_jax.controller import _step_compiler as step_compiler
from triaccel_jax.transforms import _state_conversion as state_conversion


class CompileJob(NamedTuple):
    """A compile running in the background for a decided grow or re-plan.

    Attributes:
      key: the compile cache's key ``(micro-batch, micro-batches, policy)``.
      future: resolves to ``(executable, seconds)``.
      reason: why the switch was decided, for the event log.
      figures: the decision's figures, for the event log.
      plan: the new :class:`triaccel_jax.precision.PrecisionPlan` of a re-plan; None for a grow.
    """

    key: tuple
    future: concurrent.futures.Future
    reason: str
    figures: dict[str, Any]
    plan: Any = None


class BackgroundCompiler:
    """One worker thread and at most one grow waiting for its compile.

    Example:
      >>> from triaccel_jax.controller._background_compile import BackgroundCompiler
      >>> BackgroundCompiler().busy
      False
    """

    def __init__(self) -> None:
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.job: CompileJob | None = None
        self._switch = True
        # The step a re-plan came due at while a compile was waiting (None: none waits); it
        # runs as soon as that compile is done.
        self.replan_due_at: int | None = None

    @property
    def busy(self) -> bool:
        """Whether a grow waits for its compile."""
        return self.job is not None

    def start_grow(self, controller: Any, bucket: int, reason: str, figures: dict) -> None:
        """Logs the decision to grow to ``bucket`` and starts compiling its step."""
        key, step, args = step_compiler.step_to_compile(
            controller, bucket, controller._num_micro(bucket)
        )
        self._submit(
            controller, CompileJob(key, self._compile(controller, step, args), reason, figures)
        )
        controller._log(
            "grow_decided",
            controller._micro,
            bucket,
            f"{reason}; compiling micro-batch {bucket} in the background",
            **figures,
        )

    def start_replan(self, controller: Any, plan: Any, opt_state: Any, figures: dict) -> None:
        """Logs the decision to switch to ``plan``'s policy and starts compiling its step.

        Args:
          controller: the controller.
          plan: the planner's new :class:`triaccel_jax.precision.PrecisionPlan`.
          opt_state: the optimizer state converted to the new policy (its shapes and dtypes are
            what the new step takes).
          figures: the decision's figures, for the event log.
        """
        micro = controller._micro
        key, step, args = step_compiler.step_to_compile(
            controller, micro, controller._num_micro(micro), policy=plan.policy, opt_state=opt_state
        )
        reason = "the planner chose another policy"
        job = CompileJob(key, self._compile(controller, step, args), reason, figures, plan)
        self._submit(controller, job)
        controller._log(
            "replan_decided",
            controller.policy.signature,
            plan.policy.signature,
            f"{reason}; compiling its step in the background",
            **figures,
        )

    def _compile(self, controller: Any, step: Any, args: tuple) -> concurrent.futures.Future:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="triaccel-compile"
            )

        def timed_build():
            start = time.perf_counter()
            return controller._build_step(step, args), time.perf_counter() - start

        return self._executor.submit(timed_build)

    def _submit(self, controller: Any, job: CompileJob) -> None:
        del controller
        self.job = job
        self._switch = True

    def cancel_switch(self) -> None:
        """A grow's compile in flight is kept (cached) but the grow is not taken.

        A re-plan's switch still holds: the new policy does not depend on the batch.
        """
        if self.job is not None and self.job.plan is None:
            self._switch = False

    def poll(self, controller: Any) -> None:
        """At a step's start: when the compile is ready, switches (or refuses a grow).

        A re-plan that came due meanwhile runs next (it may start a compile of its own).
        """
        job = self.job
        if job is None or not job.future.done():
            return
        self.job = None
        self._finish(controller, job)
        if self.replan_due_at is not None:
            controller._replan()

    def _finish(self, controller: Any, job: CompileJob) -> None:
        executable, seconds = job.future.result()  # a failed compile raises here, named by XLA
        step_compiler.keep_compiled(controller, job.key, executable, seconds, background=True)
        if job.plan is not None:
            switch_policy(controller, job.plan, job.reason, job.figures)
            return
        bucket, _, policy = job.key
        if policy != controller.policy or not self._switch or bucket <= controller._micro:
            return  # re-planned or shrunk meanwhile: the decision no longer holds
        compiled = controller._compiled.peaks(controller._policy_signature())
        refused = controller._bucket.over_high_water(bucket, compiled)
        if refused is not None:
            controller._log(
                "reject",
                controller._micro,
                bucket,
                refused,
                compiled_peak_bytes=compiled[bucket],
                limit_bytes=controller._bucket.limit,
            )
            return
        controller._log("grow", controller._micro, bucket, job.reason, **job.figures)
        controller._bucket.micro = bucket
        controller._set_learning_rate()


def switch_policy(
    controller: Any, plan: Any, reason: str, figures: dict, *, opt_state: Any = None
) -> None:
    """Puts ``plan``'s policy in force: the optimizer state converted, a ``"replan"`` logged.

    Args:
      controller: the controller.
      plan: the new :class:`triaccel_jax.precision.PrecisionPlan`.
      reason: why, for the event log.
      figures: the decision's figures, for the event log.
      opt_state: the controller's optimizer state already converted to the new policy; default:
        convert the state in force now.

    The measured peaks are forgotten (they were for the old policy).
    """
    controller._log("replan", controller.policy.signature, plan.policy.signature, reason, **figures)
    if opt_state is None:
        opt_state = state_conversion.convert_state(controller.opt_state, plan.policy)
    controller.opt_state = controller._place(opt_state)
    controller.plan = plan
    controller._bucket.measured = {}
