"""Trace-time dispatch, the lazy imports, and the straight-through VJP of ``cast``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triaccel_jax.kernels import _dispatch
from triaccel_jax.kernels import cast as cast_kernel
from triaccel_jax.kernels import fused_update as fused_kernel

ON_CUDA = _dispatch.triton_unavailable_reason() is None
needs_no_triton = pytest.mark.skipif(ON_CUDA, reason="checks the behaviour without a CUDA backend")


def _leaf(n=257, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (
        jax.random.normal(keys[0], (n,)),
        jax.random.normal(keys[1], (n,)) * 0.1,
        jnp.abs(jax.random.normal(keys[2], (n,))) * 0.01,
        jax.random.normal(keys[3], (n,)),
    )


def test_importing_the_package_imports_neither_triton_nor_jax_triton():
    code = textwrap.dedent(
        """
        import sys
        import jax.numpy as jnp
        import triaccel_jax
        import triaccel_jax.kernels.cast as cast
        import triaccel_jax.kernels.fused_update as fused_update
        # Tracing on a CPU backend decides for the reference without trying triton either.
        cast.cast(jnp.ones(3), jnp.bfloat16)
        cast.cast_reference(jnp.ones(3), jnp.float16)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("triton", "jax_triton"))
        print(loaded)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_cast_reference_impl_equals_the_reference(dtype, rounding):
    x = jax.random.normal(jax.random.key(0), (100,)) * 10
    key = jax.random.key(1)
    expected = cast_kernel.cast_reference(x, dtype, rounding=rounding, key=key, scale=0.5)
    got = jax.jit(
        lambda x: cast_kernel.cast(
            x, dtype, rounding=rounding, key=key, scale=0.5, impl="reference"
        )
    )(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


@needs_no_triton
def test_auto_is_the_reference_without_cuda():
    x = jax.random.normal(jax.random.key(0), (100,))
    key = jax.random.key(1)
    np.testing.assert_array_equal(
        cast_kernel.cast(x, jnp.bfloat16, rounding="stochastic", key=key),
        cast_kernel.cast_reference(x, jnp.bfloat16, rounding="stochastic", key=key),
    )
    assert _dispatch.resolve("auto", "cast") == "reference"


@needs_no_triton
def test_triton_without_cuda_is_a_clear_runtime_error():
    with pytest.raises(RuntimeError, match=r"impl='triton'.*CUDA"):
        cast_kernel.cast(jnp.ones(3), jnp.bfloat16, impl="triton")
    with pytest.raises(RuntimeError, match=r"impl='triton'.*fused update"):
        fused_kernel.fused_update(*_leaf(), count=1, learning_rate=0.1, impl="triton")


def test_unknown_impl_is_a_value_error():
    with pytest.raises(ValueError, match="impl"):
        cast_kernel.cast(jnp.ones(3), jnp.bfloat16, impl="cuda")
    with pytest.raises(ValueError, match="impl"):
        fused_kernel.fused_update(*_leaf(), count=1, learning_rate=0.1, impl="pallas")


@pytest.mark.slow
def test_fused_update_reference_impl_equals_the_reference():
    kwargs = dict(count=3, learning_rate=1e-2, weight_decay=1e-4, key=jax.random.key(2))
    grad, mu, nu, master = _leaf()
    mu, nu = mu.astype(jnp.bfloat16), nu.astype(jnp.bfloat16)
    # Both jitted: XLA may contract a * b + c into an FMA when it fuses, so a jitted and an eager
    # evaluation of the same function can differ in the last bit.
    expected = jax.jit(lambda *a: fused_kernel.fused_update_reference(*a, 1.5, **kwargs))(
        grad, mu, nu, master
    )
    got = jax.jit(lambda *a: fused_kernel.fused_update(*a, 1.5, impl="reference", **kwargs))(
        grad, mu, nu, master
    )
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cast_has_a_straight_through_vjp():
    x = jnp.array([0.1, -3.0, 1000.0, 2.0**-20], jnp.float32)

    def loss(x, dtype, scale=None):
        y = cast_kernel.cast(x, dtype, rounding="stochastic", key=jax.random.key(0), scale=scale)
        return jnp.sum(y.astype(jnp.float32) * jnp.arange(1.0, 5.0))

    for dtype in (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn):
        grad = jax.jit(jax.grad(loss), static_argnums=1)(x, dtype)
        assert grad.dtype == x.dtype
        np.testing.assert_array_equal(grad, jnp.arange(1.0, 5.0))
    # With a scale, d(x / scale) / dx = 1 / scale; no gradient to the scale itself.
    grad_x, grad_scale = jax.grad(loss, argnums=(0, 2))(x, jnp.float8_e4m3fn, jnp.float32(4.0))
    np.testing.assert_array_equal(grad_x, jnp.arange(1.0, 5.0) / 4.0)
    assert grad_scale == 0.0
    # Cotangents come back in x's dtype.
    x16 = x.astype(jnp.bfloat16)
    g16 = jax.grad(lambda x: jnp.sum(cast_kernel.cast(x, jnp.float8_e4m3fn).astype(jnp.float32)))(
        x16
    )
    assert g16.dtype == jnp.bfloat16


def test_cast_vjp_works_under_vmap_and_jvp_free_paths():
    x = jax.random.normal(jax.random.key(0), (4, 8))
    f = lambda row: jnp.sum(cast_kernel.cast(row, jnp.bfloat16).astype(jnp.float32) ** 2)
    grads = jax.vmap(jax.grad(f))(x)
    np.testing.assert_allclose(grads, 2 * x.astype(jnp.bfloat16).astype(jnp.float32))
