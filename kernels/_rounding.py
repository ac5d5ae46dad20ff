"""Rounding float32 to narrower floats: the target formats, counter-based bits, the two roundings.

This is the numerical core that the references (:mod:`triaccel_jax.kernels.cast`,
:mod:`triaccel_jax.kernels.fused_update`, :mod:`triaccel_jax.kernels.quantize`) share, written so
that the Triton kernels can do the same integer and float operations element by element and agree
with it bit for bit. Two counter-based generators, each counted by the element's flat index:

* Philox-4x32-10 (Salmon et al., 2011, "Parallel Random Numbers: As Easy as 1, 2, 3"), keyed by
  two 32-bit words drawn from a JAX key (:func:`seed_words`), for the cast and fused-update
  kernels. It is the generator behind ``triton.language.randint4x``, so a kernel that calls
  ``randint4x(seed, offsets)`` draws exactly the bits that :func:`philox4x32` returns here. Ten
  rounds of 32x32->64-bit products, emulated here with 16-bit halves, and four words per element
  where one is used: on a CPU it costs more than the rest of an optimizer's update;
* a counter hash (:func:`counter_bits`), for the block-wise quantizer that stores optimizer state
  at every step: two rounds of the ``lowbias32`` integer mix (Wellons, 2018, "Prospecting for
  Hash Functions": two multiplies and three xor-shifts, about as well mixed as MurmurHash3's
  finalizer) over the index xor-ed and added with two key words, ten integer operations an
  element. Its keys are the key's own data hashed into two words (:func:`key_words`), and
  :func:`fold_words` derives a key from a key and an integer (a step, a leaf) in a few scalar
  operations where ``jax.random.fold_in`` runs Threefry, whose 20 rounds, once per state leaf,
  add seconds to the compile of a model of a few hundred leaves. Stochastic rounding needs bits
  that are uniform and independent of the value being rounded, not a cryptographic or
  statistically perfect stream: the rounding stays unbiased for any bits that are uniform.

Stochastic rounding to bfloat16 adds 16 random bits below the kept mantissa and truncates
(exact and unbiased, subnormals included, since bfloat16 shares float32's exponent range);
stochastic rounding to float16 and float8-e4m3fn scales ``|x|`` by the inverse of the target's
spacing at ``x`` (a power of two, so exactly), and rounds the integer part up with probability
equal to the fractional part, using 24 random bits. This is exactly unbiased wherever the
fraction has at most 24 bits, which holds for every float32 input at least half the target's
smallest subnormal; below that the rounding-up probability is too high by less than 2**-24.

Non-finite inputs and overflow (the same for both roundings and in the kernels):

* NaN stays NaN;
* bfloat16 and float16 have infinities: ``inf`` stays ``inf``, and finite values that round past
  the largest finite value become ``inf`` (IEEE overflow, what ``astype`` does), so the overflow
  stays visible to loss scaling;
* float8-e4m3fn has no infinity: ``inf`` becomes NaN (as with ``astype``), while finite values
  beyond 448 *saturate* to +-448, as Transformer Engine's and the hardware's saturating fp8
  conversions do (plain ``astype`` gives NaN above 464). With a per-tensor scale from
  :func:`triaccel_jax.kernels.cast.fp8_scale` saturation only happens when the values grew since
  the scale was taken.

One platform difference: XLA:CPU flushes float32 subnormals to zero in arithmetic, so there the
product ``x * (1 / scale)`` is 0 when ``x`` or the product is a float32 subnormal (below 2**-126);
GPUs and the Triton kernels keep them. Only bfloat16 targets can tell (the other formats round
such values to zero anyway), and the bfloat16 rounding itself is integer arithmetic.
"""

from __future__ import annotations

import functools
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ROUNDING_MODES = ("nearest", "stochastic")


class Format(NamedTuple):
    """A narrow floating-point target format.

    Attributes:
      dtype: the JAX dtype.
      mantissa_bits: explicit mantissa (fraction) bits.
      min_exponent: exponent of the smallest normal value (below it values are subnormal).
      max_finite: the largest finite value.
      saturate: finite values beyond ``max_finite`` clamp to it (no infinity in the format).
    """

    dtype: jnp.dtype
    mantissa_bits: int
    min_exponent: int
    max_finite: float
    saturate: bool


FORMATS: dict[str, Format] = {
    "bfloat16": Format(jnp.dtype(jnp.bfloat16), 7, -126, float(jnp.finfo(jnp.bfloat16).max), False),
    "float16": Format(jnp.dtype(jnp.float16), 10, -14, 65504.0, False),
    "float8_e4m3fn": Format(jnp.dtype(jnp.float8_e4m3fn), 3, -6, 448.0, True),
}

# Philox-4x32 constants (Salmon et al., 2011, table 2), as in triton.language.random.
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUNDS = 10
# lowbias32's multipliers (Wellons, 2018), and the golden-ratio word that keeps a key of zeros
# (jax.random.key(0)'s data) off the mix's fixed point at zero.
MIX_A = 0x7FEB352D
MIX_B = 0x846CA68B
GOLDEN = 0x9E3779B9

_U32 = jnp.uint32


def check_rounding(rounding: str) -> None:
    """Raises a ``ValueError`` unless ``rounding`` is one of :data:`ROUNDING_MODES`."""
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"`rounding` must be one of {ROUNDING_MODES}, got {rounding!r}")


def is_exact(source: jax.typing.DTypeLike, target: jax.typing.DTypeLike) -> bool:
    """True when every value of ``source`` is a value of ``target`` (so a cast cannot round)."""
    s, t = jnp.finfo(source), jnp.finfo(target)
    return t.nmant >= s.nmant and t.maxexp >= s.maxexp and t.minexp <= s.minexp


def target_format(dtype: jnp.dtype) -> Format:
    """The :class:`Format` of a supported narrow target, else a ``ValueError`` naming them."""
    dtype = jnp.dtype(dtype)
    if dtype.name not in FORMATS:
        raise ValueError(
            f"cannot round to {dtype.name}: supported narrow targets are {', '.join(FORMATS)} "
            "(float32 and wider targets are cast exactly)"
        )
    return FORMATS[dtype.name]


def seed_words(key: jax.Array) -> jax.Array:
    """The two uint32 Philox key words ``[lo, hi]`` that a JAX PRNG key stands for.

    Drawn with ``jax.random.bits``, so any key implementation (typed keys or legacy uint32 key
    data) works and the kernels receive the same two words as the reference.
    """
    return jax.random.bits(key, (2,), _U32)


def mix32(x: jax.Array) -> jax.Array:
    """The ``lowbias32`` integer mix of uint32 ``x``: a bijection of the 32-bit words.

    Example:
      >>> import jax.numpy as jnp
      >>> hex(int(mix32(jnp.uint32(1))))
      '0x688990c0'
    """
    x = x.astype(_U32)
    x = x ^ (x >> _U32(16))
    x = x * _U32(MIX_A)
    x = x ^ (x >> _U32(15))
    x = x * _U32(MIX_B)
    return x ^ (x >> _U32(16))


def fold_words(words: jax.Array, data: jax.Array | int) -> jax.Array:
    """Two uint32 key words with the 32-bit integer ``data`` hashed in: distinct ``data`` give
    distinct words (each word is a bijection of ``data`` for given ``words``).

    Args:
      words: uint32 ``[w0, w1]``.
      data: integers (a step count, leaves' indices), traced or not; their low 32 bits.

    Returns:
      uint32 words shaped ``data.shape + (2,)``: one pair per integer.
    """
    h = mix32(jnp.asarray(data).astype(_U32) + _U32(GOLDEN))
    return jnp.stack([mix32(words[0] ^ h), mix32(words[1] + h)], axis=-1)


def key_words(key: jax.Array) -> jax.Array:
    """The two uint32 words that key :func:`counter_bits`, from the key's data alone.

    Two words of key data (Threefry's, or :func:`fold_words`') are taken as they are, xor-ed
    with two constants so that the data of ``jax.random.key(0)``, all zeros, does not give the
    mix its fixed point at zero; any other number of words (4 for ``rbg``) is folded into two.

    Args:
      key: a typed PRNG key, or legacy uint32 key data.

    Returns:
      uint32 ``[w0, w1]`` (no generator runs).
    """
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    if key.dtype != _U32:
        raise ValueError(f"a PRNG key or uint32 key data is needed, got {key.dtype}")
    offset = jnp.array([GOLDEN, MIX_A], _U32)
    if key.shape == (2,):
        return key ^ offset
    words = offset
    for word in key.reshape(-1):
        words = fold_words(words, word)
    return words


def counter_bits(words: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 random bits shaped ``shape``, the counter hash of each element's flat index.

    Element ``i`` (flat, row-major) gets ``mix32(mix32(i ^ w0) + w1)``: a keyed bijection of the
    index (every element of one array gets different bits) and, for a new key, new bits. The
    quantize kernel computes the same with the element's offset.

    Args:
      words: the uint32 ``[w0, w1]`` from :func:`key_words` (or :func:`fold_words`).
      shape: the shape of the array being rounded.

    Returns:
      uint32 bits of ``shape``.
    """
    check_size(shape)
    index = lax.iota(_U32, math.prod(shape)).reshape(shape)
    return mix32(mix32(index ^ words[0]) + words[1])


def counter_bits_like(words: jax.Array, shape: tuple[int, ...], sharding: Any = None) -> jax.Array:
    """:func:`counter_bits` (the same bits) built from one iota per axis, laid out by ``sharding``.

    The flat index is summed from the axes' iotas times their strides instead of reshaped from
    one flat iota: each device computes the indices of its own shard without a reshape that
    would cross shards, and under a mesh with Explicit axes the iotas are created with the
    array's sharding (``sharding``, that of the array to round), so they combine with it.

    Args:
      words: the uint32 ``[w0, w1]`` from :func:`key_words`.
      shape: the shape of the array being rounded.
      sharding: the ``NamedSharding`` of that array's type under Explicit axes, or None.

    Returns:
      uint32 bits of ``shape``, equal to ``counter_bits(words, shape)``.
    """
    check_size(shape)
    index = jnp.zeros(shape, _U32, out_sharding=sharding)
    stride = 1
    for axis in reversed(range(len(shape))):
        iota = lax.broadcasted_iota(_U32, shape, axis, out_sharding=sharding)
        index = index + iota * _U32(stride)
        stride *= shape[axis]
    return mix32(mix32(index ^ words[0]) + words[1])


def _mulhi(a: jax.Array, b: int) -> jax.Array:
    """High 32 bits of the 64-bit product ``a * b`` with uint32 arithmetic only.

    JAX has no 64-bit integers unless x64 is on, so the product is assembled from 16-bit halves
    (schoolbook multiplication); every partial product fits in 32 bits.
    """
    b_lo, b_hi = _U32(b & 0xFFFF), _U32(b >> 16)
    a_lo, a_hi = a & _U32(0xFFFF), a >> _U32(16)
    lo_lo, hi_lo, lo_hi, hi_hi = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi, a_hi * b_hi
    carry = (lo_lo >> _U32(16)) + (hi_lo & _U32(0xFFFF)) + (lo_hi & _U32(0xFFFF))
    return hi_hi + (hi_lo >> _U32(16)) + (lo_hi >> _U32(16)) + (carry >> _U32(16))


@jax.jit
def philox4x32(
    counter: jax.Array, key_lo: jax.Array, key_hi: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Philox-4x32-10 of the counter ``(counter, 0, 0, 0)`` under the key ``(key_lo, key_hi)``.

    Args:
      counter: uint32 counters (the flat element indices).
      key_lo: uint32 scalar, the first key word.
      key_hi: uint32 scalar, the second key word.

    Returns:
      Four uint32 arrays shaped like ``counter``: four independent random streams. They equal
      ``triton.language.randint4x(seed, counter)`` with ``seed = key_hi << 32 | key_lo``.
    """
    c0 = counter.astype(_U32)
    c1 = c2 = c3 = jnp.zeros_like(c0)
    k0, k1 = key_lo.astype(_U32), key_hi.astype(_U32)
    for _ in range(PHILOX_ROUNDS):
        c0, c1, c2, c3 = (
            _mulhi(c2, PHILOX_ROUND_B) ^ c1 ^ k0,
            c2 * _U32(PHILOX_ROUND_B),
            _mulhi(c0, PHILOX_ROUND_A) ^ c3 ^ k1,
            c0 * _U32(PHILOX_ROUND_A),
        )
        k0 = k0 + _U32(PHILOX_KEY_A)
        k1 = k1 + _U32(PHILOX_KEY_B)
    return c0, c1, c2, c3


@functools.partial(jax.jit, static_argnums=1)
def random_streams(
    words: jax.Array, shape: tuple[int, ...]
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Four streams of uint32 random bits shaped ``shape``, counted by the flat element index.

    Args:
      words: the uint32 ``[lo, hi]`` key words from :func:`seed_words`.
      shape: the shape of the array being rounded.

    Returns:
      Four uint32 arrays of ``shape``; element ``i`` (flat, row-major) of stream ``j`` is output
      ``j`` of Philox at counter ``i``, as the kernels draw it for the element at offset ``i``.
    """
    check_size(shape)
    counter = lax.iota(_U32, math.prod(shape)).reshape(shape)
    return philox4x32(counter, words[0], words[1])


def check_size(shape: tuple[int, ...]) -> None:
    """Raises a ``ValueError`` for arrays of 2**31 elements or more (the kernels' int32 offsets)."""
    if math.prod(shape) >= 2**31:
        raise ValueError(f"arrays of 2**31 or more elements are not supported, got shape {shape}")


def _exp2(exponent: jax.Array) -> jax.Array:
    """``2.0 ** exponent`` as float32 built from its bits; ``exponent`` must be in [-126, 127]."""
    return lax.bitcast_convert_type(((exponent + 127) << 23).astype(_U32), jnp.float32)


@functools.partial(jax.jit, static_argnums=1)
def round_nearest(x: jax.Array, fmt: Format) -> jax.Array:
    """Rounds float32 ``x`` to nearest (ties to even) in ``fmt``, with the module's overflow rules."""
    if fmt.saturate:
        x = jnp.where(jnp.isinf(x), jnp.nan, jnp.clip(x, -fmt.max_finite, fmt.max_finite))
    return x.astype(fmt.dtype)


@functools.partial(jax.jit, static_argnums=1)
def round_stochastic(x: jax.Array, fmt: Format, bits: jax.Array) -> jax.Array:
    """Rounds float32 ``x`` stochastically to ``fmt`` with the uint32 random ``bits`` (one each).

    Returns one of the two values of ``fmt`` around ``x``, the upper one with probability equal
    to the distance from the lower one in units of their gap (see the module docstring).
    """
    x = x.astype(jnp.float32)
    if fmt.dtype == jnp.bfloat16:
        # Adding random bits below the kept 16 and truncating rounds the magnitude up with
        # probability equal to the dropped fraction; floats are sign-magnitude, so this is
        # unbiased for negative values too, and a carry out of the largest finite bfloat16
        # reaches the bit pattern of infinity (IEEE overflow).
        noise = bits >> _U32(16)
        rounded_bits = (lax.bitcast_convert_type(x, _U32) + noise) & _U32(0xFFFF0000)
        rounded = lax.bitcast_convert_type(rounded_bits, jnp.float32)
        # The carry of a NaN payload could spill into the sign bit: keep non-finite values.
        return jnp.where(jnp.isfinite(x), rounded, x).astype(fmt.dtype)

    magnitude = jnp.abs(x)
    exponent = (lax.bitcast_convert_type(magnitude, _U32) >> _U32(23)).astype(jnp.int32) - 127
    # The target's spacing at x is 2**(e - mantissa_bits), with e never below the normal range.
    exponent = jnp.clip(exponent, fmt.min_exponent, 127)
    scaled = magnitude * _exp2(fmt.mantissa_bits - exponent)  # exact: a power-of-two scaling
    lower = jnp.floor(scaled)
    fraction = scaled - lower  # exact
    uniform = (bits >> _U32(8)).astype(jnp.float32) * np.float32(2.0**-24)  # exact, in [0, 1)
    rounded = (lower + (uniform < fraction).astype(jnp.float32)) * _exp2(
        exponent - fmt.mantissa_bits
    )  # exact: an integer up to 2**(mantissa_bits + 1) times a power of two
    if fmt.saturate:
        rounded = jnp.minimum(rounded, np.float32(fmt.max_finite))
    rounded = jnp.copysign(rounded, x)
    # inf and NaN go through round_nearest's rules: inf stays inf (float16) or becomes NaN (fp8).
    return jnp.where(jnp.isfinite(x), rounded, round_nearest(x, fmt).astype(jnp.float32)).astype(
        fmt.dtype
    )
