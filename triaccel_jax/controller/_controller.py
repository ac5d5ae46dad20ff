"""``Controller``: the host-side loop that adapts batch size and precision (docs/design.md §5).

A thin orchestrator over parts with one job each (settings, feeding, compile cache, step
compiler and runner, memory check, learning rate, out-of-memory retry, re-plan, state record).
Each decision is a pure function of measured figures; the parts return decisions and figures,
and only the controller logs them, as :class:`triaccel_jax.controller.Event` records.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import optax

from triaccel_jax._src import validation
from triaccel_jax.controller import _background_compile as background_compile
from triaccel_jax.controller import _bucket_tracker as bucket_tracker
from triaccel_jax.controller import _compile_cache as compile_cache
from triaccel_jax.controller import _config as config_lib
from triaccel_jax.controller import _events as events_lib
from triaccel_jax.controller import _feeding as feeding
from triaccel_jax.controller import _in_flight as in_flight
from triaccel_jax.controller import _learning_rate as learning_rate
from triaccel_jax.controller import _logging as logging_lib
from triaccel_jax.controller import _memory_check as memory_check
from triaccel_jax.controller import _memory_probe as memory_probe
from triaccel_jax.controller import _out_of_memory as out_of_memory
from triaccel_jax.controller import _replan as replan_lib
from triaccel_jax.controller import _sampler as sampler_lib
from triaccel_jax.controller import _state_record as state_record
from triaccel_jax.controller import _step_compiler as step_compiler
from triaccel_jax.controller import _step_runner as step_runner
from triaccel_jax.controller import _train_state_bridge as bridge
from triaccel_jax import training as train_step
from triaccel_jax.precision import _policy as policy_lib
from triaccel_jax.transforms import _loss_scaling as loss_scaling_lib
from triaccel_jax.transforms import _signals as signals_lib
from triaccel_jax.transforms import _state_conversion as state_conversion

# Re-exported from here for code that imported them from this module.
OutOfMemoryError = out_of_memory.OutOfMemoryError
StepInfo = events_lib.StepInfo
is_out_of_memory = out_of_memory.is_out_of_memory


class Controller:
    """Trains with a batch size that follows free memory and a precision policy that follows curvature.

    A thin orchestrator: each job is a part of its own (the settings, batch feeding, the compile
    cache, learning-rate scaling, the out-of-memory retry, the state record); the controller
    asks them for decisions and is the only one that writes the event log.

    The controller owns the batch bucket, the precision policy, the compile cache and the event
    log. Each :meth:`step` it draws exactly ``batch_size`` samples from an
    :class:`triaccel_jax.controller.ElasticSampler`, runs the step compiled for (micro-batch, policy), and

    * every ``check_every`` steps reads the memory probe and grows or shrinks the batch bucket
      (:func:`triaccel_jax.controller.decide_bucket`);
    * on ``RESOURCE_EXHAUSTED`` marks the bucket as a ceiling and re-runs the *same samples* as
      accumulated micro-batches of the next smaller bucket, so no sample is lost or repeated and
      the update is the big batch's (to float rounding); at ``min_batch`` it raises
      :class:`triaccel_jax.OutOfMemoryError`;
    * every ``replan_every`` steps re-plans the precision policy from
      :func:`triaccel_jax.signals` and converts the optimizer state when the policy changes;
    * while the policy computes any leaf in fp16 or fp8, scales the loss dynamically: the
      optimizer (and its curvature estimator) gets the gradients unscaled in float32, and a step
      with a non-finite gradient changes nothing, backs the scale off and reports
      ``metrics["skipped"] == 1`` (the scale is kept across steps, policies and checkpoints).

    Args:
      loss_fn: ``loss_fn(params, batch)`` returning the mean loss over ``batch`` (or
        ``(loss, aux)`` with ``has_aux``, ``aux`` a dict of scalar metrics). It is also given
        ``policy=`` (the precision policy in force, None when precision is not planned) and
        ``rng=`` (a fresh key per step and micro-batch) when its signature takes them; a loss
        without ``policy`` gets the params already cast to the policy's compute dtypes. With
        ``model_state`` it must take ``model_state=`` and return ``(loss, aux)`` with
        ``aux["model_state"]`` the updated model state (e.g. BatchNorm statistics). The
        signature is checked here; a TypeError lists the accepted forms.
      params: the parameters.
      tx: the optimizer.
      data: a pytree of arrays with the samples on the leading axis (e.g.
        ``(images, labels)``), or a callable ``indices -> batch`` with ``num_examples`` given.
      opt_state: the optimizer state; default ``tx.init(params)``.
      model_state: non-trained state the loss updates (see ``loss_fn``).
      probe: the memory probe; default :func:`triaccel_jax.controller.default_memory_probe`.
      policy: the starting precision policy (default all fp32 when re-planning).
      mesh: a ``jax.sharding.Mesh`` for data parallelism: batches are sharded over
        ``data_axis``, whose size every bucket is a multiple of; params and states not already
        on the mesh are replicated.
      callback: called with a :class:`StepInfo` after every step (e.g. a progress bar).
      config: the settings (every keyword above but the optimizer, params, data, state, probe,
        policy, mesh and callback) as one :class:`triaccel_jax.controller.ControllerConfig`,
        instead of as keywords.
      **settings: the settings, as keywords; each is described in
        :class:`triaccel_jax.controller.ControllerConfig` (``min_batch``, ``max_batch``,
        ``batch_size``, ``target``, ``check_every``, ``replan_every``, ``lr_scaling``, ``seed``, ...).

    Attributes:
      params: the parameters after the last step.
      opt_state: the optimizer state after the last step.
      model_state: the non-trained state (e.g. BatchNorm statistics) after the last step.
      loss_scale: the dynamic loss scale's state (``scale``, ``good_steps``,
        ``skipped_steps``), updated only by steps that scale the loss.
      policy: the precision policy in force (None when precision is not planned).
      plan: the :class:`triaccel_jax.precision.PrecisionPlan` in force: the policy and the
        planner's hysteresis streaks (None when there is no policy).
      config: the :class:`triaccel_jax.controller.ControllerConfig`.
      buckets: the allowed micro-batch sizes.
      sampler: the :class:`triaccel_jax.controller.ElasticSampler` the batches come from.
      events: the :class:`triaccel_jax.controller.Event` log.
      step_count: steps completed.
      timings: seconds spent running compiled steps (``"step"``, waiting for the device
        included), compiling (``"compile"``), gathering batches (``"data"``) and in the
        controller's own decisions and bookkeeping (``"control"``).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import triaccel_jax
      >>> x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
      >>> y = x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)
      >>> def loss_fn(params, batch, *, policy, rng):
      ...     inputs, targets = batch
      ...     return jnp.mean((inputs @ params["w"] - targets) ** 2)
      >>> controller = triaccel_jax.Controller(
      ...     loss_fn,
      ...     {"w": jnp.zeros(4)},
      ...     triaccel_jax.triaccel(0.05),
      ...     (x, y),
      ...     min_batch=16,
      ...     max_batch=64,
      ...     probe=triaccel_jax.BudgetMemoryProbe(2**30),
      ...     check_every=5,
      ... )
      >>> infos = controller.run(60)
      >>> controller.batch_size, infos[-1].loss < 0.1
      (64, True)

    References:
      docs/design.md §5; Lightning's batch-size finder; Qiao et al., 2021, "Pollux"; Li et al., 2021,
      "EasyScale" (a constant global batch keeps the optimisation unchanged).
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        params: Any,
        tx: optax.GradientTransformation,
        data: Any,
        *,
        opt_state: Any = None,
        model_state: Any = None,
        probe: memory_probe.MemoryProbe | None = None,
        policy: policy_lib.PrecisionPolicy | None = None,
        mesh: jax.sharding.Mesh | None = None,
        callback: Callable[[StepInfo], None] | None = None,
        config: config_lib.ControllerConfig | None = None,
        **settings: Any,
    ) -> None:
        validation.check_callable("loss_fn", loss_fn)
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(
                f"`tx` must be an optax.GradientTransformation, got {type(tx).__name__}"
            )
        self.config = config = config_lib.resolve_config(config, settings)
        if callback is not None:
            validation.check_callable("callback", callback)
        self._feeder = feeding.BatchFeeder(data, config.num_examples, mesh, config.data_axis)
        layout = config.layout(self._feeder.multiple)
        self.buckets, self._global = layout.buckets, layout.global_batch
        self._bucket = bucket_tracker.BucketTracker(
            layout.buckets,
            layout.start,
            target=config.target,
            high_water=config.high_water,
            patience=config.patience,
        )
        self._keep_global = config.keep_global_batch
        self.sampler = sampler_lib.ElasticSampler(self._feeder.num_examples, seed=config.seed)
        self._seed = config.seed

        self.tx = tx
        self.params = self._place(params)
        self.opt_state = self._place(tx.init(self.params) if opt_state is None else opt_state)
        self.model_state = self._place(model_state)
        # An optimizer that fused_update=True cannot fuse is refused here, not at the first step.
        step_compiler.fused_step(config.fused_update, tx, self.opt_state)
        self._loss_scaling = loss_scaling_lib.LossScaling(**config.loss_scaling)
        self.loss_scale = self._place(self._loss_scaling.init())
        self._loss = train_step.normalize_loss_fn(
            loss_fn, has_aux=config.has_aux, has_model_state=model_state is not None
        )
        self._start_plan(policy)
        self._lr = learning_rate.LearningRateScaling(
            self.opt_state, config.lr_hyperparam, config.lr_scaling, layout.reference_batch
        )
        self.probe = memory_probe.prepare_probe(probe)
        self._callback = logging_lib.logging_callback(callback)  # logs each step at DEBUG

        self.step_count = 0
        self._last_loss: float | None = None
        self._compiled = compile_cache.CompileCache()
        self.events: list[events_lib.Event] = []
        self._train_state: tuple[Any, int] | None = None
        self._in_flight = in_flight.InFlight()
        self._background = background_compile.BackgroundCompiler()
        self.timings = {"step": 0.0, "compile": 0.0, "data": 0.0, "control": 0.0}
        self._check_loss_structure()
        self._log(
            "start",
            None,
            self.batch_size,
            f"controller created; {self._lr.rule()}",
            buckets=list(self.buckets),
            lr_rule=config.lr_scaling,
            reference_batch=self._lr.reference,
            tuned_learning_rate=self._lr.base_lr,
        )
        self._set_learning_rate()

    def _start_plan(self, policy: policy_lib.PrecisionPolicy | None) -> None:
        """The starting plan: ``policy`` (all fp32 when re-planning), the moments converted."""
        if self.config.replan_every is not None:
            # Raises, naming the problem, when the optimizer holds no triaccel state.
            signals_lib.signals(self.opt_state)
            policy = policy or policy_lib.PrecisionPolicy.uniform(self.params)
        self.plan: policy_lib.PrecisionPlan | None = None
        self.set_policy(policy)

    # -- public ---------------------------------------------------------------------------------

    @classmethod
    def from_train_state(
        cls, loss_fn: Callable[..., Any], state: Any, data: Any, **kwargs: Any
    ) -> Controller:
        """A controller that trains a Flax train state; :attr:`train_state` gives it back.

        The state's params, optimizer state, ``batch_stats`` (given to the loss as
        ``model_state=``), policy and loss scale are the controller's starting point; see
        :func:`triaccel_jax.controller._train_state_bridge.controller_from_train_state` for
        the arguments and an example.
        """
        return bridge.controller_from_train_state(cls, loss_fn, state, data, **kwargs)

    @property
    def train_state(self) -> Any:
        """The train state given to :meth:`from_train_state`, advanced to the current step.

        An injected learning rate in its optimizer state is the tuned (reference-batch) rate:
        the controller's batch scaling is its own and is applied again by whoever trains next,
        so that round trips do not compound it.
        """
        if self._train_state is None:
            raise AttributeError("this controller was not made with Controller.from_train_state")
        template, start = self._train_state
        in_flight.flush(self)
        return bridge.train_state_of(self, template, start, self._lr.tuned(self.opt_state))

    @property
    def policy(self) -> policy_lib.PrecisionPolicy | None:
        """The precision policy in force (None when precision is not planned)."""
        return None if self.plan is None else self.plan.policy

    @property
    def batch_size(self) -> int:
        """Samples per step (the global batch)."""
        if self._keep_global:
            assert self._global is not None  # the layout has a global batch with keep_global
            return self._global
        return self._micro

    @property
    def micro_batch(self) -> int:
        """Samples per micro-batch: the batch bucket."""
        return self._bucket.micro

    @property
    def _micro(self) -> int:
        return self._bucket.micro

    @property
    def compile_count(self) -> int:
        """Steps compiled so far: one per distinct (micro-batch, micro-batches, policy)."""
        return len(self._compiled)

    def step(self) -> StepInfo:
        """Runs one training step (checks and re-plans first when they are due) and reads it."""
        in_flight.flush(self)
        return step_runner.run_step(self)

    def run(self, num_steps: int) -> list[StepInfo]:
        """Runs ``num_steps`` steps; returns their :class:`StepInfo`.

        With ``steps_in_flight`` > 0 (the default), step ``n + 1`` is dispatched before step
        ``n``'s metrics are read, so the device never waits for the host; the callback gets each
        :class:`StepInfo` in order, that many steps late, while the controller's state is the
        last dispatched step's (docs/design.md §8).
        """
        validation.check_integer("num_steps", num_steps, 0)
        if self.config.steps_in_flight == 0:
            return [self.step() for _ in range(num_steps)]
        return in_flight.run_steps(self, num_steps, self.config.steps_in_flight)

    def set_policy(self, policy: policy_lib.PrecisionPolicy | None) -> None:
        """Switches the precision policy (the optimizer state's moments are converted).

        The planner's pending streaks start afresh: they were for the policy replaced.

        Raises:
          ValueError: the policy does not cover the params.
        """
        if policy is not None:
            policy_lib.check_policy(policy, self.params)
            # Only triaccel states hold per-leaf moment dtypes; any other state is kept as is.
            self.opt_state = self._place(state_conversion.convert_state(self.opt_state, policy))
        if policy != self.policy:
            self._bucket.measured = {}  # measured peaks were for the old policy
        self.plan = None if policy is None else policy_lib.PrecisionPlan(policy, {})

    def event_records(self) -> list[dict[str, Any]]:
        """The event log as flat dicts (``pandas.DataFrame(controller.event_records())``)."""
        return events_lib.event_records(self.events)

    def _identity(self) -> dict[str, Any]:
        """What a saved state must share with this controller to be loaded into it."""
        return {
            "seed": self._seed,
            "buckets": list(self.buckets),
            "keep_global_batch": self._keep_global,
        }

    def state_dict(self) -> dict[str, Any]:
        """The controller's own state as JSON-ready data, to save beside params and optimizer state.

        See :func:`triaccel_jax.controller._state_record.controller_state_dict` for what it
        holds; a controller restored with :meth:`load_state_dict` (and the params and optimizer
        state of the same step) takes the same decisions.
        """
        in_flight.flush(self)  # the state of the last step read, params and all
        return state_record.controller_state_dict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from :meth:`state_dict`'s output (same data, seed and buckets).

        Raises:
          ValueError: the state is malformed or was saved by a controller configured differently.
        """
        in_flight.flush(self)
        state_record.load_controller_state(self, state)
        if self._train_state is not None:
            # The train state given to from_train_state is the saved step's: its step counter
            # already counts the steps the record does.
            self._train_state = (self._train_state[0], self.step_count)
        self._log("restore", None, self.step_count, "controller state loaded")
        self._set_learning_rate()

    # -- decisions --------------------------------------------------------------------------------

    def _known_peaks(self) -> dict[int, int]:
        """Peak bytes per bucket under the current policy (see ``BucketTracker.known_peaks``)."""
        return self._bucket.known_peaks(self._compiled.peaks(self._policy_signature()))

    def _check_memory(self) -> None:
        memory_check.check_memory(self)

    def _replan(self) -> None:
        replan_lib.replan_controller(self)

    def _set_learning_rate(self, samples: int | None = None) -> None:
        """Scales the rate for a step of ``samples`` (default: the batch in force).

        Each step trains at the rate of the samples it trains, so a step re-run after an
        out-of-memory error, or queued behind one, keeps its own batch's rate."""
        batch = self.batch_size if samples is None else samples
        if self._lr.is_current(batch):
            return  # every step asks: the state is rewritten only when the rate changes
        change = self._lr.follow(self.opt_state, batch)
        if change.new != change.old:
            figures = {
                "factor": change.new,
                "batch": batch,
                "reference_batch": self._lr.reference,
            }
            old_rate, new_rate = self._lr.rate(change.old), self._lr.rate(change.new)
            if old_rate is not None and new_rate is not None:
                # The rate itself, so that a log reader sees what the optimizer really uses.
                self._log(
                    "learning_rate",
                    old_rate,
                    new_rate,
                    f"{self.config.lr_scaling} rule for batch {batch}: "
                    f"{self._lr.base_lr:.4g} (tuned at reference batch {self._lr.reference}) "
                    f"x {change.new:.4g}",
                    tuned_learning_rate=self._lr.base_lr,
                    **figures,
                )
            else:
                self._log(
                    "update_scale",
                    change.old,
                    change.new,
                    f"{self.config.lr_scaling} rule for batch {batch} against reference "
                    f"batch {self._lr.reference}; the rate is not an injected constant, so the "
                    "update is multiplied instead",
                    **figures,
                )
        if self._lr.base_lr is not None:
            self.opt_state = self._place(change.opt_state)

    # -- running ----------------------------------------------------------------------------------

    def _num_micro(self, micro: int) -> int:
        """Micro-batches per step at bucket ``micro`` (outside an out-of-memory retry)."""
        if self._keep_global:
            assert self._global is not None  # the layout has a global batch with keep_global
            return self._global // micro
        return 1

    def _policy_signature(self) -> str:
        return "none" if self.policy is None else self.policy.signature

    def _compiled_step(self, micro: int, num_micro: int) -> Any:
        """The step compiled for ``micro`` x ``num_micro`` under the policy in force."""
        return step_compiler.compiled_step(self, micro, num_micro)

    def _build_step(self, step: Callable[..., Any], abstract_args: tuple) -> Any:
        return compile_cache.build(step, abstract_args)  # also on the background thread

    def _read_metrics(self, metrics: Any) -> dict[str, float]:
        return step_runner.read_metrics(metrics)

    def _on_out_of_memory(self, micro: int, tried: list[str], error: BaseException) -> None:
        decision = self._bucket.retry_after_out_of_memory(
            micro, step=self.step_count, tried=tried, error=error
        )
        self._log("oom", micro, decision.bucket, decision.reason, ceiling=decision.ceiling)
        self._background.cancel_switch()  # a grow decided before the OOM is not taken

    # -- helpers ----------------------------------------------------------------------------------

    def _place(self, tree: Any) -> Any:
        return self._feeder.place(tree)

    def _check_loss_structure(self) -> None:
        batch = self._feeder.abstract_batch(1, self._micro)
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), batch)
        train_step.check_loss_structure(
            self._loss, self.params, self.model_state, batch, self.policy
        )

    def _log(self, kind: str, old: Any, new: Any, reason: str, **figures: Any) -> None:
        self.events.append(events_lib.Event(self.step_count, kind, old, new, reason, figures))
        logging_lib.log_event(self.events[-1])
