"""``Controller``: the host-side loop that adapts batch size and precision (docs/design.md §5).

The controller is one object that owns its state and changes it only in its own methods: the
loop with its in-flight queue, the switches (grow, shrink, re-plan, ``set_policy``) taken at step
boundaries, the out-of-memory rollback and retry, the learning rate, and the saved state. It asks
pure decision functions and small state-owning parts for each decision (:mod:`._buckets` and
:class:`._bucket_tracker.BucketTracker` for the bucket, :mod:`._out_of_memory` for the retry,
:mod:`._learning_rate` for the rate, :func:`._replan.replan` for precision), compiles through
:class:`._compiling.StepCompiler`, and is the only writer of the event log.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from triaccel_jax import training
from triaccel_jax._src import validation
from triaccel_jax.controller import _agreement as agreement
from triaccel_jax.controller import _bucket_tracker as bucket_tracker
from triaccel_jax.controller import _buckets as buckets_lib
from triaccel_jax.controller import _compiling as compiling
from triaccel_jax.controller import _config as config_lib
from triaccel_jax.controller import _events as events_lib
from triaccel_jax.controller import _feeding as feeding
from triaccel_jax.controller import _goodput as goodput
from triaccel_jax.controller import _learning_rate as learning_rate
from triaccel_jax.controller import _logging as logging_lib
from triaccel_jax.controller import _memory_probe as memory_probe
from triaccel_jax.controller import _out_of_memory as out_of_memory
from triaccel_jax.controller import _precision_speed as precision_speed
from triaccel_jax.controller import _replan as replan_lib
from triaccel_jax.controller import _sampler as sampler_lib
from triaccel_jax.controller import _state_record as state_record
from triaccel_jax.controller import _step_records as records
from triaccel_jax.policy import PrecisionPlan
from triaccel_jax.policy import PrecisionPolicy
from triaccel_jax.policy import carried_itemsize
from triaccel_jax.policy import check_policy
from triaccel_jax.transforms import FusedTriAccel
from triaccel_jax.transforms import LossScaling
from triaccel_jax.transforms import convert_state
from triaccel_jax.transforms import mean_curvatures
from triaccel_jax.transforms import signals
from triaccel_jax.transforms import unfused_reason

StepInfo = events_lib.StepInfo


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
      probe: the memory probe; default :func:`triaccel_jax.controller.default_memory_probe`.
      policy: the starting precision policy (default all fp32 when re-planning).
      mesh: a ``jax.sharding.Mesh`` for data parallelism: batches are sharded over
        ``data_axis``, whose size every bucket is a multiple of; params and states not already
        on the mesh are replicated.
      callback: called with a :class:`StepInfo` after every step (e.g. a progress bar).
      faults: a fault injector, called with a :class:`triaccel_jax.controller.FaultSite` before
        every dispatch and every read of a step; it may raise an out-of-memory error to
        chaos-test a run (:class:`triaccel_jax.controller.OutOfMemoryFaults`).
      config: the settings as one :class:`triaccel_jax.controller.ControllerConfig`; or
      **settings: the same settings as keywords (not both); each is described in
        :class:`triaccel_jax.controller.ControllerConfig` (``min_batch``, ``max_batch``,
        ``batch_size``, ``target``, ``check_every``, ``replan_every``, ``lr_scaling``, ``seed``, ...).

    Attributes:
      params: the parameters after the last step.
      opt_state: the optimizer state after the last step.
      model_state: the non-trained state (e.g. BatchNorm statistics) after the last step.
      loss_scale: the dynamic loss scale's state (``scale``, ``good_steps``,
        ``skipped_steps``), updated only by steps that scale the loss.
      policy: the precision policy in force (None when precision is not planned).
      plan: the :class:`triaccel_jax.policy.PrecisionPlan` in force: the policy and the
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
        probe: memory_probe.MemoryProbe | None = None,
        policy: PrecisionPolicy | None = None,
        mesh: jax.sharding.Mesh | None = None,
        callback: Callable[[StepInfo], None] | None = None,
        faults: Callable[[out_of_memory.FaultSite], None] | None = None,
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
        if faults is not None:
            validation.check_callable("faults", faults)
        self._faults = faults
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
        # A fused form that cannot fuse the optimizer is refused here, not at the first step.
        self._fused(self.opt_state)
        if config.noise_estimator == "hessian":
            # Raises, naming the problem, when the optimizer holds no curvature to weight by.
            mean_curvatures(self.opt_state, self.params)
        self.loss_scale = self._place(config.loss_scaling.init())
        self._loss = training.normalize_loss_fn(
            loss_fn, has_aux=config.has_aux, has_model_state=model_state is not None
        )
        self._in_flight = records.InFlight()
        self._compiler = compiling.StepCompiler(self._make_step)
        # The step a re-plan came due at while a background compile was waiting (None: none
        # waits); it runs as soon as that compile is taken.
        self._replan_due_at: int | None = None
        self._start_plan(policy)
        self._lr = learning_rate.LearningRateScaling(
            self.opt_state, config.lr_hyperparam, config.lr_scaling, layout.reference_batch
        )
        self.probe = memory_probe.prepare_probe(probe)
        self._callback = logging_lib.logging_callback(callback)  # logs each step at DEBUG

        self.step_count = 0
        self._last_loss: float | None = None
        self._noise = goodput.NoiseScale()
        # The noise estimates after each of the last steps read: AdaScale's gain of a step comes
        # from those of the step steps_in_flight + 1 before it (learning_rate.noise_before).
        self._recent_noise: collections.deque[tuple[int, goodput.NoiseScale]] = collections.deque(
            maxlen=config.steps_in_flight + 1
        )
        # Training progress in reference-batch steps, that a learning-rate schedule is evaluated
        # at (schedule_progress); part of the training record and the saved state.
        self._progress = 0.0
        # Samples per second of the steps run at each (micro-batch, micro-batches, policy
        # signature), smoothed; steps that compiled or ran out of memory are not counted.
        self._throughput: dict[tuple[int, int, str], float] = {}
        # precision_rule="speed": the lower-precision policy on trial (None: none), and whether
        # a lower precision measured slower this run (then it is only taken where memory needs).
        self._trial: precision_speed.PolicyTrial | None = None
        self._lower_is_slower = False
        # XLA:CPU converts bf16 through float32 (the small CNN's bf16 step ran 2x slower, and
        # compiled 3-4x longer): no speed trial there unless asked for.
        self._speed_trials = (
            config.speed_trials
            if config.speed_trials is not None
            else jax.default_backend() != "cpu"
        )
        # The bucket goodput last chose to move to and at how many checks in a row.
        self._goodput_streak: tuple[int | None, int] = (None, 0)
        self.events: list[events_lib.Event] = []
        self._train_state: tuple[Any, int] | None = None
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
        self._set_learning_rate(self.batch_size)

    def _start_plan(self, policy: PrecisionPolicy | None) -> None:
        """The starting plan: ``policy`` (all fp32 when re-planning), the moments converted."""
        if self.config.replan_every is not None:
            # Raises, naming the problem, when the optimizer holds no triaccel state.
            signals(self.opt_state)
            policy = policy or PrecisionPolicy.uniform(self.params)
        self.plan: PrecisionPlan | None = None
        self.set_policy(policy)

    # -- public -----------------------------------------------------------------------------------

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
          **kwargs: the other arguments of :class:`Controller` (not ``params``, ``opt_state``
            or ``model_state``, which come from ``state``).

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
        if isinstance(getattr(state, "loss_scaling", None), LossScaling):
            given = kwargs.get("config")
            if isinstance(given, config_lib.ControllerConfig):
                # The state's rule, unless the config sets one of its own.
                if given.loss_scaling == LossScaling():
                    kwargs["config"] = dataclasses.replace(given, loss_scaling=state.loss_scaling)
            else:
                kwargs.setdefault("loss_scaling", state.loss_scaling)
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

        It holds the params, optimizer state, batch statistics, loss scale and (for
        :class:`triaccel_jax.flax.TrainState`) policy of the last step read. An injected learning
        rate in its optimizer state is the tuned (reference-batch) rate: the controller's batch
        scaling is its own and is applied again by whoever trains next, so that round trips do
        not compound it.
        """
        if self._train_state is None:
            raise AttributeError("this controller was not made with Controller.from_train_state")
        template, start = self._train_state
        self._flush()
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
    def policy(self) -> PrecisionPolicy | None:
        """The precision policy in force (None when precision is not planned)."""
        return None if self.plan is None else self.plan.policy

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
        """The smoothed simple gradient noise scale ``tr(Sigma) / |G|^2`` (McCandlish et al.,
        2018), measured from steps of several micro-batches; None before the first such step."""
        return self._noise.simple

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
        return self._progress

    @property
    def throughput(self) -> dict[tuple[int, int, str], float]:
        """Measured samples per second by ``(micro-batch, micro-batches, policy signature)``:
        a moving average over the steps run there, compiles and out-of-memory retries excluded.

        A measurement of this process on this machine: :meth:`state_dict` does not save it (a
        restarted run, perhaps elsewhere, measures again), and with several processes the
        decisions use the smallest over them."""
        return dict(self._throughput)

    @property
    def compile_pending(self) -> bool:
        """Whether a background compile (``compile_in_background``) is still to be taken."""
        return self._compiler.busy

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
        compiled = self._compiler.peaks(self._policy_signature())
        return {bucket: compiled.get(bucket) for bucket in chosen}

    def step(self) -> StepInfo:
        """Runs one training step and reads it: ``run(1)[0]``."""
        return self.run(1)[0]

    def run(self, num_steps: int) -> list[StepInfo]:
        """Runs ``num_steps`` steps; returns their :class:`StepInfo`.

        With ``steps_in_flight`` > 0 (the default), step ``n + 1`` is dispatched before step
        ``n``'s metrics are read, so the device never waits for the host; the callback gets each
        :class:`StepInfo` in order, that many steps late, while the controller's state is the
        last dispatched step's (docs/design.md §8). Every step is read before it returns.
        """
        validation.check_integer("num_steps", num_steps, 0)
        self._flush()
        self._in_flight.take_finished()
        # A step's seconds run from the previous read: not from before this call.
        self._in_flight.last_finish = time.perf_counter()
        window = self.config.steps_in_flight
        for _ in range(num_steps):
            self._dispatch()
            while len(self._in_flight.pending) > window:
                self._finish_oldest()
        self._flush()
        return self._in_flight.take_finished()

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
            check_policy(policy, self.params)
        elif self.config.replan_every is not None:
            raise ValueError(
                "set_policy(None) while precision is re-planned (replan_every="
                f"{self.config.replan_every}): the planner needs a policy to start from; pass "
                "PrecisionPolicy.uniform(params) for all fp32"
            )
        self._flush()  # the switch belongs to the steps after it
        self._call_off_background()
        if policy is not None:
            # Only triaccel states hold per-leaf moment dtypes; any other state is kept as is.
            self.opt_state = self._place(convert_state(self.opt_state, policy))
        if policy != self.policy:
            self._bucket.measured = {}  # measured peaks were for the old policy
        self.plan = None if policy is None else PrecisionPlan(policy, {})

    def event_records(self) -> list[dict[str, Any]]:
        """The event log as flat dicts (``pandas.DataFrame(controller.event_records())``)."""
        return events_lib.event_records(self.events)

    def state_dict(self) -> dict[str, Any]:
        """The controller's own state as JSON-ready data, to save beside params and optimizer state.

        It holds the bucket, ceiling, hysteresis counters, memory figures, policy and the
        planner's pending streaks, the tuned learning rate and factor, the schedule progress and
        the recent noise estimates AdaScale's gain comes from, loss scale, step counter and the
        sampler's cursor; the per-step ``rng`` is derived from ``seed`` and the step, so
        it is not saved. A controller restored with :meth:`load_state_dict` (and the params and
        optimizer state of the same step) takes the same decisions.
        """
        self._flush()  # the state of the last step read, params and all
        plan = self.plan
        record = state_record.ControllerRecord(
            step=self.step_count,
            **self._bucket.record(),
            compiled_peaks=self._compiler.peaks_record(),
            last_loss=self._last_loss,
            lr_factor=self._lr.factor,
            loss_scale=self.loss_scale,
            policy=self.policy,
            pending=dict(plan.pending) if plan is not None else {},
            sampler=self.sampler.state_dict(),
            tuned_learning_rate=self._lr.base_lr,
            noise_scale=(self._noise.grad_sq, self._noise.trace, self._noise.weight),
            schedule_progress=self._progress,
            recent_noise=tuple((step, *noise) for step, noise in self._recent_noise),
        )
        return state_record.to_state_dict(record, self._identity())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from :meth:`state_dict`'s output (same data, seed and buckets).

        Raises:
          ValueError: the state is malformed or was saved by a controller configured differently;
            nothing is changed then.
        """
        self._flush()
        record = state_record.from_state_dict(state, self._identity())
        opt_state = self.opt_state
        if record.policy is not None:
            record.policy.check_matches(self.params)
            # The moments were converted to the starting policy when this controller was made.
            opt_state = self._place(convert_state(self.opt_state, record.policy))
        loss_scale = self._place(record.loss_scale)
        # Everything is read and checked (the sampler checks its own state before taking it):
        # nothing below raises.
        self.sampler.load_state_dict(record.sampler)
        self._call_off_background()
        self.step_count, self._last_loss = record.step, record.last_loss
        self._noise = goodput.NoiseScale(*record.noise_scale)
        self._recent_noise.clear()
        self._recent_noise.extend(
            (step, goodput.NoiseScale(*noise)) for step, *noise in record.recent_noise
        )
        self._progress = record.schedule_progress
        self._lr.restore_tuned(record.tuned_learning_rate)
        self._bucket.restore(record)
        self._compiler.load_peaks_record(record.compiled_peaks)
        self.loss_scale, self.opt_state = loss_scale, opt_state
        if record.policy is not None:
            self.plan = PrecisionPlan(record.policy, record.pending)
        if self._train_state is not None:
            # The train state given to from_train_state is the saved step's: its step counter
            # already counts the steps the record does.
            self._train_state = (self._train_state[0], self.step_count)
        self._log("restore", None, self.step_count, "controller state loaded")
        self._set_learning_rate(self.batch_size)

    def _identity(self) -> dict[str, Any]:
        """What a saved state must share with this controller to be loaded into it."""
        return {
            "seed": self._seed,
            "buckets": list(self.buckets),
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
        first_event = len(self.events)
        self._take_background_compile()  # a grow or re-plan whose compile is ready switches now
        count = self.step_count
        check_due = count > 0 and count % self.config.check_every == 0
        replan_due = self.config.replan_due(count)
        if check_due or replan_due:
            self._flush()  # the checks read what the queued steps produce
        # The controller's own work: what follows, less any compile a check runs.
        start = time.perf_counter()
        spent = self._device_seconds()
        if check_due:
            self._check_memory()
        if replan_due:
            self._replan()
        indices = self.sampler.take(self.batch_size)
        micro = self._bucket.micro
        num_micro = self._num_micro(micro, len(indices))
        self._set_learning_rate(len(indices))  # the rate of the samples this step trains
        pending = records.PendingStep(
            count,
            indices,
            num_micro,
            micro,
            self._lr.rate(),
            self._lr.update_multiplier(),
            self._record(),
            None,
            first_event,
        )
        self.timings["control"] += time.perf_counter() - start - (self._device_seconds() - spent)
        try:
            out = self._dispatch_step(pending)
        except jax.errors.JaxRuntimeError as error:
            if not out_of_memory.is_out_of_memory(error):
                raise
            self._flush()
            self._on_out_of_memory(micro, [f"{num_micro}x{micro}"], error)
            self._rerun(pending, last=True)
            return
        for leaf in jax.tree.leaves(out.metrics):
            leaf.copy_to_host_async()  # the read a step later then finds the figures on the host
        self._take_outputs(out)
        self.step_count += 1
        self._progress += self._lr.progress_increment(len(indices))
        self._in_flight.pending.append(pending._replace(metrics=out.metrics))

    def _finish_oldest(self) -> None:
        """Reads the oldest queued step; an out-of-memory error rolls back to the record it
        started from and re-runs it and every step queued after it, in order."""
        flight = self._in_flight
        oldest = flight.pending[0]
        try:
            metrics = self._read(oldest)
        except jax.errors.JaxRuntimeError as error:
            if not out_of_memory.is_out_of_memory(error):
                raise
            queued = list(flight.pending)
            flight.pending.clear()
            self._restore(oldest.before)
            self.step_count = oldest.step
            self._on_out_of_memory(oldest.micro, [f"{oldest.num_micro}x{oldest.micro}"], error)
            for step in queued:
                self._rerun(step, last=step is queued[-1])
            return
        flight.pending.popleft()
        self._deliver(oldest, metrics)

    def _flush(self) -> None:
        """Reads every queued step, oldest first."""
        while self._in_flight.pending:
            self._finish_oldest()

    def _rerun(self, step: records.PendingStep, *, last: bool) -> None:
        """Re-runs ``step`` on its samples from the state in force, synchronously, shrinking the
        bucket while it runs out of memory.

        Each re-run trains at the rate of its own samples; after the ``last`` one the rate
        follows the batch in force for the steps to come (the retry shrank it), logged with it.

        Raises:
          OutOfMemoryError: the step ran out of memory at the smallest bucket.
        """
        self.step_count = step.step
        tried = [f"{step.num_micro}x{step.micro}"]
        while True:
            micro = self._bucket.micro
            self._set_learning_rate(len(step.indices))
            attempt = step._replace(
                num_micro=self._num_micro(micro, len(step.indices)),
                micro=micro,
                learning_rate=self._lr.rate(),
                update_scale=self._lr.update_multiplier(),
                before=self._record(),
            )
            try:
                out = self._dispatch_step(attempt)
                metrics = self._read(attempt._replace(metrics=out.metrics))
            except jax.errors.JaxRuntimeError as error:
                if not out_of_memory.is_out_of_memory(error):
                    raise
                tried.append(f"{attempt.num_micro}x{micro}")
                self._on_out_of_memory(micro, tried, error)
                continue
            break
        self._take_outputs(out)
        self.step_count += 1
        self._progress += self._lr.progress_increment(len(step.indices))
        if last:
            self._set_learning_rate(self.batch_size)
        self._deliver(attempt, metrics)

    def _dispatch_step(self, step: records.PendingStep) -> training.StepOutput:
        """Gathers ``step``'s samples as its micro-batches and dispatches the compiled step.

        Returns:
          The step's :class:`triaccel_jax.training.StepOutput`, on the device (JAX dispatches
          asynchronously: nothing waits for the step to run).

        Raises:
          jax.errors.JaxRuntimeError: XLA's error when the step fails at dispatch (e.g. out of
            memory), or the fault injector's.
        """
        executable = self._executable(step.micro, step.num_micro)
        start = time.perf_counter()
        batch = self._feeder.device_batch(step.indices, step.num_micro, step.micro)
        self.timings["data"] += time.perf_counter() - start
        start = time.perf_counter()
        try:
            if self._faults is not None:
                self._faults(
                    out_of_memory.FaultSite("dispatch", step.step, step.micro, step.num_micro)
                )
            return executable(
                self.params,
                self.opt_state,
                self.model_state,
                batch,
                np.int32(step.step),
                np.float32(step.update_scale),
                self.loss_scale,
            )
        finally:
            self.timings["step"] += time.perf_counter() - start

    def _read(self, step: records.PendingStep) -> dict[str, float]:
        """``step``'s metrics as floats: a transfer that waits for the step to finish."""
        start = time.perf_counter()
        try:
            if self._faults is not None:
                self._faults(out_of_memory.FaultSite("read", step.step, step.micro, step.num_micro))
            return {k: float(v) for k, v in jax.device_get(step.metrics).items()}
        finally:
            self.timings["step"] += time.perf_counter() - start

    def _deliver(self, step: records.PendingStep, metrics: dict[str, float]) -> None:
        """The bookkeeping of a step whose metrics are read: loss, :class:`StepInfo`, callback."""
        start = time.perf_counter()
        flight = self._in_flight
        # A non-finite loss is a step the loss scaling skipped: it changed nothing, and the
        # planner's relative budget needs a finite loss, so the last finite one is kept.
        if math.isfinite(metrics["loss"]):
            self._last_loss = metrics["loss"]
        begin, end = flight.event_span(step, len(self.events))
        events = tuple(self.events[begin:end])
        seconds = start - flight.last_finish
        decay = self.config.statistics_decay
        # With noise_estimator="hessian" the norms are curvature-weighted (B_noise); they are 0
        # until the optimizer's first curvature estimate, which carries no estimate.
        prefix = "curvature_" if self.config.noise_estimator == "hessian" else ""
        if metrics.get(f"{prefix}micro_grad_sq_norm", 0.0) > 0.0:
            self._noise = goodput.update_noise_scale(
                self._noise,
                grad_sq_norm=metrics[f"{prefix}grad_sq_norm"],
                micro_grad_sq_norm=metrics[f"{prefix}micro_grad_sq_norm"],
                batch=len(step.indices),
                micro=self._measured_micro(step),
                decay=decay,
            )
        self._recent_noise.append((step.step, self._noise))
        if seconds > 0 and not any(e.kind in ("compile", "oom") for e in events):
            signature = self._signature_of(step.before.plan)
            key = (step.micro, step.num_micro, signature)
            rate = len(step.indices) / seconds
            old = self._throughput.get(key)
            self._throughput[key] = rate if old is None else decay * old + (1.0 - decay) * rate
            trial = self._trial
            if trial is not None and (trial.micro, trial.num_micro, trial.signature) == key:
                self._trial = trial.add(len(step.indices), seconds)
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
            self._noise.simple,
        )
        flight.last_finish = start
        flight.finished.append(info)
        self.timings["control"] += time.perf_counter() - start
        if self._callback is not None:
            self._callback(info)

    # -- the training state as one record -------------------------------------------------------

    def _record(self) -> records.TrainingRecord:
        return records.TrainingRecord(
            self.params,
            self.opt_state,
            self.model_state,
            self.loss_scale,
            self.plan,
            self._bucket.micro,
            self._progress,
        )

    def _restore(self, record: records.TrainingRecord) -> None:
        """Rolls back to ``record`` whole: a switch taken after it was made is undone with it."""
        self.params, self.opt_state = record.params, record.opt_state
        self.model_state, self.loss_scale = record.model_state, record.loss_scale
        if record.plan != self.plan:
            self._bucket.measured = {}  # measured peaks were for the policy undone
        self.plan = record.plan
        self._bucket.micro = record.micro
        self._progress = record.progress
        self._lr.invalidate()  # the restored state holds the record's rate, not the current one

    def _take_outputs(self, out: training.StepOutput) -> None:
        # Replacing the state frees the previous step's buffers, as in any training loop.
        self.params, self.opt_state = out.params, out.opt_state
        self.model_state, self.loss_scale = out.model_state, out.loss_scale

    # -- switches and decisions -------------------------------------------------------------------

    def _check_memory(self) -> None:
        """Reads the probe and grows or shrinks the bucket when the tracker says so.

        A grow is taken only once the bigger bucket's step is compiled and its compiled peak is
        under the high-water mark (else it is logged as a ``"reject"``); a shrink is taken at
        once. Either moves the learning rate with the batch.
        """
        self._judge_trial()
        micro = self._bucket.micro
        reading = self.probe.read(batch_size=micro)
        peak, limit = agreement.agree_on_memory(reading.peak_bytes, reading.limit_bytes)
        state = (self.params, self.opt_state, self.model_state)
        decision = self._bucket.check(
            peak,
            limit,
            compiled_peaks=self._compiler.peaks(self._policy_signature()),
            fixed_bytes=self._bucket.fixed_bytes(state, self.params),
        )
        chosen: dict[str, Any] = {}
        if self._trial is not None and decision.kind != "shrink":
            return  # a precision trial is timed at its own batch: the bucket holds until judged
        if self.config.moves_by_goodput and decision.kind != "shrink":
            decision, chosen = self._goodput_decision(decision)
        if decision.kind == "keep" or (decision.kind == "grow" and self._compiler.busy):
            return
        if decision.kind == "shrink" and self._lower_precision_for_memory():
            return  # memory is relieved by precision first (precision_rule="speed")
        if decision.kind == "shrink":
            self._compiler.call_off_grow()  # a grow decided before memory tightened is not taken
        figures = {"peak_bytes": self._known_peaks().get(micro), "limit_bytes": limit, **chosen}
        key = (decision.bucket, self._num_micro(decision.bucket), self.policy)
        if (
            decision.kind == "grow"
            and self.config.compile_in_background
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
        self._bucket.micro = decision.bucket

    def _goodput_decision(
        self, memory: buckets_lib.BucketDecision
    ) -> tuple[buckets_lib.BucketDecision, dict[str, Any]]:
        """The bucket of highest goodput among those memory allows (``batch_rule="goodput"``):
        up to the memory decision's bucket when it grows, else up to the bucket in force.
        Returns the decision and its figures for the event log."""
        micro = self._bucket.micro
        cap = memory.bucket if memory.kind == "grow" else micro
        ceiling = self._bucket.ceiling
        allowed = [b for b in self.buckets if b <= cap and (ceiling is None or b < ceiling)]
        if micro not in allowed:
            allowed = sorted({*allowed, micro})
        signature = self._policy_signature()
        local = [self._throughput.get((b, self._num_micro(b), signature)) for b in self.buckets]
        # Every host decides alike: the step goes at the pace of the slowest.
        agreed = agreement.agree_on_rates(local)
        throughput = {
            b: rate for b, rate in zip(self.buckets, agreed, strict=True) if rate is not None
        }
        choice = goodput.choose_by_goodput(
            micro,
            allowed,
            noise_scale=self._noise.simple,
            throughput=throughput,
            reference=self._lr.reference,
            margin=self.config.goodput_margin,
            min_efficiency=self.config.min_efficiency,
            model=self.config.throughput_model,
            measurable=self._measures_noise(micro),
        )
        kind = "keep" if choice.bucket == micro else "grow" if choice.bucket > micro else "shrink"
        figures = {"noise_scale": self._noise.simple, "goodput": choice.figures}
        # Hysteresis, as for memory's moves: a move must be chosen at `patience` checks in a row
        # (measured throughput wobbles, and every move may cost a compile). A grow into what
        # memory has just allowed already waited for memory's own streak.
        moving = kind != "keep" and not (kind == "grow" and memory.kind == "grow")
        wanted, streak = self._goodput_streak
        streak = streak + 1 if moving and wanted == choice.bucket else int(moving)
        self._goodput_streak = (choice.bucket, streak) if moving else (None, 0)
        if moving and streak < self.config.patience:
            return memory._replace(kind="keep", bucket=micro), figures
        self._goodput_streak = (None, 0)
        return memory._replace(kind=kind, bucket=choice.bucket, reason=choice.reason), figures

    def _refuse_grow(self, bucket: int) -> bool:
        """Logs a ``"reject"`` and returns True when ``bucket``'s compiled peak is too high."""
        compiled = self._compiler.peaks(self._policy_signature())
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
        """Re-plans the policy from the optimizer's signals (:func:`._replan.replan`); returns
        whether a switch was made or started.

        With ``precision_rule="speed"`` (:mod:`._precision_speed`) the planner lowers leaves
        only as far as memory needs, unless a lower precision may still prove faster here: then
        the budget's plan is taken as a trial, timed, and kept only if faster. ``for_memory``
        (a memory check found the step over the high-water mark) plans for memory alone and
        without hysteresis: relief cannot wait ``patience`` re-plans.

        A changed policy converts the optimizer state and forgets the measured peaks. With
        ``compile_in_background`` the new policy's step compiles on the worker thread first and
        the switch comes at the first step boundary after it is ready; a re-plan that comes due
        while another background compile waits runs as soon as that one is taken.
        """
        if self._compiler.busy:
            if self._replan_due_at is None and not for_memory:
                self._replan_due_at = self.step_count
            return False
        speed = self.config.precision_rule == "speed"
        if speed and self._trial is not None and not for_memory:
            return False  # the trial's verdict comes first
        due = self.step_count if self._replan_due_at is None else self._replan_due_at
        self._replan_due_at = None
        assert self.policy is not None  # re-planning starts from a policy
        micro = self._bucket.micro
        figures: dict[str, Any] = {"precision_rule": self.config.precision_rule}
        savings = None
        if speed:
            peak = self._known_peaks().get(micro)
            needed = precision_speed.savings_needed(
                self.policy,
                self.params,
                peak_bytes=peak,
                limit_bytes=self._bucket.limit,
                target=self.config.target,
            )
            if for_memory or self._lower_is_slower or not self._speed_trials:
                savings = needed
            num_micro = self._num_micro(micro)
            figures.update(
                savings_needed_bytes=needed,
                peak_bytes=peak,
                limit_bytes=self._bucket.limit,
                samples_per_second={
                    signature: rate
                    for (m, n, signature), rate in self._throughput.items()
                    if (m, n) == (micro, num_micro)
                },
            )
        result = replan_lib.replan(
            self.opt_state,
            self.params,
            self.plan,
            loss=self._last_loss,
            planner=self.config.planner,
            # The first plan leaves the all-fp32 start at once: hysteresis guards against
            # flipping back and forth between plans, and there is no earlier plan yet.
            hysteresis=not (self.config.is_first_replan(due) or for_memory),
            savings_needed=savings,
        )
        if not result.changed:
            self.plan = result.plan  # the hysteresis streaks move on
            return False
        figures.update(leaves_by_dtype=result.leaves_by_dtype, loss=self._last_loss)
        reason = "the planner chose another policy"
        if for_memory or (savings is not None and savings > 0):
            reason = (
                f"memory needs {figures['savings_needed_bytes']} B saved at micro-batch {micro}"
            )
        elif speed and savings is None and _lowers(self.policy, result.plan.policy):
            figures["speed_trial"] = True
            reason = "the accuracy budget allows lower precision: a trial times it against fp32"
        key = (micro, self._num_micro(micro), result.plan.policy)
        if self.config.compile_in_background and key not in self._compiler:
            self._compiler.start(key, reason, figures, plan=result.plan, opt_state=result.opt_state)
            self._log(
                "replan_decided",
                self.policy.signature,
                result.plan.policy.signature,
                f"{reason}; compiling its step in the background",
                **figures,
            )
            return True
        self._switch_policy(result.plan, reason, figures, opt_state=result.opt_state)
        return True

    def _lower_precision_for_memory(self) -> bool:
        """With ``precision_rule="speed"`` and precision planned: a re-plan for memory before a
        shrink; True when it switched (or started compiling) a policy that saves bytes."""
        if self.config.precision_rule != "speed" or self.config.replan_every is None:
            return False
        return self._replan(for_memory=True)

    def _judge_trial(self) -> None:
        """Keeps a lower-precision trial's policy when its steps measured faster, else goes back
        to the policy before it (:func:`._precision_speed.judge_trial`)."""
        trial = self._trial
        if trial is None:
            return
        if self._policy_signature() != trial.signature:
            self._trial = None  # a rollback, set_policy or a load left the trial's policy
            return
        moved = self._bucket.micro != trial.micro
        if trial.steps < self.config.check_every and not moved:
            return
        incumbent = None
        if not moved:
            key = (trial.micro, trial.num_micro, trial.previous_signature)
            incumbent = self._throughput.get(key)
        # Every host keeps or leaves the trial alike: each rate is the slowest process's.
        trial_rate, incumbent = agreement.agree_on_rates([trial.rate, incumbent])
        if trial_rate is not None and trial.rate is not None:
            trial = trial._replace(seconds=trial.samples / trial_rate)
        verdict = precision_speed.judge_trial(trial, incumbent, self.config.goodput_margin)
        self._trial = None
        new = trial.signature if verdict.keep else trial.previous_signature
        self._log("precision_trial", trial.signature, new, verdict.reason, **verdict.figures)
        if verdict.keep:
            return
        if incumbent is not None:
            self._lower_is_slower = True
        self._switch_policy(trial.previous, verdict.reason, verdict.figures)

    def _switch_policy(
        self, plan: PrecisionPlan, reason: str, figures: dict, *, opt_state: Any = None
    ) -> None:
        """Puts ``plan``'s policy in force: the optimizer state converted (``opt_state`` when it
        is already), a ``"replan"`` logged, the measured peaks (the old policy's) forgotten."""
        assert self.policy is not None  # re-planning starts from a policy
        self._log("replan", self.policy.signature, plan.policy.signature, reason, **figures)
        if opt_state is None:
            opt_state = convert_state(self.opt_state, plan.policy)
        self.opt_state = self._place(opt_state)
        if figures.get("speed_trial"):
            micro = self._bucket.micro
            self._trial = precision_speed.PolicyTrial(
                self.plan,
                self._policy_signature(),
                self._signature_of(plan),
                micro,
                self._num_micro(micro),
            )
        self.plan = plan
        self._bucket.measured = {}

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
                self._bucket.micro = bucket
        if self._replan_due_at is not None:
            self._flush()  # a re-plan reads what the queued steps produce
            self._replan()

    def _call_off_background(self) -> None:
        """Forgets a background compile's switch and a re-plan waiting for it (``set_policy``
        and ``load_state_dict`` set the state themselves)."""
        self._compiler.cancel()
        self._replan_due_at = None
        self._trial = None

    def _on_out_of_memory(self, micro: int, tried: list[str], error: BaseException) -> None:
        """Charges an out-of-memory error to ``micro``, the bucket its step ran at."""
        decision = self._bucket.retry_after_out_of_memory(
            micro, step=self.step_count, tried=tried, error=error
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
        noise = learning_rate.noise_before(
            self._recent_noise, self.step_count, self.config.steps_in_flight
        )
        if not self._lr.is_current(samples, noise):
            change = self._lr.follow(self.opt_state, samples, noise)
            if change.new != change.old and samples != change.old_batch:
                self._log_learning_rate(change, samples, noise)
            if self._lr.base_lr is not None:
                self.opt_state = self._place(change.opt_state)
        if self._lr.moves_schedule:
            self.opt_state = self._place(self._lr.at_progress(self.opt_state, self._progress))

    def _log_learning_rate(
        self,
        change: learning_rate.LearningRateChange,
        samples: int,
        noise: goodput.NoiseScale | None,
    ) -> None:
        """Logs a batch's change of the rate (``"learning_rate"``, the rate itself, where the
        state holds it) or of the update's factor (``"update_scale"``)."""
        rule = f"{self.config.lr_scaling} rule"
        figures: dict[str, Any] = {
            "factor": change.new,
            "batch": samples,
            "reference_batch": self._lr.reference,
        }
        if self.config.lr_scaling == "adascale":
            rule = f"AdaScale gain (S = {samples / self._lr.reference:.4g})"
            figures["noise_scale"] = None if noise is None else noise.simple
        old_rate, new_rate = self._lr.rate(change.old), self._lr.rate(change.new)
        if old_rate is not None and new_rate is not None:
            # The rate itself, so that a log reader sees what the optimizer really uses.
            self._log(
                "learning_rate",
                old_rate,
                new_rate,
                f"{rule} for batch {samples}: {self._lr.base_lr:.4g} (tuned at reference batch "
                f"{self._lr.reference}) x {change.new:.4g}",
                tuned_learning_rate=self._lr.base_lr,
                **figures,
            )
        else:
            self._log(
                "update_scale",
                change.old,
                change.new,
                f"{rule} for batch {samples} against reference batch {self._lr.reference}; the "
                "rate is not an injected constant, so the update is multiplied instead",
                **figures,
            )

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
            opt_state = self.opt_state
        step = training.make_train_step(
            self._loss,
            self.tx,
            policy=policy,
            num_micro=num_micro,
            seed=self._seed,
            loss_scaling=training.loss_scaling_for(policy, self.config.loss_scaling, opt_state),
            fused=self._fused(opt_state),
            split=self._splits(micro, num_micro),
            noise_weights="curvature" if self.config.noise_estimator == "hessian" else None,
        )
        args = training.abstract_step_arguments(
            (self.params, opt_state, self.model_state),
            self._feeder.abstract_batch(num_micro, micro),
            self.loss_scale,
        )
        return step, args

    def _fused(self, opt_state: Any) -> FusedTriAccel | None:
        """The optimizer's fused form the step updates with (``ControllerConfig.fused_update``).

        Raises:
          ValueError: the fused form cannot fuse the optimizer (reason named).
        """
        fused = self.config.fused_update
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
        self.timings["compile"] += new.seconds
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

    def _measured_micro(self, step: records.PendingStep) -> int:
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
        """Whether a step runs its one micro-batch as two halves, to measure the noise scale
        (``ControllerConfig.splits_steps``); an odd micro-batch cannot be halved and runs whole,
        without an estimate."""
        return self.config.splits_steps and num_micro == 1 and micro % 2 == 0

    def _known_peaks(self) -> dict[int, int]:
        """Peak bytes per bucket under the current policy (see ``BucketTracker.known_peaks``)."""
        return self._bucket.known_peaks(self._compiler.peaks(self._policy_signature()))

    def _policy_signature(self) -> str:
        return self._signature_of(self.plan)

    @staticmethod
    def _signature_of(plan: PrecisionPlan | None) -> str:
        return "none" if plan is None else plan.policy.signature

    def _device_seconds(self) -> float:
        return self.timings["step"] + self.timings["compile"] + self.timings["data"]

    def _place(self, tree: Any) -> Any:
        return self._feeder.place(tree)

    def _check_loss_structure(self) -> None:
        batch = self._feeder.abstract_batch(1, self._bucket.micro)
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), batch)
        training.check_loss_structure(self._loss, self.params, self.model_state, batch, self.policy)

    def _log(self, kind: str, old: Any, new: Any, reason: str, **figures: Any) -> None:
        self.events.append(events_lib.Event(self.step_count, kind, old, new, reason, figures))
        logging_lib.log_event(self.events[-1])


def _lowers(before: PrecisionPolicy, after: PrecisionPolicy) -> bool:
    """Whether ``after`` computes some leaf in fewer bytes than ``before`` does."""
    return any(
        carried_itemsize(after.compute(path)) < carried_itemsize(before.compute(path))
        for path in after
    )
