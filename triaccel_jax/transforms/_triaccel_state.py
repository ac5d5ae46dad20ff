"""The state of ``scale_by_triaccel``, and how to find it inside any optimizer state.

:class:`ScaleByTriAccelState` holds the moments, the compressed curvature EMA and the per-leaf
:class:`LeafSignals` (``_curvature_signals.find_signal_states`` finds it, and the observer's
state, inside any optimizer state).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax


class LeafSignals(NamedTuple):
    """Per-leaf float32 scalars that ``scale_by_triaccel`` keeps for the planner and controller.

    All are refreshed on curvature steps (every ``curvature_every`` steps, from the first).

    Attributes:
      mean_curvature: mean of the (bias-corrected) curvature EMA over the leaf, ``kappa_l``.
      max_curvature: largest magnitude of the curvature EMA in the leaf.
      trace: sum of the curvature EMA over the leaf.
      noise_to_signal: ``mean(v_hat - m_hat**2) / mean(m_hat**2)``, the gradient noise.
      step_scale: the step-size multiplier ``s_l`` applied on the last update.
      dropped_estimates: int32 number of this leaf's curvature estimates left out of the EMA
        because they (or the EMA they would give) were not finite, saturating.
    """

    mean_curvature: jax.Array
    max_curvature: jax.Array
    trace: jax.Array
    noise_to_signal: jax.Array
    step_scale: jax.Array
    dropped_estimates: jax.Array


class ScaleByTriAccelState(NamedTuple):
    """State of :func:`scale_by_triaccel`; arrays only.

    Trees are shaped like the params; leaves the optimizer does not act on (integer, boolean,
    empty) hold ``optax.MaskedNode()``.

    Attributes:
      count: int32 number of updates, saturating.
      curvature_count: int32 number of curvature estimates taken, saturating; a leaf's EMA holds
        ``curvature_count - dropped_estimates`` of them (see :class:`LeafSignals`).
      mu: first moments, in the state dtype.
      nu: second moments, in the state dtype.
      curvature: the curvature EMA per leaf, a :class:`triaccel_jax.transforms.CompressedDiagonal`.
      leaf_signals: :class:`LeafSignals` per leaf.
      estimator_state: the curvature estimator's state.
      rounding_key: uint32 PRNG key data for the stochastic rounding of the moments.
    """

    # Shadows tuple.count, as optax's states do; the field name is part of the state's structure.
    count: jax.Array  # type: ignore[assignment]
    curvature_count: jax.Array
    mu: Any
    nu: Any
    curvature: Any
    leaf_signals: Any
    estimator_state: Any
    rounding_key: jax.Array


def as_named_tuple(cls: type[Any], node: Any) -> Any:
    """``node`` as the NamedTuple ``cls`` if it came back as a mapping of its fields.

    ``nnx.Optimizer`` keeps the optimizer state in ``nnx.Variable``s and returns nested
    NamedTuples as dicts of their fields; ``lax.cond`` needs the same structure in both branches.
    """
    if isinstance(node, Mapping) and set(node) == set(cls._fields):
        return cls(**{name: node[name] for name in cls._fields})
    return node


def is_triaccel_state(node: Any) -> bool:
    """Whether ``node`` is a :class:`ScaleByTriAccelState` (an ``is_leaf`` for tree functions)."""
    return isinstance(node, ScaleByTriAccelState)
