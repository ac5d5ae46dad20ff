"""Adam's moment update and direction, the one implementation of that math in the library.

Both :func:`triaccel_jax.scale_by_triaccel` (the optimizer) and
:func:`triaccel_jax.kernels.fused_update.fused_update_reference` (the fused update's pure-JAX
reference, which the Triton kernel matches) call :func:`adam_moments`, so the two cannot drift
apart. For the step number ``t``:

* ``m = b1 * m + (1 - b1) * g`` and ``v = b2 * v + (1 - b2) * g**2`` in float32;
* ``m_hat = m / (1 - b1**t)``, ``v_hat = v / (1 - b2**t)`` and the direction
  ``m_hat / (sqrt(v_hat) + eps)`` (Kingma & Ba, 2015, "Adam"; docs/design.md §3.1).
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Scalars(NamedTuple):
    """The float32 scalars of an update, computed once in JAX and read by every element.

    Divisions by a scalar are multiplications by its float32 reciprocal: XLA compiles ``x / c``
    for a scalar ``c`` that way anyway (as it does in ``scale_by_triaccel``), and doing it
    explicitly keeps the reference, the optimizer and the kernel on the same operations.
    """

    learning_rate: jax.Array
    b1: jax.Array
    one_minus_b1: jax.Array
    b2: jax.Array
    one_minus_b2: jax.Array
    inv_bias_correction1: jax.Array
    inv_bias_correction2: jax.Array
    eps: jax.Array
    weight_decay: jax.Array
    step_scale: jax.Array
    inv_compute_scale: jax.Array


def scalars(
    *,
    count: Any,
    learning_rate: Any,
    b1: Any,
    b2: Any,
    eps: Any,
    weight_decay: Any,
    step_scale: Any,
    compute_scale: Any,
) -> Scalars:
    """The update's scalars in float32, computed as ``scale_by_triaccel`` computes them."""
    f32 = lambda value: jnp.asarray(value, jnp.float32)
    b1, b2 = f32(b1), f32(b2)
    step = jnp.asarray(count).astype(jnp.float32)
    return Scalars(
        learning_rate=f32(learning_rate),
        b1=b1,
        one_minus_b1=1 - b1,
        b2=b2,
        one_minus_b2=1 - b2,
        inv_bias_correction1=1 / (1 - b1**step),
        inv_bias_correction2=1 / (1 - b2**step),
        eps=f32(eps),
        weight_decay=f32(weight_decay),
        step_scale=f32(step_scale),
        inv_compute_scale=1 / f32(1.0 if compute_scale is None else compute_scale),
    )


def adam_scalars(*, count: Any, b1: Any, b2: Any, eps: Any) -> Scalars:
    """The :class:`Scalars` that :func:`adam_moments` reads (no learning rate, decay or scale)."""
    return scalars(
        count=count,
        learning_rate=0.0,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=0.0,
        step_scale=1.0,
        compute_scale=None,
    )


class AdamMoments(NamedTuple):
    """Adam's new moments (float32, before they are stored) and what is derived from them.

    Attributes:
      mu: the new first moment ``m``.
      nu: the new second moment ``v``.
      m_hat: the bias-corrected first moment.
      v_hat: the bias-corrected second moment.
      direction: ``m_hat / (sqrt(v_hat) + eps)``, before any step-size scale.
    """

    mu: jax.Array
    nu: jax.Array
    m_hat: jax.Array
    v_hat: jax.Array
    direction: jax.Array


def adam_moments(grad: jax.Array, mu: jax.Array, nu: jax.Array, s: Scalars) -> AdamMoments:
    """One step of Adam's moments and direction for one leaf, in float32.

    Args:
      grad: the gradient (any floating dtype; computed in float32).
      mu: the old first moment (any floating dtype).
      nu: the old second moment.
      s: the step's :class:`Scalars` (see :func:`adam_scalars`).

    Returns:
      An :class:`AdamMoments` of float32 arrays shaped like ``grad``.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.kernels._adam import adam_moments, adam_scalars
      >>> s = adam_scalars(count=1, b1=0.9, b2=0.999, eps=1e-8)
      >>> out = adam_moments(jnp.array([0.5, -2.0]), jnp.zeros(2), jnp.zeros(2), s)
      >>> [round(x, 4) for x in out.direction.tolist()]
      [1.0, -1.0]

    References:
      Kingma & Ba, 2015, "Adam: A Method for Stochastic Optimization".
    """
    g = grad.astype(jnp.float32)
    mu_f = s.b1 * mu.astype(jnp.float32) + s.one_minus_b1 * g
    nu_f = s.b2 * nu.astype(jnp.float32) + s.one_minus_b2 * (g * g)
    m_hat = mu_f * s.inv_bias_correction1
    v_hat = nu_f * s.inv_bias_correction2
    return AdamMoments(mu_f, nu_f, m_hat, v_hat, m_hat / (jnp.sqrt(v_hat) + s.eps))
