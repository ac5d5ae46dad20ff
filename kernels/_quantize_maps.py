"""The table maps of the block-wise quantizer: their levels, and a value's code among them.

A table map is a sorted list of levels in [-1, 1] (signed) or (0, 1] (unsigned), fractions of a
block's scale; a value's code is the index of its level. Rounded to nearest, an 8-bit dynamic
map's code is computed from the value's decade and its cell within the decade, then settled with
two gathers (:func:`dynamic_guess`, :func:`refine_count`); a 4-bit map's by compares with its
15 midpoints; otherwise by a branchless binary search over the table (one gather per halving),
as bitsandbytes' kernels search their 256-entry code (Dettmers et al., 2022). Four maps:

* ``"dynamic"``: bitsandbytes' signed dynamic-exponent map (``create_dynamic_map(signed=True)``,
  Dettmers et al., 2022, "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861, after
  Dettmers, 2016, arXiv 1511.04561), which torchao's 8-bit optimizers use too: 0, 1 and, in each
  of the 7 decades ``10**-6 .. 10**0``, ``2**i`` levels (``i`` = 0..6) at the midpoints of
  ``linspace(0.1, 1, 2**i + 1)`` times the decade, with both signs. The exponent (the decade)
  spends fewer bits where the fraction needs more, so the levels' relative spacing is about
  ``0.9 / 2**i``: 0.7% near the scale, and values down to ``5.5e-7`` of it keep a level of their
  own where the linear map's smallest step is ``1 / 127``. As published, the most negative level
  is ``-0.9930`` (the positive side holds 1.0 instead): a block whose largest magnitude is
  negative stores it 0.7% smaller.
* ``"dynamic_unsigned"``: bitsandbytes' unsigned dynamic map (``create_dynamic_map(signed=False)``:
  the same decades with twice the levels each) *without its zero*, for non-negative second moments.
  Adam divides by ``sqrt(v)``; a second moment stored as 0 turns ``m / (sqrt(v) + eps)`` into
  ``m / eps``, the zero-point problem that Li et al. (2023, "Memory Efficient Optimizers with
  4-bit States", arXiv 2309.01507, section 4.1) remove by taking zero out of the second moment's
  map. Their "DE-0" copies the smallest positive level into zero's place (a code spent twice);
  here zero's code gets a level of its own one decade further down, ``0.55e-7`` (the midpoint of
  that decade, as the signed map's lowest decade holds one level), so every code stays distinct
  and anything below it (zero included) is stored as it.
* ``"dynamic4"``: the signed 4-bit dynamic-exponent map of Li et al. for first moments (their
  "DE", ``create_dynamic_map(signed=True, max_exponent_bits=3, total_bits=4)``): 0, 1 and
  ``+-{0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875}``. As published its most negative
  level is ``-0.8875``.
* ``"linear4_unsigned"``: the unsigned 4-bit linear map without zero of Li et al. for second
  moments (their "Linear", ``(i + 1) / 16`` for ``i`` = 0..15), used with rank-1 normalisation
  (:func:`triaccel_jax.kernels.quantize.quantize_rank1`) or blocks.

The levels are computed in float64 and rounded once to float32 (bitsandbytes builds them in
float32, so a level may differ from theirs in its last bit). Rounding to nearest compares with
the float32 midpoints between neighbouring levels (ties to the upper level); stochastic rounding
takes the level above with probability equal to the distance from the level below over their
gap, so it is unbiased in value between the lowest and the highest level.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


class MapInfo(NamedTuple):
    """What a table map is.

    Attributes:
      bits: bits per code (8, or 4 for codes packed two per byte).
      signed: whether it has negative levels (for signed state such as a first moment).
      zero_free: whether no level is zero (for a second moment, which is divided by).
    """

    bits: int
    signed: bool
    zero_free: bool


TABLE_MAPS: dict[str, MapInfo] = {
    "dynamic": MapInfo(bits=8, signed=True, zero_free=False),
    "dynamic_unsigned": MapInfo(bits=8, signed=False, zero_free=True),
    "dynamic4": MapInfo(bits=4, signed=True, zero_free=False),
    "linear4_unsigned": MapInfo(bits=4, signed=False, zero_free=True),
}
# The level that takes zero's code in "dynamic_unsigned": the midpoint of the decade below the
# lowest one bitsandbytes' map fills (10**-7 * 0.55).
ZERO_FREE_FLOOR = 0.55e-7


def dynamic_levels(signed: bool, decades: int) -> np.ndarray:
    """The dynamic-exponent map of ``decades + 1`` bits, sorted (float64).

    bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=decades, total_bits=decades +
    1)``: 0 and 1, and in decade ``i`` (``10 ** (i - decades + 1)``, ``i`` = 0 .. decades - 1)
    the midpoints of ``linspace(0.1, 1, k + 1)`` times the decade, ``k = 2**i`` levels of each
    sign (signed) or ``k = 2**(i + 1)`` positive ones (unsigned).

    Args:
      signed: both signs, or non-negative levels only.
      decades: how many decades (7 for 8 bits, 3 for 4).

    Returns:
      ``2 ** (decades + 1)`` sorted float64 levels in [-1, 1] or [0, 1].

    Example:
      >>> dynamic_levels(True, 3).round(4).tolist()[7:]
      [0.0, 0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0]
    """
    values = [0.0, 1.0]
    for i in range(decades):
        count = 2**i if signed else 2 ** (i + 1)
        bounds = np.linspace(0.1, 1.0, count + 1)
        means = (bounds[:-1] + bounds[1:]) / 2 * 10.0 ** (i - decades + 1)
        values += means.tolist()
        if signed:
            values += (-means).tolist()
    levels = np.sort(np.asarray(values, np.float64))
    assert levels.size == 2 ** (decades + 1)
    return levels


def _tables() -> dict[str, np.ndarray]:
    dynamic_unsigned = dynamic_levels(False, 7)
    dynamic_unsigned[0] = ZERO_FREE_FLOOR  # zero's code, moved a decade down (module docstring)
    tables = {
        "dynamic": dynamic_levels(True, 7),
        "dynamic_unsigned": dynamic_unsigned,
        "dynamic4": dynamic_levels(True, 3),
        "linear4_unsigned": np.arange(1, 17, dtype=np.float64) / 16,
    }
    out = {}
    for name, table in tables.items():
        table = table.astype(np.float32)
        assert np.all(np.diff(table) > 0) and table.size == 2 ** TABLE_MAPS[name].bits
        table.setflags(write=False)
        out[name] = table
    return out


LEVELS: dict[str, np.ndarray] = _tables()


def _midpoints(table: np.ndarray) -> np.ndarray:
    """The float32 midpoints between neighbouring levels, with +inf appended (a power of two
    entries, as the search needs)."""
    mids = ((table[:-1].astype(np.float64) + table[1:]) / 2).astype(np.float32)
    return np.append(mids, np.float32(np.inf))


MIDPOINTS: dict[str, np.ndarray] = {name: _midpoints(table) for name, table in LEVELS.items()}
# The levels above the lowest, with +inf appended: their count below a value is the index of the
# level at or below it (stochastic rounding's lower level).
UPPER_LEVELS: dict[str, np.ndarray] = {
    name: np.append(table[1:], np.float32(np.inf)) for name, table in LEVELS.items()
}
for _table in (*MIDPOINTS.values(), *UPPER_LEVELS.values()):
    _table.setflags(write=False)


def zero_code(mapping: str) -> int:
    """The code of the level nearest zero: what a block of zeros (or of values below
    ``quantize.TINY``) stores."""
    return int(np.argmin(np.abs(LEVELS[mapping])))


def explicit_sharding(x: jax.Array) -> jax.sharding.NamedSharding | None:
    """``x``'s sharding where its type carries one (a mesh with Explicit axes), else None.

    A gather from a table into an array sharded in its type needs its output sharding spelled
    out (JAX cannot tell it from a replicated table and sharded indices); under Auto axes, or
    no mesh, XLA propagates it and none is given.
    """
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    kinds = getattr(mesh, "axis_types", ())
    if any(kind == jax.sharding.AxisType.Explicit for kind in kinds):
        return sharding
    return None


def take(table: np.ndarray, index: jax.Array) -> jax.Array:
    """``table[index]`` for int32 indices known to be in bounds, sharded like ``index``."""
    return (
        jnp.asarray(table)
        .at[index]
        .get(mode="promise_in_bounds", out_sharding=explicit_sharding(index))
    )


def count_at_most(table: np.ndarray, t: jax.Array) -> jax.Array:
    """How many entries of the sorted ``table`` (a power of two of them) are ``<= t``, as int32.

    A branchless binary search, at each halving one gather and one compare per element; a table
    of at most 16 entries is compared entry by entry instead. NaN compares false and counts 0.
    """
    size = table.size
    index = jnp.zeros(t.shape, jnp.int32, out_sharding=explicit_sharding(t))
    if size <= 16:
        # A 4-bit map's 15 finite entries: compares with constants, no gather (on a CPU a
        # gather per halving cost 6x these compares).
        for entry in table[:-1]:
            index = index + (t >= entry).astype(jnp.int32)
        return index
    step = size // 2
    while step >= 1:
        probe = take(table, index + np.int32(step - 1))
        index = lax.select(probe <= t, index + np.int32(step), index)
        step //= 2
    return index


def refine_count(table: np.ndarray, t: jax.Array, guess: jax.Array) -> jax.Array:
    """:func:`count_at_most` from a ``guess`` within one of it, with two gathers.

    Where the count ``c`` (entries of the sorted ``table`` at most ``t``) is ``guess - 1``,
    ``guess`` or ``guess + 1``, ``table[c - 1] <= t < table[c]`` picks it: below
    ``table[guess - 1]`` it is ``guess - 1``, at or above ``table[guess]`` ``guess + 1``.

    Args:
      table: a sorted table whose last entry is +inf.
      t: float32 values.
      guess: int32 in ``[1, table.size - 1]``, shaped like ``t``, within one of the count.

    Returns:
      The count as int32; 0 where ``t`` is NaN, as :func:`count_at_most` gives.
    """
    below = t < take(table, guess - np.int32(1))
    above = t >= take(table, guess)
    count = guess - below.astype(jnp.int32) + above.astype(jnp.int32)
    return lax.select(jnp.isnan(t), jnp.zeros_like(count), count)


def dynamic_guess(mapping: str, t: jax.Array) -> jax.Array:
    """The index of the 8-bit dynamic map's level nearest ``t``, give or take one, by arithmetic.

    A level of decade ``i`` (values in ``[0.1, 1) * 10**(i - 6)``) is the centre of one of the
    decade's equal cells, so the decade (six compares with its lower bounds) and the cell (from
    the value's fraction of the decade) give its index. The nearest level is that cell's, or at
    a decade's lower edge the decade below's top level; float32 rounding at a cell's or a
    decade's edge moves the guess by one more at most, and the cell is clamped into its decade,
    so the guess is within one of the index :func:`count_at_most` finds: :func:`refine_count`
    settles it. Compares and selects only: on a CPU ``log10`` and ``pow`` cost more than the
    search's gathers.

    Args:
      mapping: ``"dynamic"`` or ``"dynamic_unsigned"``.
      t: float32 fractions of the scale (NaN gives some in-range guess).

    Returns:
      int32 guesses in ``[1, 255]``, shaped like ``t``.
    """
    f32 = np.float32
    signed = TABLE_MAPS[mapping].signed
    # Unsigned: a negative value lands in decade 0, cell 0, which refine_count takes down to 0.
    magnitude = jnp.abs(t) if signed else t
    # Decade i holds 2**i levels a sign (signed) or 2**(i + 1) (unsigned); below 10**-6 (decade
    # 0's start) the value is clamped into decade 0's first cell.
    per_unit: Any = f32(1e6)  # 1 / 10**(i - 6), exact in float32
    cells: Any = f32(1 if signed else 2)
    for i in range(1, 7):
        inside = magnitude >= f32(10.0 ** (i - 7))
        per_unit = jnp.where(inside, f32(10.0 ** (6 - i)), per_unit)
        cells = jnp.where(inside, f32(2**i if signed else 2 ** (i + 1)), cells)
    cell = jnp.floor((magnitude * per_unit - f32(0.1)) * (cells / f32(0.9)))
    # The positive levels before this decade's (2**i - 1, or 2**(i + 1) - 2 after the floor
    # level), plus the cell.
    index = cells - f32(1) + jnp.clip(cell, f32(0), cells - f32(1))
    if signed:
        # Sorted: the 127 negative levels, 0 (index 127), the 127 positive ones, then 1.
        index = jnp.where(t < 0, f32(126) - index, f32(128) + index)
    guess = jnp.clip(index, f32(1), f32(255))
    return jnp.where(jnp.isnan(guess), f32(1), guess).astype(jnp.int32)


def codes(mapping: str, t: jax.Array, uniform: jax.Array | None) -> jax.Array:
    """int32 codes of ``t`` (values over their scale, float32) under a table map.

    Args:
      mapping: a name in :data:`TABLE_MAPS`.
      t: float32 fractions of the scale, in [-1, 1]; below the lowest level they take it.
      uniform: float32 uniforms in [0, 1) shaped like ``t`` for stochastic rounding, or None to
        round to the nearest level (ties to the upper one).

    Returns:
      int32 indices into :data:`LEVELS` ``[mapping]``, shaped like ``t``.
    """
    if uniform is None:
        if mapping in ("dynamic", "dynamic_unsigned"):
            # Eight dependent gathers of the binary search become two (dynamic_guess).
            return refine_count(MIDPOINTS[mapping], t, dynamic_guess(mapping, t))
        return count_at_most(MIDPOINTS[mapping], t)
    table = LEVELS[mapping]
    if table.size <= 16:
        # A 4-bit map: the level below and above from compares with constants, no gather.
        lower = jnp.zeros(t.shape, jnp.int32, out_sharding=explicit_sharding(t))
        low, high = jnp.full_like(t, table[0]), jnp.full_like(t, table[1])
        for k in range(1, table.size - 1):
            above = t >= table[k]
            lower = lower + above.astype(jnp.int32)
            low = lax.select(above, jnp.full_like(t, table[k]), low)
            high = lax.select(above, jnp.full_like(t, table[k + 1]), high)
        gap = high - low
    else:
        lower = lax.min(count_at_most(UPPER_LEVELS[mapping], t), np.int32(table.size - 2))
        low = take(table, lower)
        gap = take(table, lower + np.int32(1)) - low
    # Below the lowest level the distance is negative: never up, the lowest level kept.
    up = uniform * gap < t - low
    return lax.select(up, lower + np.int32(1), lower)


def values(mapping: str, code: jax.Array) -> jax.Array:
    """The float32 levels that integer codes of a table map stand for (fractions of the scale)."""
    return take(LEVELS[mapping], code.astype(jnp.int32))
