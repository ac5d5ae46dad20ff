"""``plan_precision``: choose each leaf's precision from curvature and gradient noise (docs/design.md §3).

The predicted loss increase of running leaf ``l`` in format ``d`` is the curvature-weighted rounding
noise (HAWQ-V3, Yao et al., 2021; Q-PACE-style weighting by the actual quantisation error):

    dL_l(d) = (u_d**2 / 6) * sum_i h_i * w_i**2,

since rounding ``w_i`` to ``d`` perturbs it by ``delta_i``, uniform within ``+-u_d |w_i|``, and the
second-order loss change is ``0.5 * sum_i h_i * E[delta_i**2]``. The sum is taken where the
curvature sits, from the optimizer's compressed curvature store: each block's mean times the
block's ``sum w**2`` (a conv kernel's (in, out) channel pair: its sum over spatial positions),
plus the exact top-k entries in place of their block mean. A signal record without a store (made
by hand) falls back to the leaf mean, ``kappa_l * sum_i w_i**2``. A leaf with noisy gradients
tolerates more: its increase counts ``1 / (1 + nsr_l)`` against the budget. The planner moves leaves
to cheaper formats greedily by predicted increase per byte saved while the total stays within the
budget. Bytes are those a compute copy really takes: fp8 is carried in bf16, so it saves no more
than bf16 and is never chosen over it for memory. Vectors (biases, norms) and leaves under
``min_size`` stay fp32; fp16 needs the values to fit its range; and hysteresis (a margin and a
patience) keeps noisy signals from flipping leaves back and forth.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

from triaccel_jax import policy as policy_lib
from triaccel_jax._src import validation
from triaccel_jax.precision import _leaf_cost as leaf_cost

# Beyond this, gradient noise no longer discounts rounding noise: a leaf whose moments say "all
# noise" (m_hat ~ 0 late in training) must not be made free to round arbitrarily coarsely.
_MAX_NOISE_DISCOUNT = 1e3
# Every cast adds some noise: a leaf with zero measured curvature still costs this much, so a
# budget of zero keeps everything in fp32.
_MIN_SENSITIVITY = 1e-30
# fp16 must hold the values with this much headroom for the updates that follow.
_FP16_HEADROOM = 4.0


def _as_plan(previous: Any) -> policy_lib.PrecisionPlan | None:
    """``previous`` as a plan: a bare policy is a plan with no streaks pending."""
    if previous is None or isinstance(previous, policy_lib.PrecisionPlan):
        return previous
    if isinstance(previous, policy_lib.PrecisionPolicy):
        return policy_lib.PrecisionPlan(previous, {})
    raise TypeError(
        "`previous_policy` must be a PrecisionPolicy, a PrecisionPlan or None, got "
        f"{type(previous).__name__}"
    )


def _ladder(allowed: Sequence[str], max_abs: float) -> tuple[list[str], list[str]]:
    """Formats a leaf may take, from fp32 down, one per byte width; and range rejections.

    The width is that of the dtype a compute copy is carried in (fp8: bf16), so of two formats
    that take the same bytes only the more precise is a step on the ladder.
    """
    by_width: dict[int, str] = {}
    rejected = []
    for name in sorted(allowed, key=lambda n: policy_lib.float_format(n).unit_roundoff):
        fmt = policy_lib.float_format(name)
        if name == "fp16" and max_abs * _FP16_HEADROOM > fmt.max_finite:
            rejected.append(f"fp16 out of range (max |w| {max_abs:.3g})")
            continue
        by_width.setdefault(policy_lib.carried_itemsize(name), name)
    ladder = [by_width[w] for w in sorted(by_width, reverse=True)]
    if ladder[0] != "fp32":
        ladder.insert(0, "fp32")
    return ladder, rejected


def plan_precision(
    signals: Mapping[str, Mapping[str, Any]],
    params: Any,
    previous_policy: policy_lib.PrecisionPlan | policy_lib.PrecisionPolicy | None = None,
    *,
    budget: float = 1e-3,
    loss: float | None = None,
    min_size: int = 64,
    allowed: Sequence[Any] = ("fp32", "bf16"),
    patience: int = 2,
    margin: float = 0.25,
    state: str = "auto",
    savings_needed: int | None = None,
) -> policy_lib.PrecisionPlan:
    """Plans a per-leaf precision policy from the optimizer's curvature and noise signals.

    Args:
      signals: :func:`triaccel_jax.signals` of the optimizer state: per leaf path a record with
        ``"mean_curvature"``, optionally ``"noise_to_signal"`` and ``"curvature_store"`` (the
        bias-corrected compressed curvature; with it the cost is ``sum_i h_i * w_i**2`` where
        the curvature sits, without it ``mean_curvature * sum_i w_i**2``).
      params: the parameter tree (for sizes, ``sum w**2``, ``sum h w**2`` and the range checks).
      previous_policy: the plan in force (its policy and pending streaks), or a bare policy (no
        streaks pending); with it, hysteresis applies.
      budget: total predicted loss increase allowed, >= 0; a fraction of ``loss`` when ``loss``
        is given, else in the loss's units. 0 keeps every leaf fp32; ``inf`` lets every eligible
        leaf take the allowed format that takes the fewest bytes (of two that take the same,
        the more precise: fp8, carried in bf16, saves nothing over bf16 or fp16).
      loss: the current loss, to make ``budget`` relative.
      min_size: leaves with fewer elements stay fp32. Vectors (biases, normalisation scales)
        always do: they are few bytes and sensitive, and the Flax interceptor runs their layers
        in the dtype of the activations anyway.
      allowed: compute formats to choose from (fp32 is always allowed): names from
        ``"fp32", "bf16", "fp16", "fp8_e4m3"``.
      patience: consecutive re-plans a new choice must win before a leaf moves (>= 1).
      margin: the current choice's predicted increase is discounted by ``1 - margin`` and any
        other choice's inflated by ``1 + margin``, so a move must win by that margin, in [0, 1).
      state: state dtype: ``"fp32"``, ``"bf16"``, or ``"auto"`` (bf16 moments for leaves that
        compute below fp32, fp32 otherwise).
      savings_needed: bytes of compute copies memory needs saved, or None. With None every
        leaf the budget allows is lowered (the fewest bytes); with a number the planner stops
        once its moves save that many bytes, still cheapest predicted increase per byte first:
        a lower precision only where memory needs it (0 keeps every leaf fp32). A measured
        figure, not a setting: the controller passes it when lower precision is not faster.

    Returns:
      A :class:`triaccel_jax.policy.PrecisionPlan`: the
      :class:`triaccel_jax.PrecisionPolicy` (with ``reasons`` saying why each leaf got its
      format) and ``pending``, the hysteresis memory to pass back with it at the next call.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax import plan_precision
      >>> params = {"big": jnp.ones((64, 64)), "bias": jnp.ones(64)}  # a vector stays fp32
      >>> signals = {p: {"mean_curvature": 1e-4, "noise_to_signal": 0.0} for p in params}
      >>> policy = plan_precision(signals, params, budget=1.0).policy
      >>> policy.compute("big"), policy.compute("bias")
      ('bf16', 'fp32')

    References:
      Yao et al., 2021, "HAWQ-V3: Dyadic Neural Network Quantization"; docs/design.md §3.
    """
    if not isinstance(signals, Mapping):
        raise TypeError(
            "`signals` must map leaf paths to figures, as triaccel_jax.signals(opt_state) "
            f"returns, got {type(signals).__name__}"
        )
    previous = _as_plan(previous_policy)
    allowed_names, budget = _check_options(allowed, budget, loss, min_size, patience, margin, state)

    shapes = {path: tuple(leaf.shape) for path, leaf in policy_lib.trainable_paths(params)}
    foreign = sorted(set(signals) - set(shapes))
    if foreign and shapes and not set(signals) & set(shapes):
        # Signals of another model (or of params renamed since) would plan nothing: every leaf
        # would silently stay fp32. (A state that covers more leaves than `params`, say a
        # frozen part left out, still plans the leaves it shares.)
        listed = ", ".join(map(repr, foreign[:4])) + (" ..." if len(foreign) > 4 else "")
        known = ", ".join(map(repr, sorted(shapes)[:4])) + (" ..." if len(shapes) > 4 else "")
        raise ValueError(
            f"`signals` holds {len(foreign)} leaf path(s) that `params` has no trainable leaf "
            f"for ({listed}); the params' leaves are {known or 'none'}: pass the signals of "
            "this model's optimizer state"
        )
    stores = {
        path: leaf_cost.as_store(path, record["curvature_store"], shapes[path])
        for path, record in signals.items()
        if path in shapes and isinstance(record, Mapping) and "curvature_store" in record
    }
    figures = leaf_cost.leaf_figures(params, stores)
    if previous is not None:
        previous.policy.check_matches(params)
    # An infinite budget stays infinite even relative to a loss of 0 (inf * 0 would be NaN).
    allowance = budget * (loss if loss is not None and not math.isinf(budget) else 1.0)

    prices = _price_leaves(signals, figures, shapes, allowed_names, min_size, previous, margin)
    if savings_needed is not None:
        validation.check_integer("savings_needed", savings_needed, 0)
    choice = _greedy(figures, prices, allowance, savings_needed)
    final, pending = _hold_back(choice, previous, prices.fixed, patience)
    reasons = {}
    leaves = []
    for path, (size, *_) in figures.items():
        compute = final[path]
        leaf_state = state if state != "auto" else ("fp32" if compute == "fp32" else "bf16")
        leaves.append((path, policy_lib.LeafPrecision(compute, leaf_state)))
        reasons[path] = prices.fixed.get(path) or _reason(
            compute,
            prices.cost[path],
            prices.ladders[path],
            pending.get(path),
            patience,
            allowance,
            size,
            savings_needed,
        )
        if path in prices.notes:
            reasons[path] += f"; {prices.notes[path]}"
    return policy_lib.PrecisionPlan(policy_lib.PrecisionPolicy(tuple(leaves), reasons), pending)


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
    """The planner's settings as one validated value: :func:`plan_precision`'s keywords but
    ``loss`` (which is a measured figure, not a setting).

    It is how the :class:`triaccel_jax.Controller` takes them (``planner=``); see
    :func:`plan_precision` for what each one does.

    Attributes:
      budget: total predicted loss increase allowed, >= 0 (``inf`` allowed).
      min_size: leaves with fewer elements stay fp32, >= 0.
      allowed: the compute formats to choose from (fp32 is always allowed).
      patience: re-plans a move must be indicated at before it is made, >= 1.
      margin: hysteresis margin on the budget, in [0, 1).
      state: the moments' dtype: ``"auto"`` (bf16 with a bf16 or lower compute copy, else
        fp32), ``"fp32"`` or ``"bf16"``.

    Example:
      >>> from triaccel_jax.precision import PlannerConfig
      >>> PlannerConfig(budget=0.05, allowed=("bf16",)).allowed
      ('fp32', 'bf16')
      >>> PlannerConfig(patience=0)
      Traceback (most recent call last):
      ...
      ValueError: `patience` must be an integer >= 1, got 0

    References:
      docs/design.md §3.6.
    """

    budget: float = 1e-3
    min_size: int = 64
    allowed: tuple[str, ...] = ("fp32", "bf16")
    patience: int = 2
    margin: float = 0.25
    state: str = "auto"

    def __post_init__(self) -> None:
        allowed, budget = _check_options(
            self.allowed, self.budget, None, self.min_size, self.patience, self.margin, self.state
        )
        object.__setattr__(self, "allowed", allowed)
        object.__setattr__(self, "budget", budget)

    def options(self) -> dict[str, Any]:
        """The settings as :func:`plan_precision`'s keyword arguments."""
        return dataclasses.asdict(self)


def _check_options(allowed, budget, loss, min_size, patience, margin, state):
    """The allowed formats (fp32 always among them) and the budget as a float, or an error."""
    if isinstance(allowed, str):
        raise TypeError(f"`allowed` must be a sequence of dtype names, e.g. ({allowed!r},)")
    allowed_names = tuple(policy_lib.format_name(a, what="allowed dtype") for a in allowed)
    if "fp32" not in allowed_names:
        allowed_names = ("fp32", *allowed_names)
    budget = validation.real_scalar("budget", budget, "a number >= 0 (inf allowed)")
    if not (budget >= 0 and not math.isnan(budget)):
        raise ValueError(f"`budget` must be a number >= 0 (inf allowed), got {budget!r}")
    if loss is not None and not (math.isfinite(loss) and loss >= 0):
        raise ValueError(f"`loss` must be a finite number >= 0, got {loss!r}")
    validation.check_integer("min_size", min_size, 0, strict=True)
    validation.check_integer("patience", patience, 1, strict=True)
    validation.check_in_range("margin", margin, 0, 1, high_inclusive=False)
    validation.check_choice("state", state, ("auto", *policy_lib.STATE_NAMES))
    return allowed_names, budget


class _Prices(NamedTuple):
    """Per leaf: the formats it may take (``ladders``), each one's predicted loss increase
    (``cost``), the leaves kept fp32 and why (``fixed``), and range rejections (``notes``)."""

    ladders: dict[str, list[str]]
    cost: dict[str, dict[str, float]]
    fixed: dict[str, str]
    notes: dict[str, str]


def _price_leaves(signals, figures, shapes, allowed_names, min_size, previous, margin) -> _Prices:
    """Each eligible leaf's ladder of formats and predicted increase on each step of it."""
    prices = _Prices({}, {}, {}, {})
    for path, (size, sum_sq, max_abs, weighted) in figures.items():
        record = signals.get(path)
        if size < min_size:
            prices.fixed[path] = f"fp32: {size} elements < min_size {min_size}"
            continue
        if len(shapes[path]) <= 1:
            prices.fixed[path] = "fp32: a vector (bias or normalisation parameter)"
            continue
        if record is None:
            prices.fixed[path] = "fp32: no curvature signal for this leaf"
            continue
        ladder, rejected = _ladder(allowed_names, max_abs)
        kappa, nsr = _curvature_and_noise(path, record)
        # Where the curvature sits, if the record has the store; else the leaf mean. A
        # Hutchinson store may hold negative entries: a negative sum is no loss decrease.
        curvature_sum = kappa * sum_sq if weighted is None else weighted
        if not math.isfinite(curvature_sum):
            # A leaf whose rounding cannot be priced is not rounded (training goes on).
            prices.fixed[path] = f"fp32: its curvature-weighted sum is not finite ({curvature_sum})"
            continue
        sensitivity = max(curvature_sum, _MIN_SENSITIVITY) / (1.0 + nsr)
        before = previous.policy.compute(path) if previous is not None else "fp32"
        prices.cost[path] = {}
        for name in ladder:
            increase = policy_lib.float_format(name).unit_roundoff ** 2 / 6 * sensitivity
            if name == "fp32":
                increase = 0.0
            elif previous is not None:
                increase *= (1 - margin) if name == before else (1 + margin)
            prices.cost[path][name] = increase
        prices.ladders[path] = ladder
        if rejected:
            prices.notes[path] = "; ".join(rejected)
    return prices


def _curvature_and_noise(path: str, record: Any) -> tuple[float, float]:
    """A signal record's mean curvature (>= 0) and noise-to-signal ratio (capped), or an error."""
    try:
        kappa = max(float(record["mean_curvature"]), 0.0)
        nsr = min(max(float(record.get("noise_to_signal", 0.0)), 0.0), _MAX_NOISE_DISCOUNT)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(
            f"`signals[{path!r}]` must hold a number 'mean_curvature' (and optionally "
            f"'noise_to_signal'), as triaccel_jax.signals returns; got {record!r} ({error!r})"
        ) from None
    return kappa, nsr


def _greedy(
    figures, prices: _Prices, allowance: float, savings_needed: int | None = None
) -> dict[str, str]:
    """Repeatedly takes the step down a ladder with the least predicted increase per byte saved,
    while the total stays within ``allowance`` (and, with ``savings_needed``, until the steps
    taken save that many bytes)."""
    ladders, cost = prices.ladders, prices.cost
    choice = {path: "fp32" for path in figures}
    total = 0.0
    saved_so_far = 0
    heap: list[tuple[float, str, int, int]] = []

    def push(path: str, level: int) -> None:
        ladder = ladders[path]
        if level + 1 < len(ladder):
            here, there = ladder[level], ladder[level + 1]
            width = policy_lib.carried_itemsize(here) - policy_lib.carried_itemsize(there)
            saved = width * figures[path][0]
            extra = cost[path][there] - cost[path][here]
            heapq.heappush(heap, (extra / saved, path, level + 1, saved))

    for path in ladders:
        push(path, 0)
    while heap and (savings_needed is None or saved_so_far < savings_needed):
        _, path, level, saved = heapq.heappop(heap)
        extra = cost[path][ladders[path][level]] - cost[path][choice[path]]
        if allowance > 0 and total + extra <= allowance:
            total += extra
            saved_so_far += saved
            choice[path] = ladders[path][level]
            push(path, level)
    return choice


def _hold_back(
    choice: dict[str, str],
    previous: policy_lib.PrecisionPlan | None,
    fixed: Mapping[str, str],
    patience: int,
) -> tuple[dict[str, str], dict[str, tuple[str, int]]]:
    """Hysteresis: a leaf moves only after its new choice won ``patience`` re-plans in a row.

    Returns the final choices and the streaks still pending."""
    pending: dict[str, tuple[str, int]] = {}
    final = dict(choice)
    if previous is None:
        return final, pending
    for path, proposed in choice.items():
        current = previous.policy.compute(path)
        if proposed == current or path in fixed:  # fixed leaves go fp32 at once
            continue
        target, streak = previous.pending.get(path, (proposed, 0))
        streak = streak + 1 if target == proposed else 1
        if streak < patience:
            final[path] = current
            pending[path] = (proposed, streak)
    return final, pending


def _reason(compute, cost, ladder, pending, patience, allowance, size, savings_needed) -> str:
    if pending is not None:
        return f"{compute} (held): {pending[0]} won {pending[1]}/{patience} re-plans in a row"
    share = f"{100 * cost[compute] / allowance:.1f}% of budget" if allowance > 0 else "no budget"
    if compute != "fp32":
        saved = (policy_lib.carried_itemsize("fp32") - policy_lib.carried_itemsize(compute)) * size
        return f"{compute}: predicted loss increase {cost[compute]:.2e} ({share}), saves {saved} B"
    cheaper = ladder[1] if len(ladder) > 1 else None
    if cheaper is None:
        return "fp32: no cheaper format allowed"
    if savings_needed is not None and cost[cheaper] <= allowance:
        return (
            f"fp32: {cheaper} would add {cost[cheaper]:.2e}, within the budget, but memory needs "
            f"only {savings_needed} B saved and lower precision is not taken for speed"
        )
    return f"fp32: {cheaper} would add {cost[cheaper]:.2e}, beyond the budget left"
