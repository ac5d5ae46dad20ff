"""Block-wise 8-bit quantization with per-block scales, round-to-nearest or stochastic.

An array is read flat (row-major) and cut into consecutive blocks of ``block_size`` elements
(the last one shorter); each block keeps one float32 scale, its absolute maximum, and each
element one byte (Dettmers et al., 2021, "8-bit Optimizers via Block-wise Quantization", arXiv
2110.02861: a scale per small block confines an outlier's damage to its own block, and the
blocks are independent, so every block is quantized in parallel). Two maps from values to codes:

* ``"linear"``, for signed values (Adam's first moment, a momentum): int8 codes ``c`` in
  [-127, 127] standing for ``c * absmax / 127``. Zero is a code, so a zero stays exactly zero.
* ``"sqrt"``, for non-negative values with a wide dynamic range (Adam's second moment): uint8
  codes ``c`` in [0, 255] standing for ``absmax * ((c + 1) / 256) ** 2``. The codes are linear
  in ``sqrt(v)``, the root-mean-square gradient that Adam divides by, so the denominator's
  error is uniform and the levels are dense near zero (the smallest is ``absmax / 65536``
  where a linear map's is ``absmax / 255``); and zero is *not* a level: a value below the
  smallest level is stored as that level. A second moment quantized to zero turns Adam's
  ``m / (sqrt(v) + eps)`` into ``m / eps``, the "zero-point problem" that Li et al., 2023
  ("Memory Efficient Optimizers with 4-bit States", arXiv 2309.01507) identify as what makes
  low-bit second moments unstable, and remove the same way (a map without zero).

Rounding to a code is to the nearest level or stochastic: the code above or below, the upper one
with probability equal to the distance from the lower one over their gap *in value*, so the
dequantized value is unbiased, ``E[dequantize(quantize(x))] = x`` for every ``x`` within the
levels (both maps; below the sqrt map's lowest level the value rounds up to it). An EMA
re-quantized every step drifts with a biased rounding and stalls with round-to-nearest when its
increments are smaller than half a level (Gupta et al., 2015); unbiased rounding keeps it
tracking. The random bits are a counter hash of the element's flat index keyed by the key's data
(two rounds of a 32-bit integer mix, :mod:`triaccel_jax.kernels._rounding`), computed the same
way by the Triton kernel: an optimizer stores its state at every step, and the cast kernel's
Philox, emulated with 16-bit products outside a GPU, cost more than the optimizer's own update.
:func:`fold_in` derives keys for steps and leaves with the same mix.

Special values: a block whose absolute maximum is NaN or infinite gets a NaN scale, so the whole
block dequantizes to NaN (a byte code has no NaN to keep; the failure stays visible rather than
being rounded to a finite value). A block whose absolute maximum is below ``2**-100`` (zeros, or
values that small) stores code 0 everywhere. XLA:CPU flushes float32 subnormals to zero in
arithmetic; GPUs and the kernels keep them, which can only change the codes of blocks whose
maximum is itself within a factor 2**26 of the subnormal range.

:func:`quantize_blocks` and :func:`dequantize_blocks` dispatch at trace time to the Triton
kernels (through jax-triton, on CUDA, where ``kernels/auto_table.json`` says they win) or to the
references :func:`quantize_blocks_reference` and :func:`dequantize_blocks_reference`, which are
the tested truth.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from triaccel_jax.kernels import _dispatch
from triaccel_jax.kernels import _rounding

MAPS = ("linear", "sqrt")
ROUNDING_MODES = _rounding.ROUNDING_MODES
IMPLS = _dispatch.IMPLS
CODE_DTYPES = {"linear": jnp.dtype(jnp.int8), "sqrt": jnp.dtype(jnp.uint8)}
LINEAR_MAX = 127  # int8 codes in [-127, 127]: symmetric, so -x quantizes to -code
SQRT_LEVELS = 256  # uint8 codes 0..255 for the levels (1/256)**2 .. 1 of the block's maximum
# Blocks whose absolute maximum is below this are stored as code 0: far below anything an
# optimizer's state holds, and far enough above float32's subnormals (2**-126) that no scaled
# value of a kept block depends on whether the platform flushes subnormals.
TINY = np.float32(2.0**-100)
HUGE = np.float32(2.0**64)
# The Triton kernels hold a block in one tile of the next power of two; larger blocks take the
# reference under impl="auto" (optimizers use 64 to 4096: Dettmers et al. use 2048).
KERNEL_MAX_BLOCK_SIZE = 8192


class Quantized(NamedTuple):
    """An array quantized block-wise.

    Attributes:
      codes: the byte codes, shaped like the original array: int8 for the ``"linear"`` map,
        uint8 for ``"sqrt"``.
      scales: float32, one per block of the flattened array (``ceil(size / block_size)``): the
        block's absolute maximum, NaN for a block holding NaN or infinity.
    """

    codes: jax.Array
    scales: jax.Array


def num_blocks(size: int, block_size: int) -> int:
    """How many blocks (and scales) an array of ``size`` elements takes.

    Example:
      >>> num_blocks(1000, 256)
      4
    """
    return -(-size // block_size)


def fold_in(key: jax.Array, data: Any) -> jax.Array:
    """New keys for :func:`quantize_blocks` from ``key`` and integers, in a few integer ops.

    The counterpart of ``jax.random.fold_in`` for this module's counter hash: ``key``'s data and
    the low 32 bits of ``data`` mixed into two words, where ``jax.random.fold_in`` runs Threefry
    (20 rounds; an optimizer that folds a step and a leaf index into its key per state leaf
    compiles seconds slower over a few hundred leaves with it). Distinct ``data`` give distinct
    keys; an array of ``data`` gives one key each, in one vectorized operation.

    Args:
      key: a typed PRNG key or uint32 key data (as :func:`quantize_blocks` takes).
      data: an integer, or an array of them (a step count, leaves' indices), traced or not.

    Returns:
      uint32 key data shaped ``jnp.shape(data) + (2,)``: keys that :func:`quantize_blocks` takes.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> key = jax.random.key(0)
      >>> fold_in(key, 1).dtype, bool(jnp.any(fold_in(key, 1) != fold_in(key, 2)))
      (dtype('uint32'), True)
      >>> fold_in(key, jnp.arange(3)).shape
      (3, 2)
    """
    return _rounding.fold_words(_rounding.key_words(key), data)


def random_bits(key: jax.Array, shape: Sequence[int]) -> jax.Array:
    """The uint32 random bits :func:`quantize_blocks` rounds with, one per element of ``shape``.

    The counter hash of each element's flat index under ``key``
    (:func:`triaccel_jax.kernels._rounding.counter_bits`): for another rounding that should be as
    cheap, e.g. an optimizer state stored in bfloat16 with
    :func:`triaccel_jax.kernels.cast.round_stochastic`.

    Args:
      key: a typed PRNG key or uint32 key data (as :func:`quantize_blocks` takes).
      shape: the shape of the array to round.

    Returns:
      uint32 bits of ``shape``; the same key gives the same bits.

    Example:
      >>> import jax
      >>> bits = random_bits(jax.random.key(0), (2, 3))
      >>> bits.dtype, bits.shape
      (dtype('uint32'), (2, 3))
    """
    return _rounding.counter_bits(_rounding.key_words(key), tuple(shape))


def check_block_size(block_size: Any) -> int:
    """``block_size`` as an int, or a ``ValueError``/``TypeError`` saying what it must be."""
    if isinstance(block_size, bool) or not isinstance(block_size, int | np.integer):
        raise TypeError(f"`block_size` must be an int >= 1, got {block_size!r}")
    block_size = operator.index(block_size)
    if block_size < 1:
        raise ValueError(f"`block_size` must be an int >= 1, got {block_size}")
    return block_size


def check_map(mapping: str) -> str:
    """``mapping`` if it is one of :data:`MAPS`, else a ``ValueError`` listing them."""
    if mapping not in MAPS:
        raise ValueError(f"`mapping` must be one of {MAPS}, got {mapping!r}")
    return mapping


def _validate_quantize(
    x: jax.Array, block_size: Any, mapping: str, rounding: str, key: jax.Array | None
) -> tuple[int, bool]:
    block_size = check_block_size(block_size)
    check_map(mapping)
    _rounding.check_rounding(rounding)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"`x` must be a floating-point array to quantize, got {x.dtype}")
    _rounding.check_size((num_blocks(x.size, block_size) * block_size,))
    needs_bits = rounding == "stochastic" and x.size > 0
    if needs_bits and key is None:
        raise ValueError("stochastic rounding needs a PRNG `key`")
    return block_size, needs_bits


def _validate_dequantize(
    codes: jax.Array, scales: jax.Array, block_size: Any, mapping: str, dtype: Any
) -> int:
    block_size = check_block_size(block_size)
    check_map(mapping)
    if codes.dtype != CODE_DTYPES[mapping]:
        raise ValueError(
            f"the {mapping!r} map's codes are {CODE_DTYPES[mapping].name}, got {codes.dtype}"
        )
    expected = (num_blocks(codes.size, block_size),)
    if scales.shape != expected or scales.dtype != jnp.float32:
        raise ValueError(
            f"`scales` must be float32{list(expected)} (one per block of {block_size}), got "
            f"{scales.dtype}{list(scales.shape)}"
        )
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"`dtype` must be a floating-point dtype, got {jnp.dtype(dtype)}")
    return block_size


def _as_blocks(x: jax.Array, block_size: int) -> jax.Array:
    """The flattened ``x`` padded with zeros to whole blocks, shaped ``(blocks, block_size)``."""
    flat = x.reshape(-1)
    padding = num_blocks(flat.size, block_size) * block_size - flat.size
    if padding:
        flat = lax.pad(flat, jnp.zeros((), flat.dtype), [(0, padding, 0)])
    return flat.reshape(-1, block_size)


def _from_blocks(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    flat = blocks.reshape(-1)
    size = math.prod(shape)
    return (flat if flat.size == size else flat[:size]).reshape(shape)


def _per_block(values: jax.Array, blocks: jax.Array) -> jax.Array:
    """One value per block broadcast over the block's elements."""
    return lax.broadcast_in_dim(values, blocks.shape, (0,))


def sqrt_level(code: jax.Array) -> jax.Array:
    """The ``"sqrt"`` map's level of a code, as a fraction of the block's maximum (exact).

    Example:
      >>> import jax.numpy as jnp
      >>> sqrt_level(jnp.array([0, 255], jnp.int32)).tolist()
      [1.52587890625e-05, 1.0]
    """
    root = (code.astype(jnp.float32) + np.float32(1)) * np.float32(1 / SQRT_LEVELS)  # exact
    return root * root  # exact: (code + 1)**2 <= 2**16 over 2**16


def _uniform(words: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """float32 uniforms on the grid ``k / 2**24``, from the top 24 of each element's hash bits."""
    bits = _rounding.counter_bits(words, shape)
    return (bits >> jnp.uint32(8)).astype(jnp.float32) * np.float32(2.0**-24)  # exact


def _quantize_reference(
    x: jax.Array, block_size: int, mapping: str, words: jax.Array | None
) -> Quantized:
    """The reference on validated arguments; ``words`` are the hash's key words (or None).

    Per element: a product with the block's reciprocal (computed once per block), a rounding to
    an integer and compares; the sqrt map adds a square root. The sqrt map decides whether to
    take the upper level by comparing distances in value, ``uniform * gap < x - low``
    (stochastic) or ``x - low >= gap / 2`` (nearest), rather than by dividing by the gap. Written
    in ``lax`` operations: an optimizer quantizes every state leaf, and ``jnp``'s wrappers
    (``where``, ``clip``) were each a nested function to trace and lower per leaf.
    """
    f32 = np.float32
    blocks = _as_blocks(x.astype(jnp.float32), block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=1)  # NaN if the block holds one
    finite = jnp.isfinite(absmax)
    kept = finite & (absmax >= TINY)
    # Blocks whose maximum is 2**64 or more are scaled by 2**-64 (exact) before the reciprocal,
    # which for a maximum above 2**126 would be a subnormal that XLA:CPU flushes to zero. The
    # linear map's factor * 127 / safe is a normal number for any finite maximum; the sqrt
    # map's factor / safe is not (2**-128 near float32's largest), so it scales x first.
    factor = lax.select(absmax >= HUGE, jnp.full_like(absmax, 1 / HUGE), jnp.ones_like(absmax))
    safe = lax.select(kept, absmax * factor, jnp.ones_like(absmax))
    zero = jnp.zeros(blocks.shape, jnp.int32)
    if mapping == "linear":
        # Level c stands for c * absmax / 127: x's position in levels, up to rounding.
        scaled = blocks * _per_block(factor * (f32(LINEAR_MAX) / safe), blocks)
        if words is None:
            code = lax.round(scaled, lax.RoundingMethod.TO_NEAREST_EVEN)
        else:
            lower = lax.floor(scaled)
            up = _uniform(words, blocks.shape) < scaled - lower
            code = lax.select(up, lower + f32(1), lower)
        code = lax.clamp(f32(-LINEAR_MAX), code, f32(LINEAR_MAX)).astype(jnp.int32)
        codes = lax.select(_per_block(kept, blocks), code, zero).astype(jnp.int8)
    else:
        ratio = lax.max(blocks * _per_block(factor, blocks), jnp.zeros_like(blocks))
        ratio = lax.min(ratio * _per_block(f32(1) / safe, blocks), jnp.ones_like(blocks))
        position = lax.sqrt(ratio) * f32(SQRT_LEVELS) - f32(1)  # in [-1, 255]
        # Truncation is the floor here: a negative position is clipped to code 0 either way.
        lower = lax.clamp(0, position.astype(jnp.int32), SQRT_LEVELS - 2)
        root = (lower + 1).astype(jnp.float32) * f32(1 / SQRT_LEVELS)  # exact
        distance = ratio - root * root  # to the level below, in value (not in sqrt); exact level
        gap = (lower * 2 + 3).astype(jnp.float32) * f32(2.0**-16)  # exact
        if words is None:
            up = distance >= gap * f32(0.5)  # to nearest, ties to the upper level
        else:
            # Below the lowest level the distance is negative: never up, the lowest level kept.
            up = _uniform(words, blocks.shape) * gap < distance
        code = lax.select(up, lower + 1, lower)
        codes = lax.select(_per_block(kept, blocks), code, zero).astype(jnp.uint8)
    scales = lax.select(finite, absmax, jnp.full_like(absmax, np.nan))
    return Quantized(_from_blocks(codes, x.shape), scales)


def _dequantize_reference(
    codes: jax.Array, scales: jax.Array, block_size: int, mapping: str, dtype: jnp.dtype
) -> jax.Array:
    blocks = _as_blocks(codes, block_size)
    if mapping == "linear":
        step = _per_block(scales * np.float32(1 / LINEAR_MAX), blocks)
        values = blocks.astype(jnp.float32) * step
    else:
        values = sqrt_level(blocks) * _per_block(scales, blocks)
    return _from_blocks(values, codes.shape).astype(dtype)


def quantize_blocks_reference(
    x: jax.Array,
    *,
    block_size: int = 256,
    mapping: str = "linear",
    rounding: str = "nearest",
    key: jax.Array | None = None,
) -> Quantized:
    """Quantizes ``x`` block-wise to one byte per element (the pure-JAX reference).

    Args:
      x: a floating-point array (computed in float32).
      block_size: elements per block (any int >= 1; the last block may be shorter).
      mapping: ``"linear"`` (signed values, int8 codes) or ``"sqrt"`` (non-negative values,
        uint8 codes, no zero level; negative values are stored as the lowest level), as the
        module docstring describes.
      rounding: ``"nearest"`` or ``"stochastic"`` (unbiased in value).
      key: a PRNG key (typed, or uint32 key data such as :func:`fold_in` returns), required for
        stochastic rounding; the same key gives the same codes.

    Returns:
      A :class:`Quantized`: codes shaped like ``x`` and one float32 scale per block.

    Raises:
      TypeError: ``block_size`` is not an int.
      ValueError: ``block_size`` < 1, an unknown ``mapping`` or ``rounding``, a non-float ``x``,
        stochastic rounding without ``key``, or 2**31 elements or more.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from triaccel_jax.kernels.quantize import quantize_blocks_reference
      >>> q = quantize_blocks_reference(jnp.array([0.5, -1.0, 0.25, 2.0]), block_size=2)
      >>> q.codes.tolist(), q.scales.tolist()
      ([64, -127, 16, 127], [1.0, 2.0])
    """
    block_size, needs_bits = _validate_quantize(x, block_size, mapping, rounding, key)
    words = None
    if needs_bits:
        assert key is not None  # _validate_quantize refuses needs_bits without a key
        words = _rounding.key_words(key)
    return _quantize_reference(x, block_size, mapping, words)


def dequantize_blocks_reference(
    codes: jax.Array,
    scales: jax.Array,
    *,
    block_size: int = 256,
    mapping: str = "linear",
    dtype: Any = jnp.float32,
) -> jax.Array:
    """The values that block-wise codes stand for (the pure-JAX reference).

    Args:
      codes: int8 (``"linear"``) or uint8 (``"sqrt"``) codes, any shape.
      scales: float32, one per block of the flattened codes.
      block_size: elements per block, as quantized.
      mapping: the map they were quantized with.
      dtype: the floating-point dtype of the result (computed in float32).

    Returns:
      An array shaped like ``codes``: ``code * scale / 127`` (linear) or
      ``scale * ((code + 1) / 256) ** 2`` (sqrt).

    Raises:
      TypeError, ValueError: as :func:`quantize_blocks_reference`, or codes of the wrong dtype
        for ``mapping`` or scales of the wrong shape.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.kernels.quantize import dequantize_blocks_reference
      >>> codes = jnp.array([64, -127, 16, 127], jnp.int8)
      >>> dequantize_blocks_reference(codes, jnp.array([127.0, 254.0]), block_size=2).tolist()
      [64.0, -127.0, 32.0, 254.0]
    """
    block_size = _validate_dequantize(codes, scales, block_size, mapping, dtype)
    return _dequantize_reference(codes, scales, block_size, mapping, jnp.dtype(dtype))


def _kernel_or_reference(impl: str, kernel: str, op: str, block_size: int) -> str:
    """``"triton"`` or ``"reference"``, as :func:`_dispatch.resolve`, for a block size the kernel
    holds in one tile; a larger one takes the reference under ``"auto"`` and is refused by
    ``"triton"``."""
    use = _dispatch.resolve(impl, kernel, op)
    if use == "triton" and block_size > KERNEL_MAX_BLOCK_SIZE:
        if impl == "triton":
            raise ValueError(
                f"impl='triton': the {kernel} kernel takes blocks of at most "
                f"{KERNEL_MAX_BLOCK_SIZE} elements, got block_size={block_size}"
            )
        return "reference"
    return use


def quantize_blocks(
    x: jax.Array,
    *,
    block_size: int = 256,
    mapping: str = "linear",
    rounding: str = "nearest",
    key: jax.Array | None = None,
    impl: str = "auto",
) -> Quantized:
    """Quantizes ``x`` block-wise through the Triton kernel or the reference.

    The implementation is chosen when the call is traced, as for the cast kernel
    (:func:`triaccel_jax.kernels.cast.cast`): ``impl="auto"`` runs the Triton kernel only on a
    CUDA backend with jax_triton where ``kernels/auto_table.json`` says ``"triton"`` for
    :func:`triaccel_jax.kernels._dispatch.quantize_op`, and
    :func:`quantize_blocks_reference` (compiled by XLA) elsewhere. Both draw the same random
    bits for a key and agree bit for bit under the Triton interpreter.

    Args:
      x: a floating-point array.
      block_size: elements per block.
      mapping: ``"linear"`` or ``"sqrt"``.
      rounding: ``"nearest"`` or ``"stochastic"``.
      key: a PRNG key, required for stochastic rounding.
      impl: ``"auto"``, ``"reference"`` or ``"triton"``.

    Returns:
      A :class:`Quantized`, as :func:`quantize_blocks_reference` describes.

    Raises:
      TypeError, ValueError: as :func:`quantize_blocks_reference`, or an unknown ``impl``.
      RuntimeError: ``impl="triton"`` where Triton cannot run.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from triaccel_jax.kernels.quantize import dequantize_blocks, quantize_blocks
      >>> x = jnp.linspace(-1.0, 1.0, 1000)
      >>> q = quantize_blocks(x, block_size=256, rounding="stochastic", key=jax.random.key(0))
      >>> q.codes.dtype, q.scales.shape
      (dtype('int8'), (4,))
      >>> back = dequantize_blocks(q.codes, q.scales, block_size=256)
      >>> bool(jnp.max(jnp.abs(back - x)) <= 1 / 127)
      True
    """
    block_size, needs_bits = _validate_quantize(x, block_size, mapping, rounding, key)
    use = _kernel_or_reference(
        impl, "quantize", _dispatch.quantize_op(mapping, rounding), block_size
    )
    words = None
    if needs_bits:
        assert key is not None  # _validate_quantize refuses needs_bits without a key
        words = _rounding.key_words(key)
    if use == "triton" and x.size > 0:
        from triaccel_jax.kernels import _quantize_triton  # lazy: imports triton

        launch = _dispatch.launch_config(_dispatch.quantize_op(mapping, rounding))
        return Quantized(
            *_quantize_triton.quantize(
                x, block_size=block_size, mapping=mapping, words=words, launch=launch
            )
        )
    return _quantize_reference(x, block_size, mapping, words)


def dequantize_blocks(
    codes: jax.Array,
    scales: jax.Array,
    *,
    block_size: int = 256,
    mapping: str = "linear",
    dtype: Any = jnp.float32,
    impl: str = "auto",
) -> jax.Array:
    """The values that block-wise codes stand for, through the Triton kernel or the reference.

    Args:
      codes: int8 (``"linear"``) or uint8 (``"sqrt"``) codes.
      scales: float32, one per block.
      block_size: elements per block, as quantized.
      mapping: the map they were quantized with.
      dtype: the floating-point dtype of the result.
      impl: ``"auto"``, ``"reference"`` or ``"triton"`` (dispatched as :func:`quantize_blocks`,
        on :func:`triaccel_jax.kernels._dispatch.dequantize_op`).

    Returns:
      An array shaped like ``codes``, as :func:`dequantize_blocks_reference` describes.

    Raises:
      TypeError, ValueError: as :func:`dequantize_blocks_reference`, or an unknown ``impl``.
      RuntimeError: ``impl="triton"`` where Triton cannot run.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.kernels.quantize import dequantize_blocks
      >>> codes = jnp.array([0, 255], jnp.uint8)
      >>> dequantize_blocks(codes, jnp.array([65536.0]), mapping="sqrt").tolist()
      [1.0, 65536.0]
    """
    block_size = _validate_dequantize(codes, scales, block_size, mapping, dtype)
    dtype = jnp.dtype(dtype)
    use = _kernel_or_reference(impl, "dequantize", _dispatch.dequantize_op(mapping), block_size)
    if use == "triton" and codes.size > 0:
        from triaccel_jax.kernels import _quantize_triton  # lazy: imports triton

        launch = _dispatch.launch_config(_dispatch.dequantize_op(mapping))
        values = _quantize_triton.dequantize(
            codes, scales, block_size=block_size, mapping=mapping, launch=launch
        )
        return values.astype(dtype)
    return _dequantize_reference(codes, scales, block_size, mapping, dtype)
