"""One leaf's AdamW-style update in one pass: new moments, new master, and its compute copy.

What :func:`triaccel_jax.triaccel` does to one leaf (docs/design.md §3), written as one elementwise
function of the gradient, the two moments and the master weights, so that a GPU kernel can read
each of them once and write the four results once (docs/design.md §4: the fused update's win is fewer trips
to memory). For the step number ``t = count``:

* ``m = b1 * m + (1 - b1) * g`` and ``v = b2 * v + (1 - b2) * g**2`` in float32, stored in the
  moments' own dtypes (float32, or bfloat16 with stochastic rounding, so that small EMA
  increments survive: Zamirai et al., 2020);
* ``direction = step_scale * m_hat / (sqrt(v_hat) + eps)`` with ``m_hat = m / (1 - b1**t)`` and
  ``v_hat = v / (1 - b2**t)`` (Adam, Kingma & Ba, 2015) and the per-leaf step-size scale;
* ``master = master - learning_rate * (direction + weight_decay * master)`` (decoupled weight decay,
  Loshchilov & Hutter, 2019), stored in the master's dtype (stochastically rounded when narrower
  than float32, the option that keeps masters in the policy dtype);
* the compute copy: the new master cast to ``compute_dtype`` (divided by ``compute_scale`` first,
  for fp8), with ``rounding``.

With float32 gradients, moments and master this is one step of ``triaccel``: the same float32
operations in the same order, so the results agree to the bit except where XLA fuses a different
``a * b + c`` into an FMA in one graph than in the other (an ulp or two; the tests allow that). One difference on purpose: the optax chain rounds the update to the
gradient's dtype before adding weight decay; here it stays in float32.

Random bits: one Philox evaluation per element gives four streams (mu, nu, master, compute copy),
keyed by two words drawn from ``key`` (see :mod:`triaccel_jax.kernels._rounding`), so the Triton
kernel draws the same bits as this reference.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from triaccel_jax.kernels import _adam
from triaccel_jax.kernels import _dispatch
from triaccel_jax.kernels import _rounding
from triaccel_jax.kernels._adam import Scalars  # re-exported: the kernel reads them in this order
from triaccel_jax.kernels._adam import scalars

MOMENT_DTYPES = ("float32", "bfloat16")
MASTER_DTYPES = ("float32", "bfloat16", "float16")

# Streams of the Philox output used for each stochastically rounded write.
_MU, _NU, _MASTER, _COMPUTE = 0, 1, 2, 3


class FusedUpdate(NamedTuple):
    """The results of one fused update of a leaf.

    Attributes:
      mu: the new first moment, in the old one's dtype.
      nu: the new second moment, in the old one's dtype.
      master: the new master weights, in the old ones' dtype.
      compute: the new master in the compute dtype (the copy the forward pass uses).
    """

    mu: jax.Array
    nu: jax.Array
    master: jax.Array
    compute: jax.Array


def _check_dtype(name: str, dtype: jnp.dtype, allowed: tuple[str, ...]) -> None:
    if jnp.dtype(dtype).name not in allowed:
        raise ValueError(f"`{name}` must have one of the dtypes {allowed}, got {jnp.dtype(dtype)}")


def validate(
    grad: jax.Array,
    mu: jax.Array,
    nu: jax.Array,
    master: jax.Array,
    step_scale: Any,
    *,
    compute_dtype: Any,
    rounding: str,
    key: jax.Array | None,
    compute_scale: Any,
) -> tuple[jnp.dtype, bool]:
    """Checks the arguments; returns the compute dtype and whether random bits are needed."""
    _rounding.check_rounding(rounding)
    if not jnp.issubdtype(grad.dtype, jnp.floating):
        raise ValueError(f"`grad` must be a floating-point array, got {grad.dtype}")
    _check_dtype("mu", mu.dtype, MOMENT_DTYPES)
    _check_dtype("nu", nu.dtype, MOMENT_DTYPES)
    _check_dtype("master", master.dtype, MASTER_DTYPES)
    shapes = {
        name: a.shape for name, a in (("grad", grad), ("mu", mu), ("nu", nu), ("master", master))
    }
    if len(set(shapes.values())) != 1:
        raise ValueError(f"grad, mu, nu and master must have one shape, got {shapes}")
    for name, value in (("step_scale", step_scale), ("compute_scale", compute_scale)):
        if value is not None and jnp.ndim(value) != 0:
            raise ValueError(f"`{name}` must be a scalar, got shape {jnp.shape(value)}")
    compute_dtype = jnp.dtype(compute_dtype)
    if not _rounding.is_exact(jnp.float32, compute_dtype):
        _rounding.target_format(compute_dtype)
    _rounding.check_size(master.shape)
    needs_bits = (
        mu.dtype != jnp.float32
        or nu.dtype != jnp.float32
        or master.dtype != jnp.float32
        or (rounding == "stochastic" and not _rounding.is_exact(jnp.float32, compute_dtype))
    )
    if needs_bits and key is None:
        raise ValueError(
            "a PRNG `key` is needed: bfloat16 moments, a master narrower than float32 and "
            "stochastic rounding of the compute copy are stochastically rounded"
        )
    return compute_dtype, needs_bits


def _write(value: jax.Array, dtype: jnp.dtype, bits: jax.Array | None, rounding: str) -> jax.Array:
    """Casts a float32 result to ``dtype``: exactly, or rounded (stochastically when asked)."""
    if _rounding.is_exact(jnp.float32, dtype):
        return value.astype(dtype)
    fmt = _rounding.target_format(dtype)
    if rounding == "stochastic":
        return _rounding.round_stochastic(value, fmt, bits)
    return _rounding.round_nearest(value, fmt)


def reference(
    grad: jax.Array,
    mu: jax.Array,
    nu: jax.Array,
    master: jax.Array,
    s: Scalars,
    words: jax.Array | None,
    *,
    compute_dtype: jnp.dtype,
    rounding: str,
) -> FusedUpdate:
    """The reference on validated arguments and precomputed scalars (shared with the kernel)."""
    streams = _rounding.random_streams(words, grad.shape) if words is not None else (None,) * 4
    # The optimizer's own moment math (scale_by_triaccel calls the same function).
    mu_f, nu_f, _, _, direction = _adam.adam_moments(grad, mu, nu, s)
    direction = s.step_scale * direction
    master_f = master.astype(jnp.float32)
    master_f = master_f - s.learning_rate * (direction + s.weight_decay * master_f)
    new_master = _write(master_f, master.dtype, streams[_MASTER], "stochastic")
    copy_source = new_master.astype(jnp.float32) * s.inv_compute_scale
    return FusedUpdate(
        mu=_write(mu_f, mu.dtype, streams[_MU], "stochastic"),
        nu=_write(nu_f, nu.dtype, streams[_NU], "stochastic"),
        master=new_master,
        compute=_write(copy_source, compute_dtype, streams[_COMPUTE], rounding),
    )


def fused_update_reference(
    grad: jax.Array,
    mu: jax.Array,
    nu: jax.Array,
    master: jax.Array,
    step_scale: jax.Array | float = 1.0,
    *,
    count: jax.Array | int,
    learning_rate: jax.Array | float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    compute_dtype: Any = jnp.bfloat16,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    compute_scale: jax.Array | float | None = None,
) -> FusedUpdate:
    """One leaf's Adam moments, decoupled-weight-decay master update and compute copy (reference).

    Args:
      grad: the gradient, any floating dtype (computed in float32).
      mu: the first moment, float32 or bfloat16.
      nu: the second moment, float32 or bfloat16.
      master: the master weights, float32, bfloat16 or float16.
      step_scale: the leaf's step-size scale ``s_l`` (a scalar; 1 for plain AdamW).
      count: the new step number ``t >= 1`` (the bias corrections use ``b**t``); may be traced.
      learning_rate: the learning rate of this step; may be traced (a schedule's value).
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to ``sqrt(v_hat)``.
      weight_decay: decoupled weight-decay rate.
      compute_dtype: dtype of the compute copy (float32, bfloat16, float16 or float8_e4m3fn).
      rounding: rounding of the compute copy, ``"nearest"`` or ``"stochastic"``; the moments and
        a narrower master are always stochastically rounded.
      key: a PRNG key; required when anything is stochastically rounded (bfloat16 moments, a
        master narrower than float32, ``rounding="stochastic"`` to a narrower compute dtype).
      compute_scale: optional scalar dividing the new master before the compute cast (for fp8).

    Returns:
      A :class:`FusedUpdate` ``(mu, nu, master, compute)``.

    Raises:
      ValueError: unsupported dtypes, mismatched shapes, non-scalar scales, unknown rounding, or
        a missing ``key``.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.kernels.fused_update import fused_update_reference
      >>> w = jnp.array([1.0, -2.0])
      >>> out = fused_update_reference(
      ...     jnp.array([0.5, -0.5]),
      ...     jnp.zeros(2),
      ...     jnp.zeros(2),
      ...     w,
      ...     count=1,
      ...     learning_rate=0.1,
      ...     weight_decay=0.0,
      ...     compute_dtype=jnp.bfloat16,
      ... )
      >>> [round(v, 4) for v in out.master.tolist()], out.compute.dtype
      ([0.9, -1.9], dtype(bfloat16))
    """
    # One code path: the reference is the dispatching function with the reference forced.
    return fused_update(
        grad,
        mu,
        nu,
        master,
        step_scale,
        count=count,
        learning_rate=learning_rate,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        compute_dtype=compute_dtype,
        rounding=rounding,
        key=key,
        compute_scale=compute_scale,
        impl="reference",
    )


def fused_update(
    grad: jax.Array,
    mu: jax.Array,
    nu: jax.Array,
    master: jax.Array,
    step_scale: jax.Array | float = 1.0,
    *,
    count: jax.Array | int,
    learning_rate: jax.Array | float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    compute_dtype: Any = jnp.bfloat16,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    compute_scale: jax.Array | float | None = None,
    impl: str = "auto",
) -> FusedUpdate:
    """:func:`fused_update_reference`, run by the Triton kernel on CUDA (chosen at trace time).

    ``impl="auto"`` takes the Triton kernel (through jax-triton) only where JAX's default backend
    is CUDA, jax_triton imports and the measured table ``kernels/auto_table.json`` says
    ``"triton"`` for the moments' dtype; the reference (which XLA fuses) elsewhere; ``"reference"`` and ``"triton"`` force
    one. Both draw the same random bits for a key. This is an optimizer step, not a function to
    differentiate through, so it has no VJP.

    Args:
      grad: the gradient, any floating dtype.
      mu: the first moment, float32 or bfloat16.
      nu: the second moment, float32 or bfloat16.
      master: the master weights, float32, bfloat16 or float16.
      step_scale: the leaf's step-size scale (scalar).
      count: the new step number, >= 1.
      learning_rate: the learning rate of this step.
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to ``sqrt(v_hat)``.
      weight_decay: decoupled weight-decay rate.
      compute_dtype: dtype of the compute copy.
      rounding: rounding of the compute copy.
      key: a PRNG key, when anything is stochastically rounded.
      compute_scale: optional scalar dividing the master before the compute cast.
      impl: ``"auto"``, ``"reference"`` or ``"triton"``.

    Returns:
      A :class:`FusedUpdate` ``(mu, nu, master, compute)``.

    Raises:
      ValueError: as :func:`fused_update_reference`, or an unknown ``impl``.
      RuntimeError: ``impl="triton"`` where Triton cannot run.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from triaccel_jax.kernels.fused_update import fused_update
      >>> out = fused_update(
      ...     jnp.ones(3),
      ...     jnp.zeros(3, jnp.bfloat16),
      ...     jnp.zeros(3, jnp.bfloat16),
      ...     jnp.ones(3),
      ...     count=1,
      ...     learning_rate=0.01,
      ...     key=jax.random.key(0),
      ...     impl="reference",
      ... )
      >>> [a.dtype.name for a in out]
      ['bfloat16', 'bfloat16', 'float32', 'bfloat16']
    """
    compute_dtype, needs_bits = validate(
        grad,
        mu,
        nu,
        master,
        step_scale,
        compute_dtype=compute_dtype,
        rounding=rounding,
        key=key,
        compute_scale=compute_scale,
    )
    moments = "bfloat16" if jnp.bfloat16 in (mu.dtype, nu.dtype) else "float32"
    op = _dispatch.fused_update_op(moments)
    use = _dispatch.resolve(impl, "fused update", op)
    s = scalars(
        count=count,
        learning_rate=learning_rate,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        step_scale=step_scale,
        compute_scale=compute_scale,
    )
    words = None
    if needs_bits:
        assert key is not None  # validate refuses needs_bits without a key
        words = _rounding.seed_words(key)
    if use == "triton" and grad.size > 0:
        from triaccel_jax.kernels import _fused_update_triton  # lazy: imports triton

        return _fused_update_triton.fused_update(
            grad,
            mu,
            nu,
            master,
            s,
            words,
            compute_dtype=compute_dtype,
            rounding=rounding,
            launch=_dispatch.launch_config(op),
        )
    return reference(grad, mu, nu, master, s, words, compute_dtype=compute_dtype, rounding=rounding)
