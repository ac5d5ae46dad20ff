"""``signals``: the per-leaf scalars of every state keeping curvature signals in an optimizer state.

Those are the :class:`CurvatureSignalsState` of the observer :func:`triaccel_jax.curvature_signals`
(also inside :func:`triaccel_jax.scale_by_curvature`) and the :class:`AdamSignalsState` of the
signals beside Adam's direction (:func:`triaccel_jax.triaccel`,
:func:`triaccel_jax.scale_by_triaccel`), found anywhere inside an optimizer state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from triaccel_jax._src import tree as tree_lib
from triaccel_jax.transforms import _compression as compression
from triaccel_jax.transforms import _observer as observer
from triaccel_jax.transforms import _refresh as refresh_lib

SIGNAL_NAMES = refresh_lib.LeafSignals._fields


def signals(opt_state: Any) -> dict[str, dict[str, Any]]:
    """Per-leaf curvature, noise and step-size figures read from an optimizer state.

    The signals are kept by :func:`triaccel_jax.scale_by_triaccel` (inside
    :func:`triaccel_jax.triaccel`) or by the observer :func:`triaccel_jax.curvature_signals`
    beside any other optimizer, and found anywhere inside ``opt_state``: in an ``optax.chain``, under
    ``optax.inject_hyperparams``, ``optax.MultiSteps``, ``optax.masked`` or
    ``optax.multi_transform``, in a Flax train state's ``opt_state``, or in an
    ``nnx.Optimizer``'s ``opt_state`` (whose paths end in ``/value``, as nnx's own do).

    Under the observer ``step_scale`` is always 1.0: it measures and leaves the updates untouched,
    and only :func:`triaccel_jax.scale_by_triaccel` and :func:`triaccel_jax.scale_by_curvature`
    compute a per-leaf step scale and apply it.

    Args:
      opt_state: an optimizer state holding one or more :func:`triaccel_jax.scale_by_triaccel`
        or :func:`triaccel_jax.curvature_signals` states whose leaves do not overlap.

    Returns:
      ``{leaf_path: {"mean_curvature", "max_curvature", "trace", "noise_to_signal",
      "step_scale": float, ..., "state_dtype": str, "curvature_store": CompressedDiagonal}}``
      keyed by ``"a/b/kernel"``-style paths of the params, for the leaves the optimizer acts
      on: every field of the state's per-leaf signals (Python floats, and ints for counters
      such as ``dropped_estimates``; traced scalars when called inside ``jit``), the dtype of
      the state's moments (the gradient EMA for ``curvature_signals``) as a string, left out
      inside ``jit`` (a string is not an array ``jit`` can return; the dtype is static and
      read outside), and the leaf's bias-corrected curvature EMA as a
      :class:`triaccel_jax.transforms.CompressedDiagonal` (NumPy arrays; traced inside ``jit``), which
      :func:`triaccel_jax.plan_precision` uses to weigh each weight by its own curvature.

    Raises:
      ValueError: no state keeping signals is found, or two of them hold the same leaf.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import triaccel_jax
      >>> tx = optax.chain(optax.clip_by_global_norm(1.0), triaccel_jax.triaccel(1e-3))
      >>> params = {"dense": {"kernel": jnp.ones((2, 3))}}
      >>> state = tx.init(params)
      >>> _, state = tx.update(params, state, params)
      >>> sorted(triaccel_jax.signals(state))
      ['dense/kernel']
      >>> triaccel_jax.signals(state)["dense/kernel"]["state_dtype"]
      'float32'
      >>> import jax  # inside jit: the same figures, the dtype's name left out
      >>> inside = jax.jit(triaccel_jax.signals)(state)["dense/kernel"]
      >>> float(inside["trace"]) == triaccel_jax.signals(state)["dense/kernel"]["trace"]
      True
    """
    result: dict[str, dict[str, Any]] = {}
    for state in _states(opt_state, ""):
        entries = _leaf_signals(state)
        dtypes = jax.tree.leaves(state.mu)
        values = [leaf for _, leaf in entries]
        stores = list(state.curvature_by_leaf().values())
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((values, stores)))
        if not traced:
            values, stores = jax.device_get((values, stores))
            # Python numbers: floats for the float32 figures, ints for the int32 counters.
            values = jax.tree.map(lambda x: np.asarray(x).item(), values)
        for (key, _), leaf_values, moment, store in zip(
            entries, values, dtypes, stores, strict=True
        ):
            if key in result:
                raise ValueError(f"two states hold signals for leaf {key!r}")
            record: dict[str, Any] = dict(zip(SIGNAL_NAMES, leaf_values, strict=True))
            if not traced:
                record["state_dtype"] = moment.dtype.name
            record["curvature_store"] = _bias_corrected(store, leaf_values, traced=traced)
            result[key] = record
    return result


def _bias_corrected(
    store: compression.CompressedDiagonal, leaf: refresh_lib.LeafSignals, *, traced: bool
) -> compression.CompressedDiagonal:
    """The store divided by the EMA's bias correction ``1 - decay**n``.

    The state does not keep the decay, but the signals were computed from this very store with
    that correction: ``max_curvature = max |outlier values| / correction`` (the largest entry is
    always an outlier). So the correction is read back as that ratio; it is the one the
    optimizer used for this leaf, whatever estimates it counted. A store that is still all zero
    (or whose signals are not finite) is returned as it is.
    """
    xp = jnp if traced else np
    raw_max = xp.max(xp.abs(store.outlier_values), initial=0.0)
    corrected_max = xp.asarray(leaf.max_curvature, xp.float32)
    usable = (raw_max > 0) & (corrected_max > 0) & xp.isfinite(corrected_max)
    factor = xp.where(usable, corrected_max / xp.where(raw_max > 0, raw_max, 1.0), 1.0)
    factor = factor.astype(xp.float32)
    return compression.CompressedDiagonal(
        block_means=store.block_means * factor,
        outlier_indices=store.outlier_indices,
        outlier_values=store.outlier_values * factor,
    )


def mean_curvatures(opt_state: Any, params: Any) -> Any:
    """Each leaf's mean curvature ``kappa_l``, as a tree like the params, from an optimizer state.

    The figure is the one :func:`signals` reports as ``"mean_curvature"`` (the mean over the
    leaf of its bias-corrected curvature EMA, refreshed every ``curvature_every`` steps, 0 before
    the first estimate), read from every triaccel state inside ``opt_state`` (found as
    :func:`signals` finds them: in a chain, under optax's wrappers, in a train state) and kept as
    an array, so that it can be used inside ``jit``. It is not clipped: Hutchinson's estimate can
    make it negative.

    Args:
      opt_state: an optimizer state holding one or more :func:`triaccel_jax.scale_by_triaccel`
        or :func:`triaccel_jax.curvature_signals` states whose leaves do not overlap.
      params: the params the optimizer was initialised with, or any tree of their structure (the
        gradients): it sets the result's structure and names the leaves.

    Returns:
      A tree of ``params``' structure holding, for each leaf a triaccel state trains, its mean
      curvature as a float32 scalar array (traced inside ``jit``), and None for the others
      (integer or empty leaves, and leaves left to another optimizer).

    Raises:
      ValueError: no state keeping signals is found, two of them hold the same leaf, or one holds a
        leaf ``params`` does not have (the state is not one of these params).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import triaccel_jax
      >>> from triaccel_jax.transforms import mean_curvatures
      >>> params = {"a": jnp.ones(2), "b": jnp.ones(3), "step": jnp.int32(0)}
      >>> tx = triaccel_jax.triaccel(1e-3)  # the Fisher estimate: the squared gradient
      >>> state = tx.init(params)
      >>> grads = {"a": jnp.full(2, 2.0), "b": jnp.full(3, 3.0), "step": jnp.int32(0)}
      >>> _, state = tx.update(grads, state, params)
      >>> kappa = jax.jit(mean_curvatures)(state, params)
      >>> round(float(kappa["a"]), 4), round(float(kappa["b"]), 4), kappa["step"]
      (4.0, 9.0, None)

    References:
      Tri-Accel (arXiv 2508.16905) and ``docs/design.md`` §3 for the curvature EMA.
    """
    by_path: dict[str, jax.Array] = {}
    for state in _states(opt_state, ", so it holds no curvature"):
        for key, leaf in _leaf_signals(state):
            if key in by_path:
                raise ValueError(f"two states hold curvature for leaf {key!r}")
            by_path[key] = jnp.asarray(leaf.mean_curvature, jnp.float32)
    treedef: Any  # a jaxlib PyTreeDef, which has no stubs mypy can see
    param_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = [tree_lib.path_string(path) for path, _ in param_paths]
    unknown = sorted(set(by_path) - set(keys))
    if unknown:
        raise ValueError(
            f"the optimizer state holds curvature for leaves {unknown} that `params` does not "
            "have: pass the params (or gradients) the optimizer state was initialised with"
        )
    return treedef.unflatten([by_path.get(key) for key in keys])


def _states(opt_state: Any, consequence: str) -> list[Any]:
    """The states keeping signals inside ``opt_state``, or a ValueError saying none is there."""
    states = observer.find_signal_states(opt_state)
    if not states:
        raise ValueError(
            f"no triaccel state found in `opt_state`{consequence}: pass the state of an optimizer "
            "built with triaccel_jax.triaccel or triaccel_jax.scale_by_triaccel, or of a chain "
            "holding the observer triaccel_jax.curvature_signals (e.g. "
            "optax.chain(triaccel_jax.curvature_signals(), optax.adamw(1e-3)))"
        )
    return states


def _leaf_signals(state: Any) -> list[tuple[str, refresh_lib.LeafSignals]]:
    """A triaccel state's per-leaf signals with their ``"a/b/kernel"`` paths, in leaf order."""
    return list(state.signals_by_leaf().items())
