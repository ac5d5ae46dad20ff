"""Many leaves' compressed curvature stores, updated together over flat buffers (docs/design.md §3).

:func:`triaccel_jax.transforms._compression.update_compressed_ema` is the reference, one leaf at
a time: a block reduction, an expansion, a blend and a ``top_k`` per leaf, about 25 compiled
kernels each, so a model of a few hundred leaves compiled thousands of them. :class:`StoreGroup`
computes the same stores for a whole group of leaves with a fixed number of operations:

* the estimates are concatenated into one flat buffer; every element's leaf, and its block or
  conv channel pair, come from an iota (:mod:`triaccel_jax.transforms._segments`);
* block means are one ``segment_sum`` into the concatenated block means of all leaves;
* the top-``k`` of every leaf: the leaves are grouped by size into power-of-two widths, and
  each group is one ``(leaves, width)`` matrix and one batched ``lax.top_k`` (a sort of the
  whole buffer is far slower on XLA:CPU), which breaks ties by the lower index as the per-leaf
  reference does, so indices and values equal the reference's;
* the per-leaf checks and summaries (finite, trace, largest magnitude) are segment reductions
  over the small block-mean and outlier buffers.

The stores themselves keep their per-leaf shapes: the state's structure, checkpoints and readers
are those of the reference. A group holds leaves that are not sharded (the caller keeps sharded
leaves on the per-leaf, partitioned path, so that no leaf is gathered to be flattened).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from triaccel_jax.transforms import _compression as compression
from triaccel_jax.transforms._segments import Segments
from triaccel_jax.transforms._segments import iota
from triaccel_jax.transforms._segments import locate
from triaccel_jax.transforms._segments import runtime_indices
from triaccel_jax.transforms._segments import table


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CurvatureStores:
    """Every observed leaf's compressed curvature EMA, laid end to end (the signals' state).

    The per-leaf :class:`triaccel_jax.transforms.CompressedDiagonal` of leaf ``l`` is the ``l``-th
    piece of each array (:meth:`leaves`); the pieces' sizes are static fields, so they are part
    of the state's tree structure and known when traced.

    Attributes:
      block_means: float32 ``(B,)``, every leaf's block (or channel-pair) means.
      outlier_indices: int32 ``(K,)``, each outlier's flat index within its own leaf.
      outlier_values: float32 ``(K,)``.
      means_shapes: static, each leaf's block-means shape (``(num_blocks,)`` or ``(in, out)``).
      outlier_counts: static, each leaf's number of outliers ``k``.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.transforms import CurvatureStores, compress_diagonal
      >>> a = compress_diagonal(jnp.array([1.0, 3.0, 0.0, 8.0]), block_size=2, rho=0.25)
      >>> b = compress_diagonal(jnp.array([2.0, 2.0]), block_size=2, rho=0.5)
      >>> stores = CurvatureStores.of([a, b])
      >>> stores.block_means.tolist(), stores.outlier_counts
      ([2.0, 4.0, 2.0], (1, 1))
      >>> stores.leaves()[0].outlier_indices.tolist()
      [3]
    """

    block_means: jax.Array
    outlier_indices: jax.Array
    outlier_values: jax.Array
    means_shapes: tuple[tuple[int, ...], ...] = dataclasses.field(metadata={"static": True})
    outlier_counts: tuple[int, ...] = dataclasses.field(metadata={"static": True})

    @classmethod
    def of(cls, stores: Sequence[compression.CompressedDiagonal]) -> CurvatureStores:
        """The per-leaf stores laid end to end."""
        return cls(
            _concat([jnp.ravel(s.block_means).astype(jnp.float32) for s in stores], jnp.float32),
            _concat([s.outlier_indices.astype(jnp.int32) for s in stores], jnp.int32),
            _concat([s.outlier_values.astype(jnp.float32) for s in stores], jnp.float32),
            means_shapes=tuple(tuple(int(d) for d in s.block_means.shape) for s in stores),
            outlier_counts=tuple(int(s.outlier_values.size) for s in stores),
        )

    @property
    def block_offsets(self) -> np.ndarray:
        return _offsets([math.prod(shape) for shape in self.means_shapes])

    @property
    def outlier_offsets(self) -> np.ndarray:
        return _offsets(self.outlier_counts)

    def leaves(self) -> list[compression.CompressedDiagonal]:
        """The per-leaf stores (the inverse of :meth:`of`).

        Each piece is read at an offset XLA learns only when the program runs
        (:func:`triaccel_jax.transforms._segments.runtime_indices`), so the stores of leaves of
        one shape are read, and used, by one compiled kernel.
        """
        count = len(self.means_shapes)
        blocks = runtime_indices(self.block_offsets[:count])
        outliers = runtime_indices(self.outlier_offsets[:count])
        # As arrays: nnx.Optimizer hands its state over in Variables, which lax's dynamic slice
        # does not take.
        means = jnp.asarray(self.block_means)
        indices = jnp.asarray(self.outlier_indices)
        values = jnp.asarray(self.outlier_values)
        return [
            compression.CompressedDiagonal(
                lax.dynamic_slice_in_dim(means, blocks[i], math.prod(shape)).reshape(shape),
                lax.dynamic_slice_in_dim(indices, outliers[i], size),
                lax.dynamic_slice_in_dim(values, outliers[i], size),
            )
            for i, (shape, size) in enumerate(
                zip(self.means_shapes, self.outlier_counts, strict=True)
            )
        ]

    def with_leaves(
        self, positions: Sequence[int], stores: Sequence[compression.CompressedDiagonal]
    ) -> CurvatureStores:
        """These stores with the leaves at ``positions`` replaced by ``stores`` (same sizes).

        Written in place at offsets XLA learns only when the program runs, as :meth:`leaves`
        reads them, so that leaves of one shape share the compiled writes.
        """
        blocks = runtime_indices([self.block_offsets[i] for i in positions])
        outliers = runtime_indices([self.outlier_offsets[i] for i in positions])
        means, indices, values = self.block_means, self.outlier_indices, self.outlier_values
        for block, outlier, store in zip(blocks, outliers, stores, strict=True):
            means = lax.dynamic_update_slice_in_dim(
                means, jnp.ravel(store.block_means).astype(jnp.float32), block, 0
            )
            indices = lax.dynamic_update_slice_in_dim(
                indices, store.outlier_indices.astype(jnp.int32), outlier, 0
            )
            values = lax.dynamic_update_slice_in_dim(
                values, store.outlier_values.astype(jnp.float32), outlier, 0
            )
        return self.replace(block_means=means, outlier_indices=indices, outlier_values=values)

    def replace(
        self,
        *,
        block_means: jax.Array | None = None,
        outlier_indices: jax.Array | None = None,
        outlier_values: jax.Array | None = None,
    ) -> CurvatureStores:
        """The same layout with new arrays (None: the array kept)."""
        return dataclasses.replace(
            self,
            block_means=self.block_means if block_means is None else block_means,
            outlier_indices=self.outlier_indices if outlier_indices is None else outlier_indices,
            outlier_values=self.outlier_values if outlier_values is None else outlier_values,
        )


def _concat(pieces: list[jax.Array], dtype: Any) -> jax.Array:
    return jnp.concatenate(pieces) if pieces else jnp.zeros((0,), dtype)


def _offsets(sizes: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(sizes, np.int64))]).astype(np.int64)


class StoreGroup:
    """The static layout of the leaves of a :class:`CurvatureStores`, for updating them together.

    Args:
      shapes: the leaves' shapes.
      stores: their stores (only the static layout is read).
    """

    def __init__(self, shapes: Sequence[tuple[int, ...]], stores: CurvatureStores) -> None:
        self.segments = Segments(shapes)
        pairs, modulus, length, spatial, last = [], [], [], [], []
        for shape, means_shape in zip(self.segments.shapes, stores.means_shapes, strict=True):
            size = math.prod(shape)
            num = math.prod(means_shape)
            if compression.uses_channel_pairs(shape):
                pairs.append(True)
                modulus.append(num)
                length.append(1)
                spatial.append(shape[0] * shape[1])
                last.append(shape[0] * shape[1])
            else:
                block_length, _ = compression.block_counts(size, num)
                pairs.append(False)
                modulus.append(1)
                length.append(block_length)
                spatial.append(block_length)
                last.append(size - (num - 1) * block_length)
        self._pairs = np.array(pairs)
        self._modulus = np.array(modulus)
        self._length = np.array(length)
        self._spatial = np.array(spatial, np.float32)
        self._last = np.array(last, np.float32)
        self.block_offsets = stores.block_offsets
        self.outlier_offsets = stores.outlier_offsets

    def _block_leaf(self) -> jax.Array:
        """The leaf of every block, shape ``(B,)``."""
        return locate(self.block_offsets, iota(int(self.block_offsets[-1])))

    def _outlier_leaf(self) -> jax.Array:
        """The leaf of every outlier slot, shape ``(K,)``."""
        return locate(self.outlier_offsets, iota(int(self.outlier_offsets[-1])))

    def _block_weights(self, block_leaf: jax.Array) -> jax.Array:
        """Elements per block, shape ``(B,)``: a channel pair's spatial size, else the block
        length (the leaf's last block possibly shorter)."""
        is_last = iota(block_leaf.size) == (table(self.block_offsets[1:])[block_leaf] - 1)
        return jnp.where(
            is_last,
            table(self._last, jnp.float32)[block_leaf],
            table(self._spatial, jnp.float32)[block_leaf],
        )

    def update(
        self, flat: CurvatureStores, h: jax.Array, decay: jax.typing.ArrayLike
    ) -> CurvatureStores:
        """:func:`compression.update_compressed_ema` of every leaf of the group.

        Args:
          flat: the current EMA of the group's leaves.
          h: the new estimates of the group's leaves laid end to end in float32
            (:meth:`triaccel_jax.transforms._segments.Segments.concat`).
          decay: the EMA decay in [0, 1).

        Returns:
          The updated stores, flat.
        """
        segments = self.segments
        decay = jnp.asarray(decay, jnp.float32)
        leaf = segments.ids()
        local = segments.local(leaf)
        block = table(self.block_offsets[:-1])[leaf] + jnp.where(
            table(self._pairs, jnp.bool_)[leaf],
            local % table(self._modulus)[leaf],
            local // table(self._length)[leaf],
        )
        num_blocks = int(self.block_offsets[-1])
        block_leaf = self._block_leaf()
        sums = jax.ops.segment_sum(h, block, num_segments=num_blocks)
        means = decay * flat.block_means + (1 - decay) * (sums / self._block_weights(block_leaf))

        # The old EMA at full size: block means, with the outliers exact.
        outlier_leaf = self._outlier_leaf()
        starts = table(segments.offsets[:-1])
        full = (
            flat.block_means[block]
            .at[starts[outlier_leaf] + flat.outlier_indices]
            .set(flat.outlier_values)
        )
        blended = decay * full + (1 - decay) * h

        local_indices = self._top_k(jnp.abs(blended), outlier_leaf)
        return flat.replace(
            block_means=means.astype(jnp.float32),
            outlier_indices=local_indices,
            outlier_values=blended[starts[outlier_leaf] + local_indices],
        )

    def _top_k(self, magnitude: jax.Array, outlier_leaf: jax.Array) -> jax.Array:
        """Every leaf's ``k`` largest magnitudes' indices within the leaf, laid end to end.

        A sort of the whole buffer is slow on XLA:CPU (hundreds of ms for a few 100k elements),
        where ``lax.top_k`` over rows is fast. The leaves are grouped by size into power-of-two
        widths; each group is one ``(leaves, width)`` matrix (padding below every magnitude) and
        one batched ``top_k``, so the number of kernels follows the number of size classes, not
        of leaves. ``top_k`` puts the largest first and breaks ties by the lower index, as the
        per-leaf reference does.
        """
        segments = self.segments
        sizes = segments.sizes
        widths = 1 << np.ceil(np.log2(np.maximum(sizes, 1))).astype(np.int64)
        ks = np.diff(self.outlier_offsets)
        pieces, where = [], np.zeros((len(sizes), 2), np.int64)
        base = 0
        for width in np.unique(widths):
            members = np.flatnonzero(widths == width)
            k = int(ks[members].max())
            column = iota(int(width))[None, :]
            valid = column < table(sizes[members])[:, None]
            index = jnp.where(valid, table(segments.offsets[members])[:, None] + column, 0)
            rows = jnp.where(valid, magnitude[index], -1.0)
            _, top = lax.top_k(rows, k)
            pieces.append(top.reshape(-1))
            # Leaf members[r]'s outliers start at base + r * k in the laid-out results.
            where[members, 0] = base + np.arange(len(members)) * k
            base += len(members) * k
        results = jnp.concatenate(pieces)
        rank = iota(int(self.outlier_offsets[-1])) - table(self.outlier_offsets[:-1])[outlier_leaf]
        return results[table(where[:, 0])[outlier_leaf] + rank].astype(jnp.int32)

    def finite(self, flat: CurvatureStores) -> jax.Array:
        """Per leaf, whether its block means and outlier values are all finite, shape ``(L,)``.

        Every element of an estimate enters a block mean, so a store updated from a non-finite
        estimate has a non-finite mean.
        """
        count = len(self.segments)
        bad = jax.ops.segment_sum(
            (~jnp.isfinite(flat.block_means)).astype(jnp.int32),
            self._block_leaf(),
            num_segments=count,
            indices_are_sorted=True,
        ) + jax.ops.segment_sum(
            (~jnp.isfinite(flat.outlier_values)).astype(jnp.int32),
            self._outlier_leaf(),
            num_segments=count,
            indices_are_sorted=True,
        )
        return bad == 0

    def select(
        self, keep: jax.Array, new: CurvatureStores, old: CurvatureStores
    ) -> CurvatureStores:
        """Leaf by leaf, ``new`` where ``keep`` (shape ``(L,)``) holds, else ``old``."""
        by_block = keep[self._block_leaf()]
        by_outlier = keep[self._outlier_leaf()]
        return new.replace(
            block_means=jnp.where(by_block, new.block_means, old.block_means),
            outlier_indices=jnp.where(by_outlier, new.outlier_indices, old.outlier_indices),
            outlier_values=jnp.where(by_outlier, new.outlier_values, old.outlier_values),
        )

    def summarize(self, flat: CurvatureStores) -> compression.DiagonalSummary:
        """:func:`compression.summarize_diagonal` of every leaf: fields of shape ``(L,)``."""
        count = len(self.segments)
        block_leaf = self._block_leaf()
        trace = jax.ops.segment_sum(
            flat.block_means * self._block_weights(block_leaf),
            block_leaf,
            num_segments=count,
            indices_are_sorted=True,
        )
        max_abs = jnp.maximum(
            jax.ops.segment_max(
                jnp.abs(flat.outlier_values),
                self._outlier_leaf(),
                num_segments=count,
                indices_are_sorted=True,
            ),
            0.0,
        )
        return compression.DiagonalSummary(
            trace / table(self.segments.sizes, jnp.float32), max_abs, trace
        )
