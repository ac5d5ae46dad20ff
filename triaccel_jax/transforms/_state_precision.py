"""``quantize_state``: any optax optimizer's state kept in bfloat16 or 8-bit blocks.

The wrapper stores the inner optimizer's parameter-sized float state (AdamW's ``mu`` and ``nu``,
Muon's momentum, any float leaf of at least ``min_size`` elements) in a narrower format, and
gives the inner optimizer its state back in the dtype the inner made it, for the one update it
runs; the new state is stored again with stochastic rounding. Everything else in the state
(counts, scalars, ``inject_hyperparams``' hyperparameters, the curvature signals' state) is the
inner's, untouched. docs/design.md §3.9 gives the formats and their references.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from triaccel_jax import kernels
from triaccel_jax._src import arrays
from triaccel_jax._src import tree as tree_lib
from triaccel_jax._src import validation
from triaccel_jax.kernels import cast as cast_lib
from triaccel_jax.kernels import quantize as quantize_lib
from triaccel_jax.transforms._curvature_signals import CurvatureSignalsState

FORMATS = ("fp32", "bf16", "int8")
# optax's names for state fields that hold non-negative second moments: Adam's, AdamW's,
# RMSProp's and Muon's Adam fallback's ``nu``, AMSGrad's ``nu_max``, Adagrad's ``sum_of_squares``,
# and optax.contrib's Prodigy's and D-Adaptation AdamW's ``exp_avg_sq``.
SECOND_MOMENTS = ("nu", "nu_max", "sum_of_squares", "exp_avg_sq")
# Fields of optax.inject_hyperparams' state: numbers the user sets, never parameter-sized state.
_HYPERPARAM_FIELDS = ("hyperparams", "hyperparams_states")

FormatChoice = str | Mapping[str, str] | Callable[[str, jax.ShapeDtypeStruct], str | None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedLeaf:
    """A state leaf stored as 8-bit block-wise codes (the ``"int8"`` format).

    Attributes:
      codes: one byte per element, shaped like the leaf: int8 for the ``"linear"`` map, uint8
        for ``"sqrt"`` (:mod:`triaccel_jax.kernels.quantize`).
      scales: float32, one per block of the flattened leaf: the block's absolute maximum.
      mapping: ``"linear"`` (signed state) or ``"sqrt"`` (a non-negative second moment); static.
      dtype: the name of the dtype the inner optimizer keeps the leaf in (what the leaf is
        dequantized to); static.
    """

    codes: jax.Array
    scales: jax.Array
    mapping: str = dataclasses.field(metadata={"static": True})
    dtype: str = dataclasses.field(metadata={"static": True})


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


class QuantizedState(NamedTuple):
    """State of :func:`quantize_state`.

    Attributes:
      count: int32, updates so far; with ``key`` it gives each update its own random bits.
      key: uint32 PRNG key data (``jax.random.key_data``) from the wrapper's ``seed``.
      inner_state: the inner optimizer's state, its converted leaves as :class:`QuantizedLeaf`
        or :class:`Bfloat16Leaf` and every other node and leaf as the inner made it.
    """

    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count, as optax's states do
    key: jax.Array
    inner_state: Any


class _Spec(NamedTuple):
    format: str  # "bf16" or "int8"
    mapping: str | None  # the int8 map


def _is_stored(node: Any) -> bool:
    return isinstance(node, QuantizedLeaf | Bfloat16Leaf)


def _is_opaque(node: Any) -> bool:
    # The curvature signals' state is read by signals() and the planner as it is: never converted.
    return isinstance(node, CurvatureSignalsState)


def _check_format(value: Any, where: str) -> str:
    if value is None:
        return "fp32"
    if not isinstance(value, str) or value not in FORMATS:
        raise ValueError(f"{where} must be one of {FORMATS}, got {value!r}")
    return value


def _check_options(
    format: Any, block_size: Any, min_size: Any, second_moments: Any, seed: Any, impl: Any
) -> tuple[FormatChoice, int, int, tuple[str, ...], int]:
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


def _mapped_format(mapping: Mapping[str, str], name: str) -> str | None:
    """The entry of the longest parameter path that ``name`` ends with (on a '/' boundary)."""
    best = None
    for key in mapping:
        if (name == key or name.endswith("/" + key)) and (best is None or len(key) > len(best)):
            best = key
    return None if best is None else mapping[best]


def _spec(
    path: Sequence[Any],
    leaf: Any,
    format: FormatChoice,
    min_size: int,
    second_moments: tuple[str, ...],
) -> _Spec | None:
    """How one leaf of the inner state is stored; None: as the inner keeps it."""
    if _is_opaque(leaf) or not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
        return None
    fields = _field_names(path)
    if fields & set(_HYPERPARAM_FIELDS):
        return None
    name = tree_lib.path_string(path)
    explicit = not isinstance(format, str)
    if isinstance(format, str):
        chosen = format
    elif isinstance(format, Mapping):
        chosen = _check_format(_mapped_format(format, name), f"`format` for state leaf {name!r}")
    else:
        abstract = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
        chosen = _check_format(format(name, abstract), f"`format({name!r}, ...)`")
    if chosen == "fp32":
        return None
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
        if explicit:
            raise ValueError(
                f"state leaf {name!r} is {jnp.dtype(leaf.dtype).name}: only floating-point "
                f"leaves can be stored in {chosen!r}"
            )
        return None
    size = math.prod(leaf.shape)
    if len(leaf.shape) == 0 or size < max(min_size, 1):
        return None
    if chosen == "bf16":
        if jnp.dtype(leaf.dtype).itemsize <= 2:  # already 16 bits or fewer
            return None
        return _Spec("bf16", None)
    return _Spec("int8", "sqrt" if fields & set(second_moments) else "linear")


def quantize_state(
    inner: optax.GradientTransformation,
    *,
    format: FormatChoice = "int8",
    block_size: int = 256,
    min_size: int = 4096,
    second_moments: Sequence[str] = SECOND_MOMENTS,
    seed: int = 0,
    impl: str = "auto",
) -> optax.GradientTransformationExtraArgs:
    """Keeps another optimizer's state in bfloat16 or 8-bit blocks between its updates.

    Each update dequantizes the stored leaves to the dtype the inner optimizer made them in
    (float32 for an optimizer over float32 params), runs ``inner.update`` on them (extra
    arguments forwarded), and stores the new state again, rounding stochastically with bits
    drawn from ``seed`` folded with the update's count, so that an EMA's increments smaller than
    a level are kept in expectation instead of rounded away. The first store, at ``init``,
    rounds to nearest. Formats (docs/design.md §3.9):

    * ``"int8"``: block-wise 8-bit codes with one float32 scale (the absolute maximum) per
      ``block_size`` consecutive elements (Dettmers et al., 2021). Signed leaves use a linear
      map (int8 codes ``c`` for ``c * absmax / 127``); leaves under a field named in
      ``second_moments`` (Adam's ``nu``) use a map linear in the square root and without a zero
      level (uint8 codes ``c`` for ``absmax * ((c + 1) / 256) ** 2``), so a small second
      moment is never stored as zero, which would turn ``m / (sqrt(v) + eps)`` into ``m / eps``
      (Li et al., 2023). About 1 byte per element plus ``4 / block_size``.
    * ``"bf16"``: bfloat16, 2 bytes per element (leaves already 16 bits or narrower are kept).
    * ``"fp32"``: the leaf as the inner keeps it.

    Only floating-point leaves of at least ``min_size`` elements (never scalars) are converted;
    counts, hyperparameters of ``optax.inject_hyperparams`` (which stay findable and settable
    inside this state) and the state of :func:`triaccel_jax.curvature_signals` (which
    :func:`triaccel_jax.signals` reads) are always left as they are. State shapes and dtypes are
    the same at every step, so a jitted step never retraces.

    Args:
      inner: the optimizer whose state is stored (any optax ``GradientTransformation``).
      format: ``"int8"``, ``"bf16"`` or ``"fp32"`` for every eligible leaf; or a mapping from
        parameter paths as :func:`triaccel_jax.signals` names them (``"dense/kernel"``) to
        formats, a state leaf taking the entry of the longest path its own path ends with
        (``"0/mu/dense/kernel"`` takes ``"dense/kernel"``) and ``"fp32"`` without one; or a
        callable ``(path, leaf) -> format`` called with each state leaf's path (``"/"``-joined)
        and a ``jax.ShapeDtypeStruct``, returning a format or None (``"fp32"``). A mapping or
        callable that asks for a non-float leaf to be converted is an error.
      block_size: elements per quantization block (an int >= 1; static, it sets the scales'
        shape).
      min_size: leaves with fewer elements keep the inner's format: their bytes are negligible
        and their blocks would be mostly scale. 4096 is bitsandbytes' default.
      second_moments: state field names whose leaves are non-negative second moments, stored
        with the square-root map under ``"int8"``. A negative value there is stored as the
        lowest level.
      seed: seeds the stochastic rounding (an int that fits in 64 bits, as ``jax.random.key``
        takes).
      impl: the quantize/dequantize kernels' implementation: ``"auto"`` (the Triton kernel only
        where ``kernels/auto_table.json`` measured it faster on CUDA), ``"reference"`` or
        ``"triton"`` (:func:`triaccel_jax.kernels.quantize.quantize_blocks`).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`QuantizedState`.

    Raises:
      ValueError: an unknown format, ``block_size`` < 1, ``min_size`` < 0, a ``seed`` beyond 64
        bits, an unknown ``impl``; at ``init``, a mapping or callable asking for a non-float
        leaf to be converted.
      TypeError: ``block_size``, ``min_size`` or ``seed`` not an int, ``format`` neither a
        string, a mapping nor a callable.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import triaccel_jax
      >>> params = {"w": jnp.ones((64, 64)), "b": jnp.zeros(64)}
      >>> tx = triaccel_jax.quantize_state(optax.adamw(1e-3), format="int8", min_size=1024)
      >>> state = tx.init(params)
      >>> adam = state.inner_state[0]
      >>> adam.mu["w"].codes.dtype, adam.nu["w"].codes.dtype, adam.mu["b"].dtype
      (dtype('int8'), dtype('uint8'), dtype('float32'))

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
      Numerical Precision" (stochastic rounding).
    """
    format, block_size, min_size, second_moments, seed = _check_options(
        format, block_size, min_size, second_moments, seed, impl
    )
    inner = optax.with_extra_args_support(inner)

    def store(leaf: jax.Array, spec: _Spec, dtype: str, key: jax.Array | None) -> Any:
        rounding = "nearest" if key is None else "stochastic"
        if spec.format == "bf16":
            value = cast_lib.cast(leaf, jnp.bfloat16, rounding=rounding, key=key, impl=impl)
            return Bfloat16Leaf(value, dtype)
        assert spec.mapping is not None
        codes, scales = quantize_lib.quantize_blocks(
            leaf,
            block_size=block_size,
            mapping=spec.mapping,
            rounding=rounding,
            key=key,
            impl=impl,
        )
        return QuantizedLeaf(codes, scales, spec.mapping, dtype)

    def load(node: Any) -> Any:
        if isinstance(node, Bfloat16Leaf):
            return node.value.astype(node.dtype)
        if isinstance(node, QuantizedLeaf):
            return quantize_lib.dequantize_blocks(
                node.codes,
                node.scales,
                block_size=block_size,
                mapping=node.mapping,
                dtype=node.dtype,
                impl=impl,
            )
        return node

    def init_fn(params: Any) -> QuantizedState:
        inner_state = inner.init(params)
        flat, treedef = jax.tree_util.tree_flatten_with_path(inner_state, is_leaf=_is_opaque)
        leaves = []
        for path, leaf in flat:
            spec = _spec(path, leaf, format, min_size, second_moments)
            leaves.append(leaf if spec is None else store(leaf, spec, leaf.dtype.name, None))
        key = jax.random.key_data(jax.random.key(seed))
        return QuantizedState(
            count=jnp.zeros([], jnp.int32),
            key=key,
            inner_state=jax.tree_util.tree_unflatten(treedef, leaves),
        )

    def update_fn(
        updates: Any, state: QuantizedState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, QuantizedState]:
        inner_state = jax.tree.map(load, state.inner_state, is_leaf=_is_stored)
        updates, new_inner = inner.update(updates, inner_state, params, **extra_args)
        # Store each new leaf as its old one was stored: the layout fixed at init, so the state's
        # structure (and the compiled step) never changes.
        stored, treedef = jax.tree_util.tree_flatten(state.inner_state, is_leaf=_is_stored)
        new_leaves = jax.tree.leaves(new_inner)
        if len(new_leaves) != len(stored):
            raise ValueError(
                "the inner optimizer's update returned a state of another structure than it was "
                f"given ({len(new_leaves)} leaves, {len(stored)} before)"
            )
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.count)
        leaves = []
        for index, (old, new) in enumerate(zip(stored, new_leaves, strict=True)):
            if isinstance(old, QuantizedLeaf):
                spec = _Spec("int8", old.mapping)
            elif isinstance(old, Bfloat16Leaf):
                spec = _Spec("bf16", None)
            else:
                leaves.append(new)
                continue
            key = jax.random.fold_in(step_key, index)
            leaves.append(store(new.astype(old.dtype), spec, old.dtype, key))
        new_state = QuantizedState(
            count=optax.safe_increment(state.count),
            key=state.key,
            inner_state=jax.tree_util.tree_unflatten(treedef, leaves),
        )
        return updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class StateBytes(NamedTuple):
    """Bytes of an optimizer's parameters and state, from XLA's compiled update.

    Attributes:
      parameters: elements of the floating-point parameters.
      params_bytes: bytes of the parameters (from their dtypes).
      state_bytes: bytes of the optimizer state as the compiled update takes it: XLA's argument
        bytes of the jitted ``(grads, state, params)`` step less the gradients' and parameters'.
    """

    parameters: int
    params_bytes: int
    state_bytes: int

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
        state_bytes = arrays.tree_nbytes(abstract_state)
    else:
        state_bytes = int(analysis.argument_size_in_bytes) - 2 * params_bytes
    return StateBytes(parameters, params_bytes, state_bytes)
