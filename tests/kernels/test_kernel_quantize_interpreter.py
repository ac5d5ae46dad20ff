"""The block-wise quantize/dequantize kernels under ``TRITON_INTERPRET=1``, against the reference.

Needs torch and triton (the ``kernels-dev`` extra, in ``.venv-kernels``); skips elsewhere. The
kernels draw the reference's counter-hash bits and compute with the same IEEE-rounded operations, so
codes, scales and dequantized values agree bit for bit. The references are evaluated operation
by operation (``jax.disable_jit``), as in ``test_kernel_interpreter.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interpreter tests need torch (kernels-dev extra)")
triton = pytest.importorskip(
    "triton", reason="the interpreter tests need triton (kernels-dev extra)"
)

import kernel_bridge  # noqa: E402  (imports torch)

from triaccel_jax.kernels import _launch  # noqa: E402
from triaccel_jax.kernels import _quantize_triton  # noqa: E402
from triaccel_jax.kernels import _rounding  # noqa: E402
from triaccel_jax.kernels import quantize as q  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        not triton.knobs.runtime.interpret,
        reason="TRITON_INTERPRET=1 must be set before triton kernels are defined",
    ),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]


def _inputs(mapping: str, n: int) -> jax.Array:
    """Values of every class: a wide spread of magnitudes, zeros, exact levels, ties, specials
    (in their own blocks), blocks of zeros and of tiny values; non-negative for ``"sqrt"``."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (n,)) * jnp.exp(jax.random.normal(keys[1], (n,)) * 4)
    x = jnp.where(jax.random.bernoulli(keys[2], 0.05, (n,)), 0.0, x)
    ties = jnp.array([127.0, 63.5, -0.5, 1.5, 2.5, -126.5, 0.0], jnp.float32)
    special = jnp.array([jnp.nan, 1.0, -jnp.inf, 2.0, jnp.inf, 3e38, -3e38, 1e-36])
    tiny = jnp.array([1e-35, -1e-32, 0.0, 7e-31], jnp.float32)
    x = x.at[:7].set(ties).at[64:72].set(special).at[128:132].set(tiny).at[192:256].set(0.0)
    if mapping == "sqrt":
        x = jnp.abs(x) * jnp.where(jnp.arange(n) % 97 == 0, -1.0, 1.0)  # a few negatives
    return x.astype(jnp.float32)


def _quantize_kernel(x, block_size, mapping, key, launch=_launch.DEFAULT):
    words = None if key is None else _rounding.key_words(key)
    arguments, meta, out_types, grid = _quantize_triton.launch_arguments(
        x, block_size=block_size, mapping=mapping, words=words, launch=launch
    )
    codes, scales = kernel_bridge.launch(
        _quantize_triton.quantize_kernel,
        grid,
        arguments,
        [t.dtype for t in out_types],
        [t.shape[0] for t in out_types],
        meta,
    )
    return codes.reshape(x.shape), scales


def _dequantize_kernel(codes, scales, block_size, mapping, launch=_launch.DEFAULT):
    arguments, meta, out_type, grid = _quantize_triton.dequantize_arguments(
        codes, scales, block_size=block_size, mapping=mapping, launch=launch
    )
    (out,) = kernel_bridge.launch(
        _quantize_triton.dequantize_kernel, grid, arguments, [out_type.dtype], codes.size, meta
    )
    return out.reshape(codes.shape)


CASES = [
    # block size, elements: a power of two, a block not a power of two, blocks larger than a tile
    # of the default launch, a last block shorter than the others.
    (256, 3000),
    (100, 1234),
    (2048, 5000),
    (7, 333),
]


@pytest.mark.parametrize(("block_size", "n"), CASES, ids=[f"block{b}-n{n}" for b, n in CASES])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("mapping", q.MAPS)
def test_quantize_kernel_matches_the_reference_bit_for_bit(mapping, rounding, block_size, n):
    x = _inputs(mapping, n)
    key = jax.random.key(7) if rounding == "stochastic" else None
    with jax.disable_jit():
        expected = q.quantize_blocks_reference(
            x, block_size=block_size, mapping=mapping, rounding=rounding, key=key
        )
    codes, scales = _quantize_kernel(x, block_size, mapping, key)
    np.testing.assert_array_equal(codes, np.asarray(expected.codes))
    assert kernel_bridge.same_bits(scales, np.asarray(expected.scales)).all()


@pytest.mark.parametrize(("block_size", "n"), CASES[:2], ids=["block256", "block100"])
@pytest.mark.parametrize("mapping", q.MAPS)
def test_dequantize_kernel_matches_the_reference_bit_for_bit(mapping, block_size, n):
    x = _inputs(mapping, n)
    quantized = q.quantize_blocks_reference(
        x, block_size=block_size, mapping=mapping, rounding="stochastic", key=jax.random.key(1)
    )
    with jax.disable_jit():
        expected = q.dequantize_blocks_reference(
            quantized.codes, quantized.scales, block_size=block_size, mapping=mapping
        )
    got = _dequantize_kernel(quantized.codes, quantized.scales, block_size, mapping)
    assert kernel_bridge.same_bits(got, np.asarray(expected)).all()


def test_codes_do_not_depend_on_the_launch():
    x = _inputs("linear", 3000)
    key = jax.random.key(3)
    a = _quantize_kernel(x, 64, "linear", key, launch=_launch.LaunchConfig(512, 4))
    b = _quantize_kernel(x, 64, "linear", key, launch=_launch.LaunchConfig(4096, 8))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


@pytest.mark.parametrize("mapping", q.MAPS)
def test_kernel_stochastic_rounding_is_unbiased(mapping):
    # One value between two levels, repeated in 400 blocks whose maximum is 1: the mean of the
    # dequantized copies converges to it (the kernel's own property, beside the bit parity).
    value, blocks, block_size = 0.3011, 400, 64
    x = jnp.full((blocks, block_size), value, jnp.float32).at[:, 0].set(1.0).reshape(-1)
    codes, scales = _quantize_kernel(x, block_size, mapping, jax.random.key(11))
    back = _dequantize_kernel(jnp.asarray(codes), jnp.asarray(scales), block_size, mapping)
    samples = back.reshape(blocks, block_size)[:, 1:].astype(np.float64).ravel()
    assert np.unique(samples).size == 2
    errors = samples - float(np.float32(value))
    assert abs(errors.mean()) < 4 * errors.std() / np.sqrt(errors.size)


def test_the_jax_path_runs_the_kernel_through_jax_triton(monkeypatch):
    # The whole impl="triton" path (argument packing, output declarations, reshapes, dispatch,
    # jit) with a jax_triton stand-in that runs the kernels under the interpreter.
    from triaccel_jax.kernels import _dispatch

    fake, calls = kernel_bridge.interpreted_jax_triton()
    monkeypatch.setitem(__import__("sys").modules, "jax_triton", fake)
    monkeypatch.setattr(_dispatch, "triton_unavailable_reason", lambda: None)
    x = _inputs("sqrt", 1000).reshape(10, 100)
    key = jax.random.key(5)

    @jax.jit
    def round_trip(x):
        quantized = q.quantize_blocks(
            x, block_size=128, mapping="sqrt", rounding="stochastic", key=key, impl="triton"
        )
        back = q.dequantize_blocks(
            quantized.codes, quantized.scales, block_size=128, mapping="sqrt", impl="triton"
        )
        return quantized, back

    quantized, back = round_trip(x)
    assert len(calls) == 2
    with jax.disable_jit():
        expected = q.quantize_blocks_reference(
            x, block_size=128, mapping="sqrt", rounding="stochastic", key=key
        )
        expected_back = q.dequantize_blocks_reference(
            expected.codes, expected.scales, block_size=128, mapping="sqrt"
        )
    assert quantized.codes.shape == (10, 100) and quantized.codes.dtype == jnp.uint8
    np.testing.assert_array_equal(quantized.codes, expected.codes)
    assert kernel_bridge.same_bits(np.asarray(back), np.asarray(expected_back)).all()
