"""The block-wise quantize and dequantize kernels in Triton, and their calls through jax-triton.

Imported lazily by :func:`triaccel_jax.kernels.quantize.quantize_blocks` and
:func:`~triaccel_jax.kernels.quantize.dequantize_blocks` when the Triton path is taken. Each
program handles ``ROWS`` whole blocks laid out as a ``(ROWS, WIDTH)`` tile (``WIDTH`` the block
size rounded up to a power of two, the extra columns masked), so a block's absolute maximum is
one reduction along the tile's rows and the data is read once. The arithmetic is the
reference's (:mod:`triaccel_jax.kernels.quantize`), with the same values at every step, IEEE-rounded
division and square root (``div_rn``, ``sqrt_rn``) and the reference's counter hash of the
element's flat index (:func:`triaccel_jax.kernels._rounding.counter_bits`, 32-bit integer
multiplies and shifts), so the two agree bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from triaccel_jax.kernels import _jax_triton
from triaccel_jax.kernels import _launch
from triaccel_jax.kernels import quantize as quantize_lib


@triton.jit
def _mix32(x):
    # _rounding.mix32 (lowbias32) on uint32: products wrap modulo 2**32, shifts are logical.
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _uniform(words_ptr, offsets):
    # _rounding.counter_bits of the flat offsets, and quantize._uniform's 24-bit uniforms.
    w0 = tl.load(words_ptr).to(tl.uint32, bitcast=True)
    w1 = tl.load(words_ptr + 1).to(tl.uint32, bitcast=True)
    bits = _mix32(_mix32(offsets.to(tl.uint32) ^ w0) + w1)
    return (bits >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


@triton.jit
def quantize_kernel(
    x_ptr,
    words_ptr,
    n,
    blocks,
    codes_ptr,
    scales_ptr,
    BLOCK_SIZE: tl.constexpr,
    WIDTH: tl.constexpr,
    ROWS: tl.constexpr,
    SQRT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """Codes and per-block scales of ``n`` elements in ``blocks`` blocks of ``BLOCK_SIZE``.

    Args:
      x_ptr: input, any float dtype (computed in float32).
      words_ptr: two int32, the counter hash's key words, read when ``STOCHASTIC``.
      n: number of elements (< 2**31).
      blocks: number of blocks, ``ceil(n / BLOCK_SIZE)``.
      codes_ptr: output codes, int8 (linear) or uint8 (sqrt).
      scales_ptr: output float32 scales, one per block.
      BLOCK_SIZE: elements per block.
      WIDTH: ``BLOCK_SIZE`` rounded up to a power of two.
      ROWS: blocks per program (a power of two).
      SQRT: the ``"sqrt"`` map (uint8 codes, no zero level), else ``"linear"``.
      STOCHASTIC: stochastic rounding, else round to nearest (ties to the even code).
    """
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    columns = tl.arange(0, WIDTH)
    offsets = rows[:, None] * BLOCK_SIZE + columns[None, :]
    mask = (columns[None, :] < BLOCK_SIZE) & (offsets < n)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    absmax = tl.max(tl.abs(x), axis=1)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    absmax = tl.where(has_nan, float("nan"), absmax)
    finite = absmax < float("inf")  # False for NaN and inf
    kept = finite & (absmax >= 7.888609052210118e-31)  # quantize.TINY = 2**-100
    # quantize.HUGE: blocks of a maximum of 2**64 or more are scaled by 2**-64 (exact) before
    # the reciprocal, as the reference does.
    factor = tl.where(absmax >= 1.8446744073709552e19, 5.421010862427522e-20, 1.0)
    safe = tl.where(kept, absmax * factor, 1.0)
    if SQRT:
        inverse = tl.div_rn(tl.full(safe.shape, 1.0, tl.float32), safe)
        ratio = tl.minimum(tl.maximum(x * factor[:, None], 0.0) * inverse[:, None], 1.0)
        position = tl.sqrt_rn(ratio) * 256.0 - 1.0
        lower = tl.minimum(
            tl.maximum(tl.floor(position), 0.0), 254.0
        )  # the reference's clip(trunc)
        root = (lower + 1.0) * 0.00390625  # exact: (code + 1) / 256
        distance = ratio - root * root
        gap = (lower * 2.0 + 3.0) * 1.52587890625e-05  # exact: (2 * code + 3) / 2**16
        if STOCHASTIC:
            up = _uniform(words_ptr, offsets) * gap < distance
        else:
            up = distance >= gap * 0.5  # ties to the upper level
        code = lower + up.to(tl.float32)
        code = tl.where(kept[:, None], code, 0.0)
        tl.store(codes_ptr + offsets, code.to(tl.uint8), mask=mask)
    else:
        inverse = factor * tl.div_rn(tl.full(safe.shape, 127.0, tl.float32), safe)
        scaled = x * inverse[:, None]
        lower = tl.floor(scaled)
        fraction = scaled - lower
        if STOCHASTIC:
            up = _uniform(words_ptr, offsets) < fraction
        else:  # the reference's round to nearest even, as floor and fraction
            odd = (lower.to(tl.int32) & 1) == 1
            up = (fraction > 0.5) | ((fraction == 0.5) & odd)
        code = tl.minimum(tl.maximum(lower + up.to(tl.float32), -127.0), 127.0)
        code = tl.where(kept[:, None], code, 0.0)
        tl.store(codes_ptr + offsets, code.to(tl.int8), mask=mask)
    tl.store(scales_ptr + rows, tl.where(finite, absmax, float("nan")), mask=rows < blocks)


@triton.jit
def dequantize_kernel(
    codes_ptr,
    scales_ptr,
    n,
    blocks,
    out_ptr,
    BLOCK_SIZE: tl.constexpr,
    WIDTH: tl.constexpr,
    ROWS: tl.constexpr,
    SQRT: tl.constexpr,
):
    """float32 values of ``n`` codes in ``blocks`` blocks of ``BLOCK_SIZE`` (exact but for the
    one product with the scale)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    columns = tl.arange(0, WIDTH)
    offsets = rows[:, None] * BLOCK_SIZE + columns[None, :]
    mask = (columns[None, :] < BLOCK_SIZE) & (offsets < n)
    code = tl.load(codes_ptr + offsets, mask=mask, other=0).to(tl.float32)
    absmax = tl.load(scales_ptr + rows, mask=rows < blocks, other=0.0)
    if SQRT:
        root = (code + 1.0) * 0.00390625
        values = (root * root) * absmax[:, None]
    else:
        step = absmax * 0.007874015718698502  # float32(1 / 127), as the reference
        values = code * step[:, None]
    tl.store(out_ptr + offsets, values, mask=mask)


def tile(block_size: int, launch: _launch.LaunchConfig) -> tuple[int, int]:
    """``(WIDTH, ROWS)``: the block size rounded up to a power of two, and how many blocks one
    program handles so that a tile holds about ``launch.block`` elements."""
    width = triton.next_power_of_2(block_size)
    return width, max(1, launch.block // width)


def launch_arguments(
    x: jax.Array,
    *,
    block_size: int,
    mapping: str,
    words: jax.Array | None,
    launch: _launch.LaunchConfig = _launch.DEFAULT,
) -> tuple[tuple, dict, tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct], tuple[int]]:
    """The quantize kernel's arguments before the outputs, metaparameters, output types and grid.

    Shared by the jax-triton call and the interpreter tests, so both launch it the same way.
    """
    flat = x.reshape(-1)
    blocks = quantize_lib.num_blocks(flat.size, block_size)
    words_i32 = (
        jnp.zeros(2, jnp.int32)
        if words is None
        else jax.lax.bitcast_convert_type(words.astype(jnp.uint32), jnp.int32)
    )
    width, rows = tile(block_size, launch)
    metaparameters = {
        "BLOCK_SIZE": block_size,
        "WIDTH": width,
        "ROWS": rows,
        "SQRT": mapping == "sqrt",
        "STOCHASTIC": words is not None,
    }
    out_types = (
        jax.ShapeDtypeStruct((flat.size,), quantize_lib.CODE_DTYPES[mapping]),
        jax.ShapeDtypeStruct((blocks,), jnp.float32),
    )
    return (
        (flat, words_i32, flat.size, blocks),
        metaparameters,
        out_types,
        (triton.cdiv(blocks, rows),),
    )


def dequantize_arguments(
    codes: jax.Array,
    scales: jax.Array,
    *,
    block_size: int,
    mapping: str,
    launch: _launch.LaunchConfig = _launch.DEFAULT,
) -> tuple[tuple, dict, jax.ShapeDtypeStruct, tuple[int]]:
    """The dequantize kernel's arguments before the output, metaparameters, output type, grid."""
    flat = codes.reshape(-1)
    blocks = scales.shape[0]
    width, rows = tile(block_size, launch)
    metaparameters = {
        "BLOCK_SIZE": block_size,
        "WIDTH": width,
        "ROWS": rows,
        "SQRT": mapping == "sqrt",
    }
    out_type = jax.ShapeDtypeStruct((flat.size,), jnp.float32)
    return (flat, scales, flat.size, blocks), metaparameters, out_type, (triton.cdiv(blocks, rows),)


def quantize(
    x: jax.Array,
    *,
    block_size: int,
    mapping: str,
    words: jax.Array | None,
    launch: _launch.LaunchConfig = _launch.DEFAULT,
) -> tuple[jax.Array, jax.Array]:
    """:func:`triaccel_jax.kernels.quantize.quantize_blocks`'s Triton path on validated arguments.

    Returns:
      ``(codes, scales)``: codes shaped like ``x``, one float32 scale per block.
    """
    arguments, metaparameters, out_types, grid = launch_arguments(
        x, block_size=block_size, mapping=mapping, words=words, launch=launch
    )
    codes, scales = _jax_triton.triton_call(
        *arguments,
        kernel=quantize_kernel,
        out_type=out_types,
        grid=grid,
        num_warps=launch.num_warps,
        enable_fp_fusion=False,  # round like the reference: no a * b + c contracted to an FMA
        **metaparameters,
    )
    return codes.reshape(x.shape), scales


def dequantize(
    codes: jax.Array,
    scales: jax.Array,
    *,
    block_size: int,
    mapping: str,
    launch: _launch.LaunchConfig = _launch.DEFAULT,
) -> jax.Array:
    """:func:`triaccel_jax.kernels.quantize.dequantize_blocks`'s Triton path: float32 values
    shaped like ``codes``."""
    arguments, metaparameters, out_type, grid = dequantize_arguments(
        codes, scales, block_size=block_size, mapping=mapping, launch=launch
    )
    values = _jax_triton.triton_call(
        *arguments,
        kernel=dequantize_kernel,
        out_type=out_type,
        grid=grid,
        num_warps=launch.num_warps,
        enable_fp_fusion=False,
        **metaparameters,
    )
    return values.reshape(codes.shape)
