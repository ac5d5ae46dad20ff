"""Block-wise 8-bit and 4-bit quantization with per-block scales, to nearest or stochastic.

An array is cut into blocks of ``block_size`` elements; each block keeps one float32 scale, its
absolute maximum, and each element one byte, or half a byte under a 4-bit map (Dettmers et al.,
2021, "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861: a scale per small block
confines an outlier's damage to its own block, and the blocks are independent, so every block is
quantized in parallel). Two layouts of the blocks:

* ``layout="flat"`` (the default): the array read flat (row-major) and cut into consecutive
  blocks, the last one shorter; ``ceil(size / block_size)`` scales.
* ``layout="rows"``: blocks cut within each row of the last axis, each row's last block shorter
  where the block size does not divide it (no padding is stored); scales shaped
  ``shape[:-1] + (ceil(shape[-1] / block_size),)``. Codes and scales then keep the array's
  leading axes, so under a sharding of those axes (FSDP's ``P("fsdp", None)``) each device
  quantizes its own rows and XLA adds no collective; blocks of a flat array straddle shards.
  A last axis that is itself sharded (tensor parallelism) stays local when the block size
  divides each shard's extent; under Explicit mesh axes another block size is refused.

Maps from values to codes, as fractions of the block's scale (:func:`levels` lists them):

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
* ``"dynamic"`` and ``"dynamic_unsigned"``: bitsandbytes' (and torchao's) dynamic-exponent
  maps of 256 levels, signed for first moments and unsigned *without zero* for second moments;
  each decade from ``1e-6`` to 1 of the scale gets levels of its own, so a block that spans
  several orders of magnitude keeps its small entries where the linear map rounds them to 0.
  uint8 codes, the index of the level.
* ``"dynamic4"`` and ``"linear4_unsigned"``: Li et al.'s 4-bit maps, the signed dynamic-exponent
  map for first moments (blocks of 128 in their work) and the zero-free linear map ``(i + 1) /
  16`` for second moments (with rank-1 normalisation, :func:`quantize_rank1`). Their codes are
  packed two per byte (:func:`pack_nibbles`): flat, ``ceil(size / 2)`` bytes, under
  ``layout="flat"``; along the last axis under ``layout="rows"``. A packed array cannot tell an
  odd from an even count, so dequantizing takes the ``shape``.

The table maps' levels and their search are :mod:`triaccel_jax.kernels._quantize_maps`;
:func:`stored_bytes`, :func:`codes_shape` and :func:`scales_shape` give what an array takes.

Rounding to a code is to the nearest level or stochastic: the code above or below, the upper one
with probability equal to the distance from the lower one over their gap *in value*, so the
dequantized value is unbiased, ``E[dequantize(quantize(x))] = x`` for every ``x`` within the
levels (every map; below an unsigned map's lowest level, or the signed dynamic maps' lowest,
the value rounds up to it). An EMA re-quantized every step drifts with a biased rounding and
stalls with round-to-nearest when its increments are smaller than half a level (Gupta et al.,
2015); unbiased rounding keeps it tracking. The random bits are a counter hash of the element's
flat index keyed by the key's data (two rounds of a 32-bit integer mix,
:mod:`triaccel_jax.kernels._rounding`), the same for an element under either layout and
computed the same way by the Triton kernel: an optimizer stores its state at every step, and the
cast kernel's Philox, emulated with 16-bit products outside a GPU, cost more than the
optimizer's own update. :func:`fold_in` derives keys for steps and leaves with the same mix.

Special values: a block whose absolute maximum is NaN or infinite gets a NaN scale, so the whole
block dequantizes to NaN (a byte code has no NaN to keep; the failure stays visible rather than
being rounded to a finite value). A block whose absolute maximum is below ``2**-100`` (zeros, or
values that small) stores the code of the level nearest zero everywhere (code 0 for every map but
the signed table maps). XLA:CPU flushes float32 subnormals to zero in arithmetic; GPUs and the
kernels keep them, which can only change the codes of blocks whose maximum is itself within a
factor 2**26 of the subnormal range.

:func:`quantize_blocks` and :func:`dequantize_blocks` dispatch at trace time to the Triton
kernels (through jax-triton, on CUDA, where ``kernels/auto_table.json`` says they win) or to the
references :func:`quantize_blocks_reference` and :func:`dequantize_blocks_reference`, which are
the tested truth. The kernels implement the ``"linear"`` and ``"sqrt"`` maps with
``layout="flat"``; the table maps and the rows layout always run the reference (XLA compiles
and partitions it), and ``impl="triton"`` refuses them.
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
from triaccel_jax.kernels import _quantize_maps
from triaccel_jax.kernels import _rounding

MAPS = ("linear", "sqrt")  # the closed-form 8-bit maps, which the Triton kernels implement too
KERNEL_MAPS = MAPS
TABLE_MAPS = tuple(_quantize_maps.TABLE_MAPS)  # "dynamic", "dynamic_unsigned", "dynamic4", ...
ALL_MAPS = MAPS + TABLE_MAPS
MAP_BITS = {
    "linear": 8,
    "sqrt": 8,
    **{name: info.bits for name, info in _quantize_maps.TABLE_MAPS.items()},
}
LAYOUTS = ("flat", "rows")
ROUNDING_MODES = _rounding.ROUNDING_MODES
IMPLS = _dispatch.IMPLS
CODE_DTYPES = {
    "linear": jnp.dtype(jnp.int8),
    "sqrt": jnp.dtype(jnp.uint8),
    # The table maps' codes are indices into their sorted levels; 4-bit ones two to a byte.
    **{name: jnp.dtype(jnp.uint8) for name in TABLE_MAPS},
}
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
      codes: the codes: int8 for the ``"linear"`` map, uint8 for the others. 8-bit codes are
        shaped like the original array; 4-bit ones are packed two per byte
        (:func:`pack_nibbles`), flat (``ceil(size / 2)`` bytes) under ``layout="flat"`` and
        along the last axis (``shape[:-1] + (ceil(shape[-1] / 2),)``) under ``layout="rows"``.
      scales: float32, one per block, the block's absolute maximum (NaN for a block holding NaN
        or infinity): ``(ceil(size / block_size),)`` blocks of the flattened array under
        ``layout="flat"``, ``shape[:-1] + (ceil(shape[-1] / block_size),)`` under
        ``layout="rows"`` (:func:`scales_shape`).
    """

    codes: jax.Array
    scales: jax.Array


class Rank1Quantized(NamedTuple):
    """A 2-D array quantized with rank-1 normalisation (:func:`quantize_rank1`).

    Attributes:
      codes: uint8 codes, shaped like the array (8-bit maps) or packed two per byte along the
        last axis (4-bit maps).
      row_scales: float32, each row's absolute maximum (NaN for a row holding NaN or infinity).
      column_scales: float32, each column's absolute maximum (likewise).
    """

    codes: jax.Array
    row_scales: jax.Array
    column_scales: jax.Array


def num_blocks(size: int, block_size: int) -> int:
    """How many blocks (and scales) an array of ``size`` elements takes.

    Example:
      >>> num_blocks(1000, 256)
      4
    """
    return -(-size // block_size)


def levels(mapping: str) -> np.ndarray:
    """The sorted float32 levels of a map, as fractions of a block's scale.

    For the table maps (:data:`TABLE_MAPS`) a code is the index of its level here; the
    ``"linear"`` map's code ``c`` is level ``c + 127`` and the ``"sqrt"`` map's code ``c`` is
    level ``c``.

    Args:
      mapping: a name in :data:`ALL_MAPS`.

    Returns:
      A read-only float32 array: 255 levels (``"linear"``), 256 (the other 8-bit maps) or 16
      (4-bit maps).

    Raises:
      ValueError: an unknown ``mapping``.

    Example:
      >>> levels("linear4_unsigned")[:3].tolist(), levels("dynamic").size
      ([0.0625, 0.125, 0.1875], 256)

    References:
      Dettmers et al., 2022, "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861;
      Li et al., 2023, "Memory Efficient Optimizers with 4-bit States", arXiv 2309.01507.
    """
    check_map(mapping)
    if mapping == "linear":
        table = (np.arange(-LINEAR_MAX, LINEAR_MAX + 1) * np.float32(1 / LINEAR_MAX)).astype(
            np.float32
        )
    elif mapping == "sqrt":
        table = np.asarray(sqrt_level(jnp.arange(SQRT_LEVELS, dtype=jnp.int32)))
    else:
        return _quantize_maps.LEVELS[mapping]
    table.setflags(write=False)
    return table


def scales_shape(shape: Sequence[int], block_size: int, layout: str = "flat") -> tuple[int, ...]:
    """The shape of the scales an array of ``shape`` is quantized with.

    Args:
      shape: the array's shape.
      block_size: elements per block.
      layout: ``"flat"`` (blocks of the flattened array) or ``"rows"`` (blocks along the last
        axis, each row's last block possibly shorter).

    Returns:
      ``(ceil(size / block_size),)``, or ``shape[:-1] + (ceil(shape[-1] / block_size),)``.

    Raises:
      ValueError: an unknown ``layout``, or ``layout="rows"`` for a scalar.

    Example:
      >>> scales_shape((1000, 1000), 256), scales_shape((1000, 1000), 256, layout="rows")
      ((3907,), (1000, 4))
    """
    shape = tuple(shape)
    block_size = check_block_size(block_size)
    check_layout(layout, shape)
    if layout == "flat":
        return (num_blocks(math.prod(shape), block_size),)
    return (*shape[:-1], num_blocks(shape[-1], block_size))


def codes_shape(shape: Sequence[int], mapping: str, layout: str = "flat") -> tuple[int, ...]:
    """The shape of the codes an array of ``shape`` is stored as.

    Args:
      shape: the array's shape.
      mapping: a name in :data:`ALL_MAPS`.
      layout: ``"flat"`` or ``"rows"``.

    Returns:
      ``shape`` for 8-bit maps; for 4-bit maps (two codes per byte) ``(ceil(size / 2),)``
      under ``layout="flat"`` and ``shape[:-1] + (ceil(shape[-1] / 2),)`` under
      ``layout="rows"``.

    Example:
      >>> codes_shape((3, 5), "dynamic"), codes_shape((3, 5), "dynamic4")
      ((3, 5), (8,))
      >>> codes_shape((3, 5), "dynamic4", layout="rows")
      (3, 3)
    """
    shape = tuple(shape)
    check_map(mapping)
    check_layout(layout, shape)
    if MAP_BITS[mapping] == 8:
        return shape
    if layout == "flat":
        return (-(-math.prod(shape) // 2),)
    return (*shape[:-1], -(-shape[-1] // 2))


def stored_bytes(
    shape: Sequence[int], *, block_size: int, mapping: str, layout: str = "flat"
) -> int:
    """The bytes an array of ``shape`` takes quantized: its codes and its float32 scales.

    Args:
      shape: the array's shape.
      block_size: elements per block.
      mapping: a name in :data:`ALL_MAPS`.
      layout: ``"flat"`` or ``"rows"``.

    Returns:
      ``prod(codes_shape) + 4 * prod(scales_shape)``.

    Example:
      >>> stored_bytes((1024, 256), block_size=256, mapping="dynamic")  # 1 + 4 / 256 per element
      266240
      >>> stored_bytes((1024, 256), block_size=128, mapping="dynamic4")  # 0.5 + 4 / 128
      139264
    """
    codes = math.prod(codes_shape(shape, mapping, layout))
    return codes + 4 * math.prod(scales_shape(shape, block_size, layout))


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
    """``mapping`` if it is one of :data:`ALL_MAPS`, else a ``ValueError`` listing them."""
    if mapping not in ALL_MAPS:
        raise ValueError(f"`mapping` must be one of {ALL_MAPS}, got {mapping!r}")
    return mapping


def check_layout(layout: str, shape: tuple[int, ...] = (1,)) -> str:
    """``layout`` if it is one of :data:`LAYOUTS` (and ``"rows"`` has a last axis to cut)."""
    if layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {LAYOUTS}, got {layout!r}")
    if layout == "rows" and len(shape) == 0:
        raise ValueError(
            "layout='rows' cuts blocks along the last axis, and a scalar has none: use "
            "layout='flat'"
        )
    return layout


def _validate_quantize(
    x: jax.Array,
    block_size: Any,
    mapping: str,
    rounding: str,
    key: jax.Array | None,
    layout: str = "flat",
) -> tuple[int, bool]:
    block_size = check_block_size(block_size)
    check_map(mapping)
    _rounding.check_rounding(rounding)
    check_layout(layout, x.shape)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"`x` must be a floating-point array to quantize, got {x.dtype}")
    _rounding.check_size((num_blocks(x.size, block_size) * block_size,))
    if layout == "rows":
        _rounding.check_size((*scales_shape(x.shape, block_size, layout), block_size))
    if layout == "rows":
        _check_row_shards(x, x.shape[-1], block_size, mapping)
    needs_bits = rounding == "stochastic" and x.size > 0
    if needs_bits and key is None:
        raise ValueError("stochastic rounding needs a PRNG `key`")
    return block_size, needs_bits


def _validate_dequantize(
    codes: jax.Array,
    scales: jax.Array,
    block_size: Any,
    mapping: str,
    dtype: Any,
    layout: str = "flat",
    shape: Sequence[int] | None = None,
) -> tuple[int, tuple[int, ...]]:
    """The block size and the shape of the values the codes stand for, or an error naming what
    does not fit."""
    block_size = check_block_size(block_size)
    check_map(mapping)
    if codes.dtype != CODE_DTYPES[mapping]:
        raise ValueError(
            f"the {mapping!r} map's codes are {CODE_DTYPES[mapping].name}, got {codes.dtype}"
        )
    if shape is None:
        if MAP_BITS[mapping] == 4:
            raise ValueError(
                f"the {mapping!r} map's codes are packed two per byte, so an odd and an even "
                "number of elements give the same bytes: pass `shape`, the shape quantized"
            )
        shape = codes.shape
    shape = tuple(operator.index(n) for n in shape)
    check_layout(layout, shape)
    expected_codes = codes_shape(shape, mapping, layout)
    if codes.shape != expected_codes:
        packed = " (4-bit codes, two per byte)" if MAP_BITS[mapping] == 4 else ""
        raise ValueError(
            f"codes of an array of shape {shape} under layout={layout!r} are shaped "
            f"{expected_codes}{packed}, got {codes.shape}"
        )
    expected = scales_shape(shape, block_size, layout)
    if scales.shape != expected or scales.dtype != jnp.float32:
        raise ValueError(
            f"`scales` must be float32{list(expected)} (one per block of {block_size}), got "
            f"{scales.dtype}{list(scales.shape)}"
        )
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"`dtype` must be a floating-point dtype, got {jnp.dtype(dtype)}")
    if layout == "rows":
        _check_row_shards(codes, shape[-1], block_size, mapping)
    return block_size, shape


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


def _as_row_blocks(x: jax.Array, block_size: int) -> jax.Array:
    """``x`` with its last axis padded with zeros to whole blocks and cut into them:
    ``x.shape[:-1] + (blocks per row, block_size)``. The leading axes are left as they are, so
    a shard of rows holds its own blocks whole. A row shorter than the block is one block of
    its own length (the same one scale; no padded copy of the array)."""
    length = x.shape[-1]
    block_size = min(block_size, max(length, 1))
    blocks = num_blocks(length, block_size)
    padding = blocks * block_size - length
    if padding:
        config = [(0, 0, 0)] * (x.ndim - 1) + [(0, padding, 0)]
        x = lax.pad(x, jnp.zeros((), x.dtype), config)
    return x.reshape((*x.shape[:-1], blocks, block_size))


def _from_row_blocks(blocks: jax.Array, length: int) -> jax.Array:
    """The inverse of :func:`_as_row_blocks`: rows of ``length`` elements, the padding cut."""
    rows = blocks.reshape((*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1]))
    return rows if rows.shape[-1] == length else rows[..., :length]


def _per_block(values: jax.Array, blocks: jax.Array) -> jax.Array:
    """One value per block broadcast over the block's elements (the last axis of ``blocks``)."""
    return lax.broadcast_in_dim(
        values, blocks.shape, tuple(range(values.ndim)), out_sharding=_explicit(blocks)
    )


def _explicit(x: jax.Array) -> Any:
    return _quantize_maps.explicit_sharding(x)


def _check_row_shards(array: jax.Array, length: int, block_size: int, mapping: str) -> None:
    """Refuses a ``layout="rows"`` array whose last axis is split over Explicit mesh axes at
    places where a block (or, for 4-bit codes, a byte) would cross from one shard to the next.

    Under Explicit axes the array's type says how its last axis is split; blocks that cross a
    shard's edge cannot be cut without moving data between devices, which JAX refuses in a
    reshape. Under Auto axes XLA decides later and inserts the collectives instead.

    Args:
      array: the array quantized, or its codes.
      length: the length of the quantized array's last axis.
      block_size: elements per block.
      mapping: the map (4-bit codes pair neighbouring elements into a byte).
    """
    sharding = _explicit(array)
    if sharding is None or array.ndim == 0:
        return
    spec = tuple(sharding.spec)
    entry = spec[array.ndim - 1] if len(spec) >= array.ndim else None
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    explicit = {
        name
        for name, kind in zip(sharding.mesh.axis_names, sharding.mesh.axis_types, strict=True)
        if kind == jax.sharding.AxisType.Explicit
    }
    shards = math.prod(sharding.mesh.shape[name] for name in names if name in explicit)
    if shards == 1:
        return
    local, rest = divmod(length, shards)
    fits = rest == 0 and local % block_size == 0
    if MAP_BITS[mapping] == 4:
        fits = fits and local % 2 == 0  # two codes a byte: a byte must not cross a shard's edge
    if not fits:
        raise ValueError(
            f"layout='rows': the last axis ({length} elements) is split {shards} ways over the "
            f"mesh axes {names}, so blocks of {block_size} would cross from one shard to the "
            f"next; use a block size that divides each shard's {length / shards:g} elements"
            + (" (and is even, for 4-bit codes)" if MAP_BITS[mapping] == 4 else "")
            + ", or shard the leading axes instead"
        )


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


def _uniform_like(words: jax.Array, x: jax.Array) -> jax.Array:
    """:func:`_uniform` of ``x``'s shape, each device computing its shard's own."""
    bits = _rounding.counter_bits_like(words, x.shape, _explicit(x))
    return (bits >> jnp.uint32(8)).astype(jnp.float32) * np.float32(2.0**-24)  # exact


def _quantize_block_array(
    blocks: jax.Array, mapping: str, uniform: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Codes and scales of float32 ``blocks`` shaped ``(..., block_size)``: one block per row
    of the last axis; ``uniform`` (shaped like ``blocks``) for stochastic rounding, else None.

    Per element: a product with the block's reciprocal (computed once per block), a rounding to
    an integer and compares; the sqrt map adds a square root, a table map a search of its
    levels. The sqrt map decides whether to take the upper level by comparing distances in value,
    ``uniform * gap < x - low`` (stochastic) or ``x - low >= gap / 2`` (nearest), rather than by
    dividing by the gap. Written in ``lax`` operations: an optimizer quantizes every state leaf,
    and ``jnp``'s wrappers (``where``, ``clip``) were each a nested function to trace and lower
    per leaf.
    """
    f32 = np.float32
    absmax = jnp.max(jnp.abs(blocks), axis=-1)  # NaN if the block holds one
    finite = jnp.isfinite(absmax)
    kept = finite & (absmax >= TINY)
    # Blocks whose maximum is 2**64 or more are scaled by 2**-64 (exact) before the reciprocal,
    # which for a maximum above 2**126 would be a subnormal that XLA:CPU flushes to zero. The
    # linear map's factor * 127 / safe is a normal number for any finite maximum; the sqrt
    # map's factor / safe is not (2**-128 near float32's largest), so it scales x first.
    factor = lax.select(absmax >= HUGE, jnp.full_like(absmax, 1 / HUGE), jnp.ones_like(absmax))
    safe = lax.select(kept, absmax * factor, jnp.ones_like(absmax))
    zero = jnp.zeros(blocks.shape, jnp.int32, out_sharding=_explicit(blocks))
    if mapping == "linear":
        # Level c stands for c * absmax / 127: x's position in levels, up to rounding.
        scaled = blocks * _per_block(factor * (f32(LINEAR_MAX) / safe), blocks)
        if uniform is None:
            code = lax.round(scaled, lax.RoundingMethod.TO_NEAREST_EVEN)
        else:
            lower = lax.floor(scaled)
            up = uniform < scaled - lower
            code = lax.select(up, lower + f32(1), lower)
        code = lax.clamp(f32(-LINEAR_MAX), code, f32(LINEAR_MAX)).astype(jnp.int32)
        codes = lax.select(_per_block(kept, blocks), code, zero).astype(jnp.int8)
    elif mapping == "sqrt":
        ratio = lax.max(blocks * _per_block(factor, blocks), jnp.zeros_like(blocks))
        ratio = lax.min(ratio * _per_block(f32(1) / safe, blocks), jnp.ones_like(blocks))
        position = lax.sqrt(ratio) * f32(SQRT_LEVELS) - f32(1)  # in [-1, 255]
        # Truncation is the floor here: a negative position is clipped to code 0 either way.
        lower = lax.clamp(0, position.astype(jnp.int32), SQRT_LEVELS - 2)
        root = (lower + 1).astype(jnp.float32) * f32(1 / SQRT_LEVELS)  # exact
        distance = ratio - root * root  # to the level below, in value (not in sqrt); exact level
        gap = (lower * 2 + 3).astype(jnp.float32) * f32(2.0**-16)  # exact
        if uniform is None:
            up = distance >= gap * f32(0.5)  # to nearest, ties to the upper level
        else:
            # Below the lowest level the distance is negative: never up, the lowest level kept.
            up = uniform * gap < distance
        code = lax.select(up, lower + 1, lower)
        codes = lax.select(_per_block(kept, blocks), code, zero).astype(jnp.uint8)
    else:
        # The value over the block's maximum, in [-1, 1] (clamped: the float32 product of a
        # value and a reciprocal can pass 1 by an ulp); its code is a search of the levels.
        ratio = (blocks * _per_block(factor, blocks)) * _per_block(f32(1) / safe, blocks)
        ratio = lax.clamp(f32(-1), ratio, f32(1))
        code = _quantize_maps.codes(mapping, ratio, uniform)
        zero = lax.full_like(zero, _quantize_maps.zero_code(mapping))
        codes = lax.select(_per_block(kept, blocks), code, zero).astype(jnp.uint8)
    scales = lax.select(finite, absmax, jnp.full_like(absmax, np.nan))
    return codes, scales


def _quantize_reference(
    x: jax.Array,
    block_size: int,
    mapping: str,
    words: jax.Array | None,
    layout: str = "flat",
) -> Quantized:
    """The reference on validated arguments; ``words`` are the hash's key words (or None)."""
    x = x.astype(jnp.float32)
    if layout == "flat":
        blocks = _as_blocks(x, block_size)
        uniform = None if words is None else _uniform(words, blocks.shape)
        codes, scales = _quantize_block_array(blocks, mapping, uniform)
        codes = _from_blocks(codes, x.shape)
        if MAP_BITS[mapping] == 4:
            codes = pack_nibbles(codes.reshape(-1))
        return Quantized(codes, scales)
    # The same bits for an element as under the flat layout (the counter hash of its flat
    # index), so a last axis that the block size divides gives the flat layout's codes.
    uniform = None if words is None else _as_row_blocks(_uniform_like(words, x), block_size)
    codes, scales = _quantize_block_array(_as_row_blocks(x, block_size), mapping, uniform)
    codes = _from_row_blocks(codes, x.shape[-1])
    if MAP_BITS[mapping] == 4:
        codes = pack_nibbles(codes)
    return Quantized(codes, scales)


def _dequantize_block_array(codes: jax.Array, scales: jax.Array, mapping: str) -> jax.Array:
    """float32 values of ``codes`` shaped ``(..., block_size)``, one scale per block."""
    if mapping == "linear":
        step = _per_block(scales * np.float32(1 / LINEAR_MAX), codes)
        return codes.astype(jnp.float32) * step
    if mapping == "sqrt":
        return sqrt_level(codes) * _per_block(scales, codes)
    return _quantize_maps.values(mapping, codes) * _per_block(scales, codes)


def _dequantize_reference(
    codes: jax.Array,
    scales: jax.Array,
    block_size: int,
    mapping: str,
    dtype: jnp.dtype,
    layout: str = "flat",
    shape: tuple[int, ...] | None = None,
) -> jax.Array:
    shape = codes.shape if shape is None else shape
    if layout == "flat":
        if MAP_BITS[mapping] == 4:
            codes = unpack_nibbles(codes, math.prod(shape))
        values = _dequantize_block_array(_as_blocks(codes, block_size), scales, mapping)
        return _from_blocks(values, shape).astype(dtype)
    if MAP_BITS[mapping] == 4:
        codes = unpack_nibbles(codes, shape[-1])
    blocks = _as_row_blocks(codes, block_size)
    values = _dequantize_block_array(blocks, scales, mapping)
    return _from_row_blocks(values, shape[-1]).astype(dtype)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """4-bit codes packed two per byte along the last axis: ``ceil(n / 2)`` bytes for ``n``.

    Element ``2k`` of a row goes to the high nibble of byte ``k`` and element ``2k + 1`` to its
    low nibble (bitsandbytes' and torchao's order); an odd last element leaves a zero low nibble.

    Args:
      codes: uint8 codes in [0, 15], any shape with at least one axis.

    Returns:
      uint8 bytes shaped ``codes.shape[:-1] + (ceil(codes.shape[-1] / 2),)``.

    Raises:
      ValueError: codes that are not uint8 or a scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> pack_nibbles(jnp.array([1, 2, 15], jnp.uint8)).tolist()
      [18, 240]
    """
    if codes.dtype != jnp.uint8 or codes.ndim == 0:
        raise ValueError(
            f"4-bit codes to pack must be a uint8 array with an axis, got {codes.dtype}"
            f"{list(codes.shape)}"
        )
    length = codes.shape[-1]
    if length % 2:
        codes = lax.pad(
            codes, jnp.zeros((), jnp.uint8), [(0, 0, 0)] * (codes.ndim - 1) + [(0, 1, 0)]
        )
    pairs = codes.reshape((*codes.shape[:-1], codes.shape[-1] // 2, 2))
    # A sum over each pair of the codes shifted into place (the high one by 4: no carry), not
    # two strided slices: XLA fuses the codes' computation into each slice it feeds, and the
    # stochastic codes computed twice over were 8x the quantize's time on a CPU.
    shifted = pairs & jnp.uint8(15)
    shifted = shifted << jnp.asarray(np.array([4, 0], np.uint8))
    return jnp.sum(shifted, axis=-1, dtype=jnp.uint8)


def unpack_nibbles(packed: jax.Array, length: int) -> jax.Array:
    """The 4-bit codes that :func:`pack_nibbles` packed: ``length`` codes per row.

    Args:
      packed: uint8 bytes, two codes each, along the last axis.
      length: codes per row, ``2 * packed.shape[-1]`` or one less.

    Returns:
      uint8 codes in [0, 15] shaped ``packed.shape[:-1] + (length,)``.

    Raises:
      ValueError: bytes that are not uint8, or a ``length`` they cannot hold.

    Example:
      >>> import jax.numpy as jnp
      >>> unpack_nibbles(jnp.array([18, 240], jnp.uint8), 3).tolist()
      [1, 2, 15]
    """
    length = operator.index(length)
    if packed.dtype != jnp.uint8 or packed.ndim == 0:
        raise ValueError(
            f"packed 4-bit codes must be a uint8 array with an axis, got {packed.dtype}"
            f"{list(packed.shape)}"
        )
    if -(-length // 2) != packed.shape[-1]:
        raise ValueError(
            f"{packed.shape[-1]} bytes hold {2 * packed.shape[-1] - 1} or "
            f"{2 * packed.shape[-1]} codes, not {length}"
        )
    pairs = jnp.stack([packed >> jnp.uint8(4), packed & jnp.uint8(15)], axis=-1)
    codes = pairs.reshape((*packed.shape[:-1], 2 * packed.shape[-1]))
    return codes if codes.shape[-1] == length else codes[..., :length]


def quantize_blocks_reference(
    x: jax.Array,
    *,
    block_size: int = 256,
    mapping: str = "linear",
    rounding: str = "nearest",
    key: jax.Array | None = None,
    layout: str = "flat",
) -> Quantized:
    """Quantizes ``x`` block-wise to one byte (or half a byte) per element: the pure-JAX reference.

    Args:
      x: a floating-point array (computed in float32).
      block_size: elements per block (any int >= 1; the last block, of the array or of each
        row, may be shorter).
      mapping: one of :data:`ALL_MAPS`, as the module docstring describes: ``"linear"``
        (signed, int8 codes), ``"sqrt"`` (non-negative, uint8, no zero level), ``"dynamic"``
        (signed, uint8), ``"dynamic_unsigned"`` (non-negative, uint8, no zero level),
        ``"dynamic4"`` (signed, 4-bit) or ``"linear4_unsigned"`` (non-negative, 4-bit, no zero
        level). Unsigned maps store negative values as their lowest level.
      rounding: ``"nearest"`` or ``"stochastic"`` (unbiased in value).
      key: a PRNG key (typed, or uint32 key data such as :func:`fold_in` returns), required for
        stochastic rounding; the same key gives the same codes.
      layout: ``"flat"`` (blocks of the flattened array) or ``"rows"`` (blocks along the last
        axis, so that codes and scales split along the leading axes as ``x`` does).

    Returns:
      A :class:`Quantized`: codes (shaped as :func:`codes_shape` says) and float32 scales
      (:func:`scales_shape`).

    Raises:
      TypeError: ``block_size`` is not an int.
      ValueError: ``block_size`` < 1, an unknown ``mapping``, ``rounding`` or ``layout``, a
        non-float ``x``, ``layout="rows"`` for a scalar, stochastic rounding without ``key``,
        or 2**31 elements or more.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from triaccel_jax.kernels.quantize import quantize_blocks_reference
      >>> q = quantize_blocks_reference(jnp.array([0.5, -1.0, 0.25, 2.0]), block_size=2)
      >>> q.codes.tolist(), q.scales.tolist()
      ([64, -127, 16, 127], [1.0, 2.0])
      >>> q = quantize_blocks_reference(jnp.ones((4, 300)), mapping="dynamic4", layout="rows")
      >>> q.codes.shape, q.scales.shape
      ((4, 150), (4, 2))

    References:
      Dettmers et al., 2022, "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861;
      Li et al., 2023, "Memory Efficient Optimizers with 4-bit States", arXiv 2309.01507.
    """
    block_size, needs_bits = _validate_quantize(x, block_size, mapping, rounding, key, layout)
    words = None
    if needs_bits:
        assert key is not None  # _validate_quantize refuses needs_bits without a key
        words = _rounding.key_words(key)
    return _quantize_reference(x, block_size, mapping, words, layout)


def dequantize_blocks_reference(
    codes: jax.Array,
    scales: jax.Array,
    *,
    block_size: int = 256,
    mapping: str = "linear",
    dtype: Any = jnp.float32,
    layout: str = "flat",
    shape: Sequence[int] | None = None,
) -> jax.Array:
    """The values that block-wise codes stand for (the pure-JAX reference).

    Args:
      codes: the codes, as :func:`quantize_blocks_reference` returned them.
      scales: float32, one per block.
      block_size: elements per block, as quantized.
      mapping: the map they were quantized with.
      dtype: the floating-point dtype of the result (computed in float32).
      layout: the layout they were quantized with.
      shape: the shape of the array quantized; required for 4-bit maps (an odd and an even count
        pack to the same bytes), optional otherwise.

    Returns:
      An array of ``shape`` (the codes' shape for 8-bit maps): ``code * scale / 127`` (linear),
      ``scale * ((code + 1) / 256) ** 2`` (sqrt), ``levels(mapping)[code] * scale`` (the table
      maps).

    Raises:
      TypeError, ValueError: as :func:`quantize_blocks_reference`, or codes of the wrong dtype
        or shape for ``mapping``, ``layout`` and ``shape``, a 4-bit map without ``shape``, or
        scales of the wrong shape.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.kernels.quantize import dequantize_blocks_reference
      >>> codes = jnp.array([64, -127, 16, 127], jnp.int8)
      >>> dequantize_blocks_reference(codes, jnp.array([127.0, 254.0]), block_size=2).tolist()
      [64.0, -127.0, 32.0, 254.0]
      >>> packed = jnp.array([0x0F, 0x70], jnp.uint8)  # codes 0, 15, 7 of "linear4_unsigned"
      >>> dequantize_blocks_reference(
      ...     packed, jnp.array([16.0]), mapping="linear4_unsigned", shape=(3,)
      ... ).tolist()
      [1.0, 16.0, 8.0]
    """
    block_size, shape = _validate_dequantize(
        codes, scales, block_size, mapping, dtype, layout, shape
    )
    return _dequantize_reference(
        codes, scales, block_size, mapping, jnp.dtype(dtype), layout, shape
    )


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


def _reference_only(impl: str, kernel: str, mapping: str, layout: str) -> bool:
    """True when the kernels do not implement ``mapping`` or ``layout``: ``impl="auto"`` then
    takes the reference, and ``impl="triton"`` is refused, naming what the kernel implements.

    The Triton kernels implement the closed-form maps on the flat layout. The table maps take
    the reference, which XLA compiles and fuses; the rows layout takes it too because XLA
    partitions it shard by shard, where a Triton call sees the whole array.
    """
    if impl not in IMPLS:
        raise ValueError(f"`impl` must be one of {IMPLS}, got {impl!r}")
    if mapping in KERNEL_MAPS and layout == "flat":
        return False
    if impl == "triton":
        raise ValueError(
            f"impl='triton': the {kernel} kernel implements the maps {KERNEL_MAPS} with "
            f"layout='flat', got mapping={mapping!r}, layout={layout!r}; use impl='auto' or "
            "'reference' (the reference, compiled by XLA)"
        )
    return True


def quantize_blocks(
    x: jax.Array,
    *,
    block_size: int = 256,
    mapping: str = "linear",
    rounding: str = "nearest",
    key: jax.Array | None = None,
    impl: str = "auto",
    layout: str = "flat",
) -> Quantized:
    """Quantizes ``x`` block-wise through the Triton kernel or the reference.

    The implementation is chosen when the call is traced, as for the cast kernel
    (:func:`triaccel_jax.kernels.cast.cast`): ``impl="auto"`` runs the Triton kernel only on a
    CUDA backend with jax_triton where ``kernels/auto_table.json`` says ``"triton"`` for
    :func:`triaccel_jax.kernels._dispatch.quantize_op`, and
    :func:`quantize_blocks_reference` (compiled by XLA) elsewhere. Both draw the same random
    bits for a key and agree bit for bit under the Triton interpreter. The kernel implements the
    ``"linear"`` and ``"sqrt"`` maps on the flat layout; the other maps and ``layout="rows"``
    always take the reference, and ``impl="triton"`` refuses them.

    Args:
      x: a floating-point array.
      block_size: elements per block.
      mapping: one of :data:`ALL_MAPS`.
      rounding: ``"nearest"`` or ``"stochastic"``.
      key: a PRNG key, required for stochastic rounding.
      impl: ``"auto"``, ``"reference"`` or ``"triton"``.
      layout: ``"flat"`` or ``"rows"`` (blocks along the last axis).

    Returns:
      A :class:`Quantized`, as :func:`quantize_blocks_reference` describes.

    Raises:
      TypeError, ValueError: as :func:`quantize_blocks_reference`, an unknown ``impl``, or
        ``impl="triton"`` with a map or layout the kernel does not implement.
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
      >>> q = quantize_blocks(x.reshape(10, 100), block_size=64, mapping="dynamic", layout="rows")
      >>> q.codes.shape, q.scales.shape
      ((10, 100), (10, 2))

    References:
      Dettmers et al., 2022, "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861.
    """
    block_size, needs_bits = _validate_quantize(x, block_size, mapping, rounding, key, layout)
    words = None
    if needs_bits:
        assert key is not None  # _validate_quantize refuses needs_bits without a key
        words = _rounding.key_words(key)
    if _reference_only(impl, "quantize", mapping, layout):
        return _quantize_reference(x, block_size, mapping, words, layout)
    use = _kernel_or_reference(
        impl, "quantize", _dispatch.quantize_op(mapping, rounding), block_size
    )
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
    layout: str = "flat",
    shape: Sequence[int] | None = None,
) -> jax.Array:
    """The values that block-wise codes stand for, through the Triton kernel or the reference.

    Args:
      codes: the codes, as :func:`quantize_blocks` returned them.
      scales: float32, one per block.
      block_size: elements per block, as quantized.
      mapping: the map they were quantized with.
      dtype: the floating-point dtype of the result.
      impl: ``"auto"``, ``"reference"`` or ``"triton"`` (dispatched as :func:`quantize_blocks`,
        on :func:`triaccel_jax.kernels._dispatch.dequantize_op`).
      layout: the layout they were quantized with.
      shape: the shape quantized; required for 4-bit maps, optional otherwise.

    Returns:
      An array of ``shape``, as :func:`dequantize_blocks_reference` describes.

    Raises:
      TypeError, ValueError: as :func:`dequantize_blocks_reference`, an unknown ``impl``, or
        ``impl="triton"`` with a map or layout the kernel does not implement.
      RuntimeError: ``impl="triton"`` where Triton cannot run.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.kernels.quantize import dequantize_blocks
      >>> codes = jnp.array([0, 255], jnp.uint8)
      >>> dequantize_blocks(codes, jnp.array([65536.0]), mapping="sqrt").tolist()
      [1.0, 65536.0]
      >>> back = dequantize_blocks(codes, jnp.array([2.0]), mapping="dynamic")  # -0.993, 1
      >>> [round(v, 4) for v in back.tolist()]
      [-1.9859, 2.0]
    """
    block_size, shape = _validate_dequantize(
        codes, scales, block_size, mapping, dtype, layout, shape
    )
    dtype = jnp.dtype(dtype)
    if _reference_only(impl, "dequantize", mapping, layout):
        return _dequantize_reference(codes, scales, block_size, mapping, dtype, layout, shape)
    use = _kernel_or_reference(impl, "dequantize", _dispatch.dequantize_op(mapping), block_size)
    if use == "triton" and codes.size > 0:
        from triaccel_jax.kernels import _quantize_triton  # lazy: imports triton

        launch = _dispatch.launch_config(_dispatch.dequantize_op(mapping))
        values = _quantize_triton.dequantize(
            codes, scales, block_size=block_size, mapping=mapping, launch=launch
        )
        return values.astype(dtype)
    return _dequantize_reference(codes, scales, block_size, mapping, dtype)


def _check_rank1(mapping: str, shape: tuple[int, ...]) -> None:
    check_map(mapping)
    if mapping not in TABLE_MAPS:
        raise ValueError(
            f"rank-1 normalisation takes the table maps {TABLE_MAPS}, got mapping={mapping!r}"
        )
    if len(shape) != 2:
        raise ValueError(
            f"rank-1 normalisation takes 2-D arrays (a row and a column scale per element), got "
            f"shape {shape}; blocks (quantize_blocks) take any shape"
        )


def _rank1_scales(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's and each column's absolute maximum of float32 ``x``, NaN where non-finite."""
    magnitude = jnp.abs(x)
    maxima = []
    for axis in (1, 0):
        absmax = jnp.max(magnitude, axis=axis)
        maxima.append(lax.select(jnp.isfinite(absmax), absmax, jnp.full_like(absmax, np.nan)))
    return maxima[0], maxima[1]


def _element_scales(row_scales: jax.Array, column_scales: jax.Array) -> jax.Array:
    """``min(row_scales[i], column_scales[j])`` per element (NaN if either is NaN)."""
    return jnp.minimum(row_scales[:, None], column_scales[None, :])


def quantize_rank1(
    x: jax.Array,
    *,
    mapping: str = "linear4_unsigned",
    rounding: str = "nearest",
    key: jax.Array | None = None,
) -> Rank1Quantized:
    """Quantizes a 2-D ``x`` with rank-1 normalisation: each element over the smaller of its
    row's and its column's absolute maximum.

    Li et al. (2023) quantize the second moment this way: its large entries line up in rows and
    columns (a feature or a unit whose gradients are large), so an element's own row or column
    bounds it more tightly than a block of the flattened array does, for one scale per row and
    per column (``4 * (rows + columns)`` bytes) instead of one per block. With the zero-free
    ``"linear4_unsigned"`` map it is their 4-bit second moment.

    Args:
      x: a 2-D floating-point array (computed in float32).
      mapping: a table map (:data:`TABLE_MAPS`); an unsigned one stores negative values as its
        lowest level.
      rounding: ``"nearest"`` or ``"stochastic"`` (unbiased in value; the same counter-hash bits
        as :func:`quantize_blocks`).
      key: a PRNG key, required for stochastic rounding.

    Returns:
      A :class:`Rank1Quantized`. Every element of a row or column that holds NaN or infinity
      dequantizes to NaN; elements whose scale is below ``TINY`` store the code nearest zero.

    Raises:
      ValueError: a map without a table, an array that is not 2-D or not floating-point, an
        unknown ``rounding``, or stochastic rounding without ``key``.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([[1.0, 1e-3], [1e-3, 1e-6]])  # one large row and column
      >>> q = quantize_rank1(x)
      >>> q.codes.shape, q.row_scales.tolist(), q.column_scales.tolist()
      ((2, 1), [1.0, 0.0010000000474974513], [1.0, 0.0010000000474974513])
      >>> back = dequantize_rank1(q.codes, q.row_scales, q.column_scales)
      >>> [f"{v:.3g}" for v in back.ravel().tolist()]
      ['1', '0.001', '0.001', '6.25e-05']

    References:
      Li et al., 2023, "Memory Efficient Optimizers with 4-bit States", arXiv 2309.01507,
      section 4.2 (rank-1 normalisation) and 4.1 (the zero-free map).
    """
    _check_rank1(mapping, tuple(x.shape))
    _rounding.check_rounding(rounding)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"`x` must be a floating-point array to quantize, got {x.dtype}")
    _rounding.check_size(x.shape)
    if rounding == "stochastic" and x.size > 0 and key is None:
        raise ValueError("stochastic rounding needs a PRNG `key`")
    f32 = np.float32
    x = x.astype(jnp.float32)
    row_scales, column_scales = _rank1_scales(x)
    scale = _element_scales(row_scales, column_scales)
    finite = jnp.isfinite(scale)
    kept = finite & (scale >= TINY)
    # As for blocks: a scale of 2**64 or more is brought down by 2**-64 before its reciprocal.
    factor = lax.select(scale >= HUGE, jnp.full_like(scale, 1 / HUGE), jnp.ones_like(scale))
    safe = lax.select(kept, scale * factor, jnp.ones_like(scale))
    ratio = lax.clamp(f32(-1), (x * factor) * (f32(1) / safe), f32(1))
    uniform = None
    if rounding == "stochastic" and x.size > 0:
        assert key is not None
        uniform = _uniform_like(_rounding.key_words(key), x)
    code = _quantize_maps.codes(mapping, ratio, uniform)
    zero = lax.full_like(code, _quantize_maps.zero_code(mapping))
    codes = lax.select(kept, code, zero).astype(jnp.uint8)
    if MAP_BITS[mapping] == 4:
        codes = pack_nibbles(codes)
    return Rank1Quantized(codes, row_scales, column_scales)


def dequantize_rank1(
    codes: jax.Array,
    row_scales: jax.Array,
    column_scales: jax.Array,
    *,
    mapping: str = "linear4_unsigned",
    dtype: Any = jnp.float32,
) -> jax.Array:
    """The values that :func:`quantize_rank1`'s codes stand for.

    Args:
      codes: uint8 codes (packed two per byte along the last axis for 4-bit maps).
      row_scales: float32, one per row.
      column_scales: float32, one per column.
      mapping: the map they were quantized with.
      dtype: the floating-point dtype of the result (computed in float32).

    Returns:
      ``levels(mapping)[code] * min(row_scale, column_scale)``, shaped ``(rows, columns)``.

    Raises:
      ValueError: a map without a table, codes or scales of the wrong dtype or shape.

    Example:
      >>> import jax.numpy as jnp
      >>> codes = jnp.array([[0xF0]], jnp.uint8)  # codes 15 and 0 of "linear4_unsigned"
      >>> dequantize_rank1(codes, jnp.array([2.0]), jnp.array([4.0, 1.0])).tolist()
      [[2.0, 0.0625]]
    """
    if row_scales.ndim != 1 or column_scales.ndim != 1:
        raise ValueError(
            f"row and column scales must be 1-D, got shapes {row_scales.shape} and "
            f"{column_scales.shape}"
        )
    shape = (row_scales.shape[0], column_scales.shape[0])
    _check_rank1(mapping, shape)
    if row_scales.dtype != jnp.float32 or column_scales.dtype != jnp.float32:
        raise ValueError(
            f"row and column scales must be float32, got {row_scales.dtype} and "
            f"{column_scales.dtype}"
        )
    if codes.dtype != jnp.uint8:
        raise ValueError(f"the {mapping!r} map's codes are uint8, got {codes.dtype}")
    expected = codes_shape(shape, mapping, "rows")
    if codes.shape != expected:
        raise ValueError(
            f"codes of a {shape} array under the {mapping!r} map are shaped {expected}, got "
            f"{codes.shape}"
        )
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"`dtype` must be a floating-point dtype, got {jnp.dtype(dtype)}")
    if MAP_BITS[mapping] == 4:
        codes = unpack_nibbles(codes, shape[1])
    values = _quantize_maps.values(mapping, codes)
    return (values * _element_scales(row_scales, column_scales)).astype(dtype)
