"""Per-block step scales: ``TriAccelConfig(scale="block")`` (docs/design.md §3.3, §3.4).

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
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from triaccel_jax.transforms import _compression as compression
from triaccel_jax.transforms import _refresh as refresh_lib


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
        (:func:`triaccel_jax.transforms._refresh.reference_curvature`).
      alpha: exponent of the scale, >= 0 (0 gives exactly 1 everywhere).
      min_scale: lower clip, > 0.
      max_scale: upper clip, >= ``min_scale``.
      bound: how the bounds hold the scale, ``"clip"`` or ``"smooth"``
        (:func:`triaccel_jax.transforms._refresh.bounded_scale`).

    Returns:
      A float32 array of ``shape``: the element-wise scale, constant over each block (each
      (in, out) channel pair of a 2-D conv kernel). Where a scale is NaN (no finite curvature
      anywhere) it is 1, as for the per-leaf scale.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.transforms import compress_diagonal
      >>> from triaccel_jax.transforms._block_scale import block_step_scale
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
    per_block = refresh_lib.bounded_scale(
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
