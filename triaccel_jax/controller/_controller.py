"""``Controller``: the host-side loop that adapts batch size and precision (docs/design.md §5).

Plain Python around pure jitted functions, and a thin orchestrator over parts with one job each:
its settings (:mod:`._config`), the data (:mod:`._feeding`), the compiled steps (:mod:`._compile_cache`),
the learning rate (:mod:`._learning_rate`), the out-of-memory retry (:mod:`._out_of_memory`), the
re-plan (:mod:`._replan`) and the state record (:mod:`._state_record`). Each decision is a pure
function of measured figures (:func:`triaccel_jax.controller.decide_bucket`,
:func:`triaccel_jax.plan_precision`); the parts return decisions and figures, and only the
controller logs them, as :class:`triaccel_jax.controller.Event` records.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from triaccel_jax._src import arrays
from triaccel_jax._src import validation
from triaccel_jax.controller import _agreement as agreement
from triaccel_jax.controller import _buckets as buckets_lib
from triaccel_jax.controller import _compile_cache as compile_cache
from triaccel_jax.controller import _config as config_lib
from triaccel_jax.controller import _events as events_lib
from triaccel_jax.controller import _feeding as feeding
from triaccel_jax.controller import _learning_rate as learning_rate
from triaccel_jax.controller import _memory_probe as memory_probe
from triaccel_jax.controller import _out_of_memory as out_of_memory
from triaccel_jax.controller import _replan as replan_lib
from triaccel_jax.controller import _sampler as sampler_lib
from triaccel_jax.controller import _state_record as state_record
from triaccel_jax.controller import _train_step as train_step
from triaccel_jax.precision import _planner as planner
from triaccel_jax.precision import _policy as policy_lib
from triaccel_jax.transforms import _loss_scaling as loss_scaling_lib
from triaccel_jax.transforms import _signals as signals_lib
from triaccel_jax.transforms import _state_conversion as state_conversion

# Re-exported from here for code that imported them from this module.
OutOfMemoryError = out_of_memory.OutOfMemoryError
StepInfo = events_lib.StepInfo
is_out_of_memory = out_of_memory.is_out_of_memory
_SETTINGS = frozenset(f.name for f in dataclasses.fields(config_lib.ControllerConfig))


def _make_config(config: Any, settings: Mapping[str, Any]) -> config_lib.ControllerConfig:
    """The settings from ``config=`` or from keywords (not both), or a clear error."""
    unknown = sorted(set(settings) - _SETTINGS)
    if unknown:
        raise TypeError(f"Controller got unexpected keyword arguments {unknown}")
    if config is None:
        return config_lib.ControllerConfig(**settings)
    if not isinstance(config, config_lib.ControllerConfig):
        raise TypeError(f"`config` must be a ControllerConfig, got {type(config).__name__}")
    if settings:
        raise TypeError(
            f"pass the settings in `config` or as keywords, not both: {sorted(settings)}"
        )
    return config


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
      loss_fn: ``loss_fn(params, batch, *, policy, rng)`` returning the mean loss over ``batch``
        (or ``(loss, aux)`` with ``has_aux``, ``aux`` a dict of scalar metrics). With
        ``model_state`` it is also given ``model_state=`` and must return
        ``(loss, aux)`` with ``aux["model_state"]`` the updated model state (e.g. BatchNorm
        statistics). ``policy`` is the precision policy in force (None when precision is not
        planned); ``rng`` a fresh key per step and micro-batch.
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
      params, opt_state, model_state: the training state after the last step.
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
        self.config = config = _make_config(config, settings)
        if callback is not None:
            validation.check_callable("callback", callback)
        self._feeder = feeding.BatchFeeder(data, config.num_examples, mesh, config.data_axis)
        layout = config.layout(self._feeder.multiple)
        self.buckets, self._micro, self._global = layout.buckets, layout.start, layout.global_batch
        self._keep_global = config.keep_global_batch
        self.sampler = sampler_lib.ElasticSampler(self._feeder.num_examples, seed=config.seed)
        self._seed, self._base_key = config.seed, jax.random.key(config.seed)

        self.tx = tx
        self.params = self._place(params)
        self.opt_state = self._place(tx.init(self.params) if opt_state is None else opt_state)
        self.model_state = self._place(model_state)
        self._loss_scaling = loss_scaling_lib.LossScaling(**config.loss_scaling)
        self.loss_scale = self._place(self._loss_scaling.init())
        self._loss = train_step.normalize_loss_fn(
            loss_fn, has_aux=config.has_aux, has_model_state=model_state is not None
        )
        self._start_plan(policy)
        self._lr = learning_rate.LearningRateScaling(
            self.opt_state, config.lr_hyperparam, config.lr_scaling, layout.reference_batch
        )
        self.probe = memory_probe.default_memory_probe() if probe is None else probe
        if not callable(getattr(self.probe, "read", None)):
            raise TypeError("`probe` must have a read(*, batch_size) method (a MemoryProbe)")
        if callable(getattr(self.probe, "reset", None)):
            self.probe.reset()  # a probe used before: its earlier peaks are not this run's
        self._callback = callback

        self.step_count = 0
        self._ceiling: int | None = None
        self._grow_streak = self._shrink_streak = 0
        self._measured: dict[int, int] = {}
        self._limit: int | None = None
        self._last_loss: float | None = None
        self._compiled = compile_cache.CompileCache()
        self.events: list[events_lib.Event] = []
        self._train_state: tuple[Any, int] | None = None
        self.timings = {"step": 0.0, "compile": 0.0, "data": 0.0, "control": 0.0}
        self._check_loss_structure()
        self._log("start", None, self.batch_size, "controller created", buckets=list(self.buckets))
        self._set_learning_rate()

    def _start_plan(self, policy: policy_lib.PrecisionPolicy | None) -> None:
        """The starting plan: ``policy`` (all fp32 when re-planning), the moments converted."""
        if self.config.replan_every is not None:
            signals_lib.signals(
                self.opt_state
            )  # raises, naming the problem, without triaccel state
            policy = policy or policy_lib.PrecisionPolicy.uniform(self.params)
        self.plan: planner.PrecisionPlan | None = None
        self.set_policy(policy)

    # -- public ---------------------------------------------------------------------------------

    @classmethod
    def from_train_state(
        cls, loss_fn: Callable[..., Any], state: Any, data: Any, **kwargs: Any
    ) -> Controller:
        """A controller that trains a Flax train state; :attr:`train_state` gives it back.

        Args:
          loss_fn: as for :class:`Controller`; with a state that has ``batch_stats`` (e.g.
            :class:`triaccel_jax.flax.TrainState`), the loss gets them as ``model_state=``.
          state: a ``flax.training.train_state.TrainState`` or
            :class:`triaccel_jax.flax.TrainState` (whose ``policy`` becomes the starting policy,
            and whose loss scale and its rule the controller continues with).
          data: as for :class:`Controller`.
          **kwargs: the other arguments of :class:`Controller`.

        Returns:
          The controller.

        Example:
          >>> import jax, jax.numpy as jnp, numpy as np, flax.linen as nn
          >>> import triaccel_jax
          >>> from triaccel_jax.flax import TrainState
          >>> x = np.random.default_rng(0).normal(size=(128, 3)).astype(np.float32)
          >>> model = nn.Dense(1)
          >>> state = TrainState.create(
          ...     apply_fn=model.apply,
          ...     tx=triaccel_jax.triaccel(0.05),
          ...     params=model.init(jax.random.key(0), x)["params"],
          ... )
          >>> def loss_fn(params, batch, *, policy, rng):
          ...     return jnp.mean((state.apply_fn({"params": params}, batch) - 1.0) ** 2)
          >>> controller = triaccel_jax.Controller.from_train_state(
          ...     loss_fn,
          ...     state,
          ...     x,
          ...     min_batch=32,
          ...     max_batch=32,
          ...     probe=triaccel_jax.BudgetMemoryProbe(2**30),
          ... )
          >>> _ = controller.run(5)
          >>> int(controller.train_state.step)
          5
        """
        if "params" in kwargs or "opt_state" in kwargs or "model_state" in kwargs:
            raise TypeError("from_train_state takes params, opt_state and batch_stats from `state`")
        kwargs.setdefault("policy", getattr(state, "policy", None))
        if isinstance(getattr(state, "loss_scaling", None), loss_scaling_lib.LossScaling):
            kwargs.setdefault("loss_scaling", dataclasses.asdict(state.loss_scaling))
        controller = cls(
            loss_fn,
            state.params,
            state.tx,
            data,
            opt_state=state.opt_state,
            model_state=getattr(state, "batch_stats", None),
            **kwargs,
        )
        if getattr(state, "loss_scale", None) is not None:
            controller.loss_scale = controller._place(state.loss_scale)
        controller._train_state = (state, controller.step_count)
        return controller

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
        changes = {
            "step": template.step + (self.step_count - start),
            "params": self.params,
            "opt_state": self._lr.tuned(self.opt_state),
        }
        if getattr(template, "batch_stats", None) is not None:
            changes["batch_stats"] = self.model_state
        if getattr(template, "loss_scale", None) is not None:
            changes["loss_scale"] = self.loss_scale
        state = template.replace(**changes)
        if hasattr(state, "with_policy"):  # triaccel_jax.flax.TrainState: rebuild the copy
            state = state.with_policy(self.policy)
        return state

    @property
    def policy(self) -> policy_lib.PrecisionPolicy | None:
        """The precision policy in force (None when precision is not planned)."""
        return None if self.plan is None else self.plan.policy

    @property
    def batch_size(self) -> int:
        """Samples per step (the global batch)."""
        return self._global if self._keep_global else self._micro

    @property
    def micro_batch(self) -> int:
        """Samples per micro-batch: the batch bucket."""
        return self._micro

    @property
    def compile_count(self) -> int:
        """Steps compiled so far: one per distinct (micro-batch, micro-batches, policy)."""
        return len(self._compiled)

    def step(self) -> StepInfo:
        """Runs one training step (checks and re-plans first when they are due)."""
        start = time.perf_counter()
        spent_before = self.timings["step"] + self.timings["compile"] + self.timings["data"]
        first_event = len(self.events)
        if self.step_count > 0 and self.step_count % self.config.check_every == 0:
            self._check_memory()
        every = self.config.replan_every
        if every and self.step_count > 0 and self.step_count % every == 0:
            self._replan()
        indices = self.sampler.take(self.batch_size)
        metrics = self._run_with_retry(indices)
        self.step_count += 1
        if self._lr.factor != self._lr.factor_for(self.batch_size):
            # An out-of-memory retry shrank the batch: the retried step kept the rate of the
            # samples it trained; the steps from now on train the smaller batch.
            self._set_learning_rate()
        # A non-finite loss is a step the loss scaling skipped: it changed nothing, and the
        # planner's relative budget needs a finite loss, so the last finite one is kept.
        if math.isfinite(metrics["loss"]):
            self._last_loss = metrics["loss"]
        seconds = time.perf_counter() - start
        spent = self.timings["step"] + self.timings["compile"] + self.timings["data"] - spent_before
        self.timings["control"] += seconds - spent
        info = StepInfo(
            self.step_count,
            len(indices),  # the samples this step trained, also when an OOM shrank the bucket
            self._micro,
            metrics["loss"],
            metrics,
            self._known_peaks().get(self._micro),
            self._limit,
            tuple(self.events[first_event:]),
            seconds,
        )
        if self._callback is not None:
            self._callback(info)
        return info

    def run(self, num_steps: int) -> list[StepInfo]:
        """Runs ``num_steps`` steps; returns their :class:`StepInfo`."""
        validation.check_integer("num_steps", num_steps, 0)
        return [self.step() for _ in range(num_steps)]

    def set_policy(self, policy: policy_lib.PrecisionPolicy | None) -> None:
        """Switches the precision policy (the optimizer state's moments are converted).

        The planner's pending streaks start afresh: they were for the policy replaced.

        Raises:
          ValueError: the policy does not cover the params.
        """
        if policy is not None:
            policy_lib.check_policy(policy, self.params)
            if self.config.replan_every is not None:
                self.opt_state = self._place(state_conversion.convert_state(self.opt_state, policy))
        if policy != self.policy:
            self._measured = {}  # measured peaks were for the old policy
        self.plan = None if policy is None else planner.PrecisionPlan(policy, {})

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

        It holds the bucket, ceiling, hysteresis counters, memory figures, policy and the
        planner's pending streaks, learning-rate factor, step counter and the sampler's cursor;
        the per-step ``rng`` is derived from ``seed`` and the step, so a controller restored with
        :meth:`load_state_dict` (and the params and optimizer state of the same step) takes the
        same decisions.
        """
        record = state_record.ControllerRecord(
            step=self.step_count,
            micro_batch=self._micro,
            ceiling=self._ceiling,
            grow_streak=self._grow_streak,
            shrink_streak=self._shrink_streak,
            measured_peaks=dict(self._measured),
            compiled_peaks=self._compiled.peaks_record(),
            limit_bytes=self._limit,
            last_loss=self._last_loss,
            lr_factor=self._lr.factor,
            loss_scale={k: np.asarray(v).item() for k, v in self.loss_scale._asdict().items()},
            policy=self.policy,
            pending=dict(self.plan.pending) if self.plan is not None else {},
            sampler=self.sampler.state_dict(),
        )
        return state_record.to_state_dict(record, self._identity())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from :meth:`state_dict`'s output (same data, seed and buckets).

        Raises:
          ValueError: the state is malformed or was saved by a controller configured differently.
        """
        record = state_record.from_state_dict(state, self._identity())
        self.sampler.load_state_dict(record.sampler)
        self.step_count, self._micro, self._ceiling = (
            record.step,
            record.micro_batch,
            record.ceiling,
        )
        self._grow_streak, self._shrink_streak = record.grow_streak, record.shrink_streak
        self._measured = record.measured_peaks
        self._compiled.load_peaks_record(record.compiled_peaks)
        self._limit, self._last_loss = record.limit_bytes, record.last_loss
        if record.loss_scale is not None:  # absent from states saved before it existed
            self.loss_scale = self._place(
                loss_scaling_lib.LossScaleState(
                    jnp.float32(record.loss_scale["scale"]),
                    jnp.int32(record.loss_scale["good_steps"]),
                    jnp.int32(record.loss_scale["skipped_steps"]),
                )
            )
        if record.policy is not None:
            record.policy.check_matches(self.params)
            self.plan = planner.PrecisionPlan(record.policy, record.pending)
        self._log("restore", None, self.step_count, "controller state loaded")
        self._set_learning_rate()

    # -- decisions --------------------------------------------------------------------------------

    def _known_peaks(self) -> dict[int, int]:
        """Peak bytes per bucket under the current policy: measured by the probe if it measures
        (they include whatever else holds memory), else XLA's compiled analyses. The two are not
        mixed: a linear fit through figures from different sources would be meaningless."""
        if self._measured:
            return dict(self._measured)
        return self._compiled.peaks(self._policy_signature())

    def _fixed_bytes(self) -> int:
        """Bytes of a step's peak that do not grow with the batch, for a one-point prediction.

        A compiled step holds its state twice (inputs and outputs: nothing is donated, so that
        an out-of-memory step leaves the state intact) and one gradient per parameter. Measured
        peaks also include unknown others, so they are extrapolated as proportional to the
        batch, which over-predicts: growth is then cautious, never unsafe.
        """
        if self._measured:
            return 0
        state = arrays.tree_nbytes((self.params, self.opt_state, self.model_state))
        return 2 * state + arrays.tree_nbytes(self.params)

    def _check_memory(self) -> None:
        reading = self.probe.read(batch_size=self._micro)
        peak, limit = agreement.agree_on_memory(reading.peak_bytes, reading.limit_bytes)
        self._limit = limit
        if peak is not None:
            self._measured[self._micro] = peak
        decision = buckets_lib.decide_bucket(
            self._micro,
            self.buckets,
            self._known_peaks(),
            limit,
            target=self.config.target,
            high_water=self.config.high_water,
            patience=self.config.patience,
            ceiling=self._ceiling,
            fixed_bytes=self._fixed_bytes(),
            grow_streak=self._grow_streak,
            shrink_streak=self._shrink_streak,
        )
        self._grow_streak, self._shrink_streak = decision.grow_streak, decision.shrink_streak
        if decision.kind == "keep":
            return
        figures = {"peak_bytes": self._known_peaks().get(self._micro), "limit_bytes": limit}
        if decision.kind == "grow" and self._grow_rejected(decision.bucket, limit):
            return
        self._log(decision.kind, self._micro, decision.bucket, decision.reason, **figures)
        self._micro = decision.bucket
        self._set_learning_rate()

    def _grow_rejected(self, bucket: int, limit: int) -> bool:
        """Compiles ``bucket`` and logs a rejection if its compiled peak is over the high water."""
        self._compiled_step(bucket, self._num_micro(bucket))
        compiled_peak = None if self._measured else self._known_peaks().get(bucket)
        high_water = self.config.high_water
        if compiled_peak is None or compiled_peak <= high_water * limit:
            return False
        self._log(
            "reject",
            self._micro,
            bucket,
            f"compiled peak of bucket {bucket} is {compiled_peak / limit:.0%} of "
            f"the limit, over the high-water mark {high_water:.0%}",
            compiled_peak_bytes=compiled_peak,
            limit_bytes=limit,
        )
        return True

    def _replan(self) -> None:
        result = replan_lib.replan(
            self.opt_state,
            self.params,
            self.plan,
            loss=self._last_loss,
            planner_options=self.config.planner_options,
        )
        if result.changed:
            self._log(
                "replan",
                self.policy.signature,
                result.plan.policy.signature,
                "the planner chose another policy",
                leaves_by_dtype=result.leaves_by_dtype,
                loss=self._last_loss,
            )
            self.opt_state = self._place(result.opt_state)
            self._measured = {}  # measured peaks were for the old policy
        self.plan = result.plan

    def _set_learning_rate(self) -> None:
        change = self._lr.follow(self.opt_state, self.batch_size)
        if change.new != change.old:
            self._log(
                "learning_rate",
                change.old,
                change.new,
                f"{self.config.lr_scaling} scaling for batch {self.batch_size} against reference "
                f"{self._lr.reference}",
            )
        if self._lr.base_lr is not None:
            self.opt_state = self._place(change.opt_state)

    # -- running ----------------------------------------------------------------------------------

    def _num_micro(self, micro: int) -> int:
        """Micro-batches per step at bucket ``micro`` (outside an out-of-memory retry)."""
        return self._global // micro if self._keep_global else 1

    def _policy_signature(self) -> str:
        return "none" if self.policy is None else self.policy.signature

    def _compiled_step(self, micro: int, num_micro: int) -> Any:
        key = (micro, num_micro, self.policy)
        executable = self._compiled.get(key)
        if executable is not None:
            return executable
        scaling = self._loss_scaling if loss_scaling_lib.needs_loss_scaling(self.policy) else None
        if scaling is not None and loss_scaling_lib.holds_loss_scale(self.opt_state):
            raise ValueError(
                f"policy {self._policy_signature()} computes in fp16/fp8, so the controller scales "
                "the loss itself; an optimizer wrapped in dynamic_loss_scale would unscale the "
                "gradients a second time: pass the inner optimizer"
            )
        step = train_step.make_train_step(
            self._loss,
            self.tx,
            policy=self.policy,
            num_micro=num_micro,
            seed=self._seed,
            loss_scaling=scaling,
        )
        state = arrays.abstract_tree((self.params, self.opt_state, self.model_state))
        scalars = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.float32)
        batch = self._feeder.abstract_batch(num_micro, micro)
        args = (*state, batch, *scalars, arrays.abstract_tree(self.loss_scale))
        new = self._compiled.compile(key, step, args)
        if new.peak_bytes is not None and num_micro == self._num_micro(micro):
            self._compiled.record_peak(self._policy_signature(), micro, new.peak_bytes)
        self.timings["compile"] += new.seconds
        self._log(
            "compile",
            None,
            f"{num_micro}x{micro}",
            f"first step with micro-batch {micro} x {num_micro}, policy {self._policy_signature()}",
            compiled_peak_bytes=new.peak_bytes,
            policy=self._policy_signature(),
            seconds=round(new.seconds, 3),
        )
        return new.executable

    def _run_with_retry(self, indices: np.ndarray) -> dict[str, float]:
        tried = []
        while True:
            micro = self._micro
            num_micro = self._num_micro(micro) if self._keep_global else len(indices) // micro
            compiled = self._compiled_step(micro, num_micro)
            start = time.perf_counter()
            batch = self._feeder.device_batch(indices, num_micro, micro)
            self.timings["data"] += time.perf_counter() - start
            start = time.perf_counter()
            try:
                out = compiled(
                    self.params,
                    self.opt_state,
                    self.model_state,
                    batch,
                    np.int32(self.step_count),
                    np.float32(self._lr.update_multiplier()),
                    self.loss_scale,
                )
                metrics = {k: float(v) for k, v in jax.device_get(out.metrics).items()}
            except jax.errors.JaxRuntimeError as error:
                self.timings["step"] += time.perf_counter() - start
                if not is_out_of_memory(error):
                    raise
                tried.append(f"{num_micro}x{micro}")
                self._on_out_of_memory(micro, tried, error)
                continue
            # Replacing the state frees the previous step's buffers, as in any training loop,
            # so it is timed as part of the step, not as the controller's own work.
            self.params, self.opt_state, self.model_state, self.loss_scale = (
                out.params,
                out.opt_state,
                out.model_state,
                out.loss_scale,
            )
            self.timings["step"] += time.perf_counter() - start
            return metrics

    def _on_out_of_memory(self, micro: int, tried: list[str], error: BaseException) -> None:
        decision = out_of_memory.retry_after_out_of_memory(
            micro, self.buckets, self._ceiling, step=self.step_count, tried=tried, error=error
        )
        self._ceiling = decision.ceiling
        self._log("oom", micro, decision.bucket, decision.reason, ceiling=self._ceiling)
        self._micro = decision.bucket
        self._grow_streak = self._shrink_streak = 0

    # -- helpers ----------------------------------------------------------------------------------

    def _place(self, tree: Any) -> Any:
        return self._feeder.place(tree)

    def _check_loss_structure(self) -> None:
        batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((self._micro, *x.shape[1:]), x.dtype),
            self._feeder.sample_spec,
        )
        try:
            jax.eval_shape(
                lambda p, s, b, k: self._loss(p, s, b, self.policy, k),
                self.params,
                self.model_state,
                batch,
                self._base_key,
            )
        except TypeError as error:
            if "loss function" in str(error) or "metric" in str(error):
                raise TypeError(f"`loss_fn` returns the wrong structure: {error}") from None
            raise

    def _log(self, kind: str, old: Any, new: Any, reason: str, **figures: Any) -> None:
        self.events.append(events_lib.Event(self.step_count, kind, old, new, reason, figures))
