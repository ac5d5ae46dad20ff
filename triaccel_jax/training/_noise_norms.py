"""The two squared gradient norms a gradient-noise-scale estimate needs, from any loss.

A step that differentiates a batch of ``B`` samples as two halves of ``B / 2`` and averages the
two gradients gets the same mean gradient as one pass over the batch, with the same arithmetic,
and also both norms the simple noise scale is estimated from (McCandlish et al., 2018, appendix
A): ``|g_B|^2`` of the average and ``|g_{B/2}|^2``, the mean of the halves' own. This is how a
hand-written training loop feeds :class:`triaccel_jax.controller.AdaptiveBatches` the noise that
its goodput batch decides from; the controller's own step measures the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from triaccel_jax.training._step import _sq_norm
from triaccel_jax.training._step import split_in_halves


def value_and_grad_with_noise(
    fun: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., tuple[Any, Any, dict[str, jax.Array]]]:
    """Like :func:`jax.value_and_grad` of a mean loss over a batch, with the noise norms too.

    The batch (the second argument, a pytree of arrays with the samples on the leading axis) is
    split into two halves, the even- and the odd-numbered samples (so that a batch sharded over
    devices is halved within each shard, and no sample moves), each differentiated by
    :func:`jax.value_and_grad`;
    the value and the gradient are the halves' means, which for a loss that averages over its
    samples is the whole batch's, so the training step is unchanged.

    Cost: the halves are two calls in one straight-line program, not a loop (XLA:CPU runs a
    convolution's gradient inside a loop body an order of magnitude slower). Together they do
    the arithmetic of one pass over the batch, so a jitted step costs about what it costs with
    :func:`jax.value_and_grad`: on a 2-core CPU, a Flax linen ``SmallCNN`` training step with
    ``optax.adamw`` at batch 128 took 0.91x its time (``benchmarks/noise_cost.py``, interleaved
    medians; the halves in a ``lax.scan`` took 16x). On an accelerator that a half batch does
    not fill, two half-size passes can cost more than one whole one.

    Memory: XLA schedules the two halves together and may keep both halves' activations live
    at once: up to what :func:`jax.value_and_grad` keeps for the whole batch, plus the two
    halves' gradients beside their mean. It is not one half's memory, as a loop over the halves
    would keep. For that ``SmallCNN`` step at batch 128 on CPU, XLA's predicted peak
    (:func:`triaccel_jax.precision.compiled_peak_bytes`) is 43 MiB, against 53 MiB with
    :func:`jax.value_and_grad` and 30 MiB with the halves in a ``lax.scan``.

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
      ValueError: when traced, a batch leaf has an odd number of samples (on some shard, for
        a sharded batch).

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
        halves = jax.tree.map(
            lambda x: split_in_halves(x, needs="value_and_grad_with_noise"), batch
        )
        # Two calls, not a lax.scan over the halves: XLA:CPU runs a convolution's gradient an
        # order of magnitude slower inside a loop body (see the docstring's cost figures).
        (value_a, grads_a), (value_b, grads_b) = (
            grad_fn(params, jax.tree.map(lambda x, i=i: x[i], halves), *args, **kwargs)
            for i in range(2)
        )
        grads = jax.tree.map(lambda a, b: ((a + b) / 2).astype(a.dtype), grads_a, grads_b)
        value = jax.tree.map(
            lambda a, b: jnp.mean(jnp.stack([a, b]), axis=0).astype(a.dtype), value_a, value_b
        )
        micro = (_sq_norm(grads_a) + _sq_norm(grads_b)) / 2
        return value, grads, {"grad_sq_norm": _sq_norm(grads), "micro_grad_sq_norm": micro}

    return wrapped
