"""The quantizer's table maps (dynamic exponent, 4-bit), packed codes, the rows layout, rank-1.

These run in the main environment (no triton): the table maps and the rows layout take the
pure-JAX reference under every ``impl`` but ``"triton"``, which refuses them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triaccel_jax.kernels import _dispatch
from triaccel_jax.kernels import _quantize_maps
from triaccel_jax.kernels import quantize as quantize_lib

UNSIGNED = ("dynamic_unsigned", "linear4_unsigned")


def _round_trip(x, block_size, mapping, rounding="nearest", key=None, layout="flat"):
    quantized = quantize_lib.quantize_blocks(
        x, block_size=block_size, mapping=mapping, rounding=rounding, key=key, layout=layout
    )
    back = quantize_lib.dequantize_blocks(
        quantized.codes,
        quantized.scales,
        block_size=block_size,
        mapping=mapping,
        layout=layout,
        shape=x.shape,
    )
    return quantized, np.asarray(back, np.float64)


def _wide_range(shape, seed, signed=True):
    """Values spread over six decades within every block (first-moment-like, or squares)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-6, 0, shape)
    return (x if signed else x * x).astype(np.float32)


def _per_element(scales, shape, block_size, layout):
    scales = np.asarray(scales, np.float64)
    if layout == "flat":
        return np.repeat(scales, block_size)[: int(np.prod(shape))].reshape(shape)
    return np.repeat(scales, block_size, axis=-1)[..., : shape[-1]]


# -- the tables ----------------------------------------------------------------------------------


def _bitsandbytes_dynamic(signed: bool) -> np.ndarray:
    # bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8), restated in
    # float64 from its definition: its levels are the midpoints of linspace(0.1, 1, k + 1) in
    # each of the decades 1e-6 .. 1, k = 2**i (signed, both signs) or 2**(i + 1) (unsigned).
    data = [0.0, 1.0]
    for i in range(7):
        k = 2**i if signed else 2 ** (i + 1)
        b = np.linspace(0.1, 1, k + 1)
        means = 10.0 ** (i - 6) * (b[:-1] + b[1:]) / 2
        data += list(means) + (list(-means) if signed else [])
    return np.sort(np.asarray(data))


def test_the_dynamic_maps_are_bitsandbytes_levels():
    np.testing.assert_allclose(
        quantize_lib.levels("dynamic"), _bitsandbytes_dynamic(True), rtol=1e-7
    )
    unsigned = _bitsandbytes_dynamic(False)
    assert unsigned[0] == 0.0
    # The unsigned map without its zero: zero's code takes 0.55e-7, a decade below the rest.
    np.testing.assert_allclose(quantize_lib.levels("dynamic_unsigned")[1:], unsigned[1:], rtol=1e-7)
    assert quantize_lib.levels("dynamic_unsigned")[0] == np.float32(0.55e-7)
    positive = [0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875]
    np.testing.assert_allclose(
        quantize_lib.levels("dynamic4"),
        [*(-p for p in reversed(positive)), 0.0, *positive, 1.0],
        rtol=1e-6,
    )
    np.testing.assert_array_equal(quantize_lib.levels("linear4_unsigned"), np.arange(1, 17) / 16)


@pytest.mark.parametrize("mapping", quantize_lib.ALL_MAPS)
def test_every_map_has_sorted_levels_within_one(mapping):
    table = quantize_lib.levels(mapping)
    assert table.dtype == np.float32 and np.all(np.diff(table) > 0)
    assert table[-1] == 1.0 and table[0] >= -1.0
    expected = {8: 256, 4: 16}[quantize_lib.MAP_BITS[mapping]] - (mapping == "linear")
    assert table.size == expected
    if mapping in UNSIGNED or mapping == "sqrt":
        assert table[0] > 0  # zero-free: a second moment is never stored as 0


# -- nearest and stochastic rounding -------------------------------------------------------------


@pytest.mark.parametrize("layout", quantize_lib.LAYOUTS)
@pytest.mark.parametrize("mapping", quantize_lib.TABLE_MAPS)
def test_nearest_rounding_takes_the_nearest_level(mapping, layout):
    block_size = 64
    signed = mapping not in UNSIGNED
    x = _wide_range((6, 150), 0, signed)
    quantized, back = _round_trip(jnp.asarray(x), block_size, mapping, layout=layout)
    scale = _per_element(quantized.scales, x.shape, block_size, layout)
    candidates = quantize_lib.levels(mapping).astype(np.float64)[None, None, :] * scale[..., None]
    best = np.min(np.abs(candidates - x[..., None].astype(np.float64)), axis=-1)
    error = np.abs(back - x)
    # The float32 midpoints and the ratio's rounding can pick the other of two nearly equally
    # near levels: within a few float32 ulps of the scale.
    assert np.all(error <= best + scale * 2e-7), np.max(error - best)


def _edges(points: np.ndarray, ulps: int) -> np.ndarray:
    """Every float32 within ``ulps`` of each point, the points included."""
    out = [points.astype(np.float32)]
    for direction in (np.inf, -np.inf):
        x = points.astype(np.float32)
        for _ in range(ulps):
            x = np.nextafter(x, np.float32(direction))
            out.append(x)
    return np.concatenate(out)


@pytest.mark.parametrize("mapping", ["dynamic", "dynamic_unsigned"])
def test_the_8bit_dynamic_codes_from_arithmetic_are_the_binary_searchs(mapping):
    # The guess (decade and cell) is within one of the nearest level's index; two gathers settle
    # it. Checked where a guess can slip: a few ulps around every midpoint, level and decade
    # bound, and over six decades of random values, both signs, zero, +-1, beyond, inf and NaN.
    table = _quantize_maps.MIDPOINTS[mapping]
    bounds = np.float32(10.0) ** np.arange(-9, 1, dtype=np.float32)
    points = _edges(np.concatenate([table[:-1], quantize_lib.levels(mapping), bounds]), 4)
    rng = np.random.default_rng(0)
    spread = rng.standard_normal(400_000) * 10.0 ** rng.uniform(-9, 0, 400_000)
    special = [0.0, -0.0, 1.0, -1.0, 1.5, -1.5, np.inf, -np.inf, np.nan, 1e-30, -1e-30, 1e-45]
    t = np.concatenate([points, -points, np.clip(spread, -1, 1), special]).astype(np.float32)
    guess = np.asarray(_quantize_maps.dynamic_guess(mapping, jnp.asarray(t)))
    searched = np.asarray(_quantize_maps.count_at_most(table, jnp.asarray(t)))
    assert guess.min() >= 1 and guess.max() <= table.size - 1
    assert np.abs(guess - searched)[~np.isnan(t)].max() <= 1
    np.testing.assert_array_equal(
        np.asarray(_quantize_maps.codes(mapping, jnp.asarray(t), None)), searched
    )
    jitted = jax.jit(lambda v: _quantize_maps.codes(mapping, v, None))
    np.testing.assert_array_equal(np.asarray(jitted(jnp.asarray(t))), searched)


@pytest.mark.parametrize("mapping", quantize_lib.TABLE_MAPS)
def test_stochastic_rounding_lands_on_a_neighbouring_level(mapping):
    x = _wide_range((4, 256), 1, mapping not in UNSIGNED)
    key = jax.random.key(2)
    quantized, back = _round_trip(jnp.asarray(x), 128, mapping, "stochastic", key)
    scale = _per_element(quantized.scales, x.shape, 128, "flat")
    table = quantize_lib.levels(mapping).astype(np.float64)
    ratio = np.clip(x / scale, table[0], 1.0)
    index = np.clip(np.searchsorted(table, ratio, side="right") - 1, 0, table.size - 2)
    low, high = table[index] * scale, table[index + 1] * scale
    close = scale * 1e-6
    on_low = np.abs(back - low) <= close
    on_high = np.abs(back - high) <= close
    assert np.all(on_low | on_high)


@pytest.mark.parametrize(
    ("mapping", "values"),
    [
        ("dynamic", [0.3, -0.017, 2e-4, -0.9]),
        ("dynamic_unsigned", [0.3, 0.017, 2e-6, 0.9]),
        ("dynamic4", [0.3, -0.017, 0.05, -0.5]),
        ("linear4_unsigned", [0.3, 0.1, 0.53, 0.9]),  # between its levels 1/16 .. 1
    ],
)
def test_stochastic_rounding_is_unbiased_over_keys(mapping, values):
    # As for the closed-form maps (test_kernel_quantize.py): each row is one block, the values
    # beside a maximum of 1, quantized with a fresh key; the mean over keys converges to the
    # value (5 standard errors of the mean).
    n_keys = 4000
    block = jnp.array([1.0, *values], jnp.float32)
    keys = jax.random.split(jax.random.key(1234), n_keys)
    size = block.size

    def one(key):
        quantized = quantize_lib.quantize_blocks(
            block, block_size=size, mapping=mapping, rounding="stochastic", key=key
        )
        return quantize_lib.dequantize_blocks(
            quantized.codes, quantized.scales, block_size=size, mapping=mapping, shape=(size,)
        )

    samples = np.asarray(jax.jit(jax.vmap(one))(keys), np.float64)[:, 1:]
    mean, std = samples.mean(axis=0), samples.std(axis=0)
    target = np.asarray(values, np.float32).astype(np.float64)
    assert np.all(std > 0)
    assert np.all(np.abs(mean - target) <= 5 * std / np.sqrt(n_keys) + 1e-9), (mean, target)


# -- wide-range blocks: what the dynamic maps are for --------------------------------------------


def test_the_dynamic_map_zeroes_no_entry_of_a_wide_range_block_where_linear_zeroes_many():
    # Issue 40's workload: a first moment whose columns' scales spread 100x, so every block of
    # 256 (a row) spans two decades and more (the normal's own spread).
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 256)) * 10.0 ** rng.uniform(-2, 0, 256)[None, :]
    x = jnp.asarray(x, jnp.float32)
    nonzero = np.asarray(x) != 0

    def measure(mapping):
        _, back = _round_trip(x, 256, mapping)
        x64 = np.asarray(x, np.float64)
        zeroed = np.mean(back[nonzero] == 0)
        relative = np.mean(np.abs(back - x64)[nonzero] / np.abs(x64[nonzero]))
        return zeroed, relative

    linear_zeroed, linear_error = measure("linear")
    dynamic_zeroed, dynamic_error = measure("dynamic")
    assert linear_zeroed > 0.05  # the linear map's step, absmax / 127, swallows small entries
    assert dynamic_zeroed == 0.0
    assert dynamic_error < linear_error / 4, (dynamic_error, linear_error)


@pytest.mark.parametrize("mapping", UNSIGNED)
def test_zero_free_maps_never_store_a_second_moment_as_zero(mapping):
    # A second moment spanning twelve decades, and exact zeros: Adam's m / (sqrt(v) + eps) must
    # not become m / eps, so every kept block's values dequantize above zero, zeros included.
    x = _wide_range((8, 128), 3, signed=False)
    x[:, ::7] = 0.0
    for rounding in ("nearest", "stochastic"):
        quantized, back = _round_trip(jnp.asarray(x), 128, mapping, rounding, jax.random.key(0))
        lowest = (
            _per_element(quantized.scales, x.shape, 128, "flat") * quantize_lib.levels(mapping)[0]
        )
        assert np.all(back >= lowest * (1 - 1e-6)) and np.all(back > 0)


def test_the_signed_dynamic_map_keeps_zero_exactly():
    x = jnp.array([1.0, 0.0, -0.5, 0.0, 1e-9], jnp.float32)
    _, back = _round_trip(x, 5, "dynamic")
    assert back[1] == 0.0 and back[3] == 0.0


# -- special values ------------------------------------------------------------------------------


@pytest.mark.parametrize("mapping", quantize_lib.TABLE_MAPS)
def test_a_block_with_nan_or_inf_dequantizes_to_nan_and_others_are_untouched(mapping):
    x = jnp.array([1.0, jnp.nan, 2.0, 3.0, jnp.inf, 0.5, 4.0, 1.0])
    quantized, back = _round_trip(x, 2, mapping)
    assert np.isnan(np.asarray(quantized.scales)).tolist() == [True, False, True, False]
    assert np.isnan(back).tolist() == [True, True, False, False, True, True, False, False]
    np.testing.assert_allclose(back[[3, 6]], [3.0, 4.0], rtol=1e-6)  # each block's maximum


@pytest.mark.parametrize("mapping", quantize_lib.TABLE_MAPS)
def test_zero_and_tiny_blocks_store_the_code_nearest_zero(mapping):
    x = jnp.array([0.0, 0.0, 1e-35, 1e-33], jnp.float32)
    quantized, back = _round_trip(x, 2, mapping)
    codes = np.asarray(
        quantize_lib.unpack_nibbles(quantized.codes, 4)
        if quantize_lib.MAP_BITS[mapping] == 4
        else quantized.codes
    )
    np.testing.assert_array_equal(codes, _quantize_maps.zero_code(mapping))
    assert np.all(np.isfinite(back)) and np.all(np.abs(back) <= 1e-33)


def test_huge_values_stay_finite():
    x = jnp.array([3e38, -3e38, 1.0, 1e38], jnp.float32)
    _, back = _round_trip(x, 4, "dynamic")
    assert np.all(np.isfinite(back))
    np.testing.assert_allclose(back[[0, 1, 3]], [3e38, -3e38, 1e38], rtol=0.01)


# -- 4-bit codes, two per byte -------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 7, 128, 1001])
@pytest.mark.parametrize("mapping", ["dynamic4", "linear4_unsigned"])
def test_4bit_codes_take_half_a_byte_per_element(mapping, n):
    x = jnp.asarray(np.abs(_wide_range((n,), 4)) if n else np.zeros(0, np.float32))
    quantized, back = _round_trip(x, 128, mapping)
    assert quantized.codes.dtype == jnp.uint8 and quantized.codes.shape == (-(-n // 2),)
    assert quantized.codes.nbytes == -(-n // 2)
    assert quantize_lib.stored_bytes((n,), block_size=128, mapping=mapping) == -(-n // 2) + 4 * -(
        -n // 128
    )
    assert back.shape == (n,)


def test_4bit_rows_pack_each_row_and_keep_the_leading_axes():
    x = jnp.asarray(_wide_range((3, 4, 301), 5))
    quantized, back = _round_trip(x, 128, "dynamic4", layout="rows")
    assert quantized.codes.shape == (3, 4, 151) and quantized.scales.shape == (3, 4, 3)
    assert back.shape == (3, 4, 301)
    unpacked = np.asarray(quantize_lib.unpack_nibbles(quantized.codes, 301))
    flat = quantize_lib.quantize_blocks(x[1, 2], block_size=128, mapping="dynamic4")
    np.testing.assert_array_equal(unpacked[1, 2], quantize_lib.unpack_nibbles(flat.codes, 301))


def test_pack_and_unpack_nibbles_round_trip():
    codes = jnp.asarray(np.random.default_rng(0).integers(0, 16, (3, 9)), jnp.uint8)
    packed = quantize_lib.pack_nibbles(codes)
    assert packed.shape == (3, 5)
    np.testing.assert_array_equal(quantize_lib.unpack_nibbles(packed, 9), codes)
    assert int(packed[0, 0]) == int(codes[0, 0]) * 16 + int(codes[0, 1])  # the first one high
    with pytest.raises(ValueError, match="5 bytes hold 9 or 10 codes"):
        quantize_lib.unpack_nibbles(packed, 11)
    with pytest.raises(ValueError, match="uint8"):
        quantize_lib.pack_nibbles(codes.astype(jnp.int8))


def test_4bit_dequantize_needs_the_shape():
    quantized = quantize_lib.quantize_blocks(jnp.ones(7), block_size=4, mapping="dynamic4")
    with pytest.raises(ValueError, match="pass `shape`"):
        quantize_lib.dequantize_blocks(
            quantized.codes, quantized.scales, block_size=4, mapping="dynamic4"
        )
    with pytest.raises(ValueError, match="two per byte"):
        quantize_lib.dequantize_blocks(
            quantized.codes, quantized.scales, block_size=4, mapping="dynamic4", shape=(9,)
        )


# -- blocks along the last axis ------------------------------------------------------------------


def test_rows_cut_blocks_within_each_row_with_a_short_last_block():
    x = jnp.ones((3, 10)).at[1, 9].set(100.0)  # in row 1's short last block only
    quantized = quantize_lib.quantize_blocks(x, block_size=4, mapping="dynamic", layout="rows")
    assert quantized.codes.shape == (3, 10)
    np.testing.assert_array_equal(quantized.scales, [[1, 1, 1], [1, 1, 100], [1, 1, 1]])
    assert quantize_lib.scales_shape((1000, 1000), 256, "rows") == (1000, 4)
    assert quantize_lib.stored_bytes(
        (1000, 1000), block_size=256, mapping="dynamic", layout="rows"
    ) == (1000 * 1000 + 4 * 4000)


@pytest.mark.parametrize("mapping", quantize_lib.ALL_MAPS)
def test_rows_whose_length_the_block_divides_give_the_flat_layouts_codes(mapping):
    # The same counter-hash bits for an element under both layouts: when blocks of the flat
    # array are whole rows' blocks, the codes are the same, and the scales are reshaped.
    x = jnp.asarray(_wide_range((4, 6, 128), 6, mapping not in (*UNSIGNED, "sqrt")))
    key = jax.random.key(9)
    flat = quantize_lib.quantize_blocks(
        x, block_size=64, mapping=mapping, rounding="stochastic", key=key
    )
    rows = quantize_lib.quantize_blocks(
        x, block_size=64, mapping=mapping, rounding="stochastic", key=key, layout="rows"
    )
    np.testing.assert_array_equal(rows.scales, np.asarray(flat.scales).reshape(4, 6, 2))
    if quantize_lib.MAP_BITS[mapping] == 4:
        np.testing.assert_array_equal(np.asarray(rows.codes).ravel(), flat.codes)
    else:
        np.testing.assert_array_equal(rows.codes, flat.codes)


def test_rows_refuses_a_scalar():
    with pytest.raises(ValueError, match="scalar has none"):
        quantize_lib.quantize_blocks(jnp.float32(1.0), layout="rows")


# -- rank-1 normalisation ------------------------------------------------------------------------


@pytest.mark.parametrize("mapping", quantize_lib.TABLE_MAPS)
def test_rank1_scales_each_element_by_its_row_and_column(mapping):
    x = _wide_range((9, 13), 7, mapping not in UNSIGNED)
    quantized = quantize_lib.quantize_rank1(jnp.asarray(x), mapping=mapping)
    np.testing.assert_array_equal(quantized.row_scales, np.abs(x).max(axis=1))
    np.testing.assert_array_equal(quantized.column_scales, np.abs(x).max(axis=0))
    width = 7 if quantize_lib.MAP_BITS[mapping] == 4 else 13
    assert quantized.codes.shape == (9, width)
    back = np.asarray(
        quantize_lib.dequantize_rank1(
            quantized.codes, quantized.row_scales, quantized.column_scales, mapping=mapping
        ),
        np.float64,
    )
    scale = np.minimum(np.abs(x).max(axis=1)[:, None], np.abs(x).max(axis=0)[None, :])
    candidates = quantize_lib.levels(mapping).astype(np.float64) * scale[..., None]
    best = np.min(np.abs(candidates - x[..., None]), axis=-1)
    assert np.all(np.abs(back - x) <= best + scale * 2e-7)


def test_rank1_is_unbiased_and_zero_free_for_second_moments():
    x = np.abs(_wide_range((16, 16), 8, signed=False))
    x[3, 3] = 0.0
    keys = jax.random.split(jax.random.key(0), 2000)

    def one(key):
        quantized = quantize_lib.quantize_rank1(jnp.asarray(x), rounding="stochastic", key=key)
        return quantize_lib.dequantize_rank1(*quantized)

    samples = np.asarray(jax.jit(jax.vmap(one))(keys), np.float64)
    assert np.all(samples > 0)
    scale = np.minimum(x.max(axis=1)[:, None], x.max(axis=0)[None, :])
    above = x >= scale / 16  # between two levels: unbiased there
    mean, std = samples.mean(axis=0), samples.std(axis=0)
    assert np.all(np.abs(mean - x)[above] <= 5 * std[above] / np.sqrt(2000) + 1e-12)


def test_rank1_marks_a_row_and_column_holding_nan_and_refuses_other_shapes():
    x = jnp.ones((3, 4)).at[1, 2].set(jnp.nan)
    back = np.asarray(quantize_lib.dequantize_rank1(*quantize_lib.quantize_rank1(x)))
    nan = np.zeros((3, 4), bool)
    nan[1, :] = nan[:, 2] = True
    np.testing.assert_array_equal(np.isnan(back), nan)
    with pytest.raises(ValueError, match="2-D"):
        quantize_lib.quantize_rank1(jnp.ones((2, 3, 4)))
    with pytest.raises(ValueError, match="table maps"):
        quantize_lib.quantize_rank1(jnp.ones((2, 3)), mapping="linear")


# -- dispatch and bad input ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mapping", "layout"), [("dynamic", "flat"), ("dynamic4", "flat"), ("linear", "rows")]
)
def test_impl_triton_refuses_what_the_kernel_does_not_implement(mapping, layout):
    x = jnp.ones((4, 8))
    with pytest.raises(ValueError, match="implements the maps"):
        quantize_lib.quantize_blocks(x, mapping=mapping, layout=layout, impl="triton")
    quantized = quantize_lib.quantize_blocks(x, mapping=mapping, layout=layout)
    with pytest.raises(ValueError, match="implements the maps"):
        quantize_lib.dequantize_blocks(
            quantized.codes,
            quantized.scales,
            mapping=mapping,
            layout=layout,
            shape=(4, 8),
            impl="triton",
        )


def test_impl_auto_takes_the_reference_for_the_new_maps_where_triton_would_run(monkeypatch):
    # Even where the table says "triton", the table maps and the rows layout run the reference
    # (the main environment has no triton: importing the kernel module would fail).
    monkeypatch.setattr(_dispatch, "triton_unavailable_reason", lambda: None)
    monkeypatch.setattr(_dispatch, "auto_choice", lambda op: "triton")
    x = jnp.asarray(_wide_range((4, 64), 10))
    for mapping, layout in (("dynamic", "flat"), ("dynamic4", "flat"), ("sqrt", "rows")):
        y = jnp.abs(x) if mapping == "sqrt" else x
        quantized = quantize_lib.quantize_blocks(y, block_size=32, mapping=mapping, layout=layout)
        expected = quantize_lib.quantize_blocks_reference(
            y, block_size=32, mapping=mapping, layout=layout
        )
        np.testing.assert_array_equal(quantized.codes, expected.codes)


def test_jit_matches_eager():
    x = jnp.asarray(_wide_range((5, 70), 11))
    key = jax.random.key(3)
    for mapping in quantize_lib.TABLE_MAPS:
        for layout in quantize_lib.LAYOUTS:

            def f(x, mapping=mapping, layout=layout):
                return quantize_lib.quantize_blocks(
                    x, block_size=32, mapping=mapping, rounding="stochastic", key=key, layout=layout
                )

            with jax.disable_jit():
                eager = f(x)
            jitted = jax.jit(f)(x)
            np.testing.assert_array_equal(eager.codes, jitted.codes)
            np.testing.assert_array_equal(eager.scales, jitted.scales)


def test_bfloat16_input_and_output():
    x = jnp.linspace(-2, 2, 50, dtype=jnp.bfloat16)
    quantized = quantize_lib.quantize_blocks(x, block_size=16, mapping="dynamic")
    back = quantize_lib.dequantize_blocks(
        quantized.codes, quantized.scales, block_size=16, mapping="dynamic", dtype=jnp.bfloat16
    )
    assert back.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(back, np.float32), np.asarray(x, np.float32), atol=0.02)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="layout"):
        quantize_lib.quantize_blocks(jnp.ones(4), layout="columns")
    with pytest.raises(ValueError, match="mapping"):
        quantize_lib.quantize_blocks(jnp.ones(4), mapping="dynamic8")
    quantized = quantize_lib.quantize_blocks(
        jnp.ones((4, 8)), block_size=4, mapping="dynamic", layout="rows"
    )
    with pytest.raises(ValueError, match="one per block"):
        quantize_lib.dequantize_blocks(
            quantized.codes, quantized.scales, block_size=8, mapping="dynamic", layout="rows"
        )
    with pytest.raises(ValueError, match="uint8"):
        quantize_lib.dequantize_blocks(
            quantized.codes.astype(jnp.int8),
            quantized.scales,
            block_size=4,
            mapping="dynamic",
            layout="rows",
        )
