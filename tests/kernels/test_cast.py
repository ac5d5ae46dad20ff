"""The cast kernel's reference: round-to-nearest and unbiased stochastic rounding to bfloat16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triaccel_jax.kernels import cast


def _neighbours(x):
    """The bfloat16 values just below and above each float32 value (truncate, then step up)."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    low = (bits & 0xFFFF0000).view(np.float32)
    high = ((bits & 0xFFFF0000) + 0x10000).view(np.float32)
    return np.minimum(low, high), np.maximum(low, high)


def test_stochastic_rounding_takes_only_the_two_neighbours():
    x = jax.random.normal(jax.random.key(0), (10_000,)) * 100
    y = np.asarray(
        cast.cast_reference(x, jnp.bfloat16, rounding="stochastic", key=jax.random.key(1))
    )
    low, high = _neighbours(x)
    y32 = y.astype(np.float32)
    assert np.all((y32 == low) | (y32 == high))


def test_stochastic_rounding_is_unbiased():
    value = np.float32(1.0 + 2.0**-9)  # a quarter of the way from 1.0 to 1.0 + 2**-7
    n = 100_000
    y = cast.cast_reference(
        jnp.full((n,), value), jnp.bfloat16, rounding="stochastic", key=jax.random.key(2)
    )
    errors = np.asarray(y, np.float64) - float(value)
    standard_error = errors.std() / np.sqrt(n)
    assert abs(errors.mean()) < 4 * standard_error
    assert np.isclose(np.mean(np.asarray(y, np.float32) > 1.0), 0.25, atol=0.01)


def test_stochastic_rounding_is_deterministic_for_a_key_and_varies_across_keys():
    x = jnp.linspace(-3.0, 3.0, 4097)
    a = cast.cast_reference(x, jnp.bfloat16, rounding="stochastic", key=jax.random.key(3))
    b = cast.cast_reference(x, jnp.bfloat16, rounding="stochastic", key=jax.random.key(3))
    c = cast.cast_reference(x, jnp.bfloat16, rounding="stochastic", key=jax.random.key(4))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_non_finite_values_and_exact_values_are_kept():
    x = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 1.0, -2.5, 0.0])
    y = cast.cast_reference(x, jnp.bfloat16, rounding="stochastic", key=jax.random.key(5))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x))


def test_nearest_matches_xla_cast():
    x = jax.random.normal(jax.random.key(6), (1000,))
    np.testing.assert_array_equal(cast.cast_reference(x, jnp.bfloat16), x.astype(jnp.bfloat16))


def test_errors():
    x = jnp.ones(3)
    with pytest.raises(ValueError, match="rounding"):
        cast.cast_reference(x, jnp.bfloat16, rounding="up")
    with pytest.raises(ValueError, match="key"):
        cast.cast_reference(x, jnp.bfloat16, rounding="stochastic")
