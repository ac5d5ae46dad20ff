"""``plan_state_formats``: each leaf's optimizer-state format from curvature and gradient noise.

:func:`triaccel_jax.quantize_state` stores an optimizer's state in float32, bfloat16 or 8-bit
blocks; this chooses the format per leaf, the way :func:`triaccel_jax.plan_precision` chooses the
compute format (docs/design.md §3.9).

Storing the state with stochastic rounding perturbs each update by an unbiased error: a step of
size ``lr`` moves leaf ``l`` by ``lr * (u + e)`` instead of ``lr * u``, ``e`` independent across
steps with ``E[e_i**2] = v_f * u_i**2`` (``v_f`` the format's relative error variance). The
expected loss a step adds is the curvature-weighted second moment of the perturbation (the
quadratic model of the compute planner, HAWQ-V3):

    dL_l(f) = 0.5 * lr**2 * v_f * sum_i h_i * u_i**2  ~=  0.5 * lr**2 * v_f * kappa_l * n_l,

with Adam-like updates of unit size per element (``|u_i| ~ 1``: the normalised direction; Muon's
orthogonalised step is of the same order). A leaf whose gradients are noisy already takes steps
with a random error of relative variance ``nsr_l`` (the signals' noise-to-signal ratio), so its
increase counts ``1 / (1 + nsr_l)`` against the budget, as in the compute planner. The leaves are
moved to fewer bits greedily, smallest increase per byte saved first, while the total stays
within the budget (a fraction of the loss, per step) — or, with ``max_bytes_per_parameter``, until
the parameters and state fit that many bytes per parameter, whatever the increase (memory first:
the predicted increase is then reported, not enforced).

``v_f`` for stochastic rounding to a grid of spacing ``s`` is at most ``s**2 / 4`` of the value
squared: bfloat16's spacing is ``2**-7 |x|``, so ``v = 2**-16``; an 8-bit block's spacing is its
absolute maximum over 127 (Dettmers et al., 2021), and a block of 256 Gaussian values has an
absolute maximum about 2.8 standard deviations out, so relative to the mean square ``v = 2.8**2 /
(4 * 127**2) ~ 1.2e-4``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import numpy as np

from triaccel_jax import policy as policy_lib
from triaccel_jax._src import caller
from triaccel_jax._src import validation

# The formats quantize_state stores, from the most to the least precise: (relative error
# variance of one stochastically rounded store, bytes per element at a block size).
STATE_FORMATS = ("fp32", "bf16", "int8")
# float32 is the reference every increase is measured from: its own rounding counts as none.
_ERROR_VARIANCE = {"fp32": 0.0, "bf16": 2.0**-16, "int8": 2.8**2 / (4 * 127**2)}
# Beyond this the gradient noise no longer discounts the rounding noise (as the compute planner).
_MAX_NOISE_DISCOUNT = 1e3


def _bytes_per_element(name: str, block_size: int, itemsize: int) -> float:
    """Bytes of one state element in format ``name`` for a leaf the inner optimizer keeps in
    ``itemsize`` bytes ("fp32" is the state as the inner keeps it: an optax optimizer keeps
    bfloat16 parameters' moments in bfloat16)."""
    return {
        "fp32": float(itemsize),
        "bf16": float(min(2, itemsize)),
        "int8": 1.0 + 4.0 / block_size,
    }[name]


class StateFormatPlan(NamedTuple):
    """The optimizer-state format chosen for each leaf, and what it costs and saves.

    Attributes:
      formats: ``{leaf path: "fp32" | "bf16" | "int8"}``: pass it as
        ``quantize_state(inner, format=plan.formats)``.
      bytes_per_parameter: parameters plus state per parameter (an analytic count from the
        dtypes: the parameters' own, and ``state_copies`` state leaves per parameter in their
        formats, the scales included), before: 4 + 4 x ``state_copies`` for float32.
      predicted_increase: the loss a step is predicted to add by the rounding of the state,
        summed over the leaves (in the loss's units).
      allowance: the increase the budget allowed (``inf`` with no budget).
      reasons: ``{leaf path: why}``.
      meets_cap: whether ``bytes_per_parameter`` is within ``max_bytes_per_parameter`` (True
        without a cap). False when no choice of the formats allowed reaches it (leaves under
        ``min_size`` or without signals stay float32, and the fewest bytes of a format are its
        floor); the plan is then the fewest bytes it can reach, and a warning says so.
    """

    formats: dict[str, str]
    bytes_per_parameter: float
    predicted_increase: float
    allowance: float
    reasons: dict[str, str]
    meets_cap: bool = True


def plan_state_formats(
    signals: Mapping[str, Mapping[str, Any]],
    params: Any,
    *,
    learning_rate: float,
    budget: float = 1e-3,
    loss: float | None = None,
    formats: Sequence[str] = STATE_FORMATS,
    state_copies: int = 2,
    block_size: int = 256,
    min_size: int = 4096,
    max_bytes_per_parameter: float | None = None,
) -> StateFormatPlan:
    """Plans each leaf's optimizer-state format from the curvature and noise signals.

    Args:
      signals: :func:`triaccel_jax.signals` of the optimizer state (the observer
        :func:`triaccel_jax.curvature_signals` in the chain gives them over any optimizer): per
        leaf path ``"mean_curvature"`` and optionally ``"noise_to_signal"``. A leaf whose
        figures are NaN or infinite cannot be priced and keeps its state as the inner keeps it.
      params: the parameter tree (sizes, and the bytes of the parameters and of the state an
        optax optimizer keeps in their dtype: bfloat16 parameters' moments are bfloat16, so
        ``"bf16"`` is no move for them).
      learning_rate: the step size the state's updates are taken at (> 0).
      budget: the loss a step may gain from the state's rounding, >= 0: a fraction of ``loss``
        when given, else in the loss's units. 0 keeps every leaf in float32; ``inf`` takes the
        fewest bytes for every eligible leaf.
      loss: the current loss, making ``budget`` relative.
      formats: the formats to choose from (float32 is always allowed), of ``"fp32"``,
        ``"bf16"``, ``"int8"``.
      state_copies: state leaves per parameter that the formats apply to (AdamW 2: ``mu`` and
        ``nu``; Muon or SGD with momentum 1); only the bytes count depends on it.
      block_size: :func:`triaccel_jax.quantize_state`'s block size (the scales' bytes).
      min_size: leaves with fewer elements stay float32, as ``quantize_state`` keeps them.
      max_bytes_per_parameter: a memory cap on parameters plus state per parameter: leaves are
        lowered, least increase per byte first, until it holds (or none can be lowered further),
        whatever the budget. A cap the plan cannot meet is said in the plan (``meets_cap``
        False, ``bytes_per_parameter`` what it reached) and warned.

    Returns:
      A :class:`StateFormatPlan`.

    Raises:
      ValueError: a format, count or bound is invalid (named), or ``signals`` share no leaf
        with ``params``.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.precision import plan_state_formats
      >>> params = {name: jnp.ones((128, 128)) for name in ("flat", "middle", "sharp")}
      >>> signals = {
      ...     "flat": {"mean_curvature": 1e-6},
      ...     "middle": {"mean_curvature": 5e-3},
      ...     "sharp": {"mean_curvature": 1.0},
      ... }
      >>> plan = plan_state_formats(signals, params, learning_rate=1e-3, budget=1e-9)
      >>> plan.formats
      {'flat': 'int8', 'middle': 'bf16', 'sharp': 'fp32'}
      >>> round(plan.bytes_per_parameter, 3)  # from 12 (AdamW: params, mu and nu in float32)
      8.677

    References:
      Dettmers et al., 2021, "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861;
      Yao et al., 2021, "HAWQ-V3: Dyadic Neural Network Quantization"; docs/design.md §3.9.
    """
    if not isinstance(signals, Mapping):
        raise TypeError(
            "`signals` must map leaf paths to figures, as triaccel_jax.signals(opt_state) "
            f"returns, got {type(signals).__name__}"
        )
    validation.check_in_range(
        "learning_rate", learning_rate, 0.0, math.inf, low_inclusive=False, high_inclusive=False
    )
    budget = validation.real_scalar("budget", budget, "a number >= 0 (inf allowed)")
    if not budget >= 0:  # NaN too
        raise ValueError(f"`budget` must be a number >= 0 (inf allowed), got {budget!r}")
    if loss is not None:
        validation.check_in_range("loss", loss, 0.0, math.inf, high_inclusive=False)
    unknown = [f for f in formats if f not in STATE_FORMATS]
    if unknown:
        raise ValueError(f"unknown state formats {unknown}; choose from {list(STATE_FORMATS)}")
    state_copies = validation.check_integer("state_copies", state_copies, 1)
    block_size = validation.check_integer("block_size", block_size, 1)
    min_size = validation.check_integer("min_size", min_size, 0)
    if max_bytes_per_parameter is not None:
        validation.check_in_range(
            "max_bytes_per_parameter", max_bytes_per_parameter, 0.0, math.inf, low_inclusive=False
        )
    allowed = [f for f in STATE_FORMATS if f == "fp32" or f in formats]

    leaves = policy_lib.trainable_paths(params)
    sizes = {path: int(np.prod(leaf.shape)) for path, leaf in leaves}
    itemsizes = {path: np.dtype(leaf.dtype).itemsize for path, leaf in leaves}
    # A format that stores no fewer bytes than the leaf's own is no move (quantize_state keeps
    # a bfloat16 state as it is under "bf16").
    ladders = {
        path: [
            f
            for f in allowed
            if f == "fp32" or _bytes_per_element(f, block_size, itemsizes[path]) < itemsizes[path]
        ]
        for path in sizes
    }
    own_bytes = sum(itemsizes[path] * sizes[path] for path in sizes)
    total = sum(sizes.values())
    if not set(signals) & set(sizes):
        raise ValueError(
            "`signals` shares no leaf path with `params` (signals for "
            f"{sorted(signals)[:4]}, params {sorted(sizes)[:4]}): pass the signals of this "
            "model's optimizer state"
        )

    def figures(path: str) -> tuple[float, float] | None:
        """The leaf's mean curvature (>= 0) and noise-to-signal ratio (capped), or None where
        its rounding cannot be priced: a NaN figure, or an infinite curvature times size (a NaN
        or infinite increase would make every comparison with the budget false)."""
        record = signals[path]
        kappa = float(record.get("mean_curvature", 0.0))
        nsr = float(record.get("noise_to_signal", 0.0))
        if math.isnan(nsr) or not math.isfinite(max(kappa, 0.0) * sizes[path]):
            return None
        return max(kappa, 0.0), min(max(nsr, 0.0), _MAX_NOISE_DISCOUNT)

    def increase(path: str, name: str) -> float:
        if name == "fp32":  # the reference: its own rounding counts as none
            return 0.0
        kappa, nsr = movable[path]
        per_copy = 0.5 * learning_rate**2 * _ERROR_VARIANCE[name] * kappa * sizes[path]
        return per_copy / (1.0 + nsr)

    def state_bytes(path: str, name: str) -> float:
        return state_copies * sizes[path] * _bytes_per_element(name, block_size, itemsizes[path])

    chosen = dict.fromkeys(sizes, "fp32")
    reasons = {}
    movable: dict[str, tuple[float, float]] = {}  # each leaf that may move, with its figures
    for path, size in sizes.items():
        if path not in signals:
            reasons[path] = "no signals for this leaf: float32"
        elif size < min_size:
            reasons[path] = f"{size} elements, under min_size {min_size}: float32"
        elif (leaf_figures := figures(path)) is None:
            # A leaf whose rounding cannot be priced keeps its state (as the compute planner).
            kappa, nsr = (signals[path].get(k) for k in ("mean_curvature", "noise_to_signal"))
            reasons[path] = (
                f"its signals are not finite (mean_curvature {kappa}, noise_to_signal {nsr}): "
                "float32"
            )
        else:
            movable[path] = leaf_figures
    allowance = budget * (loss if loss is not None and not math.isinf(budget) else 1.0)
    spent = 0.0  # float32 state is the reference
    used = own_bytes + sum(state_bytes(path, "fp32") for path in sizes)
    cap = None if max_bytes_per_parameter is None else max_bytes_per_parameter * total

    def next_move(path: str) -> tuple[float, str, float, float] | None:
        """(price per byte, next format, added increase, bytes saved) of lowering ``path``."""
        ladder = ladders[path]
        position = ladder.index(chosen[path])
        if position + 1 == len(ladder):
            return None
        lower = ladder[position + 1]
        added = increase(path, lower) - increase(path, chosen[path])
        saved = state_bytes(path, chosen[path]) - state_bytes(path, lower)
        return added / saved, lower, added, saved

    heap: list[tuple[float, str, tuple[float, str, float, float]]] = []
    for path in movable:
        move = next_move(path)
        if move is not None:
            heapq.heappush(heap, (move[0], path, move))
    while heap:
        _, path, (_, lower, added, saved) = heapq.heappop(heap)
        over_cap = cap is not None and used > cap
        if not over_cap and not spent + added <= allowance:
            refused = (
                f"not {lower}: it would add {added:.3g} to the loss a step, over the budget left "
                f"({max(allowance - spent, 0.0):.3g})"
            )
            moved = reasons.get(path)
            reasons[path] = f"{moved}; {refused}" if moved else f"{chosen[path]}: {refused}"
            continue
        chosen[path] = lower
        spent += added
        used -= saved
        reasons[path] = (
            f"{lower}: for memory (the cap {max_bytes_per_parameter} B/parameter)"
            if over_cap
            else f"{lower}: adds {added:.3g} to the loss a step, within the budget"
        )
        move = next_move(path)
        if move is not None:
            heapq.heappush(heap, (move[0], path, move))
    for path in movable:
        reasons.setdefault(path, f"{chosen[path]}: the cheapest within the budget")
    meets_cap = cap is None or used <= cap
    if not meets_cap:
        # Said, not only returned: a plan over the cap would otherwise pass for one within it.
        stuck = len(sizes) - len(movable)
        caller.warn(
            f"plan_state_formats cannot meet max_bytes_per_parameter={max_bytes_per_parameter}: "
            f"with the formats {allowed} the fewest bytes it reaches are {used / total:.4g} "
            f"per parameter ({stuck} of {len(sizes)} leaves must stay float32: under min_size, "
            "without signals or with non-finite ones); the plan has meets_cap=False"
        )
    return StateFormatPlan(chosen, used / total, spent, allowance, reasons, meets_cap)
