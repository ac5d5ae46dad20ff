"""The cast reference: round-to-nearest, stochastic rounding to each target, fp8 scales, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from triaccel_jax.kernels import _rounding
from triaccel_jax.kernels import cast as cast_kernel

TARGETS = [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn]
_RAW = {1: np.uint8, 2: np.uint16}


def _next_up(magnitude: np.ndarray) -> np.ndarray:
    """The next larger representable magnitude (non-negative finite values of a narrow dtype)."""
    raw = _RAW[magnitude.dtype.itemsize]
    return (magnitude.view(raw) + 1).astype(raw).view(magnitude.dtype)


def neighbours(x: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """The values of ``dtype`` just below and just above each float32 ``x`` (in float64)."""
    dtype = np.dtype(jnp.dtype(dtype))
    magnitude = np.abs(np.asarray(x, np.float32))
    nearest = magnitude.astype(dtype)
    down = nearest.astype(np.float64) > magnitude
    previous = (nearest.view(_RAW[dtype.itemsize]) - down).astype(_RAW[dtype.itemsize]).view(dtype)
    lower, upper = previous.astype(np.float64), _next_up(previous).astype(np.float64)
    sign = np.sign(np.asarray(x, np.float64))
    return np.minimum(sign * lower, sign * upper), np.maximum(sign * lower, sign * upper)


def _wide_values(n: int, dtype, seed: int = 0) -> jax.Array:
    """Finite float32 values spread over the target's whole range (subnormals included)."""
    info = ml_dtypes.finfo(jnp.dtype(dtype))
    k1, k2 = jax.random.split(jax.random.key(seed))
    exponents = jax.random.uniform(
        k1, (n,), minval=float(info.minexp) - float(info.nmant) - 1, maxval=float(info.maxexp) - 1.1
    )
    signs = jnp.where(jax.random.bernoulli(k2, 0.5, (n,)), 1.0, -1.0)
    return (signs * 2.0**exponents).astype(jnp.float32)


@pytest.mark.parametrize("dtype", TARGETS, ids=lambda d: jnp.dtype(d).name)
def test_stochastic_rounding_takes_only_the_two_neighbours(dtype):
    x = _wide_values(20_000, dtype)
    y = cast_kernel.cast_reference(x, dtype, rounding="stochastic", key=jax.random.key(1))
    assert y.dtype == dtype
    low, high = neighbours(np.asarray(x), dtype)
    y64 = np.asarray(y).astype(np.float64)
    assert np.all((y64 == low) | (y64 == high))
    # Both neighbours occur (not a disguised deterministic rounding).
    assert 0.2 < np.mean(y64 == high) < 0.8


# (target, value, rounding-up probability): normal values at several fractions, a negative one,
# and values in each target's subnormal range.
UNBIASED_CASES = [
    (jnp.bfloat16, 1.0 + 2.0**-9, 0.25),
    (jnp.bfloat16, -(3.0 + 0.7 * 2.0**-6), 0.7),
    (jnp.bfloat16, 2.5 * 2.0**-133, 0.5),
    (jnp.float16, 1.0 + 0.3 * 2.0**-10, 0.3),
    (jnp.float16, -1000.0 - 0.9 * 0.5, 0.9),
    (jnp.float16, 3.25 * 2.0**-24, 0.25),
    (jnp.float8_e4m3fn, 1.0 + 0.375 * 2.0**-3, 0.375),
    (jnp.float8_e4m3fn, -(192.0 + 0.125 * 16), 0.125),
    (jnp.float8_e4m3fn, 2.75 * 2.0**-9, 0.75),
]


@pytest.mark.parametrize(("dtype", "value", "p_up"), UNBIASED_CASES)
def test_stochastic_rounding_is_unbiased(dtype, value, p_up):
    n = 100_000
    value = np.float32(value)
    y = cast_kernel.cast_reference(
        jnp.full((n,), value), dtype, rounding="stochastic", key=jax.random.key(2)
    )
    y64 = np.asarray(y).astype(np.float64)
    errors = y64 - float(value)
    standard_error = errors.std() / np.sqrt(n)
    assert standard_error > 0
    assert abs(errors.mean()) < 4 * standard_error, (errors.mean(), standard_error)
    low, high = neighbours(np.full((1,), value), dtype)
    assert set(np.unique(y64)) == {low[0], high[0]}
    up = high[0] if value > 0 else low[0]  # "up" in magnitude
    assert np.isclose(np.mean(y64 == up), p_up, atol=0.01)


@pytest.mark.parametrize("dtype", TARGETS, ids=lambda d: jnp.dtype(d).name)
def test_stochastic_rounding_is_deterministic_for_a_key(dtype):
    x = jnp.linspace(-3.0, 3.0, 4097)
    cast = jax.jit(
        lambda x, key: cast_kernel.cast_reference(x, dtype, rounding="stochastic", key=key)
    )
    a = cast(x, jax.random.key(3))
    b = cast_kernel.cast_reference(x, dtype, rounding="stochastic", key=jax.random.key(3))
    c = cast(x, jax.random.key(4))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    # Legacy uint32 key data works too, and means the same key.
    d = cast_kernel.cast_reference(
        x, dtype, rounding="stochastic", key=jax.random.key_data(jax.random.key(3))
    )
    np.testing.assert_array_equal(np.asarray(a), np.asarray(d))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_nearest_is_xla_cast_for_formats_with_infinity(dtype):
    x = jnp.concatenate([_wide_values(10_000, dtype), jnp.array([1e30, -1e30, jnp.inf, jnp.nan])])
    y = cast_kernel.cast_reference(x, dtype)
    expected = x.astype(dtype)
    np.testing.assert_array_equal(
        np.asarray(y).view(np.uint16), np.asarray(expected).view(np.uint16)
    )


def test_nearest_float8_saturates_finite_values():
    x = jnp.concatenate([_wide_values(10_000, jnp.float8_e4m3fn), jnp.array([460.0, 500.0, -1e9])])
    y = np.asarray(cast_kernel.cast_reference(x, jnp.float8_e4m3fn)).astype(np.float32)
    expected = np.asarray(jnp.clip(x, -448.0, 448.0).astype(jnp.float8_e4m3fn)).astype(np.float32)
    np.testing.assert_array_equal(y, expected)
    np.testing.assert_array_equal(y[-3:], [448.0, 448.0, -448.0])


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_non_finite_values_and_overflow(rounding):
    key = jax.random.key(5)
    special = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0, -0.0, 1.0, -2.5], jnp.float32)
    for dtype in (jnp.bfloat16, jnp.float16):
        y = np.asarray(cast_kernel.cast_reference(special, dtype, rounding=rounding, key=key))
        np.testing.assert_array_equal(y.astype(np.float32), np.asarray(special))
        assert np.signbit(y[4])  # -0 keeps its sign
    y = np.asarray(
        cast_kernel.cast_reference(special, jnp.float8_e4m3fn, rounding=rounding, key=key)
    )
    assert np.all(np.isnan(y[:3].astype(np.float32)))  # no infinity in e4m3fn: inf -> NaN
    np.testing.assert_array_equal(y[3:].astype(np.float32), np.asarray(special[3:]))
    # Finite overflow: infinity for float16 (IEEE), saturation for float8_e4m3fn.
    big = jnp.array([1e6, -7e4, 3e38], jnp.float32)
    y16 = np.asarray(cast_kernel.cast_reference(big, jnp.float16, rounding=rounding, key=key))
    np.testing.assert_array_equal(y16, [np.inf, -np.inf, np.inf])
    y8 = np.asarray(cast_kernel.cast_reference(big, jnp.float8_e4m3fn, rounding=rounding, key=key))
    np.testing.assert_array_equal(y8.astype(np.float32), [448.0, -448.0, 448.0])


def test_float8_scale():
    x = jax.random.normal(jax.random.key(6), (1000,)) * 5000.0
    amax = jnp.max(jnp.abs(x))
    scale = cast_kernel.scale_from_amax(amax)
    np.testing.assert_allclose(scale, amax / 448.0, rtol=1e-6)
    y = cast_kernel.cast_reference(x, jnp.float8_e4m3fn, scale=scale)
    restored = np.asarray(y).astype(np.float32) * np.asarray(scale)
    # Nothing saturated: the largest magnitude maps to (about) 448, and the relative error of
    # each normal value is at most half an e4m3 ulp (2**-4).
    assert np.max(np.abs(np.asarray(y).astype(np.float32))) == 448.0
    normal = np.abs(np.asarray(x)) > 2.0**-6 * float(scale)
    relative = np.abs(restored - np.asarray(x))[normal] / np.abs(np.asarray(x))[normal]
    assert relative.max() <= 2.0**-4 + 1e-6
    # Without the scale almost everything would saturate.
    unscaled = np.asarray(cast_kernel.cast_reference(x, jnp.float8_e4m3fn)).astype(np.float32)
    assert np.mean(np.abs(unscaled) == 448.0) > 0.9
    # The scale is x -> x * (1 / scale), the same for stochastic rounding and any target.
    for dtype in TARGETS:
        for rounding in ("nearest", "stochastic"):
            key = jax.random.key(7)
            scaled = cast_kernel.cast_reference(x, dtype, rounding=rounding, key=key, scale=scale)
            manual = cast_kernel.cast_reference(x * (1 / scale), dtype, rounding=rounding, key=key)
            np.testing.assert_array_equal(np.asarray(scaled), np.asarray(manual))


def test_fp8_scale_of_an_array():
    x = jnp.array([1.0, -896.0, 2.0**-8])
    assert float(cast_kernel.fp8_scale(x)) == 2.0
    assert float(cast_kernel.fp8_scale(x.astype(jnp.bfloat16))) == 2.0
    assert float(cast_kernel.fp8_scale(jnp.zeros(3))) == 1.0
    assert float(cast_kernel.fp8_scale(jnp.zeros((0,)))) == 1.0
    assert float(cast_kernel.fp8_scale(jnp.array([1.0, jnp.nan]))) == 1.0
    y = cast_kernel.cast(x, jnp.float8_e4m3fn, scale=cast_kernel.fp8_scale(x))
    np.testing.assert_array_equal(np.asarray(y).astype(np.float32) * 2.0, x)


def test_scale_from_amax_edge_cases():
    assert float(cast_kernel.scale_from_amax(0.0)) == 1.0
    assert float(cast_kernel.scale_from_amax(jnp.inf)) == 1.0
    assert float(cast_kernel.scale_from_amax(jnp.nan)) == 1.0
    assert float(cast_kernel.scale_from_amax(448.0, margin=1)) == 2.0
    assert float(cast_kernel.scale_from_amax(65504.0, jnp.float16)) == 1.0
    assert jax.jit(cast_kernel.scale_from_amax)(896.0) == 2.0


def test_exact_targets_ignore_rounding():
    x = jax.random.normal(jax.random.key(8), (10,))
    np.testing.assert_array_equal(
        cast_kernel.cast_reference(x, jnp.float32, rounding="stochastic"), x
    )
    x16 = x.astype(jnp.float16)
    y = cast_kernel.cast_reference(x16, jnp.float32, rounding="stochastic")
    np.testing.assert_array_equal(y, x16.astype(jnp.float32))
    same = cast_kernel.cast_reference(x16, jnp.float16, rounding="stochastic")
    np.testing.assert_array_equal(same, x16)
    # float16 -> bfloat16 loses mantissa bits, so it is rounded (and needs a key).
    with pytest.raises(ValueError, match="key"):
        cast_kernel.cast_reference(x16, jnp.bfloat16, rounding="stochastic")


def test_philox_matches_the_known_answer_and_counts_by_index():
    # Random123's known-answer test for Philox-4x32-10: counter 0, key 0.
    zero = jnp.zeros((), jnp.uint32)
    out = _rounding.philox4x32(jnp.zeros(1, jnp.uint32), zero, zero)
    assert [int(o[0]) for o in out] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    words = jnp.array([11, 22], jnp.uint32)
    streams = _rounding.random_streams(words, (3, 4))
    flat = _rounding.philox4x32(jnp.arange(12, dtype=jnp.uint32), words[0], words[1])
    for s, f in zip(streams, flat, strict=True):
        np.testing.assert_array_equal(np.asarray(s).reshape(-1), np.asarray(f))


def test_errors():
    x = jnp.ones(3)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="rounding"):
        cast_kernel.cast_reference(x, jnp.bfloat16, rounding="up")
    with pytest.raises(ValueError, match="key"):
        cast_kernel.cast_reference(x, jnp.float8_e4m3fn, rounding="stochastic")
    with pytest.raises(ValueError, match=r"float8_e5m2.*supported"):
        cast_kernel.cast_reference(x, jnp.float8_e5m2)
    with pytest.raises(ValueError, match="floating"):
        cast_kernel.cast_reference(x, jnp.int8)
    with pytest.raises(ValueError, match="floating"):
        cast_kernel.cast_reference(jnp.ones(3, jnp.int32), jnp.bfloat16)
    with pytest.raises(ValueError, match="scalar"):
        cast_kernel.cast_reference(x, jnp.float8_e4m3fn, scale=jnp.ones(3))
    with pytest.raises(ValueError, match="rounding"):
        cast_kernel.cast(x, jnp.float16, rounding="down", key=key)


@pytest.mark.parametrize("dtype", TARGETS, ids=lambda d: jnp.dtype(d).name)
def test_round_stochastic_with_given_bits_is_the_casts_rounding(dtype):
    # With the very bits cast draws from a key (Philox stream 0), the two agree bit for bit: one
    # rounding, whoever draws the bits.
    x = _wide_values(4096, dtype, seed=3)
    key = jax.random.key(9)
    bits = _rounding.random_streams(_rounding.seed_words(key), x.shape)[0]
    expected = cast_kernel.cast_reference(x, dtype, rounding="stochastic", key=key)
    got = cast_kernel.round_stochastic(x, dtype, bits)
    np.testing.assert_array_equal(
        np.asarray(got).view(_RAW[got.dtype.itemsize]),
        np.asarray(expected).view(_RAW[expected.dtype.itemsize]),
    )


def test_round_stochastic_names_bad_bits_and_casts_exact_targets_plainly():
    x = jnp.linspace(-1, 1, 6).reshape(2, 3)
    bits = jnp.zeros((2, 3), jnp.uint32)
    np.testing.assert_array_equal(cast_kernel.round_stochastic(x, jnp.float32, bits), x)
    with pytest.raises(ValueError, match="uint32 shaped like"):
        cast_kernel.round_stochastic(x, jnp.bfloat16, bits.astype(jnp.int32))
    with pytest.raises(ValueError, match="uint32 shaped like"):
        cast_kernel.round_stochastic(x, jnp.bfloat16, bits.reshape(3, 2))
    with pytest.raises(ValueError, match="supported"):
        cast_kernel.round_stochastic(x, jnp.float8_e5m2, bits)
