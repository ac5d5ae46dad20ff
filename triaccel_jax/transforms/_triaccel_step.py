"""The pieces of one ``scale_by_triaccel`` step that the optax update and the fused update share.

``scale_by_triaccel``'s update is three parts: checking and flattening the inputs
(:class:`StepInputs`), the Adam moments and direction of each leaf, and the curvature step that
refreshes the store, the signals and the step scales (:class:`CurvatureStep`). The optax update
computes the moments in XLA and returns the scaled direction; the fused update
(:func:`triaccel_jax.transforms.fused_apply`) hands the moments, the master write and the compute
copy to one kernel per leaf. Both go through the same :class:`TriAccelParts`, so the curvature
and signal logic exists once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax

from triaccel_jax import kernels
from triaccel_jax.transforms._triaccel_state import LeafSignals
from triaccel_jax.transforms._triaccel_state import ScaleByTriAccelState


class StepInputs(NamedTuple):
    """One update's checked and flattened inputs.

    Attributes:
      loss_fn: the loss (Hutchinson's estimator), resolved from its accepted names, or None.
      grads: the gradient leaves, flattened.
      treedef: the gradients' tree structure.
      active: indices of the leaves the optimizer trains.
      mu: the first-moment leaves, flattened like ``grads``.
      nu: the second-moment leaves.
      new_count: the new step number (the state's count plus one).
      scalars: Adam's float32 scalars for ``new_count``.
      step_key: this step's PRNG key (each leaf folds in its index).
    """

    loss_fn: Callable[..., Any] | None
    grads: list[Any]
    treedef: Any
    active: list[int]
    mu: list[Any]
    nu: list[Any]
    new_count: jax.Array
    scalars: kernels.Scalars
    step_key: jax.Array


class CurvatureStep(NamedTuple):
    """What the curvature step leaves: the store, the signals and each leaf's step scale.

    Attributes:
      stores: each leaf's compressed curvature store.
      estimator_state: the curvature estimator's state.
      curvature_count: estimates folded so far.
      signals: each leaf's :class:`LeafSignals`.
      scales: the step-size scale by active leaf index (a scalar, or an array per element with
        ``TriAccelConfig(scale="block")``).
    """

    stores: list[Any]
    estimator_state: Any
    curvature_count: jax.Array
    signals: list[LeafSignals]
    scales: dict[int, Any]


class TriAccelParts(NamedTuple):
    """The pieces a ``scale_by_triaccel`` update is made of, which the fused update runs too.

    Attributes:
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to ``sqrt(v_hat)``.
      impl: the kernels' implementation choice (``TriAccelConfig.impl``).
      scale: the step scale's granularity, ``"leaf"`` or ``"block"``.
      prepare: ``(updates, state, *, loss_fn, obj_fn, value_fn) -> StepInputs``.
      curvature_step: ``(updates, state, params, inputs, moments) -> CurvatureStep``.
    """

    b1: Any
    b2: Any
    eps: Any
    impl: str
    scale: str
    prepare: Callable[..., StepInputs]
    curvature_step: Callable[..., CurvatureStep]


def next_state(
    state: ScaleByTriAccelState,
    inputs: StepInputs,
    curvature: CurvatureStep,
    mu: list[Any],
    nu: list[Any],
) -> ScaleByTriAccelState:
    """The state after a step, from the new moments (flattened) and the curvature step."""
    treedef = inputs.treedef
    return ScaleByTriAccelState(
        count=inputs.new_count,
        curvature_count=curvature.curvature_count,
        mu=treedef.unflatten(mu),
        nu=treedef.unflatten(nu),
        curvature=treedef.unflatten(curvature.stores),
        leaf_signals=treedef.unflatten(curvature.signals),
        estimator_state=curvature.estimator_state,
        rounding_key=state.rounding_key,
    )
