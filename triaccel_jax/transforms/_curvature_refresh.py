"""The curvature step of ``scale_by_triaccel``: fold an estimate, then refresh the leaf signals.

Every ``curvature_every`` steps the optimizer folds a fresh diagonal curvature estimate into each
leaf's compressed EMA, and from the bias-corrected EMA derives the leaf's step-size scale
``s_l = clip((kappa_ref / kappa_l) ** alpha, min_scale, max_scale)`` and its noise-to-signal
ratio (docs/design.md §3.2 to §3.4). These functions work on lists of leaves (the optimizer's
flattened trees) and on the indices of the leaves it trains.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from triaccel_jax._src import validation
from triaccel_jax.transforms import _compression as compression
from triaccel_jax.transforms import _compression_sharded as compression_sharded
from triaccel_jax.transforms._triaccel_state import LeafSignals
from triaccel_jax.transforms._triaccel_state import as_named_tuple

_TINY = float(jnp.finfo(jnp.float32).tiny)
_HUGE = float(jnp.finfo(jnp.float32).max)


class FoldedCurvature(NamedTuple):
    """What folding one estimate into the leaves' EMAs gives, per trained leaf index.

    Attributes:
      stores: the new compressed EMA of every leaf (untrained leaves unchanged).
      summaries: bias-corrected summary (mean, max_abs, trace) per trained leaf index.
      dropped: new count of dropped estimates per trained leaf index.
    """

    stores: list[Any]
    summaries: dict[int, Any]
    dropped: dict[int, jax.Array]


def fold_estimate(
    stores: list[Any],
    diagonal: list[Any],
    signals: list[LeafSignals],
    curvature_count: jax.Array,
    *,
    active: list[int],
    shapes: list[tuple[int, ...]],
    curvature_decay: Any,
) -> FoldedCurvature:
    """Folds each trained leaf's estimate into its EMA, leaving non-finite estimates out.

    A non-finite estimate (``|x|**1.5`` at 0, an overflowing HVP) would stay in the EMA for good:
    it is left out, and the leaf's bias correction ``1 - decay**kept`` counts only the estimates
    it kept. ``curvature_count`` is the count after this estimate.
    """
    stores = list(stores)
    decay = jnp.asarray(curvature_decay, jnp.float32)
    summaries, dropped = {}, {}
    for i in active:
        candidate = compression_sharded.update_compressed_ema(
            stores[i], diagonal[i], curvature_decay
        )
        keep = jnp.all(jnp.isfinite(diagonal[i])) & _all_finite(candidate)
        stores[i] = jax.tree.map(
            lambda new, old, keep=keep: jnp.where(keep, new, old), candidate, stores[i]
        )
        old_dropped = signals[i].dropped_estimates
        dropped[i] = jnp.where(keep, old_dropped, optax.safe_increment(old_dropped))
        kept = jnp.maximum(curvature_count - dropped[i], 0)
        correction = jnp.maximum(1 - decay ** kept.astype(jnp.float32), _TINY)
        summary = compression.summarize_diagonal(stores[i], shapes[i])
        summaries[i] = jax.tree.map(lambda x, c=correction: x / c, summary)
    return FoldedCurvature(stores, summaries, dropped)


def refreshed_signals(
    folded: FoldedCurvature,
    signals: list[LeafSignals],
    *,
    active: list[int],
    m_hat: dict[int, jax.Array],
    v_hat: dict[int, jax.Array],
    alpha: Any,
    min_scale: Any,
    max_scale: Any,
    bound: str = "clip",
) -> list[LeafSignals]:
    """Each trained leaf's new :class:`LeafSignals`, its step scale against the median curvature.

    ``kappa_ref`` is the median of the finite mean curvatures, so one leaf cannot poison the
    rest; with no finite curvature anywhere (or a NaN one here) a leaf's step stays unscaled.
    """
    signals = list(signals)
    scales = step_scales(
        {i: folded.summaries[i].mean for i in active},
        alpha=alpha,
        min_scale=min_scale,
        max_scale=max_scale,
        bound=bound,
    )
    for i in active:
        scale = scales[i]
        signal = jnp.mean(jnp.square(m_hat[i]))
        noise = jnp.maximum(jnp.mean(v_hat[i]) - signal, 0.0)
        summary = folded.summaries[i]
        signals[i] = LeafSignals(
            mean_curvature=summary.mean,
            max_curvature=summary.max_abs,
            trace=summary.trace,
            # m_hat can cancel to exactly 0 while v_hat > 0: keep the ratio finite.
            noise_to_signal=jnp.minimum(noise / (signal + _TINY), _HUGE),
            step_scale=scale.astype(jnp.float32),
            dropped_estimates=folded.dropped[i],
        )
    return signals


def step_scales(
    mean_curvatures: dict[int, jax.Array],
    *,
    alpha: Any,
    min_scale: Any,
    max_scale: Any,
    bound: str = "clip",
) -> dict[int, jax.Array]:
    """Each leaf's step scale ``(kappa_ref / kappa_l) ** alpha`` within its bounds.

    The bounds ``[min_scale, max_scale]`` are applied as :func:`bounded_scale`'s ``bound`` says.

    ``kappa_l`` is the leaf's mean curvature clipped at 0 (Hutchinson's can be negative), and
    ``kappa_ref`` the median of the finite ones, so one leaf cannot poison the rest; with no
    finite curvature anywhere (or a NaN one here) a leaf's scale is 1 (float32 scalars).
    """
    if not mean_curvatures:
        return {}
    kappa = {i: jnp.maximum(k, 0.0) for i, k in mean_curvatures.items()}
    kappa_ref = _finite_median(list(kappa.values()))
    return {
        i: bounded_scale(
            kappa_ref, k, alpha=alpha, min_scale=min_scale, max_scale=max_scale, bound=bound
        )
        for i, k in kappa.items()
    }


def check_step_scale(alpha: Any, min_scale: Any, max_scale: Any) -> None:
    """Raises ``ValueError`` unless ``alpha >= 0`` and ``0 < min_scale <= max_scale``."""
    validation.check_in_range("alpha", alpha, 0.0, float("inf"))
    validation.check_in_range("min_scale", min_scale, 0.0, float("inf"), low_inclusive=False)
    validation.check_in_range("max_scale", max_scale, 0.0, float("inf"), low_inclusive=False)
    validation.check_not_above("min_scale", min_scale, "max_scale", max_scale)


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


def refresh_curvature(
    operand: tuple[list[Any], Any, jax.Array, list[LeafSignals]],
    *,
    estimate: Callable[[Any], tuple[Any, Any]],
    treedef: Any,
    active: list[int],
    shapes: list[tuple[int, ...]],
    moments: Callable[[], tuple[dict[int, jax.Array], dict[int, jax.Array]]],
    axis_name: str | None,
    curvature_decay: Any,
    alpha: Any,
    min_scale: Any,
    max_scale: Any,
    bound: str = "clip",
) -> tuple[list[Any], Any, jax.Array, list[LeafSignals]]:
    """One curvature step (the true branch of ``lax.cond``): estimate, fold, refresh signals.

    ``operand`` is ``(stores, estimator_state, curvature_count, signals)``, returned updated;
    ``moments()`` gives the bias-corrected moments the noise-to-signal ratio reads.
    """
    stores, estimator_state, curvature_count, signals = operand
    diagonal, estimator_state = estimate(estimator_state)
    diagonal = treedef.flatten_up_to(diagonal)
    if axis_name is not None:
        # Each replica's Hutchinson estimate sees only its shard of the batch; left alone, the
        # replicas' EMAs and step scales drift apart. The mean over replicas is the estimate of
        # the global batch (the HVP is linear in the loss).
        active_diagonals = lax.pmean([diagonal[i] for i in active], axis_name)
        for i, averaged in zip(active, active_diagonals, strict=True):
            diagonal[i] = averaged
    curvature_count = optax.safe_increment(curvature_count)
    folded = fold_estimate(
        stores,
        diagonal,
        signals,
        curvature_count,
        active=active,
        shapes=shapes,
        curvature_decay=curvature_decay,
    )
    m_hat, v_hat = moments()
    signals = refreshed_signals(
        folded,
        signals,
        active=active,
        m_hat=m_hat,
        v_hat=v_hat,
        alpha=alpha,
        min_scale=min_scale,
        max_scale=max_scale,
        bound=bound,
    )
    return folded.stores, estimator_state, curvature_count, signals


def refresh_when_due(
    state: Any,
    *,
    estimate: Callable[[Any], tuple[Any, Any]],
    treedef: Any,
    active: list[int],
    shapes: list[tuple[int, ...]],
    moments: Callable[[], tuple[dict[int, jax.Array], dict[int, jax.Array]]],
    curvature_every: Any,
    axis_name: str | None,
    curvature_decay: Any,
    alpha: Any,
    min_scale: Any,
    max_scale: Any,
    bound: str = "clip",
) -> tuple[list[Any], Any, jax.Array, list[LeafSignals]]:
    """:func:`refresh_curvature` on the steps it is due (every ``curvature_every``, from the
    first, under ``lax.cond``); the stored stores and signals on the others.

    ``state`` is a state keeping signals (``scale_by_triaccel``'s or ``curvature_signals``'s):
    its ``count`` (before this step), ``curvature``, ``leaf_signals``, ``estimator_state`` and
    ``curvature_count`` are read. Returns ``(stores, estimator_state, curvature_count,
    signals)``, the stores and signals flattened like the updates.
    """
    stores = [
        as_named_tuple(compression.CompressedDiagonal, x)
        for x in treedef.flatten_up_to(state.curvature)
    ]
    signals = [as_named_tuple(LeafSignals, x) for x in treedef.flatten_up_to(state.leaf_signals)]

    def refresh(operand):
        return refresh_curvature(
            operand,
            estimate=estimate,
            treedef=treedef,
            active=active,
            shapes=shapes,
            moments=moments,
            axis_name=axis_name,
            curvature_decay=curvature_decay,
            alpha=alpha,
            min_scale=min_scale,
            max_scale=max_scale,
            bound=bound,
        )

    due = state.count % jnp.asarray(curvature_every, jnp.int32) == 0
    operand = (stores, state.estimator_state, state.curvature_count, signals)
    return lax.cond(due, refresh, lambda operand: operand, operand)


def _all_finite(tree: Any) -> jax.Array:
    """Whether every floating-point entry of ``tree`` is finite (a boolean scalar)."""
    checks = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def _finite_median(values: list[jax.Array]) -> jax.Array:
    """The median of the finite ``values`` (NaN when none is): one leaf cannot poison the rest."""
    stacked = jnp.stack(values)
    return jnp.nanmedian(jnp.where(jnp.isfinite(stacked), stacked, jnp.nan))
