"""``scale_by_curvature``: Tri-Accel's per-leaf curvature step scale over any optax direction.

Tri-Accel (arXiv 2508.16905) multiplies each layer's step by a scale from a cheap curvature
signal. :func:`triaccel_jax.scale_by_triaccel` does it for Adam's direction, sharing Adam's
moments; this transform does it for any direction (SGD, Muon, a whole optax optimizer): it keeps
the signals with :func:`triaccel_jax.curvature_signals` from the gradients it is given, runs the
direction on those gradients, and multiplies each leaf of the direction's output by
``s_l = clip((kappa_ref / kappa_l) ** alpha, min_scale, max_scale)`` (docs/design.md §3.3,
§3.9). A per-leaf scalar commutes with a learning rate, so the direction may be a full optimizer
(its learning rate included) as well as a ``scale_by_*`` piece.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from triaccel_jax.transforms import _curvature_signals as observer
from triaccel_jax.transforms._config import TriAccelConfig
from triaccel_jax.transforms._config import resolve_config
from triaccel_jax.transforms._triaccel_state import LeafSignals
from triaccel_jax.transforms._triaccel_state import as_named_tuple


class ScaleByCurvatureState(NamedTuple):
    """State of :func:`scale_by_curvature`.

    Attributes:
      signals: the :class:`triaccel_jax.transforms.CurvatureSignalsState` of the gradients (its
        ``leaf_signals`` report the step scale applied on the last update).
      direction: the direction's own state.
    """

    signals: observer.CurvatureSignalsState
    direction: Any


def scale_by_curvature(
    direction: optax.GradientTransformation,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    config: TriAccelConfig | None = None,
    curvature_every: int = 10,
    curvature_decay: float = 0.95,
    alpha: float = 0.5,
    min_scale: float = 0.5,
    max_scale: float = 2.0,
    seed: int = 0,
    axis_name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Multiplies each leaf of ``direction``'s output by Tri-Accel's curvature step scale.

    The curvature is estimated on the gradients this transform receives (before the direction),
    by the estimator of ``config``; the scale of leaf ``l`` is
    ``clip((kappa_ref / kappa_l) ** alpha, min_scale, max_scale)`` with ``kappa_l`` its mean
    curvature and ``kappa_ref`` the median over leaves: flat leaves take longer steps, sharp
    ones shorter. Leaves the direction returns that the signals do not hold (integer leaves)
    pass through as the direction returns them. Every numeric argument may be injected by
    ``optax.inject_hyperparams``; the direction is passed through it untouched.

    Args:
      direction: any optax transform: a ``scale_by_*`` piece, or a whole optimizer (its
        learning rate commutes with the per-leaf scale). Extra arguments of ``update`` are
        passed to it.
      b1: decay of the gradient EMA the noise-to-signal signal reads, in [0, 1).
      b2: decay of the EMA of ``mean(g**2)``, in [0, 1).
      config: a :class:`triaccel_jax.TriAccelConfig` (estimator, store layout, probes, the
        gradient EMA's dtype). Its ``scale`` must be ``"leaf"``. None: its defaults.
      curvature_every: estimate curvature every this many steps (>= 1), from the first.
      curvature_decay: EMA decay of the curvature estimates, in [0, 1).
      alpha: exponent of the step scale (>= 0; 0 turns the scaling off).
      min_scale: lower clip of the step scale, > 0.
      max_scale: upper clip of the step scale, >= min_scale.
      seed: seed of the stochastic rounding and of Hutchinson's probes.
      axis_name: the ``shard_map``/``pmap`` axis over which replicas average their curvature
        estimates; None for one replica or ``jit``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`ScaleByCurvatureState`; ``update`` takes ``loss_fn`` (or ``obj_fn``,
      ``value_fn``; Hutchinson's estimator needs it) and passes every extra argument on.

    Raises:
      ValueError: a hyperparameter is out of range, or ``config.scale`` is ``"block"``.
      TypeError: ``direction`` is not an optax transform, or ``config`` not a TriAccelConfig.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import triaccel_jax
      >>> tx = triaccel_jax.scale_by_curvature(optax.sgd(0.1), curvature_every=1)
      >>> params = {"flat": jnp.ones(2), "mid": jnp.ones(2), "sharp": jnp.ones(2)}
      >>> grads = {"flat": jnp.full(2, 0.1), "mid": jnp.ones(2), "sharp": jnp.full(2, 10.0)}
      >>> updates, state = tx.update(grads, tx.init(params), params)
      >>> signals = triaccel_jax.signals(state)  # Fisher curvatures 0.01, 1 and 100
      >>> [signals[k]["step_scale"] for k in ("flat", "mid", "sharp")]  # sqrt(1 / kappa), clipped
      [2.0, 1.0, 0.5]
      >>> updates["sharp"].tolist()  # -0.1 * 10.0 * 0.5
      [-0.5, -0.5]

    References:
      Tri-Accel, arXiv 2508.16905; Yao et al., 2021, "ADAHESSIAN".
    """
    if not isinstance(
        direction, optax.GradientTransformation | optax.GradientTransformationExtraArgs
    ):
        raise TypeError(
            "`direction` must be an optax transform (e.g. optax.scale_by_adam() or "
            f"optax.contrib.muon(1e-3)), got {type(direction).__name__}"
        )
    config = resolve_config(config)
    if config.scale != "leaf":
        raise ValueError(
            "scale_by_curvature scales each leaf by one number: TriAccelConfig(scale='block') "
            "is scale_by_triaccel's (Adam's direction) only"
        )
    signals_tx = observer.signals_with_scales(
        b1,
        b2,
        config=config,
        curvature_every=curvature_every,
        curvature_decay=curvature_decay,
        seed=seed,
        axis_name=axis_name,
        alpha=alpha,
        min_scale=min_scale,
        max_scale=max_scale,
    )
    direction = optax.with_extra_args_support(direction)

    def init_fn(params: Any) -> ScaleByCurvatureState:
        return ScaleByCurvatureState(signals_tx.init(params), direction.init(params))

    def update_fn(
        updates: Any,
        state: ScaleByCurvatureState,
        params: Any = None,
        *,
        loss_fn: Callable[..., Any] | None = None,
        obj_fn: Callable[..., Any] | None = None,
        value_fn: Callable[..., Any] | None = None,
        **extra_args: Any,
    ) -> tuple[Any, ScaleByCurvatureState]:
        names = {"loss_fn": loss_fn, "obj_fn": obj_fn, "value_fn": value_fn}
        losses = {name: fn for name, fn in names.items() if fn is not None}
        _, signals_state = signals_tx.update(updates, state.signals, params, **losses)
        out, direction_state = direction.update(
            updates, state.direction, params, **losses, **extra_args
        )
        treedef: Any  # a jaxlib PyTreeDef, which has no stubs mypy can see
        leaves, treedef = jax.tree.flatten(out)
        held = [
            as_named_tuple(LeafSignals, x)
            for x in observer.flatten_like_updates(treedef, signals_state.leaf_signals)
        ]
        for i, node in enumerate(held):
            if isinstance(node, LeafSignals):
                # In float32 (or wider), then back: a bfloat16 step is scaled without promotion.
                wide = jnp.promote_types(leaves[i].dtype, jnp.float32)
                scaled = node.step_scale.astype(wide) * leaves[i].astype(wide)
                leaves[i] = scaled.astype(leaves[i].dtype)
        return treedef.unflatten(leaves), ScaleByCurvatureState(signals_state, direction_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
