"""Learning-rate scaling with the batch size, the injected rate it is written to, and schedules
that advance by samples.

When the batch changes, the learning rate follows it against the ``reference`` batch it was
tuned at (``lr_scaling``):

* ``"sqrt"`` (the default; for Adam-like optimizers): lr x sqrt(batch / reference). The square-root
  rule keeps an adaptive method's SDE approximation when the batch grows by ``kappa``: the rate
  grows by sqrt(kappa) (and ``1 - beta`` by ``kappa``, which the controller leaves alone) (Malladi
  et al., 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms", NeurIPS,
  arXiv 2205.10287; Granziol et al., 2022, "Learning Rates as a Function of Batch Size", JMLR).
* ``"linear"``: lr x (batch / reference), Goyal et al.'s rule for SGD, sound while the batch
  is under the critical batch.
* ``"adascale"`` (for SGD-like optimizers): AdaScale's gain (Johnson et al., 2020, "AdaScale
  SGD", ICML): with ``S = batch / reference``,

      r = (tr(Sigma) + |G|^2) / (tr(Sigma) / S + |G|^2)

  from the controller's smoothed gradient-noise estimates (:mod:`._goodput`), bias-corrected. It
  is ``S`` (linear scaling) where the gradient is all noise and 1 where there is none; it is 1
  before the noise is measured and lies in [1, S] (in [S, 1] for a batch under the reference).
* ``"sqrt_adascale"`` (for Adam-like optimizers under the goodput batch): lr x sqrt(r), the square root of
  AdaScale's gain, the square-root rule applied to the batch's statistical worth ``r = S * E(B)``
  (the goodput rule's efficiency); a schedule advances by ``r`` per step, as with
  ``"adascale"``.
* ``"none"``: the rate is left as it is.

The controller scales the rate by writing it into the state of ``optax.inject_hyperparams``,
which changes an array, not the compiled program (docs/design.md §5). That only works for a
*constant* hyperparameter: one that a schedule drives is recomputed from the schedule at every
update, so writing it would be silently undone; :func:`find_hyperparam` reports that case, and
the step then multiplies the update instead.

A schedule inside ``optax.inject_hyperparams`` is taken as tuned at the reference batch and
counted in reference-batch steps. The controller keeps the training *progress* in those units
(each step adds ``samples / reference``, or AdaScale's gain ``r``: its scale-invariant
iterations) and before each step writes ``floor(progress)`` into the count the schedule is
evaluated at (:func:`set_schedule_count`), so a change of batch does not change the schedule's
meaning. A schedule passed to the optimizer directly (``optax.adam(schedule)``) lives in optax's
own ``scale_by_schedule`` count, which advances one per step: the controller cannot move it
(it still scales the update by the batch rule).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from triaccel_jax._src.readonly import ReadOnly
from triaccel_jax.controller import _state_record as state_record
from triaccel_jax.controller._config import GAIN_RULES
from triaccel_jax.controller._noise_scale import NoiseScaleEstimate

_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
# AdaScale's gain is rounded to the nearest power of (1 + ADASCALE_RESOLUTION), i.e. to within
# half a percent: the rate (or the update's factor) is rewritten only when the gain moves by
# about 1%, not at every wobble of the smoothed estimates, and the rounded gain is a function of
# the estimates alone, so a rolled-back or resumed run writes the same rate.
ADASCALE_RESOLUTION = 0.01


def _is_injected(node: Any) -> bool:
    return isinstance(node, _INJECTED)


def _is_plain_schedule_state(state: Any) -> bool:
    """Whether ``state`` is the state optax keeps for a plain schedule given to
    ``inject_hyperparams`` (a ``WrappedScheduleState``: its step count alone)."""
    return getattr(state, "_fields", None) == ("count",)


class FoundHyperparam(NamedTuple):
    """Where a hyperparameter lives: its value, whether a schedule recomputes it, and whether
    that schedule is a plain one whose count the controller can set (:func:`set_schedule_count`)."""

    value: float
    scheduled: bool
    movable: bool = False


def find_hyperparam(opt_state: Any, name: str) -> FoundHyperparam | None:
    """The injected hyperparameter ``name``, or None when no injected state holds it.

    Raises:
      ValueError: several injected states hold ``name`` (ambiguous).
    """
    found = []
    for node in jax.tree.leaves(opt_state, is_leaf=_is_injected):
        if _is_injected(node) and name in node.hyperparams:
            states = getattr(node, "hyperparams_states", {}) or {}
            scheduled = name in states
            movable = scheduled and _is_plain_schedule_state(states[name])
            found.append(FoundHyperparam(float(node.hyperparams[name]), scheduled, movable))
    if len(found) > 1:
        raise ValueError(
            f"{len(found)} injected optimizer states hold a hyperparameter {name!r}; the "
            "controller cannot tell which is the learning rate (pass lr_hyperparam=None to "
            "scale the update instead)"
        )
    return found[0] if found else None


def set_hyperparam(opt_state: Any, name: str, value: float) -> Any:
    """``opt_state`` with the injected hyperparameter ``name`` set to ``value`` (its dtype kept)."""

    def replace(node: Any) -> Any:
        if not (_is_injected(node) and name in node.hyperparams):
            return node
        old = node.hyperparams[name]
        hyperparams = {**node.hyperparams, name: jnp.asarray(value, dtype=jnp.result_type(old))}
        return node._replace(hyperparams=hyperparams)

    return jax.tree.map(replace, opt_state, is_leaf=_is_injected)


def set_schedule_count(opt_state: Any, name: str, count: int) -> Any:
    """``opt_state`` whose next update evaluates the injected schedule of ``name`` at ``count``.

    ``optax.inject_hyperparams`` (optax >= 0.1.9) keeps a plain schedule's own step count in
    ``hyperparams_states[name].count`` (a ``WrappedScheduleState``); each update evaluates the
    schedule at that count, uses the value (and stores it in ``hyperparams[name]``), then adds
    one. Setting the count before an update therefore sets the point of the schedule that update
    uses. The state's own ``count`` (the step counter beside it, which older optax evaluated
    schedules at) is set too, so that the state reads as one count. Other hyperparameters'
    schedules keep counting steps; a stateful schedule (not a plain one) is left alone.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from triaccel_jax.controller._learning_rate import set_schedule_count
      >>> schedule = optax.linear_schedule(1.0, 0.0, 10)
      >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
      >>> state = set_schedule_count(tx.init(jnp.zeros(1)), "learning_rate", 4)
      >>> _, state = tx.update(jnp.ones(1), state)
      >>> round(float(state.hyperparams["learning_rate"]), 6), int(state.count)
      (0.6, 5)
    """

    def replace(node: Any) -> Any:
        if not (_is_injected(node) and name in node.hyperparams):
            return node
        node = node._replace(count=jnp.asarray(count, dtype=jnp.result_type(node.count)))
        states = getattr(node, "hyperparams_states", None) or {}
        state = states.get(name)
        if state is None or not _is_plain_schedule_state(state):
            return node
        moved = state._replace(count=jnp.asarray(count, dtype=jnp.result_type(state.count)))
        return node._replace(hyperparams_states={**states, name: moved})

    return jax.tree.map(replace, opt_state, is_leaf=_is_injected)


def lr_factor(batch: int, reference: int, scaling: str) -> float:
    """The learning-rate multiplier for ``batch`` against the ``reference`` batch, for the
    rules that depend on the batch alone (``"adascale"`` needs the noise: :func:`adascale_gain`).

    Example:
      >>> from triaccel_jax.controller._learning_rate import lr_factor
      >>> lr_factor(64, 16, "sqrt"), lr_factor(64, 16, "linear"), lr_factor(64, 16, "none")
      (2.0, 4.0, 1.0)
    """
    ratio = batch / reference
    rules = {"sqrt": math.sqrt(ratio), "linear": ratio, "none": 1.0}
    if scaling not in rules:
        raise ValueError(
            f"lr_factor takes a rule of {tuple(rules)}, got {scaling!r} (AdaScale's gain "
            "depends on the gradient noise: adascale_gain)"
        )
    return rules[scaling]


def adascale_gain(scale: float, noise: NoiseScaleEstimate | None) -> float:
    """AdaScale's gain for a batch ``scale`` times the reference, from smoothed noise estimates.

    ``r = (tr(Sigma) + |G|^2) / (tr(Sigma) / S + |G|^2)`` with ``S = scale`` and the estimates
    bias-corrected (divided by ``noise.weight``); equivalently ``(B + 1) / (B / S + 1)`` with
    ``B = tr(Sigma) / |G|^2`` the simple noise scale. A negative ``tr(Sigma)`` estimate counts
    as 0; a non-positive ``|G|^2`` with some variance as all noise (``r = S``). The gain is 1
    before any estimate and is clipped to [1, S] ([S, 1] for a batch under the reference).

    Args:
      scale: ``S``, the batch over the reference batch.
      noise: the averaged estimates
        (:class:`triaccel_jax.controller._noise_scale.NoiseScaleEstimate`), or None before any.

    Example:
      >>> from triaccel_jax.controller._noise_scale import NoiseScaleEstimate as Noise
      >>> from triaccel_jax.controller._learning_rate import adascale_gain
      >>> adascale_gain(4.0, None), adascale_gain(4.0, Noise(grad_sq=1.0, trace=0.0, weight=1.0))
      (1.0, 1.0)
      >>> adascale_gain(4.0, Noise(grad_sq=0.0, trace=1.0, weight=1.0))  # all noise: linear
      4.0
      >>> adascale_gain(4.0, Noise(grad_sq=0.5, trace=1.0, weight=0.5))  # |G|^2 1, tr 2: 3 / 1.5
      2.0

    References:
      Johnson, Agrawal, Gu and Guestrin, 2020, "AdaScale SGD: A User-Friendly Algorithm for
      Distributed Training", ICML, eq. 5.
    """
    if noise is None or noise.weight == 0.0:
        return 1.0
    grad_sq = noise.grad_sq / noise.weight
    trace = max(noise.trace / noise.weight, 0.0)
    if grad_sq <= 0.0:
        gain = scale if trace > 0.0 else 1.0
    else:
        gain = (trace + grad_sq) / (trace / scale + grad_sq)
    return min(max(gain, min(1.0, scale)), max(1.0, scale))


def round_gain(gain: float, scale: float) -> float:
    """``gain`` rounded to the nearest power of ``1 + ADASCALE_RESOLUTION`` (within half a
    percent), kept in [1, ``scale``]; a gain at a bound stays exactly there.

    Example:
      >>> from triaccel_jax.controller._learning_rate import round_gain
      >>> round_gain(1.0, 4.0), round(round_gain(2.003, 4.0), 4), round_gain(4.0, 4.0)
      (1.0, 2.0068, 4.0)
    """
    low, high = min(1.0, scale), max(1.0, scale)
    if gain <= low or gain >= high:
        return low if gain <= low else high
    step = math.log1p(ADASCALE_RESOLUTION)
    rounded = math.exp(round(math.log(gain) / step) * step)
    return min(max(rounded, low), high)


class LearningRateChange(NamedTuple):
    """A change of the learning-rate factor: before, after, the state carrying the rate, and
    the batch the factor before was for (None at the start)."""

    old: float
    new: float
    opt_state: Any
    old_batch: int | None = None


class RateEvent(NamedTuple):
    """A change of the rate (or of the update's factor) for the controller's event log: the
    event's kind (``"learning_rate"`` or ``"update_scale"``), old and new values, reason and
    figures."""

    kind: str
    old: float
    new: float
    reason: str
    figures: dict[str, Any]


class LearningRateScaling:
    """The learning rate's one owner: the tuned rate, the batch rule and the schedule clock.

    It keeps the rate a function of the batch size and a schedule advancing by samples; the
    controller asks it for each step's rate (:meth:`for_step`), adds each step's progress
    (:meth:`advance`) and saves it (:meth:`state_dict`, the ``"learning_rate"`` part of the
    controller's state). Its state is private and changed only by its methods.

    Args:
      opt_state: the optimizer state, searched for the injected rate ``hyperparam``.
      hyperparam: the name of the injected learning rate, or None (scale the update, and leave
        any schedule to count steps).
      scaling: ``"sqrt"``, ``"linear"``, ``"adascale"`` or ``"none"`` (the module's docstring
        gives each rule and its reference).
      reference: the batch size the rate (or schedule) was tuned for.
      decay_hyperparam: the name of an injected constant weight decay to scale with the batch,
        or None (left alone). Decoupled weight decay shrinks the weights by ``lr x wd`` a step;
        Power Lines (Bergsma et al., 2025, "Power Lines: Scaling Laws for Weight Decay and Batch
        Size in LLM Pre-training", arXiv 2505.13738) finds the best AdamW timescale
        ``B / (lr x wd x D)`` fixed in epochs whatever the batch, so the decay is written as
        ``wd x (B / reference) / factor``: ``lr x wd`` grows in proportion to the batch, and the
        weights decay by the same amount per sample at every batch.

    Example:
      >>> import optax
      >>> from triaccel_jax.controller._learning_rate import LearningRateScaling
      >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
      >>> state = tx.init({"w": 0.0})
      >>> scaling = LearningRateScaling(state, "learning_rate", "linear", 16)
      >>> change = scaling.follow(state, 32)
      >>> change.new, round(float(change.opt_state.hyperparams["learning_rate"]), 6)
      (2.0, 0.2)
    """

    def __init__(
        self,
        opt_state: Any,
        hyperparam: str | None,
        scaling: str,
        reference: int,
        decay_hyperparam: str | None = None,
    ):
        self._hyperparam, self._scaling, self._reference = hyperparam, scaling, reference
        self._decay_hyperparam = decay_hyperparam
        self._base_decay: float | None = None
        if decay_hyperparam is not None:
            decay = find_hyperparam(opt_state, decay_hyperparam)
            if decay is None or decay.scheduled:
                raise ValueError(
                    f"weight_decay_hyperparam={decay_hyperparam!r}: the optimizer state holds no "
                    "injected constant of that name to scale (wrap the optimizer in "
                    "optax.inject_hyperparams with a number for it, e.g. "
                    f"optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, "
                    f"{decay_hyperparam}=1e-4))"
                )
            self._base_decay = decay.value
        found = None
        if hyperparam is not None:
            try:
                found = find_hyperparam(opt_state, hyperparam)
            except ValueError:
                if scaling != "none":
                    raise
                # Nothing to scale; an ambiguous rate's schedule is left to count steps.
        self._found = found
        constant = found is not None and not found.scheduled and scaling != "none"
        self._base_lr = found.value if found is not None and constant else None
        self._moves_schedule = found is not None and found.movable
        self._factor = 1.0
        self._batch: int | None = None
        # Training progress in reference-batch steps: the clock a schedule is evaluated at.
        self._progress = 0.0
        # Whether the state may hold a rate other than base_lr * factor (after a restore).
        self._stale = False

    base_lr = ReadOnly[float | None](
        "The tuned rate, when the state holds it as a constant (else None: the step multiplies the "
        "update by :attr:`factor`)."
    )

    factor = ReadOnly[float]("The factor in force.")

    reference = ReadOnly[int]("The batch the rate (or schedule) was tuned at.")

    scaling = ReadOnly[str]("The batch rule, one of ``ControllerConfig.lr_scaling``'s.")

    moves_schedule = ReadOnly[bool](
        "Whether the rate is a plain schedule inside ``optax.inject_hyperparams`` whose count "
        "follows the training progress (:meth:`at_progress`)."
    )

    progress = ReadOnly[float]("Training progress in reference-batch steps (the schedule's clock).")

    def rule(self) -> str:
        """The rule in words: what follows the batch, by which formula, from which reference,
        and how a schedule advances.

        Example:
          >>> import optax
          >>> from triaccel_jax.controller._learning_rate import LearningRateScaling
          >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.01)
          >>> LearningRateScaling(tx.init({"w": 0.0}), "learning_rate", "sqrt", 32).rule()
          'learning rate 0.01, tuned at the reference batch 32, scaled by the sqrt rule: 0.01 x sqrt(batch / 32)'
          >>> schedule = optax.linear_schedule(0.1, 0.0, 100)
          >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
          >>> print(LearningRateScaling(tx.init({"w": 0.0}), "learning_rate", "none", 32).rule())
          learning rate not scaled with the batch (lr_scaling='none'); the injected learning-rate schedule, tuned at the reference batch 32, advances by samples: each step it is evaluated at floor(progress), the progress growing by samples / 32 per step
        """
        formula = {
            "sqrt": "sqrt(batch / {r})",
            "linear": "(batch / {r})",
            "adascale": "r, AdaScale's gain (tr(Sigma) + |G|^2) / (tr(Sigma) / S + |G|^2) with "
            "S = batch / {r}, r = 1 until the gradient noise is measured",
            "sqrt_adascale": "sqrt(r), the square root of AdaScale's gain r = (tr(Sigma) + "
            "|G|^2) / (tr(Sigma) / S + |G|^2) with S = batch / {r}, r = 1 until the gradient "
            "noise is measured",
        }.get(self._scaling)
        if formula is None:
            text = "learning rate not scaled with the batch (lr_scaling='none')"
        else:
            formula = formula.format(r=self._reference)
            if self._base_lr is not None:
                text = (
                    f"learning rate {self._base_lr:.4g}, tuned at the reference batch "
                    f"{self._reference}, scaled by the {self._scaling} rule: {self._base_lr:.4g} x "
                    f"{formula}"
                )
            else:
                text = (
                    f"the update is multiplied by {formula} ({self._scaling} rule, reference "
                    f"batch {self._reference}): the optimizer holds no injected constant learning "
                    "rate (a schedule, or no optax.inject_hyperparams) to write the scaled rate "
                    "into"
                )
        return text + self._schedule_rule()

    def _schedule_rule(self) -> str:
        """How a learning-rate schedule advances, in words ('' for an injected constant)."""
        found = self._found
        if self._moves_schedule:
            per_step = (
                "the gain r" if self._scaling in GAIN_RULES else f"samples / {self._reference}"
            )
            return (
                f"; the injected learning-rate schedule, tuned at the reference batch "
                f"{self._reference}, advances by samples: each step it is evaluated at "
                f"floor(progress), the progress growing by {per_step} per step"
            )
        if found is not None and found.scheduled:
            return (
                "; the injected learning-rate schedule keeps a state of its own, which the "
                "controller cannot move: it advances by steps, not samples"
            )
        if found is None:
            return (
                "; a schedule given to the optimizer itself (e.g. optax.adam(schedule), outside "
                "optax.inject_hyperparams) counts steps, not samples: the controller cannot "
                "move it (wrap the optimizer in optax.inject_hyperparams for that)"
            )
        return ""

    def rate(self, factor: float | None = None) -> float | None:
        """The learning rate at ``factor`` (default: the factor in force), or None when the rate
        is not an injected constant (then only the factor is known)."""
        if self._base_lr is None:
            return None
        return self._base_lr * (self._factor if factor is None else factor)

    @property
    def gain(self) -> float:
        """AdaScale's gain in force (with ``"adascale"`` or ``"sqrt_adascale"``): the progress a
        step makes, in reference-batch steps."""
        return self._factor if self._scaling == "adascale" else self._factor**2

    def factor_for(self, batch: int, noise: NoiseScaleEstimate | None = None) -> float:
        """The factor for ``batch``; with ``"adascale"``, the gain from ``noise`` (the averaged
        estimates, None before any), rounded (:func:`round_gain`); with ``"sqrt_adascale"`` its
        square root."""
        if self._scaling in GAIN_RULES:
            scale = batch / self._reference
            gain = round_gain(adascale_gain(scale, noise), scale)
            return gain if self._scaling == "adascale" else math.sqrt(gain)
        return lr_factor(batch, self._reference, self._scaling)

    def decay_for(self, batch: int) -> float | None:
        """The weight decay written for ``batch`` at the factor in force (Power Lines:
        ``wd x (batch / reference) / factor``), or None when no decay is scaled."""
        if self._base_decay is None:
            return None
        return self._base_decay * (batch / self._reference) / self._factor

    def update_multiplier(self) -> float:
        """What the compiled step multiplies the update by: 1 when the rate is written instead."""
        return 1.0 if self._base_lr is not None else self._factor

    def is_current(self, batch: int, noise: NoiseScaleEstimate | None = None) -> bool:
        """Whether the state already holds the rate for ``batch`` (nothing to write)."""
        return (
            not self._stale
            and batch == self._batch
            and self.factor_for(batch, noise) == self._factor
        )

    def follow(
        self, opt_state: Any, batch: int, noise: NoiseScaleEstimate | None = None
    ) -> LearningRateChange:
        """Sets the factor for ``batch`` (and ``noise``, with ``"adascale"``); returns it with
        ``opt_state`` holding the scaled rate."""
        old, old_batch = self._factor, self._batch
        for name, value in self._settle(batch, noise).items():
            opt_state = set_hyperparam(opt_state, name, value)
        return LearningRateChange(old, self._factor, opt_state, old_batch)

    def _settle(self, batch: int, noise: NoiseScaleEstimate | None) -> dict[str, float]:
        """Sets the factor for ``batch``; returns the injected values it gives, by name."""
        self._factor, self._batch, self._stale = self.factor_for(batch, noise), batch, False
        values = {}
        if self._base_lr is not None:
            assert self._hyperparam is not None  # base_lr is only found under a named hyperparam
            values[self._hyperparam] = self._base_lr * self._factor
        decay = self.decay_for(batch)
        if decay is not None:
            assert self._decay_hyperparam is not None  # a decay is only scaled under its name
            values[self._decay_hyperparam] = decay
        return values

    def values_for(
        self, samples: int, noise: NoiseScaleEstimate | None = None
    ) -> tuple[dict[str, float], RateEvent | None]:
        """The injected values a step of ``samples`` trains with, for a loop that writes the
        optimizer state itself (:class:`triaccel_jax.controller.AdaptiveBatches`): sets the
        factor as :meth:`for_step` does and returns ``({name: value}, event)``, the event as
        :meth:`for_step`'s."""
        old, old_batch = self._factor, self._batch
        values = self._settle(samples, noise)
        event = None
        if self._factor != old and samples != old_batch:
            change = LearningRateChange(old, self._factor, None, old_batch)
            event = self._describe(change, samples, noise)
        return values, event

    def for_step(
        self, opt_state: Any, samples: int, noise: NoiseScaleEstimate | None = None
    ) -> tuple[Any, RateEvent | None]:
        """``opt_state`` set for a step of ``samples``: the scaled rate written when it changes
        (:meth:`follow`) and a schedule's count set from the progress (:meth:`at_progress`).

        Args:
          opt_state: the optimizer state in force.
          samples: the step's samples.
          noise: the estimates AdaScale's gain comes from (None before any).

        Returns:
          ``(opt_state, event)``: ``event`` describes a change of the rate that came with a
          change of batch, for the event log (None otherwise: a move of AdaScale's gain alone is
          not logged, each step's rate is in its :class:`StepInfo`).
        """
        if self.is_current(samples, noise):
            return self.at_progress(opt_state), None
        change = self.follow(opt_state, samples, noise)
        event = None
        if change.new != change.old and samples != change.old_batch:
            event = self._describe(change, samples, noise)
        return self.at_progress(change.opt_state), event

    def _describe(
        self, change: LearningRateChange, samples: int, noise: NoiseScaleEstimate | None
    ) -> RateEvent:
        """A batch's change of the rate (``"learning_rate"``, the rate itself, where the state
        holds it) or of the update's factor (``"update_scale"``), in words and figures."""
        rule = f"{self._scaling} rule"
        figures: dict[str, Any] = {
            "factor": change.new,
            "batch": samples,
            "reference_batch": self._reference,
        }
        if self._scaling in GAIN_RULES:
            root = "" if self._scaling == "adascale" else "square root of the "
            rule = f"{root}AdaScale gain (S = {samples / self._reference:.4g})"
            figures["noise_scale"] = None if noise is None else noise.simple
        old_rate, new_rate = self.rate(change.old), self.rate(change.new)
        if old_rate is not None and new_rate is not None:
            # The rate itself, so that a log reader sees what the optimizer really uses.
            return RateEvent(
                "learning_rate",
                old_rate,
                new_rate,
                f"{rule} for batch {samples}: {self._base_lr:.4g} (tuned at reference batch "
                f"{self._reference}) x {change.new:.4g}",
                {"tuned_learning_rate": self._base_lr, **figures},
            )
        return RateEvent(
            "update_scale",
            change.old,
            change.new,
            f"{rule} for batch {samples} against reference batch {self._reference}; the "
            "rate is not an injected constant, so the update is multiplied instead",
            figures,
        )

    def advance(self, samples: int) -> None:
        """Adds a step of ``samples`` to the training progress, in reference-batch steps:
        ``samples / reference``, or with ``"adascale"`` the gain in force (AdaScale's
        scale-invariant iterations). Call after :meth:`for_step` for the step."""
        self._progress += self.gain if self._scaling in GAIN_RULES else samples / self._reference

    def schedule_count(self) -> tuple[str, int] | None:
        """``(name, count)``: the injected schedule the controller moves and the count its next
        update is evaluated at, ``floor(progress)``; None when the rate is not such a schedule.
        A part in 10^9 absorbs the rounding of a sum of fractions (three steps of a third of the
        reference count as one reference step)."""
        if not self._moves_schedule:
            return None
        assert self._hyperparam is not None  # a schedule is only found under a named hyperparam
        return self._hyperparam, math.floor(self._progress + 1e-9)

    def at_progress(self, opt_state: Any) -> Any:
        """``opt_state`` whose next update evaluates the learning-rate schedule at
        :meth:`schedule_count` (:func:`set_schedule_count`); ``opt_state`` itself when the rate
        is not a schedule the controller moves."""
        moved = self.schedule_count()
        return opt_state if moved is None else set_schedule_count(opt_state, *moved)

    def rewind(self, progress: float) -> None:
        """Goes back to ``progress`` (a rollback restored an older optimizer state): the state's
        rate is then unknown, so the next :meth:`for_step` writes it again."""
        self._progress = progress
        self._stale = True

    def saved_state(self) -> LearningRateState:
        """The scaling's saved state (:meth:`state_dict` encodes it)."""
        return LearningRateState(
            tuned_learning_rate=self._base_lr,
            tuned_weight_decay=self._base_decay,
            factor=self._factor,
            schedule_progress=self._progress,
        )

    def load_saved_state(self, saved: LearningRateState) -> None:
        """Continues from :meth:`saved_state`'s output.

        The saved tuned rate is the one scaled from here on, when this owner writes an injected
        constant rate: the optimizer state given with the saved state holds that rate already
        scaled for the saved batch, and scaling it again would compound.
        """
        if saved.tuned_learning_rate is not None and self._base_lr is not None:
            self._base_lr = saved.tuned_learning_rate
        if saved.tuned_weight_decay is not None and self._base_decay is not None:
            self._base_decay = saved.tuned_weight_decay
        self._progress = saved.schedule_progress
        self._stale = True

    def state_dict(self) -> dict[str, Any]:
        """The tuned rate (None when the state holds no injected constant rate), the factor in
        force (for reading: it follows the batch) and the schedule progress, JSON-ready."""
        return state_record.encode(self.saved_state())

    def load_state_dict(self, state: Any) -> None:
        """Continues from :meth:`state_dict`'s output (see :meth:`load_saved_state`).

        Raises:
          ValueError: the state is malformed (the field named); nothing is changed then.
        """
        self.load_saved_state(state_record.decode(LearningRateState, state, "learning_rate"))

    def tuned(self, opt_state: Any) -> Any:
        """``opt_state`` holding the tuned (reference-batch) rate, for handing the state back."""
        if self._base_decay is not None:
            assert self._decay_hyperparam is not None
            opt_state = set_hyperparam(opt_state, self._decay_hyperparam, self._base_decay)
        if self._base_lr is None:
            return opt_state
        assert self._hyperparam is not None  # base_lr is only found under a named hyperparam
        return set_hyperparam(opt_state, self._hyperparam, self._base_lr)


@dataclasses.dataclass(frozen=True)
class LearningRateState:
    """What a :class:`LearningRateScaling` saves, the ``"learning_rate"`` part of the
    controller's state.

    Attributes:
      tuned_learning_rate: the rate tuned at the reference batch, or None when the optimizer
        state holds no injected constant rate.
      tuned_weight_decay: the weight decay tuned with it, or None.
      factor: the factor in force (for reading: it follows the batch).
      schedule_progress: the samples-based schedule progress, in steps at the reference batch.
    """

    tuned_learning_rate: float | None
    tuned_weight_decay: float | None
    factor: float
    schedule_progress: Annotated[float, state_record.AtLeast(0.0, finite=True)]
