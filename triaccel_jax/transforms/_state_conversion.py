"""``convert_state``: an optimizer state recast to a new precision policy's state dtypes.

When the controller (or a Flax train state) switches policy mid-run, the moments of every
triaccel state and the gradient EMA of every ``curvature_signals`` state inside the optimizer
state take the new policy's state dtype of their leaf (docs/design.md §3.7); everything else
in the state is kept (another optimizer's own moments keep their dtype).
"""

from __future__ import annotations

from typing import Any

import jax

from triaccel_jax import policy as policy_lib
from triaccel_jax._src import tree as tree_lib
from triaccel_jax.transforms import _observer as observer


def convert_state(opt_state: Any, policy: policy_lib.PrecisionPolicy) -> Any:
    """Converts an optimizer state to a new policy's state dtypes; nothing else changes.

    Every :class:`CurvatureSignalsState` inside ``opt_state`` has its moments re-cast (round to
    nearest) to the policy's state dtype of each leaf: the gradient EMA ``mu``, and ``nu`` where
    it is stored like ``mu`` (Adam's, in :func:`triaccel_jax.triaccel` and
    :func:`triaccel_jax.scale_by_triaccel`; the observer's float32 vector of leaf means stays as
    it is). Counters, curvature, signals and keys are kept as they are, and so are the states of
    other transforms. Use it when the controller switches policy mid-run.

    Args:
      opt_state: the optimizer state (any optax wrapping).
      policy: the new policy; it must have an entry for every leaf the states hold.

    Returns:
      The converted state, same tree structure.

    Example:
      >>> import jax.numpy as jnp
      >>> import triaccel_jax
      >>> params = {"w": jnp.ones(3)}
      >>> state = triaccel_jax.triaccel(0.1).init(params)
      >>> policy = triaccel_jax.PrecisionPolicy.uniform(params, "bf16", "bf16")
      >>> triaccel_jax.transforms.convert_state(state, policy)[0].mu["w"].dtype
      dtype(bfloat16)
    """

    policy_lib.check_policy(policy)

    def recast(path, moment):
        name = tree_lib.path_string(path)
        if name not in policy:
            raise ValueError(f"the new policy has no entry for leaf {name!r}")
        return moment.astype(policy_lib.float_format(policy.state(name)).dtype)

    def convert(node):
        if not observer.is_signal_state(node):
            return node
        # Adam's second moment is stored like the first (its tree, shapes and dtypes); the
        # observer's float32 vector of leaf means is left as it is.
        adams = isinstance(node, observer.AdamSignalsState)
        return node._replace(
            mu=jax.tree_util.tree_map_with_path(recast, node.mu),
            nu=jax.tree_util.tree_map_with_path(recast, node.nu) if adams else node.nu,
        )

    return jax.tree.map(convert, opt_state, is_leaf=observer.is_signal_state)
