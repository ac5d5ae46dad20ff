"""Casting to a lower precision, with round-to-nearest or stochastic rounding.

Stochastic rounding rounds ``x`` up or down to one of its two neighbouring representable values
with probabilities proportional to the distances, so the result is unbiased: ``E[round(x)] = x``.
Optimizer moments stored in bfloat16 need it, because an EMA increment smaller than half a bf16
ulp would otherwise be rounded away on every step and the moment would stall (Gupta et al., 2015,
"Deep Learning with Limited Numerical Precision"; Zamirai et al., 2020, "Revisiting BFloat16
Training").

The random bits are counter-based: they come from ``key`` alone, so the same key gives the same
rounding on every platform, and callers derive per-step keys with ``jax.random.fold_in``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ROUNDING_MODES = ("nearest", "stochastic")

# A float32 whose low 16 bits are zero is exactly representable in bfloat16: bfloat16 is the
# upper half of float32 (same sign and exponent bits, 7 of the 23 mantissa bits).
_BF16_KEPT_MASK = np.uint32(0xFFFF0000)


def cast_reference(
    x: jax.Array,
    dtype: jnp.dtype,
    *,
    rounding: str = "nearest",
    key: jax.Array | None = None,
) -> jax.Array:
    """Casts ``x`` to ``dtype`` with the given rounding (the pure-JAX reference).

    Args:
      x: a floating-point array.
      dtype: the target floating-point dtype.
      rounding: ``"nearest"`` (round to nearest even, XLA's cast) or ``"stochastic"``.
        Stochastic rounding is supported from float32/float16/bfloat16 to bfloat16; a cast to
        the same or a wider dtype is exact and ignores ``rounding``.
      key: a PRNG key, required for stochastic rounding.

    Returns:
      ``x`` in ``dtype``. Non-finite values (inf, nan) are cast unchanged.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from triaccel_jax.kernels.cast import cast_reference
      >>> x = jnp.full((4,), 1.0 + 2.0**-10, jnp.float32)
      >>> y = cast_reference(x, jnp.bfloat16, rounding="stochastic", key=jax.random.key(0))
      >>> bool(jnp.all((y == 1.0) | (y == 1.0 + 2.0**-7)))
      True
    """
    dtype = jnp.dtype(dtype)
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"`rounding` must be one of {ROUNDING_MODES}, got {rounding!r}")
    if rounding == "nearest" or jnp.finfo(dtype).bits >= jnp.finfo(x.dtype).bits:
        return x.astype(dtype)
    if key is None:
        raise ValueError("stochastic rounding needs a PRNG `key`")
    if dtype != jnp.bfloat16:
        raise ValueError(
            f"stochastic rounding to {dtype.name} is not available; supported targets: bfloat16"
        )
    return _stochastic_round_to_bfloat16(x.astype(jnp.float32), key)


def _stochastic_round_to_bfloat16(x: jax.Array, key: jax.Array) -> jax.Array:
    # Adding uniform random bits below the kept mantissa and truncating rounds the magnitude up
    # with probability equal to the dropped fraction; floats are sign-magnitude, so this is
    # unbiased for negative values too.
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint16).astype(jnp.uint32)
    rounded_bits = (bits + noise) & _BF16_KEPT_MASK
    rounded = lax.bitcast_convert_type(rounded_bits, jnp.float32)
    # The carry of a NaN payload could spill into the sign bit; keep non-finite values as they are.
    return jnp.where(jnp.isfinite(x), rounded, x).astype(jnp.bfloat16)
