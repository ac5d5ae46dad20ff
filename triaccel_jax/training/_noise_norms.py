"""The two squared gradient norms a gradient-noise-scale estimate needs, from any loss.

A step that trains on a batch of ``B`` samples as two halves of ``B / 2`` (one after the other,
the gradients averaged) computes the same mean gradient as one pass over the batch, at the same
cost, and also gets both norms the simple noise scale is estimated from (McCandlish et al., 2018,
appendix A): ``|g_B|^2`` of the average and ``|g_{B/2}|^2``, the mean of the halves' own. This is
how a hand-written training loop feeds :class:`triaccel_jax.controller.AdaptiveBatches` the
noise that its goodput batch decides from; the controller's own step measures the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from triaccel_jax.training._step import _sq_norm


def _split(leaf: Any) -> jax.Array:
    """A batch leaf of ``2n`` samples as ``(2, n, ...)``: the first half, then the second."""
    leaf = jnp.asarray(leaf)
    if leaf.ndim == 0 or leaf.shape[0] % 2:
        raise ValueError(
            "value_and_grad_with_noise splits the batch into two halves on its leading axis, "
            f"which needs an even number of samples; got a leaf of shape {leaf.shape}"
        )
    return leaf.reshape(2, leaf.shape[0] // 2, *leaf.shape[1:])


def value_and_grad_with_noise(
    fun: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., tuple[Any, Any, dict[str, jax.Array]]]:
    """Like :func:`jax.value_and_grad` of a mean loss over a batch, with the noise norms too.

    The batch (the second argument, a pytree of arrays with the samples on the leading axis) is
    split into two halves that are differentiated one after the other (a ``lax.scan``, so the
    memory is one half's); the value and the gradient are the halves' means, which for a loss
    that averages over its samples is the whole batch's, so the training step is unchanged.

    Args:
      fun: ``fun(params, batch, *args, **kwargs)`` returning the mean loss over ``batch``, or
        ``(loss, aux)`` with ``has_aux``.
      has_aux: whether ``fun`` returns ``(loss, aux)``; ``aux`` is then the halves' mean, leaf
        by leaf (e.g. batch statistics, or an accuracy).

    Returns:
      A function of ``fun``'s arguments returning ``(value, grads, norms)``: ``value`` is the
      loss (or ``(loss, aux)``), ``grads`` the gradient with respect to the first argument, and
      ``norms`` a dict of float32 scalars ``{"grad_sq_norm": |g_B|^2, "micro_grad_sq_norm":
      |g_{B/2}|^2}``: give them to :meth:`triaccel_jax.controller.AdaptiveBatches.report`.

    Raises:
      ValueError: when traced, a batch leaf has an odd number of samples.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from triaccel_jax.training import value_and_grad_with_noise
      >>> def loss(w, batch):
      ...     x, y = batch
      ...     return jnp.mean((x @ w - y) ** 2)
      >>> x = jax.random.normal(jax.random.key(0), (64, 3))
      >>> y = x @ jnp.array([1.0, -1.0, 2.0])
      >>> value, grads, norms = value_and_grad_with_noise(loss)(jnp.zeros(3), (x, y))
      >>> bool(jnp.allclose(grads, jax.grad(loss)(jnp.zeros(3), (x, y)), rtol=1e-5))
      True
      >>> bool(norms["micro_grad_sq_norm"] >= norms["grad_sq_norm"] > 0)
      True

    References:
      McCandlish et al., 2018, "An Empirical Model of Large-Batch Training", arXiv 1812.06162,
      appendix A.
    """
    grad_fn = jax.value_and_grad(fun, has_aux=has_aux)

    def wrapped(params: Any, batch: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any, dict]:
        halves = jax.tree.map(_split, batch)
        first = jax.tree.map(lambda x: x[0], halves)
        shapes = jax.eval_shape(lambda: grad_fn(params, first, *args, **kwargs)[1])

        def body(total: Any, half: Any) -> tuple[Any, Any]:
            value, grads = grad_fn(params, half, *args, **kwargs)
            # The gradients are summed in the carry: memory for one half's, not both.
            return jax.tree.map(jnp.add, total, grads), (value, _sq_norm(grads))

        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        total, (values, norms) = jax.lax.scan(body, zeros, halves)
        grads = jax.tree.map(lambda g: (g / 2).astype(g.dtype), total)
        value = jax.tree.map(lambda v: jnp.mean(v, axis=0).astype(v.dtype), values)
        return (
            value,
            grads,
            {"grad_sq_norm": _sq_norm(grads), "micro_grad_sq_norm": jnp.mean(norms)},
        )

    return wrapped
