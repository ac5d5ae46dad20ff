"""The main job's optimizer state: Tri-Accel's, stored in planned low-bit formats, and every run's
bytes by format.

Tri-Accel's row trains :func:`triaccel_optimizer`: the curvature observer, Adam's direction with
its moments kept by :func:`triaccel_jax.quantize_state`, Tri-Accel's step scale, decoupled weight
decay and the rate: :func:`triaccel_jax.triaccel`'s update, composed so that its large state,
Adam's ``mu`` and ``nu``, is the wrapped part (``triaccel`` keeps them inside the curvature
signals' state, which ``quantize_state`` leaves as it is). The formats are planned per leaf by
:func:`plan_state` from a short probe of the run's own signals (:func:`triaccel_jax.precision.
plan_state_formats` under the cap ``--state-cap``); the probe's steps and seconds are the plan's
cost, reported with the run.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
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

    ``formats`` maps each parameter path to its moments' format; ``cap`` is the planner's
    ``max_bytes_per_parameter`` (parameters plus Adam's two moments, per parameter) and
    ``bytes_per_parameter`` what the plan takes by the registry's count; ``probe_steps`` and
    ``probe_seconds`` (its compile included) are the probe's, whose signals the plan read.
    """

    formats: dict[str, str]
    cap: float
    bytes_per_parameter: float
    meets_cap: bool
    predicted_increase: float
    probe_steps: int
    probe_seconds: float
    reasons: dict[str, str]


def plan_state(
    loss_fn: Callable[..., Any],
    params: Any,
    model_state: Any,
    train: Mapping[str, np.ndarray],
    *,
    learning_rate: float,
    batch_size: int,
    steps: int,
    cap: float,
    seed: int,
) -> StatePlan:
    """Plans Tri-Accel's state formats from a probe of the run's own signals.

    Trains ``steps`` steps of :func:`triaccel_optimizer` with float32 state from ``params`` on
    batches of a seeded order of ``train`` (a throwaway: the run itself starts from ``params``
    again), then plans each leaf's format with
    :func:`triaccel_jax.precision.plan_state_formats` from the probe's signals under ``cap``.

    Args:
      loss_fn: the main job's loss (``loss_fn(params, batch, *, policy, rng, model_state)``).
      params: the run's initial parameters.
      model_state: the model's state (BatchNorm statistics) or None.
      train: the training split, ``{"image", "label"}``.
      learning_rate: the run's rate (the plan's loss model is per step at this rate).
      batch_size: the probe's batch.
      steps: the probe's steps, >= 1.
      cap: bytes per parameter of parameters plus Adam's moments, > 0.
      seed: the order of the probe's samples and its dropout keys.

    Returns:
      A :class:`StatePlan`.

    Raises:
      ValueError: ``steps`` < 1 or ``cap`` not a positive number.
    """
    if steps < 1:
        raise ValueError(f"the state plan's probe needs at least 1 step, got {steps}")
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"the state cap must be a positive number of bytes, got {cap!r}")
    start = time.perf_counter()
    tx = injected_triaccel(learning_rate)
    state = tx.init(params)

    @jax.jit
    def step(params, state, model_state, batch, rng):
        def loss(p):
            return loss_fn(p, batch, policy=None, rng=rng, model_state=model_state)

        (_, aux), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, aux.get("model_state", model_state)

    size = len(train["label"])
    order = np.random.default_rng(seed).permutation(size)
    key = jax.random.key(seed)
    for i in range(steps):
        rows = order[np.arange(i * batch_size, (i + 1) * batch_size) % size]
        batch = {k: v[rows] for k, v in train.items()}
        params, state, model_state = step(
            params, state, model_state, batch, jax.random.fold_in(key, i)
        )
    signals = jax.device_get(transforms.signals(state))
    plan = precision_lib.plan_state_formats(
        signals,
        params,
        learning_rate=learning_rate,
        max_bytes_per_parameter=cap,
        state_copies=STATE_COPIES,
    )
    return StatePlan(
        formats=dict(plan.formats),
        cap=float(cap),
        bytes_per_parameter=float(plan.bytes_per_parameter),
        meets_cap=plan.meets_cap,
        predicted_increase=float(plan.predicted_increase),
        probe_steps=steps,
        probe_seconds=time.perf_counter() - start,
        reasons=dict(plan.reasons),
    )


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
