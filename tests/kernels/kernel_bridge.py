"""Running the Triton kernels under the interpreter on torch CPU tensors bridged from JAX arrays.

The kernel modules' ``launch_arguments`` give the same arguments and metaparameters as the
jax-triton call; here they are turned into torch tensors (through numpy, viewing bfloat16 and
float8 as raw integers, which torch and numpy both have) and the kernel is launched directly.
It also holds what the interpreter and launch tests share: the inputs (``inputs``, ``fused_inputs``,
``N`` values of every class: subnormals, specials, round-to-nearest ties) and
``interpreted_jax_triton``, a stand-in for jax_triton that runs the kernels under the interpreter.
Importing this module imports torch and triton: callers ``pytest.importorskip`` them first.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import torch

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "uint16": torch.uint16,
}
# Integer views that numpy and torch share, for dtypes numpy does not know natively.
_RAW = {"bfloat16": (np.int16, torch.int16), "float8_e4m3fn": (np.uint8, torch.uint8)}


def to_torch(array) -> torch.Tensor:
    """A torch CPU tensor with the values (and dtype) of a JAX or numpy array."""
    array = np.asarray(array)
    if array.dtype.name in _RAW:
        np_raw, _ = _RAW[array.dtype.name]
        return torch.from_numpy(array.view(np_raw).copy()).view(TORCH_DTYPES[array.dtype.name])
    return torch.from_numpy(array.copy())


def to_numpy(tensor: torch.Tensor, dtype) -> np.ndarray:
    """The values of a torch tensor as a numpy array of the JAX ``dtype``."""
    dtype = jnp.dtype(dtype)
    if dtype.name in _RAW:
        _, torch_raw = _RAW[dtype.name]
        return tensor.view(torch_raw).numpy().view(dtype)
    return tensor.numpy()


def empty(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=TORCH_DTYPES[jnp.dtype(dtype).name])


def launch(kernel, grid, arguments, out_dtypes, n, metaparameters) -> list[np.ndarray]:
    """Launches ``kernel`` on ``arguments`` (JAX arrays or Python scalars) plus one fresh output
    of ``n`` elements per dtype in ``out_dtypes`` (``n`` a sequence: one size per output);
    returns the outputs as numpy arrays."""
    inputs = [a if isinstance(a, int | float) else to_torch(a) for a in arguments]
    sizes = list(n) if isinstance(n, list | tuple) else [n] * len(out_dtypes)
    outputs = [empty((size,), dtype) for size, dtype in zip(sizes, out_dtypes, strict=True)]
    kernel[grid](*inputs, *outputs, **metaparameters)
    return [to_numpy(out, dtype) for out, dtype in zip(outputs, out_dtypes, strict=True)]


def same_bits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise: identical bit patterns, or both NaN (NaN payloads and signs may differ)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    raw = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    both_nan = np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
    return (a.view(raw) == b.view(raw)) | both_nan


# -- inputs and a jax_triton stand-in, shared by the interpreter and launch tests --------------

N = 3000  # three programs of 1024, the last one masked


def midpoints(dtype, n: int, seed: int) -> np.ndarray:
    """Float32 values exactly halfway between neighbouring values of ``dtype`` (RNE ties)."""
    raw = {1: np.uint8, 2: np.uint16}[jnp.dtype(dtype).itemsize]
    info = jnp.finfo(dtype)
    codes = np.random.default_rng(seed).integers(0, np.iinfo(raw).max, n, dtype=raw)
    values = codes.view(jnp.dtype(dtype)).astype(np.float64)
    upper = (codes + 1).astype(raw).view(jnp.dtype(dtype)).astype(np.float64)
    mid = (values + upper) / 2
    keep = np.isfinite(mid) & (np.abs(mid) < float(info.max)) & (np.sign(values) == np.sign(upper))
    return mid[keep].astype(np.float32)


def inputs(dtype) -> jax.Array:
    info = jnp.finfo(dtype)
    k1, k2 = jax.random.split(jax.random.key(0))
    # Log-uniform magnitudes from below the smallest subnormal to beyond the largest value.
    exponents = jax.random.uniform(
        k1, (N - 700,), minval=float(info.minexp - info.nmant - 3), maxval=float(info.maxexp) + 1
    )
    signs = jnp.where(jax.random.bernoulli(k2, 0.5, exponents.shape), 1.0, -1.0)
    special = np.array(
        [
            np.inf,
            -np.inf,
            np.nan,
            0.0,
            -0.0,
            float(info.max),
            -float(info.max),
            1e-45,
            3e38,
            -3e38,
            65504.0,
            65519.0,
            65520.0,
            448.0,
            464.0,
            465.0,
            -1e-40,
        ],
        np.float32,
    )
    mids = midpoints(dtype, 700 - special.size, seed=1)
    values = jnp.concatenate([signs * 2.0**exponents, special, mids]).astype(jnp.float32)
    return values[:N] if values.size >= N else jnp.pad(values, (0, N - values.size))


def fused_inputs(grad_dtype, moment_dtype, master_dtype, n=N):
    keys = jax.random.split(jax.random.key(5), 4)
    grad = jax.random.normal(keys[0], (n,)) * jnp.exp(jax.random.normal(keys[1], (n,)) * 3)
    mu = grad * 0.3 + jax.random.normal(keys[2], (n,)) * 0.1
    nu = grad**2 * 0.5 + 1e-6
    master = jax.random.normal(keys[3], (n,))
    grad = grad.at[:3].set(jnp.array([0.0, jnp.inf, jnp.nan]))
    return (
        grad.astype(grad_dtype),
        mu.astype(moment_dtype),
        nu.astype(moment_dtype),
        master.astype(master_dtype),
    )


def interpreted_jax_triton():
    """A stand-in for the jax_triton module (0.4's keywords) that runs the kernel under the
    interpreter from a ``jax.pure_callback``: the whole JAX path of ``impl="triton"`` (argument
    packing, output declarations, bitcasts, reshapes, dispatch, jit) runs on CPU."""
    calls = []

    def triton_call(
        *args, kernel, out_type=None, grid, num_warps=None, backend_options=None, **metaparams
    ):
        calls.append({"backend_options": backend_options, "num_warps": num_warps, "grid": grid})
        single = not isinstance(out_type, list | tuple)
        out_types = [out_type] if single else list(out_type)
        positions = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]

        def host(*arrays):
            filled = list(args)
            for i, array in zip(positions, arrays, strict=True):
                filled[i] = np.asarray(array)
            outs = launch(
                kernel,
                grid,
                filled,
                [t.dtype for t in out_types],
                [t.shape[0] for t in out_types],
                metaparams,
            )
            return [o.view(t.dtype) for o, t in zip(outs, out_types, strict=True)]

        results = jax.pure_callback(
            host,
            [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in out_types],
            *[args[i] for i in positions],
        )
        return results[0] if single else results

    return types.SimpleNamespace(triton_call=triton_call), calls
