"""``signals``: the per-leaf scalars of every triaccel state inside an optimizer state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from triaccel_jax._src import transform
from triaccel_jax._src import tree as tree_lib

SIGNAL_NAMES = transform.LeafSignals._fields


def _find_states(opt_state: Any) -> list[transform.ScaleByTriAccelState]:
    def is_triaccel(node):
        return isinstance(node, transform.ScaleByTriAccelState)

    nodes = jax.tree.leaves(opt_state, is_leaf=is_triaccel)
    return [node for node in nodes if is_triaccel(node)]


def signals(opt_state: Any) -> dict[str, dict[str, Any]]:
    """Per-leaf curvature, noise and step-size figures read from an optimizer state.

    The triaccel state is found anywhere inside ``opt_state``: in an ``optax.chain``, under
    ``optax.inject_hyperparams``, ``optax.MultiSteps``, ``optax.masked`` or
    ``optax.multi_transform``, in a Flax train state's ``opt_state``, or in an
    ``nnx.Optimizer``'s ``opt_state`` (whose paths end in ``/value``, as nnx's own do).

    Args:
      opt_state: an optimizer state holding one or more :func:`triaccel_jax.scale_by_triaccel`
        states whose leaves do not overlap.

    Returns:
      ``{leaf_path: {"mean_curvature", "max_curvature", "trace", "noise_to_signal",
      "step_scale": float, "state_dtype": str}}`` keyed by ``"a/b/kernel"``-style paths of the
      params, for the leaves the optimizer acts on. Values are Python floats, or traced scalars
      when called inside ``jit``.

    Raises:
      ValueError: no triaccel state is found, or two of them hold the same leaf.

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
    """
    states = _find_states(opt_state)
    if not states:
        raise ValueError(
            "no triaccel state found in `opt_state`: pass the state of an optimizer built with "
            "triaccel_jax.triaccel or triaccel_jax.scale_by_triaccel"
        )
    result: dict[str, dict[str, Any]] = {}
    for state in states:

        def is_signals(node):
            # nnx.Optimizer stores the state through nnx.Variables and gives the NamedTuple
            # back as a dict of its fields after an update.
            return isinstance(node, transform.LeafSignals) or (
                isinstance(node, Mapping) and set(node) == set(SIGNAL_NAMES)
            )

        with_paths, _ = jax.tree_util.tree_flatten_with_path(state.leaf_signals, is_leaf=is_signals)
        dtypes = jax.tree.leaves(state.mu)
        entries = [(p, s) for p, s in with_paths if is_signals(s)]
        values = [
            s if isinstance(s, transform.LeafSignals) else transform.LeafSignals(**s)
            for _, s in entries
        ]
        if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(values)):
            values = jax.tree.map(float, jax.device_get(values))
        for (path, _), leaf_values, moment in zip(entries, values, dtypes, strict=True):
            key = tree_lib.path_string(path)
            if key in result:
                raise ValueError(f"two triaccel states hold signals for leaf {key!r}")
            record = dict(zip(SIGNAL_NAMES, leaf_values, strict=True))
            record["state_dtype"] = moment.dtype.name
            result[key] = record
    return result
