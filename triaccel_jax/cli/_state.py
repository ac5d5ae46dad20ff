"""The main job's optimizer state: Tri-Accel's, stored in planned low-bit formats, and every run's
bytes by format.

Tri-Accel's row trains :func:`triaccel_optimizer`: the curvature observer, Adam's direction with
its moments kept by :func:`triaccel_jax.quantize_state`, Tri-Accel's step scale, decoupled weight
decay and the rate: :func:`triaccel_jax.triaccel`'s update, composed so that its large state,
Adam's ``mu`` and ``nu``, is the wrapped part (``triaccel`` keeps them inside the curvature
signals' state, which ``quantize_state`` leaves as it is). The moments start in the formats
their sizes give under the cap ``--state-cap`` (:func:`initial_state_formats`) and are planned
per leaf by :func:`plan_state` from the run's own signals after its first steps
(:func:`triaccel_jax.precision.plan_state_formats`); where the plan differs, the state is
converted (:func:`convert_state_formats`) and the run goes on from the same step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax

from triaccel_jax import policy as policy_lib
from triaccel_jax import precision as precision_lib
from triaccel_jax import transforms
from triaccel_jax._src import arrays

WEIGHT_DECAY = 1e-4
# Adam's two moments per parameter are the state the plan applies to (mu signed, nu a second
# moment): the planner's state_copies.
STATE_COPIES = 2
# Each map of the registry's coded formats, to the format it stores (a leaf's format is read
# back from its map: the signed and the unsigned map of one format).
_FORMAT_OF_MAP = {
    mapping: name
    for name, spec in policy_lib.STATE_FORMATS.items()
    for mapping in (spec.signed_map, spec.unsigned_map)
    if mapping is not None
}


def triaccel_optimizer(
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: float = WEIGHT_DECAY,
    *,
    state_formats: str | Mapping[str, str] = "fp32",
) -> optax.GradientTransformationExtraArgs:
    """Tri-Accel's update with Adam's moments stored in ``state_formats``.

    The curvature observer and Tri-Accel's step scale around Adam's direction
    (:func:`triaccel_jax.scale_by_curvature`), then decoupled weight decay and the rate, as
    :func:`triaccel_jax.triaccel` steps: ``-lr * (s_l * m_hat / (sqrt(v_hat) + eps) + wd * p)``.
    Adam's direction is wrapped in :func:`triaccel_jax.quantize_state` so that its moments, the
    state that grows with the parameters, are stored in the given formats. The observer's
    gradient EMA stays in the dtype the controller's precision policy gives it (the controller
    re-casts it at every policy switch, :func:`triaccel_jax.transforms.convert_state`).

    Args:
      learning_rate: the rate (a number, or injected by ``optax.inject_hyperparams``).
      weight_decay: the decoupled weight-decay rate.
      state_formats: ``quantize_state``'s ``format``: a name of
        :data:`triaccel_jax.policy.STATE_FORMATS`, or ``{parameter path: format}`` (a plan's
        ``formats``); ``"fp32"`` (the default) stores the moments unwrapped.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.cli._state import state_bytes_by_format, triaccel_optimizer
      >>> params = {"w": jnp.ones((128, 128))}
      >>> tx = triaccel_optimizer(1e-3, state_formats={"w": "int8"})
      >>> sorted(state_bytes_by_format(tx.init(params)))
      ['fp32', 'int8', 'other']
    """
    direction: optax.GradientTransformation = optax.scale_by_adam()
    if not (isinstance(state_formats, str) and state_formats == "fp32"):
        direction = transforms.quantize_state(direction, format=state_formats)
    return optax.chain(
        transforms.scale_by_curvature(direction),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )


def injected_triaccel(
    learning_rate: float, state_formats: str | Mapping[str, str] = "fp32"
) -> optax.GradientTransformationExtraArgs:
    """:func:`triaccel_optimizer` with its rate and weight decay injected
    (``optax.inject_hyperparams``), so that the controller scales the rate with the batch."""
    factory = functools.partial(triaccel_optimizer, state_formats=state_formats)
    return optax.inject_hyperparams(factory)(learning_rate=learning_rate, weight_decay=WEIGHT_DECAY)


@dataclasses.dataclass
class StatePlan:
    """The formats Tri-Accel's state is stored in, and what planning them cost.

    The run starts in ``initial_formats`` (:func:`initial_state_formats`: by size, before any
    step has given signals) and at step ``plan_step`` plans ``formats`` from its own signals
    (:func:`plan_state`); ``switched`` says whether they differed, so that the state was
    converted (:func:`convert_state_formats`) and the step compiled again. ``cap`` is the
    planner's ``max_bytes_per_parameter`` (parameters plus Adam's two moments, per parameter)
    and ``bytes_per_parameter`` what the plan takes by the registry's count; ``plan_seconds``
    is the host's time reading the signals, planning and converting (a new step's compile is
    counted with the controller's compiles).
    """

    formats: dict[str, str]
    initial_formats: dict[str, str]
    cap: float
    bytes_per_parameter: float
    meets_cap: bool
    predicted_increase: float
    plan_step: int
    plan_seconds: float
    switched: bool
    reasons: dict[str, str]


def _plan_under_cap(
    signals: Any, params: Any, learning_rate: float, cap: float, rank_by: str
) -> precision_lib.StateFormatPlan:
    """:func:`triaccel_jax.precision.plan_state_formats` of Adam's two moments under ``cap``."""
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"the state cap must be a positive number of bytes, got {cap!r}")
    return precision_lib.plan_state_formats(
        signals,
        params,
        learning_rate=learning_rate,
        max_bytes_per_parameter=cap,
        state_copies=STATE_COPIES,
        rank_by=rank_by,
    )


def initial_state_formats(params: Any, *, learning_rate: float, cap: float) -> dict[str, str]:
    """The formats Tri-Accel's run starts in: under ``cap``, the largest leaves lowest.

    No step has given signals yet (the state's are zeros), so the assignment ranks the leaves
    by size alone (:func:`triaccel_jax.precision.plan_state_formats` with ``rank_by="size"``):
    the signal-blind assignment the plan is compared against. :func:`plan_state` re-plans from
    the run's own signals after its first steps.

    Args:
      params: the run's parameters.
      learning_rate: the run's rate.
      cap: bytes per parameter of parameters plus Adam's moments, > 0.

    Returns:
      ``{parameter path: format}``.

    Raises:
      ValueError: ``cap`` is not a positive number.

    Example:
      >>> import jax.numpy as jnp
      >>> params = {"big": jnp.ones((256, 256)), "small": jnp.ones((8,))}
      >>> initial_state_formats(params, learning_rate=1e-3, cap=7.0)
      {'big': 'int8', 'small': 'fp32'}
    """
    signals = transforms.signals(injected_triaccel(learning_rate).init(params))
    return dict(_plan_under_cap(signals, params, learning_rate, cap, "size").formats)


def plan_state(
    opt_state: Any,
    params: Any,
    *,
    learning_rate: float,
    cap: float,
    step: int,
    started_in: Mapping[str, str],
) -> StatePlan:
    """Plans Tri-Accel's state formats from the run's own signals at ``step``.

    :func:`triaccel_jax.precision.plan_state_formats` reads the curvature and noise signals of
    ``opt_state``, the state of :func:`injected_triaccel` after the run's first ``step`` steps,
    under ``cap``. Nothing is trained for the plan: the run's first steps are its signals'
    source (a throwaway probe would cost its own compile and steps).

    Args:
      opt_state: the run's optimizer state (any formats).
      params: its parameters.
      learning_rate: the run's rate (the plan's loss model is per step at this rate).
      cap: bytes per parameter of parameters plus Adam's moments, > 0.
      step: the steps the run has taken, recorded in the plan.
      started_in: the formats the run started in (:func:`initial_state_formats`).

    Returns:
      A :class:`StatePlan`; ``switched`` when its formats differ from ``started_in``.

    Raises:
      ValueError: ``cap`` is not a positive number.
    """
    start = time.perf_counter()
    signals = jax.device_get(transforms.signals(opt_state))
    plan = _plan_under_cap(signals, params, learning_rate, cap, "signals")
    return StatePlan(
        formats=dict(plan.formats),
        initial_formats=dict(started_in),
        cap=float(cap),
        bytes_per_parameter=float(plan.bytes_per_parameter),
        meets_cap=plan.meets_cap,
        predicted_increase=float(plan.predicted_increase),
        plan_step=int(step),
        plan_seconds=time.perf_counter() - start,
        switched=dict(plan.formats) != dict(started_in),
        reasons=dict(plan.reasons),
    )


def _is_moments(node: Any) -> bool:
    # Adam's moments as triaccel_optimizer keeps them: wrapped, or plain where every leaf is fp32.
    return isinstance(node, (transforms.QuantizedState, optax.ScaleByAdamState))


def convert_state_formats(
    opt_state: Any, params: Any, *, learning_rate: float, formats: str | Mapping[str, str]
) -> Any:
    """The state of :func:`injected_triaccel` with Adam's moments stored in ``formats``.

    Every other part (the observer's signals, the counts, the injected rate) is kept as it is;
    the moments are converted by :func:`triaccel_jax.transforms.to_quantized_state` (from
    float32 or from another format, rounded to nearest) or read back by
    :func:`triaccel_jax.transforms.dequantize_state` where ``formats`` keeps every leaf fp32.
    So a running job moves its state to a new plan without losing its moments.

    Args:
      opt_state: the run's optimizer state, in any formats.
      params: its parameters.
      learning_rate: the rate :func:`injected_triaccel` is built with (the state's own injected
        rate is kept).
      formats: the new ``{parameter path: format}``, or one format's name for every leaf.

    Returns:
      The state ``injected_triaccel(learning_rate, formats)`` updates.

    Example:
      >>> import jax.numpy as jnp
      >>> params = {"w": jnp.ones((128, 128))}
      >>> fp32 = injected_triaccel(1e-3).init(params)
      >>> int8 = convert_state_formats(fp32, params, learning_rate=1e-3, formats={"w": "int8"})
      >>> sorted(state_bytes_by_format(int8))
      ['fp32', 'int8', 'other']
    """
    template = jax.eval_shape(injected_triaccel(learning_rate, formats).init, params)
    wrapped = formats if isinstance(formats, str) else dict(formats)
    moments_tx = transforms.quantize_state(optax.scale_by_adam(), format=wrapped)

    def convert(like: Any, node: Any) -> Any:
        # ``node`` is the part of ``opt_state`` where the new state keeps ``like``.
        if isinstance(like, transforms.QuantizedState):
            return transforms.to_quantized_state(moments_tx, node, params)
        if isinstance(like, optax.ScaleByAdamState) and isinstance(node, transforms.QuantizedState):
            return transforms.dequantize_state(node)
        return node

    return jax.tree.map(convert, template, opt_state, is_leaf=_is_moments)


def _is_stored(node: Any) -> bool:
    # quantize_state's stored leaves, each counted whole under its format.
    return isinstance(
        node, (transforms.QuantizedLeaf, transforms.FactoredLeaf, transforms.Bfloat16Leaf)
    )


def _float_name(dtype: np.dtype) -> str:
    # The policy's short name ("fp32", "bf16", "fp16"); a dtype it has none for keeps its own.
    try:
        return policy_lib.format_name(dtype)
    except ValueError:
        return dtype.name


def state_bytes_by_format(opt_state: Any) -> dict[str, int]:
    """The bytes of an optimizer state by the format each leaf is stored in.

    A :class:`triaccel_jax.transforms.QuantizedLeaf` counts its codes and scales under the
    registry's format of its map (``"int8"``, ``"int8_dynamic"``, ``"int4"``), a
    :class:`~triaccel_jax.transforms.Bfloat16Leaf` under ``"bf16"``; any other floating-point
    leaf under its dtype (``"fp32"``, ``"bf16"``, ...); integer and key leaves (counts, the
    curvature store's indices, rounding keys) under ``"other"``.

    Args:
      opt_state: an optimizer state (arrays or ``jax.ShapeDtypeStruct``).

    Returns:
      ``{format: bytes}``, formats with no bytes left out.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import triaccel_jax
      >>> params = {"w": jnp.ones((64, 64))}
      >>> tx = triaccel_jax.quantize_state(optax.adam(1e-3), format="int8", min_size=1024)
      >>> state_bytes_by_format(tx.init(params))  # counts, a key; 2 x (4096 codes + a scale a row)
      {'other': 16, 'int8': 8704}
    """
    totals: dict[str, int] = {}
    for node in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_stored):
        if isinstance(node, transforms.Bfloat16Leaf):
            name, nbytes = "bf16", arrays.nbytes(node.value)
        elif _is_stored(node):
            name = _FORMAT_OF_MAP.get(node.mapping, node.mapping)
            nbytes = arrays.tree_nbytes(node)
        else:
            dtype = np.dtype(getattr(node, "dtype", np.asarray(node).dtype))
            floating = np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"
            name = _float_name(dtype) if floating else "other"
            nbytes = arrays.nbytes(node)
        if nbytes:
            totals[name] = totals.get(name, 0) + int(nbytes)
    return totals


def compiled_state_bytes(tx: optax.GradientTransformation, params: Any) -> int | None:
    """XLA's bytes of ``tx``'s state in its compiled update
    (:func:`triaccel_jax.transforms.compiled_state_bytes`), or None where the backend gives no
    memory analysis (the figure would be a count from dtypes, which
    :func:`state_bytes_by_format` already is)."""
    measured = transforms.compiled_state_bytes(tx, params)
    return int(measured.state_bytes) if measured.compiled else None
