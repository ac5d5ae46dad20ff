"""Diagonal curvature estimators, as optax transforms (docs/design.md §3).

Each estimator maps the gradients it receives to a diagonal curvature estimate with the same tree
structure (float32 on trainable leaves; other leaves pass through), in the shape of optax's own
``optax.contrib.hutchinson_estimator_diag_hessian``. :func:`triaccel_jax.scale_by_triaccel` calls
one every ``curvature_every`` steps and keeps a compressed EMA of its output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from triaccel_jax._src import tree as tree_lib
from triaccel_jax._src import validation

_LOSS_FN_HELP = (
    "estimator='hutchinson' needs the loss as an extra argument: call "
    "`tx.update(grads, opt_state, params, loss_fn=lambda p: loss(p, batch))`, where the loss is a "
    "function of the same params tree (with Flax: `loss_fn=lambda p: loss_of(state.apply_fn, p, "
    "batch)`, passed through `triaccel_jax.flax.TrainState.apply_gradients(grads=g, "
    "loss_fn=...)` or `nnx.Optimizer.update(model, grads, loss_fn=...)`; optax's names for the "
    "same argument, `obj_fn=` (contrib.sophia) and `value_fn=` (the line searches), work too); "
    "or use estimator='fisher', which needs no extra argument"
)

# optax names the loss of the params `obj_fn` (contrib.sophia) and `value_fn` (the line
# searches): accepting all three lets one `update(..., value_fn=f)` feed every transform in a
# chain.
LOSS_FN_NAMES = ("loss_fn", "obj_fn", "value_fn")


def resolve_loss_fn(
    loss_fn: Callable[..., Any] | None = None,
    *,
    obj_fn: Callable[..., Any] | None = None,
    value_fn: Callable[..., Any] | None = None,
) -> Callable[..., Any] | None:
    """The loss given under any of :data:`LOSS_FN_NAMES`, or None when none is given.

    Raises:
      TypeError: a given value is not callable.
      ValueError: two names hold different functions (the estimator could not tell which loss
        to differentiate).
    """
    given = {
        name: fn
        for name, fn in zip(LOSS_FN_NAMES, (loss_fn, obj_fn, value_fn), strict=True)
        if fn is not None
    }
    for name, fn in given.items():
        validation.check_callable(name, fn)
    names = list(given)
    for name in names[1:]:
        if given[name] is not given[names[0]]:
            raise ValueError(
                f"`{names[0]}` and `{name}` are different functions, but they are two names "
                "(optax's) of one extra argument, the loss of the params: pass the loss once, "
                "or the same function under each name"
            )
    return given[names[0]] if names else None


def fisher_diagonal() -> optax.GradientTransformationExtraArgs:
    """The empirical Fisher diagonal: the element-wise square of the gradient.

    The gradient is the mean over a batch, so this is the squared batch gradient, the Fisher
    estimate that needs neither per-example gradients nor a loss function (as in Adam's second
    moment; see Kunstner et al., 2019, "Limitations of the Empirical Fisher Approximation" for
    what it does and does not measure). It is the default estimator because it works through a
    plain ``apply_gradients``.

    Returns:
      A transform whose ``update`` returns the float32 diagonal estimate as its "updates".

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.transforms import fisher_diagonal
      >>> tx = fisher_diagonal()
      >>> diag, _ = tx.update({"w": jnp.array([1.0, -2.0])}, tx.init(None))
      >>> diag["w"].tolist()
      [1.0, 4.0]
    """

    def init_fn(params: Any) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        diagonal = jax.tree.map(
            lambda g: jnp.square(g.astype(jnp.float32)) if tree_lib.is_trainable(g) else g,
            updates,
        )
        return diagonal, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class HutchinsonDiagonalState(NamedTuple):
    """State of :func:`hutchinson_diagonal`: the raw PRNG key data (uint32) of the next probe."""

    key: jax.Array


def _rademacher_like(key: jax.Array, params: Any) -> Any:
    """Random +-1 probes for trainable leaves; float0 zeros (no tangent) for the others."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, max(len(leaves), 1))
    probes = [
        jax.random.rademacher(leaf_key, leaf.shape, leaf.dtype)
        if tree_lib.is_trainable(leaf)
        else _no_tangent(leaf)
        for leaf_key, leaf in zip(keys, leaves, strict=False)
    ]
    return jax.tree.unflatten(treedef, probes)


def _no_tangent(leaf: Any) -> Any:
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
        return jnp.zeros(leaf.shape, leaf.dtype)
    return np.zeros(leaf.shape, jax.dtypes.float0)


_MASKED_PARAMS_HELP = (
    "estimator='hutchinson' called `loss_fn` on params with optax.MaskedNode in place of the "
    "leaves an optax.masked / optax.multi_transform leaves out (optax hands the inner transform "
    "only its own leaves), and the loss could not take them ({error}). Give the loss the whole "
    "tree back: `loss_fn=lambda p: loss(triaccel_jax.transforms.unmask(p, params))`, with "
    "`params` the full params of your step (the masked-out leaves are then constants of the "
    "estimate)."
)


def _holds_masked_nodes(tree: Any) -> bool:
    is_masked = lambda x: isinstance(x, optax.MaskedNode)
    return any(is_masked(x) for x in jax.tree.leaves(tree, is_leaf=is_masked))


def unmask(masked_params: Any, params: Any) -> Any:
    """``masked_params`` with each ``optax.MaskedNode`` replaced by that leaf of ``params``.

    Under ``optax.masked`` or ``optax.multi_transform`` the inner transform gets the params
    with ``MaskedNode`` in place of the leaves it does not train, while a loss needs them all.
    Wrap the loss given to a Hessian-based estimator with it.

    Args:
      masked_params: the params as the inner transform sees them.
      params: the full params (the step's).

    Returns:
      A tree like ``params``: the inner transform's leaves where it has them, ``params``'
      elsewhere.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from triaccel_jax.transforms import unmask
      >>> params = {"w": jnp.ones(2), "b": jnp.zeros(2)}
      >>> masked = {"w": jnp.full(2, 3.0), "b": optax.MaskedNode()}
      >>> {k: v.tolist() for k, v in unmask(masked, params).items()}
      {'b': [0.0, 0.0], 'w': [3.0, 3.0]}
    """
    is_masked = lambda x: isinstance(x, optax.MaskedNode)
    return jax.tree.map(
        lambda m, p: p if is_masked(m) else m, masked_params, params, is_leaf=is_masked
    )


def hutchinson_diagonal(
    num_samples: int = 1, *, seed: int = 0
) -> optax.GradientTransformationExtraArgs:
    """Hutchinson's estimate of the Hessian diagonal, ``E[z * (H z)]`` over Rademacher ``z``.

    The Hessian-vector product is forward-over-reverse (``jax.jvp`` of ``jax.grad``), one per
    probe, as in AdaHessian (Yao et al., 2021) and Sophia (Liu et al., 2023, "Sophia: A Scalable
    Stochastic Second-order Optimizer for Language Model Pre-training"). Its cost is about two
    gradient evaluations per probe, which is why triaccel runs it every ``curvature_every`` steps.

    When the loss averages over a batch sharded across devices, ``jit`` computes the HVP of that
    global loss, so the estimate is averaged across devices exactly as the gradient is.

    Args:
      num_samples: Rademacher probes averaged per estimate (>= 1; may be traced).
      seed: seed of the probes' PRNG key.

    Returns:
      A transform whose ``update(updates, state, params, *, loss_fn)`` returns the float32
      diagonal estimate. ``loss_fn(params) -> scalar`` is a keyword-only extra argument; it is
      required (under optax's other names for it, ``obj_fn`` or ``value_fn``, too), and
      ``params`` must be the tree ``loss_fn`` takes.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.transforms import hutchinson_diagonal
      >>> tx = hutchinson_diagonal()
      >>> params = {"w": jnp.array([1.0, 2.0])}
      >>> loss_fn = lambda p: jnp.sum(jnp.array([3.0, 5.0]) * p["w"] ** 2)  # H = diag(6, 10)
      >>> diag, _ = tx.update(params, tx.init(params), params, loss_fn=loss_fn)
      >>> diag["w"].tolist()
      [6.0, 10.0]
    """
    validation.check_integer("num_samples", num_samples, 1)

    def init_fn(params: Any) -> HutchinsonDiagonalState:
        del params
        return HutchinsonDiagonalState(key=jax.random.key_data(jax.random.key(seed)))

    def update_fn(
        updates,
        state,
        params=None,
        *,
        loss_fn: Callable[..., Any] | None = None,
        obj_fn: Callable[..., Any] | None = None,
        value_fn: Callable[..., Any] | None = None,
        **_,
    ):
        loss_fn = resolve_loss_fn(loss_fn, obj_fn=obj_fn, value_fn=value_fn)
        if loss_fn is None:
            raise ValueError(_LOSS_FN_HELP)
        if params is None:
            raise ValueError(
                "estimator='hutchinson' needs `params` in `tx.update(grads, state, params)`"
            )
        key, probe_key = jax.random.split(jax.random.wrap_key_data(state.key))
        gradient_fn = jax.grad(loss_fn, allow_int=True)

        def probe(index, total):
            z = _rademacher_like(jax.random.fold_in(probe_key, index), params)
            _, hz = jax.jvp(gradient_fn, (params,), (z,))
            return jax.tree.map(
                lambda acc, zi, hzi: (
                    acc + zi.astype(jnp.float32) * hzi.astype(jnp.float32)
                    if tree_lib.is_trainable(zi)
                    else acc
                ),
                total,
                z,
                hz,
            )

        zeros = jax.tree.map(
            lambda p: jnp.zeros(p.shape, jnp.float32) if tree_lib.is_trainable(p) else p, params
        )
        samples = jnp.asarray(num_samples, jnp.int32)
        try:
            total = lax.fori_loop(0, samples, probe, zeros)
        except TypeError as error:
            if not _holds_masked_nodes(params):
                raise
            raise ValueError(_MASKED_PARAMS_HELP.format(error=error)) from None
        count = samples.astype(jnp.float32)
        estimate = jax.tree.map(
            lambda t, g: t / count if tree_lib.is_trainable(g) else g, total, updates
        )
        return estimate, HutchinsonDiagonalState(key=jax.random.key_data(key))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
