"""Tri-Accel's step scale, the one place it is computed: each leaf's step times the scale its
curvature gives.

Tri-Accel (arXiv 2508.16905) multiplies each layer's step by
``s_l = clip((kappa_ref / kappa_l) ** alpha, min_scale, max_scale)`` from its mean curvature
``kappa_l`` and the median ``kappa_ref`` over leaves: flat leaves take longer steps, sharp ones
shorter (docs/design.md §3.4). Every scale is :func:`bounded_scale` against
:func:`reference_curvature`:

* the per-leaf scale, :func:`leaf_step_scales`, is one of the signals the planner and
  :func:`triaccel_jax.signals` report, so the curvature refresh (:mod:`._refresh`) calls it
  when it refreshes the leaves' mean curvatures and keeps the result in :class:`LeafSignals`,
  where the step reads it; the transforms that keep signals without scaling anything (the
  observer alone) hand the refresh no step scale and report 1;
* the per-block scale, :func:`block_step_scale` (``TriAccelConfig(scale="block")``), is
  derived at every step from the store and the same leaf means.

The default step scale is one number per leaf, ``s_l = clip((kappa_ref / kappa_l) ** alpha)``
with ``kappa_l`` the leaf's mean curvature and ``kappa_ref`` the median of the leaves' means.
Tuning the learning rate absorbs most of such a per-layer multiplier (docs/accuracy.md). The
compressed store already holds a finer signal at no extra cost: the mean curvature of every block
of ``block_size`` elements (or of every (in, out) channel pair of a 2-D conv kernel). With
``scale="block"`` each block ``b`` of leaf ``l`` gets its own scale

    s_b = clip((kappa_ref / kappa_b) ** alpha, min_scale, max_scale),

against the same reference ``kappa_ref`` (the median of the leaves' bias-corrected mean
curvatures), so a leaf whose blocks are all alike is scaled exactly as in ``scale="leaf"``, and
within a leaf the flatter blocks take longer steps than the sharper ones. The outliers of the
store are not used: they are single entries, and a per-element scale from one noisy estimate is
what the block means are there to smooth.

The scales are recomputed from the store at every step (a few operations per block plus one
leaf-sized broadcast), rather than kept in the state, so the state's layout does not depend on
the option.

:func:`scale_by_step_scale` applies either, reading the signals' state it is handed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from triaccel_jax.transforms import _compression as compression
from triaccel_jax.transforms import _refresh as refresh_lib
from triaccel_jax.transforms._config import StepScaleSettings
from triaccel_jax.transforms._config import TriAccelConfig
from triaccel_jax.transforms._refresh import LeafSignals

_TINY = float(jnp.finfo(jnp.float32).tiny)


def bounded_scale(
    kappa_ref: jax.Array,
    kappa: jax.Array,
    *,
    alpha: Any,
    min_scale: Any,
    max_scale: Any,
    bound: str,
) -> jax.Array:
    """``(kappa_ref / kappa) ** alpha`` held within ``[min_scale, max_scale]`` (float32).

    ``bound="clip"`` is Tri-Accel's hard clip: past the bounds the scale is constant, so a leaf
    whose curvature is far from the median sits at a bound whatever it does. ``"smooth"`` bounds
    the log of the scale with a tanh instead, ``log s = L tanh(x / L)`` with
    ``x = alpha * log(kappa_ref / kappa)`` and ``L`` the log of the bound on that side: the same
    slope as the clip at the median, always strictly inside the bounds and always moving with the
    curvature (a soft clip, as in soft-capping of logits). NaN (no finite curvature) gives 1.
    """
    exponent = jnp.asarray(alpha, jnp.float32)
    if bound == "clip":
        scale = jnp.clip(((kappa_ref + _TINY) / (kappa + _TINY)) ** exponent, min_scale, max_scale)
    else:
        x = exponent * (jnp.log(kappa_ref + _TINY) - jnp.log(kappa + _TINY))
        high = jnp.maximum(jnp.log(jnp.asarray(max_scale, jnp.float32)), _TINY)
        low = jnp.maximum(-jnp.log(jnp.asarray(min_scale, jnp.float32)), _TINY)
        side = jnp.where(x >= 0, high, low)
        scale = jnp.clip(jnp.exp(side * jnp.tanh(x / side)), min_scale, max_scale)
    return jnp.where(jnp.isnan(scale), 1.0, scale).astype(jnp.float32)


def reference_curvature(mean_curvatures: Any) -> jax.Array:
    """``kappa_ref``: the median of the finite mean curvatures (clipped at 0), NaN when none is.

    The median, so that one leaf cannot poison the rest; Hutchinson's means can be negative.
    """
    stacked = jnp.maximum(
        mean_curvatures if isinstance(mean_curvatures, jax.Array) else jnp.stack(mean_curvatures),
        0.0,
    )
    return jnp.nanmedian(jnp.where(jnp.isfinite(stacked), stacked, jnp.nan))


def leaf_step_scales(scale: StepScaleSettings, bound: str) -> Callable[[jax.Array], jax.Array]:
    """Each leaf's step scale from the leaves' mean curvatures, as the refresh computes it.

    Args:
      scale: the exponent and bounds.
      bound: ``"clip"`` or ``"smooth"`` (:func:`bounded_scale`).

    Returns:
      ``mean_curvatures -> scales``: vectors over the observed leaves (float32), each leaf's
      mean against their median (:func:`reference_curvature`).
    """

    def scales(mean_curvatures: jax.Array) -> jax.Array:
        return bounded_scale(
            reference_curvature(mean_curvatures),
            jnp.maximum(mean_curvatures, 0.0),
            alpha=scale.alpha,
            min_scale=scale.min_scale,
            max_scale=scale.max_scale,
            bound=bound,
        )

    return scales


def block_step_scale(
    store: compression.CompressedDiagonal,
    mean_curvature: jax.Array,
    shape: tuple[int, ...],
    kappa_ref: jax.Array,
    *,
    alpha: Any,
    min_scale: Any,
    max_scale: Any,
    bound: str = "clip",
) -> jax.Array:
    """A leaf's step scale per block of its curvature store, broadcast to the leaf's shape.

    Args:
      store: the leaf's compressed curvature EMA (not bias-corrected), as the state holds it.
      mean_curvature: the leaf's bias-corrected mean curvature (its signals'), refreshed from
        ``store``.
      shape: the leaf's shape.
      kappa_ref: the reference curvature, the median over leaves
        (:func:`reference_curvature`).
      alpha: exponent of the scale, >= 0 (0 gives exactly 1 everywhere).
      min_scale: lower clip, > 0.
      max_scale: upper clip, >= ``min_scale``.
      bound: how the bounds hold the scale, ``"clip"`` or ``"smooth"``
        (:func:`bounded_scale`).

    Returns:
      A float32 array of ``shape``: the element-wise scale, constant over each block (each
      (in, out) channel pair of a 2-D conv kernel). Where a scale is NaN (no finite curvature
      anywhere) it is 1, as for the per-leaf scale.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.transforms import compress_diagonal
      >>> from triaccel_jax.transforms._step_scale import block_step_scale
      >>> store = compress_diagonal(jnp.array([1.0, 1.0, 4.0, 4.0]), block_size=2, rho=0.25)
      >>> scales = block_step_scale(
      ...     store,
      ...     jnp.asarray(2.5),
      ...     (4,),
      ...     jnp.asarray(2.5),
      ...     alpha=0.5,
      ...     min_scale=0.1,
      ...     max_scale=10.0,
      ... )
      >>> [round(float(s), 3) for s in scales]  # sqrt(2.5 / 1) and sqrt(2.5 / 4)
      [1.581, 1.581, 0.791, 0.791]

    References:
      Tri-Accel, arXiv 2508.16905; Yao et al., 2021, "ADAHESSIAN" (curvature averaged over
      blocks and conv channel pairs).
    """
    if math.prod(shape) == 0:
        # An empty leaf has no blocks (and no update to scale).
        return jnp.ones(shape, jnp.float32)
    kappa = jnp.maximum(mean_curvature, 0.0)
    # The store is the raw EMA; its bias correction is the leaf mean's, recovered as the ratio
    # of the corrected mean (in the signals) to the raw one, so that kappa_b and kappa_ref are
    # on the same footing however many estimates were dropped.
    raw_mean = _raw_mean(store, shape)
    positive = raw_mean > 0
    factor = jnp.where(positive, kappa / jnp.where(positive, raw_mean, 1.0), 1.0)
    kappa_b = jnp.maximum(store.block_means * factor, 0.0)
    per_block = bounded_scale(
        kappa_ref, kappa_b, alpha=alpha, min_scale=min_scale, max_scale=max_scale, bound=bound
    )
    return _broadcast_blocks(per_block, shape)


def _raw_mean(store: compression.CompressedDiagonal, shape: tuple[int, ...]) -> jax.Array:
    """The mean of the diagonal the store's block means describe (blocks weighted by length)."""
    size = math.prod(shape)
    if compression.uses_channel_pairs(shape):
        return jnp.mean(store.block_means)
    _, counts = compression.block_counts(size, store.block_means.size)
    return jnp.sum(store.block_means * counts) / size


def _broadcast_blocks(per_block: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """A leaf-shaped array holding each element's block value (the store's layout)."""
    if compression.uses_channel_pairs(shape):
        return jnp.broadcast_to(per_block, shape)
    size = math.prod(shape)
    length, _ = compression.block_counts(size, per_block.size)
    return jnp.repeat(per_block, length)[:size].reshape(shape)


def scale_by_step_scale(
    scale: StepScaleSettings, config: TriAccelConfig
) -> optax.GradientTransformationExtraArgs:
    """Multiplies each leaf of the updates by the step scale of the curvature signals.

    ``config.scale="leaf"``: the leaf's ``LeafSignals.step_scale`` (the refresh computed it with
    :func:`leaf_step_scales`); ``"block"``: one scale per block of the leaf's curvature store
    (:func:`block_step_scale`, with ``scale``'s exponent and bounds). Leaves the signals do not
    hold pass through. The product is taken in float32 (or wider) and returned in the update's
    dtype.

    Args:
      scale: the step scale's exponent and bounds (read by the block scales only: the leaf
        scales come computed in the signals).
      config: its ``scale`` and ``bound``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with an empty state, whose ``update`` needs
      the extra argument ``curvature_signals``: the signals' state (a
      :class:`triaccel_jax.transforms.CurvatureSignalsState` or
      :class:`triaccel_jax.transforms.AdamSignalsState`), which
      :func:`triaccel_jax.transforms._alias.with_signals` passes.
    """

    def update_fn(
        updates: Any,
        state: optax.EmptyState,
        params: Any = None,
        *,
        curvature_signals: Any = None,
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
        kappa_ref = reference_curvature(signals.mean_curvature)
        leaf_stores = iter(stores.leaves())
        out: list[Any] = []
        position = 0
        for u, flag in zip(jax.tree.leaves(updates), flags, strict=True):
            if not flag:
                out.append(None)
                continue
            out.append(
                block_step_scale(
                    next(leaf_stores),
                    signals.mean_curvature[position],
                    u.shape,
                    kappa_ref,
                    alpha=scale.alpha,
                    min_scale=scale.min_scale,
                    max_scale=scale.max_scale,
                    bound=config.bound,
                )
            )
            position += 1
        return out

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


def _scaled(update: Any, scale: Any) -> Any:
    """``scale * update`` in float32 (or wider), back in the update's dtype; None: unscaled."""
    if scale is None or refresh_lib.is_masked(scale):
        return update
    wide = jnp.promote_types(update.dtype, jnp.float32)
    return (scale.astype(wide) * update.astype(wide)).astype(update.dtype)
