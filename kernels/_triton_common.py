"""Triton device functions shared by the kernels: the Philox seed, the two roundings, format codes.

Imports triton; only the kernel modules import this, and only :func:`triaccel_jax.kernels.cast`
and :func:`triaccel_jax.kernels.fused_update` import those, lazily, when the Triton path is taken.

The device functions compute what :mod:`triaccel_jax.kernels._rounding` (the reference) computes,
bit for bit, with exact float32 and integer operations: they round and encode the narrow formats'
bit patterns themselves instead of using a conversion instruction, both because the interpreter's
narrow conversions are approximate (bfloat16 truncates, float8 mishandles NaN) and so that the
GPU and the interpreter run the very same arithmetic. Stochastic rounding uses the reference's
Philox bits (``tl.randint4x`` is Philox-4x32-10). In the kernels, divisions and square roots use
the IEEE-rounded ``div_rn`` / ``sqrt_rn``: Triton's ``/`` and ``sqrt`` are the fast approximate
ones on NVIDIA GPUs, while XLA's are correctly rounded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from triaccel_jax.kernels import _launch
from triaccel_jax.kernels import _rounding

# Format codes passed to the kernels as ``tl.constexpr``. The constants of each format inside
# the device functions below are those of _rounding.FORMATS (mantissa bits, smallest normal
# exponent, largest finite value); the parity tests hold the two tables together.
FLOAT32 = 0
BFLOAT16 = 1
FLOAT16 = 2
FLOAT8_E4M3FN = 3

_CODES = {
    "float32": FLOAT32,
    "bfloat16": BFLOAT16,
    "float16": FLOAT16,
    "float8_e4m3fn": FLOAT8_E4M3FN,
}

# The default launch (_launch.DEFAULT): 8 elements per thread with 4 warps, enough for full-width
# accesses; a measured table may pick another of _launch.CANDIDATES per operation.
BLOCK = _launch.DEFAULT.block
NUM_WARPS = _launch.DEFAULT.num_warps


def format_code(dtype: jnp.dtype) -> int:
    """The kernels' code for a target dtype: float32 (stored as computed) or a narrow format."""
    dtype = jnp.dtype(dtype)
    if dtype.name not in _CODES:
        _rounding.target_format(dtype)  # raises the reference's error for unsupported targets
    return _CODES[dtype.name]


# Narrow outputs are declared to jax-triton as unsigned integers of the same width and bitcast
# back in JAX (free): the kernels store computed bit patterns anyway, and no jax-triton version's
# dtype table has to know float8_e4m3fn.
_STORAGE = {"bfloat16": jnp.uint16, "float16": jnp.uint16, "float8_e4m3fn": jnp.uint8}


def storage_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype an output of ``dtype`` is declared with to jax-triton (and launched with)."""
    return jnp.dtype(_STORAGE.get(jnp.dtype(dtype).name, dtype))


def from_storage(out: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """An output declared with :func:`storage_dtype`, viewed as ``dtype`` again."""
    if out.dtype == jnp.dtype(dtype):
        return out
    return jax.lax.bitcast_convert_type(out, dtype)


def grid(n: int, block: int = BLOCK) -> tuple[int]:
    """One program per ``block`` elements (:data:`BLOCK` by default)."""
    return (triton.cdiv(n, block),)


@triton.jit
def load_seed(words_ptr):
    """The 64-bit Philox seed ``hi << 32 | lo`` from the two int32 key words (see _rounding)."""
    lo = tl.load(words_ptr).to(tl.uint32, bitcast=True).to(tl.uint64)
    hi = tl.load(words_ptr + 1).to(tl.uint32, bitcast=True).to(tl.uint64)
    return (hi << 32) | lo


@triton.jit
def _exp2(exponent):
    # 2.0 ** exponent for an int32 exponent in [-126, 127], built from its bits (exact).
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _is_finite(x_bits):
    return (x_bits & 0x7F800000) != 0x7F800000


@triton.jit
def _encode_bfloat16(x, bits, STOCHASTIC: tl.constexpr):
    # bfloat16 is the upper half of float32. Stochastic: add 16 random bits below the kept half
    # and truncate (as _rounding.round_stochastic). Nearest even: add 0x7FFF plus the lowest kept
    # bit, then truncate. A carry out of the largest finite value gives infinity's bit pattern.
    x_bits = x.to(tl.uint32, bitcast=True)
    if STOCHASTIC:
        rounded = x_bits + (bits >> 16)
    else:
        rounded = x_bits + 0x7FFF + ((x_bits >> 16) & 1)
    finite = _is_finite(x_bits)
    # Non-finite inputs: keep the upper half (inf stays inf); NaN gets the quiet bit, so that a
    # payload only in the lower half cannot turn into inf.
    is_nan = (x_bits & 0x7FFFFFFF) > 0x7F800000
    field = tl.where(finite, rounded >> 16, tl.where(is_nan, (x_bits >> 16) | 0x40, x_bits >> 16))
    return field


@triton.jit
def _encode_small(
    x,
    bits,
    STOCHASTIC: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    WIDTH: tl.constexpr,
    SATURATE: tl.constexpr,
    MAX_FIELD: tl.constexpr,
    INF_FIELD: tl.constexpr,
    NAN_FIELD: tl.constexpr,
):
    # float16 / float8-e4m3fn. Scale |x| by the inverse spacing of the target at x (a power of
    # two, exact), split into integer part and fraction (exact), round the integer part up with
    # probability equal to the fraction (stochastic, 24 random bits) or to nearest even. With
    # e = max(exponent of x, MIN_EXPONENT) and n the rounded integer, the encoding of the result is
    # ((e - MIN_EXPONENT) << MANTISSA) + n: this covers subnormals (e = MIN_EXPONENT, n below
    # 2**MANTISSA) and a carry into the next binade (n = 2**(MANTISSA + 1)) alike.
    x_bits = x.to(tl.uint32, bitcast=True)
    abs_bits = x_bits & 0x7FFFFFFF
    exponent = (abs_bits >> 23).to(tl.int32) - 127
    exponent = tl.minimum(tl.maximum(exponent, MIN_EXPONENT), 127)
    scaled = abs_bits.to(tl.float32, bitcast=True) * _exp2(MANTISSA - exponent)
    lower = tl.floor(scaled)
    fraction = scaled - lower
    if STOCHASTIC:
        uniform = (bits >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
        up = uniform < fraction
    else:
        odd = (lower.to(tl.int32) & 1) == 1
        up = (fraction > 0.5) | ((fraction == 0.5) & odd)
    field = ((exponent - MIN_EXPONENT) << MANTISSA) + lower.to(tl.int32) + up.to(tl.int32)
    # Overflow: saturate (no infinity in the format) or become infinity (IEEE).
    if SATURATE:
        field = tl.minimum(field, MAX_FIELD)
    else:
        field = tl.minimum(field, INF_FIELD)
    finite = _is_finite(x_bits)
    is_nan = abs_bits > 0x7F800000
    if SATURATE:
        special = tl.full(field.shape, NAN_FIELD, tl.int32)  # inf -> NaN: nothing to saturate to
    else:
        special = tl.where(is_nan, NAN_FIELD, INF_FIELD)
    field = tl.where(finite, field, special).to(tl.uint32)
    return field | ((x_bits >> 31) << (WIDTH - 1))


@triton.jit
def encode(x, bits, FORMAT: tl.constexpr, STOCHASTIC: tl.constexpr):
    """The bit pattern (uint32, in the low 16 or 8 bits) of float32 ``x`` rounded to ``FORMAT``
    (1 bfloat16, 2 float16, 3 float8_e4m3fn), with the overflow and non-finite rules of
    ``_rounding``. The rounding is done here with exact float32 and integer operations rather than
    by a conversion instruction, so that the interpreter (whose narrow conversions are
    approximate) and the GPU compute the same bits as the reference."""
    if FORMAT == 1:
        field = _encode_bfloat16(x, bits, STOCHASTIC)
    elif FORMAT == 2:
        field = _encode_small(x, bits, STOCHASTIC, 10, -14, 16, False, 0x7BFF, 0x7C00, 0x7E00)
    else:
        field = _encode_small(x, bits, STOCHASTIC, 3, -6, 8, True, 0x7E, 0x7F, 0x7F)
    return field


@triton.jit
def decode(field, FORMAT: tl.constexpr):
    """The float32 value of an encoding from :func:`encode` (exact)."""
    if FORMAT == 1:
        value = (field << 16).to(tl.float32, bitcast=True)
    else:
        if FORMAT == 2:
            MANTISSA: tl.constexpr = 10
            MIN_EXPONENT: tl.constexpr = -14
            WIDTH: tl.constexpr = 16
        else:
            # Triton DSL: FORMAT is a constexpr, so only one branch is compiled, and a constexpr
            # must be declared where it is assigned; mypy reads the two as a redefinition.
            MANTISSA: tl.constexpr = 3  # type: ignore[no-redef]
            MIN_EXPONENT: tl.constexpr = -6  # type: ignore[no-redef]
            WIDTH: tl.constexpr = 8  # type: ignore[no-redef]
        magnitude_field = field & ((1 << (WIDTH - 1)) - 1)
        biased = (magnitude_field >> MANTISSA).to(tl.int32)
        mantissa = (magnitude_field & ((1 << MANTISSA) - 1)).to(tl.int32)
        significand = tl.where(biased == 0, mantissa, mantissa + (1 << MANTISSA))
        magnitude = significand.to(tl.float32) * _exp2(
            tl.maximum(biased, 1) + MIN_EXPONENT - 1 - MANTISSA
        )
        if FORMAT == 2:  # float16: the top exponent means inf (mantissa 0) or NaN
            top = biased == 31
            magnitude = tl.where(top & (mantissa == 0), float("inf"), magnitude)
            magnitude = tl.where(top & (mantissa != 0), float("nan"), magnitude)
        else:  # float8_e4m3fn: only S.1111.111 is NaN
            magnitude = tl.where(magnitude_field == 0x7F, float("nan"), magnitude)
        sign = (field >> (WIDTH - 1)) & 1
        value = tl.where(sign == 1, -magnitude, magnitude)
    return value


@triton.jit
def store_rounded(ptr, offsets, mask, x, bits, FORMAT: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Stores float32 ``x`` rounded to the dtype of ``ptr`` (format ``FORMAT``) and returns the
    stored value as float32."""
    if FORMAT == 0:
        tl.store(ptr + offsets, x, mask=mask)
        value = x
    else:
        field = encode(x, bits, FORMAT, STOCHASTIC)
        if FORMAT == 3:
            tl.store(ptr.to(tl.pointer_type(tl.uint8)) + offsets, field.to(tl.uint8), mask=mask)
        else:
            tl.store(ptr.to(tl.pointer_type(tl.uint16)) + offsets, field.to(tl.uint16), mask=mask)
        value = decode(field, FORMAT)
    return value
