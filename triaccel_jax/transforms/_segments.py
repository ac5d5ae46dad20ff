"""Per-leaf statistics over one flat buffer: the multi-tensor idea for a tree of many leaves.

A reduction written leaf by leaf (``jnp.mean(x)`` for each of ``L`` leaves) compiles ``L``
kernels, and XLA's compile time grows with the number of arrays and of distinct shapes. Here the
leaves of a group are concatenated once into a flat float32 buffer, every statistic is one
segmented operation over it, and per-leaf results come out as a vector of ``L`` values: the
compiled program's size no longer depends on ``L`` (PyTorch's ``foreach`` / multi-tensor apply,
arXiv 1912.01703; unlike ``optax.flatten``, each leaf keeps its own statistics).

Which element belongs to which leaf is computed from an iota with a branchless binary search over
the ``L + 1`` leaf offsets (``log2(L)`` compares of a small table), so the program closes over no
constant as large as the buffer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


class Segments:
    """The static layout of leaves laid end to end in one flat buffer.

    Built at trace time from the leaves' shapes; every leaf must have at least one element.

    Args:
      shapes: the leaves' shapes, in buffer order.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.transforms._segments import Segments
      >>> segments = Segments([(2,), (1, 3)])
      >>> flat = segments.concat([jnp.array([1.0, 3.0]), jnp.array([[2.0, 2.0, 5.0]])])
      >>> segments.mean(flat).tolist()
      [2.0, 3.0]
    """

    def __init__(self, shapes: Sequence[tuple[int, ...]]) -> None:
        self.shapes = tuple(tuple(int(d) for d in shape) for shape in shapes)
        self.sizes = np.array([math.prod(shape) for shape in self.shapes], np.int64)
        if (self.sizes <= 0).any():
            raise ValueError(f"every leaf of a segment layout needs an element: {self.shapes}")
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.total = int(self.offsets[-1])
        if self.total > 2**31 - 1:
            raise ValueError(
                f"{self.total:,} elements in one flat buffer: segment ids index it with int32"
            )

    def __len__(self) -> int:
        return len(self.shapes)

    def concat(self, leaves: Sequence[jax.Array]) -> jax.Array:
        """The leaves raveled and laid end to end, in float32."""
        return jnp.concatenate([jnp.ravel(leaf).astype(jnp.float32) for leaf in leaves])

    def split(self, flat: jax.Array) -> list[jax.Array]:
        """The inverse of :meth:`concat` (in ``flat``'s dtype)."""
        return [
            flat[int(start) : int(stop)].reshape(shape)
            for start, stop, shape in zip(
                self.offsets[:-1], self.offsets[1:], self.shapes, strict=True
            )
        ]

    def ids(self) -> jax.Array:
        """The int32 leaf index of every element of the flat buffer.

        Built row by row (rows of ``ROW`` elements): a row within one leaf is that leaf's index
        broadcast, and only the rows a leaf boundary crosses come from a small table. A binary
        search per element was 80 ms on 2.4M elements on this CPU, this is one broadcast and a
        scatter of a few rows.
        """
        rows = -(-self.total // ROW)
        plan = self._row_plan(rows)
        by_row = jnp.broadcast_to(
            lax.optimization_barrier(table(plan.row_leaf))[:, None], (rows, ROW)
        )
        crossed = np.flatnonzero(plan.crossed)
        by_row = by_row.at[table(crossed)].set(table(plan.crossed_leaf))
        return jnp.minimum(by_row.reshape(-1)[: self.total], len(self) - 1)

    def local(self, ids: jax.Array) -> jax.Array:
        """Every element's index within its own leaf, from :meth:`ids`."""
        return iota(self.total) - table(self.offsets[:-1])[ids]

    def sum(self, flat: jax.Array) -> jax.Array:
        """The sum over each leaf, shape ``(L,)`` (float32 in, float32 out).

        A scatter-add over every element is slow on a CPU (about 10x a reduction), so the
        buffer is cut into rows of ``ROW`` elements: rows inside one leaf are summed by a
        reduction and added to their leaf (a scatter of one number per row); only the few rows
        that a leaf boundary crosses are split element by element.
        """
        count = len(self)
        rows = -(-self.total // ROW)
        matrix = jnp.pad(flat, (0, rows * ROW - self.total)).reshape(rows, ROW)
        plan = self._row_plan(rows)
        whole = jax.ops.segment_sum(
            jnp.where(table(plan.crossed, jnp.bool_), 0.0, matrix.sum(axis=1)),
            table(plan.row_leaf),
            num_segments=count,
            indices_are_sorted=True,
        )
        crossed_rows = np.flatnonzero(plan.crossed)
        split = jax.ops.segment_sum(
            matrix[table(crossed_rows)].reshape(-1),
            table(plan.crossed_leaf.reshape(-1)),
            num_segments=count,
        )
        return whole + split

    def mean(self, flat: jax.Array) -> jax.Array:
        """The mean over each leaf, shape ``(L,)``."""
        return self.sum(flat) / table(self.sizes, jnp.float32)

    def _row_plan(self, rows: int) -> _RowPlan:
        """Static tables of :meth:`sum`: which rows a boundary crosses, each row's leaf, and the
        leaf of every element of the crossed rows (``L``, out of range, past the end)."""
        starts = self.offsets[:-1]
        crossed = np.zeros(rows, bool)
        # A row with a leaf's start strictly inside holds two leaves or more; any other row
        # lies within one leaf (the zeros padding the last row add nothing).
        crossed[starts[starts % ROW != 0] // ROW] = True
        row_leaf = np.searchsorted(self.offsets, np.arange(rows) * ROW, side="right") - 1
        positions = np.flatnonzero(crossed)[:, None] * ROW + np.arange(ROW)[None, :]
        crossed_leaf = np.searchsorted(self.offsets, positions, side="right") - 1
        crossed_leaf = np.where(positions < self.total, crossed_leaf, len(self))
        return _RowPlan(crossed, np.minimum(row_leaf, len(self) - 1), crossed_leaf)


class _RowPlan(NamedTuple):
    crossed: np.ndarray
    row_leaf: np.ndarray
    crossed_leaf: np.ndarray


# Elements per row of Segments.sum: a row crossed by a leaf boundary is split element by element.
ROW = 128


def iota(size: int) -> jax.Array:
    """``0, 1, ..., size - 1`` (int32), computed when the program runs.

    The index arithmetic built on it (leaf ids, blocks, ranks) depends on nothing but static
    shapes, so XLA would otherwise fold it into constants as large as the buffer at compile
    time: over a second for a few million elements, and an executable that holds them. The
    optimization barrier keeps it a computation (a few cheap element-wise kernels).
    """
    return lax.optimization_barrier(jnp.arange(size, dtype=jnp.int32))


def runtime_indices(values: Iterable[Any]) -> tuple[jax.Array, ...]:
    """Each of ``values`` as an int32 scalar that XLA treats as known only when the program runs.

    A read of one leaf's piece of a flat buffer at a static offset is a slice, which XLA:CPU
    compiles as a kernel of its own for every offset (a few milliseconds each), and it makes the
    kernel it fuses into differ from every other leaf's. Read at an offset from behind an
    optimization barrier (``lax.dynamic_slice``), the read fuses into the consumer as a dynamic
    slice, and the leaves of one shape share one compiled kernel.
    """
    return tuple(lax.optimization_barrier(tuple(jnp.int32(int(v)) for v in values)))


def table(values: Any, dtype: Any = jnp.int32) -> jax.Array:
    """A small per-leaf table (``L`` or ``L + 1`` entries) as a constant."""
    return jnp.asarray(np.asarray(values), dtype)


def locate(offsets: np.ndarray, positions: jax.Array) -> jax.Array:
    """For each position, the ``i`` with ``offsets[i] <= position < offsets[i + 1]`` (int32).

    ``offsets`` is a static, non-decreasing NumPy vector starting at 0. A branchless binary search:
    ``ceil(log2(len(offsets)))`` compares, each against a gather from the small table.
    """
    starts = np.asarray(offsets[:-1])
    count = len(starts)
    found = jnp.zeros(positions.shape, jnp.int32)
    if count <= 1:
        return found
    starts_table = table(starts)
    step = 1 << (count - 1).bit_length()
    while step:
        candidate = found + step
        safe = jnp.minimum(candidate, count - 1)
        found = jnp.where((candidate < count) & (starts_table[safe] <= positions), candidate, found)
        step >>= 1
    return found
