"""Tri-Accel's step scale: each leaf's step times the scale its curvature signals give.

Tri-Accel (arXiv 2508.16905) multiplies each layer's step by
``s_l = clip((kappa_ref / kappa_l) ** alpha, min_scale, max_scale)`` from its mean curvature
``kappa_l`` and the median ``kappa_ref`` over leaves: flat leaves take longer steps, sharp ones
shorter (docs/design.md §3.3). The curvature signals (:mod:`._observer`) estimate the
curvature and keep ``s_l`` in each leaf's :class:`LeafSignals`; :func:`scale_by_step_scale` only
reads them. It is composed after the signals by :func:`with_signals`, which hands every later
transform of the composition the signals' state, found by its type in the state the signals
return (as optax's ``optax.tree.get`` finds a state by name), never by its position.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from triaccel_jax.transforms import _block_scale as block_scale
from triaccel_jax.transforms import _observer as observer
from triaccel_jax.transforms import _refresh as refresh_lib
from triaccel_jax.transforms._config import CurvatureSettings
from triaccel_jax.transforms._config import TriAccelConfig
from triaccel_jax.transforms._refresh import LeafSignals


def scale_by_step_scale(
    settings: CurvatureSettings, config: TriAccelConfig
) -> optax.GradientTransformationExtraArgs:
    """Multiplies each leaf of the updates by the step scale the curvature signals hold.

    ``config.scale="leaf"``: the leaf's ``LeafSignals.step_scale``; ``"block"``: one scale per
    block of the leaf's curvature store, from its block means against the same median
    (:func:`triaccel_jax.transforms._block_scale.block_step_scale`, with ``settings``' exponent
    and bounds). Leaves the signals do not hold pass through. The product is taken in float32
    (or wider) and returned in the update's dtype.

    Args:
      settings: the step scale's exponent and bounds (block scales only).
      config: its ``scale`` and ``bound``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with an empty state, whose ``update`` needs
      the extra argument ``curvature_signals``: the signals' :class:`CurvatureSignalsState`
      (:func:`with_signals` passes it).
    """

    def update_fn(
        updates: Any,
        state: optax.EmptyState,
        params: Any = None,
        *,
        curvature_signals: observer.CurvatureSignalsState | None = None,
        **extra_args: Any,
    ) -> tuple[Any, optax.EmptyState]:
        del params, extra_args
        if curvature_signals is None:
            raise ValueError(
                "the step scale reads the curvature signals of its chain: compose it after "
                "them with with_signals (as scale_by_triaccel and scale_by_curvature do)"
            )
        treedef: Any = jax.tree.structure(updates)  # a PyTreeDef: no stubs mypy can see
        try:
            moments = treedef.flatten_up_to(curvature_signals.mu)
        except (ValueError, TypeError) as error:
            raise ValueError(
                "the updates do not have the tree structure of the params the optimizer state "
                f"was initialised with: {error}"
            ) from None
        # The signals are vectors over the observed leaves: those whose moment is not masked.
        flags = [not refresh_lib.is_masked(m) for m in moments]
        signals = refresh_lib.as_named_tuple(LeafSignals, curvature_signals.leaf_signals)
        if config.scale == "block":
            scales = _block_scales(updates, flags, signals, curvature_signals.curvature)
        else:
            scales = refresh_lib.per_leaf(signals.step_scale, flags)
        out = treedef.unflatten(
            [
                _scaled(u, scale)
                for u, scale in zip(treedef.flatten_up_to(updates), scales, strict=True)
            ]
        )
        return out, state

    def _block_scales(
        updates: Any, flags: list[bool], signals: LeafSignals, stores: Any
    ) -> list[Any]:
        if not any(flags):
            return [None] * len(flags)
        kappa_ref = refresh_lib.reference_curvature(signals.mean_curvature)
        leaf_stores = iter(stores.leaves())
        out: list[Any] = []
        position = 0
        for u, flag in zip(jax.tree.leaves(updates), flags, strict=True):
            if not flag:
                out.append(None)
                continue
            out.append(
                block_scale.block_step_scale(
                    next(leaf_stores),
                    signals.mean_curvature[position],
                    u.shape,
                    kappa_ref,
                    alpha=settings.alpha,
                    min_scale=settings.min_scale,
                    max_scale=settings.max_scale,
                    bound=config.bound,
                )
            )
            position += 1
        return out

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


def with_signals(
    signals_tx: optax.GradientTransformation, *rest: optax.GradientTransformation
) -> optax.GradientTransformationExtraArgs:
    """``optax.chain(signals_tx, *rest)`` in which ``rest`` reads the signals' new state.

    Each transform of ``rest`` gets, besides the caller's extra arguments, the extra argument
    ``curvature_signals``: the :class:`CurvatureSignalsState` found (by type) in the state
    ``signals_tx`` returned this step. The state is the tuple of the members' states, as
    ``optax.chain``'s is.

    Args:
      signals_tx: a transform whose state holds exactly one curvature-signals state.
      *rest: the transforms that follow; each must take extra arguments (plain optax
        transforms are wrapped with ``optax.with_extra_args_support``).

    Returns:
      An ``optax.GradientTransformationExtraArgs``.
    """
    rest = tuple(optax.with_extra_args_support(tx) for tx in rest)

    def init_fn(params: Any) -> tuple[Any, ...]:
        return (signals_tx.init(params), *(tx.init(params) for tx in rest))

    def update_fn(
        updates: Any, state: tuple[Any, ...], params: Any = None, **extra_args: Any
    ) -> tuple[Any, tuple[Any, ...]]:
        updates, first = signals_tx.update(updates, state[0], params, **extra_args)
        (kept,) = observer.find_signal_states(first)
        extra_args["curvature_signals"] = kept
        new_state = [first]
        for tx, inner in zip(rest, state[1:], strict=True):
            updates, inner = tx.update(updates, inner, params, **extra_args)
            new_state.append(inner)
        return updates, tuple(new_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _scaled(update: Any, scale: Any) -> Any:
    """``scale * update`` in float32 (or wider), back in the update's dtype; None: unscaled."""
    if scale is None or refresh_lib.is_masked(scale):
        return update
    wide = jnp.promote_types(update.dtype, jnp.float32)
    return (scale.astype(wide) * update.astype(wide)).astype(update.dtype)
