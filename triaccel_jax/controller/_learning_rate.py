"""Learning-rate scaling with the batch size, and the injected rate it is written to.

When the batch bucket changes, the learning rate follows it (``"sqrt"``: lr x sqrt(batch /
reference), ``"linear"`` or ``"none"``). The controller scales the rate by writing it into the
state of ``optax.inject_hyperparams``, which changes an array, not the compiled program
(docs/design.md §5). That only works for a *constant* hyperparameter: one that a schedule drives
is recomputed from the schedule at every update, so writing it would be silently undone;
:func:`find_hyperparam` reports that case, and the step then multiplies the update instead.
"""

from __future__ import annotations

import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _is_injected(node: Any) -> bool:
    return isinstance(node, _INJECTED)


class FoundHyperparam(NamedTuple):
    """Where a hyperparameter lives: its value, and whether a schedule recomputes it."""

    value: float
    scheduled: bool


def find_hyperparam(opt_state: Any, name: str) -> FoundHyperparam | None:
    """The injected hyperparameter ``name``, or None when no injected state holds it.

    Raises:
      ValueError: several injected states hold ``name`` (ambiguous).
    """
    found = []
    for node in jax.tree.leaves(opt_state, is_leaf=_is_injected):
        if _is_injected(node) and name in node.hyperparams:
            states = getattr(node, "hyperparams_states", {}) or {}
            found.append(FoundHyperparam(float(node.hyperparams[name]), name in states))
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


def lr_factor(batch: int, reference: int, scaling: str) -> float:
    """The learning-rate multiplier for ``batch`` against the ``reference`` batch.

    Example:
      >>> from triaccel_jax.controller._learning_rate import lr_factor
      >>> lr_factor(64, 16, "sqrt"), lr_factor(64, 16, "linear"), lr_factor(64, 16, "none")
      (2.0, 4.0, 1.0)
    """
    ratio = batch / reference
    return {"sqrt": math.sqrt(ratio), "linear": ratio, "none": 1.0}[scaling]


class LearningRateChange(NamedTuple):
    """A change of the learning-rate factor: before, after, and the state carrying the rate."""

    old: float
    new: float
    opt_state: Any


class LearningRateScaling:
    """Keeps the learning rate proportional to a function of the batch size.

    Args:
      opt_state: the optimizer state, searched for the injected rate ``hyperparam``.
      hyperparam: the name of the injected learning rate, or None (scale the update).
      scaling: ``"sqrt"``, ``"linear"`` or ``"none"``.
      reference: the batch size the rate was tuned for.

    Attributes:
      base_lr: the tuned rate, when the state holds it as a constant (else None: the step
        multiplies the update by :attr:`factor`).
      factor: the factor in force.

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

    def __init__(self, opt_state: Any, hyperparam: str | None, scaling: str, reference: int):
        self.hyperparam, self.scaling, self.reference = hyperparam, scaling, reference
        found = None
        if hyperparam is not None and scaling != "none":
            found = find_hyperparam(opt_state, hyperparam)
        self.base_lr = found.value if found is not None and not found.scheduled else None
        self.factor = 1.0
        # Whether the state may hold a rate other than base_lr * factor (after restore_tuned).
        self._stale = False

    def rule(self) -> str:
        """The rule in words: what follows the batch, by which formula, from which reference.

        Example:
          >>> import optax
          >>> from triaccel_jax.controller._learning_rate import LearningRateScaling
          >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.01)
          >>> LearningRateScaling(tx.init({"w": 0.0}), "learning_rate", "sqrt", 32).rule()
          'learning rate 0.01, tuned at the reference batch 32, scaled by the sqrt rule: 0.01 x sqrt(batch / 32)'
        """
        formula = {"sqrt": "sqrt(batch / {r})", "linear": "(batch / {r})"}.get(self.scaling)
        if formula is None:
            return "learning rate not scaled with the batch (lr_scaling='none')"
        formula = formula.format(r=self.reference)
        if self.base_lr is not None:
            return (
                f"learning rate {self.base_lr:.4g}, tuned at the reference batch {self.reference}, "
                f"scaled by the {self.scaling} rule: {self.base_lr:.4g} x {formula}"
            )
        return (
            f"the update is multiplied by {formula} ({self.scaling} rule, reference batch "
            f"{self.reference}): the optimizer holds no injected constant learning rate "
            "(a schedule, or no optax.inject_hyperparams) to write the scaled rate into"
        )

    def rate(self, factor: float | None = None) -> float | None:
        """The learning rate at ``factor`` (default: the factor in force), or None when the rate
        is not an injected constant (then only the factor is known)."""
        if self.base_lr is None:
            return None
        return self.base_lr * (self.factor if factor is None else factor)

    def factor_for(self, batch: int) -> float:
        """The factor for ``batch``."""
        return lr_factor(batch, self.reference, self.scaling)

    def update_multiplier(self) -> float:
        """What the compiled step multiplies the update by: 1 when the rate is written instead."""
        return 1.0 if self.base_lr is not None else self.factor

    def is_current(self, batch: int) -> bool:
        """Whether the state already holds the rate for ``batch`` (nothing to write)."""
        return not self._stale and self.factor_for(batch) == self.factor

    def follow(self, opt_state: Any, batch: int) -> LearningRateChange:
        """Sets the factor for ``batch``; returns it with ``opt_state`` holding the scaled rate."""
        old, self.factor, self._stale = self.factor, self.factor_for(batch), False
        if self.base_lr is not None:
            assert self.hyperparam is not None  # base_lr is only found under a named hyperparam
            opt_state = set_hyperparam(opt_state, self.hyperparam, self.base_lr * self.factor)
        return LearningRateChange(old, self.factor, opt_state)

    def invalidate(self) -> None:
        """Marks the state's rate as unknown (a rollback restored an older state), so that the
        next :meth:`is_current` is False and the rate is written again."""
        self._stale = True

    def restore_tuned(self, tuned: float | None) -> None:
        """Takes ``tuned`` (a saved state's tuned rate) as the rate to scale, when this
        controller writes an injected constant rate: the optimizer state it was given holds that
        rate already scaled for the saved batch, and scaling it again would compound."""
        if tuned is not None and self.base_lr is not None:
            self.base_lr = float(tuned)
            self._stale = True

    def tuned(self, opt_state: Any) -> Any:
        """``opt_state`` holding the tuned (reference-batch) rate, for handing the state back."""
        if self.base_lr is None:
            return opt_state
        assert self.hyperparam is not None  # base_lr is only found under a named hyperparam
        return set_hyperparam(opt_state, self.hyperparam, self.base_lr)
