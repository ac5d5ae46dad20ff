"""Casting to a lower precision, with round-to-nearest or stochastic rounding.

Targets: float32 (or any float) to bfloat16, float16 or float8-e4m3fn. For fp8 a per-tensor
``scale`` divides the values before the cast, so that the tensor's range fits the format's +-448
(per-tensor scaling as in Transformer Engine's delayed scaling; :func:`scale_from_amax` computes
it from the absolute maximum).

Stochastic rounding rounds ``x`` up or down to one of its two neighbouring representable values
with probabilities proportional to the distances, so the result is unbiased: ``E[round(x)] = x``.
Optimizer moments stored in bfloat16 need it, because an EMA increment smaller than half a bf16
ulp would otherwise be rounded away on every step and the moment would stall (Gupta et al., 2015,
"Deep Learning with Limited Numerical Precision"; Zamirai et al., 2020, "Revisiting BFloat16
Training").

The random bits are counter-based (Philox-4x32-10, counted by the element's flat index, keyed by
two words drawn from ``key``): the same key gives the same rounding on every platform and in the
Triton kernel, and callers derive per-step keys with ``jax.random.fold_in``. How inf, NaN and
overflow are treated is documented in :mod:`triaccel_jax.kernels._rounding`: NaN stays NaN; for
bfloat16 and float16 inf stays inf and overflow gives inf (IEEE); float8-e4m3fn has no infinity,
so inf gives NaN, and finite values beyond +-448 saturate to +-448.

:func:`cast` is the entry point for models and optimizers: it dispatches at trace time to the
Triton kernel (through jax-triton, on CUDA, where the measured auto table says it wins) or to
:func:`cast_reference`, and has a straight-through
custom VJP so gradients flow through it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from triaccel_jax.kernels import _dispatch
from triaccel_jax.kernels import _rounding

ROUNDING_MODES = _rounding.ROUNDING_MODES
IMPLS = _dispatch.IMPLS
TARGETS = tuple(_rounding.FORMATS)


def _validate(
    x: jax.Array, dtype: Any, rounding: str, key: jax.Array | None, scale: Any
) -> tuple[jnp.dtype, bool]:
    """Checks the arguments; returns the target dtype and whether random bits are needed."""
    dtype = jnp.dtype(dtype)
    _rounding.check_rounding(rounding)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"`x` must be a floating-point array, got {x.dtype}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"`dtype` must be a floating-point dtype, got {dtype}")
    exact = _rounding.is_exact(jnp.float32, dtype)
    if not exact:
        _rounding.target_format(dtype)  # raises for an unsupported narrow target
    if scale is not None and jnp.ndim(scale) != 0:
        raise ValueError(
            f"`scale` must be a scalar (one scale per array), got shape {jnp.shape(scale)}"
        )
    _rounding.check_size(x.shape)
    source = x.dtype if scale is None else jnp.dtype(jnp.float32)  # scaling happens in float32
    needs_bits = rounding == "stochastic" and not exact and not _rounding.is_exact(source, dtype)
    if needs_bits and key is None:
        raise ValueError("stochastic rounding needs a PRNG `key`")
    return dtype, needs_bits


def _reference(
    x: jax.Array, dtype: jnp.dtype, rounding: str, words: jax.Array | None, scale: jax.Array | None
) -> jax.Array:
    """The reference on validated arguments; ``words`` are the Philox key words (or None)."""
    if scale is not None:
        # x / scale as x times the float32 reciprocal: what XLA compiles a division by a scalar
        # to anyway; written out, the kernel can do the very same operation.
        x = x.astype(jnp.float32) * (1 / scale.astype(jnp.float32))
    if _rounding.is_exact(x.dtype, dtype):
        return x.astype(dtype)
    fmt = _rounding.target_format(dtype)
    x = x.astype(jnp.float32)
    if rounding == "nearest" or words is None:
        return _rounding.round_nearest(x, fmt)
    bits = _rounding.random_streams(words, x.shape)[0]
    return _rounding.round_stochastic(x, fmt, bits)


def cast_reference(
    x: jax.Array,
    dtype: Any,
    *,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    scale: jax.Array | float | None = None,
) -> jax.Array:
    """Casts ``x`` to ``dtype`` with the given rounding (the pure-JAX reference).

    Args:
      x: a floating-point array (computed in float32 when it must be rounded).
      dtype: the target floating-point dtype: bfloat16, float16 or float8_e4m3fn, or a dtype
        that holds every float32 exactly (float32, float64), which is a plain cast.
      rounding: ``"nearest"`` (round to nearest even) or ``"stochastic"`` (unbiased; a cast to a
        dtype that holds every value of ``x`` exactly ignores it).
      key: a PRNG key, required for stochastic rounding.
      scale: optional positive scalar; ``x / scale`` is cast (meant for fp8, see
        :func:`scale_from_amax`), computed in float32 as ``x * (1 / scale)``, which is what XLA
        makes of a division by a scalar anyway. The result stands for ``scale * result``.

    Returns:
      ``x`` (divided by ``scale``) in ``dtype``. NaN stays NaN; inf stays inf where the format has
      infinities and becomes NaN in float8_e4m3fn; finite overflow gives inf for bfloat16/float16
      and saturates to +-448 for float8_e4m3fn (see the module docstring).

    Raises:
      ValueError: unknown ``rounding``, unsupported ``dtype``, stochastic rounding without
        ``key``, a non-scalar ``scale`` or an array of 2**31 elements or more.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from triaccel_jax.kernels.cast import cast_reference
      >>> x = jnp.full((4,), 1.0 + 2.0**-10, jnp.float32)
      >>> y = cast_reference(x, jnp.bfloat16, rounding="stochastic", key=jax.random.key(0))
      >>> bool(jnp.all((y == 1.0) | (y == 1.0 + 2.0**-7)))
      True
      >>> cast_reference(jnp.array([100.0, 1e6]), jnp.float8_e4m3fn, scale=2.0).tolist()
      [48.0, 448.0]
    """
    dtype, needs_bits = _validate(x, dtype, rounding, key, scale)
    words = None
    if needs_bits:
        assert key is not None  # _validate refuses needs_bits without a key
        words = _rounding.seed_words(key)
    scale = None if scale is None else jnp.asarray(scale, jnp.float32)
    return _reference(x, dtype, rounding, words, scale)


def round_stochastic(x: jax.Array, dtype: Any, bits: jax.Array) -> jax.Array:
    """Rounds ``x`` stochastically to ``dtype`` with the caller's random bits (pure JAX).

    :func:`cast`'s stochastic rounding, for a caller that draws its own bits, one uint32 per
    element; XLA fuses it with whatever computes ``x``. :func:`cast` draws Philox bits from a key,
    as its Triton kernel does; an optimizer that stores its state at every step draws cheaper ones
    (:func:`triaccel_jax.kernels.quantize.random_bits`, a counter hash). No custom VJP: this
    stores values, it is not a layer.

    Args:
      x: a floating-point array (computed in float32).
      dtype: bfloat16, float16 or float8_e4m3fn; or a dtype that holds every value of ``x``
        exactly (a plain cast, ``bits`` unread).
      bits: uint32 random bits shaped like ``x``.

    Returns:
      ``x`` in ``dtype``, with the special values and overflow of :func:`cast_reference`.

    Raises:
      ValueError: a non-float ``x``, an unsupported ``dtype``, or ``bits`` not uint32 of
        ``x``'s shape.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from triaccel_jax.kernels.cast import round_stochastic
      >>> x = jnp.full((1000,), 1.0 + 2.0**-9)  # a quarter of the way from 1 to the next bf16
      >>> bits = jax.random.bits(jax.random.key(0), x.shape, jnp.uint32)
      >>> y = round_stochastic(x, jnp.bfloat16, bits).astype(jnp.float32)
      >>> bool(jnp.all((y == 1.0) | (y == 1.0 + 2.0**-7))), round(float(jnp.mean(y)), 3)
      (True, 1.002)
    """
    dtype, _ = _validate(x, dtype, "nearest", None, None)
    if bits.dtype != jnp.uint32 or bits.shape != x.shape:
        raise ValueError(
            f"`bits` must be uint32 shaped like `x` {list(x.shape)}, got "
            f"{bits.dtype}{list(bits.shape)}"
        )
    if _rounding.is_exact(x.dtype, dtype):
        return x.astype(dtype)
    return _rounding.round_stochastic(x.astype(jnp.float32), _rounding.target_format(dtype), bits)


def scale_from_amax(
    amax: jax.Array | float, dtype: Any = jnp.float8_e4m3fn, *, margin: int = 0
) -> jax.Array:
    """The per-tensor scale that maps an absolute maximum onto the format's largest value.

    ``scale = amax * 2**margin / max_finite(dtype)`` (e.g. ``amax / 448`` for float8_e4m3fn), so
    that ``x / scale`` just fits; this is Transformer Engine's per-tensor scaling written as a
    divisor (TE multiplies by ``max / amax / 2**margin``). For delayed scaling pass the maximum of
    an amax history. A zero or non-finite ``amax`` gives scale 1 (nothing to fit, or nothing
    trustworthy to fit to).

    Args:
      amax: the absolute maximum of the tensor, ``jnp.max(jnp.abs(x))``, or of a history of it.
      dtype: the target format (float8_e4m3fn by default; any supported target works).
      margin: a power-of-two head-room: ``scale`` is multiplied by ``2**margin``.

    Returns:
      A float32 scalar > 0, to pass as ``scale=`` to :func:`cast` or :func:`cast_reference`.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.kernels.cast import scale_from_amax
      >>> x = jnp.array([0.5, -896.0, 3.0])
      >>> float(scale_from_amax(jnp.max(jnp.abs(x))))
      2.0
    """
    max_finite = np.float32(jnp.finfo(jnp.dtype(dtype)).max)
    amax = jnp.asarray(amax, jnp.float32)
    scale = amax * np.float32(2.0**margin) / max_finite
    return jnp.where(jnp.isfinite(scale) & (scale > 0), scale, np.float32(1.0))


def fp8_scale(x: jax.Array, dtype: Any = jnp.float8_e4m3fn, *, margin: int = 0) -> jax.Array:
    """The current per-tensor scale of ``x``: :func:`scale_from_amax` of ``max(|x|)``.

    Args:
      x: the array to cast (an empty array gives scale 1).
      dtype: the target format.
      margin: power-of-two head-room, as in :func:`scale_from_amax`.

    Returns:
      A float32 scalar > 0 (1 when ``x`` is all zeros or holds inf/NaN).

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.kernels.cast import cast, fp8_scale
      >>> x = jnp.array([0.5, -896.0, 3.0])
      >>> scale = fp8_scale(x)
      >>> (cast(x, jnp.float8_e4m3fn, scale=scale).astype(jnp.float32) * scale).tolist()
      [0.5, -896.0, 3.0]
    """
    if x.size == 0:
        return jnp.ones((), jnp.float32)
    return scale_from_amax(jnp.max(jnp.abs(x.astype(jnp.float32))), dtype, margin=margin)


def _forward(
    x: jax.Array,
    scale: jax.Array | None,
    words: jax.Array | None,
    *,
    dtype: jnp.dtype,
    rounding: str,
    use: str,
) -> jax.Array:
    if use == "triton" and not _rounding.is_exact(jnp.float32, dtype):
        from triaccel_jax.kernels import _cast_triton  # lazy: imports triton and jax_triton

        launch = _dispatch.launch_config(_dispatch.cast_op(dtype, rounding))
        return _cast_triton.cast(
            x, dtype, rounding=rounding, words=words, scale=scale, launch=launch
        )
    return _reference(x, dtype, rounding, words, scale)


def cast(
    x: jax.Array,
    dtype: Any,
    *,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    scale: jax.Array | float | None = None,
    impl: str = "auto",
) -> jax.Array:
    """Casts ``x`` to ``dtype`` through the Triton kernel or the reference, differentiably.

    The implementation is chosen when the call is traced: ``impl="auto"`` runs the Triton kernel
    (through jax-triton) only where JAX's default backend is CUDA, jax_triton imports and the
    measured table ``kernels/auto_table.json`` says ``"triton"`` for this target and
    rounding (see :mod:`triaccel_jax.kernels._dispatch`), and :func:`cast_reference` (compiled by
    XLA) elsewhere. Both draw the same random bits for a key, so they agree bit
    for bit under the Triton interpreter; on a GPU they agree up to the device's arithmetic.

    The VJP is straight-through (Bengio et al., 2013; as in quantisation-aware training): the
    cotangent is cast back to ``x``'s dtype and divided by ``scale`` (the derivative of
    ``x / scale``); no gradient flows to ``scale``, which is a statistic of ``x``, not a parameter.

    Args:
      x: a floating-point array.
      dtype: bfloat16, float16, float8_e4m3fn, or a dtype holding every float32 exactly.
      rounding: ``"nearest"`` or ``"stochastic"``.
      key: a PRNG key, required for stochastic rounding.
      scale: optional positive scalar that divides ``x`` before the cast (for fp8).
      impl: ``"auto"``, ``"reference"`` or ``"triton"``.

    Returns:
      ``x`` (divided by ``scale``) in ``dtype``, as :func:`cast_reference` describes.

    Raises:
      ValueError: as :func:`cast_reference`, or an unknown ``impl``.
      RuntimeError: ``impl="triton"`` where Triton cannot run (no CUDA backend or no jax_triton).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from triaccel_jax.kernels.cast import cast
      >>> x = jnp.array([1.0, 2.0**-12, 3.0])
      >>> cast(x, jnp.float16, impl="reference").dtype
      dtype('float16')
      >>> g = jax.grad(lambda x: jnp.sum(cast(x, jnp.float8_e4m3fn, scale=2.0).astype(jnp.float32)))
      >>> g(x).tolist()
      [0.5, 0.5, 0.5]
    """
    dtype, needs_bits = _validate(x, dtype, rounding, key, scale)
    use = _dispatch.resolve(impl, "cast", _dispatch.cast_op(dtype, rounding))
    words = None
    if needs_bits:
        assert key is not None  # _validate refuses needs_bits without a key
        words = _rounding.seed_words(key)
    scale = None if scale is None else jnp.asarray(scale, jnp.float32)
    forward = functools.partial(_forward, dtype=dtype, rounding=rounding, use=use)
    return _straight_through(forward, x, scale, words)


def _straight_through(
    forward: Any, x: jax.Array, scale: jax.Array | None, words: jax.Array | None
) -> jax.Array:
    """``forward(x, scale, words)`` with the straight-through VJP with respect to ``x``."""

    @jax.custom_vjp
    def f(x, scale, words):
        return forward(x, scale, words)

    def f_fwd(x, scale, words):
        return forward(x, scale, words), (scale, words)

    def f_bwd(residuals, cotangent):
        scale, words = residuals
        if scale is None:
            grad_x = cotangent.astype(x.dtype)
        else:
            grad_x = (cotangent.astype(jnp.float32) * (1 / scale)).astype(x.dtype)
        zero_scale = None if scale is None else jnp.zeros_like(scale)
        zero_words = None if words is None else np.zeros(words.shape, jax.dtypes.float0)
        return grad_x, zero_scale, zero_words

    f.defvjp(f_fwd, f_bwd)
    return f(x, scale, words)
