"""Compressed storage of a diagonal curvature estimate (docs/design.md §3).

A full diagonal would cost one more parameter-sized buffer per leaf. Instead a leaf's diagonal
``h`` is stored as

* block means: the mean of ``h`` over consecutive blocks of ``block_size`` elements of the
  flattened leaf, or, for 2-D convolution kernels (Flax's ``(height, width, in, out)`` layout with
  a spatial extent above one), one mean per (in, out) channel pair, which is AdaHessian's spatial
  averaging (Yao et al., 2021, "ADAHESSIAN: An Adaptive Second Order Optimizer for Machine
  Learning");
* the ``k = ceil(rho * n)`` entries of largest magnitude, kept exactly as (flat index, value), so
  the few large curvatures that block means would smear out survive (the outliers that HAWQ-style
  sensitivity analysis cares about).

From the store come the per-leaf summaries the optimizer and the planner use: the mean (exact,
from the block means), the largest magnitude (exact, from the outliers) and the trace.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from triaccel_jax._src import validation


class CompressedDiagonal(NamedTuple):
    """A leaf's diagonal curvature, compressed.

    Attributes:
      block_means: float32 block means, shape ``(num_blocks,)``, or ``(in, out)`` for a
        convolution kernel stored per channel pair.
      outlier_indices: int32 flat indices of the ``k`` entries of largest magnitude, shape ``(k,)``.
      outlier_values: float32 values at those indices, shape ``(k,)``.
    """

    block_means: jax.Array
    outlier_indices: jax.Array
    outlier_values: jax.Array


def uses_channel_pairs(shape: tuple[int, ...]) -> bool:
    """Whether a leaf of ``shape`` is stored per (in, out) channel pair (a 2-D conv kernel)."""
    return len(shape) == 4 and shape[0] * shape[1] > 1


def num_outliers(size: int, rho: float) -> int:
    """``k = ceil(rho * size)``, at most ``size``: the number of exactly kept entries."""
    # Rounding first keeps products such as 0.07 * 100 = 7.000000000000001 from giving 8.
    return min(size, math.ceil(round(rho * size, 9)))


def num_blocks(size: int, block_size: int) -> int:
    """Blocks of a flattened leaf of ``size`` elements: ``ceil(size / block_size)``."""
    return -(-size // block_size)


def block_counts(size: int, blocks: int) -> tuple[int, jax.Array]:
    """Block length and elements per block when ``size`` elements are cut into ``blocks``.

    Blocks are contiguous and of length ``ceil(size / blocks)`` (at most ``block_size``), the
    last one possibly shorter. The layout depends only on the number of blocks, which the store's
    shape records, so the update needs no static ``block_size`` (it may be an injected
    hyperparameter). The counts are built from an iota rather than a NumPy constant, so that a
    traced function using them closes over no array constants (``custom_partitioning`` needs
    that).
    """
    length = -(-size // blocks)
    last = size - (blocks - 1) * length
    counts = jnp.where(jnp.arange(blocks) == blocks - 1, last, length).astype(jnp.float32)
    return length, counts


def empty_store(shape: tuple[int, ...], *, block_size: int, rho: float) -> CompressedDiagonal:
    """The all-zero store for a leaf of ``shape`` (the initial curvature EMA)."""
    size = math.prod(shape)
    means_shape = shape[2:] if uses_channel_pairs(shape) else (num_blocks(size, block_size),)
    k = num_outliers(size, rho)
    return CompressedDiagonal(
        block_means=jnp.zeros(means_shape, jnp.float32),
        outlier_indices=jnp.arange(k, dtype=jnp.int32),
        outlier_values=jnp.zeros((k,), jnp.float32),
    )


def _block_means(h: jax.Array, blocks: int) -> jax.Array:
    h = h.astype(jnp.float32)
    if uses_channel_pairs(h.shape):
        return jnp.mean(h, axis=(0, 1))
    length, counts = block_counts(h.size, blocks)
    padded = jnp.pad(h.reshape(-1), (0, blocks * length - h.size))
    return jnp.sum(padded.reshape(blocks, length), axis=1) / counts


def _top_magnitude(h: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    flat = h.reshape(-1).astype(jnp.float32)
    _, indices = lax.top_k(jnp.abs(flat), k)
    return indices.astype(jnp.int32), flat[indices]


def compress_diagonal(h: jax.Array, *, block_size: int, rho: float) -> CompressedDiagonal:
    """Compresses a full diagonal ``h`` into block means plus its top-``k`` entries by magnitude.

    Args:
      h: the diagonal, shaped like its parameter leaf.
      block_size: the flattened leaf is cut into ``ceil(h.size / block_size)`` contiguous blocks
        of equal length (the last possibly shorter), at most ``block_size`` long. Ignored for 2-D
        conv kernels, which are averaged per (in, out) channel pair.
      rho: fraction of entries kept exactly, ``k = ceil(rho * h.size)``.

    Returns:
      The :class:`CompressedDiagonal`.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.transforms import compress_diagonal
      >>> store = compress_diagonal(jnp.array([1.0, 3.0, 0.0, 8.0]), block_size=2, rho=0.25)
      >>> store.block_means.tolist(), store.outlier_indices.tolist()
      ([2.0, 4.0], [3])
    """
    validation.check_integer("block_size", block_size, 1)
    validation.check_in_range("rho", rho, 0.0, 1.0, low_inclusive=False)
    means = _block_means(h, num_blocks(h.size, block_size))
    indices, values = _top_magnitude(h, num_outliers(h.size, rho))
    return CompressedDiagonal(means, indices, values)


def expand_diagonal(store: CompressedDiagonal, shape: tuple[int, ...]) -> jax.Array:
    """The full-size approximation of a compressed diagonal: block means, outliers exact.

    Args:
      store: the compressed diagonal.
      shape: the leaf's shape.

    Returns:
      A float32 array of ``shape`` holding each element's block mean, except at the outlier
      indices, which hold the stored values.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.transforms import compress_diagonal, expand_diagonal
      >>> store = compress_diagonal(jnp.array([1.0, 3.0, 0.0, 8.0]), block_size=2, rho=0.25)
      >>> expand_diagonal(store, (4,)).tolist()
      [2.0, 2.0, 4.0, 8.0]
    """
    shape = tuple(shape)
    size = math.prod(shape)
    means_ok = (
        store.block_means.shape == shape[2:]
        if uses_channel_pairs(shape)
        else store.block_means.ndim == 1
        and store.block_means.size <= size
        and (size == 0 or store.block_means.size >= 1)
    )
    if not means_ok or store.outlier_values.size > size:
        raise ValueError(
            f"the store (block means {store.block_means.shape}, {store.outlier_values.size} "
            f"outliers) is not one of a leaf of shape {shape}"
        )
    if uses_channel_pairs(shape):
        full = jnp.broadcast_to(store.block_means, shape).reshape(-1)
    else:
        length, _ = block_counts(size, store.block_means.size)
        full = jnp.repeat(store.block_means, length)[:size]
    return full.at[store.outlier_indices].set(store.outlier_values).reshape(shape)


def update_compressed_ema(
    store: CompressedDiagonal, h: jax.Array, decay: jax.typing.ArrayLike
) -> CompressedDiagonal:
    """Folds a new diagonal estimate ``h`` into the exponential moving average held in ``store``.

    The block means follow the exact EMA of the true block means (the EMA is linear). The outliers
    are the top-``k`` by magnitude of ``decay * expand(store) + (1 - decay) * h``: exact for an
    entry that stays an outlier, approximated by its block mean for one that just became one.

    Args:
      store: the current EMA (not bias-corrected).
      h: the new diagonal estimate, shaped like the leaf.
      decay: the EMA decay in [0, 1).

    Returns:
      The updated store, with the dtypes and shapes of ``store``.
    """
    decay = jnp.asarray(decay, jnp.float32)
    h = h.astype(jnp.float32)
    means = decay * store.block_means + (1 - decay) * _block_means(h, store.block_means.size)
    blended = decay * expand_diagonal(store, h.shape) + (1 - decay) * h
    indices, values = _top_magnitude(blended, store.outlier_values.size)
    return CompressedDiagonal(means.astype(jnp.float32), indices, values)


class DiagonalSummary(NamedTuple):
    """Per-leaf scalars of a diagonal: mean, largest magnitude, trace (float32)."""

    mean: jax.Array
    max_abs: jax.Array
    trace: jax.Array


def summarize_diagonal(store: CompressedDiagonal, shape: tuple[int, ...]) -> DiagonalSummary:
    """Mean, largest magnitude and trace of the diagonal a store represents.

    The trace and mean are exact (block means weighted by block sizes); the largest magnitude is
    exact because the entry of largest magnitude is always among the ``k >= 1`` outliers.
    """
    size = math.prod(shape)
    if uses_channel_pairs(shape):
        trace = jnp.sum(store.block_means) * (shape[0] * shape[1])
    else:
        _, counts = block_counts(size, store.block_means.size)
        trace = jnp.sum(store.block_means * counts)
    max_abs = jnp.max(jnp.abs(store.outlier_values), initial=0.0)
    return DiagonalSummary(trace / size, max_abs, trace)
