"""The cast kernel in Triton, and its call from JAX through jax-triton.

Imported lazily by :func:`triaccel_jax.kernels.cast.cast` when the Triton path is taken (it
imports triton; jax_triton is imported only when :func:`cast` runs). The kernel is a single pass:
load, multiply by the scale's reciprocal, round, store; one Philox evaluation per element for stochastic
rounding (stream 0, as the reference draws it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from triaccel_jax.kernels import _jax_triton
from triaccel_jax.kernels import _launch
from triaccel_jax.kernels import _triton_common as common


@triton.jit
def cast_kernel(
    x_ptr,
    inv_scale_ptr,
    words_ptr,
    n,
    out_ptr,
    FORMAT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``out = round(x * inv_scale)`` for ``n`` elements.

    Args:
      x_ptr: input, any float dtype (computed in float32).
      inv_scale_ptr: one float32, the reciprocal of the scale, read when ``HAS_SCALE``.
      words_ptr: two int32, the Philox key words, read when ``STOCHASTIC``.
      n: number of elements (< 2**31).
      out_ptr: output in the target dtype.
      FORMAT: the target's code from :func:`_triton_common.format_code`.
      STOCHASTIC: stochastic rounding, else round to nearest even.
      HAS_SCALE: multiply by the reciprocal of the scale first.
      BLOCK: elements per program.
    """
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        x = x * tl.load(inv_scale_ptr)
    if STOCHASTIC:
        bits, _, _, _ = tl.randint4x(common.load_seed(words_ptr), offsets)
    else:
        bits = offsets.to(tl.uint32)  # unused
    common.store_rounded(out_ptr, offsets, mask, x, bits, FORMAT, STOCHASTIC)


def launch_arguments(
    x: jax.Array,
    dtype: jnp.dtype,
    *,
    rounding: str,
    words: jax.Array | None,
    scale: jax.Array | None,
    launch: _launch.LaunchConfig = _launch.DEFAULT,
) -> tuple[tuple, dict, jax.ShapeDtypeStruct]:
    """The kernel's runtime arguments (before the output), metaparameters and output type.

    Shared by the jax-triton call and the interpreter tests, so that both launch the kernel the
    same way. The output is declared in :func:`_triton_common.storage_dtype` (raw bits).
    """
    flat = x.reshape(-1)
    words = (
        jnp.zeros(2, jnp.int32)
        if words is None
        else jax.lax.bitcast_convert_type(words.astype(jnp.uint32), jnp.int32)
    )
    inv_scale = jnp.ones(1, jnp.float32) if scale is None else jnp.reshape(1 / scale, (1,))
    arguments = (flat, inv_scale.astype(jnp.float32), words, flat.size)
    metaparameters = {
        "FORMAT": common.format_code(dtype),
        "STOCHASTIC": rounding == "stochastic" and words is not None,
        "HAS_SCALE": scale is not None,
        "BLOCK": launch.block,
    }
    out_type = jax.ShapeDtypeStruct((flat.size,), common.storage_dtype(dtype))
    return arguments, metaparameters, out_type


def cast(
    x: jax.Array,
    dtype: jnp.dtype,
    *,
    rounding: str,
    words: jax.Array | None,
    scale: jax.Array | None,
    launch: _launch.LaunchConfig = _launch.DEFAULT,
) -> jax.Array:
    """:func:`triaccel_jax.kernels.cast.cast`'s Triton path on validated arguments.

    Args:
      x: floating-point array.
      dtype: a narrow target (bfloat16, float16, float8_e4m3fn).
      rounding: ``"nearest"`` or ``"stochastic"``.
      words: the Philox key words (uint32[2]) for stochastic rounding, else None.
      scale: a float32 scalar dividing ``x``, or None.
      launch: elements per program and warps (:data:`_launch.CANDIDATES`).

    Returns:
      The rounded array, shaped like ``x``.
    """
    if x.size == 0:
        return x.astype(dtype)
    arguments, metaparameters, out_type = launch_arguments(
        x, dtype, rounding=rounding, words=words, scale=scale, launch=launch
    )
    out = _jax_triton.triton_call(
        *arguments,
        kernel=cast_kernel,
        out_type=out_type,
        grid=common.grid(x.size, launch.block),
        num_warps=launch.num_warps,
        enable_fp_fusion=False,  # round like the reference: no a * b + c contracted to an FMA
        **metaparameters,
    )
    return common.from_storage(out, dtype).reshape(x.shape)
