"""``Controller``: the host-side loop that adapts batch size and precision (docs/design.md §5).

Plain Python around pure jitted functions. Each decision is a pure function of measured figures
(:func:`triaccel_jax.controller.decide_bucket`, :func:`triaccel_jax.plan_precision`); the controller reads
the figures, takes the decisions, compiles one step per (micro-batch, micro-batches per step,
policy) and logs every decision as an :class:`triaccel_jax.controller.Event`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from triaccel_jax._src import validation
from triaccel_jax.controller import _agreement as agreement
from triaccel_jax.controller import _buckets as buckets_lib
from triaccel_jax.controller import _events as events_lib
from triaccel_jax.controller import _hyperparams as hyperparams
from triaccel_jax.controller import _memory_probe as memory_probe
from triaccel_jax.controller import _sampler as sampler_lib
from triaccel_jax.controller import _train_step as train_step
from triaccel_jax.precision import _planner as planner
from triaccel_jax.precision import _policy as policy_lib
from triaccel_jax.transforms import _loss_scaling as loss_scaling_lib
from triaccel_jax.transforms import _signals as signals_lib
from triaccel_jax.transforms import _state_conversion as state_conversion

STATE_FORMAT = "triaccel_jax.Controller"
STATE_VERSION = 1
LR_SCALINGS = ("sqrt", "linear", "none")


class OutOfMemoryError(RuntimeError):
    """The step ran out of memory at the smallest allowed batch size."""


class StepInfo(NamedTuple):
    """What one controller step did, as passed to the progress callback.

    Attributes:
      step: the number of steps completed, this one included.
      batch_size: samples this step trained (the global batch; after an out-of-memory retry,
        the batch drawn before the bucket shrank).
      micro_batch: samples per micro-batch (the batch bucket after the step); when it is
        smaller than ``batch_size``, ``batch_size // micro_batch`` micro-batches were
        accumulated.
      loss: the step's mean loss.
      metrics: the step's mean metrics (``loss`` included), as Python floats, with
        ``skipped`` (1.0 when loss scaling found a non-finite gradient and the step changed
        nothing) and ``loss_scale`` (the scale the loss was multiplied by, 1.0 unscaled).
      peak_bytes: the current bucket's peak bytes as last measured or compiled, or None.
      limit_bytes: the memory limit at the last check, or None.
      events: the events logged during this step.
      seconds: wall time of the step, compiles included.
    """

    step: int
    batch_size: int
    micro_batch: int
    loss: float
    metrics: dict[str, float]
    peak_bytes: int | None
    limit_bytes: int | None
    events: tuple[events_lib.Event, ...]
    seconds: float


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is XLA running out of memory (``RESOURCE_EXHAUSTED``).

    Example:
      >>> import jax
      >>> from triaccel_jax.controller import is_out_of_memory
      >>> is_out_of_memory(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: 2.0GiB"))
      True
      >>> is_out_of_memory(ValueError("RESOURCE_EXHAUSTED"))  # only XLA's runtime errors
      False
    """
    if not isinstance(error, jax.errors.JaxRuntimeError):
        return False
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _nbytes(tree: Any) -> int:
    return sum(
        int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
    )


def _abstract(x: Any) -> Any:
    if isinstance(x, jax.Array):
        weak = getattr(x, "weak_type", False)  # typed PRNG keys have none
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=weak)
    return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)


def _strong(x: Any) -> Any:
    """``x`` as a committed, non-weakly-typed jax array, so compiled steps accept it every time."""
    if isinstance(x, jax.Array):
        return jax.lax.convert_element_type(x, x.dtype) if getattr(x, "weak_type", False) else x
    return jnp.asarray(np.asarray(x))


class Controller:
    """Trains with a batch size that follows free memory and a precision policy that follows curvature.

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
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      num_examples: the data set size when ``data`` is a callable.
      min_batch: smallest batch bucket, >= 1.
      max_batch: largest batch bucket, >= ``min_batch``.
      batch_size: the bucket to start at (default ``min_batch``).
      reference_batch: the batch size the learning rate was tuned for (default the starting
        batch size).
      lr_scaling: ``"sqrt"`` (lr x sqrt(batch / reference)), ``"linear"`` or ``"none"``.
      lr_hyperparam: name of the ``optax.inject_hyperparams`` hyperparameter holding the learning
        rate. When the optimizer state holds it as a constant, the scaled rate is written there
        (no re-jit). Otherwise (no injected rate, a rate driven by a schedule, or None) the
        step multiplies the update by the factor, which is the same for optimizers whose
        update is linear in the learning rate (SGD, Adam, AdamW, triaccel).
      keep_global_batch: keep the optimisation unchanged: every step uses ``global_batch``
        samples and only the micro-batch (the bucket) follows memory.
      global_batch: the fixed batch with ``keep_global_batch`` (default ``max_batch``); a
        multiple of every bucket.
      probe: the memory probe; default :func:`triaccel_jax.controller.default_memory_probe`.
      target: grow only to buckets predicted under this fraction of the limit, in (0, 1).
      high_water: shrink when the peak passes this fraction of the limit, in [target, 1].
      patience: consecutive checks a bucket change must be indicated at, >= 1.
      check_every: steps between memory checks, >= 1.
      replan_every: steps between precision re-plans (None: precision is not planned).
      policy: the starting precision policy (default all fp32 when re-planning).
      planner_options: keyword arguments of :func:`triaccel_jax.plan_precision` (e.g.
        ``budget``, ``allowed``, ``patience``).
      loss_scaling: keyword arguments of the dynamic loss scale (``initial_scale``,
        ``growth_interval``, ``growth_factor``, ``backoff_factor``, ``min_scale``,
        ``max_scale``, as for :func:`triaccel_jax.transforms.dynamic_loss_scale`), used while the policy
        computes a leaf in fp16 or fp8.
      mesh: a ``jax.sharding.Mesh`` for data parallelism: batches are sharded over
        ``data_axis``, whose size every bucket is a multiple of; params and states not already
        on the mesh are replicated.
      data_axis: the mesh axis the batch is split over.
      seed: seed of the sampler's permutations and of the per-step ``rng``.
      callback: called with a :class:`StepInfo` after every step (e.g. a progress bar).

    Attributes:
      params, opt_state, model_state: the training state after the last step.
      loss_scale: the dynamic loss scale's state (``scale``, ``good_steps``,
        ``skipped_steps``), updated only by steps that scale the loss.
      policy: the precision policy in force (None when precision is not planned).
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
        has_aux: bool = False,
        num_examples: int | None = None,
        min_batch: int = 16,
        max_batch: int = 512,
        batch_size: int | None = None,
        reference_batch: int | None = None,
        lr_scaling: str = "sqrt",
        lr_hyperparam: str | None = "learning_rate",
        keep_global_batch: bool = False,
        global_batch: int | None = None,
        probe: memory_probe.MemoryProbe | None = None,
        target: float = 0.85,
        high_water: float = 0.95,
        patience: int = 2,
        check_every: int = 10,
        replan_every: int | None = None,
        policy: policy_lib.PrecisionPolicy | None = None,
        planner_options: Mapping[str, Any] | None = None,
        loss_scaling: Mapping[str, Any] | None = None,
        mesh: jax.sharding.Mesh | None = None,
        data_axis: str = "data",
        seed: int = 0,
        callback: Callable[[StepInfo], None] | None = None,
    ) -> None:
        validation.check_callable("loss_fn", loss_fn)
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(
                f"`tx` must be an optax.GradientTransformation, got {type(tx).__name__}"
            )
        validation.check_in_range(
            "target", target, 0.0, 1.0, low_inclusive=False, high_inclusive=False
        )
        validation.check_in_range("high_water", high_water, target, 1.0)
        validation.check_integer("patience", patience, 1)
        validation.check_integer("check_every", check_every, 1)
        if replan_every is not None:
            validation.check_integer("replan_every", replan_every, 1)
        validation.check_choice("lr_scaling", lr_scaling, LR_SCALINGS)
        if callback is not None:
            validation.check_callable("callback", callback)

        self._mesh, self._data_axis = mesh, data_axis
        multiple = 1
        if mesh is not None:
            if data_axis not in mesh.shape:
                raise ValueError(
                    f"`data_axis` {data_axis!r} is not an axis of the mesh {dict(mesh.shape)}"
                )
            multiple = int(mesh.shape[data_axis])
        self.buckets = buckets_lib.bucket_sizes(min_batch, max_batch, multiple)
        start = self.buckets[0] if batch_size is None else batch_size
        if start not in self.buckets:
            raise ValueError(
                f"`batch_size` {batch_size!r} is not one of the buckets {self.buckets}"
            )
        self._keep_global = bool(keep_global_batch)
        if self._keep_global:
            self._global = self.buckets[-1] if global_batch is None else global_batch
            validation.check_integer("global_batch", self._global, 1)
            self.buckets = tuple(
                b for b in self.buckets if self._global % b == 0 and b <= self._global
            )
            if start not in self.buckets:
                raise ValueError(
                    f"with keep_global_batch, `global_batch` ({self._global}) must be a multiple "
                    f"of the starting bucket {start} (buckets {self.buckets})"
                )
        elif global_batch is not None:
            raise ValueError("`global_batch` is only used with keep_global_batch=True")
        self._micro = start
        reference = reference_batch if reference_batch is not None else self.batch_size
        validation.check_integer("reference_batch", reference, 1)
        self._reference = int(reference)
        self._lr_scaling = lr_scaling

        self._data, self._num_examples = self._check_data(data, num_examples)
        self.sampler = sampler_lib.ElasticSampler(self._num_examples, seed=seed)
        self._seed = seed
        self._base_key = jax.random.key(seed)

        self.tx = tx
        self.params = self._place(params)
        self.opt_state = self._place(tx.init(self.params) if opt_state is None else opt_state)
        self.model_state = self._place(model_state)
        self._has_model_state = model_state is not None
        self._loss_scaling = loss_scaling_lib.LossScaling(**dict(loss_scaling or {}))
        self.loss_scale = self._place(self._loss_scaling.init())
        self._loss = train_step.normalize_loss_fn(
            loss_fn, has_aux=has_aux, has_model_state=self._has_model_state
        )

        self._replan_every = replan_every
        self._planner_options = dict(planner_options or {})
        if replan_every is not None:
            signals_lib.signals(
                self.opt_state
            )  # raises, naming the problem, without triaccel state
            policy = policy or policy_lib.PrecisionPolicy.uniform(self.params)
        if policy is not None:
            policy_lib.check_policy(policy, self.params)
            if replan_every is not None:  # the moments' dtypes follow the planned policy
                self.opt_state = self._place(state_conversion.convert_state(self.opt_state, policy))
        self.policy = policy

        # The learning rate is scaled in the injected state when the optimizer holds it as a
        # constant; a scheduled one is recomputed every update, so the update is scaled instead.
        self._lr_hyperparam = lr_hyperparam
        found = None
        if lr_hyperparam is not None and lr_scaling != "none":
            found = hyperparams.find_hyperparam(self.opt_state, lr_hyperparam)
        self._base_lr = found.value if found is not None and not found.scheduled else None
        self._lr_factor = 1.0

        self.probe = memory_probe.default_memory_probe() if probe is None else probe
        if not callable(getattr(self.probe, "read", None)):
            raise TypeError("`probe` must have a read(*, batch_size) method (a MemoryProbe)")
        if callable(getattr(self.probe, "reset", None)):
            self.probe.reset()  # a probe used before: its earlier peaks are not this run's
        self._target, self._high_water, self._patience = target, high_water, patience
        self._check_every = check_every
        self._callback = callback

        self.step_count = 0
        self._ceiling: int | None = None
        self._grow_streak = self._shrink_streak = 0
        self._measured: dict[int, int] = {}
        self._compiled_peaks: dict[str, dict[int, int]] = {}
        self._limit: int | None = None
        self._last_loss: float | None = None
        self._compiled: dict[tuple[int, int, Any], Any] = {}
        self.events: list[events_lib.Event] = []
        self._train_state: tuple[Any, int] | None = None
        self.timings = {"step": 0.0, "compile": 0.0, "data": 0.0, "control": 0.0}
        self._check_loss_structure()
        self._log("start", None, self.batch_size, "controller created", buckets=list(self.buckets))
        self._set_learning_rate()

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
        the controller's batch scaling is its own and is applied again by whoever trains next.
        """
        if self._train_state is None:
            raise AttributeError("this controller was not made with Controller.from_train_state")
        template, start = self._train_state
        opt_state = self.opt_state
        if self._base_lr is not None:
            # The state holds the tuned rate, not this batch's scaled one, so that a controller
            # made from it again (or a plain loop) scales it once: round trips do not compound.
            opt_state = hyperparams.set_hyperparam(opt_state, self._lr_hyperparam, self._base_lr)
        changes = {
            "step": template.step + (self.step_count - start),
            "params": self.params,
            "opt_state": opt_state,
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
        if self.step_count > 0 and self.step_count % self._check_every == 0:
            self._check_memory()
        if self._replan_every and self.step_count > 0 and self.step_count % self._replan_every == 0:
            self._replan()
        indices = self.sampler.take(self.batch_size)
        metrics = self._run_with_retry(indices)
        self.step_count += 1
        if self._lr_factor != self._lr_factor_for(self.batch_size):
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

        Raises:
          ValueError: the policy does not cover the params.
        """
        if policy is not None:
            policy_lib.check_policy(policy, self.params)
            if self._replan_every is not None:
                self.opt_state = self._place(state_conversion.convert_state(self.opt_state, policy))
        if policy != self.policy:
            self._measured = {}  # measured peaks were for the old policy
        self.policy = policy

    def event_records(self) -> list[dict[str, Any]]:
        """The event log as flat dicts (``pandas.DataFrame(controller.event_records())``)."""
        return events_lib.event_records(self.events)

    def state_dict(self) -> dict[str, Any]:
        """The controller's own state as JSON-ready data, to save beside params and optimizer state.

        It holds the bucket, ceiling, hysteresis counters, memory figures, policy, learning-rate
        factor, step counter and the sampler's cursor; the per-step ``rng`` is derived from
        ``seed`` and the step, so a controller restored with :meth:`load_state_dict` (and the
        params and optimizer state of the same step) takes the same decisions.
        """
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "seed": self._seed,
            "buckets": list(self.buckets),
            "keep_global_batch": self._keep_global,
            "step": self.step_count,
            "micro_batch": self._micro,
            "ceiling": self._ceiling,
            "grow_streak": self._grow_streak,
            "shrink_streak": self._shrink_streak,
            "measured_peaks": {str(b): v for b, v in self._measured.items()},
            "compiled_peaks": {
                sig: {str(b): v for b, v in peaks.items()}
                for sig, peaks in self._compiled_peaks.items()
            },
            "limit_bytes": self._limit,
            "last_loss": self._last_loss,
            "lr_factor": self._lr_factor,
            "loss_scale": {k: np.asarray(v).item() for k, v in self.loss_scale._asdict().items()},
            "policy": None if self.policy is None else json.loads(self.policy.to_json()),
            "sampler": self.sampler.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from :meth:`state_dict`'s output (same data, seed and buckets).

        Raises:
          ValueError: the state is malformed or was saved by a controller configured differently.
        """
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"not a controller state: expected a mapping with format {STATE_FORMAT!r}"
            )
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"controller state version {state.get('version')!r} is not supported")
        for key, mine in (
            ("seed", self._seed),
            ("buckets", list(self.buckets)),
            ("keep_global_batch", self._keep_global),
        ):
            if state.get(key) != mine:
                raise ValueError(
                    f"the controller state was saved with {key}={state.get(key)!r}, this "
                    f"controller has {key}={mine!r}"
                )
        if state["micro_batch"] not in self.buckets:
            raise ValueError(f"saved micro_batch {state['micro_batch']!r} is not a bucket")
        self.sampler.load_state_dict(state["sampler"])
        self.step_count = int(state["step"])
        self._micro = int(state["micro_batch"])
        self._ceiling = state["ceiling"]
        self._grow_streak, self._shrink_streak = (
            int(state["grow_streak"]),
            int(state["shrink_streak"]),
        )
        self._measured = {int(b): int(v) for b, v in state["measured_peaks"].items()}
        self._compiled_peaks = {
            sig: {int(b): int(v) for b, v in peaks.items()}
            for sig, peaks in state["compiled_peaks"].items()
        }
        self._limit = state["limit_bytes"]
        self._last_loss = state["last_loss"]
        if state.get("loss_scale") is not None:  # absent from states saved before it existed
            self.loss_scale = self._place(
                loss_scaling_lib.LossScaleState(
                    jnp.float32(state["loss_scale"]["scale"]),
                    jnp.int32(state["loss_scale"]["good_steps"]),
                    jnp.int32(state["loss_scale"]["skipped_steps"]),
                )
            )
        if state["policy"] is not None:
            self.policy = policy_lib.PrecisionPolicy.from_json(json.dumps(state["policy"]))
            self.policy.check_matches(self.params)
        self._log("restore", None, self.step_count, "controller state loaded")
        self._set_learning_rate()

    # -- decisions --------------------------------------------------------------------------------

    def _known_peaks(self) -> dict[int, int]:
        """Peak bytes per bucket under the current policy: measured by the probe if it measures
        (they include whatever else holds memory), else XLA's compiled analyses. The two are not
        mixed: a linear fit through figures from different sources would be meaningless."""
        if self._measured:
            return dict(self._measured)
        return dict(self._compiled_peaks.get(self._policy_signature(), {}))

    def _fixed_bytes(self) -> int:
        """Bytes of a step's peak that do not grow with the batch, for a one-point prediction.

        A compiled step holds its state twice (inputs and outputs: nothing is donated, so that
        an out-of-memory step leaves the state intact) and one gradient per parameter. Measured
        peaks also include unknown others, so they are extrapolated as proportional to the
        batch, which over-predicts: growth is then cautious, never unsafe.
        """
        if self._measured:
            return 0
        state = _nbytes((self.params, self.opt_state, self.model_state))
        return 2 * state + _nbytes(self.params)

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
            target=self._target,
            high_water=self._high_water,
            patience=self._patience,
            ceiling=self._ceiling,
            fixed_bytes=self._fixed_bytes(),
            grow_streak=self._grow_streak,
            shrink_streak=self._shrink_streak,
        )
        self._grow_streak, self._shrink_streak = decision.grow_streak, decision.shrink_streak
        if decision.kind == "keep":
            return
        figures = {"peak_bytes": self._known_peaks().get(self._micro), "limit_bytes": limit}
        if decision.kind == "grow":
            self._compiled_step(decision.bucket, self._num_micro(decision.bucket))
            compiled_peak = None if self._measured else self._known_peaks().get(decision.bucket)
            if compiled_peak is not None and compiled_peak > self._high_water * limit:
                self._log(
                    "reject",
                    self._micro,
                    decision.bucket,
                    f"compiled peak of bucket {decision.bucket} is {compiled_peak / limit:.0%} of "
                    f"the limit, over the high-water mark {self._high_water:.0%}",
                    compiled_peak_bytes=compiled_peak,
                    limit_bytes=limit,
                )
                return
        self._log(decision.kind, self._micro, decision.bucket, decision.reason, **figures)
        self._micro = decision.bucket
        self._set_learning_rate()

    def _replan(self) -> None:
        new = planner.plan_precision(
            signals_lib.signals(self.opt_state),
            self.params,
            self.policy,
            loss=self._last_loss,
            **self._planner_options,
        )
        if new != self.policy:
            counts: dict[str, int] = {}
            for path in new:
                counts[new.compute(path)] = counts.get(new.compute(path), 0) + 1
            self._log(
                "replan",
                self.policy.signature,
                new.signature,
                "the planner chose another policy",
                leaves_by_dtype=counts,
                loss=self._last_loss,
            )
            self.opt_state = self._place(state_conversion.convert_state(self.opt_state, new))
            self._measured = {}  # measured peaks were for the old policy
        self.policy = new

    def _lr_factor_for(self, batch: int) -> float:
        ratio = batch / self._reference
        return {"sqrt": math.sqrt(ratio), "linear": ratio, "none": 1.0}[self._lr_scaling]

    def _set_learning_rate(self) -> None:
        factor = self._lr_factor_for(self.batch_size)
        if factor != self._lr_factor:
            self._log(
                "learning_rate",
                self._lr_factor,
                factor,
                f"{self._lr_scaling} scaling for batch {self.batch_size} against reference "
                f"{self._reference}",
            )
        self._lr_factor = factor
        if self._base_lr is not None:
            self.opt_state = self._place(
                hyperparams.set_hyperparam(
                    self.opt_state, self._lr_hyperparam, self._base_lr * factor
                )
            )

    # -- running ----------------------------------------------------------------------------------

    def _num_micro(self, micro: int) -> int:
        """Micro-batches per step at bucket ``micro`` (outside an out-of-memory retry)."""
        return self._global // micro if self._keep_global else 1

    def _policy_signature(self) -> str:
        return "none" if self.policy is None else self.policy.signature

    def _compiled_step(self, micro: int, num_micro: int) -> Any:
        key = (micro, num_micro, self.policy)
        if key in self._compiled:
            return self._compiled[key]
        start = time.perf_counter()
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
        batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                (num_micro, micro, *x.shape[1:]), x.dtype, sharding=self._batch_sharding()
            ),
            self._sample_spec,
        )
        args = jax.tree.map(_abstract, (self.params, self.opt_state, self.model_state))
        scalars = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.float32)
        scale = jax.tree.map(_abstract, self.loss_scale)
        compiled = jax.jit(step).lower(*args, batch, *scalars, scale).compile()
        self._compiled[key] = compiled
        peak = memory_probe.compiled_peak_bytes(compiled)
        if peak is not None and num_micro == self._num_micro(micro):
            self._compiled_peaks.setdefault(self._policy_signature(), {})[micro] = peak
        seconds = time.perf_counter() - start
        self.timings["compile"] += seconds
        self._log(
            "compile",
            None,
            f"{num_micro}x{micro}",
            f"first step with micro-batch {micro} x {num_micro}, policy {self._policy_signature()}",
            compiled_peak_bytes=peak,
            policy=self._policy_signature(),
            seconds=round(seconds, 3),
        )
        return compiled

    def _run_with_retry(self, indices: np.ndarray) -> dict[str, float]:
        tried = []
        while True:
            micro = self._micro
            num_micro = self._num_micro(micro) if self._keep_global else len(indices) // micro
            compiled = self._compiled_step(micro, num_micro)
            start = time.perf_counter()
            batch = self._device_batch(indices, num_micro, micro)
            self.timings["data"] += time.perf_counter() - start
            start = time.perf_counter()
            try:
                out = compiled(
                    self.params,
                    self.opt_state,
                    self.model_state,
                    batch,
                    np.int32(self.step_count),
                    np.float32(1.0 if self._base_lr is not None else self._lr_factor),
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
        smaller = [b for b in self.buckets if b < micro]
        self._ceiling = micro if self._ceiling is None else min(self._ceiling, micro)
        if not smaller:
            raise OutOfMemoryError(
                f"step {self.step_count} ran out of memory at the smallest batch bucket {micro} "
                f"(tried micro-batches {', '.join(tried)}; buckets {self.buckets}). Lower "
                f"`min_batch`, free device memory or use lower precision. XLA said: "
                f"{str(error).splitlines()[0]}"
            ) from error
        new = smaller[-1]
        self._log(
            "oom",
            micro,
            new,
            f"out of memory at micro-batch {micro}: re-running the same samples as micro-batches "
            f"of {new}; {micro} is now a ceiling",
            ceiling=self._ceiling,
        )
        self._micro = new
        self._grow_streak = self._shrink_streak = 0

    # -- data and placement ----------------------------------------------------------------------

    def _check_data(self, data: Any, num_examples: int | None) -> tuple[Any, int]:
        if callable(data):
            if num_examples is None:
                raise ValueError("`num_examples` is required when `data` is a callable")
            validation.check_integer("num_examples", num_examples, 1)
            one = data(np.arange(1))  # the shapes of one sample
            self._sample_spec = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct((0, *np.shape(x)[1:]), np.asarray(x).dtype), one
            )
            self._fetch = data
            return data, int(num_examples)
        leaves = jax.tree.leaves(data)
        if not leaves:
            raise ValueError("`data` holds no arrays")
        sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(
                f"every array in `data` needs the samples on its leading axis, of one size; got "
                f"leading sizes {sorted(map(str, sizes))}"
            )
        (size,) = sizes
        if size == 0:
            raise ValueError("`data` holds no samples")
        if num_examples is not None and num_examples != size:
            raise ValueError(f"`num_examples` ({num_examples}) does not match the data ({size})")
        host = jax.tree.map(np.asarray, data)
        self._sample_spec = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((0, *x.shape[1:]), x.dtype), host
        )
        self._fetch = lambda idx: jax.tree.map(lambda x: x[idx], host)
        return host, size

    def _batch_sharding(self) -> Any:
        if self._mesh is None:
            return None
        return NamedSharding(self._mesh, PartitionSpec(None, self._data_axis))

    def _device_batch(self, indices: np.ndarray, num_micro: int, micro: int) -> Any:
        grid = indices.reshape(num_micro, micro)
        sharding = self._batch_sharding()
        if sharding is None:
            return jax.tree.map(
                lambda x: jnp.asarray(x.reshape(num_micro, micro, *x.shape[1:])),
                self._fetch(indices),
            )
        # Each process fetches only the rows its devices hold (every process knows the global
        # indices, because all run the same sampler).
        specs, treedef = jax.tree.flatten(self._sample_spec)
        fetched: dict[tuple, list[Any]] = {}

        def rows(index: tuple, position: int) -> np.ndarray:
            part_indices = grid[index[:2]]
            key = (index[0].start, index[0].stop, index[1].start, index[1].stop)
            if key not in fetched:
                fetched[key] = jax.tree.leaves(self._fetch(part_indices.reshape(-1)))
            part = np.asarray(fetched[key][position])
            return part.reshape(*part_indices.shape, *part.shape[1:])

        arrays = [
            jax.make_array_from_callback(
                (num_micro, micro, *spec.shape[1:]), sharding, lambda index, i=i: rows(index, i)
            )
            for i, spec in enumerate(specs)
        ]
        return jax.tree.unflatten(treedef, arrays)

    def _place(self, tree: Any) -> Any:
        if tree is None:
            return None
        if self._mesh is None:
            return jax.tree.map(_strong, tree)
        replicated = NamedSharding(self._mesh, PartitionSpec())

        def place(x):
            x = _strong(x)
            if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == self._mesh:
                return x
            return jax.device_put(x, replicated)

        return jax.tree.map(place, tree)

    def _check_loss_structure(self) -> None:
        first = self._sample_spec
        batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((self._micro, *x.shape[1:]), x.dtype), first
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
