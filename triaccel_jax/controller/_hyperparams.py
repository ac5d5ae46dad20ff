"""Reading and writing a hyperparameter held by ``optax.inject_hyperparams`` in an optimizer state.

The controller scales the learning rate by writing it into the injected state, which changes an
array, not the compiled program (docs/design.md §5). That only works for a *constant* hyperparameter:
one that a schedule drives is recomputed from the schedule at every update, so writing it would
be silently undone; :func:`find_hyperparam` reports that case.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _is_injected(node: Any) -> bool:
    return isinstance(node, _INJECTED)


class FoundHyperparam(NamedTuple):
    """Where a hyperparameter lives: its value, and whether a schedule recomputes it."""

    value: float
    scheduled: bool


def find_hyperparam(opt_state: Any, name: str) -> FoundHyperparam | None:
    """The injected hyperparameter ``name``, or None when no injected state holds it.

    Raises:
      ValueError: several injected states hold ``name`` (ambiguous).
    """
    found = []
    for node in jax.tree.leaves(opt_state, is_leaf=_is_injected):
        if _is_injected(node) and name in node.hyperparams:
            states = getattr(node, "hyperparams_states", {}) or {}
            found.append(FoundHyperparam(float(node.hyperparams[name]), name in states))
    if len(found) > 1:
        raise ValueError(
            f"{len(found)} injected optimizer states hold a hyperparameter {name!r}; the "
            "controller cannot tell which is the learning rate (pass lr_hyperparam=None to "
            "scale the update instead)"
        )
    return found[0] if found else None


def set_hyperparam(opt_state: Any, name: str, value: float) -> Any:
    """``opt_state`` with the injected hyperparameter ``name`` set to ``value`` (its dtype kept)."""

    def replace(node: Any) -> Any:
        if not (_is_injected(node) and name in node.hyperparams):
            return node
        old = node.hyperparams[name]
        hyperparams = {**node.hyperparams, name: jnp.asarray(value, dtype=jnp.result_type(old))}
        return node._replace(hyperparams=hyperparams)

    return jax.tree.map(replace, opt_state, is_leaf=_is_injected)
