"""``quantize_state``: any optax optimizer's state kept in bfloat16, 8- or 4-bit blocks.

The wrapper stores the inner optimizer's parameter-sized float state (AdamW's ``mu`` and ``nu``,
Muon's momentum, any float leaf of at least ``min_size`` elements) in a narrower format, and
gives the inner optimizer its state back in the dtype the inner made it, for the one update it
runs; the new state is stored again, rounded to nearest or stochastically. Everything else in
the state (counts, scalars, ``inject_hyperparams``' hyperparameters, the curvature signals'
state) is the inner's, untouched. docs/design.md §3.9 gives the formats and their references.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import itertools
import math
import numbers
import weakref
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jex_core

from triaccel_jax import kernels
from triaccel_jax import policy as policy_lib
from triaccel_jax._src import arrays
from triaccel_jax._src import tree as tree_lib
from triaccel_jax._src import validation
from triaccel_jax.kernels import cast as cast_kernel
from triaccel_jax.kernels import quantize as quantize_lib
from triaccel_jax.transforms._observer import is_signal_state

FORMATS = tuple(policy_lib.STATE_FORMATS)  # "fp32", "bf16", "int8", "int8_dynamic", "int4"
ROUNDINGS = ("nearest", "stochastic")
# Names of state fields and dict keys that hold non-negative second moments, for states of a type
# _SECOND_MOMENTS_BY_TYPE does not know: optax's ``nu``, ``nu_max`` and ``sum_of_squares``,
# PyTorch's (and optax.contrib's Prodigy's) ``exp_avg_sq``, and ``v``, ``v_row`` and ``v_col``
# (Adam's v as the papers write it; Adafactor's).
SECOND_MOMENTS = ("nu", "nu_max", "sum_of_squares", "exp_avg_sq", "v", "v_row", "v_col")
# Fields of optax.inject_hyperparams' state: numbers the user sets, never parameter-sized state.
_HYPERPARAM_FIELDS = ("hyperparams", "hyperparams_states")

FormatChoice = str | Mapping[str, str] | Callable[[str, jax.ShapeDtypeStruct], str | None]


def _state_types(names: Mapping[str, tuple[str, ...]]) -> dict[type, tuple[str, ...]]:
    """``{optax state type: fields}`` for the names this optax has (older ones lack some)."""
    # Some (ScaleByRStdDevWithCountState) are not exported at optax's top level.
    from optax._src import transform as optax_transform

    found = {}
    for name, fields in names.items():
        module, _, attribute = name.rpartition(".")
        places = (optax.contrib,) if module == "contrib" else (optax, optax_transform)
        for place in places:
            kind = getattr(place, attribute, None)
            if isinstance(kind, type):
                found[kind] = fields
                break
    return found


# The second moments of optax's state types, by role: every field that holds a non-negative
# quantity the update divides by (or takes the root of). A state of one of these types is read
# by its type alone, not by field names: SM3's ``nu`` is its signed momentum (its accumulators
# are ``mu``), Adan's ``v`` a signed average of gradient differences.
_SECOND_MOMENTS_BY_TYPE = _state_types(
    {
        "ScaleByAdamState": ("nu",),  # adam, adamw, adamax (a max of |g|), nadam, radam, yogi
        "ScaleByAmsgradState": ("nu", "nu_max"),
        "ScaleByRmsState": ("nu",),
        "ScaleByRmsWithCountState": ("nu",),
        "ScaleByRStdDevState": ("nu",),  # stored centered: CenteredState
        "ScaleByRStdDevWithCountState": ("nu",),
        "ScaleByBeliefState": ("nu",),  # adabelief's nu is already centered: E[(g - m)**2]
        "ScaleByRssState": ("sum_of_squares",),
        "ScaleByAdaDeltaState": ("e_g", "e_x"),
        "ScaleByAdanState": ("n",),
        "ScaleBySM3State": ("mu",),
        "ScaleByNovogradState": ("nu",),
        "ScaleByLionState": (),
        "TraceState": (),
        "FactoredState": ("v_row", "v_col", "v"),  # adafactor
        "contrib.MuonState": (),
        "contrib.ProdigyState": ("exp_avg_sq",),
        "contrib.DAdaptAdamWState": ("exp_avg_sq",),
        "contrib.MomoAdamState": ("exp_avg_sq",),
        "contrib.MadgradState": ("grad_sum_sq",),
        "contrib.ScaleByAdemamixState": ("nu",),
        "contrib.ScaleBySimplifiedAdEMAMixState": ("n",),
        # Sophia's nu averages Hutchinson's estimates of the Hessian's diagonal, which may be
        # negative: signed.
        "contrib.SophiaState": (),
    }
)
# States whose update reads ``second - |mean|**2`` (a centered variance): rounded independently,
# the difference of the two stored moments goes negative where the variance is small, and the
# update's root is NaN. Stored as :class:`CenteredState`: ``mean`` and the variance itself.
_CENTERED = _state_types(
    {"ScaleByRStdDevState": ("mu", "nu"), "ScaleByRStdDevWithCountState": ("mu", "nu")}
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedLeaf:
    """A state leaf stored as 8-bit block-wise codes (the ``"int8"`` format).

    Attributes:
      codes: one byte per element, shaped like the leaf: int8 for the ``"linear"`` map, uint8
        for ``"sqrt"`` (:mod:`triaccel_jax.kernels.quantize`).
      scales: float32, one per block: the block's absolute maximum. Blocks are cut along the
        last axis (``layout="rows"``: shaped ``shape[:-1] + (blocks per row,)``), so that codes
        and scales split along the leading axes as a sharded leaf does; the flattened leaf's
        blocks (``layout="flat"``) only where the Triton kernels store it (``impl="triton"``).
      mapping: ``"linear"`` (signed state) or ``"sqrt"`` (a non-negative second moment); static.
      dtype: the name of the dtype the inner optimizer keeps the leaf in (what the leaf is
        dequantized to); static.
      block_size: elements per block (what the scales are per); static, so that the leaf
        dequantizes on its own (:func:`dequantize_state`).
      shape: the leaf's shape, for the 4-bit maps, whose codes pack two per byte; None for the
        8-bit maps, whose codes are shaped like the leaf. Static.
      layout: ``"rows"`` or ``"flat"`` (:mod:`triaccel_jax.kernels.quantize`), as stored; static.
    """

    codes: jax.Array
    scales: jax.Array
    mapping: str = dataclasses.field(metadata={"static": True})
    dtype: str = dataclasses.field(metadata={"static": True})
    block_size: int = dataclasses.field(metadata={"static": True})
    shape: tuple[int, ...] | None = dataclasses.field(default=None, metadata={"static": True})
    layout: str = dataclasses.field(default="rows", metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Bfloat16Leaf:
    """A state leaf stored in bfloat16 (the ``"bf16"`` format).

    Attributes:
      value: the leaf rounded (stochastically, after the first update) to bfloat16.
      dtype: the name of the dtype the inner optimizer keeps the leaf in; static.
    """

    value: jax.Array
    dtype: str = dataclasses.field(metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FactoredLeaf:
    """A non-negative second moment of rank >= 2 stored factored (``"int4"``'s second moments).

    In place of the leaf ``v`` (shaped ``(..., rows, cols)``), its float32 means over the last
    axis and over the second-to-last axis, read back as Adafactor's rank-1 reconstruction
    ``row[..., :, None] * col[..., None, :] / mean(row)`` (Shazeer & Stern, 2018), each index of
    the leading axes on its own: ``4 * (rows + cols)`` bytes per leading index in place of
    ``rows * cols`` codes. A rank-1 non-negative matrix is read back exactly. Since the means
    are linear, an exponential moving average of squares stored this way is Adafactor's
    factored average: the means of ``beta * v + (1 - beta) * g**2`` are ``beta`` times the
    stored means plus ``1 - beta`` times those of ``g**2``.

    Attributes:
      row: float32, ``shape[:-1]``: the mean over the last axis.
      col: float32, ``shape[:-2] + shape[-1:]``: the mean over the second-to-last axis.
      dtype: the name of the dtype the inner optimizer keeps the leaf in; static.
      shape: the leaf's shape; static.
      mapping: the map of the format's other second moments (``"linear4_unsigned"`` for
        ``"int4"``): it names the format this leaf is stored in, for readers that count bytes by
        format; static.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from triaccel_jax.transforms import dequantize_state, quantize_state
      >>> params = {"w": jnp.zeros((4, 3))}
      >>> tx = quantize_state(optax.adam(1.0), format="int4", min_size=1)
      >>> grads = {"w": jnp.outer(jnp.arange(1.0, 5.0), jnp.array([1.0, 2.0, 3.0]))}  # rank 1
      >>> _, state = tx.update(grads, tx.init(params), params)
      >>> nu = state.inner_state[0].nu["w"]
      >>> nu.row.shape, nu.col.shape  # 4 * (4 + 3) bytes for 12 elements
      ((4,), (3,))
      >>> bool(jnp.allclose(dequantize_state(state)[0].nu["w"], 0.001 * grads["w"] ** 2))
      True
    """

    row: jax.Array
    col: jax.Array
    dtype: str = dataclasses.field(metadata={"static": True})
    shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    mapping: str = dataclasses.field(default="linear4_unsigned", metadata={"static": True})


def _factor(value: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The float32 means of ``value`` over its last and its second-to-last axis."""
    value = value.astype(jnp.float32)
    return jnp.mean(value, axis=-1), jnp.mean(value, axis=-2)


def _unfactor(row: jax.Array, col: jax.Array) -> jax.Array:
    """Adafactor's rank-1 reconstruction ``row[..., :, None] * col[..., None, :] / mean(row)``
    (0 where the whole matrix is 0: the state at init). ``mean(row)`` is taken as ``mean(col)``,
    the same number: under FSDP the column means are whole on every device (their reduction
    over the sharded rows is the one all-reduce a factored leaf costs) and the row means are
    split, so this mean is local."""
    total = jnp.mean(col, axis=-1, keepdims=True)[..., None]  # (..., 1, 1)
    safe = jnp.where(total > 0, total, jnp.ones_like(total))
    outer = row[..., :, None] * col[..., None, :]
    return jnp.where(total > 0, outer / safe, jnp.zeros_like(outer))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CenteredState:
    """An optax state of a centered second moment, stored with its variance in place of ``nu``.

    ``optax.rmsprop(centered=True)`` keeps ``mu`` (the mean of the gradients) and ``nu`` (the
    mean of their squares) and divides by ``sqrt(nu - mu**2 + eps)``. Where the variance is
    small, ``nu`` and ``mu**2`` are nearly equal, and rounded independently their difference goes
    negative: NaN updates. :func:`quantize_state` stores such a state (optax's
    ``ScaleByRStdDevState`` and ``ScaleByRStdDevWithCountState``) as this node: ``state`` is the
    inner's state with ``nu`` replaced by the variance ``max(nu - |mu|**2, 0)``, which the
    zero-free map stores as a second moment, and each update reads ``nu`` back as ``variance +
    |mu|**2`` of the stored ``mu``, so ``nu - |mu|**2`` is the stored variance, never negative.

    Attributes:
      state: the inner's state node, its ``nu`` holding the centered variance.
    """

    state: Any


class QuantizedState(NamedTuple):
    """State of :func:`quantize_state`.

    Attributes:
      count: int32, updates so far; with ``key`` it gives each update its own random bits.
      key: uint32 PRNG key data (``jax.random.key_data``) from the wrapper's ``seed``.
      inner_state: the inner optimizer's state, its converted leaves as :class:`QuantizedLeaf`,
        :class:`FactoredLeaf` or :class:`Bfloat16Leaf` and every other node and leaf as the
        inner made it.
    """

    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count, as optax's states do
    key: jax.Array
    inner_state: Any


class _Spec(NamedTuple):
    format: str  # a name in FORMATS other than "fp32", or "factored" (a FactoredLeaf)
    mapping: str | None  # the coded formats' map
    block_size: int | None = None  # a stored leaf's, kept at every update


def _is_stored(node: Any) -> bool:
    return isinstance(node, QuantizedLeaf | FactoredLeaf | Bfloat16Leaf)


def _is_opaque(node: Any) -> bool:
    # The curvature signals' state is read by signals() and the planner as it is: never converted.
    return is_signal_state(node)


def _check_format(value: Any, where: str) -> str:
    if value is None:
        return "fp32"
    if not isinstance(value, str) or value not in FORMATS:
        raise ValueError(f"{where} must be one of {FORMATS}, got {value!r}")
    return value


def _check_options(
    format: Any, block_size: Any, min_size: Any, second_moments: Any, seed: Any, impl: Any
) -> tuple[FormatChoice, int | None, int, tuple[str, ...], int]:
    if isinstance(format, str):
        _check_format(format, "`format`")
    elif isinstance(format, Mapping):
        for name, value in format.items():
            if not isinstance(name, str):
                raise TypeError(f"`format` keys must be parameter paths (str), got {name!r}")
            _check_format(value, f"`format[{name!r}]`")
        format = dict(format)
    elif not callable(format):
        raise TypeError(
            f"`format` must be one of {FORMATS}, a mapping from parameter paths to them, or a "
            f"callable (path, leaf) -> format; got {type(format).__name__}"
        )
    if block_size is not None:
        block_size = quantize_lib.check_block_size(block_size)
    if isinstance(min_size, bool) or not isinstance(min_size, numbers.Integral):
        raise TypeError(f"`min_size` must be an int >= 0, got {min_size!r}")
    min_size = validation.check_integer("min_size", int(min_size), 0, strict=True)
    # Into a tuple before checking: a generator would be used up by the check itself.
    names = None if isinstance(second_moments, str) else _as_tuple(second_moments)
    if names is None or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"`second_moments` must be a sequence of state field names, got {second_moments!r}"
        )
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"`seed` must be an int, got {seed!r}")
    if not -(2**63) <= int(seed) < 2**63:  # jax.random.key's range, checked when built
        raise ValueError(f"`seed` must fit in 64 bits (-2**63 <= seed < 2**63), got {seed!r}")
    validation.check_choice("impl", impl, kernels.IMPLS)
    return format, block_size, min_size, names, int(seed)


def _as_tuple(items: Any) -> tuple[Any, ...] | None:
    """``tuple(items)``, or None where ``items`` is not iterable."""
    try:
        return tuple(items)
    except TypeError:
        return None


def _field_names(path: Sequence[Any]) -> set[str]:
    return {entry.name for entry in path if isinstance(entry, jax.tree_util.GetAttrKey)}


def _path_names(path: Sequence[Any]) -> set[str]:
    """The field names and string dict keys on ``path``: what a state's role is read from."""
    names = _field_names(path)
    names.update(
        entry.key
        for entry in path
        if isinstance(entry, jax.tree_util.DictKey) and isinstance(entry.key, str)
    )
    return names


def _is_known(node: Any) -> bool:
    return type(node) in _SECOND_MOMENTS_BY_TYPE


def _second_moment_leaves(tree: Any, names: tuple[str, ...]) -> list[bool]:
    """For each leaf of ``tree`` (flattened as the wrapper flattens the inner state), whether it
    is a non-negative second moment: a field of an optax state type that
    ``_SECOND_MOMENTS_BY_TYPE`` lists (by type, whatever the field's name), else a leaf under a
    field or dict key named in ``names``."""
    found: list[bool] = []
    nodes, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda node: _is_opaque(node) or _is_known(node)
    )
    for path, node in nodes:
        if _is_known(node):
            fields = _SECOND_MOMENTS_BY_TYPE[type(node)]
            leaves, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=_is_opaque)
            found.extend(getattr(inner[0], "name", None) in fields for inner, _ in leaves)
        else:
            found.append(bool(_path_names(path) & set(names)))
    return found


def _mapped_key(mapping: Mapping[str, str], name: str) -> str | None:
    """The longest key of ``mapping`` that ``name`` ends with (on a '/' boundary), or None."""
    best = None
    for key in mapping:
        if (name == key or name.endswith("/" + key)) and (best is None or len(key) > len(best)):
            best = key
    return best


def _check_mapping_paths(mapping: Mapping[str, str], state_paths: list[str], params: Any) -> None:
    """Refuses a key of ``mapping`` that names no parameter and no state leaf, naming the
    nearest path: a misspelt path would otherwise keep its leaf in float32 without a word."""
    param_paths = [
        tree_lib.path_string(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    ]
    known = [*param_paths, *state_paths]
    for key in mapping:
        if any(path == key or path.endswith("/" + key) for path in known):
            continue
        nearest = difflib.get_close_matches(key, param_paths or known, n=1, cutoff=0.0)
        hint = f"; the nearest parameter path is {nearest[0]!r}" if nearest else ""
        raise ValueError(
            f"`format` names {key!r}, which is no parameter path and no state leaf path (nor a "
            f"'/'-bounded end of one){hint}"
        )


def _eligible(path: Sequence[Any], leaf: Any, min_size: int) -> bool:
    """Whether a leaf of the inner state can be stored in fewer bits: a floating-point array of
    at least ``min_size`` elements (never a scalar), not a hyperparameter of
    ``inject_hyperparams`` nor the curvature signals' state."""
    if _is_opaque(leaf) or not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
        return False
    if _field_names(path) & set(_HYPERPARAM_FIELDS):
        return False
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
        return False
    return len(leaf.shape) > 0 and math.prod(leaf.shape) >= max(min_size, 1)


def _spec(
    path: Sequence[Any],
    leaf: Any,
    format: FormatChoice,
    min_size: int,
    second_moment: bool,
) -> _Spec | None:
    """How one leaf of the inner state is stored; None: as the inner keeps it.

    A string format applies to every eligible leaf (:func:`_eligible`); a callable is asked
    about the eligible leaves only (a count or a small bias has no choice to make); a mapping
    that names a non-float leaf is an error, because a user named it.
    """
    if _is_opaque(leaf) or not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
        return None
    if _field_names(path) & set(_HYPERPARAM_FIELDS):
        return None
    name = tree_lib.path_string(path)
    if isinstance(format, str):
        chosen = format
    elif isinstance(format, Mapping):
        key = _mapped_key(format, name)
        chosen = _check_format(
            None if key is None else format[key], f"`format` for state leaf {name!r}"
        )
        if chosen != "fp32" and not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise ValueError(
                f"state leaf {name!r} is {jnp.dtype(leaf.dtype).name}: only floating-point "
                f"leaves can be stored in {chosen!r} (`format[{key!r}]`)"
            )
    elif _eligible(path, leaf, min_size):
        abstract = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
        chosen = _check_format(format(name, abstract), f"`format({name!r}, ...)`")
    else:
        return None
    if chosen == "fp32" or not _eligible(path, leaf, min_size):
        return None
    if chosen == "bf16":
        if jnp.dtype(leaf.dtype).itemsize <= 2:  # already 16 bits or fewer
            return None
        return _Spec("bf16", None)
    state = policy_lib.state_format(chosen)
    mapping = state.unsigned_map if second_moment else state.signed_map
    if second_moment and state.factored and len(leaf.shape) >= 2:
        # The registry's factored second moment (int4's): row and column means, no codes.
        return _Spec("factored", mapping)
    return _Spec(chosen, mapping)


# -- centered second moments -------------------------------------------------------------------


def _abs_sq(x: jax.Array) -> jax.Array:
    # optax's abs_sq: |x|**2, real for a complex x.
    return (x.real * x.real + x.imag * x.imag) if jnp.iscomplexobj(x) else x * x


def _centered_fields(node: Any) -> tuple[str, str]:
    mean, second = _CENTERED[type(node)]
    return mean, second


def _center(node: Any) -> CenteredState:
    """A ``ScaleByRStdDevState``-like node as stored: its ``nu`` replaced by ``nu - |mu|**2``
    (clamped at 0: rounding in the inner's own float arithmetic may leave it a hair below)."""
    mean, second = _centered_fields(node)

    def variance(m: jax.Array, n: jax.Array) -> jax.Array:
        return jnp.maximum(n - _abs_sq(m).astype(n.dtype), jnp.zeros((), n.dtype))

    values = jax.tree.map(variance, getattr(node, mean), getattr(node, second))
    return CenteredState(node._replace(**{second: values}))


def _uncenter(node: CenteredState) -> Any:
    """The inner's node back from :func:`_center`'s: ``nu = variance + |mu|**2``. With the
    stored ``mu``, ``nu - |mu|**2`` then rounds to a number >= 0 (``(a + b) - b >= 0`` for
    ``a, b >= 0`` in floating point), so the update's root is real."""
    inner = node.state
    mean, second = _centered_fields(inner)
    values = jax.tree.map(
        lambda m, v: v + _abs_sq(m).astype(v.dtype), getattr(inner, mean), getattr(inner, second)
    )
    return inner._replace(**{second: values})


def _is_centered_kind(node: Any) -> bool:
    return type(node) in _CENTERED


def _center_where(tree: Any, stored: list[bool]) -> Any:
    """``tree`` with each centered-moment node that holds a stored leaf (``stored``, one flag per
    leaf as :func:`_second_moment_leaves` counts them) replaced by :func:`_center`'s. The leaves
    keep their order: a :class:`CenteredState` flattens as the node it holds."""
    nodes, treedef = jax.tree_util.tree_flatten(
        tree, is_leaf=lambda node: _is_opaque(node) or _is_centered_kind(node)
    )
    position = 0
    out = []
    for node in nodes:
        count = len(jax.tree_util.tree_leaves(node, is_leaf=_is_opaque))
        if _is_centered_kind(node) and any(stored[position : position + count]):
            node = _center(node)
        out.append(node)
        position += count
    return jax.tree_util.tree_unflatten(treedef, out)


def _uncenter_all(tree: Any) -> Any:
    """``tree`` with every :class:`CenteredState` read back as the inner's node."""
    return jax.tree.map(
        lambda node: _uncenter(node) if isinstance(node, CenteredState) else node,
        tree,
        is_leaf=lambda node: isinstance(node, CenteredState) or _is_opaque(node),
    )


def _recenter_like(tree: Any, like: Any) -> Any:
    """``tree`` (the inner's new state) with the nodes centered that are centered in ``like``
    (the state it was given, as stored)."""
    nodes, _ = jax.tree_util.tree_flatten(
        tree, is_leaf=lambda node: _is_opaque(node) or _is_centered_kind(node)
    )
    marks, treedef = jax.tree_util.tree_flatten(
        like,
        is_leaf=lambda node: (
            _is_opaque(node) or _is_centered_kind(node) or isinstance(node, CenteredState)
        ),
    )
    if len(nodes) != len(marks):
        raise ValueError(
            "the inner optimizer's update returned a state of another structure than it was "
            f"given ({len(nodes)} nodes, {len(marks)} before)"
        )
    out = [
        _center(node) if isinstance(mark, CenteredState) else node
        for node, mark in zip(nodes, marks, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


# -- the update, leaf group by leaf group ------------------------------------------------------
#
# The inner update is traced once to a jaxpr and evaluated equation by equation in another
# order: first everything that reads no stored leaf (counts, bias corrections, a global norm of
# the gradients), then, group after group, what reads a group's stored leaves, where a group is
# the stored leaves that some equation reads together (AdamW's mu and nu of one parameter; all
# of them for an inner that reduces over its moments). Each group's stored leaves are
# dequantized only after the previous group's new state is stored and its updates computed (an
# optimization barrier orders them), so at most one group's full-precision state lives at a
# time: XLA materializes a leaf's new moment for its block maxima, and without the order it ran
# every leaf's dequantize and update first, holding the whole state in full precision.
# Calls to jitted functions (optax's tree_bias_correction takes every moment at once) are
# inlined to see through them; anything else (scan, cond, custom derivatives) is one equation.


class _Equation(NamedTuple):
    primitive: Any
    params: dict[str, Any]
    inputs: tuple[Any, ...]  # each an int (a value's id) or a _Constant
    outputs: tuple[int | None, ...]  # None: dropped
    context: Any  # the equation's context (its compute type, say), entered as eval_jaxpr does


class _Constant(NamedTuple):
    value: Any


_CALLS = ("jit",)  # the primitive of a call to a jitted function


def _inline(closed: Any) -> tuple[list[_Equation], list[int], list[Any]]:
    """The equations of ``closed`` with calls inlined: ``(equations, input ids, output atoms)``."""
    ids = itertools.count()
    equations: list[_Equation] = []

    def walk(jaxpr: Any, consts: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, inputs, strict=True))

        def read(atom: Any) -> Any:
            return _Constant(atom.val) if isinstance(atom, jex_core.Literal) else env[atom]

        for eqn in jaxpr.eqns:
            args = [read(atom) for atom in eqn.invars]
            body = eqn.params.get("jaxpr") if eqn.primitive.name in _CALLS else None
            if body is not None:
                body_consts = [_Constant(c) for c in getattr(body, "consts", ())]
                outs = walk(getattr(body, "jaxpr", body), body_consts, args)
            else:
                outs = [None if isinstance(v, jex_core.DropVar) else next(ids) for v in eqn.outvars]
                equations.append(
                    _Equation(eqn.primitive, eqn.params, tuple(args), tuple(outs), eqn.ctx)
                )
            for var, out in zip(eqn.outvars, outs, strict=True):
                if not isinstance(var, jex_core.DropVar):
                    env[var] = out
        return [read(atom) for atom in jaxpr.outvars]

    inputs = [next(ids) for _ in closed.jaxpr.invars]
    outputs = walk(closed.jaxpr, [_Constant(c) for c in closed.consts], inputs)
    return equations, inputs, outputs


def _groups(
    equations: list[_Equation], stored_inputs: dict[int, int], stored_outputs: dict[int, Any]
) -> tuple[dict[int, int], dict[int, frozenset[int]]]:
    """Which group each stored leaf is in, and the stored leaves each value depends on.

    Args:
      equations: the inlined equations.
      stored_inputs: value id of each stored leaf's dequantized input -> the leaf's index.
      stored_outputs: index of each stored leaf -> the atom the inner returns for it.

    Returns:
      ``(group, depends)``: each stored index's group (the smallest index in it), and for each
      value id the stored indices it was computed from.
    """
    parent = {index: index for index in stored_outputs}

    def find(index: int) -> int:
        while parent[index] != index:
            parent[index] = parent[parent[index]]
            index = parent[index]
        return index

    def union(indices: frozenset[int]) -> None:
        roots = sorted({find(i) for i in indices})
        for root in roots[1:]:
            parent[root] = roots[0]

    depends = {value: frozenset([index]) for value, index in stored_inputs.items()}
    empty: frozenset[int] = frozenset()
    for eqn in equations:
        reads = empty.union(
            *(depends.get(atom, empty) for atom in eqn.inputs if isinstance(atom, int))
        )
        union(reads)
        for out in eqn.outputs:
            if out is not None:
                depends[out] = reads
    for index, atom in stored_outputs.items():
        union(frozenset([index]) | (depends.get(atom, empty) if isinstance(atom, int) else empty))
    return {index: find(index) for index in stored_outputs}, depends


def _grouped_update(
    update: Callable[..., tuple[Any, Any]],
    updates: Any,
    nodes: list[Any],
    treedef: Any,
    params: Any,
    load: Callable[[Any], Any],
    store: Callable[[int, Any, jax.Array], Any],
) -> tuple[Any, list[Any]]:
    """``update(updates, state, params)`` on the loaded state, storing the new state group by group.

    Args:
      update: the inner update, extra arguments bound.
      updates: the gradients.
      nodes: the flattened inner state: stored leaves (:class:`QuantizedLeaf`,
        :class:`Bfloat16Leaf`) and the inner's own leaves.
      treedef: the inner state's structure over ``nodes``.
      params: the parameters (or None).
      load: a stored leaf -> its full-precision value.
      store: ``(index, old stored leaf, new value)`` -> the new stored leaf.

    Returns:
      ``(new updates, new nodes)``, the nodes stored as they were given.
    """
    grads, grads_def = jax.tree_util.tree_flatten(updates)
    leaves, params_def = jax.tree_util.tree_flatten(params)
    stored = [i for i, node in enumerate(nodes) if _is_stored(node)]
    abstract = [
        jax.ShapeDtypeStruct(_stored_shape(node), node.dtype) if _is_stored(node) else node
        for node in nodes
    ]

    def flat(grads: list[Any], state: list[Any], leaves: list[Any]) -> tuple[Any, Any]:
        return update(
            jax.tree_util.tree_unflatten(grads_def, grads),
            jax.tree_util.tree_unflatten(treedef, state),
            jax.tree_util.tree_unflatten(params_def, leaves),
        )

    closed, shapes = jax.make_jaxpr(flat, return_shape=True)(grads, abstract, leaves)
    out_updates_def = jax.tree.structure(shapes[0])
    n_out_updates = len(jax.tree.leaves(shapes[0]))
    n_out_state = len(jax.tree.leaves(shapes[1]))
    if n_out_state != len(nodes):
        raise ValueError(
            "the inner optimizer's update returned a state of another structure than it was "
            f"given ({n_out_state} leaves, {len(nodes)} before)"
        )
    if closed.jaxpr.effects:
        # Side effects keep their order: everything loaded, evaluated as traced, then stored.
        loaded = [load(node) if _is_stored(node) else node for node in nodes]
        outs = jex_core.jaxpr_as_fun(closed)(*grads, *loaded, *leaves)
        new_nodes = [
            store(i, node, outs[n_out_updates + i]) if _is_stored(node) else outs[n_out_updates + i]
            for i, node in enumerate(nodes)
        ]
        return jax.tree_util.tree_unflatten(out_updates_def, outs[:n_out_updates]), new_nodes

    equations, inputs, outputs = _inline(closed)
    state_inputs = inputs[len(grads) : len(grads) + len(nodes)]
    stored_inputs = {state_inputs[i]: i for i in stored}
    state_outputs = outputs[n_out_updates:]
    group, depends = _groups(equations, stored_inputs, {i: state_outputs[i] for i in stored})

    def group_of(atom: Any) -> int | None:
        reads = depends.get(atom, frozenset()) if isinstance(atom, int) else frozenset()
        return group[min(reads)] if reads else None

    env: dict[int, Any] = dict(zip(inputs, [*grads, *nodes, *leaves], strict=True))
    for value in stored_inputs:
        del env[value]  # loaded with its group

    def run(eqn: _Equation) -> None:
        args = [atom.value if isinstance(atom, _Constant) else env[atom] for atom in eqn.inputs]
        with eqn.context.manager:
            outs = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
        outs = outs if eqn.primitive.multiple_results else [outs]
        for out, value in zip(eqn.outputs, outs, strict=True):
            if out is not None:
                env[out] = value

    def read(atom: Any) -> Any:
        return atom.value if isinstance(atom, _Constant) else env[atom]

    by_group: dict[int | None, list[_Equation]] = {}
    for eqn in equations:
        first = next((atom for atom in eqn.inputs if group_of(atom) is not None), None)
        by_group.setdefault(None if first is None else group_of(first), []).append(eqn)
    for eqn in by_group.pop(None, []):
        run(eqn)

    # Each output of the inner update: in the stored leaves' group it is computed in, or shared.
    owner: dict[int, int | None] = {}
    for position, atom in enumerate(outputs):
        state_index = position - n_out_updates
        owner[position] = group[state_index] if state_index in group else group_of(atom)
    results: list[Any] = [None] * len(outputs)
    for position, atom in enumerate(outputs):
        if owner[position] is None:
            results[position] = read(atom)

    previous: list[int] = []
    for root in sorted(set(group.values())):
        members = [i for i in stored if group[i] == root]
        raw = [nodes[i] for i in members]
        if previous:
            # This group's scales (bf16 values) pass an optimization barrier with the previous
            # group's results: its loads wait for them.
            gates = [_gate(node) for node in raw]
            gates, _ = jax.lax.optimization_barrier((gates, [results[p] for p in previous]))
            raw = [_gated(node, gate) for node, gate in zip(raw, gates, strict=True)]
        for i, node in zip(members, raw, strict=True):
            env[state_inputs[i]] = load(node)
        for eqn in by_group.get(root, []):
            run(eqn)
        previous = [p for p, g in owner.items() if g == root]
        for position in previous:
            state_index = position - n_out_updates
            atom = outputs[position]
            if state_index in group and atom == state_inputs[state_index]:
                # Returned as it came: kept as stored, not rounded again.
                results[position] = nodes[state_index]
            elif state_index in group:
                results[position] = store(state_index, nodes[state_index], read(atom))
            else:
                results[position] = read(atom)
    new_updates = jax.tree_util.tree_unflatten(out_updates_def, results[:n_out_updates])
    return new_updates, results[n_out_updates:]


def _gate(node: Any) -> jax.Array:
    """The part of a stored leaf that a barrier holds back: its scales (a factored leaf: its
    row means; bf16: its values)."""
    if isinstance(node, QuantizedLeaf):
        return node.scales
    return node.row if isinstance(node, FactoredLeaf) else node.value


def _gated(node: Any, gate: jax.Array) -> Any:
    """``node`` with :func:`_gate`'s part replaced."""
    if isinstance(node, QuantizedLeaf):
        return dataclasses.replace(node, scales=gate)
    if isinstance(node, FactoredLeaf):
        return dataclasses.replace(node, row=gate)
    return dataclasses.replace(node, value=gate)


def _stored_shape(node: Any) -> tuple[int, ...]:
    if isinstance(node, QuantizedLeaf):
        return node.shape if node.shape is not None else tuple(node.codes.shape)
    if isinstance(node, FactoredLeaf):
        return node.shape
    return tuple(node.value.shape)


def quantize_state(
    inner: optax.GradientTransformation,
    *,
    format: FormatChoice = "int8",
    rounding: str = "nearest",
    block_size: int | None = None,
    min_size: int = 4096,
    second_moments: Sequence[str] = SECOND_MOMENTS,
    seed: int = 0,
    impl: str = "auto",
) -> optax.GradientTransformationExtraArgs:
    """Keeps another optimizer's state in bfloat16, 8- or 4-bit blocks between its updates.

    Each update dequantizes the stored leaves to the dtype the inner optimizer made them in
    (float32 for an optimizer over float32 params), runs ``inner.update`` on them (extra
    arguments forwarded), and stores the new state again. Formats (docs/design.md §3.9):

    * ``"int8"``: block-wise 8-bit codes with one float32 scale (the absolute maximum) per
      ``block_size`` consecutive elements (Dettmers et al., 2021). Signed leaves use a linear
      map (int8 codes ``c`` for ``c * absmax / 127``); non-negative second moments use a map
      linear in the square root and without a zero level (uint8 codes ``c`` for
      ``absmax * ((c + 1) / 256) ** 2``), so a small second moment is never stored as zero,
      which would turn ``m / (sqrt(v) + eps)`` into ``m / eps`` (Li et al., 2023). About 1
      byte per element plus ``4 / block_size``.
    * ``"int8_dynamic"``: the registry's dynamic-exponent 8-bit maps
      (:data:`triaccel_jax.policy.STATE_FORMATS`).
    * ``"int4"``: signed leaves in the registry's dynamic-exponent 4-bit map, codes packed two
      per byte with one scale per 128 (0.53 bytes per element); a non-negative second moment of
      rank >= 2 stored factored (the registry's ``StateFormat.factored``), as a
      :class:`FactoredLeaf`: its float32 means over the last axis and over the second-to-last,
      read back as Adafactor's rank-1 reconstruction (Shazeer & Stern, 2018; the "4-bit
      Factor" state of Li et al., 2023), ``4 * (rows + cols)`` bytes per leading index, so
      that an EMA of squares (Adam's ``nu``) is Adafactor's factored EMA; 1-D second moments in
      the zero-free 4-bit map. AdamW over float32 matrices of 1024 x 1024 and 512 x 2048 then
      takes 4.54 bytes a parameter with its parameters (12.0 in float32, 8.0 at ``"bf16"``,
      6.03 at ``"int8"``), Muon 4.53 (8.0, 6.0, 5.02): :func:`compiled_state_bytes`, equal to
      :meth:`triaccel_jax.policy.StateFormat.leaf_bytes`' count.
    * ``"bf16"``: bfloat16, 2 bytes per element (leaves already 16 bits or narrower are kept).
    * ``"fp32"``: the leaf as the inner keeps it.

    **Blocks along the last axis.** A coded leaf's blocks are cut within each row of its last
    axis (``layout="rows"`` of :mod:`triaccel_jax.kernels.quantize`; a row shorter than the
    block is one block), so its codes and scales split along the leading axes as the leaf does:
    a leaf sharded along its leading axes (FSDP) is quantized shard by shard, and a sharded
    update adds no collective under Auto or Explicit meshes, whatever the shape. A leaf sharded
    along its last axis (tensor parallel) stays local when ``block_size`` divides each
    device's columns (``block_size=125`` for 1000 columns on 8 devices); otherwise an Explicit
    mesh refuses the blocks by name and an Auto mesh moves data. A factored second moment's
    column means reduce over a leaf's rows: under FSDP that is one all-reduce per factored leaf
    and step (of ``cols`` floats; its row means shard like the leaf, its column means are
    replicated). Short rows cost scales: a row of 128 with blocks of 256 carries one scale per
    128 elements. ``impl="triton"`` stores the flattened leaf's blocks, which the Triton
    kernels implement (a kernel call sees the whole array: for unsharded leaves).

    **Second moments** are found by role: in a state of one of optax's types, by its type
    (Adam's, RMSProp's, AdaBelief's and Novograd's ``nu``, AMSGrad's ``nu`` and ``nu_max``,
    Adagrad's ``sum_of_squares``, Adafactor's ``v_row``, ``v_col`` and ``v``, Adadelta's
    ``e_g`` and ``e_x``, Adan's ``n``, SM3's accumulators ``mu`` (its ``nu`` is a signed
    momentum), optax.contrib's ``exp_avg_sq``); in any other state (a dict, a custom
    NamedTuple), by the field names and dict keys in ``second_moments``.

    **Centered second moments.** ``optax.rmsprop(centered=True)`` divides by
    ``sqrt(nu - mu**2 + eps)``; ``nu`` and ``mu**2`` rounded independently differ by a
    negative number where the variance is small, and the update is NaN. Its state is stored
    as a :class:`CenteredState`: ``mu`` and the variance ``max(nu - mu**2, 0)`` (a second
    moment), from which each update reads ``nu`` back, so the variance it sees is the stored
    one, never negative.

    Only floating-point leaves of at least ``min_size`` elements (never scalars) are converted;
    counts, hyperparameters of ``optax.inject_hyperparams`` (which stay findable and settable
    inside this state) and the state of :func:`triaccel_jax.curvature_signals` (which
    :func:`triaccel_jax.signals` reads) are always left as they are. State shapes and dtypes are
    the same at every step, so a jitted step never retraces.

    **Rounding.** ``"nearest"`` (the default) rounds each new value to the nearest level, as
    bitsandbytes' and torchao's 8-bit optimizers and the 4-bit states of Li et al. do.
    ``"stochastic"`` rounds up or down with probabilities that make the stored value unbiased,
    so that an EMA's increments smaller than half a level are kept in expectation instead of
    rounded away (Gupta et al., 2015), with random bits from a counter hash of each element's
    index keyed by ``seed``, the update's count and the leaf
    (:func:`triaccel_jax.kernels.quantize.random_bits`). The first store, at ``init``, rounds
    to nearest either way. The default is the study's (benchmarks/state_precision.py, AdamW at lr 0.004, seeds 0-4 paired,
    Fashion-MNIST, 2026-12-05): test accuracy against float32 state, MLP 3 epochs, int8 nearest
    -0.08 [-0.25, +0.10] points and stochastic +0.01 [-0.08, +0.11]; CNN 1 epoch, int8 nearest
    +0.09 [-0.29, +0.48] and stochastic -0.07 [-0.34, +0.20]; bf16 alike (95% paired
    intervals): no difference either rounding shows, while stochastic rounding's bits make the
    int8 update 1.2 to 1.3 times as long on a CPU (benchmarks/state_update_cost.py).

    **Order.** The inner update is traced once and evaluated group by group: first what reads
    no stored leaf (counts, a global norm of the gradients), then each group of stored leaves
    that the inner reads together (AdamW's ``mu`` and ``nu`` of one parameter; every leaf, for
    an inner that reduces over its whole state), dequantized, updated and stored again before
    the next group's are loaded. At most one group's state is in full precision at a time, so
    the update's compiled peak is below fp32 AdamW's (0.73x on four 1024 x 1024 leaves with
    int8 state), where loading every leaf first held the whole state in float32 beside the
    stored one. The inner's side effects, if any, keep their order (it is evaluated as traced).

    Args:
      inner: the optimizer whose state is stored (any optax ``GradientTransformation``).
      format: ``"int8"``, ``"int8_dynamic"``, ``"int4"``, ``"bf16"`` or ``"fp32"`` (a name in
        :data:`triaccel_jax.policy.STATE_FORMATS`, whose maps store the signed leaves and the
        second moments) for every eligible leaf; or a mapping from
        parameter paths as :func:`triaccel_jax.signals` names them (``"dense/kernel"``) to
        formats, a state leaf taking the entry of the longest path its own path ends with
        (``"0/mu/dense/kernel"`` takes ``"dense/kernel"``) and ``"fp32"`` without one (a path
        that names no parameter and no state leaf is refused at ``init``, naming the nearest
        parameter path; a mapping that asks for a non-float leaf to be converted is an error);
        or a callable ``(path, leaf) -> format`` called with the path (``"/"``-joined) and a
        ``jax.ShapeDtypeStruct`` of each state leaf that can be stored (floating point, at
        least ``min_size`` elements, not a hyperparameter: never a count), returning a format
        or None (``"fp32"``), so that ``lambda path, leaf: "int8"`` is ``"int8"``.
      rounding: ``"nearest"`` or ``"stochastic"``, how each update stores its new state (static).
      block_size: elements per quantization block (an int >= 1; static, it sets the scales'
        shape); None: each coded format's own (:data:`triaccel_jax.policy.STATE_FORMATS`: 256
        for ``"int8"`` and ``"int8_dynamic"``, 128 for ``"int4"``).
      min_size: leaves with fewer elements keep the inner's format: their bytes are negligible
        and their blocks would be mostly scale. 4096 is bitsandbytes' default.
      second_moments: field names and dict keys whose leaves are non-negative second moments,
        stored with the square-root map under ``"int8"``, in states of a type other than
        optax's own (whose second moments are known by type). A negative value there is stored
        as the lowest level: leave out a name your state uses for a signed leaf (a velocity
        ``v``).
      seed: seeds the stochastic rounding (an int that fits in 64 bits, as ``jax.random.key``
        takes); unread with ``rounding="nearest"``.
      impl: the implementation of the int8 quantize/dequantize kernels and of bf16's round to
        nearest: ``"auto"`` (the Triton kernel only where ``kernels/auto_table.json`` measured
        it faster on CUDA), ``"reference"`` or ``"triton"``
        (:func:`triaccel_jax.kernels.quantize.quantize_blocks`). bf16's stochastic rounding is
        always XLA's, fused with the update (:func:`triaccel_jax.kernels.cast.round_stochastic`).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`QuantizedState`.

    Raises:
      ValueError: an unknown format or rounding, ``block_size`` < 1, ``min_size`` < 0, a
        ``seed`` beyond 64 bits, an unknown ``impl``; at ``init``, a mapping asking for a
        non-float leaf to be converted or naming a path that is no leaf's, a callable
        returning an unknown format.
      TypeError: ``inner`` not a ``GradientTransformation`` (a factory such as ``optax.adam``,
        uncalled, is named), ``block_size``, ``min_size`` or ``seed`` not an int, ``format``
        neither a string, a mapping nor a callable.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import triaccel_jax
      >>> params = {"w": jnp.ones((64, 64)), "b": jnp.zeros(64)}
      >>> tx = triaccel_jax.quantize_state(optax.adamw(1e-3), format="int8", min_size=1024)
      >>> state = tx.init(params)
      >>> adam = state.inner_state[0]
      >>> adam.mu["w"].codes.dtype, adam.nu["w"].codes.dtype, adam.mu["b"].dtype
      (dtype('int8'), dtype('uint8'), dtype('float32'))

      Under ``"int4"``, Adam's second moment of a matrix is kept as its row and column means:

      >>> tx = triaccel_jax.quantize_state(optax.adamw(1e-3), format="int4", min_size=1024)
      >>> nu = tx.init(params).inner_state[0].nu["w"]
      >>> type(nu).__name__, nu.row.shape, nu.col.shape
      ('FactoredLeaf', (64,), (64,))

      Any optimizer: SGD's momentum, stored in 8 bits and updated under ``jit``:

      >>> tx = triaccel_jax.quantize_state(optax.sgd(0.1, momentum=0.9), min_size=1024)
      >>> state = tx.init(params)
      >>> grads = jax.tree.map(jnp.ones_like, params)
      >>> updates, state = jax.jit(tx.update)(grads, state, params)
      >>> round(float(updates["w"][0, 0]), 6), state.inner_state[0].trace["w"].codes.dtype
      (-0.1, dtype('int8'))

    References:
      Dettmers, Lewis, Shleifer & Zettlemoyer, 2021, "8-bit Optimizers via Block-wise
      Quantization", arXiv 2110.02861. Li, Chen & Zhu, 2023, "Memory Efficient Optimizers with
      4-bit States", arXiv 2309.01507. Gupta et al., 2015, "Deep Learning with Limited
      Numerical Precision" (stochastic rounding). Shazeer & Stern, 2018, "Adafactor: Adaptive
      Learning Rates with Sublinear Memory Cost", arXiv 1804.04235 (factored second moments).
    """
    _check_inner(inner)
    format, block_size, min_size, second_moments, seed = _check_options(
        format, block_size, min_size, second_moments, seed, impl
    )
    validation.check_choice("rounding", rounding, ROUNDINGS)
    inner = optax.with_extra_args_support(inner)
    # Blocks along the last axis, so that a sharded leaf's codes and scales shard as it does and
    # its update adds no collective; the Triton kernels implement the flattened leaf's blocks,
    # and a Triton call sees the whole array, so impl="triton" (unsharded leaves) keeps those.
    layout = "flat" if impl == "triton" else "rows"

    def store(leaf: jax.Array, spec: _Spec, dtype: str, key: jax.Array | None) -> Any:
        # key None: round to nearest (always at init); else stochastically with the counter hash.
        if spec.format == "bf16":
            if key is None:
                value = cast_kernel.cast(leaf, jnp.bfloat16, impl=impl)
            else:
                bits = quantize_lib.random_bits(key, leaf.shape)
                value = cast_kernel.round_stochastic(leaf, jnp.bfloat16, bits)
            return Bfloat16Leaf(value, dtype)
        if spec.format == "factored":
            # Means, not codes: nothing to round (key unread).
            row, col = _factor(leaf)
            assert spec.mapping is not None
            return FactoredLeaf(row, col, dtype, tuple(leaf.shape), spec.mapping)
        assert spec.mapping is not None
        size = spec.block_size or block_size or policy_lib.state_format(spec.format).block_size
        assert size is not None
        codes, scales = quantize_lib.quantize_blocks(
            leaf,
            block_size=size,
            mapping=spec.mapping,
            rounding="nearest" if key is None else "stochastic",
            key=key,
            impl=impl,
            layout=layout,
        )
        packed = quantize_lib.MAP_BITS[spec.mapping] < 8
        return QuantizedLeaf(
            codes,
            scales,
            spec.mapping,
            dtype,
            size,
            tuple(leaf.shape) if packed else None,
            layout,
        )

    def load(node: Any) -> Any:
        return _load(node, impl)

    def to_stored(inner_state: Any, params: Any) -> Any:
        # The inner's plain state as this wrapper stores it, rounded to nearest: at init, and
        # for a state converted from another format (to_quantized_state).
        flat, _ = jax.tree_util.tree_flatten_with_path(inner_state, is_leaf=_is_opaque)
        if isinstance(format, Mapping):
            _check_mapping_paths(format, [tree_lib.path_string(p) for p, _ in flat], params)
        roles = _second_moment_leaves(inner_state, second_moments)
        specs = [
            _spec(path, leaf, format, min_size, role)
            for (path, leaf), role in zip(flat, roles, strict=True)
        ]
        # Centered before anything is rounded: the variance from the full-precision moments.
        centered = _center_where(inner_state, [spec is not None for spec in specs])
        values, treedef = jax.tree_util.tree_flatten(centered, is_leaf=_is_opaque)
        leaves = [
            value if spec is None else store(value, spec, value.dtype.name, None)
            for value, spec in zip(values, specs, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def key_data() -> jax.Array:
        return jax.random.key_data(jax.random.key(seed))

    def init_fn(params: Any) -> QuantizedState:
        return QuantizedState(
            count=jnp.zeros([], jnp.int32),
            key=key_data(),
            inner_state=to_stored(inner.init(params), params),
        )

    def convert(state: Any, params: Any) -> QuantizedState:
        count = state.count if isinstance(state, QuantizedState) else jnp.zeros([], jnp.int32)
        plain = _match_structure(dequantize_state(state), jax.eval_shape(inner.init, params))
        return QuantizedState(count=count, key=key_data(), inner_state=to_stored(plain, params))

    def update_fn(
        updates: Any, state: QuantizedState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, QuantizedState]:
        nodes, treedef = jax.tree_util.tree_flatten(state.inner_state, is_leaf=_is_stored)
        leaf_keys: dict[int, jax.Array] = {}
        if rounding == "stochastic":
            # One key per stored leaf, all in one vectorized fold, each then an opaque buffer
            # (the barriers): fused into the leaf's kernels, its index would be a constant there,
            # and leaves of one shape, each kernel then different, would not share a compiled
            # kernel (XLA compiles identical fused computations once).
            indices = [
                i
                for i, node in enumerate(nodes)
                if _is_stored(node) and not isinstance(node, FactoredLeaf)  # means: not rounded
            ]
            step_key = quantize_lib.fold_in(state.key, state.count)
            every = jax.lax.optimization_barrier(
                quantize_lib.fold_in(step_key, jnp.asarray(indices, jnp.uint32))
            )
            leaf_keys = dict(zip(indices, jax.lax.optimization_barrier(list(every)), strict=True))

        def store_new(index: int, old: Any, new: jax.Array) -> Any:
            # Stored as the old leaf was: the layout fixed at init, so the state's structure (and
            # the compiled step) never changes.
            if isinstance(old, QuantizedLeaf):
                spec = _Spec("coded", old.mapping, old.block_size)
            elif isinstance(old, FactoredLeaf):
                spec = _Spec("factored", old.mapping)
            else:
                spec = _Spec("bf16", None)
            key = leaf_keys.get(index)
            if spec.format != "bf16":
                # Computed once into memory, where the block maxima read it anyway: without the
                # barrier XLA recomputed the inner's update from the old codes in the fusion
                # that writes the new ones (on a CPU, 30% more time for AdamW's update).
                new = jax.lax.optimization_barrier(new)
            return store(new.astype(old.dtype), spec, old.dtype, key)

        inner_update = functools.partial(inner.update, **extra_args)
        if _has_centered(state.inner_state):
            # The inner reads its nu back from the stored variance and mean, and its new nu is
            # centered again (from its full-precision mean) before it is stored.
            inner_update = functools.partial(_centered_update, inner_update)
        updates, new_nodes = _grouped_update(
            inner_update, updates, nodes, treedef, params, load, store_new
        )
        new_state = QuantizedState(
            count=optax.safe_increment(state.count),
            key=state.key,
            inner_state=jax.tree_util.tree_unflatten(treedef, new_nodes),
        )
        return updates, new_state

    _CONVERTERS[init_fn] = convert
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# The wrappers quantize_state built, by their init function (which every copy of the
# GradientTransformation shares), to what converts a state into theirs: the options stay the
# wrapper's, without a field on optax's NamedTuple. Weak keys: a wrapper dropped is forgotten.
_CONVERTERS: weakref.WeakKeyDictionary[Callable[..., Any], Callable[[Any, Any], QuantizedState]]
_CONVERTERS = weakref.WeakKeyDictionary()


def _check_inner(inner: Any) -> None:
    """Refuses, when the wrapper is built, what is not a GradientTransformation: a factory such
    as ``optax.adam`` would otherwise fail only at ``init``, far from the mistake."""
    if callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None)):
        return
    if callable(inner):
        name = getattr(inner, "__qualname__", None) or type(inner).__name__
        module = getattr(inner, "__module__", None)
        where = f"{module.split('.')[0]}.{name}" if module else name
        raise TypeError(
            f"`inner` must be an optax GradientTransformation; {where} is a function that "
            f"builds one: call it, e.g. quantize_state({where}(1e-3))"
        )
    raise TypeError(f"`inner` must be an optax GradientTransformation, got {type(inner).__name__}")


def _has_centered(tree: Any) -> bool:
    return any(
        isinstance(node, CenteredState)
        for node in jax.tree_util.tree_leaves(
            tree, is_leaf=lambda node: isinstance(node, CenteredState) or _is_opaque(node)
        )
    )


def _centered_update(
    update: Callable[..., tuple[Any, Any]], updates: Any, state: Any, params: Any = None
) -> tuple[Any, Any]:
    """The inner update over a state holding :class:`CenteredState` nodes."""
    new_updates, new_state = update(updates, _uncenter_all(state), params)
    return new_updates, _recenter_like(new_state, state)


def _load(node: Any, impl: str = "auto") -> Any:
    """A stored leaf's value in the dtype the inner keeps it in (any other node as it is)."""
    if isinstance(node, Bfloat16Leaf):
        return node.value.astype(node.dtype)
    if isinstance(node, FactoredLeaf):
        return _unfactor(node.row, node.col).astype(node.dtype)
    if isinstance(node, QuantizedLeaf):
        return quantize_lib.dequantize_blocks(
            node.codes,
            node.scales,
            block_size=node.block_size,
            mapping=node.mapping,
            dtype=node.dtype,
            impl=impl,
            shape=node.shape,
            layout=node.layout,
        )
    return node


def _describe(leaf: Any) -> str:
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        return type(leaf).__name__
    return f"{jnp.dtype(dtype).name}{list(shape)}"


def _match_structure(given: Any, expected: Any) -> Any:
    """``given``'s leaves in ``expected``'s structure, matched by path: a state restored as
    plain containers (a checkpoint read without a template gives dicts and lists for optax's
    NamedTuples) has the same paths. A path missing or left over, or a leaf of another shape
    or dtype, is refused by name, the first in ``expected``'s order."""
    given_flat, _ = jax.tree_util.tree_flatten_with_path(given)
    expected_flat, treedef = jax.tree_util.tree_flatten_with_path(expected)
    by_path = {tree_lib.path_string(path): leaf for path, leaf in given_flat}
    leaves = []
    for path, want in expected_flat:
        name = tree_lib.path_string(path)
        if name not in by_path:
            nearest = difflib.get_close_matches(name, list(by_path), n=1, cutoff=0.0)
            hint = f" (its nearest is {nearest[0]!r})" if nearest else ""
            raise ValueError(
                f"the state has no leaf {name!r}, which the inner optimizer's state for these "
                f"parameters has ({_describe(want)}){hint}"
            )
        leaf = by_path.pop(name)
        if not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
            leaf = jnp.asarray(leaf)
        if tuple(leaf.shape) != tuple(want.shape) or jnp.dtype(leaf.dtype) != jnp.dtype(want.dtype):
            raise ValueError(
                f"state leaf {name!r} is {_describe(leaf)}; the inner optimizer's state for these "
                f"parameters has {_describe(want)} there"
            )
        leaves.append(leaf)
    if by_path:
        extra = next(iter(by_path))
        raise ValueError(
            f"the state has a leaf {extra!r} ({_describe(by_path[extra])}) that the inner "
            "optimizer's state for these parameters has not"
        )
    return jax.tree_util.tree_unflatten(treedef, leaves)


def dequantize_state(state: Any) -> Any:
    """The inner optimizer's plain state from a :func:`quantize_state` state.

    Every stored leaf (:class:`QuantizedLeaf`, :class:`FactoredLeaf`, :class:`Bfloat16Leaf`) is
    read back in the dtype the inner keeps it in (a factored leaf as its rank-1 reconstruction)
    and every :class:`CenteredState` as the inner's node (``nu`` from the
    stored variance and mean); counts, hyperparameters and every other leaf are kept as they
    are. The result is what the inner optimizer takes: switch a running job to float32 state,
    or to another format with :func:`to_quantized_state`. The values are the stored ones, so
    they differ from a float32 run's by the rounding of the state, no more.

    Args:
      state: a :class:`QuantizedState`, or any tree holding stored leaves (its
        ``inner_state``, say).

    Returns:
      The inner optimizer's state (the ``inner_state`` of a :class:`QuantizedState`), plain.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from triaccel_jax.transforms import dequantize_state, quantize_state
      >>> params = {"w": jnp.full((64, 64), 0.5)}
      >>> tx = quantize_state(optax.adam(1e-3), min_size=1024)
      >>> _, state = tx.update(params, tx.init(params), params)  # the gradient 0.5 everywhere
      >>> plain = dequantize_state(state)
      >>> type(plain[0]).__name__, plain[0].mu["w"].dtype, round(float(plain[0].mu["w"][0, 0]), 6)
      ('ScaleByAdamState', dtype('float32'), 0.05)
      >>> optax.adam(1e-3).update(params, plain, params)[0]["w"].shape  # optax's own state
      (64, 64)

    References:
      docs/design.md §3.9.
    """
    inner = state.inner_state if isinstance(state, QuantizedState) else state
    loaded = jax.tree.map(_load, inner, is_leaf=lambda node: _is_stored(node) or _is_opaque(node))
    return _uncenter_all(loaded)


def to_quantized_state(tx: optax.GradientTransformation, state: Any, params: Any) -> QuantizedState:
    """The state ``tx`` (a :func:`quantize_state` wrapper) keeps for an optimizer state.

    Converts the inner optimizer's plain state (a float32 run's, say, or one restored from its
    checkpoint) into the :class:`QuantizedState` that ``tx`` stores, the same leaves ``tx.init``
    would convert, in the same formats and maps, rounded to nearest as ``tx.init`` rounds; given
    a :class:`QuantizedState` of another format (another wrapper's), it is read back first
    (:func:`dequantize_state`) and stored in ``tx``'s. So a running job switches its state's
    format, and a float32 checkpoint restores into a quantized state. The inner's counts and
    ``inject_hyperparams``' hyperparameters are kept as they are; the wrapper's own count (which
    keys stochastic rounding) is the given :class:`QuantizedState`'s, else 0.

    The state is matched to the inner optimizer's state for ``params`` by leaf path
    (``"0/mu/dense/kernel"``), so a state restored as plain dicts and lists (a checkpoint read
    without a template) converts too; each leaf must have the shape and dtype the inner's has.

    Args:
      tx: the transformation :func:`quantize_state` returned (not one wrapping it, such as a
        chain: its options are read from it).
      state: the inner optimizer's state (``optax.adamw(...).init(params)`` and its updates'),
        plain or as restored from a checkpoint, or a :class:`QuantizedState`.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``), which set the inner state's
        structure.

    Returns:
      A :class:`QuantizedState`, as ``tx.init`` makes them: ``tx.update`` takes it.

    Raises:
      TypeError: ``tx`` was not built by :func:`quantize_state`.
      ValueError: ``state`` does not match the inner optimizer's state for ``params``: the first
        path missing, left over, or of another shape or dtype is named.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from triaccel_jax.transforms import quantize_state, to_quantized_state
      >>> params = {"w": jnp.ones((64, 64))}
      >>> plain = optax.adamw(1e-3).init(params)  # a float32 run's state
      >>> plain = optax.adamw(1e-3).update(params, plain, params)[1]
      >>> tx = quantize_state(optax.adamw(1e-3), min_size=1024)
      >>> state = to_quantized_state(tx, plain, params)
      >>> state.inner_state[0].mu["w"].codes.dtype, int(state.inner_state[0].count)
      (dtype('int8'), 1)
      >>> bf16 = to_quantized_state(quantize_state(optax.adamw(1e-3), format="bf16"), state, params)
      >>> bf16.inner_state[0].nu["w"].value.dtype  # switched from int8 to bfloat16
      dtype(bfloat16)

    References:
      docs/design.md §3.9.
    """
    try:
        convert = _CONVERTERS.get(getattr(tx, "init", None))  # type: ignore[arg-type]
    except TypeError:  # not weakly referable: no function, no wrapper's
        convert = None
    if convert is None:
        raise TypeError(
            "`tx` must be the transformation quantize_state returned (its options are read "
            f"from it), got {type(tx).__name__}"
        )
    return convert(state, params)


class StateBytes(NamedTuple):
    """Bytes of an optimizer's parameters and state, from XLA's compiled update.

    Attributes:
      parameters: elements of the floating-point parameters.
      params_bytes: bytes of the parameters (from their dtypes).
      state_bytes: bytes of the optimizer state as the compiled update takes it: XLA's argument
        bytes of the jitted ``(grads, state, params)`` step less the gradients' and parameters'.
      compiled: whether ``state_bytes`` is XLA's figure; False where the backend gives no memory
        analysis and the state's dtypes were counted instead.
    """

    parameters: int
    params_bytes: int
    state_bytes: int
    compiled: bool = True

    @property
    def bytes_per_parameter(self) -> float:
        """Parameters plus state, per parameter (12 for AdamW over float32 parameters)."""
        return (self.params_bytes + self.state_bytes) / self.parameters

    @property
    def state_bytes_per_parameter(self) -> float:
        """The state alone, per parameter (8 for AdamW with float32 moments)."""
        return self.state_bytes / self.parameters


def compiled_state_bytes(
    tx: optax.GradientTransformation, params: Any, **extra_args: Any
) -> StateBytes:
    """Measures the bytes of ``params`` and ``tx``'s state in XLA's compiled update.

    Lowers and compiles a training step's update, ``tx.update`` then ``optax.apply_updates``,
    jitted with every argument kept, on abstract arrays (nothing is allocated or run), and reads
    the argument bytes of its memory analysis; the gradients' bytes (shaped like the
    parameters) are taken off. Where the backend gives no memory
    analysis, the state's bytes are counted from its dtypes instead.

    Args:
      tx: the optimizer.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      **extra_args: extra arguments ``tx.update`` needs (a loss function, say).

    Returns:
      A :class:`StateBytes`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from triaccel_jax.transforms import compiled_state_bytes, quantize_state
      >>> params = {"w": jnp.zeros((256, 256))}
      >>> sgd = optax.sgd(0.1, momentum=0.9)  # float32 params and momentum: 8 bytes
      >>> compiled_state_bytes(sgd, params).bytes_per_parameter
      8.0...
      >>> measured = compiled_state_bytes(quantize_state(sgd), params)  # 4 + 1 + 4 / 256
      >>> round(measured.bytes_per_parameter, 3)
      5.016
    """
    abstract_params = arrays.abstract_tree(params)
    abstract_state = jax.eval_shape(tx.init, abstract_params)
    parameters = sum(
        math.prod(leaf.shape)
        for leaf in jax.tree.leaves(abstract_params)
        if tree_lib.is_trainable(leaf)
    )
    params_bytes = arrays.tree_nbytes(abstract_params)

    def step(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        updates, state = tx.update(grads, state, params, **extra_args)
        return optax.apply_updates(params, updates), state

    # keep_unused: an argument the update never reads (the params of an optimizer without
    # weight decay) would otherwise be pruned from the executable and its bytes not counted.
    compiled = (
        jax.jit(step, keep_unused=True)
        .lower(abstract_params, abstract_state, abstract_params)
        .compile()
    )
    try:
        analysis = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):
        analysis = None
    if analysis is None:
        return StateBytes(parameters, params_bytes, arrays.tree_nbytes(abstract_state), False)
    state_bytes = int(analysis.argument_size_in_bytes) - 2 * params_bytes
    return StateBytes(parameters, params_bytes, state_bytes)
