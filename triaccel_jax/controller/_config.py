"""``ControllerConfig``: the controller's settings as one frozen, validated value (docs/design.md §5).

Everything :class:`triaccel_jax.Controller` takes as a keyword that is a setting rather than an
object it works on (params, data, optimizer, probe, mesh, policy, callback) lives here, checked
once when the config is made, so a bad setting fails before anything is compiled, and the
controller's parts read their settings from one place.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

from triaccel_jax._src import caller
from triaccel_jax._src import validation
from triaccel_jax.controller import _buckets as buckets_lib
from triaccel_jax.precision import PlannerConfig
from triaccel_jax.transforms import FusedTriAccel
from triaccel_jax.transforms import LossScaling

LR_SCALINGS = ("sqrt", "linear", "adascale", "sqrt_adascale", "none")
# The rules whose factor is AdaScale's gain (or its square root): the goodput rule's own.
GAIN_RULES = ("adascale", "sqrt_adascale")
BATCH_RULES = ("memory", "goodput")
NOISE_ESTIMATORS = ("simple", "hessian", "preconditioned")
# The step's weighted norms each estimator reads (make_train_step's `noise_weights`).
NOISE_WEIGHTS = {"simple": None, "hessian": "curvature", "preconditioned": "preconditioned"}
PRECISION_RULES = ("speed", "memory")
# The default noise horizon, in steps of the reference batch (see ControllerConfig.noise_horizon).
NOISE_HORIZON_STEPS = 200


# replan_every="auto" with an optimizer that holds the signals: a re-plan every 100 steps, the
# first at step 20 (the first plan leaves the all-fp32 start early; the accuracy study's rhythm).
AUTO_REPLAN_EVERY, AUTO_FIRST_REPLAN = 100, 20


class BatchLayout(NamedTuple):
    """The batch sizes a configuration allows on a given data-parallel width.

    Attributes:
      buckets: the allowed micro-batch sizes, ascending.
      start: the bucket to start at.
      global_batch: samples per step with ``keep_global_batch``, else None.
      reference_batch: the batch size the learning rate was tuned for.
    """

    buckets: tuple[int, ...]
    start: int
    global_batch: int | None
    reference_batch: int


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """The controller's settings: the keywords :class:`triaccel_jax.Controller` takes besides
    the objects it works on.

    Validated when made: every error names the setting and the value. Pass one to the controller
    as ``config=``, or pass the settings as keywords.

    Attributes:
      has_aux: whether the loss function returns ``(loss, aux)``.
      num_examples: the data set size when the data is a callable.
      min_batch: smallest batch bucket, >= 1.
      max_batch: largest batch bucket, >= ``min_batch``.
      batch_size: the bucket to start at (default ``min_batch``).
      reference_batch: the batch size the learning rate was tuned for (default the starting
        batch size).
      lr_scaling: how the learning rate follows the batch (docs/design.md §5):

        * None (the default): the rule the batch rule assumes, ``"sqrt_adascale"`` with
          ``batch_rule="goodput"`` (the noise measured as ``noise_estimator`` says; with
          ``"hessian"``, whose noise is not the gain's, ``"sqrt"``), ``"sqrt"`` otherwise
          (:attr:`learning_rate_rule`). Set ``"adascale"`` for SGD-like optimizers;
        * ``"sqrt"``: lr x sqrt(batch / reference), the square-root rule on the
          batch alone (Malladi et al., 2022, for Adam-like optimizers);
        * ``"sqrt_adascale"`` (for Adam-like optimizers under the goodput batch): lr x sqrt(r),
          the square root of AdaScale's gain below: the square-root rule for adaptive methods (Malladi et
          al., 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms", arXiv
          2205.10287) applied to the batch's statistical worth ``r = S * E(B)``, which is the
          goodput rule's efficiency model (AdaptDL scales Adam this way); schedules advance by
          ``r`` per step;
        * ``"adascale"`` (for SGD-like optimizers): lr x r, AdaScale's gain ``r = (tr(Sigma) +
          |G|^2) / (tr(Sigma) / S + |G|^2)`` with ``S = batch / reference``, from the smoothed
          gradient-noise estimates (Johnson et al., 2020, "AdaScale SGD", ICML); r = 1 before
          the noise is measured, r in [1, S]. A step's gain comes from the estimates after the
          step ``steps_in_flight + 1`` before it (always read by then, so the gain does not
          depend on how a run is cut into calls), rounded to within 0.5%: the rate is rewritten
          when the gain moves by about 1%, not every step. It measures the noise every step
          (as ``measure_noise_scale``). With
          ``keep_global_batch``, S = global_batch / reference_batch is fixed (1 by default: set
          a smaller ``reference_batch`` for a gain);
        * ``"linear"``: lr x (batch / reference) (Goyal et al., 2017, for SGD);
        * ``"none"``: the rate is left alone.

        ``"sqrt"``, ``"linear"`` and ``"none"`` ignore the gradient noise, which the goodput
        batch rule's efficiency model assumes the rate follows (docs/design.md §5.3): with
        ``batch_rule="goodput"`` they are taken with a ``UserWarning`` that says so.

        A schedule given as the injected rate (``optax.inject_hyperparams(opt)(learning_rate=
        schedule)``) is taken as tuned at the reference batch, in reference-batch steps: it
        advances by training progress, ``samples / reference_batch`` per step (or ``r`` per step
        with the AdaScale rules), not by steps
        (:attr:`triaccel_jax.Controller.schedule_progress`), and the rule's factor multiplies
        the update. A schedule given to the optimizer itself (``optax.adam(schedule)``) counts
        optax's own steps: the controller cannot move it.
      lr_hyperparam: name of the ``optax.inject_hyperparams`` hyperparameter holding the learning
        rate. When the optimizer state holds it as a constant, the scaled rate is written there
        (no re-jit). Otherwise (no injected rate, a rate driven by a schedule, or None) the
        step multiplies the update by the factor, which is the same for optimizers whose
        update is linear in the learning rate (SGD, Adam, AdamW, triaccel).
      weight_decay_hyperparam: name of an ``optax.inject_hyperparams`` constant weight decay to
        scale with the batch, or None (the default: left alone). Decoupled decay shrinks the
        weights by ``lr x wd`` a step; it is written as ``wd x (batch / reference) / factor``
        (``factor`` the learning rate's), so that the weights decay by the same amount per
        sample at every batch, the AdamW timescale in epochs that Power Lines (Bergsma et al.,
        2025, arXiv 2505.13738) finds best held fixed.
      keep_global_batch: keep the optimisation unchanged: every step uses ``global_batch``
        samples and only the micro-batch (the bucket) follows memory.
      global_batch: the fixed batch with ``keep_global_batch`` (default ``max_batch``); a
        multiple of every bucket.
      target: grow only to buckets predicted under this fraction of the limit, in (0, 1).
      high_water: shrink when the peak passes this fraction of the limit, in [target, 1].
      patience: consecutive checks a bucket change must be indicated at, >= 1.
      check_every: steps between memory checks, >= 1.
      replan_every: steps between precision re-plans (None: precision is not planned).
        ``"auto"`` (the default): every 100 steps from step 20 when the optimizer holds the
        signals the planner reads (``triaccel``, ``scale_by_curvature`` or the observer
        ``curvature_signals`` in its chain) and the controller is given no ``policy``, else
        not planned (:attr:`Controller.config` holds the settings resolved).
      first_replan: the step of the first re-plan (default ``replan_every``, 20 under
        ``"auto"``); later ones follow
        every ``replan_every`` steps. The first plan moves leaves at once (no hysteresis: there
        is no earlier plan to flip back to), so a small ``first_replan`` puts the planned policy
        in force early instead of after two full intervals.
      planner: the planner's settings, a :class:`triaccel_jax.precision.PlannerConfig` (e.g.
        ``PlannerConfig(budget=0.05)``).
      loss_scaling: the dynamic loss scale's rule, a :class:`triaccel_jax.transforms.LossScaling`
        (``initial_scale``, ``growth_interval``, ...), used while the policy computes a leaf in
        fp16 or fp8.
      data_axis: the mesh axis the batch is split over.
      seed: seed of the sampler's permutations and of the per-step ``rng``.
      steps_in_flight: steps :meth:`Controller.run` dispatches before reading a step's metrics,
        so the device never waits for the host between steps (0: read each step at once, as
        :meth:`Controller.step` always does). Each step in flight keeps its input state alive
        for an out-of-memory retry: one more copy of the training state per step.
      compile_in_background: compile the step a grown bucket or a re-planned policy needs on a
        worker thread while training continues on the current one, and switch at the first step
        after it is ready (False: compile in the step that decides, which is deterministic).
      compilation_cache: True (the default): the controller turns JAX's persistent compilation
        cache on for the process, so a second run of the same steps (a restarted job, the next
        notebook session) loads its executables instead of compiling them: in the user's cache
        folder (``$XDG_CACHE_HOME/triaccel_jax/jax``, else ``~/.cache/triaccel_jax/jax``), or in
        ``$TRIACCEL_COMPILATION_CACHE`` (``0`` or ``off`` turns it off). A cache folder set in
        JAX's own configuration (``jax_compilation_cache_dir``) is used as it is. False: JAX's
        settings are left alone.
      fused_update: None (default): the step runs ``tx.update`` and ``optax.apply_updates``.
        The optimizer's fused form (:func:`triaccel_jax.transforms.fused_triaccel` of the
        arguments ``tx`` was made with): the step writes the moments and the new params in one
        pass per leaf (:func:`triaccel_jax.transforms.fused_apply`; an error at construction if
        it cannot be fused).
      noise_horizon: the samples over which the gradient noise scale's averages forget: each
        step of ``B`` samples decays them by ``exp(-B / noise_horizon)``, so the memory is the
        same whatever the batch (docs/design.md §5.3). None (the default): 200 steps of the
        reference batch.
      measure_noise_scale: run a step of one micro-batch as two halves accumulated like
        micro-batches (the update is the same), so that every step measures the gradient noise
        scale; steps of several micro-batches always do. A step of one odd-sized micro-batch
        runs whole and carries no estimate (with ``batch_rule="goodput"`` and no estimate yet,
        the batch then moves to the next bucket memory allows, to measure it there).
      batch_rule: how the bucket moves at a memory check. ``"goodput"`` (the default): to the
        bucket of highest goodput (throughput from a model fitted to the timed steps x
        statistical efficiency from the gradient noise scale, Pollux) among those memory allows,
        no smaller than the reference batch and no larger than ``critical_multiple`` noise
        scales, moving only when the gain's lower confidence bound beats ``goodput_margin``
        (docs/design.md §5.3); it measures the noise scale every step (as
        ``measure_noise_scale``). ``"memory"``: to the
        largest bucket memory allows. Memory stays the cap either way, and out-of-memory
        recovery is the same. With ``keep_global_batch`` the batch is fixed and the micro-batch
        follows memory whatever the rule.
      goodput_every: the fraction of an epoch between goodput decisions, in (0, 1]: the
        decisions run on a sample clock (2% of an epoch by default, and at memory checks, every
        ``check_every`` steps), so each rests on about the same new evidence whatever the batch.
      goodput_margin: relative gain in goodput a goodput bucket move needs, >= 0.
      precision_rule: what a re-planned precision is for (with ``replan_every``). ``"speed"``
        (the default): leaves go lower where memory needs it (before the batch shrinks) or
        where a trial of the planner's policy measured its steps faster than the policy before
        it; otherwise they keep float32 (on a CPU, where bf16 is emulated, that is float32
        unless memory is short). ``"memory"``: every leaf the accuracy budget allows goes lower.
      speed_trials: whether ``precision_rule="speed"`` puts the budget's lower-precision plan on
        a timed trial. None (the default): on accelerators, not on a CPU, where XLA converts
        bf16 through float32 (the small CNN's bf16 step measured 2x slower there, and its
        compile took 3-4x longer, so a trial only costs time); True or False forces it.
      speed_trial_margin: relative gain in measured samples per second a lower precision on
        a speed trial needs to be kept, >= 0 (0.05 by default).
      critical_multiple: the goodput batch's cap, in noise scales: 1 (the default) keeps it at
        most about the critical batch (McCandlish et al., 2018), > 0.
      assumed_step_time: ``(fixed_seconds, seconds_per_sample)``: goodput decides with this
        model of step time instead of the one fitted to the measured steps, e.g. a GPU's to
        study the statistics alone on a CPU; None (the default): measured.
      noise_estimator: the gradient noise scale goodput and ``StepInfo.noise_scale`` use:
        ``"simple"`` (the default), ``B_simple = tr(Sigma) / |G|^2``; ``"hessian"``, ``B_noise =
        tr(H Sigma) / (G^T H G)`` with each leaf's norms weighted by its mean curvature from the
        optimizer's store (McCandlish et al., 2018, eq. 2.8; it needs an optimizer that holds
        curvature, such as :func:`triaccel_jax.triaccel`); ``"preconditioned"``, the noise of
        Adam's preconditioned gradient ``g / (sqrt(nu) + eps)`` (AdaptDL's measure for Adam; it
        needs an optimizer that holds Adam's ``nu``).

    Example:
      >>> from triaccel_jax.controller import ControllerConfig
      >>> config = ControllerConfig(min_batch=16, max_batch=128, keep_global_batch=True)
      >>> config.layout(multiple=1)
      BatchLayout(buckets=(16, 32, 64, 128), start=16, global_batch=128, reference_batch=128)
      >>> ControllerConfig(target=1.0)
      Traceback (most recent call last):
      ...
      ValueError: `target` must be in (0.0, 1.0), got 1.0

    References:
      docs/design.md §5.
    """

    has_aux: bool = False
    num_examples: int | None = None
    min_batch: int = 16
    max_batch: int = 512
    batch_size: int | None = None
    reference_batch: int | None = None
    lr_scaling: str | None = None
    lr_hyperparam: str | None = "learning_rate"
    weight_decay_hyperparam: str | None = None
    keep_global_batch: bool = False
    global_batch: int | None = None
    target: float = 0.85
    high_water: float = 0.95
    patience: int = 2
    check_every: int = 10
    replan_every: int | str | None = "auto"
    first_replan: int | None = None
    planner: PlannerConfig = dataclasses.field(default_factory=PlannerConfig)
    loss_scaling: LossScaling = dataclasses.field(default_factory=LossScaling)
    data_axis: str = "data"
    seed: int = 0
    steps_in_flight: int = 1
    compile_in_background: bool = False
    compilation_cache: bool = True
    fused_update: FusedTriAccel | None = None
    noise_horizon: int | None = None
    measure_noise_scale: bool = False
    batch_rule: str = "goodput"
    goodput_every: float = 0.02
    goodput_margin: float = 0.05
    critical_multiple: float = 1.0
    assumed_step_time: tuple[float, float] | None = None
    precision_rule: str = "speed"
    speed_trials: bool | None = None
    speed_trial_margin: float = 0.05
    noise_estimator: str = "simple"

    def __post_init__(self) -> None:
        validation.check_in_range(
            "target", self.target, 0.0, 1.0, low_inclusive=False, high_inclusive=False
        )
        validation.check_in_range("high_water", self.high_water, self.target, 1.0)
        validation.check_integer("patience", self.patience, 1)
        validation.check_integer("check_every", self.check_every, 1)
        validation.check_integer("steps_in_flight", self.steps_in_flight, 0)
        if isinstance(self.replan_every, str) and self.replan_every != "auto":
            raise ValueError(
                f"`replan_every` must be a number of steps, 'auto' or None, got {self.replan_every!r}"
            )
        if self.replan_every is not None and self.replan_every != "auto":
            validation.check_integer("replan_every", self.replan_every, 1)
        if self.first_replan is not None:
            validation.check_integer("first_replan", self.first_replan, 1)
            if self.replan_every is None:
                raise ValueError("`first_replan` needs `replan_every` (precision is not planned)")

        if self.lr_scaling is not None:
            validation.check_choice("lr_scaling", self.lr_scaling, LR_SCALINGS)
        validation.check_choice("batch_rule", self.batch_rule, BATCH_RULES)
        validation.check_choice("precision_rule", self.precision_rule, PRECISION_RULES)
        validation.check_choice("noise_estimator", self.noise_estimator, NOISE_ESTIMATORS)
        movable = self.min_batch < self.max_batch
        if self.moves_by_goodput and movable and self.learning_rate_rule not in GAIN_RULES:
            caller.warn(
                f"batch_rule='goodput' with lr_scaling={self.learning_rate_rule!r}: goodput "
                "grows the batch where its efficiency model (Pollux) says a step of B samples "
                "makes AdaScale's gain in progress, and this rule does not scale the learning "
                "rate by that gain, so the batch it picks may train slower than predicted. Use "
                "lr_scaling='sqrt_adascale' (Adam-like optimizers) or 'adascale' (SGD-like), "
                "with noise_estimator 'simple' or 'preconditioned'",
            )
        if self.noise_estimator == "hessian" and self.lr_scaling in GAIN_RULES:
            raise ValueError(
                f"lr_scaling={self.lr_scaling!r} takes AdaScale's gain from the plain gradient "
                "variance, and noise_estimator='hessian' measures a curvature-weighted one: use "
                "noise_estimator='simple' or 'preconditioned' with AdaScale's gain, or "
                "lr_scaling='sqrt'"
            )
        validation.check_in_range(
            "goodput_every", self.goodput_every, 0.0, 1.0, low_inclusive=False
        )
        validation.check_in_range("goodput_margin", self.goodput_margin, 0.0, float("inf"))
        validation.check_in_range("speed_trial_margin", self.speed_trial_margin, 0.0, float("inf"))
        validation.check_in_range(
            "critical_multiple", self.critical_multiple, 0.0, float("inf"), low_inclusive=False
        )
        if self.noise_horizon is not None:
            validation.check_integer("noise_horizon", self.noise_horizon, 1)
        if self.assumed_step_time is not None:
            assumed = self.assumed_step_time
            if not (
                isinstance(assumed, tuple)
                and len(assumed) == 2
                and all(isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in assumed)
                and assumed[0] + assumed[1] > 0
            ):
                raise ValueError(
                    "`assumed_step_time` must be (fixed_seconds, seconds_per_sample), two finite "
                    f"numbers >= 0 not both 0, got {assumed!r}"
                )
        if not isinstance(self.compilation_cache, bool):
            raise ValueError(
                f"`compilation_cache` must be True or False, got {self.compilation_cache!r}"
            )
        if self.speed_trials not in (None, True, False):
            raise ValueError(
                f"`speed_trials` must be None, True or False, got {self.speed_trials!r}"
            )
        if self.fused_update is not None and not isinstance(self.fused_update, FusedTriAccel):
            raise ValueError(
                "`fused_update` must be None or the optimizer's fused form, "
                f"triaccel_jax.transforms.fused_triaccel(...), got {self.fused_update!r}"
            )
        if self.global_batch is not None and not self.keep_global_batch:
            raise ValueError("`global_batch` is only used with keep_global_batch=True")
        for name, kind in (("planner", PlannerConfig), ("loss_scaling", LossScaling)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise TypeError(
                    f"`{name}` must be a {kind.__module__.rsplit('.', 1)[0]}.{kind.__name__}, "
                    f"e.g. {name}={kind.__name__}(...), got {type(value).__name__}"
                )

    def with_planning(self, holds_signals: bool) -> ControllerConfig:
        """These settings with ``replan_every="auto"`` resolved: every 100 steps from step 20
        (unless ``first_replan`` says otherwise) when ``holds_signals``, else None.

        Example:
          >>> from triaccel_jax.controller import ControllerConfig
          >>> resolved = ControllerConfig().with_planning(holds_signals=True)
          >>> resolved.replan_every, resolved.first_replan
          (100, 20)
          >>> print(ControllerConfig().with_planning(holds_signals=False).replan_every)
          None
        """
        if self.replan_every != "auto":
            return self
        if not holds_signals:
            if self.first_replan is not None:
                raise ValueError(
                    "`first_replan` is set but the optimizer holds no signals to plan precision "
                    "from (put triaccel_jax.curvature_signals() first in its chain)"
                )
            return dataclasses.replace(self, replan_every=None)
        first = AUTO_FIRST_REPLAN if self.first_replan is None else self.first_replan
        return dataclasses.replace(self, replan_every=AUTO_REPLAN_EVERY, first_replan=first)

    def noise_horizon_for(self, reference_batch: int) -> int:
        """The noise horizon in samples: ``noise_horizon``, or 200 reference batches."""
        if self.noise_horizon is not None:
            return self.noise_horizon
        return NOISE_HORIZON_STEPS * reference_batch

    @property
    def learning_rate_rule(self) -> str:
        """The learning-rate rule in force: ``lr_scaling``, or for None the one the batch rule
        assumes (``"sqrt_adascale"`` under goodput with a noise estimator of the plain or
        preconditioned gradient, ``"sqrt"`` otherwise)."""
        if self.lr_scaling is not None:
            return self.lr_scaling
        if self.moves_by_goodput and self.noise_estimator != "hessian":
            return "sqrt_adascale"
        return "sqrt"

    @property
    def moves_by_goodput(self) -> bool:
        """Whether goodput moves the batch (``batch_rule="goodput"`` and a batch free to move)."""
        return self.batch_rule == "goodput" and not self.keep_global_batch

    @property
    def replans_for_memory(self) -> bool:
        """Whether memory pressure re-plans precision before it shrinks the batch
        (``precision_rule="speed"`` with precision planned): the speed rule lowers leaves only
        as far as memory needs, so a step over the high-water mark asks for that first."""
        return self.precision_rule == "speed" and self.replan_every is not None

    @property
    def splits_steps(self) -> bool:
        """Whether a step of one (even) micro-batch runs as two halves, to measure the noise
        scale (``measure_noise_scale``, goodput batch moves or AdaScale's gain need it)."""
        return (
            self.measure_noise_scale
            or self.moves_by_goodput
            or self.learning_rate_rule in GAIN_RULES
        )

    def replan_due(self, step: int) -> bool:
        """Whether a re-plan is due before ``step`` (steps done so far).

        Example:
          >>> from triaccel_jax.controller import ControllerConfig
          >>> config = ControllerConfig(replan_every=100, first_replan=20)
          >>> [s for s in range(1, 400) if config.replan_due(s)]
          [20, 120, 220, 320]
        """
        every = self.replan_every
        if not isinstance(every, int) or step <= 0:
            return False  # None: not planned; "auto" is resolved by the controller first
        first = every if self.first_replan is None else self.first_replan
        return step >= first and (step - first) % every == 0

    def is_first_replan(self, step: int) -> bool:
        """Whether the re-plan due before ``step`` is the first one (planned without hysteresis)."""
        first = self.replan_every if self.first_replan is None else self.first_replan
        return self.replan_every is not None and step == first

    def layout(self, multiple: int) -> BatchLayout:
        """The buckets, starting bucket, global batch and reference batch on ``multiple`` devices.

        Args:
          multiple: the data-parallel width every bucket must be a multiple of.

        Raises:
          ValueError: the range holds no bucket, ``batch_size`` is not a bucket, or
            ``global_batch`` is not a multiple of the starting bucket.
        """
        buckets = buckets_lib.bucket_sizes(self.min_batch, self.max_batch, multiple)
        start = buckets[0] if self.batch_size is None else self.batch_size
        if start not in buckets:
            below = [b for b in buckets if b < start]
            above = [b for b in buckets if b > start]
            nearest = " or ".join(str(b) for b in (below[-1:] + above[:1]))
            unit = "powers of two" if multiple == 1 else f"{multiple} (the devices) x powers of two"
            raise ValueError(
                f"`batch_size` {self.batch_size!r} is not one of the buckets {buckets}: the "
                f"buckets are the {unit} within [min_batch, max_batch] = [{self.min_batch}, "
                f"{self.max_batch}], so a step compiles once a size. Start at {nearest}"
            )
        global_batch = None
        if self.keep_global_batch:
            global_batch = buckets[-1] if self.global_batch is None else self.global_batch
            validation.check_integer("global_batch", global_batch, 1)
            buckets = tuple(b for b in buckets if global_batch % b == 0 and b <= global_batch)
            if start not in buckets:
                raise ValueError(
                    f"with keep_global_batch, `global_batch` ({global_batch}) must be a "
                    f"multiple of the starting bucket {start} (buckets {buckets})"
                )
        reference = self.reference_batch
        if reference is None:
            reference = global_batch if global_batch is not None else start
        reference = validation.check_integer("reference_batch", reference, 1)
        return BatchLayout(buckets, start, global_batch, reference)


_SETTINGS = frozenset(f.name for f in dataclasses.fields(ControllerConfig))


def resolve_config(
    config: ControllerConfig | None, settings: Mapping[str, Any], owner: str = "Controller"
) -> ControllerConfig:
    """The controller's settings from ``config=`` or from keywords (not both), or a clear error.

    Example:
      >>> from triaccel_jax.controller._config import ControllerConfig, resolve_config
      >>> resolve_config(None, {"min_batch": 8}) == ControllerConfig(min_batch=8)
      True
    """
    unknown = sorted(set(settings) - _SETTINGS)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, _SETTINGS, n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise TypeError(
            f"{owner} got unexpected keyword arguments {', '.join(hints)}; its settings are "
            f"{', '.join(sorted(_SETTINGS))} (the fields of ControllerConfig)"
        )
    if config is None:
        return ControllerConfig(**settings)
    if not isinstance(config, ControllerConfig):
        raise TypeError(f"`config` must be a ControllerConfig, got {type(config).__name__}")
    if settings:
        raise TypeError(
            f"pass the settings in `config` or as keywords, not both: {sorted(settings)}"
        )
    return config
