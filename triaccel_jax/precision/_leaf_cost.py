"""The figures the planner prices a leaf by: ``sum_i h_i * w_i**2`` and the leaf's sizes.

The predicted loss increase of rounding a leaf (docs/design.md §3.6) needs, per trainable leaf,
its size, ``sum w**2``, ``max |w|`` (for fp16's range) and the curvature-weighted
``sum_i h_i * w_i**2``, which is computed here from the optimizer's compressed curvature store
without expanding it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from triaccel_jax import policy as policy_lib
from triaccel_jax import transforms


@jax.jit
def weighted_curvature_sum(store: transforms.CompressedDiagonal, leaf: jax.Array) -> jax.Array:
    """``sum_i h_i * w_i**2`` for the diagonal ``h`` a compressed store represents.

    Equal to ``sum(expand_diagonal(store, leaf.shape) * leaf**2)`` without building the full
    diagonal: each block mean times its block's ``sum w**2`` (for a conv kernel stored per
    (in, out) channel pair, the pair's sum over spatial positions), plus, for each top-k entry,
    its exact value minus its block mean times its ``w**2``. The store's outlier indices are
    distinct, as :func:`triaccel_jax.transforms.compress_diagonal` and the optimizer's updates make them.

    Args:
      store: a leaf's compressed curvature (e.g. ``signals(opt_state)[path]["curvature_store"]``,
        bias-corrected).
      leaf: the parameter leaf ``w``.

    Returns:
      A float32 scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.transforms import compress_diagonal
      >>> from triaccel_jax.precision._leaf_cost import weighted_curvature_sum
      >>> store = compress_diagonal(jnp.array([1.0, 3.0, 0.0, 8.0]), block_size=2, rho=0.25)
      >>> float(weighted_curvature_sum(store, jnp.array([1.0, 1.0, 2.0, 0.5])))  # 2+2+4*4+8/4
      22.0
    """
    w2 = jnp.square(leaf.astype(jnp.float32))
    means = store.block_means.astype(jnp.float32)
    flat = w2.reshape(-1)
    indices = store.outlier_indices
    if transforms.uses_channel_pairs(leaf.shape):
        block_w2 = jnp.sum(w2, axis=(0, 1))
        # Flat index j of an (h, w, in, out) kernel lies in channel pair j mod (in * out).
        outlier_means = means.reshape(-1)[indices % means.size]
    else:
        length, _ = transforms.block_counts(leaf.size, means.size)
        padded = jnp.pad(flat, (0, means.size * length - leaf.size))
        block_w2 = jnp.sum(padded.reshape(means.size, length), axis=1)
        outlier_means = means[indices // length]
    base = jnp.sum(means * block_w2)
    return base + jnp.sum((store.outlier_values - outlier_means) * flat[indices])


def as_store(path: str, store: Any, shape: tuple[int, ...]) -> transforms.CompressedDiagonal:
    """A record's ``curvature_store`` as a store of a leaf of ``shape``, or a clear error."""
    size = math.prod(shape)
    try:
        means, indices, values = (jnp.asarray(x) for x in store)
    except (TypeError, ValueError):
        fits = False
    else:
        means_fit = (
            means.shape == shape[2:]
            if transforms.uses_channel_pairs(shape)
            else means.ndim == 1 and 1 <= means.size <= max(size, 1)
        )
        fits = (
            means_fit
            and indices.ndim == values.ndim == 1
            and indices.shape == values.shape
            and values.size <= size
            and jnp.issubdtype(indices.dtype, jnp.integer)
        )
    if not fits:
        raise ValueError(
            f"`signals[{path!r}]['curvature_store']` must be the compressed curvature of a leaf "
            f"of shape {shape} (block means, outlier indices, outlier values), as "
            f"triaccel_jax.signals returns; got {store!r}"
        )
    return transforms.CompressedDiagonal(means, indices, values)


def leaf_figures(
    params: Any, stores: Mapping[str, transforms.CompressedDiagonal]
) -> dict[str, tuple[int, float, float, float | None]]:
    """``{path: (size, sum w**2, max |w|, sum h w**2 or None)}`` of the trainable leaves.

    ``sum h w**2`` is computed for the leaves in ``stores``; everything comes in one transfer.
    """
    paths = policy_lib.trainable_paths(params)
    figures = jax.device_get(
        [
            (
                jnp.sum(jnp.square(leaf.astype(jnp.float32))),
                jnp.max(jnp.abs(leaf.astype(jnp.float32))),
                weighted_curvature_sum(stores[path], leaf) if path in stores else None,
            )
            for path, leaf in paths
        ]
    )
    return {
        path: (
            int(np.prod(leaf.shape)),
            float(sq),
            float(mx),
            None if weighted is None else float(weighted),
        )
        for (path, leaf), (sq, mx, weighted) in zip(paths, figures, strict=True)
    }
