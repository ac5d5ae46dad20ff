"""Running the Triton kernels under the interpreter on torch CPU tensors bridged from JAX arrays.

The kernel modules' ``launch_arguments`` give the same arguments and metaparameters as the
jax-triton call; here they are turned into torch tensors (through numpy, viewing bfloat16 and
float8 as raw integers, which torch and numpy both have) and the kernel is launched directly.
Importing this module imports torch and triton: callers ``pytest.importorskip`` them first.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int32": torch.int32,
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
    of ``n`` elements per dtype in ``out_dtypes``; returns the outputs as numpy arrays."""
    inputs = [a if isinstance(a, int | float) else to_torch(a) for a in arguments]
    outputs = [empty((n,), dtype) for dtype in out_dtypes]
    kernel[grid](*inputs, *outputs, **metaparameters)
    return [to_numpy(out, dtype) for out, dtype in zip(outputs, out_dtypes, strict=True)]


def same_bits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise: identical bit patterns, or both NaN (NaN payloads and signs may differ)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    raw = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    both_nan = np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
    return (a.view(raw) == b.view(raw)) | both_nan
