"""What the GPU check's sections share: the cases, inputs, timing and ulp distances."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

TARGETS = (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn)
FUSED_CASES = (
    # grad, moments, master, compute, rounding, compute_scale
    (jnp.float32, jnp.float32, jnp.float32, jnp.bfloat16, "nearest", None),
    (jnp.float32, jnp.float32, jnp.float32, jnp.float32, "nearest", None),
    (jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.bfloat16, "stochastic", None),
    (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, "nearest", 0.01),
    (jnp.float32, jnp.bfloat16, jnp.bfloat16, jnp.float8_e4m3fn, "stochastic", 0.004),
    (jnp.bfloat16, jnp.float32, jnp.float16, jnp.float16, "stochastic", None),
)
HYPER = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-2)


def name(dtype: Any) -> str:
    return jnp.dtype(dtype).name


def _ordered(a: np.ndarray) -> np.ndarray:
    """Raw bits as integers ordered like the values (sign-magnitude to two's complement)."""
    raw = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]).astype(np.int64)
    sign = np.int64(1) << (8 * a.dtype.itemsize - 1)
    return np.where(raw & sign, -(raw & (sign - 1)), raw)


def ulp_distance(got: Any, expected: Any) -> tuple[float, float]:
    """(fraction of bit-identical elements, largest distance in ulps); NaN matches NaN only."""
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, expected.dtype)
    nan_g = np.isnan(got.astype(np.float32))
    nan_e = np.isnan(expected.astype(np.float32))
    distance = np.abs(_ordered(got) - _ordered(expected)).astype(np.float64)
    distance = np.where(nan_g & nan_e, 0.0, distance)
    distance = np.where(nan_g != nan_e, np.inf, distance)
    return float(np.mean(distance == 0)), float(distance.max(initial=0.0))


def timed(f: Callable[..., Any], *args: Any, iterations: int, rounds: int = 5) -> float:
    """Seconds per call of ``f(*args)``: the median over ``rounds`` of ``iterations`` queued calls.

    The calls of a round are dispatched back to back and waited for once, so the device stays
    busy and the figure is the kernel's time, not the host's dispatch latency (blocking on each
    call of a 0.1 ms kernel measures mostly the round trip).
    """
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iterations):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / iterations)
    return statistics.median(times)


def cast_inputs(n: int, seed: int = 0) -> jax.Array:
    """Normal float32 values from 2**-126 to 2**130 in magnitude (no float32 subnormals), and
    inf, -inf, NaN, +-0 and values beyond every target's range."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    exponents = jax.random.uniform(k1, (n,), minval=-125.0, maxval=127.0)
    signs = jnp.where(jax.random.bernoulli(k2, 0.5, (n,)), 1.0, -1.0)
    x = (signs * 2.0**exponents).astype(jnp.float32)
    # A third of the values where the narrow formats are dense, to exercise their rounding.
    x = x.at[: n // 3].set(x[: n // 3] / 2.0 ** jnp.round(exponents[: n // 3]) * 3.0)
    special = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0, -0.0, 1e30, -7e4, 500.0], jnp.float32)
    return x.at[: special.size].set(special)


def fused_inputs(n: int, grad_dtype, moment_dtype, master_dtype, seed: int = 5):
    keys = jax.random.split(jax.random.key(seed), 4)
    grad = jax.random.normal(keys[0], (n,)) * jnp.exp(jax.random.normal(keys[1], (n,)))
    mu = grad * 0.3 + jax.random.normal(keys[2], (n,)) * 0.1
    nu = grad**2 * 0.5 + 1e-6
    master = jax.random.normal(keys[3], (n,))
    return (
        grad.astype(grad_dtype),
        mu.astype(moment_dtype),
        nu.astype(moment_dtype),
        master.astype(master_dtype),
    )


def echo(*args: Any) -> None:
    print(*args, flush=True)
