"""The block-wise quantizer's reference: its error bounds, unbiased rounding, layout and errors.

These run in the main environment (no triton): the reference is the tested truth that the Triton
kernels are compared with in ``test_kernel_quantize_interpreter.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from triaccel_jax.kernels import _dispatch
from triaccel_jax.kernels import _rounding
from triaccel_jax.kernels import quantize as quantize_lib


def _round_trip(x, block_size, mapping, rounding="nearest", key=None):
    quantized = quantize_lib.quantize_blocks_reference(
        x, block_size=block_size, mapping=mapping, rounding=rounding, key=key
    )
    back = quantize_lib.dequantize_blocks_reference(
        quantized.codes, quantized.scales, block_size=block_size, mapping=mapping
    )
    return quantized, np.asarray(back, np.float64)


def _per_element_scale(scales, size, block_size):
    return np.repeat(np.asarray(scales, np.float64), block_size)[:size]


def _linear_step(scales, size, block_size):
    return _per_element_scale(scales, size, block_size) / 127


def _sqrt_gap(x, absmax):
    """The gap between the two sqrt-map levels around each value (in value)."""
    ratio = np.clip(x / np.where(absmax > 0, absmax, 1), 0, 1)
    lower = np.clip(np.floor(np.sqrt(ratio) * 256 - 1), 0, 254)
    return ((lower + 2) ** 2 - (lower + 1) ** 2) / 65536 * absmax


# -- layout --------------------------------------------------------------------------------------


def test_codes_keep_the_shape_and_scales_are_one_per_block():
    x = jnp.ones((3, 5, 7))  # 105 elements: 4 blocks of 32, the last one of 9
    linear = quantize_lib.quantize_blocks_reference(x, block_size=32)
    chex_shape = (linear.codes.shape, linear.codes.dtype, linear.scales.shape, linear.scales.dtype)
    assert chex_shape == ((3, 5, 7), jnp.int8, (4,), jnp.float32)
    nonneg = quantize_lib.quantize_blocks_reference(x, block_size=32, mapping="sqrt")
    assert nonneg.codes.dtype == jnp.uint8 and nonneg.scales.shape == (4,)


def test_blocks_are_consecutive_elements_of_the_flattened_array():
    # One large value per block sets that block's scale only.
    x = jnp.zeros((4, 8)).at[0, 0].set(100.0).at[2, 7].set(-3.0)
    quantized = quantize_lib.quantize_blocks_reference(x, block_size=8)
    np.testing.assert_array_equal(quantized.scales, [100.0, 0.0, 3.0, 0.0])
    assert int(quantized.codes[0, 0]) == 127 and int(quantized.codes[2, 7]) == -127


def test_exact_values_round_trip_exactly():
    x = jnp.array([127.0, -64.0, 0.0, 1.0, -127.0])
    _, back = _round_trip(x, 8, "linear")
    np.testing.assert_array_equal(back, np.asarray(x))
    levels = jnp.array([65536.0, 1.0, 4.0, 9.0, 256.0 * 256.0])  # ((c + 1) / 256)**2 * absmax
    _, back = _round_trip(levels, 8, "sqrt")
    np.testing.assert_array_equal(back, np.asarray(levels))


# -- error bounds --------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    shape=st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple),
    block_size=st.integers(1, 70),
    log_scale=st.floats(-30, 30),
    zeros=st.floats(0, 1),
    seed=st.integers(0, 2**31 - 1),
)
def test_linear_round_trip_is_within_half_a_step(shape, block_size, log_scale, zeros, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp(rng.standard_normal(shape) * 3) * 10.0**log_scale
    x = np.where(rng.random(shape) < zeros, 0.0, x).astype(np.float32)
    quantized, back = _round_trip(jnp.asarray(x), block_size, "linear")
    step = _linear_step(quantized.scales, x.size, block_size).reshape(shape)
    # Half a step, plus the float32 roundings of x * (127 / absmax) (relative 2**-23 of 127).
    assert np.all(np.abs(back - x) <= step * (0.5 + 1e-4)), np.max(np.abs(back - x) / step)
    np.testing.assert_array_equal(back[x == 0], 0.0)  # zero stays zero
    assert np.all(np.abs(np.asarray(quantized.codes, np.int32)) <= 127)
    # Stochastic rounding lands on one of the two neighbouring levels: within one step.
    _, back = _round_trip(jnp.asarray(x), block_size, "linear", "stochastic", jax.random.key(seed))
    assert np.all(np.abs(back - x) <= step * (1 + 1e-4))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    shape=st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple),
    block_size=st.integers(1, 70),
    log_scale=st.floats(-30, 30),
    seed=st.integers(0, 2**31 - 1),
)
def test_sqrt_round_trip_is_within_half_a_level_gap(shape, block_size, log_scale, seed):
    rng = np.random.default_rng(seed)
    # Squares of gradients: non-negative, many orders of magnitude within a block.
    x = ((rng.standard_normal(shape) * np.exp(rng.standard_normal(shape) * 2)) ** 2).astype(
        np.float64
    )
    x = (x * 10.0**log_scale).astype(np.float32)
    quantized, back = _round_trip(jnp.asarray(x), block_size, "sqrt")
    absmax = _per_element_scale(quantized.scales, x.size, block_size).reshape(shape)
    x64 = x.astype(np.float64)
    lowest = absmax / 65536
    kept = absmax >= float(quantize_lib.TINY)
    above = kept & (x64 >= lowest)
    gap = _sqrt_gap(x64, absmax)
    error = np.abs(back - x64)
    assert np.all(error[above] <= gap[above] * (0.5 + 1e-4) + absmax[above] * 2e-7)
    # Zero is not a level: anything below the lowest level is stored as it, never as 0.
    np.testing.assert_allclose(back[kept & ~above], lowest[kept & ~above], rtol=1e-6)
    assert np.all(back[kept] > 0)
    # Relative resolution near the block's maximum: levels 2/256 apart in sqrt, < 0.8% in value.
    top = kept & (x64 >= absmax / 4)
    assert np.all(error[top] <= x64[top] * 0.008)


def test_sqrt_map_keeps_small_values_a_linear_map_rounds_to_zero():
    x = jnp.array([1.0, 1e-3, 1e-4], jnp.float32)  # a second moment's spread within a block
    _, linear = _round_trip(x, 3, "linear")
    _, nonneg = _round_trip(x, 3, "sqrt")
    assert linear[2] == 0.0
    # 1e-4 lies between the levels 2**2 / 2**16 and 3**2 / 2**16: within 40% of its value.
    np.testing.assert_allclose(nonneg[1:], [1e-3, 1e-4], rtol=0.4)
    assert np.all(nonneg > 0)


def test_negative_values_take_the_lowest_sqrt_level():
    quantized, back = _round_trip(jnp.array([-1.0, 4.0]), 2, "sqrt")
    assert int(quantized.codes[0]) == 0
    np.testing.assert_allclose(back[0], 4.0 / 65536)


# -- stochastic rounding is unbiased ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("mapping", "values", "absmax"),
    [
        ("linear", [0.3, -0.017, 0.9996, -0.5], 1.0),
        ("sqrt", [0.3, 0.017, 2e-4, 0.9996], 1.0),
    ],
)
def test_stochastic_rounding_is_unbiased_over_keys(mapping, values, absmax):
    # Each row is one block: the given values beside its maximum, quantized with a fresh key.
    # The mean over keys of the dequantized value converges to the value (tolerance: 5 standard
    # errors of the mean, from the two-level rounding's own variance).
    n_keys = 4000
    block = jnp.array([absmax, *values], jnp.float32)
    keys = jax.random.split(jax.random.key(1234), n_keys)

    def one(key):
        quantized = quantize_lib.quantize_blocks_reference(
            block, block_size=block.size, mapping=mapping, rounding="stochastic", key=key
        )
        return quantize_lib.dequantize_blocks_reference(
            quantized.codes, quantized.scales, block_size=block.size, mapping=mapping
        )

    samples = np.asarray(jax.jit(jax.vmap(one))(keys), np.float64)[:, 1:]
    mean, std = samples.mean(axis=0), samples.std(axis=0)
    target = np.asarray(values, np.float32).astype(np.float64)
    assert np.all(std > 0)  # every value lies between two levels, so both are drawn
    assert np.all(np.abs(mean - target) <= 5 * std / np.sqrt(n_keys) + 1e-9), (mean, target)


def test_stochastic_rounding_tracks_an_ema_that_nearest_rounding_stalls():
    # An EMA whose increment, (1 - decay) * 0.5, is below half a level (0.5 / 127): nearest
    # rounding never moves it off zero; stochastic rounding follows the float32 EMA (Gupta et
    # al., 2015). Element 0 pins the block's maximum at 1; element 1 is Adam's first moment.
    # One run ends within about 0.02 of the EMA (the rounding noise the EMA accumulates over its
    # 1 / (1 - decay) horizon), so the mean of 32 runs with independent keys is compared.
    decay, target, steps, runs = 0.999, 0.5, 2000, 32

    def run(rounding, seed):
        def step(value, key):
            value = value.at[1].set(decay * value[1] + (1 - decay) * target)
            quantized = quantize_lib.quantize_blocks_reference(
                value, block_size=2, rounding=rounding, key=key
            )
            return quantize_lib.dequantize_blocks_reference(
                quantized.codes, quantized.scales, block_size=2
            ), None

        keys = jax.random.split(jax.random.key(seed), steps)
        return jax.lax.scan(step, jnp.array([1.0, 0.0]), keys)[0][1]

    exact = target * (1 - decay**steps)
    assert float(jax.jit(run, static_argnums=0)("nearest", 0)) == 0.0
    finals = np.asarray(jax.jit(jax.vmap(lambda seed: run("stochastic", seed)))(jnp.arange(runs)))
    assert abs(finals.mean() - exact) < 0.05 * exact, (finals.mean(), exact)
    assert finals.std() < 0.1 * exact  # each run tracks it too, within its rounding noise


# -- the counter hash ------------------------------------------------------------------------------


def _lowbias32(x):
    # Wellons' lowbias32 on Python ints: the specification the JAX and Triton versions follow.
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_counter_bits_are_two_rounds_of_lowbias32_over_the_flat_index():
    words = jnp.array([0x12345678, 0x9ABCDEF0], jnp.uint32)
    got = np.asarray(_rounding.counter_bits(words, (2, 3))).ravel().tolist()
    expected = [
        _lowbias32((_lowbias32(i ^ 0x12345678) + 0x9ABCDEF0) & 0xFFFFFFFF) for i in range(6)
    ]
    assert got == expected


def test_counter_bits_are_distinct_and_uniform():
    n = 2**16
    bits = np.asarray(_rounding.counter_bits(quantize_lib.fold_in(jax.random.key(0), 7), (n,)))
    assert np.unique(bits).size == n  # a bijection of the index
    # The top 8 bits, 256 cells of 256 expected each: a chi-square with 255 degrees of freedom
    # is below 350 with probability 1 - 1e-4.
    counts = np.bincount(bits >> 24, minlength=256)
    assert np.sum((counts - 256.0) ** 2 / 256.0) < 350
    uniform = (bits >> 8) / 2.0**24
    assert abs(uniform.mean() - 0.5) < 4 * np.sqrt(1 / 12 / n)
    # Neighbouring elements, and one element at two steps, are uncorrelated (|r| < 4.5 / sqrt(n)).
    assert abs(np.corrcoef(uniform[:-1], uniform[1:])[0, 1]) < 4.5 / np.sqrt(n)
    other = np.asarray(_rounding.counter_bits(quantize_lib.fold_in(jax.random.key(0), 8), (n,)))
    assert abs(np.corrcoef(uniform, (other >> 8) / 2.0**24)[0, 1]) < 4.5 / np.sqrt(n)


def test_random_bits_are_the_bits_quantize_blocks_rounds_with():
    # Every element but the first lies half a level above 0: it rounds up exactly when its
    # uniform, the top 24 of its bits, is below one half.
    n, key = 512, jax.random.key(4)
    x = jnp.full((n,), 0.5 / 127, jnp.float32).at[0].set(1.0)
    codes = np.asarray(
        quantize_lib.quantize_blocks(x, block_size=n, rounding="stochastic", key=key).codes
    )
    uniform = (np.asarray(quantize_lib.random_bits(key, (n,))) >> 8) / 2.0**24
    np.testing.assert_array_equal(codes[1:], (uniform[1:] < 0.5).astype(np.int8))


def test_fold_in_gives_every_step_and_leaf_its_own_key():
    key = jax.random.key(3)
    steps = jax.vmap(lambda t: quantize_lib.fold_in(key, t))(jnp.arange(100))
    keys = jax.vmap(lambda k: jax.vmap(lambda leaf: quantize_lib.fold_in(k, leaf))(jnp.arange(50)))(
        steps
    )
    pairs = {tuple(w) for w in np.asarray(keys).reshape(-1, 2).tolist()}
    assert len(pairs) == 100 * 50
    np.testing.assert_array_equal(quantize_lib.fold_in(key, 5), quantize_lib.fold_in(key, 5))
    assert quantize_lib.fold_in(jax.random.key(0), 0).tolist() != [0, 0]  # no fixed point at zero


def test_keys_are_read_from_their_data_whatever_the_implementation():
    typed = jax.random.key(11)
    np.testing.assert_array_equal(
        _rounding.key_words(typed), _rounding.key_words(jax.random.key_data(typed))
    )
    rbg = jax.random.key(11, impl="rbg")  # 4 words of key data, folded into 2
    x = jnp.linspace(-1, 1, 300)
    codes = quantize_lib.quantize_blocks(x, rounding="stochastic", key=rbg).codes
    again = quantize_lib.quantize_blocks(
        x, rounding="stochastic", key=jax.random.key_data(rbg)
    ).codes
    np.testing.assert_array_equal(codes, again)
    with pytest.raises(ValueError, match="key data"):
        quantize_lib.quantize_blocks(x, rounding="stochastic", key=jnp.zeros(2, jnp.int32))


# -- special values ------------------------------------------------------------------------------


@pytest.mark.parametrize("mapping", quantize_lib.MAPS)
def test_a_block_with_nan_or_inf_dequantizes_to_nan_and_others_are_untouched(mapping):
    x = jnp.array([1.0, jnp.nan, 2.0, 3.0, jnp.inf, 0.5, 4.0, 1.0])
    quantized, back = _round_trip(x, 2, mapping)
    assert np.isnan(np.asarray(quantized.scales)).tolist() == [True, False, True, False]
    assert np.isnan(back).tolist() == [True, True, False, False, True, True, False, False]
    np.testing.assert_allclose(back[[2, 3, 6, 7]], [2.0, 3.0, 4.0, 1.0], rtol=0.01)


@pytest.mark.parametrize("mapping", quantize_lib.MAPS)
def test_zero_and_tiny_blocks_store_code_zero(mapping):
    x = jnp.array([0.0, 0.0, 1e-35, -1e-33], jnp.float32)
    quantized, back = _round_trip(jnp.abs(x) if mapping == "sqrt" else x, 2, mapping)
    np.testing.assert_array_equal(np.asarray(quantized.codes, np.int32), 0)
    assert np.all(np.isfinite(back)) and np.all(np.abs(back) <= 1e-33)


def test_huge_values_stay_finite():
    x = jnp.array([3e38, -3e38, 1.0, 1e38], jnp.float32)
    _, back = _round_trip(x, 4, "linear")
    assert np.all(np.isfinite(back))
    np.testing.assert_allclose(back[[0, 1, 3]], [3e38, -3e38, 1e38], rtol=0.01)


def test_empty_arrays():
    quantized = quantize_lib.quantize_blocks_reference(jnp.zeros((0, 3)), rounding="stochastic")
    assert quantized.codes.shape == (0, 3) and quantized.scales.shape == (0,)
    back = quantize_lib.dequantize_blocks_reference(quantized.codes, quantized.scales)
    assert back.shape == (0, 3)


def test_bfloat16_input_and_output():
    x = jnp.linspace(-2, 2, 50, dtype=jnp.bfloat16)
    quantized = quantize_lib.quantize_blocks_reference(x, block_size=16)
    back = quantize_lib.dequantize_blocks_reference(
        quantized.codes, quantized.scales, block_size=16, dtype=jnp.bfloat16
    )
    assert back.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(back, np.float32), np.asarray(x, np.float32), atol=0.02)


def test_the_same_key_gives_the_same_codes_and_another_key_others():
    x = jax.random.normal(jax.random.key(0), (1000,))
    a = quantize_lib.quantize_blocks_reference(x, rounding="stochastic", key=jax.random.key(1))
    b = quantize_lib.quantize_blocks_reference(x, rounding="stochastic", key=jax.random.key(1))
    c = quantize_lib.quantize_blocks_reference(x, rounding="stochastic", key=jax.random.key(2))
    np.testing.assert_array_equal(a.codes, b.codes)
    assert np.any(np.asarray(a.codes) != np.asarray(c.codes))


def test_jit_matches_eager():
    x = jax.random.normal(jax.random.key(0), (300,)) ** 2
    key = jax.random.key(3)
    for mapping in quantize_lib.MAPS:

        def f(x, mapping=mapping):
            return quantize_lib.quantize_blocks(
                x, block_size=64, mapping=mapping, rounding="stochastic", key=key
            )

        with jax.disable_jit():
            eager = f(x)
        jitted = jax.jit(f)(x)
        np.testing.assert_array_equal(eager.codes, jitted.codes)
        np.testing.assert_array_equal(eager.scales, jitted.scales)


# -- dispatch and bad input ------------------------------------------------------------------------


def test_dispatch_asks_the_table_for_its_own_operation(monkeypatch):
    asked = []
    monkeypatch.setattr(_dispatch, "triton_unavailable_reason", lambda: None)
    monkeypatch.setattr(_dispatch, "auto_choice", lambda op: asked.append(op) or "xla")
    x = jnp.ones(8)
    quantized = quantize_lib.quantize_blocks(
        x, mapping="sqrt", rounding="stochastic", key=jax.random.key(0)
    )
    quantize_lib.dequantize_blocks(quantized.codes, quantized.scales, mapping="sqrt")
    assert asked == ["quantize/sqrt/stochastic", "dequantize/sqrt"]


def test_the_reference_runs_where_triton_cannot():
    if _dispatch.triton_unavailable_reason() is None:
        pytest.skip("Triton can run here")
    x = jnp.ones(8)
    np.testing.assert_array_equal(
        quantize_lib.quantize_blocks(x).codes, quantize_lib.quantize_blocks_reference(x).codes
    )
    with pytest.raises(RuntimeError, match="impl='triton'"):
        quantize_lib.quantize_blocks(x, impl="triton")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"block_size": 0}, ValueError, "block_size"),
        ({"block_size": -3}, ValueError, "block_size"),
        ({"block_size": 2.0}, TypeError, "block_size"),
        ({"block_size": True}, TypeError, "block_size"),
        ({"mapping": "log"}, ValueError, "mapping"),
        ({"rounding": "up"}, ValueError, "rounding"),
        ({"rounding": "stochastic"}, ValueError, "key"),
        ({"impl": "cuda"}, ValueError, "impl"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        quantize_lib.quantize_blocks(jnp.ones(4), **kwargs)


def test_bad_input_arrays_are_named():
    with pytest.raises(ValueError, match="floating-point"):
        quantize_lib.quantize_blocks(jnp.ones(4, jnp.int32))
    codes = jnp.zeros(10, jnp.int8)
    with pytest.raises(ValueError, match="uint8"):
        quantize_lib.dequantize_blocks(codes, jnp.ones(1), block_size=16, mapping="sqrt")
    with pytest.raises(ValueError, match="one per block"):
        quantize_lib.dequantize_blocks(codes, jnp.ones(2), block_size=16)
    with pytest.raises(ValueError, match="floating-point dtype"):
        quantize_lib.dequantize_blocks(codes, jnp.ones(1), block_size=16, dtype=jnp.int32)
