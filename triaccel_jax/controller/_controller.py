"""``Controller``: the host-side loop that adapts batch size and precision (docs/design.md §5).

The controller runs the loop with its in-flight queue, takes the switches (grow, shrink, re-plan,
``set_policy``) at step boundaries, rolls back and retries after an out-of-memory error (one
handler: :meth:`Controller._on_device`), and composes the saved state. Each decision's state
lives in the part that decides, private and changed only by its methods, each with a
``state_dict()`` of its own: :class:`._bucket_tracker.BucketTracker` (the bucket and its memory
figures), :class:`._goodput_tracker.GoodputTracker` (noise scale, throughput, the goodput
streak), :class:`._precision_schedule.PrecisionSchedule` (the plan, speed trials, a waiting
re-plan) and :class:`._learning_rate.LearningRateScaling` (the tuned rate, the batch rule, the
schedule clock); the bucket, goodput and learning-rate parts are built by
:func:`._batch_parts.build_batch_parts`, as :class:`._adaptive_batches.AdaptiveBatches` builds
them. The decisions themselves are pure functions of measured figures
(:mod:`._buckets`, :mod:`._goodput`, :mod:`._out_of_memory`, :func:`._replan.decide_replan`,
:mod:`._precision_speed`): the controller applies them (compiles, converts the optimizer state,
moves the bucket), compiles through :class:`._compiling.StepCompiler` and is the only writer of
the event log. Every time it measures is read from its ``clock``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import time
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Annotated
from typing import Any
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from triaccel_jax import training
from triaccel_jax._src import arrays
from triaccel_jax._src import caller
from triaccel_jax._src import compilation_cache
from triaccel_jax._src import tree as tree_lib
from triaccel_jax._src import validation
from triaccel_jax._src.readonly import ReadOnly
from triaccel_jax.controller import _agreement as agreement
from triaccel_jax.controller import _batch_parts as batch_parts
from triaccel_jax.controller import _buckets as buckets_lib
from triaccel_jax.controller import _compiling as compiling
from triaccel_jax.controller import _config as config_lib
from triaccel_jax.controller import _events as events_lib
from triaccel_jax.controller import _feeding as feeding
from triaccel_jax.controller import _logging as logging_lib
from triaccel_jax.controller import _memory_probe as memory_probe
from triaccel_jax.controller import _out_of_memory as out_of_memory
from triaccel_jax.controller import _precision_schedule as precision_schedule
from triaccel_jax.controller import _replan as replan_lib
from triaccel_jax.controller import _sampler as sampler_lib
from triaccel_jax.controller import _state_record as state_record
from triaccel_jax.controller import _step_records as step_records
from triaccel_jax.controller._bucket_tracker import BucketTrackerState
from triaccel_jax.controller._goodput_tracker import GoodputTrackerState
from triaccel_jax.controller._learning_rate import LearningRateState
from triaccel_jax.policy import PrecisionPlan
from triaccel_jax.policy import PrecisionPolicy
from triaccel_jax.policy import check_policy
from triaccel_jax.transforms import FusedTriAccel
from triaccel_jax.transforms import LossScaleState
from triaccel_jax.transforms import convert_state
from triaccel_jax.transforms import mean_curvatures
from triaccel_jax.transforms import signals
from triaccel_jax.transforms import unfused_reason

StepInfo = events_lib.StepInfo
ControllerCheckpoint = state_record.ControllerCheckpoint
_T = TypeVar("_T")


class Controller:
    """Trains with a batch size that follows free memory and a precision policy that follows curvature.

    The controller owns the batch bucket, the precision policy, the compile cache and the event
    log. Each step it draws exactly ``batch_size`` samples from an
    :class:`triaccel_jax.controller.ElasticSampler`, runs the step compiled for (micro-batch,
    policy), and

    * every ``check_every`` steps reads the memory probe and grows or shrinks the batch bucket
      (:func:`triaccel_jax.controller.decide_bucket`);
    * on ``RESOURCE_EXHAUSTED`` marks the bucket the step ran at as a ceiling and re-runs the
      *same samples* as accumulated micro-batches of the next smaller bucket, so no sample is
      lost or repeated and the update is the big batch's (to float rounding); at ``min_batch`` it
      raises :class:`triaccel_jax.OutOfMemoryError`;
    * every ``replan_every`` steps re-plans the precision policy from
      :func:`triaccel_jax.signals` and converts the optimizer state when the policy changes;
    * while the policy computes any leaf in fp16 or fp8, scales the loss dynamically: the
      optimizer (and its curvature estimator) gets the gradients unscaled in float32, and a step
      with a non-finite gradient changes nothing, backs the scale off and reports
      ``metrics["skipped"] == 1`` (the scale is kept across steps, policies and checkpoints).

    Steps are transactions: everything a step depends on (params, optimizer state, model state,
    loss scale, policy, bucket) is snapshotted before it is dispatched, a switch takes effect at
    a step boundary and belongs to the steps after it, and a step rolled back after a late
    out-of-memory error is restored whole. Each step trains at the rate of the samples it trains,
    and its :class:`StepInfo` tells the micro-batch and rate it really ran at.

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
      loss_scale: the dynamic loss scale's state to continue from; default
        ``loss_scaling.init()``.
      start_step: the steps already trained (e.g. a Flax train state's ``step``): the step
        count starts there, and so do the per-step ``rng`` and the schedule of checks and
        re-plans; default 0.
      probe: the memory probe; default :func:`triaccel_jax.controller.default_memory_probe`.
      policy: the starting precision policy (default all fp32 when re-planning).
      mesh: a ``jax.sharding.Mesh`` for data parallelism: batches are sharded over
        ``data_axis``, whose size every bucket is a multiple of; params and states not already
        on the mesh are replicated.
      callback: called with a :class:`StepInfo` after every step (e.g. a progress bar).
      faults: a fault injector, called with a :class:`triaccel_jax.controller.FaultSite` before
        every dispatch and every read of a step; it may raise an out-of-memory error to
        chaos-test a run (:class:`triaccel_jax.controller.OutOfMemoryFaults`).
      clock: a monotonic clock in seconds that every time the controller measures is read
        from: the steps' seconds (goodput's throughput, a precision trial's speed), the compile
        seconds and :attr:`timings`; default ``time.perf_counter``. Tests pass a virtual clock
        that moves only by the seconds their steps say they take, so that timed decisions are
        exact on a busy machine; a user may pass a monotonic clock of their own. It is an
        argument, not a :class:`~triaccel_jax.controller.ControllerConfig` setting: the config
        is a value, compared and validated as settings, and a clock is an object the controller
        works with, like ``probe``. It is not saved state either: a restored controller times
        its steps on its own clock (throughput is not saved).
      config: the settings as one :class:`triaccel_jax.controller.ControllerConfig`; or
      **settings: the same settings as keywords (not both); each is described in
        :class:`triaccel_jax.controller.ControllerConfig` (``min_batch``, ``max_batch``,
        ``batch_size``, ``target``, ``check_every``, ``replan_every``, ``lr_scaling``, ``seed``, ...).

    Its state is read through read-only properties (:attr:`params`, :attr:`opt_state`,
    :attr:`model_state`, :attr:`loss_scale`, :attr:`policy`, :attr:`plan`, :attr:`step_count`,
    :attr:`events`, ...) and changed only by its methods: :meth:`run`, :meth:`set_policy`,
    :meth:`load_state_dict` and :meth:`restore` (a checkpoint's arrays and state).

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
      ...     batch_rule="memory",  # grow wherever memory allows (the default weighs goodput)
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
        loss_scale: LossScaleState | None = None,
        start_step: int = 0,
        probe: memory_probe.MemoryProbe | None = None,
        policy: PrecisionPolicy | None = None,
        mesh: jax.sharding.Mesh | None = None,
        callback: Callable[[StepInfo], None] | None = None,
        faults: Callable[[out_of_memory.FaultSite], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        config: config_lib.ControllerConfig | None = None,
        **settings: Any,
    ) -> None:
        validation.check_callable("loss_fn", loss_fn)
        validation.check_callable("clock", clock)
        self._clock = clock
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(
                f"`tx` must be an optax.GradientTransformation, got {type(tx).__name__}"
            )
        start_step = validation.check_integer("start_step", start_step, 0)
        self._config = config = config_lib.resolve_config(config, settings)
        if callback is not None:
            validation.check_callable("callback", callback)
        if faults is not None:
            validation.check_callable("faults", faults)
        self._faults = faults
        if config.compilation_cache:
            compilation_cache.enable_by_default()
        self._feeder = feeding.BatchFeeder(data, config.num_examples, mesh, config.data_axis)
        layout = config.layout(self._feeder.multiple)
        self._buckets, self._global = layout.buckets, layout.global_batch
        self._keep_global = config.keep_global_batch
        self._sampler = sampler_lib.ElasticSampler(self._feeder.num_examples, seed=config.seed)
        self._seed = config.seed

        self._tx = tx
        self._params = self._place(params)
        self._opt_state = self._place(tx.init(self._params) if opt_state is None else opt_state)
        self._model_state = self._place(model_state)
        # replan_every="auto": precision is planned when the optimizer holds the signals and no
        # policy was given (a policy given is the user's choice of precision, kept).
        self._config = config = config.with_planning(
            policy is None and _holds_signals(self._opt_state)
        )
        self._bucket, self._lr, self._goodput = batch_parts.build_batch_parts(
            config,
            layout,
            self._opt_state,
            lag=config.steps_in_flight,
            num_examples=self._feeder.num_examples,
        )
        # A fused form that cannot fuse the optimizer is refused here, not at the first step.
        self._fused(self._opt_state)
        if config.noise_estimator == "hessian":
            # Raises, naming the problem, when the optimizer holds no curvature to weight by.
            mean_curvatures(self._opt_state, self._params)
        self._loss_scale = self._place(
            config.loss_scaling.init() if loss_scale is None else loss_scale
        )
        self._loss = training.normalize_loss_fn(
            loss_fn, has_aux=config.has_aux, has_model_state=model_state is not None
        )
        self._in_flight = step_records.InFlight(clock)
        self._compiler = compiling.StepCompiler(self._make_step, clock=clock)
        # XLA:CPU converts bf16 through float32 (the small CNN's bf16 step ran 2x slower, and
        # compiled 3-4x longer): no speed trial there unless asked for.
        speed_trials = (
            config.speed_trials
            if config.speed_trials is not None
            else jax.default_backend() != "cpu"
        )
        self._precision = precision_schedule.PrecisionSchedule(speed_trials=speed_trials)
        self._start_plan(policy)
        self._rescale_said = False  # whether the first rescaling of the rate was warned about
        self._probe = memory_probe.prepare_probe(probe)
        self._callback = logging_lib.logging_callback(callback)  # logs each step at DEBUG

        self._step_count = start_step
        self._last_loss: float | None = None
        self._events: list[events_lib.Event] = []
        self._timings = {"step": 0.0, "compile": 0.0, "data": 0.0, "control": 0.0}
        self._check_loss_structure()
        self._log(
            "start",
            None,
            self.batch_size,
            f"controller created; {self._lr.rule()}",
            buckets=list(self._buckets),
            lr_rule=config.learning_rate_rule,
            reference_batch=self._lr.reference,
            tuned_learning_rate=self._lr.base_lr,
        )
        self._set_learning_rate(self.batch_size)

    def _start_plan(self, policy: PrecisionPolicy | None) -> None:
        """The starting plan: ``policy`` (all fp32 when re-planning), the moments converted."""
        if self._config.replan_every is not None:
            # Raises, naming the problem, when the optimizer holds no triaccel state.
            signals(self._opt_state)
            policy = policy or PrecisionPolicy.uniform(self._params)
        self.set_policy(policy)

    # -- the state, read-only ---------------------------------------------------------------------

    config = ReadOnly[config_lib.ControllerConfig](
        "The :class:`triaccel_jax.controller.ControllerConfig`."
    )

    tx = ReadOnly[optax.GradientTransformation]("The optimizer.")

    params = ReadOnly[Any]("The parameters after the last step dispatched.")

    opt_state = ReadOnly[Any](
        "The optimizer state after the last step dispatched (its injected learning rate, if any, "
        "scaled for the batch in force)."
    )

    @property
    def tuned_opt_state(self) -> Any:
        """:attr:`opt_state` holding the tuned (reference-batch) learning rate instead of the
        batch-scaled one, for handing the state to whoever trains next: they apply their own
        scaling once, so that round trips do not compound it."""
        return self._lr.tuned(self._opt_state)

    model_state = ReadOnly[Any](
        "The non-trained state (e.g. BatchNorm statistics) after the last step dispatched."
    )

    loss_scale = ReadOnly[LossScaleState](
        "The dynamic loss scale's state (``scale``, ``good_steps``, ``skipped_steps``), updated "
        "only by steps that scale the loss."
    )

    @property
    def plan(self) -> PrecisionPlan | None:
        """The :class:`triaccel_jax.policy.PrecisionPlan` in force: the policy and the planner's
        hysteresis streaks (None when there is no policy)."""
        return self._precision.plan

    @property
    def policy(self) -> PrecisionPolicy | None:
        """The precision policy in force (None when precision is not planned)."""
        return self._precision.policy

    buckets = ReadOnly[tuple[int, ...]]("The allowed micro-batch sizes.")

    sampler = ReadOnly[sampler_lib.ElasticSampler](
        "The :class:`triaccel_jax.controller.ElasticSampler` the batches come from."
    )

    probe = ReadOnly[memory_probe.MemoryProbe]("The memory probe.")

    step_count = ReadOnly[int]("Steps completed (counted from ``start_step``).")

    @property
    def events(self) -> list[events_lib.Event]:
        """The :class:`triaccel_jax.controller.Event` log (a copy)."""
        return list(self._events)

    @property
    def timings(self) -> dict[str, float]:
        """Seconds spent running compiled steps (``"step"``, waiting for the device included),
        compiling (``"compile"``), gathering batches (``"data"``) and in the controller's own
        decisions and bookkeeping (``"control"``) (a copy)."""
        return dict(self._timings)

    @property
    def batch_size(self) -> int:
        """Samples per step (the global batch)."""
        if self._keep_global:
            assert self._global is not None  # the layout has a global batch with keep_global
            return self._global
        return self._bucket.micro

    @property
    def micro_batch(self) -> int:
        """Samples per micro-batch: the batch bucket."""
        return self._bucket.micro

    @property
    def compile_count(self) -> int:
        """Steps compiled so far: one per distinct (micro-batch, micro-batches, policy)."""
        return len(self._compiler)

    @property
    def noise_scale(self) -> float | None:
        """The gradient noise scale ``tr(Sigma) / |G|^2`` (McCandlish et al., 2018), averaged
        per sample over ``noise_horizon`` samples; None before the first step that measures it."""
        return self._goodput.noise_scale

    @property
    def noise_interval(self) -> tuple[float, float] | None:
        """The 95% interval of :attr:`noise_scale`, or None before two estimates."""
        return self._goodput.noise_interval

    @property
    def schedule_progress(self) -> float:
        """Training progress in reference-batch steps, after the last step dispatched.

        Each step adds its samples over ``reference_batch`` (``lr_scaling`` ``"sqrt"``,
        ``"linear"`` or ``"none"``), or AdaScale's gain with ``"adascale"`` (its scale-invariant
        iterations). A learning-rate schedule given as the injected rate
        (``optax.inject_hyperparams(opt)(learning_rate=schedule)``) is evaluated at
        ``floor(schedule_progress)`` before each step, so that a schedule tuned at the reference
        batch keeps its meaning in samples when the batch changes. A rolled-back step's
        progress is undone with it; :meth:`state_dict` saves it.
        """
        return self._lr.progress

    @property
    def bytes_per_parameter(self) -> float:
        """The parameters and the optimizer state in force, in bytes per trainable parameter
        (from their dtypes: 12 for AdamW over float32 parameters, about 6 with its state in
        8 bits, :func:`triaccel_jax.quantize_state`)."""
        parameters = sum(
            int(np.prod(leaf.shape))
            for leaf in jax.tree.leaves(self._params)
            if tree_lib.is_trainable(leaf)
        )
        held = arrays.tree_nbytes(self._params) + arrays.tree_nbytes(self._opt_state)
        return held / max(parameters, 1)

    @property
    def throughput(self) -> dict[tuple[int, int, str], float]:
        """Measured samples per second by ``(micro-batch, micro-batches, policy signature)``:
        the samples of the steps timed there over their seconds (sums, not a mean of per-step
        rates), the first step after a move, compiles and out-of-memory retries left out.

        :meth:`state_dict` saves the sums, so a resumed run decides from them as the
        uninterrupted one would; with several processes the decisions use the slowest."""
        return self._goodput.throughput

    @property
    def compile_pending(self) -> bool:
        """Whether a background compile (``compile_in_background``) is still to be taken."""
        return self._compiler.busy

    # -- public -----------------------------------------------------------------------------------

    def wait_for_compile(self) -> bool:
        """Blocks until the background compile in progress (if any) is ready; the switch it
        carries is then made at the next step. Returns whether there was one."""
        return self._compiler.wait()

    def precompile(self, buckets: Sequence[int] | None = None) -> dict[int, int | None]:
        """Compiles the step of each bucket under the policy in force, ahead of training.

        Args:
          buckets: the buckets to compile (default all of :attr:`buckets`).

        Returns:
          ``{bucket: compiled peak bytes}`` (None where XLA reports no figure): what a grow to
          that bucket is checked against.

        Raises:
          ValueError: a bucket is not one of :attr:`buckets`.

        Example:
          >>> import jax.numpy as jnp, numpy as np, triaccel_jax
          >>> controller = triaccel_jax.Controller(
          ...     lambda p, b: jnp.mean((b @ p - 1.0) ** 2),
          ...     jnp.zeros(2),
          ...     triaccel_jax.triaccel(0.05),
          ...     np.ones((64, 2), np.float32),
          ...     min_batch=8,
          ...     max_batch=16,
          ...     probe=triaccel_jax.BudgetMemoryProbe(2**30),
          ... )
          >>> sorted(controller.precompile()), controller.compile_count
          ([8, 16], 2)
        """
        chosen = self.buckets if buckets is None else tuple(buckets)
        unknown = [b for b in chosen if b not in self.buckets]
        if unknown:
            raise ValueError(f"{unknown} are not buckets of this controller: {self.buckets}")
        for bucket in chosen:
            self._executable(bucket, self._num_micro(bucket))
        compiled = self._compiler.peaks(self._precision.signature)
        return {bucket: compiled.get(bucket) for bucket in chosen}

    def step(self) -> StepInfo:
        """Runs one training step and reads it: ``run(1)[0]``."""
        return self.run(1)[0]

    def run(
        self,
        num_steps: int | None = None,
        *,
        epochs: int | None = None,
        evaluate: Callable[[Any, Any], Mapping[str, Any]] | None = None,
        evaluate_every: int | None = None,
    ) -> list[StepInfo]:
        """Runs ``num_steps`` steps, or to the end of ``epochs`` more epochs; returns their
        :class:`StepInfo`.

        With ``steps_in_flight`` > 0 (the default), step ``n + 1`` is dispatched before step
        ``n``'s metrics are read, so the device never waits for the host; the callback gets each
        :class:`StepInfo` in order, that many steps late, while the controller's state is the
        last dispatched step's (docs/design.md §8). Every step is read before it returns.

        Args:
          num_steps: the steps to run (not with ``epochs``).
          epochs: run until ``epochs`` more epochs have ended (from the start of an epoch,
            exactly that many; the sampler serves every sample once an epoch, and the step that
            serves an epoch's last sample may take its rest from the next one).
          evaluate: ``evaluate(params, model_state)`` returning a mapping of metrics (e.g. a
            test accuracy), called with every step before it read: at the end of each epoch, and
            every ``evaluate_every`` steps when given. Each result is an ``"evaluate"`` event
            (its metrics in the figures, with the epoch and the samples seen), so it reaches the
            event log, the logger and a metric writer.
          evaluate_every: steps between evaluations besides the epochs' ends.

        Raises:
          TypeError: neither or both of ``num_steps`` and ``epochs`` given.
          ValueError: ``evaluate_every`` without ``evaluate``, or a count below its minimum.

        Example:
          >>> import jax.numpy as jnp, numpy as np, optax, triaccel_jax
          >>> x = np.random.default_rng(0).normal(size=(256, 2)).astype(np.float32)
          >>> controller = triaccel_jax.Controller(
          ...     lambda p, b: jnp.mean((b @ p - 1.0) ** 2),
          ...     jnp.zeros(2),
          ...     optax.sgd(0.05),
          ...     x,
          ...     min_batch=32,
          ...     max_batch=32,
          ...     probe=triaccel_jax.BudgetMemoryProbe(2**30),
          ... )
          >>> infos = controller.run(
          ...     epochs=2,
          ...     evaluate=lambda params, _: {"loss": float(jnp.mean((x @ params - 1) ** 2))},
          ... )
          >>> len(infos), [e.figures["epoch"] for e in controller.events if e.kind == "evaluate"]
          (16, [1, 2])
        """
        if (num_steps is None) == (epochs is None):
            raise TypeError("run() takes num_steps or epochs=, one of them")
        if evaluate is not None:
            validation.check_callable("evaluate", evaluate)
        if evaluate_every is not None:
            if evaluate is None:
                raise ValueError("`evaluate_every` needs `evaluate`")
            validation.check_integer("evaluate_every", evaluate_every, 1)
        if num_steps is not None:
            validation.check_integer("num_steps", num_steps, 0)
        end = None
        if epochs is not None:
            validation.check_integer("epochs", epochs, 1)
            end = (self._sampler.epoch + epochs) * self._sampler.num_examples
        self._flush()
        self._in_flight.take_finished()
        # A step's seconds run from the previous read: not from before this call.
        self._in_flight.last_finish = self._clock()
        window = self._config.steps_in_flight
        done = 0

        def more() -> bool:
            if end is not None:
                return self._sampler.samples_seen < end
            assert num_steps is not None  # one of the two is given
            return done < num_steps

        while more():
            epoch = self._sampler.epoch
            self._dispatch()
            done += 1
            while len(self._in_flight.pending) > window:
                self._finish_oldest()
            if evaluate is not None and (
                self._sampler.epoch > epoch
                or (evaluate_every is not None and self._step_count % evaluate_every == 0)
            ):
                self._evaluate(evaluate)
        self._flush()
        return self._in_flight.take_finished()

    def _evaluate(self, evaluate: Callable[[Any, Any], Mapping[str, Any]]) -> None:
        """Reads every queued step, then logs ``evaluate``'s metrics of the state after them."""
        self._flush()
        start = self._clock()
        metrics = evaluate(self._params, self._model_state)
        if not isinstance(metrics, Mapping):
            raise TypeError(
                f"`evaluate` must return a mapping of metrics, got {type(metrics).__name__}"
            )
        figures = {str(k): v for k, v in jax.device_get(dict(metrics)).items()}
        seen = self._sampler.samples_seen
        self._log(
            "evaluate",
            None,
            None,
            f"evaluated after {seen} samples ({seen / self._sampler.num_examples:.3g} epochs)",
            epoch=seen // self._sampler.num_examples,
            samples=seen,
            seconds=self._clock() - start,
            **figures,
        )
        # The evaluation's time is no step's: the next step's seconds start after it.
        self._in_flight.last_finish = self._clock()

    def set_policy(self, policy: PrecisionPolicy | None) -> None:
        """Switches the precision policy from the next step (the optimizer state's moments are
        converted to its state dtypes).

        The planner's pending streaks start afresh: they were for the policy replaced.

        A re-plan compiling in the background is called off: the policy set here is the one in
        force until the next re-plan.

        Raises:
          ValueError: the policy does not cover the params, or is None while precision is
            re-planned (``replan_every``).
        """
        if policy is not None:
            check_policy(policy, self._params)
        elif self._config.replan_every is not None:
            raise ValueError(
                "set_policy(None) while precision is re-planned (replan_every="
                f"{self._config.replan_every}): the planner needs a policy to start from; pass "
                "PrecisionPolicy.uniform(params) for all fp32"
            )
        self._flush()  # the switch belongs to the steps after it
        self._call_off_background()
        if policy is not None:
            # Only triaccel states hold per-leaf moment dtypes; any other state is kept as is.
            self._opt_state = self._place(convert_state(self._opt_state, policy))
        if policy != self.policy:
            self._bucket.forget_measured()  # measured peaks were for the old policy
        self._precision.set_policy(policy)

    def event_records(self) -> list[dict[str, Any]]:
        """The event log as flat dicts (``pandas.DataFrame(controller.event_records())``)."""
        return events_lib.event_records(self._events)

    def state_dict(self) -> dict[str, Any]:
        """The controller's own state as JSON-ready data, to save beside params and optimizer state.

        It holds the step counter, the last loss, the loss scale, the sampler's cursor and the
        compiled peaks, and the state of each part that decides: ``"bucket"`` (the bucket,
        ceiling, hysteresis counters and memory figures), ``"goodput"`` (the noise estimates,
        the recent ones AdaScale's gain comes from, and the goodput streak), ``"precision"``
        (the policy and the planner's pending streaks) and ``"learning_rate"`` (the tuned rate,
        the factor and the schedule progress). The per-step ``rng`` is derived from ``seed``
        and the step, so it is not saved; nor is throughput, a measurement of this machine. A
        controller restored with :meth:`load_state_dict` (and the params and optimizer state of
        the same step) takes the same decisions.
        """
        return state_record.to_state_dict(self._saved_state(), self._identity())

    def _saved_state(self) -> ControllerState:
        """The controller's saved state, less the envelope :meth:`state_dict` puts it in."""
        self._flush()  # the state of the last step read, params and all
        return ControllerState(
            step=self._step_count,
            last_loss=self._last_loss,
            loss_scale=LossScaleRecord.of(self._loss_scale),
            sampler=self._sampler.saved_state(),
            compiled_peaks=self._compiler.peaks_record(),
            bucket=self._bucket.saved_state(),
            goodput=self._goodput.saved_state(),
            precision=self._precision.saved_state(),
            learning_rate=self._lr.saved_state(),
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from :meth:`state_dict`'s output (same data, seed and buckets), with the
        params and optimizer state in force.

        Raises:
          ValueError: the state is malformed or was saved by a controller configured differently;
            nothing is changed then.
        """
        self._load(state, None)

    def checkpoint_state(self) -> ControllerCheckpoint:
        """What a checkpoint of this controller holds: the step, the training arrays, the policy
        and :meth:`state_dict` (the steps in flight read first).

        Example:
          >>> import jax.numpy as jnp, numpy as np, triaccel_jax
          >>> loss = lambda p, b: jnp.mean((b @ p - 1.0) ** 2)
          >>> data, tx = np.ones((64, 2), np.float32), triaccel_jax.triaccel(0.05)
          >>> settings = dict(min_batch=8, max_batch=8, probe=triaccel_jax.BudgetMemoryProbe(2**30))
          >>> controller = triaccel_jax.Controller(loss, jnp.zeros(2), tx, data, **settings)
          >>> _ = controller.run(3)
          >>> checkpoint = controller.checkpoint_state()
          >>> checkpoint.step, sorted(checkpoint.arrays), checkpoint.state["step"]
          (3, ['model_state', 'opt_state', 'params'], 3)
        """
        state = self.state_dict()
        arrays = {
            "params": self._params,
            "opt_state": self._opt_state,
            "model_state": self._model_state,
        }
        return ControllerCheckpoint(self._step_count, arrays, self.policy, state)

    def restore(self, arrays: Mapping[str, Any], state: Mapping[str, Any]) -> None:
        """Continues from a checkpoint: ``arrays`` as :meth:`checkpoint_state` gives them
        (``params``, ``opt_state``, ``model_state``) and ``state`` from :meth:`state_dict`.

        Raises:
          ValueError: ``arrays`` lacks one of its three entries or does not have the structure
            of the controller's, or ``state`` is malformed or was saved by a controller
            configured differently; nothing is changed then.
        """
        missing = sorted({"params", "opt_state", "model_state"} - set(arrays))
        if missing:
            raise ValueError(f"restore: `arrays` has no {missing}")
        for name, mine in (("params", self._params), ("model_state", self._model_state)):
            given: Any = jax.tree.structure(arrays[name])  # a jaxlib PyTreeDef: no stubs
            if given != jax.tree.structure(mine):
                raise ValueError(
                    f"restore: `arrays[{name!r}]` has the structure {given}, this controller's "
                    f"is {jax.tree.structure(mine)}"
                )
        self._load(state, arrays)

    def _load(self, state: Mapping[str, Any], arrays: Mapping[str, Any] | None) -> None:
        """Loads ``state`` (and ``arrays``, when given): every part reads its own fields into a
        copy of itself, and the copies are taken only when all of them have read theirs."""
        self._flush()
        fields = state_record.from_state_dict(state, self._identity())
        saved = state_record.decode(ControllerState, fields, "")
        loss_scale = self._place(saved.loss_scale.loss_scale_state())
        # Copies take the saved fields; the controller takes them once all have checked theirs.
        bucket, goodput_part = copy.copy(self._bucket), copy.copy(self._goodput)
        precision, lr = copy.copy(self._precision), copy.copy(self._lr)
        bucket.load_saved_state(saved.bucket)
        goodput_part.load_saved_state(saved.goodput)
        precision.load_saved_state(saved.precision)
        lr.load_saved_state(saved.learning_rate)
        params = self._params if arrays is None else self._place(arrays["params"])
        opt_state = self._opt_state if arrays is None else arrays["opt_state"]
        policy = precision.policy
        if policy is not None:
            policy.check_matches(params)
            # Moments not in the saved policy's dtypes are converted to them (a no-op for a
            # checkpoint's, saved under that policy).
            opt_state = convert_state(opt_state, policy)
        opt_state = self._place(opt_state)
        # Everything is read and checked (the sampler checks its own state before taking it):
        # nothing below raises.
        self._sampler.load_saved_state(saved.sampler)
        self._compiler.load_peaks_record(saved.compiled_peaks)
        self._call_off_background()
        self._bucket, self._goodput, self._precision, self._lr = bucket, goodput_part, precision, lr
        self._step_count, self._last_loss = saved.step, saved.last_loss
        self._params, self._opt_state, self._loss_scale = params, opt_state, loss_scale
        if arrays is not None:
            self._model_state = self._place(arrays["model_state"])
        self._log("restore", None, self._step_count, "controller state loaded")
        self._set_learning_rate(self.batch_size)

    def _identity(self) -> dict[str, Any]:
        """What a saved state must share with this controller to be loaded into it."""
        return {
            "seed": self._seed,
            "buckets": list(self._buckets),
            "keep_global_batch": self._keep_global,
        }

    # -- the loop ---------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """At a step boundary: takes a ready switch, runs the due checks, draws the next step's
        samples and queues the step on the device.

        An out-of-memory error at dispatch reads every queued step, then runs this one through
        the synchronous retry.
        """
        # A switch made at this boundary belongs to this step's record and its StepInfo.
        first_event = len(self._events)
        self._take_background_compile()  # a grow or re-plan whose compile is ready switches now
        count = self._step_count
        check_due = count > 0 and count % self._config.check_every == 0
        replan_due = self._config.replan_due(count)
        if check_due or replan_due:
            self._flush()  # the checks read what the queued steps produce
        # The controller's own work: what follows, less any compile a check runs.
        start = self._clock()
        spent = self._device_seconds()
        if check_due:
            self._check_memory()
        if replan_due:
            self._replan()
            # Every queued step was read before the re-plan: the next step's time starts after
            # it, so that a re-plan's seconds (signals read, a plan made) are no step's.
            self._in_flight.last_finish = self._clock()
        indices = self._sampler.take(self.batch_size)
        micro = self._bucket.micro
        pending = self._pending(count, indices, micro, first_event)
        self._timings["control"] += self._clock() - start - (self._device_seconds() - spent)
        out, error = self._on_device(lambda: self._dispatch_step(pending))
        if error is not None:
            self._flush()
            self._recover([pending], error)
            return
        assert out is not None  # ran without an error
        for leaf in jax.tree.leaves((out.metrics, out.noise)):
            leaf.copy_to_host_async()  # the read a step later then finds the figures on the host
        self._take_outputs(out, len(indices))
        self._in_flight.pending.append(pending._replace(metrics=out.metrics, noise=out.noise))

    def _pending(
        self, step: int, indices: np.ndarray, micro: int, first_event: int
    ) -> step_records.PendingStep:
        """Step ``step`` of ``indices`` at bucket ``micro``, at the rate of its own samples, from
        the training state in force."""
        self._set_learning_rate(len(indices))
        return step_records.PendingStep(
            step,
            indices,
            self._num_micro(micro, len(indices)),
            micro,
            self._lr.rate(),
            self._lr.update_multiplier(),
            self._record(),
            None,
            None,
            first_event,
        )

    def _finish_oldest(self) -> None:
        """Reads the oldest queued step; an out-of-memory error rolls back to the record it
        started from and re-runs it and every step queued after it, in order."""
        flight = self._in_flight
        oldest = flight.pending[0]
        read, error = self._on_device(lambda: self._read(oldest))
        if error is not None:
            queued = list(flight.pending)
            flight.pending.clear()
            self._restore(oldest.before)
            self._recover(queued, error)
            return
        assert read is not None  # read without an error
        flight.pending.popleft()
        self._deliver(oldest, *read)

    def _flush(self) -> None:
        """Reads every queued step, oldest first."""
        while self._in_flight.pending:
            self._finish_oldest()

    def _on_device(self, call: Callable[[], _T]) -> tuple[_T | None, BaseException | None]:
        """``call()``'s result, or XLA's out-of-memory error it raised: the one place such an
        error is caught (any other error passes through).

        Returns:
          ``(result, None)``, or ``(None, error)`` on ``RESOURCE_EXHAUSTED``.
        """
        try:
            return call(), None
        except jax.errors.JaxRuntimeError as error:
            if not out_of_memory.is_out_of_memory(error):
                raise
            return None, error

    def _recover(self, steps: Sequence[step_records.PendingStep], error: BaseException) -> None:
        """After ``steps[0]`` ran out of memory: charges the error to the bucket it ran at and
        re-runs ``steps``, in order, from the state in force (the caller rolled back to it)."""
        failed = steps[0]
        self._step_count = failed.step  # the error belongs to the step that failed
        self._on_out_of_memory(failed.micro, [f"{failed.num_micro}x{failed.micro}"], error)
        for step in steps:
            self._rerun(step, last=step is steps[-1])

    def _rerun(self, step: step_records.PendingStep, *, last: bool) -> None:
        """Re-runs ``step`` on its samples from the state in force, synchronously, shrinking the
        bucket while it runs out of memory.

        Each re-run trains at the rate of its own samples; after the ``last`` one the rate
        follows the batch in force for the steps to come (the retry shrank it), logged with it.

        Raises:
          OutOfMemoryError: the step ran out of memory at the smallest bucket.
        """
        self._step_count = step.step
        tried = [f"{step.num_micro}x{step.micro}"]

        def attempt_at(
            attempt: step_records.PendingStep,
        ) -> tuple[Any, tuple[dict[str, float], tuple[float, float] | None]]:
            out = self._dispatch_step(attempt)
            return out, self._read(attempt._replace(metrics=out.metrics, noise=out.noise))

        while True:
            attempt = self._pending(step.step, step.indices, self._bucket.micro, step.first_event)
            ran, error = self._on_device(functools.partial(attempt_at, attempt))
            if error is None:
                break
            tried.append(f"{attempt.num_micro}x{attempt.micro}")
            self._on_out_of_memory(attempt.micro, tried, error)
        assert ran is not None  # ran without an error
        out, read = ran
        self._take_outputs(out, len(step.indices))
        if last:
            self._set_learning_rate(self.batch_size)
        self._deliver(attempt, *read)

    def _dispatch_step(self, step: step_records.PendingStep) -> training.StepOutput:
        """Gathers ``step``'s samples as its micro-batches and dispatches the compiled step.

        Returns:
          The step's :class:`triaccel_jax.training.StepOutput`, on the device (JAX dispatches
          asynchronously: nothing waits for the step to run).

        Raises:
          jax.errors.JaxRuntimeError: XLA's error when the step fails at dispatch (e.g. out of
            memory), or the fault injector's.
        """
        executable = self._executable(step.micro, step.num_micro)
        start = self._clock()
        batch = self._feeder.device_batch(step.indices, step.num_micro, step.micro)
        self._timings["data"] += self._clock() - start
        start = self._clock()
        try:
            if self._faults is not None:
                self._faults(
                    out_of_memory.FaultSite("dispatch", step.step, step.micro, step.num_micro)
                )
            return executable(
                self._params,
                self._opt_state,
                self._model_state,
                batch,
                np.int32(step.step),
                np.float32(step.update_scale),
                self._loss_scale,
            )
        finally:
            self._timings["step"] += self._clock() - start

    def _read(
        self, step: step_records.PendingStep
    ) -> tuple[dict[str, float], tuple[float, float] | None]:
        """``step``'s metrics as floats, and its noise norms ``(|G_big|^2, |G_small|^2)``, None
        where the step measured no estimate (the curvature weights before the optimizer's first
        curvature estimate are 0): a transfer that waits for the step to finish."""
        start = self._clock()
        try:
            if self._faults is not None:
                self._faults(out_of_memory.FaultSite("read", step.step, step.micro, step.num_micro))
            metrics, noise = jax.device_get((step.metrics, step.noise))
            norms = (float(noise.batch_sq_norm), float(noise.micro_sq_norm))
            return {k: float(v) for k, v in metrics.items()}, norms if norms[1] > 0.0 else None
        finally:
            self._timings["step"] += self._clock() - start

    def _deliver(
        self,
        step: step_records.PendingStep,
        metrics: dict[str, float],
        norms: tuple[float, float] | None,
    ) -> None:
        """The bookkeeping of a step whose metrics are read: loss, measurements, :class:`StepInfo`,
        callback."""
        start = self._clock()
        flight = self._in_flight
        # A non-finite loss is a step the loss scaling skipped: it changed nothing, and the
        # planner's relative budget needs a finite loss, so the last finite one is kept.
        if math.isfinite(metrics["loss"]):
            self._last_loss = metrics["loss"]
        begin, end = flight.event_span(step, len(self._events))
        events = tuple(self._events[begin:end])
        seconds = start - flight.last_finish
        self._goodput.observe_noise(
            step.step, norms, batch=len(step.indices), micro=self._measured_micro(step)
        )
        if seconds > 0 and not any(e.kind in ("compile", "oom") for e in events):
            key = (step.micro, step.num_micro, precision_schedule.signature_of(step.before.plan))
            self._goodput.observe_throughput(key, seconds=seconds)
            self._precision.time_trial(key, len(step.indices), seconds)
        info = events_lib.StepInfo(
            step.step + 1,
            len(step.indices),
            step.micro,  # the micro-batch the step ran at, not the bucket in force when read
            metrics["loss"],
            metrics,
            self._known_peaks().get(step.micro),
            self._bucket.limit,
            events,
            seconds,
            step.indices,
            step.learning_rate,
            step.update_scale,
            self._goodput.noise_scale,
        )
        flight.last_finish = start
        flight.finished.append(info)
        self._timings["control"] += self._clock() - start
        if self._callback is not None:
            self._callback(info)

    # -- the training state as one record -------------------------------------------------------

    def _record(self) -> step_records.TrainingRecord:
        return step_records.TrainingRecord(
            self._params,
            self._opt_state,
            self._model_state,
            self._loss_scale,
            self._precision.plan,
            self._bucket.micro,
            self._lr.progress,
        )

    def _restore(self, record: step_records.TrainingRecord) -> None:
        """Rolls back to ``record`` whole: a switch taken after it was made is undone with it."""
        self._params, self._opt_state = record.params, record.opt_state
        self._model_state, self._loss_scale = record.model_state, record.loss_scale
        if record.plan != self._precision.plan:
            self._bucket.forget_measured()  # measured peaks were for the policy undone
        self._precision.set_plan(record.plan)
        self._bucket.move_to(record.micro)
        # The restored state holds the record's rate and schedule count, not the current ones.
        self._lr.rewind(record.progress)

    def _take_outputs(self, out: training.StepOutput, samples: int) -> None:
        """Takes a dispatched step's outputs as the state in force and counts the step."""
        # Replacing the state frees the previous step's buffers, as in any training loop.
        self._params, self._opt_state = out.params, out.opt_state
        self._model_state, self._loss_scale = out.model_state, out.loss_scale
        self._step_count += 1
        self._lr.advance(samples)

    # -- switches and decisions -------------------------------------------------------------------

    def _check_memory(self) -> None:
        """Reads the probe and grows or shrinks the bucket when the tracker says so.

        A grow is taken only once the bigger bucket's step is compiled and its compiled peak is
        under the high-water mark (else it is logged as a ``"reject"``); a shrink is taken at
        once. Either moves the learning rate with the batch.
        """
        self._judge_trial()
        micro = self._bucket.micro
        reading = self._probe.read(batch_size=micro)
        peak, limit = agreement.agree_on_memory(reading.peak_bytes, reading.limit_bytes)
        state = (self._params, self._opt_state, self._model_state)
        decision = self._bucket.check(
            peak,
            limit,
            compiled_peaks=self._compiler.peaks(self._precision.signature),
            fixed_bytes=self._bucket.fixed_bytes(state, self._params),
        )
        chosen: dict[str, Any] = {}
        # Memory pressure is memory's shrink alone: a move goodput chose, down included, is not.
        memory_shrink = decision.kind == "shrink"
        if self._precision.trial is not None and not memory_shrink:
            return  # a precision trial is timed at its own batch: the bucket holds until judged
        if self._config.moves_by_goodput and not memory_shrink:
            decision, chosen = self._goodput_decision(decision)
        if decision.kind == "keep" or (decision.kind == "grow" and self._compiler.busy):
            return
        if memory_shrink and self._config.replans_for_memory and self._replan(for_memory=True):
            return  # memory is relieved by precision first (precision_rule="speed")
        if decision.kind == "shrink":
            self._compiler.call_off_grow()  # a grow decided before is not taken
        figures = {"peak_bytes": self._known_peaks().get(micro), "limit_bytes": limit, **chosen}
        key = (decision.bucket, self._num_micro(decision.bucket), self.policy)
        if (
            decision.kind == "grow"
            and self._config.compile_in_background
            and key not in self._compiler
        ):
            self._compiler.start(key, decision.reason, figures)
            self._log(
                "grow_decided",
                micro,
                decision.bucket,
                f"{decision.reason}; compiling micro-batch {decision.bucket} in the background",
                **figures,
            )
            return
        if decision.kind == "grow":
            self._executable(decision.bucket, self._num_micro(decision.bucket))
            if self._refuse_grow(decision.bucket):
                return
        self._log(decision.kind, micro, decision.bucket, decision.reason, **figures)
        self._bucket.move_to(decision.bucket)

    def _goodput_decision(
        self, memory: buckets_lib.BucketDecision
    ) -> tuple[buckets_lib.BucketDecision, dict[str, Any]]:
        """The bucket of highest goodput among those memory allows (``batch_rule="goodput"``):
        up to the memory decision's bucket when it grows, else up to the bucket in force.
        Returns the decision and its figures for the event log."""
        signature = self._precision.signature
        return self._goodput.within_memory(
            memory,
            self._bucket.micro,
            self._buckets,
            self._bucket.ceiling,
            lambda b: (b, self._num_micro(b), signature),
            measurable=self._measures_noise(self._bucket.micro),
        )

    def _refuse_grow(self, bucket: int) -> bool:
        """Logs a ``"reject"`` and returns True when ``bucket``'s compiled peak is too high."""
        compiled = self._compiler.peaks(self._precision.signature)
        refused = self._bucket.over_high_water(bucket, compiled)
        if refused is None:
            return False
        self._log(
            "reject",
            self._bucket.micro,
            bucket,
            refused,
            compiled_peak_bytes=compiled[bucket],
            limit_bytes=self._bucket.limit,
        )
        return True

    def _replan(self, *, for_memory: bool = False) -> bool:
        """Re-plans the policy when the schedule says it runs now
        (:meth:`._precision_schedule.PrecisionSchedule.start_replan`) and applies the decision
        (:func:`._replan.decide_replan`); returns whether a switch was made or started.

        ``for_memory``: a memory check found the step over the high-water mark
        (``precision_rule="speed"``). A changed policy's step compiles first: on the worker
        thread with ``compile_in_background`` (the switch then comes at the first step boundary
        after it is ready), else at the next step.
        """
        due = self._precision.start_replan(
            self._step_count, compiling=self._compiler.busy, for_memory=for_memory
        )
        if due is None:
            return False
        micro, num_micro = self._bucket.micro, self._num_micro(self._bucket.micro)
        previous = self._precision.plan
        assert previous is not None  # re-planning starts from a policy
        decision = replan_lib.decide_replan(
            self._opt_state,
            self._params,
            previous,
            loss=self._last_loss,
            planner=self._config.planner,
            precision_rule=self._config.precision_rule,
            first=self._config.is_first_replan(due),
            for_memory=for_memory,
            tries_for_speed=self._precision.tries_for_speed,
            micro=micro,
            num_micro=num_micro,
            peak_bytes=self._known_peaks().get(micro),
            limit_bytes=self._bucket.limit,
            target=self._config.target,
            throughput=self._goodput.throughput,
        )
        if not decision.changed:
            self._precision.set_plan(decision.plan)  # the hysteresis streaks move on
            return False
        plan, reason, figures = decision.plan, decision.reason, decision.figures
        key = (micro, num_micro, plan.policy)
        if self._config.compile_in_background and key not in self._compiler:
            self._compiler.start(key, reason, figures, plan=plan, opt_state=decision.opt_state)
            self._log(
                "replan_decided",
                previous.policy.signature,
                plan.policy.signature,
                f"{reason}; compiling its step in the background",
                **figures,
            )
            return True
        self._switch_policy(plan, reason, figures, opt_state=decision.opt_state)
        return True

    def _judge_trial(self) -> None:
        """Logs a finished speed trial's verdict
        (:meth:`._precision_schedule.PrecisionSchedule.judge_trial`) and goes back to the
        policy before it when the trial's steps were not faster."""
        judged = self._precision.judge_trial(
            micro=self._bucket.micro,
            min_steps=self._config.check_every,
            margin=self._config.speed_trial_margin,
            rate=self._goodput.rate,
        )
        if judged is None:
            return
        trial, verdict = judged
        new = trial.signature if verdict.keep else trial.previous_signature
        self._log("precision_trial", trial.signature, new, verdict.reason, **verdict.figures)
        if not verdict.keep:
            self._switch_policy(trial.previous, verdict.reason, verdict.figures)

    def _switch_policy(
        self, plan: PrecisionPlan, reason: str, figures: dict, *, opt_state: Any = None
    ) -> None:
        """Puts ``plan``'s policy in force: the optimizer state converted (``opt_state`` when it
        is already), a ``"replan"`` logged, the measured peaks (the old policy's) forgotten, and
        a speed trial started at the bucket in force when the decision asked for one."""
        assert self.policy is not None  # re-planning starts from a policy
        self._log("replan", self.policy.signature, plan.policy.signature, reason, **figures)
        if opt_state is None:
            opt_state = convert_state(self._opt_state, plan.policy)
        self._opt_state = self._place(opt_state)
        micro = self._bucket.micro
        trial_at = (micro, self._num_micro(micro)) if figures.get("speed_trial") else None
        self._precision.switch(plan, trial_at=trial_at)
        self._bucket.forget_measured()

    def _take_background_compile(self) -> None:
        """At a step boundary: when a background compile is ready, makes its switch (or refuses
        its grow); a re-plan that came due meanwhile runs next (it may start a compile of its
        own)."""
        ready = self._compiler.take_ready()
        if ready is None:
            return
        job, new = ready
        self._note_compile(job.key, new, background=True)
        if job.plan is not None:
            # The state has kept training since the decision: convert it as it is now.
            self._switch_policy(job.plan, job.reason, job.figures)
        else:
            bucket, _, policy = job.key
            still_holds = job.switch and policy == self.policy and bucket > self._bucket.micro
            if still_holds and not self._refuse_grow(bucket):
                self._log("grow", self._bucket.micro, bucket, job.reason, **job.figures)
                self._bucket.move_to(bucket)
        if self._precision.waiting:
            self._flush()  # a re-plan reads what the queued steps produce
            self._replan()

    def _call_off_background(self) -> None:
        """Forgets a background compile's switch and a re-plan waiting for it (``set_policy``
        and ``load_state_dict`` set the state themselves)."""
        self._compiler.cancel()
        self._precision.call_off()

    def _on_out_of_memory(self, micro: int, tried: list[str], error: BaseException) -> None:
        """Charges an out-of-memory error to ``micro``, the bucket its step ran at."""
        decision = self._bucket.retry_after_out_of_memory(
            micro, step=self._step_count, tried=tried, error=error
        )
        self._log("oom", micro, decision.bucket, decision.reason, ceiling=decision.ceiling)
        self._compiler.call_off_grow()  # a grow decided before the error is not taken

    def _set_learning_rate(self, samples: int) -> None:
        """Scales the rate for a step of ``samples`` (each step asks for its own samples' rate;
        the state is rewritten only when the rate changes) and sets a learning-rate schedule's
        count from the training progress.

        With ``lr_scaling="adascale"`` the factor is the gain from the noise estimates of the
        step ``steps_in_flight + 1`` before this one, rounded (it changes when the gain moves by
        about 1%). A rate change is logged only when the batch changes with it, not for each
        move of AdaScale's gain: :class:`StepInfo` carries each step's rate or factor.
        """
        noise = self._goodput.noise_before(self._step_count)
        opt_state, event = self._lr.for_step(self._opt_state, samples, noise)
        if event is not None:
            self._log(event.kind, event.old, event.new, event.reason, **event.figures)
            if not self._rescale_said:
                # The user's tuned rate changing is said where a person sees it, once; every
                # later change is in the event log (and logged at INFO).
                self._rescale_said = True
                caller.warn(
                    f"the Controller rescales the learning rate with the batch: {event.reason} "
                    f"(reference_batch={self._lr.reference}: the batch the rate was tuned at; "
                    "lr_scaling='none' leaves the rate alone). Said once: later changes are in "
                    "Controller.events."
                )
        if opt_state is not self._opt_state:
            self._opt_state = self._place(opt_state)

    # -- compiling --------------------------------------------------------------------------------

    def _executable(self, micro: int, num_micro: int) -> Any:
        """The step compiled for ``micro`` x ``num_micro`` under the policy in force."""
        key = (micro, num_micro, self.policy)
        executable, new = self._compiler.compiled(key)
        if new is not None:
            self._note_compile(key, new, background=False)
        return executable

    def _make_step(self, key: compiling.StepKey, opt_state: Any) -> tuple[Any, tuple]:
        """The pure step for ``key`` and its arguments as shapes (``opt_state``: the state the
        step takes, default the one in force)."""
        micro, num_micro, policy = key
        if opt_state is None:
            opt_state = self._opt_state
        step = training.make_train_step(
            self._loss,
            self._tx,
            policy=policy,
            num_micro=num_micro,
            seed=self._seed,
            loss_scaling=training.loss_scaling_for(policy, self._config.loss_scaling, opt_state),
            fused=self._fused(opt_state),
            split=self._splits(micro, num_micro),
            noise_weights=config_lib.NOISE_WEIGHTS[self._config.noise_estimator],
        )
        args = training.abstract_step_arguments(
            (self._params, opt_state, self._model_state),
            self._feeder.abstract_batch(num_micro, micro),
            self._loss_scale,
        )
        return step, args

    def _fused(self, opt_state: Any) -> FusedTriAccel | None:
        """The optimizer's fused form the step updates with (``ControllerConfig.fused_update``).

        Raises:
          ValueError: the fused form cannot fuse the optimizer (reason named).
        """
        fused = self._config.fused_update
        if fused is not None:
            reason = unfused_reason(fused, opt_state)
            if reason is not None:
                raise ValueError(f"fused_update cannot fuse the optimizer: {reason}")
        return fused

    def _note_compile(
        self, key: compiling.StepKey, new: compiling.CompiledStep, *, background: bool
    ) -> None:
        """Records a new compile's peak (for a bucket's own step, not an out-of-memory retry's
        accumulation) and time, and logs a ``"compile"`` event."""
        micro, num_micro, policy = key
        signature = "none" if policy is None else policy.signature
        if new.peak_bytes is not None and num_micro == self._num_micro(micro):
            self._compiler.record_peak(signature, micro, new.peak_bytes)
        self._timings["compile"] += new.seconds
        self._log(
            "compile",
            None,
            f"{num_micro}x{micro}",
            f"first step with micro-batch {micro} x {num_micro}, policy {signature}",
            compiled_peak_bytes=new.peak_bytes,
            policy=signature,
            seconds=round(new.seconds, 3),
            background=background,
        )

    # -- helpers ----------------------------------------------------------------------------------

    def _num_micro(self, micro: int, samples: int | None = None) -> int:
        """Micro-batches per step at bucket ``micro``: the global batch's share with
        ``keep_global_batch``, else as many as ``samples`` needs (1 outside a retry)."""
        if self._keep_global:
            assert self._global is not None  # the layout has a global batch with keep_global
            return self._global // micro
        return 1 if samples is None else max(samples // micro, 1)

    def _measured_micro(self, step: step_records.PendingStep) -> int:
        """The samples behind the step's ``micro_grad_sq_norm``: its micro-batch, or half of it
        for a step of one micro-batch split in two (``measure_noise_scale``)."""
        if self._splits(step.micro, step.num_micro):
            return step.micro // 2
        return step.micro

    def _measures_noise(self, micro: int) -> bool:
        """Whether a step at bucket ``micro`` measures the noise scale: one of several
        micro-batches, or one micro-batch split in halves."""
        num_micro = self._num_micro(micro)
        return num_micro > 1 or self._splits(micro, num_micro)

    def _splits(self, micro: int, num_micro: int) -> bool:
        """Whether a step measures the noise scale on halves of its one micro-batch
        (``ControllerConfig.splits_steps``): the halves are taken within each device's shard, so
        a micro-batch with an odd number of samples on a device cannot be halved and runs
        without an estimate."""
        per_device = micro // self._feeder.multiple
        return self._config.splits_steps and num_micro == 1 and per_device % 2 == 0

    def _known_peaks(self) -> dict[int, int]:
        """Peak bytes per bucket under the current policy (see ``BucketTracker.known_peaks``)."""
        return self._bucket.known_peaks(self._compiler.peaks(self._precision.signature))

    def _device_seconds(self) -> float:
        return self._timings["step"] + self._timings["compile"] + self._timings["data"]

    def _place(self, tree: Any) -> Any:
        return self._feeder.place(tree)

    def _check_loss_structure(self) -> None:
        batch = self._feeder.abstract_batch(1, self._bucket.micro)
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), batch)
        training.check_loss_structure(
            self._loss, self._params, self._model_state, batch, self.policy
        )

    def _log(self, kind: str, old: Any, new: Any, reason: str, **figures: Any) -> None:
        self._events.append(events_lib.Event(self._step_count, kind, old, new, reason, figures))
        logging_lib.log_event(self._events[-1])


def _holds_signals(opt_state: Any) -> bool:
    """Whether ``opt_state`` holds the signals the precision planner reads."""
    try:
        signals(opt_state)
    except (ValueError, TypeError):
        return False
    return True


@dataclasses.dataclass(frozen=True)
class LossScaleRecord:
    """The dynamic loss scale as the controller saves it: :class:`LossScaleState`'s fields as
    numbers.

    Attributes:
      scale: the loss scale.
      good_steps: finite steps since the scale last changed.
      skipped_steps: steps skipped for non-finite gradients.

    Example:
      >>> from triaccel_jax.controller._controller import LossScaleRecord
      >>> from triaccel_jax.transforms import LossScaling
      >>> LossScaleRecord.of(LossScaling().init())
      LossScaleRecord(scale=32768.0, good_steps=0, skipped_steps=0)
    """

    scale: float
    good_steps: int
    skipped_steps: int

    @classmethod
    def of(cls, state: LossScaleState) -> LossScaleRecord:
        """``state``'s arrays as numbers."""
        return cls(*(np.asarray(v).item() for v in state))

    def loss_scale_state(self) -> LossScaleState:
        """The record as the arrays the step expects (float32 and int32)."""
        return LossScaleState(
            jnp.float32(self.scale), jnp.int32(self.good_steps), jnp.int32(self.skipped_steps)
        )


@dataclasses.dataclass(frozen=True)
class ControllerState:
    """What a :class:`Controller` saves beside the envelope (format, version and the settings
    a state must share to be loaded): its own fields and each deciding part's saved state.

    Attributes:
      step: steps completed.
      last_loss: the last step's loss, or None before the first.
      loss_scale: the dynamic loss scale.
      sampler: the sampler's position.
      compiled_peaks: the compiled peak bytes ``{policy signature: {bucket: bytes}}``.
      bucket, goodput, precision, learning_rate: the parts' saved states.
    """

    step: Annotated[int, state_record.AtLeast(0)]
    last_loss: float | None
    loss_scale: LossScaleRecord
    sampler: sampler_lib.SamplerState
    compiled_peaks: dict[str, dict[int, int]]
    bucket: BucketTrackerState
    goodput: GoodputTrackerState
    precision: precision_schedule.PrecisionScheduleState
    learning_rate: LearningRateState
