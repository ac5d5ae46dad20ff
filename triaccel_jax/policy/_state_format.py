"""The formats an optimizer's state can be stored in: one registry for every reader.

:func:`triaccel_jax.quantize_state` stores state in these formats, the planner
(:func:`triaccel_jax.precision.plan_state_formats`) prices them, and the precision policy takes
its state dtypes from the float ones. Each format says how many bits an element takes, which
map of :mod:`triaccel_jax.kernels.quantize` stores a signed moment (a momentum, Adam's ``mu``)
and which a non-negative one (Adam's ``nu``), its block size, its bytes (per element, and per
leaf: :meth:`StateFormat.leaf_bytes`, codes and scales with blocks along the last axis, or a
factored second moment's row and column means), and its error model: the relative error
variance of one store.

The error model is what the planner's loss model reads (docs/design.md §3.9): a store of ``x``
returns ``x + e`` with ``E[e**2] = v * E[x**2]`` over a block of standard Gaussian values, for
stochastic rounding (unbiased; nearest is no worse). The constants are
:func:`measure_error_variance`'s figures (seed 0, 2**16 values, rounded), which a test checks:
float32 0 (the reference), bfloat16 5.5e-6 (a third of its spacing's bound ``2**-16``), the
linear 8-bit map 9.7e-5, the dynamic 8-bit map 2.3e-4 and the signed 4-bit map 4.4e-2. On
Gaussian blocks the dynamic map errs more than the linear one, whose levels are spent evenly up
to the block's maximum; its levels are spent on small magnitudes, which it keeps where the
linear map rounds them to zero (blocks that span decades: benchmarks/quantize_maps.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from triaccel_jax.kernels import quantize as quantize_lib


class StateFormat(NamedTuple):
    """One way to store an optimizer-state leaf.

    Attributes:
      name: the format's name, as ``quantize_state(format=...)`` takes it.
      bits: bits per element of the stored codes (32 and 16 for the float formats).
      signed_map: the map of :mod:`triaccel_jax.kernels.quantize` for signed state (None for a
        float format).
      unsigned_map: the map for non-negative state, second moments (zero-free, so that
        ``m / (sqrt(v) + eps)`` never becomes ``m / eps``); None for a float format.
      block_size: elements per block sharing one float32 scale (None for a float format).
      error_variance: the relative error variance of one stochastically rounded store of a block
        of Gaussian values (see the module's docstring).
      factored: whether a non-negative leaf of rank >= 2 is stored factored (Adafactor's row and
        column means of the last two axes, float32, in place of codes: Shazeer & Stern, 2018;
        the "4-bit Factor" state of Li et al., 2023) rather than in ``unsigned_map``'s codes.
    """

    name: str
    bits: int
    signed_map: str | None
    unsigned_map: str | None
    block_size: int | None
    error_variance: float
    factored: bool = False

    @property
    def is_float(self) -> bool:
        """Whether the format is a float dtype (no codes, no scales)."""
        return self.signed_map is None

    def bytes_per_element(self, itemsize: int, block_size: int | None = None) -> float:
        """Bytes one element takes in this format, its scale's share included.

        Args:
          itemsize: the bytes of the element as the inner optimizer keeps it (``"fp32"`` keeps
            it so; ``"bf16"`` takes at most 2).
          block_size: the block size, if not the format's own.

        Returns:
          Bytes per element.

        Example:
          >>> from triaccel_jax.policy import state_format
          >>> state_format("int4").bytes_per_element(4)
          0.53125
        """
        if self.name == "fp32":
            return float(itemsize)
        if self.is_float:
            return float(min(self.bits // 8, itemsize))
        block = self.block_size if block_size is None else block_size
        assert block is not None
        return self.bits / 8 + 4.0 / block

    def leaf_bytes(
        self,
        shape: Sequence[int],
        itemsize: int,
        *,
        second_moment: bool = False,
        block_size: int | None = None,
    ) -> int:
        """The bytes one state leaf of ``shape`` takes stored in this format.

        A float format stores ``size * itemsize`` (``"fp32"``: the leaf as the inner optimizer
        keeps it) or ``size * min(2, itemsize)`` (``"bf16"``). A coded format stores its codes
        and its float32 scales with blocks cut along the last axis (the ``"rows"`` layout of
        :func:`triaccel_jax.kernels.quantize.stored_bytes`, which shards like the leaf; a scalar,
        which has no last axis, is one flat block), in ``unsigned_map`` for a second moment and
        ``signed_map`` otherwise. A second moment of rank >= 2 in a ``factored`` format is its
        float32 row and column means of the last two axes: ``4 * (rows + cols)`` bytes for each
        index of the leading axes.

        Args:
          shape: the leaf's shape.
          itemsize: the bytes of one element as the inner optimizer keeps it.
          second_moment: whether the leaf is a non-negative second moment (Adam's ``nu``).
          block_size: the block size, if not the format's own.

        Returns:
          The stored bytes (an int).

        Example:
          >>> from triaccel_jax.policy import state_format
          >>> int4 = state_format("int4")
          >>> int4.leaf_bytes((1024, 256), 4)  # 4-bit codes and one scale per 128: 0.53 B each
          139264
          >>> int4.leaf_bytes((1024, 256), 4, second_moment=True)  # factored: 4 * (1024 + 256)
          5120
          >>> state_format("bf16").leaf_bytes((1024, 256), 4)
          524288
        """
        shape = tuple(int(d) for d in shape)
        size = math.prod(shape)
        if self.name == "fp32":
            return size * int(itemsize)
        if self.is_float:
            return size * min(self.bits // 8, int(itemsize))
        if second_moment and self.factored and len(shape) >= 2:
            return 4 * (shape[-2] + shape[-1]) * math.prod(shape[:-2])
        block = self.block_size if block_size is None else block_size
        mapping = self.unsigned_map if second_moment else self.signed_map
        assert block is not None and mapping is not None
        layout = "rows" if shape else "flat"
        return quantize_lib.stored_bytes(shape, block_size=block, mapping=mapping, layout=layout)


STATE_FORMATS: dict[str, StateFormat] = {
    state.name: state
    for state in (
        StateFormat("fp32", 32, None, None, None, 0.0),
        StateFormat("bf16", 16, None, None, None, 5.5e-6),
        StateFormat("int8", 8, "linear", "sqrt", 256, 9.7e-5),
        StateFormat("int8_dynamic", 8, "dynamic", "dynamic_unsigned", 256, 2.3e-4),
        StateFormat("int4", 4, "dynamic4", "linear4_unsigned", 128, 4.4e-2, factored=True),
    )
}
"""Every state format by name, from the most to the least precise."""


def state_format(name: str) -> StateFormat:
    """The registered state format called ``name``.

    Args:
      name: a key of :data:`STATE_FORMATS`.

    Returns:
      Its :class:`StateFormat`.

    Raises:
      ValueError: no format has that name (the known ones are listed).

    Example:
      >>> from triaccel_jax.policy import state_format
      >>> state_format("int8").unsigned_map
      'sqrt'
    """
    if not isinstance(name, str) or name not in STATE_FORMATS:
        raise ValueError(f"unknown state format {name!r}: one of {sorted(STATE_FORMATS)}")
    return STATE_FORMATS[name]


def measure_error_variance(name: str, *, samples: int = 2**16, seed: int = 0) -> float:
    """Measures a format's relative error variance: ``E[e**2] / E[x**2]`` of one stochastically
    rounded store of standard Gaussian values, in the format's signed map and block size.

    Args:
      name: a key of :data:`STATE_FORMATS`.
      samples: how many values (a multiple of the block size keeps every block full).
      seed: the values' and the rounding's seed.

    Returns:
      The measured relative error variance (0 for float32).

    Example:
      >>> from triaccel_jax.policy import measure_error_variance
      >>> round(measure_error_variance("int4"), 3)
      0.044
    """
    state = state_format(name)
    key_values, key_rounding = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(key_values, (samples,), jnp.float32)
    if state.name == "fp32":
        return 0.0
    if state.is_float:
        bits = jax.random.bits(key_rounding, x.shape, jnp.uint32)
        # Stochastic rounding to bfloat16: add 16 random low bits, then truncate them.
        raw = jax.lax.bitcast_convert_type(x, jnp.uint32)
        rounded = (raw + (bits >> 16)) & jnp.uint32(0xFFFF0000)
        back = jax.lax.bitcast_convert_type(rounded, jnp.float32)
    else:
        assert state.signed_map is not None and state.block_size is not None
        quantized = quantize_lib.quantize_blocks(
            x,
            block_size=state.block_size,
            mapping=state.signed_map,
            rounding="stochastic",
            key=key_rounding,
            impl="reference",
        )
        back = quantize_lib.dequantize_blocks(
            quantized.codes,
            quantized.scales,
            block_size=state.block_size,
            mapping=state.signed_map,
            impl="reference",
            shape=x.shape,
        )
    error = np.asarray(back, np.float64) - np.asarray(x, np.float64)
    return float(np.mean(error**2) / np.mean(np.asarray(x, np.float64) ** 2))
