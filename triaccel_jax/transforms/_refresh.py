"""The curvature refresh: fold an estimate into each leaf's EMA, then refresh the leaf signals.

Every ``curvature_every`` steps the curvature signals fold a fresh diagonal curvature estimate
into each leaf's compressed EMA, and from the bias-corrected EMA derive the leaf's signals: its
curvature figures, its noise-to-signal ratio and, where the transform scales the step, its
step-size scale (computed by :func:`triaccel_jax.transforms._step_scale.leaf_step_scales`,
handed in; docs/design.md §3.2 to §3.4). The whole tree is refreshed under one
``lax.cond``. The stores and the signals are kept laid end to end over the observed leaves
(vectors with one entry per leaf), and when every leaf is known to be whole on its devices the
refresh runs over flat buffers with segment reductions, so that the compiled program does not
grow with the number of leaves (docs/design.md §13).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from triaccel_jax.transforms import _compression as compression
from triaccel_jax.transforms import _compression_sharded as compression_sharded
from triaccel_jax.transforms._compression_grouped import CurvatureStores
from triaccel_jax.transforms._compression_grouped import StoreGroup
from triaccel_jax.transforms._config import CurvatureSettings
from triaccel_jax.transforms._segments import Segments
from triaccel_jax.transforms._segments import runtime_indices

_TINY = float(jnp.finfo(jnp.float32).tiny)
_HUGE = float(jnp.finfo(jnp.float32).max)


class LeafSignals(NamedTuple):
    """Per-leaf float32 figures that the curvature signals keep for the planner and controller.

    In the signals' state each field is a vector with one entry per observed leaf (in the
    params' leaf order; :meth:`CurvatureSignalsState.signals_by_leaf` gives each leaf's scalars).
    All are refreshed on curvature steps (every ``curvature_every`` steps, from the first).

    Attributes:
      mean_curvature: mean of the (bias-corrected) curvature EMA over the leaf, ``kappa_l``.
      max_curvature: largest magnitude of the curvature EMA in the leaf.
      trace: sum of the curvature EMA over the leaf.
      noise_to_signal: ``mean(v_hat - m_hat**2) / mean(m_hat**2)``, the gradient noise.
      step_scale: the step-size multiplier ``s_l`` (1 for the observer alone, which scales
        nothing and is handed no step scale).
      dropped_estimates: int32 number of this leaf's curvature estimates left out of the EMA
        because they (or the EMA they would give) were not finite, saturating.
    """

    mean_curvature: jax.Array
    max_curvature: jax.Array
    trace: jax.Array
    noise_to_signal: jax.Array
    step_scale: jax.Array
    dropped_estimates: jax.Array


def as_named_tuple(cls: type[Any], node: Any) -> Any:
    """``node`` as the NamedTuple ``cls`` if it came back as a mapping of its fields.

    ``nnx.Optimizer`` keeps the optimizer state in ``nnx.Variable``s and returns nested
    NamedTuples as dicts of their fields; ``lax.cond`` needs the same structure in both branches.
    """
    if isinstance(node, Mapping) and set(node) == set(cls._fields):
        return cls(**{name: node[name] for name in cls._fields})
    return node


def as_named_tuples(cls: type[Any], tree: Any) -> Any:
    """``tree`` with every mapping of ``cls``'s fields made a ``cls`` (:func:`as_named_tuple`)."""

    def is_node(x: Any) -> bool:
        return (
            is_masked(x)
            or isinstance(x, cls)
            or (isinstance(x, Mapping) and set(x) == set(cls._fields))
        )

    return jax.tree.map(lambda x: as_named_tuple(cls, x), tree, is_leaf=is_node)


def is_masked(node: Any) -> bool:
    """Whether ``node`` stands for a leaf the signals do not observe (an ``is_leaf``)."""
    return isinstance(node, optax.MaskedNode)


def per_leaf(vector: jax.Array, flags: list[bool]) -> list[jax.Array | None]:
    """``vector``'s entries spread over the leaves: the ``i``-th observed leaf gets
    ``vector[i]``, the others None.

    Each entry is read at an index from behind an optimization barrier
    (:func:`triaccel_jax.transforms._segments.runtime_indices`), so that the read fuses into the
    leaf's own kernel and the leaves of one shape share one compiled kernel.
    """
    indices = iter(runtime_indices(range(sum(flags))))
    return [
        lax.dynamic_index_in_dim(vector, next(indices), keepdims=False) if flag else None
        for flag in flags
    ]


class NoiseMoments(NamedTuple):
    """What the noise ratio reads, for the observed leaves in tree order.

    The moments come before their bias corrections, which are applied to the per-leaf means:
    scaling each leaf first would be one more kernel per leaf.

    Attributes:
      m: each leaf's first moment (element-wise).
      v: each leaf's second moment, element-wise (a list, Adam's); or already the vector of
        their means over each leaf, shape ``(L,)`` (the observer's).
      inv_bias_correction1: the scalar ``1 / (1 - b1**t)``.
      inv_bias_correction2: the scalar ``1 / (1 - b2**t)``.
    """

    m: list[jax.Array]
    v: list[jax.Array] | jax.Array
    inv_bias_correction1: jax.Array
    inv_bias_correction2: jax.Array


def grouped(leaves: list[jax.Array]) -> list[bool]:
    """Which leaves are laid end to end in flat buffers: those known to be whole on their
    devices (laying a sharded leaf out would gather it) and under ``GROUPED_LEAF_LIMIT``
    elements, when they are every leaf or at least ``GROUPED_MIN_LEAVES`` of them.

    The flat buffers are temporaries as large as the leaves they hold (about ten of them in a
    refresh), so a large leaf keeps the per-leaf path: its temporaries are its own, and its
    kernels are shared with the other leaves of its shape. The flat path compiles a fixed set of
    kernels (about 65 on XLA:CPU) where the per-leaf path compiles about 20 per distinct shape;
    beside leaves that take the per-leaf path anyway, a few small leaves cost less to compile on
    it too than the flat path's whole set.
    """
    small = [
        math.prod(jnp.shape(leaf)) < GROUPED_LEAF_LIMIT and compression_sharded.is_known_whole(leaf)
        for leaf in leaves
    ]
    if all(small) or sum(small) >= GROUPED_MIN_LEAVES:
        return small
    return [False] * len(leaves)


# Leaves of this many elements or more keep the per-leaf path (see `grouped`). On the 193-leaf
# transformer of benchmarks/compile_time.py (2026-12-05): every leaf flat, compile 1.32x AdamW's
# and 122 MB of temporaries; 2**15, 1.61x and 49 MB (46 MB before the flat path); 2**14, 2.04x
# and 28 MB.
GROUPED_LEAF_LIMIT = 2**15
# Fewer small leaves than this, beside large ones, keep the per-leaf path (see `grouped`). On the
# six 256x256 layers of benchmarks/compile_time.py (six small biases, 2026-12-05), triaccel's
# update compiled 114 kernels with the biases flat and 83 with every leaf apart.
GROUPED_MIN_LEAVES = 16


def leaf_means(
    leaves: list[jax.Array], fn: Callable[[jax.Array], jax.Array] | None = None
) -> jax.Array:
    """Each leaf's mean of ``fn(leaf)`` (element-wise, ``fn(0) == 0``; None: the leaf), shape
    ``(L,)`` in float32.

    The :func:`grouped` leaves are laid end to end as they are (XLA:CPU fuses no producer into
    a concatenation, so ``fn`` is applied after it, once) and one segmented sum gives their
    means; the others are reduced leaf by leaf.
    """
    fn = (lambda x: x) if fn is None else fn
    if not leaves:
        return jnp.zeros((0,), jnp.float32)
    flat = grouped(leaves)
    together = [i for i, g in enumerate(flat) if g]
    apart = [i for i, g in enumerate(flat) if not g]
    means = jnp.zeros((len(leaves),), jnp.float32)
    if together:
        segments = Segments([jnp.shape(leaves[i]) for i in together])
        values = segments.mean(fn(segments.concat([leaves[i] for i in together])))
        means = values if not apart else means.at[np.asarray(together)].set(values)
    if apart:
        values = jnp.stack([jnp.mean(fn(jnp.asarray(leaves[i], jnp.float32))) for i in apart])
        means = values if not together else means.at[np.asarray(apart)].set(values)
    return means


def refresh_when_due(
    state: Any,
    *,
    estimate: Callable[[Any], tuple[Any, Any]],
    like_updates: Callable[[Any], Any],
    updates: Any,
    active: Any,
    moments: Callable[[], NoiseMoments],
    settings: CurvatureSettings,
    step_scales: Callable[[jax.Array], jax.Array] | None,
    axis_name: str | None,
    fisher: bool = False,
) -> tuple[CurvatureStores, Any, jax.Array, LeafSignals]:
    """The curvature step on the steps it is due (every ``curvature_every``, from the first,
    under one ``lax.cond`` for the whole tree); the stored stores and signals on the others.

    Leaves known to be whole on each device are folded together over flat buffers
    (:class:`triaccel_jax.transforms._compression_grouped.StoreGroup`), so the compiled refresh
    does not grow with their number; when any leaf may be sharded, each leaf keeps the per-leaf,
    partitioned update (``_compression_sharded.update_compressed_ema``), which never gathers it.

    Args:
      state: the signals' state: its ``count`` (before this step), ``curvature``,
        ``leaf_signals``, ``estimator_state`` and ``curvature_count`` are read.
      estimate: ``estimator_state -> (diagonal, estimator_state)``, the curvature estimate.
      like_updates: a tree of the estimate's -> the same nodes in the updates' structure (a
        clear error where it differs).
      updates: the gradients (their shapes give the leaves').
      active: a tree of the updates' structure, True where the leaf is observed.
      moments: ``() -> NoiseMoments`` of the observed leaves; called only on the steps that
        refresh.
      settings: the decays.
      step_scales: the leaves' mean curvatures -> their step scales (vectors over the
        observed leaves; :func:`triaccel_jax.transforms._step_scale.leaf_step_scales`), or
        None where nothing is scaled: every scale is then 1.
      axis_name: the mapped axis over which replicas average their estimates, or None.
      fisher: the estimate is the empirical Fisher diagonal, the squared updates: on the flat
        path it is squared once, after laying the updates end to end (the estimate's own
        per-leaf squares are then unused, and compiled away).

    Returns:
      ``(stores, estimator_state, curvature_count, signals)``: the observed leaves' stores and
      their signals as vectors over the observed leaves.
    """
    stores = state.curvature
    signals = as_named_tuple(LeafSignals, state.leaf_signals)
    flags = [bool(flag) for flag in jax.tree.leaves(active)]

    def refresh(operand):
        stores, estimator_state, curvature_count, signals = operand
        diagonal, estimator_state = estimate(estimator_state)
        diagonal = like_updates(diagonal)
        if axis_name is not None:
            # Each replica's Hutchinson estimate sees only its shard of the batch; left alone,
            # the replicas' EMAs and step scales drift apart. The mean over replicas is the
            # estimate of the global batch (the HVP is linear in the loss).
            observed = jax.tree.map(lambda d, a: d if a else None, diagonal, active)
            averaged = lax.pmean(observed, axis_name)
            diagonal = jax.tree.map(
                lambda d, a: d if a is None else a, diagonal, averaged, is_leaf=_is_none
            )
        curvature_count = optax.safe_increment(curvature_count)
        if not any(flags):
            return stores, estimator_state, curvature_count, signals
        treedef: Any = jax.tree.structure(updates)  # a PyTreeDef: no stubs mypy can see
        estimates = [
            h for h, flag in zip(treedef.flatten_up_to(diagonal), flags, strict=True) if flag
        ]
        shapes = [
            tuple(g.shape) for g, flag in zip(jax.tree.leaves(updates), flags, strict=True) if flag
        ]
        decay = settings.curvature_decay
        observed = [g for g, flag in zip(jax.tree.leaves(updates), flags, strict=True) if flag]
        squared = fisher and axis_name is None
        new_stores, keep, summary = _fold_all(stores, shapes, estimates, observed, squared, decay)
        old_dropped = signals.dropped_estimates
        dropped = jnp.where(keep, old_dropped, optax.safe_increment(old_dropped))
        kept = jnp.maximum(curvature_count - dropped, 0)
        correction = jnp.maximum(
            1 - jnp.asarray(decay, jnp.float32) ** kept.astype(jnp.float32), _TINY
        )
        summary = jax.tree.map(lambda x: x / correction, summary)

        noise = moments()
        signal = leaf_means(noise.m, jnp.square) * jnp.square(noise.inv_bias_correction1)
        v_mean = (
            leaf_means(noise.v) if isinstance(noise.v, list) else noise.v
        ) * noise.inv_bias_correction2
        noise_level = jnp.maximum(v_mean - signal, 0.0)
        new_signals = LeafSignals(
            mean_curvature=summary.mean,
            max_curvature=summary.max_abs,
            trace=summary.trace,
            # m_hat can cancel to exactly 0 while v_hat > 0: keep the ratio finite.
            noise_to_signal=jnp.minimum(noise_level / (signal + _TINY), _HUGE),
            step_scale=(
                jnp.ones(jnp.shape(summary.mean), jnp.float32)
                if step_scales is None
                else step_scales(summary.mean)
            ),
            dropped_estimates=dropped,
        )
        return new_stores, estimator_state, curvature_count, new_signals

    due = state.count % jnp.asarray(settings.curvature_every, jnp.int32) == 0
    operand = (stores, state.estimator_state, state.curvature_count, signals)
    return lax.cond(due, refresh, lambda operand: operand, operand)


def _fold_all(
    stores: CurvatureStores,
    shapes: list[tuple[int, ...]],
    estimates: list[jax.Array],
    updates: list[jax.Array],
    squared: bool,
    decay: Any,
) -> tuple[CurvatureStores, jax.Array, compression.DiagonalSummary]:
    """Every observed leaf's store after an estimate, whether it was kept, and its summary
    (vectors over the leaves). The :func:`grouped` leaves' candidates are folded together over
    flat buffers, the others' one by one (partitioned when sharded); the checks, the choice
    between candidate and old store and the summaries then run over the laid-out stores, which
    are small (a mean per block and ``k`` outliers per leaf), for every leaf at once.
    ``squared``: the estimate is the squared update (the Fisher's), squared once after laying the
    updates out."""
    count = len(shapes)
    flags = grouped(estimates)
    together = [i for i in range(count) if flags[i]]
    apart = [i for i in range(count) if not flags[i]]
    candidate = stores
    if together:
        blocks, outliers = stores.block_offsets, stores.outlier_offsets
        every = len(together) == count
        block_index, outlier_index = _ranges(blocks, together), _ranges(outliers, together)
        sub = (
            stores
            if every
            else CurvatureStores(
                stores.block_means[block_index],
                stores.outlier_indices[outlier_index],
                stores.outlier_values[outlier_index],
                means_shapes=tuple(stores.means_shapes[i] for i in together),
                outlier_counts=tuple(stores.outlier_counts[i] for i in together),
            )
        )
        group = StoreGroup([shapes[i] for i in together], sub)
        if squared:
            h = jnp.square(group.segments.concat([updates[i] for i in together]))
        else:
            h = group.segments.concat([estimates[i] for i in together])
        folded = group.update(sub, h, decay)
        if every:
            candidate = folded
        else:
            candidate = candidate.replace(
                block_means=candidate.block_means.at[block_index].set(folded.block_means),
                outlier_indices=candidate.outlier_indices.at[outlier_index].set(
                    folded.outlier_indices
                ),
                outlier_values=candidate.outlier_values.at[outlier_index].set(
                    folded.outlier_values
                ),
            )
    if apart:
        # Read and written back at offsets known only when the program runs, so that the fold's
        # kernels are the same for every leaf of one shape (XLA compiles those once).
        pieces = stores.leaves()
        candidate = candidate.with_leaves(
            apart,
            [
                compression_sharded.update_compressed_ema(pieces[i], estimates[i], decay)
                for i in apart
            ],
        )
    every_leaf = StoreGroup(shapes, stores)
    keep = every_leaf.finite(candidate)
    new = every_leaf.select(keep, candidate, stores)
    return new, keep, every_leaf.summarize(new)


def _ranges(offsets: np.ndarray, leaves: list[int]) -> np.ndarray:
    """The positions of ``leaves``' pieces in a buffer laid out at ``offsets`` (static)."""
    return np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in leaves])


class _Folded(NamedTuple):
    """One leaf's EMA after an estimate: its store, bias-corrected summary and dropped count."""

    store: compression.CompressedDiagonal
    summary: compression.DiagonalSummary
    dropped: jax.Array


def _fold(
    store: compression.CompressedDiagonal,
    diagonal: jax.Array,
    signal: LeafSignals,
    shape: tuple[int, ...],
    curvature_count: jax.Array,
    curvature_decay: Any,
) -> _Folded:
    """Folds one leaf's estimate into its EMA, leaving a non-finite estimate out: the one-leaf
    reference of what :func:`refresh_when_due` does for every leaf.

    A non-finite estimate (``|x|**1.5`` at 0, an overflowing HVP) would stay in the EMA for good:
    it is left out, and the leaf's bias correction ``1 - decay**kept`` counts only the estimates
    it kept. ``curvature_count`` is the count after this estimate.
    """
    store, keep = _fold_store(store, diagonal, curvature_decay)
    old_dropped = signal.dropped_estimates
    dropped = jnp.where(keep, old_dropped, optax.safe_increment(old_dropped))
    kept = jnp.maximum(curvature_count - dropped, 0)
    decay = jnp.asarray(curvature_decay, jnp.float32)
    correction = jnp.maximum(1 - decay ** kept.astype(jnp.float32), _TINY)
    summary = compression.summarize_diagonal(store, shape)
    return _Folded(store, jax.tree.map(lambda x: x / correction, summary), dropped)


def _fold_store(
    store: compression.CompressedDiagonal, diagonal: jax.Array, curvature_decay: Any
) -> tuple[compression.CompressedDiagonal, jax.Array]:
    """One leaf's store after an estimate (partitioned shard by shard when the leaf is sharded),
    and whether it was kept: a non-finite candidate leaves the old store in place."""
    candidate = compression_sharded.update_compressed_ema(store, diagonal, curvature_decay)
    # Every element of the estimate enters a block mean of the candidate, so the candidate is
    # finite only if the estimate is; and max(|x|) is NaN or inf exactly where x holds one.
    # Two small reductions, where checking the whole estimate would be two more of its size.
    keep = jnp.isfinite(_max_abs(candidate.block_means)) & jnp.isfinite(
        _max_abs(candidate.outlier_values)
    )
    return jax.tree.map(lambda new, old: jnp.where(keep, new, old), candidate, store), keep


def _is_none(node: Any) -> bool:
    return node is None


def _max_abs(x: jax.Array) -> jax.Array:
    """``max(|x|)``: NaN where ``x`` holds a NaN, inf where an infinity (0 when empty)."""
    return jnp.max(jnp.abs(x), initial=0.0)
