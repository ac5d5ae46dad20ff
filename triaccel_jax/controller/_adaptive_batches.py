"""``AdaptiveBatches``: the controller's batch and learning-rate decisions in your own loop.

The :class:`triaccel_jax.Controller` runs the training loop itself. Most JAX code keeps its own
loop (flax's examples, big_vision, levanter), so this is the same decisions without the loop, the
way AdaptDL's ``AdaptiveDataLoader`` keeps a PyTorch user's loop and only changes what the loader
yields (Qiao et al., 2021, "Pollux"): iterating yields each batch at the size decided for it with
the step's :class:`StepSettings` (the learning rate and weight decay for that batch, written into
the optimizer state by :meth:`StepSettings.apply`), and :meth:`AdaptiveBatches.report` takes what
the step returned (its loss and the two squared gradient norms of
:func:`triaccel_jax.training.value_and_grad_with_noise`) or the out-of-memory error it raised.

The decisions are the controller's own parts: the bucket's memory figures
(:class:`._bucket_tracker.BucketTracker`), goodput's noise scale, step times and choice
(:class:`._goodput_tracker.GoodputTracker`), the learning rate's owner
(:class:`._learning_rate.LearningRateScaling`) and the out-of-memory retry rule, on the same
sample clock and with the same saved state. Your step stays yours: a new batch size is a new
shape, which ``jax.jit`` compiles once per bucket. Precision is re-planned in a loop of your own
with :func:`triaccel_jax.controller.replan` (docs/guide.md, "Your own training loop").
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import inspect
import math
import time
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Annotated
from typing import Any
from typing import NamedTuple

import jax
import numpy as np

from triaccel_jax._src import caller
from triaccel_jax._src import validation
from triaccel_jax._src.readonly import ReadOnly
from triaccel_jax.controller import _agreement as agreement
from triaccel_jax.controller import _batch_parts as batch_parts
from triaccel_jax.controller import _config as config_lib
from triaccel_jax.controller import _events as events_lib
from triaccel_jax.controller import _learning_rate as learning_rate
from triaccel_jax.controller import _logging as logging_lib
from triaccel_jax.controller import _memory_probe as memory_probe
from triaccel_jax.controller import _out_of_memory as out_of_memory
from triaccel_jax.controller import _state_record as state_record
from triaccel_jax.controller._bucket_tracker import BucketTrackerState
from triaccel_jax.controller._feeding import BatchFeeder
from triaccel_jax.controller._goodput_tracker import GoodputTrackerState
from triaccel_jax.controller._sampler import ElasticSampler
from triaccel_jax.controller._sampler import SamplerState

STATE_FORMAT = "triaccel_jax.controller.AdaptiveBatches"

# The settings only the controller's own loop uses (it compiles and runs the step); given to
# AdaptiveBatches with another value than the default, each is refused with what to do instead.
_LOOP_ONLY = {
    "has_aux": "your step computes its own loss",
    "keep_global_batch": "your step does not accumulate micro-batches",
    "global_batch": "your step does not accumulate micro-batches",
    "replan_every": "re-plan precision in your loop with triaccel_jax.controller.replan",
    "first_replan": "re-plan precision in your loop with triaccel_jax.controller.replan",
    "steps_in_flight": "report() reads each step as it ends",
    "compile_in_background": "jax.jit compiles your step",
    "fused_update": "your step applies its own update",
    "measure_noise_scale": "value_and_grad_with_noise measures it in your step",
    "speed_trials": "precision is yours to re-plan",
    "speed_trial_margin": "precision is yours to re-plan",
    "noise_estimator": "report() takes the plain gradient's norms",
}

# Every setting of ControllerConfig that AdaptiveBatches reads or refuses.
_DEFAULTS = config_lib.ControllerConfig()

# The key step times are kept under: (batch, one micro-batch, your step).
_YOUR_STEP = "your step"


class StepSettings(NamedTuple):
    """What one step of your loop trains with, yielded beside its batch.

    Attributes:
      step: the steps trained before this one.
      epoch: the epoch the batch's first sample comes from (for an iterable, the passes over
        it begun before).
      batch_size: the samples in the batch.
      learning_rate: the injected learning rate for this batch (None when the optimizer holds
        no injected constant rate: then multiply the update by ``update_scale``).
      update_scale: the factor to multiply the update by (1.0 when the rate is written).
      hyperparams: every injected value :meth:`apply` writes, by name (the rate, and the weight
        decay with ``weight_decay_hyperparam``).
      schedule_count: ``(name, count)`` of an injected learning-rate schedule that advances by
        samples, the count its next update is evaluated at; None otherwise.
    """

    step: int
    epoch: int
    batch_size: int
    learning_rate: float | None
    update_scale: float
    hyperparams: Mapping[str, float]
    schedule_count: tuple[str, int] | None

    def apply(self, opt_state: Any) -> Any:
        """``opt_state`` holding this step's injected values (``optax.inject_hyperparams``):
        its rate and weight decay, and a schedule's count. Dtypes and shapes are kept, so a
        jitted step does not compile again.

        Example:
          >>> import optax
          >>> from triaccel_jax.controller import StepSettings
          >>> tx = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)
          >>> settings = StepSettings(0, 0, 64, 2e-3, 1.0, {"learning_rate": 2e-3}, None)
          >>> state = settings.apply(tx.init({"w": 0.0}))
          >>> round(float(state.hyperparams["learning_rate"]), 6)
          0.002
        """
        for name, value in self.hyperparams.items():
            opt_state = learning_rate.set_hyperparam(opt_state, name, value)
        if self.schedule_count is not None:
            opt_state = learning_rate.set_schedule_count(opt_state, *self.schedule_count)
        return opt_state


class _Pending(NamedTuple):
    """A batch yielded and not yet reported."""

    settings: StepSettings
    samples: Any  # the indices (arrays) or the batch itself (an iterable): put back after an OOM
    started: float


def _concat(parts: list[Any]) -> Any:
    if len(parts) == 1:
        return parts[0]
    return jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *parts)


def _rows(batch: Any) -> int:
    """The samples in a batch: its leaves' leading axis, which all must share."""
    sizes = {int(np.shape(leaf)[0]) if np.ndim(leaf) else -1 for leaf in jax.tree.leaves(batch)}
    if len(sizes) != 1 or -1 in sizes:
        raise ValueError(
            "every leaf of a batch from `data` must have the samples on its leading axis, and "
            f"all the same number of them; got leading sizes {sorted(sizes)} (-1: a scalar)"
        )
    return sizes.pop()


class _Stream:
    """Batches of any size cut from an iterable of batches of its own size (a tf.data, grain or
    any Python iterable): what is left of a batch waits for the next; one pass a epoch."""

    def __init__(self, data: Iterable[Any]) -> None:
        self._data = data
        self._iterator: Iterator[Any] | None = None
        self._held: collections.deque[Any] = collections.deque()  # batches, oldest first
        self._held_rows = 0
        self.passes = 0  # passes begun

    def begin_pass(self) -> None:
        """Starts a pass (an epoch) over the data.

        Raises:
          TypeError: a second pass over a one-shot iterator (a generator, say), which its first
            pass used up: the epoch would be silently empty.
        """
        if self.passes and iter(self._data) is self._data:
            raise TypeError(
                "`data` is a one-shot iterator (e.g. a generator): its first pass used it up, so "
                f"epoch {self.passes + 1} would be empty. Pass something iter() can start again "
                "once an epoch: a list of batches, a tf.data.Dataset or grain loader, or an "
                "object whose __iter__ returns a new generator (class Batches: def "
                "__iter__(self): return make_batches())"
            )
        self._iterator = iter(self._data)
        self.passes += 1

    def take(self, size: int) -> Any | None:
        """``size`` samples, or None when the pass ends first (the rest waits for the next)."""
        while self._held_rows < size:
            if self._iterator is None:
                return None
            try:
                batch = next(self._iterator)
            except StopIteration:
                self._iterator = None
                return None
            batch = jax.tree.map(np.asarray, batch)
            self._held.append(batch)
            self._held_rows += _rows(batch)
        parts, needed = [], size
        while needed:
            batch = self._held.popleft()
            rows = _rows(batch)
            if rows > needed:
                self._held.appendleft(jax.tree.map(lambda x, n=needed: x[n:], batch))
                batch = jax.tree.map(lambda x, n=needed: x[:n], batch)
                rows = needed
            parts.append(batch)
            needed -= rows
        self._held_rows -= size
        return _concat(parts)

    def put_back(self, batch: Any) -> None:
        self._held.appendleft(batch)
        self._held_rows += _rows(batch)


class AdaptiveBatches:
    """Your training loop, with the controller's batch size and learning rate.

    Iterating yields ``(batch, settings)`` until the end of an epoch: each batch is of the size
    decided for it (the bucket in force; goodput and memory move it at checks, every
    ``check_every`` steps), and ``settings`` is its :class:`StepSettings`. Train on the batch
    with ``settings.apply(opt_state)`` (the rate for that batch), then call :meth:`report` with
    what the step returned, or with the out-of-memory error it raised: the same samples then
    come again in smaller batches, so none is lost or repeated. Iterate again for the next
    epoch.

    Args:
      data: a pytree of arrays with the samples on the leading axis (drawn by an
        :class:`ElasticSampler`: each epoch a new permutation, a batch of any size at any step),
        a callable ``indices -> batch`` with ``num_examples`` given, or any iterable of batches
        (a ``tf.data`` or grain pipeline, a list): batches are cut and joined to the decided
        size, each pass over it one epoch; samples left at the end of a pass start the next.
      opt_state: the optimizer state: where the injected learning rate (and weight decay) the
        batch rule scales is found, the tuned values read from it.
      probe: the memory probe; default :func:`triaccel_jax.controller.default_memory_probe`.
      peak_bytes: your step's peak device bytes at a batch size, or None where unknown:
        ``triaccel_jax.precision.step_peak_bytes(train_step, params, opt_state, batch)`` gives
        XLA's compiled figure for your jitted step (any batch of the right structure). Asked once
        per batch size, for the bucket in force at a check. A bigger bucket's peak is predicted
        from the known ones, so without any (and a probe that measures none, as on a CPU) memory
        allows no growth, which a warning says once.
      callback: called with each :class:`Event` as it is logged (a decision, a rate change).
      clock: a monotonic clock in seconds, read when a batch is yielded and when its step is
        reported: the step's seconds (goodput's throughput) are the difference; default
        ``time.perf_counter``. Tests pass a virtual clock; a user may pass a monotonic clock of
        their own. An argument like ``probe``, not a
        :class:`~triaccel_jax.controller.ControllerConfig` setting (the config is a value,
        compared with the defaults here), and not saved state.
      config: the settings as one :class:`triaccel_jax.controller.ControllerConfig`; or
      **settings: the same settings as keywords (not both): ``min_batch``, ``max_batch``,
        ``batch_size`` (the start), ``reference_batch`` (the batch the rate was tuned at,
        default the start), ``batch_rule``, ``lr_scaling``, ``lr_hyperparam``,
        ``weight_decay_hyperparam``, ``check_every``, ``target``, ``high_water``, ``patience``,
        ``goodput_every``, ``goodput_margin``, ``critical_multiple``, ``assumed_step_time``,
        ``noise_horizon``, ``seed``, ``num_examples``. The settings of the controller's own
        loop (``replan_every``, ``steps_in_flight``, ...) are refused, each saying what to do.

    Raises:
      TypeError, ValueError: a setting is unknown, refused or invalid (named); ``data`` would
        be read as something else than meant (a list ``[x, y]`` of arrays, a generator
        function), or is a one-shot iterator iterated a second epoch (the fix named).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from triaccel_jax.controller import AdaptiveBatches, BudgetMemoryProbe
      >>> from triaccel_jax.training import value_and_grad_with_noise
      >>> rng = np.random.default_rng(0)
      >>> x = rng.normal(size=(512, 4)).astype(np.float32)
      >>> y = x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)
      >>> def loss(w, batch):
      ...     inputs, targets = batch
      ...     return jnp.mean((inputs @ w - targets) ** 2)
      >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05, momentum=0.9)
      >>> @jax.jit
      ... def train_step(w, opt_state, batch):
      ...     value, grads, norms = value_and_grad_with_noise(loss)(w, batch)
      ...     updates, opt_state = tx.update(grads, opt_state, w)
      ...     return optax.apply_updates(w, updates), opt_state, {"loss": value, **norms}
      >>> w = jnp.zeros(4)
      >>> opt_state = tx.init(w)
      >>> batches = AdaptiveBatches(
      ...     (x, y),
      ...     opt_state,
      ...     min_batch=16,
      ...     max_batch=64,
      ...     batch_size=32,
      ...     probe=BudgetMemoryProbe(2**30),
      ... )
      >>> for epoch in range(3):
      ...     for batch, settings in batches:
      ...         opt_state = settings.apply(opt_state)
      ...         w, opt_state, metrics = train_step(w, opt_state, batch)
      ...         batches.report(metrics)
      >>> batches.step_count, batches.epoch, bool(metrics["loss"] < 0.2)  # from 14 at w = 0
      (48, 3, True)

    References:
      Qiao et al., 2021, "Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized Deep
      Learning" (AdaptDL's adaptive data loader); McCandlish et al., 2018, "An Empirical Model
      of Large-Batch Training"; docs/design.md §5.
    """

    def __init__(
        self,
        data: Any,
        opt_state: Any,
        *,
        probe: memory_probe.MemoryProbe | None = None,
        peak_bytes: Callable[[int], int | None] | None = None,
        callback: Callable[[events_lib.Event], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        config: config_lib.ControllerConfig | None = None,
        **settings: Any,
    ) -> None:
        self._config = config = config_lib.resolve_config(config, settings, "AdaptiveBatches")
        validation.check_callable("clock", clock)
        self._clock = clock
        refused = [
            f"{name} ({why})"
            for name, why in _LOOP_ONLY.items()
            if getattr(config, name) != getattr(_DEFAULTS, name)
        ]
        if refused:
            raise ValueError(
                "AdaptiveBatches takes the decisions only, not the controller's loop; these "
                f"settings belong to Controller: {'; '.join(refused)}"
            )
        if callback is not None:
            validation.check_callable("callback", callback)
        self._callback = callback
        self._stream: _Stream | None = None
        self._feeder: BatchFeeder | None = None
        self._sampler: ElasticSampler | None = None
        _check_data_form(data)
        is_arrays = callable(data) or _is_arrays(data)
        if is_arrays:
            self._feeder = BatchFeeder(data, config.num_examples, None, config.data_axis)
            self._sampler = ElasticSampler(self._feeder.num_examples, seed=config.seed)
        elif isinstance(data, Iterable):
            if config.num_examples is None:
                raise ValueError(
                    "`num_examples` is required with an iterable `data`: goodput decides on a "
                    "clock of samples, a fraction (goodput_every) of an epoch"
                )
            self._stream = _Stream(data)
        else:
            raise TypeError(
                "`data` must be a pytree of arrays (samples on the leading axis), a callable "
                f"indices -> batch, or an iterable of batches; got {type(data).__name__}"
            )
        num_examples = self._feeder.num_examples if self._feeder else config.num_examples
        assert num_examples is not None  # checked above
        layout = config.layout(1)
        self._buckets = layout.buckets
        self._bucket, self._lr, self._goodput = batch_parts.build_batch_parts(
            config,
            layout,
            opt_state,
            lag=0,  # each step is read (reported) before the next one is yielded
            num_examples=num_examples,
        )
        self._probe = memory_probe.prepare_probe(probe)
        if peak_bytes is not None:
            validation.check_callable("peak_bytes", peak_bytes)
        self._peak_bytes = peak_bytes
        self._peaks: dict[int, int] = {}  # peak_bytes' answers, by batch size
        self._step_count = 0
        self._epoch = 0
        self._last_loss: float | None = None
        self._pending: _Pending | None = None
        # The indices of failed steps (array data), first in line.
        self._put_back: collections.deque[np.ndarray] = collections.deque()
        self._events: list[events_lib.Event] = []
        self._rescale_said = False
        # Whether a state without the settings' values was warned about, and the values last
        # found in a reported state (reading them waits on the device: once per change only).
        self._unapplied_said = False
        self._applied_seen: Mapping[str, float] | None = None
        self._no_noise_said = False  # whether a report without the noise norms was warned about
        self._cannot_grow_said = False  # whether a check without memory figures was warned about
        self._log(
            "start",
            None,
            self._bucket.micro,
            f"adaptive batches created; {self._lr.rule()}",
            buckets=list(self._buckets),
            lr_rule=config.learning_rate_rule,
            reference_batch=self._lr.reference,
            tuned_learning_rate=self._lr.base_lr,
        )

    # -- the state, read-only ---------------------------------------------------------------------

    config = ReadOnly[config_lib.ControllerConfig](
        "The :class:`triaccel_jax.controller.ControllerConfig`."
    )

    step_count = ReadOnly[int]("The steps reported.")

    epoch = ReadOnly[int]("The epochs iterated to their end.")

    buckets = ReadOnly[tuple[int, ...]]("The batch sizes allowed, ascending.")

    @property
    def batch_size(self) -> int:
        """The batch size of the next batch."""
        return self._bucket.micro

    @property
    def events(self) -> list[events_lib.Event]:
        """The decisions so far (a copy), as the controller's :attr:`Controller.events`."""
        return list(self._events)

    @property
    def noise_scale(self) -> float | None:
        """The gradient noise scale averaged per sample, or None before any reported norms."""
        return self._goodput.noise_scale

    @property
    def noise_interval(self) -> tuple[float, float] | None:
        """The noise scale's 95% interval, or None before it is known."""
        return self._goodput.noise_interval

    # -- the loop ---------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[Any, StepSettings]]:
        """Yields ``(batch, settings)`` to the end of the epoch (:class:`AdaptiveBatches`)."""
        if self._stream is not None:
            self._stream.begin_pass()
        start_epoch = self._epoch
        while True:
            self._check_reported()
            if self._step_count > 0 and self._step_count % self._config.check_every == 0:
                self._check()
            started = self._clock()
            taken = self._take(self._bucket.micro, start_epoch)
            if taken is None:
                break
            batch, samples, epoch = taken
            noise = self._goodput.noise_before(self._step_count)
            values, event = self._lr.values_for(_rows(batch), noise)
            if event is not None:
                self._log(event.kind, event.old, event.new, event.reason, **event.figures)
                self._say_rescaled(event.reason, by_update_scale=event.kind == "update_scale")
            settings = StepSettings(
                self._step_count,
                epoch,
                _rows(batch),
                self._lr.rate(),
                self._lr.update_multiplier(),
                values,
                self._lr.schedule_count(),
            )
            self._pending = _Pending(settings, samples, started)
            yield batch, settings
        self._epoch = start_epoch + 1

    def _take(self, size: int, start_epoch: int) -> tuple[Any, Any, int] | None:
        """The next ``size`` samples as ``(batch, samples to put back, epoch)``; None at the end
        of the epoch (arrays: its last sample served; an iterable: its pass ended)."""
        if self._stream is not None:
            batch = self._stream.take(size)
            return None if batch is None else (batch, batch, self._stream.passes - 1)
        assert self._sampler is not None and self._feeder is not None
        parts, needed = [], size
        while self._put_back and needed:
            indices = self._put_back.popleft()
            if len(indices) > needed:
                self._put_back.appendleft(indices[needed:])
                indices = indices[:needed]
            parts.append(indices)
            needed -= len(indices)
        if not parts and self._sampler.epoch > start_epoch:
            return None
        epoch = self._sampler.epoch
        if needed:
            parts.append(self._sampler.take(needed))
        indices = np.concatenate(parts)
        return self._feeder.host_batch(indices), indices, epoch

    def _check_reported(self) -> None:
        if self._pending is not None:
            raise RuntimeError(
                f"step {self._pending.settings.step}'s batch was not reported: call "
                "AdaptiveBatches.report(metrics) after each step (or report(error=...) when it "
                "ran out of memory) before taking the next batch"
            )

    def report(
        self,
        metrics: Mapping[str, Any] | None = None,
        *,
        error: BaseException | None = None,
        opt_state: Any = None,
    ) -> None:
        """Reads the step of the last batch yielded: its metrics, or the error it raised.

        Args:
          metrics: what the step returned, a mapping of scalars (on the device or not): its
            ``loss`` (optional), and ``grad_sq_norm`` and ``micro_grad_sq_norm``, the squared
            norms of the batch's gradient and of its halves' (from
            :func:`triaccel_jax.training.value_and_grad_with_noise`), from which the gradient
            noise scale and goodput's batch are estimated; without them the batch moves for
            memory alone and the rate by the batch rule's noise-free form. Reading them waits
            for the step to end: the step's time is measured from the batch's fetch to here.
          error: the error the step raised instead: an out-of-memory error makes the batch
            size's bucket a ceiling and moves below it, and the batch's samples come again
            first, in batches of the smaller size.
          opt_state: optionally, the optimizer state the step returned: its injected values are
            compared with the ones this step's settings gave, and a difference (the rate of a
            forgotten ``settings.apply(opt_state)``) is warned about once. Nothing else reads it.

        Raises:
          RuntimeError: no batch is waiting for its report.
          OutOfMemoryError: the step ran out of memory at the smallest bucket.
          BaseException: ``error`` itself, when it is not an out-of-memory error.
          ValueError: a metric is not a finite number where one is needed (named).
        """
        if self._pending is None:
            raise RuntimeError(
                "report() was called with no batch waiting: iterate over AdaptiveBatches for a "
                "batch, train on it, then report it once"
            )
        pending, self._pending = self._pending, None
        settings = pending.settings
        if error is not None:
            if not out_of_memory.is_out_of_memory(error):
                raise error
            # First in line: before any samples put back earlier (a part of them failed).
            if self._stream is not None:
                self._stream.put_back(pending.samples)
            else:
                self._put_back.appendleft(pending.samples)
            decision = self._bucket.retry_after_out_of_memory(
                settings.batch_size,
                step=settings.step,
                tried=[f"1x{settings.batch_size}"],
                error=error,
            )
            self._log(
                "oom",
                settings.batch_size,
                decision.bucket,
                decision.reason,
                ceiling=decision.ceiling,
            )
            return
        if opt_state is not None:
            self._check_applied(settings, opt_state)
        values = {k: float(v) for k, v in jax.device_get(dict(metrics or {})).items()}
        seconds = self._clock() - pending.started
        norms = None
        if "grad_sq_norm" in values or "micro_grad_sq_norm" in values:
            norms = (
                _finite(values, "grad_sq_norm"),
                _finite(values, "micro_grad_sq_norm"),
            )
        if norms is None:
            self._say_no_noise()
        samples = settings.batch_size
        self._goodput.observe_noise(settings.step, norms, batch=samples, micro=samples // 2)
        self._goodput.observe_throughput((samples, 1, _YOUR_STEP), seconds=seconds)
        if math.isfinite(values.get("loss", math.nan)):
            self._last_loss = values["loss"]
        self._lr.advance(samples)
        self._step_count += 1

    # -- decisions --------------------------------------------------------------------------------

    def _check(self) -> None:
        """The memory check and, under ``batch_rule="goodput"``, goodput's choice within it."""
        micro = self._bucket.micro
        reading = self._probe.read(batch_size=micro)
        peak, limit = agreement.agree_on_memory(reading.peak_bytes, reading.limit_bytes)
        if self._peak_bytes is not None and micro not in self._peaks:
            known = self._peak_bytes(micro)
            if known is not None:
                self._peaks[micro] = validation.check_integer(
                    "peak_bytes(batch)", known, 1, description="a positive number of bytes"
                )
        if limit is None or (peak is None and not self._peaks):
            self._say_cannot_grow(micro, limit_known=limit is not None)
        decision = self._bucket.check(peak, limit, compiled_peaks=self._peaks, fixed_bytes=0)
        figures: dict[str, Any] = {"peak_bytes": peak, "limit_bytes": limit}
        if self._config.moves_by_goodput and decision.kind != "shrink":
            decision, chosen = self._goodput.within_memory(
                decision,
                micro,
                self._buckets,
                self._bucket.ceiling,
                lambda b: (b, 1, _YOUR_STEP),
                measurable=micro % 2 == 0,
            )
            figures.update(chosen)
        if decision.kind == "keep":
            return
        self._log(decision.kind, micro, decision.bucket, decision.reason, **figures)
        self._bucket.move_to(decision.bucket)

    def _say_cannot_grow(self, micro: int, *, limit_known: bool) -> None:
        """Warns once that the batch cannot grow: memory allows no growth without figures."""
        if self._cannot_grow_said or micro >= self._buckets[-1]:
            return
        self._cannot_grow_said = True
        known = (
            "no peak for any batch size (a CPU measures none)"
            if limit_known
            else "no memory limit (a CPU reports none)"
        )
        caller.warn(
            f"AdaptiveBatches cannot grow the batch beyond {micro}: its memory probe reports "
            f"{known}, and a batch grows only where its peak is predicted to fit the limit. Pass "
            "peak_bytes=triaccel_jax.precision.step_peak_bytes(train_step, *its_arguments) (your "
            "jitted step and its arguments, the batch last: XLA's compiled peak at each size), "
            "and, where the probe knows no limit, probe=triaccel_jax.BudgetMemoryProbe("
            "limit_bytes). Said once."
        )

    def _check_applied(self, settings: StepSettings, opt_state: Any) -> None:
        """Warns once where ``opt_state`` holds another value than ``settings`` wrote."""
        if self._unapplied_said or settings.hyperparams == self._applied_seen:
            return
        self._applied_seen = settings.hyperparams
        for name, value in settings.hyperparams.items():
            found = learning_rate.find_hyperparam(opt_state, name)
            # A scheduled value is the schedule's to write; float32 holds the value to ~1e-7.
            if found is None or found.scheduled or math.isclose(found.value, value, rel_tol=1e-5):
                continue
            self._unapplied_said = True
            caller.warn(
                f"the optimizer state reported for step {settings.step} holds {name}="
                f"{found.value:.6g}, not the {value:.6g} its settings gave: the step trained at "
                "another rate than AdaptiveBatches decided (and its warnings say). Write them "
                "before each step: opt_state = settings.apply(opt_state). Said once."
            )
            return

    def _say_no_noise(self) -> None:
        """Warns once that goodput, which should move the batch, gets no noise to move it by."""
        if self._no_noise_said or not self._config.moves_by_goodput or len(self._buckets) < 2:
            return
        self._no_noise_said = True
        caller.warn(
            "AdaptiveBatches.report() got no noise norms ('grad_sq_norm' and "
            "'micro_grad_sq_norm'), so the goodput batch cannot move (memory alone can shrink "
            "it): compute the step's gradient with triaccel_jax.training."
            "value_and_grad_with_noise and report its norms with the loss, or set "
            "batch_rule='memory' to move the batch for memory alone. Said once."
        )

    def _say_rescaled(self, reason: str, *, by_update_scale: bool) -> None:
        if self._rescale_said:
            return
        self._rescale_said = True
        if by_update_scale:
            # The controller multiplies the update itself; in a loop of the user's own, nothing
            # does unless the step reads settings.update_scale.
            reason += (
                ": in your own loop nothing multiplies it for you, so multiply your step's "
                "update by settings.update_scale (or put the optimizer under "
                "optax.inject_hyperparams, and settings.apply(opt_state) writes the rate)"
            )
        caller.warn(
            f"AdaptiveBatches rescales the learning rate with the batch: {reason} "
            f"(reference_batch={self._lr.reference}: the batch the rate was tuned at; "
            "lr_scaling='none' leaves the rate alone). Said once: later changes are in "
            "AdaptiveBatches.events."
        )

    def _log(self, kind: str, old: Any, new: Any, reason: str, **figures: Any) -> None:
        event = events_lib.Event(self._step_count, kind, old, new, reason, figures)
        self._events.append(event)
        logging_lib.log_event(event)
        if self._callback is not None:
            self._callback(event)

    # -- the saved state --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything the decisions depend on, JSON-ready: steps, epochs, the bucket's, the
        goodput figures', the learning rate's and (array data) the sampler's state, and the
        samples of a step that ran out of memory, still to come. An iterable's position is the
        pipeline's own to save (tf.data and grain checkpoint theirs), and samples held between
        two of its batches are not saved."""
        if self._pending is not None:
            raise RuntimeError(
                "state_dict() between a batch and its report: report the step first, so that "
                "the saved state is the one after it"
            )
        return state_record.encode(self._saved_state())

    def _saved_state(self) -> AdaptiveBatchesState:
        """What :meth:`state_dict` encodes (call it between a report and the next batch)."""
        put_back = self._put_back if self._stream is None else ()
        return AdaptiveBatchesState(
            format=STATE_FORMAT,
            step=self._step_count,
            epoch=self._epoch,
            last_loss=self._last_loss,
            bucket=self._bucket.saved_state(),
            goodput=self._goodput.saved_state(),
            learning_rate=self._lr.saved_state(),
            sampler=None if self._sampler is None else self._sampler.saved_state(),
            put_back=tuple(tuple(np.asarray(i).tolist()) for i in put_back),
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from :meth:`state_dict`'s output (after a restart, with the same settings
        and data); nothing changes unless every part reads its own fields.

        Raises:
          ValueError: the state is malformed or of another object (the field named).
        """
        if isinstance(state, Mapping) and state.get("format", STATE_FORMAT) != STATE_FORMAT:
            raise ValueError(f"not an AdaptiveBatches state: format {state['format']!r}")
        what = "AdaptiveBatches state"
        saved = state_record.decode(AdaptiveBatchesState, state, "", what=what)
        if any(not indices for indices in saved.put_back):
            raise ValueError(
                f"{what}: `put_back` must hold lists of sample indices, got an empty one"
            )
        # Copies take the saved fields; they are kept once all have checked theirs.
        bucket, goodput = copy.copy(self._bucket), copy.copy(self._goodput)
        lr = copy.copy(self._lr)
        bucket.load_saved_state(saved.bucket)
        goodput.load_saved_state(saved.goodput)
        lr.load_saved_state(saved.learning_rate)
        sampler = None
        if self._sampler is not None:
            if saved.sampler is None:
                raise ValueError(
                    f"{what}: `sampler` is null, but these batches are drawn from array data"
                )
            sampler = copy.copy(self._sampler)
            sampler.load_saved_state(saved.sampler)
        self._bucket, self._goodput, self._lr = bucket, goodput, lr
        if sampler is not None:
            self._sampler = sampler
        self._step_count, self._epoch, self._last_loss = saved.step, saved.epoch, saved.last_loss
        self._put_back = collections.deque(
            np.asarray(indices, dtype=np.int64) for indices in saved.put_back
        )


def _finite(values: Mapping[str, float], name: str) -> float:
    if name not in values:
        raise ValueError(
            "report() got one of grad_sq_norm and micro_grad_sq_norm without the other: the "
            f"noise scale needs both ({name!r} is missing)"
        )
    value = values[name]
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"metric {name!r} must be a finite number >= 0, got {value!r}")
    return value


def _check_data_form(data: Any) -> None:
    """Refuses the forms of ``data`` that would be read as something else than meant.

    Raises:
      TypeError: a generator function (it would be called as ``indices -> batch``), or a list
        of arrays of one leading size and different shapes (``[x, y]``, read as a stream of
        two batches where a tuple ``(x, y)`` of samples was meant).
    """
    if inspect.isgeneratorfunction(data):
        raise TypeError(
            "`data` is a generator function, which would be called as `indices -> batch`: pass "
            "an iterable of batches that starts again each epoch (an object whose __iter__ "
            "returns your generator), or a function of an array of sample indices"
        )
    if (
        isinstance(data, list)
        and len(data) >= 2
        and all(isinstance(x, np.ndarray | jax.Array) and np.ndim(x) > 0 for x in data)
        and len({np.shape(x)[0] for x in data}) == 1
        and len({np.shape(x) for x in data}) > 1
    ):
        shapes = ", ".join(str(np.shape(x)) for x in data)
        raise TypeError(
            f"`data` is a list of arrays of one leading size and different shapes ({shapes}): "
            "a list is read as a stream of batches. For arrays of samples, such as inputs and "
            "labels, pass a tuple (x, y) or a dict"
        )


def _is_arrays(data: Any) -> bool:
    """Whether ``data`` is samples on a leading axis (an array, or a dict or tuple of them, as the
    controller takes) rather than an iterable of batches (a list, a generator, a pipeline)."""
    if isinstance(data, list | Iterator):
        return False
    leaves = jax.tree.leaves(data)
    return bool(leaves) and all(isinstance(leaf, np.ndarray | jax.Array) for leaf in leaves)


@dataclasses.dataclass(frozen=True)
class AdaptiveBatchesState:
    """What :class:`AdaptiveBatches` saves (:meth:`AdaptiveBatches.state_dict`).

    Attributes:
      format: ``"triaccel_jax.AdaptiveBatches"``.
      step: steps reported.
      epoch: the epoch being served.
      last_loss: the last loss reported, or None.
      bucket, goodput, learning_rate: the parts' saved states.
      sampler: the sampler's position (array data), or None (an iterable).
      put_back: the sample indices of steps that ran out of memory, still to come.
    """

    format: str
    step: Annotated[int, state_record.AtLeast(0)]
    epoch: Annotated[int, state_record.AtLeast(0)]
    last_loss: float | None
    bucket: BucketTrackerState
    goodput: GoodputTrackerState
    learning_rate: learning_rate.LearningRateState
    sampler: SamplerState | None
    put_back: tuple[tuple[int, ...], ...]
