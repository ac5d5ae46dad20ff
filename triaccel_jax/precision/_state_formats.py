"""``plan_state_formats``: each leaf's optimizer-state format from curvature, noise and memory.

:func:`triaccel_jax.quantize_state` stores an optimizer's state in the formats of
:data:`triaccel_jax.policy.STATE_FORMATS` (float32, bfloat16, 8-bit and 4-bit blocks); this
chooses the format per leaf, the way :func:`triaccel_jax.plan_precision` chooses the compute
format (docs/design.md §3.9). Every figure it reads about a format, its error variance and the
bytes it stores, is the registry's: :attr:`StateFormat.error_variance
<triaccel_jax.policy.StateFormat>` and :meth:`StateFormat.leaf_bytes
<triaccel_jax.policy.StateFormat.leaf_bytes>`.

**The loss model.** Storing the state with stochastic rounding perturbs each update by an
unbiased error: a step of size ``lr`` moves leaf ``l`` by ``lr * (u + e)`` instead of ``lr * u``,
``e`` independent across steps. A signed copy (a momentum, Adam's ``mu``) stored in format ``f``
enters the update linearly, with relative error variance ``v_f`` (the registry's); a second
moment enters it through ``1 / sqrt(nu)``, which halves its relative error, so it counts
``v_f / 4``. The expected loss a step adds is the curvature-weighted second moment of the
perturbation (the quadratic model of the compute planner, HAWQ-V3):

    dL_l(f) = 0.5 * lr**2 * v_f * (signed + second_moments / 4) * kappa_l * n_l / (1 + nsr_l),

with Adam-like updates of unit size per element (``|u_i| ~ 1``: the normalised direction;
Muon's orthogonalised step is of the same order), ``kappa_l`` the leaf's mean curvature, ``n_l``
its size and ``nsr_l`` its gradients' noise-to-signal ratio: a leaf whose gradients are noisy
already steps with a random error of that relative variance, so its rounding counts less. The
registry's variances (fp32 0, bf16 5.5e-6, int8 9.7e-5, int8_dynamic 2.3e-4, int4 4.4e-2) are
measured on Gaussian blocks; the factored int4 second moment is priced at int4's.

**How the plan is chosen.** Each leaf's candidate formats are ordered by the bytes its state
takes in them (:meth:`~triaccel_jax.policy.StateFormat.leaf_bytes` per copy: codes and scales,
the factored second moment's row and column means), and kept on the lower convex hull of
(bytes, error variance): a format that another stores in no more bytes with no more error
(``"bf16"`` for bfloat16 parameters, ``"int8_dynamic"`` beside ``"int8"`` on Gaussian blocks) is
never a step. A move lowers one leaf by one step of its hull; its price is the increase it adds
per byte it saves.

* **Under a cap** (``max_bytes_per_parameter``): the cheapest moves per byte are taken, a heap's
  order, until parameters and state fit the cap (the greedy solution of the knapsack's
  relaxation, which takes every leaf's hull in order); a pass then raises leaves back, the most
  increase removed per byte first, while the cap still holds, so the plan ends within one step
  of one leaf of the cap (no lowered leaf can go up a step and fit). So a cap between uniform
  int4's bytes and uniform int8's mixes them: the leaves where ``v_f * kappa * n / (1 + nsr)``
  per byte is largest keep int8 (or more), the rest take int4. The predicted increase is then
  what the cap costs; no budget applies unless one is given.
* **Under a budget** (no cap): moves are taken, cheapest per byte first, while the total
  increase stays within the budget (a fraction of the loss, per step).
* **Signal-blind** (``rank_by="size"``, a cap required): the same ladders, lowered by the
  registry's order alone — every leaf to the next format of least error variance, the largest
  leaves first — until the cap holds, then raised back, the smallest leaves first, while it
  holds: the uniform format where a uniform format meets the cap, and otherwise the two formats
  around it split by leaf size. It is the baseline the plan is compared against at the same
  bytes (``max_bytes_per_parameter=plan.bytes_per_parameter``); its ``predicted_increase`` is
  priced with the same signals.

With a cap, the signal plan is also never predicted worse than the signal-blind one at that cap:
where the greedy's discrete end leaves it so (a knapsack's corner), the signal-blind assignment
is taken, and its reasons say so.
"""

from __future__ import annotations

import dataclasses
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

# The candidates by default: every registry format but int8_dynamic, which stores int8's bytes
# with a larger error variance on Gaussian blocks (never a step of the hull; allowed when asked).
CANDIDATES = ("fp32", "bf16", "int8", "int4")
RANK_BY = ("signals", "size")
# Beyond this the gradient noise no longer discounts the rounding noise (as the compute planner).
_MAX_NOISE_DISCOUNT = 1e3
# A relative slack for the cap's comparison: a plan's own bytes_per_parameter passed back as a
# cap must hold for the same assignment despite the division's rounding.
_CAP_SLACK = 1e-12


class StateFormatPlan(NamedTuple):
    """The optimizer-state format chosen for each leaf, and what it costs and saves.

    Attributes:
      formats: ``{leaf path: format name}`` (names of :data:`triaccel_jax.policy.STATE_FORMATS`):
        pass it as ``quantize_state(inner, format=plan.formats)``.
      bytes_per_parameter: parameters plus state per parameter (an analytic count from the
        dtypes and the registry's :meth:`~triaccel_jax.policy.StateFormat.leaf_bytes`: the
        parameters' own bytes, and each state copy in its format, scales and factored means
        included), before: 4 + 4 x ``state_copies`` for float32.
      predicted_increase: the loss a step is predicted to add by the rounding of the state,
        summed over the leaves (in the loss's units).
      allowance: the increase the budget allowed (``inf`` with no budget; 0 under a cap alone).
      reasons: ``{leaf path: why}``.
      meets_cap: whether ``bytes_per_parameter`` is within ``max_bytes_per_parameter`` (True
        without a cap). False when no choice of the formats allowed reaches it (leaves under
        ``min_size`` or without signals stay float32, and the fewest bytes of a format are its
        floor); the plan is then the fewest bytes it can reach, and a warning says so.
      state_bytes: ``{leaf path: bytes}`` of each leaf's state, all its copies, in its format
        (``bytes_per_parameter`` is their sum and the parameters' bytes over the parameters).
    """

    formats: dict[str, str]
    bytes_per_parameter: float
    predicted_increase: float
    allowance: float
    reasons: dict[str, str]
    meets_cap: bool = True
    state_bytes: dict[str, int] | None = None


@dataclasses.dataclass
class _Leaf:
    """One parameter leaf as the planner prices it."""

    size: int
    ladder: list[str]  # its hull's formats, the most bytes first (fp32)
    bytes: dict[str, int]  # its state's bytes (every copy) in each candidate format
    weight: float | None  # increase per unit of error variance; None: cannot be priced
    position: int = 0  # its format's index in ladder

    @property
    def format(self) -> str:
        return self.ladder[self.position]

    def increase(self, name: str) -> float:
        if self.weight is None:
            return 0.0
        return self.weight * policy_lib.state_format(name).error_variance


def _hull(points: dict[str, tuple[int, float]]) -> list[str]:
    """The formats on the lower convex hull of ``{name: (bytes, error variance)}``, from the
    most bytes (fp32's, error 0) down: each step saves bytes at a price per byte no lower than
    the step before, and no format left out is a better trade."""
    # By bytes, the most first (among equal bytes the least error); a format is on the front
    # where no other stores it in no more bytes with no more error.
    ordered = sorted(points, key=lambda n: (-points[n][0], points[n][1], n))
    front: list[str] = []
    for name in ordered:
        nbytes, error = points[name]
        if front and nbytes == points[front[-1]][0]:
            continue  # as many bytes as one kept, and no less error
        while front and points[front[-1]][1] >= error:
            front.pop()  # more bytes, and no less error
        front.append(name)
    hull: list[str] = []
    for name in front:
        while len(hull) >= 2:
            (b0, e0), (b1, e1), (b2, e2) = (points[n] for n in (hull[-2], hull[-1], name))
            # hull[-1] is above the chord from hull[-2] to name: its first step costs more per
            # byte than its second, so it is no step of the hull.
            if (e1 - e0) * (b1 - b2) >= (e2 - e1) * (b0 - b1):
                hull.pop()
            else:
                break
        hull.append(name)
    return hull


def plan_state_formats(
    signals: Mapping[str, Mapping[str, Any]],
    params: Any,
    *,
    learning_rate: float,
    budget: float | None = None,
    loss: float | None = None,
    formats: Sequence[str] = CANDIDATES,
    state_copies: int = 2,
    second_moments: int | None = None,
    block_size: int | None = None,
    min_size: int = 4096,
    max_bytes_per_parameter: float | None = None,
    rank_by: str = "signals",
) -> StateFormatPlan:
    """Plans each leaf's optimizer-state format from the curvature and noise signals.

    The loss model, the registry's figures it reads and how a cap binds are in docs/design.md
    §3.9 ("The planner's choice per leaf"). Two calls a study compares, at the same bytes:

    * the plan at a cap: ``plan_state_formats(signals, params, learning_rate=lr,
      max_bytes_per_parameter=cap)``;
    * the signal-blind assignment at the plan's bytes: ``plan_state_formats(signals, params,
      learning_rate=lr, max_bytes_per_parameter=plan.bytes_per_parameter, rank_by="size")``
      (a uniform format is ``quantize_state(inner, format="int4")`` itself).

    Args:
      signals: :func:`triaccel_jax.signals` of the optimizer state (the observer
        :func:`triaccel_jax.curvature_signals` in the chain gives them over any optimizer): per
        leaf path ``"mean_curvature"`` and optionally ``"noise_to_signal"``. A leaf whose
        figures are NaN or infinite cannot be priced and keeps its state as the inner keeps it.
      params: the parameter tree (shapes, and the bytes of the parameters and of the state an
        optax optimizer keeps in their dtype: bfloat16 parameters' moments are bfloat16, so
        ``"bf16"`` is no move for them).
      learning_rate: the step size the state's updates are taken at (> 0).
      budget: the loss a step may gain from the state's rounding, >= 0: a fraction of ``loss``
        when given, else in the loss's units. 0 keeps every leaf in float32; ``inf`` takes the
        fewest bytes for every eligible leaf. None (the default): 1e-3 without a cap, 0 with
        one (the cap alone decides: a budget beside a cap lowers further, within it).
      loss: the current loss, making ``budget`` relative.
      formats: the formats to choose from, names in :data:`triaccel_jax.policy.STATE_FORMATS`
        (float32 is always allowed); by default ``"fp32"``, ``"bf16"``, ``"int8"`` and
        ``"int4"`` (``"int8_dynamic"`` when asked).
      state_copies: state leaves per parameter that the formats apply to (AdamW 2: ``mu`` and
        ``nu``; Muon or SGD with momentum 1).
      second_moments: how many of the ``state_copies`` are non-negative second moments (Adam's
        ``nu``: stored in the unsigned maps, factored under ``"int4"``; their error counts a
        quarter). None: AdamW-like, 1 when ``state_copies`` >= 2, else 0 (Muon, SGD).
      block_size: the block size of every coded format, as ``quantize_state``'s; None: each
        format's own (the registry's: 256 for int8, 128 for int4).
      min_size: leaves with fewer elements stay float32, as ``quantize_state`` keeps them.
      max_bytes_per_parameter: a memory cap on parameters plus state per parameter (> 0). The
        plan lowers the leaves whose rounding costs the least loss per byte until it holds, then
        raises leaves back while it still holds (the module's docstring). A cap the plan cannot
        meet is said in the plan (``meets_cap`` False, ``bytes_per_parameter`` the fewest it
        reached) and warned.
      rank_by: ``"signals"`` (the plan) or ``"size"``: the signal-blind baseline at the cap,
        which needs ``max_bytes_per_parameter`` and takes no budget (the module's docstring).

    Returns:
      A :class:`StateFormatPlan`.

    Raises:
      ValueError: a format, count, bound or ``rank_by`` is invalid (named), ``rank_by="size"``
        without a cap or with a budget, or ``signals`` share no leaf with ``params``.
      TypeError: ``signals`` is not a mapping.

    Example:
      Under a budget, the sharper leaves keep more bits:

      >>> import jax.numpy as jnp
      >>> from triaccel_jax.precision import plan_state_formats
      >>> params = {
      ...     "flat": jnp.ones((128, 128)),
      ...     "middle": jnp.ones((128, 128)),
      ...     "sharp": jnp.ones((256, 128)),
      ... }
      >>> signals = {
      ...     "flat": {"mean_curvature": 1e-6},
      ...     "middle": {"mean_curvature": 5e-3},
      ...     "sharp": {"mean_curvature": 1.0},
      ... }
      >>> plan = plan_state_formats(signals, params, learning_rate=1e-3, budget=1e-9)
      >>> plan.formats
      {'flat': 'int4', 'middle': 'bf16', 'sharp': 'fp32'}

      Under a cap between uniform int4's bytes (4.59 a parameter for AdamW here) and uniform
      int8's (6.06), the plan mixes them; the signal-blind baseline at its bytes lowers the
      largest leaf, the sharp one, and is predicted to cost 200 times as much:

      >>> plan = plan_state_formats(
      ...     signals, params, learning_rate=1e-3, max_bytes_per_parameter=5.6
      ... )
      >>> plan.formats, round(plan.bytes_per_parameter, 3), plan.meets_cap
      ({'flat': 'int4', 'middle': 'int4', 'sharp': 'int8'}, 5.328, True)
      >>> blind = plan_state_formats(
      ...     signals,
      ...     params,
      ...     learning_rate=1e-3,
      ...     max_bytes_per_parameter=plan.bytes_per_parameter,
      ...     rank_by="size",
      ... )
      >>> blind.formats, round(blind.predicted_increase / plan.predicted_increase)
      ({'flat': 'int8', 'middle': 'int8', 'sharp': 'int4'}, 213)

    References:
      Dettmers et al., 2021, "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861;
      Li, Chen & Zhu, 2023, "Memory Efficient Optimizers with 4-bit States", arXiv 2309.01507;
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
    validation.check_choice("rank_by", rank_by, RANK_BY)
    if max_bytes_per_parameter is not None:
        validation.check_in_range(
            "max_bytes_per_parameter", max_bytes_per_parameter, 0.0, math.inf, low_inclusive=False
        )
    if rank_by == "size" and max_bytes_per_parameter is None:
        raise ValueError(
            "rank_by='size' assigns formats by leaf size to meet a cap: pass "
            "max_bytes_per_parameter (the signal plan's bytes_per_parameter, to compare at the "
            "same bytes)"
        )
    budget_given = budget is not None
    if budget is None:
        budget = 1e-3 if max_bytes_per_parameter is None else 0.0
    elif rank_by == "size":
        raise ValueError("rank_by='size' plans by the cap alone: leave `budget` out")
    budget = validation.real_scalar("budget", budget, "a number >= 0 (inf allowed)")
    if not budget >= 0:  # NaN too
        raise ValueError(f"`budget` must be a number >= 0 (inf allowed), got {budget!r}")
    if loss is not None:
        validation.check_in_range("loss", loss, 0.0, math.inf, high_inclusive=False)
    if isinstance(formats, str):
        formats = (formats,)
    unknown = [f for f in formats if f not in policy_lib.STATE_FORMATS]
    if unknown:
        raise ValueError(
            f"unknown state formats {unknown}; choose from {list(policy_lib.STATE_FORMATS)}"
        )
    state_copies = validation.check_integer("state_copies", state_copies, 1)
    if second_moments is None:
        second_moments = 1 if state_copies >= 2 else 0
    second_moments = validation.check_integer("second_moments", second_moments, 0)
    if second_moments > state_copies:
        raise ValueError(
            f"`second_moments` ({second_moments}) must be at most `state_copies` ({state_copies})"
        )
    if block_size is not None:
        block_size = validation.check_integer("block_size", block_size, 1)
    min_size = validation.check_integer("min_size", min_size, 0)
    allowed = [f for f in policy_lib.STATE_FORMATS if f == "fp32" or f in formats]
    signed = state_copies - second_moments
    # The update's relative error variance per unit of v_f: a signed copy enters it linearly, a
    # second moment through 1 / sqrt(nu), at half the relative error (a quarter the variance).
    copies_weight = signed + second_moments / 4

    params_leaves = policy_lib.trainable_paths(params)
    if not set(signals) & {path for path, _ in params_leaves}:
        raise ValueError(
            "`signals` shares no leaf path with `params` (signals for "
            f"{sorted(signals)[:4]}, params {sorted(p for p, _ in params_leaves)[:4]}): pass the "
            "signals of this model's optimizer state"
        )

    def state_bytes(shape: tuple[int, ...], itemsize: int, name: str) -> int:
        state = policy_lib.state_format(name)
        block = None if state.is_float else block_size
        one_signed = state.leaf_bytes(shape, itemsize, block_size=block)
        one_second = state.leaf_bytes(shape, itemsize, second_moment=True, block_size=block)
        return signed * one_signed + second_moments * one_second

    leaves: dict[str, _Leaf] = {}
    reasons: dict[str, str] = {}
    own_bytes = 0
    for path, leaf in params_leaves:
        shape = tuple(int(d) for d in leaf.shape)
        size = math.prod(shape)
        itemsize = np.dtype(leaf.dtype).itemsize
        own_bytes += size * itemsize
        weight = None
        if path not in signals:
            reasons[path] = "no signals for this leaf: float32"
        elif size < min_size or size == 0:
            reasons[path] = f"{size} elements, under min_size {min_size}: float32"
        else:
            record = signals[path]
            kappa = float(record.get("mean_curvature", 0.0))
            nsr = float(record.get("noise_to_signal", 0.0))
            # A NaN figure, or an infinite curvature times size, cannot be priced (a NaN or
            # infinite increase would make every comparison false): the leaf keeps its state.
            if math.isnan(nsr) or not math.isfinite(max(kappa, 0.0) * size):
                reasons[path] = (
                    f"its signals are not finite (mean_curvature {record.get('mean_curvature')}"
                    f", noise_to_signal {record.get('noise_to_signal')}): float32"
                )
            else:
                discount = 1.0 + min(max(nsr, 0.0), _MAX_NOISE_DISCOUNT)
                weight = 0.5 * learning_rate**2 * copies_weight * max(kappa, 0.0) * size / discount
        names = allowed if weight is not None else ["fp32"]
        by_format = {name: state_bytes(shape, itemsize, name) for name in names}
        points = {n: (by_format[n], policy_lib.state_format(n).error_variance) for n in names}
        leaves[path] = _Leaf(size, _hull(points), by_format, weight)

    total = sum(leaf.size for leaf in leaves.values())
    allowance = budget * (loss if loss is not None and not math.isinf(budget) else 1.0)
    cap = None if max_bytes_per_parameter is None else max_bytes_per_parameter * total

    def used() -> int:
        return own_bytes + sum(leaf.bytes[leaf.format] for leaf in leaves.values())

    def fits(nbytes: float) -> bool:
        return cap is None or nbytes <= cap * (1 + _CAP_SLACK)

    def spent() -> float:
        return sum(leaf.increase(leaf.format) for leaf in leaves.values())

    def step(path: str, down: bool) -> tuple[float, int] | None:
        """(increase added, bytes saved) of moving ``path`` one hull step down (or up: both
        negative), or None at its ladder's end."""
        leaf = leaves[path]
        other = leaf.position + (1 if down else -1)
        if not 0 <= other < len(leaf.ladder):
            return None
        here, there = leaf.format, leaf.ladder[other]
        return leaf.increase(there) - leaf.increase(here), leaf.bytes[here] - leaf.bytes[there]

    def signal_key(path: str) -> tuple[float, int, str] | None:
        move = step(path, down=True)
        if move is None:
            return None
        added, saved = move
        return added / saved, -leaves[path].size, path

    def blind_key(path: str) -> tuple[float, int, str] | None:
        # The registry's order alone: the next format of least error first, largest leaves first.
        leaf = leaves[path]
        if leaf.position + 1 == len(leaf.ladder):
            return None
        lower = leaf.ladder[leaf.position + 1]
        return policy_lib.state_format(lower).error_variance, -leaf.size, path

    def lower_until(key: Any, stop: Any) -> None:
        """Lower the leaves, in ``key``'s order, until ``stop()`` holds or none can move."""
        heap = [k for path in leaves if leaves[path].weight is not None if (k := key(path))]
        heapq.heapify(heap)
        while heap and not stop():
            *_, path = heapq.heappop(heap)
            leaves[path].position += 1
            if (k := key(path)) is not None:
                heapq.heappush(heap, k)

    def raise_back(order: Any) -> None:
        """Raise leaves back one step at a time, the best by ``order`` first, while the cap
        holds: the plan ends within one step of one leaf of the cap."""
        while True:
            best = None
            now = used()
            for path in leaves:
                move = step(path, down=False)
                if move is None or not fits(now - move[1]):
                    continue
                rank = order(path, move)
                if rank is not None and (best is None or rank < best[0]):
                    best = (rank, path)
            if best is None:
                return
            leaves[best[1]].position -= 1

    def signal_order(path: str, move: tuple[float, int]) -> tuple[float, int, str] | None:
        removed, added_bytes = -move[0], -move[1]
        if not removed > 0:
            return None  # raising it removes no increase: it costs bytes for nothing
        return -removed / added_bytes, -leaves[path].size, path

    def blind_order(path: str, move: tuple[float, int]) -> tuple[float, int, str]:
        # Undo the least precise format first, the smallest leaves first.
        leaf = leaves[path]
        return -policy_lib.state_format(leaf.format).error_variance, leaf.size, path

    def over_cap() -> bool:
        return not fits(used())

    if rank_by == "size":
        lower_until(blind_key, lambda: not over_cap())
        raise_back(blind_order)
        for path, leaf in leaves.items():
            if leaf.weight is not None:
                reasons[path] = (
                    f"{leaf.format}: signal-blind, by leaf size, for the cap "
                    f"{max_bytes_per_parameter} B/parameter"
                )
    else:
        why: dict[str, str] = {}
        if cap is not None:
            lower_until(signal_key, lambda: not over_cap())
            raise_back(signal_order)
            signal_positions = {path: leaf.position for path, leaf in leaves.items()}
            signal_spent = spent()
            # The signal-blind assignment at this cap, priced alike: never predicted better.
            for leaf in leaves.values():
                leaf.position = 0
            lower_until(blind_key, lambda: not over_cap())
            raise_back(blind_order)
            blind_better = not over_cap() and spent() < signal_spent
            if not blind_better:
                for path, position in signal_positions.items():
                    leaves[path].position = position
            for path, leaf in leaves.items():
                if leaf.weight is not None and leaf.position > 0:
                    why[path] = (
                        f"{leaf.format}: for memory (the cap {max_bytes_per_parameter} "
                        f"B/parameter), adding {leaf.increase(leaf.format):.3g} to the loss a "
                        "step"
                        + (
                            ": the size-ranked assignment predicts less here"
                            if blind_better
                            else ""
                        )
                    )
        # Within the budget left, lower further, least increase per byte first (under a cap
        # without a budget, none).
        heap = [k for path in leaves if leaves[path].weight is not None if (k := signal_key(path))]
        if cap is not None and not budget_given:
            heap = []
            for path, leaf in leaves.items():
                if leaf.weight is not None and path not in why:
                    why[path] = (
                        f"{leaf.format}: kept, the cap holds without lowering it (it costs more "
                        "loss per byte than the leaves lowered)"
                    )
        heapq.heapify(heap)
        total_spent = spent()
        while heap:
            *_, path = heapq.heappop(heap)
            move = step(path, down=True)
            assert move is not None
            added, _ = move
            leaf = leaves[path]
            lower = leaf.ladder[leaf.position + 1]
            if not total_spent + added <= allowance:
                refused = (
                    f"not {lower}: it would add {added:.3g} to the loss a step, over the budget "
                    f"left ({max(allowance - total_spent, 0.0):.3g})"
                )
                moved = why.get(path)
                why[path] = f"{moved}; {refused}" if moved else f"{leaf.format}: {refused}"
                continue
            leaf.position += 1
            total_spent += added
            why[path] = f"{lower}: adds {added:.3g} to the loss a step, within the budget"
            if (k := signal_key(path)) is not None:
                heapq.heappush(heap, k)
        for path, leaf in leaves.items():
            if leaf.weight is not None:
                reasons[path] = why.get(path, f"{leaf.format}: the cheapest within the budget")

    nbytes = used()
    meets_cap = fits(nbytes)
    if not meets_cap:
        # Said, not only returned: a plan over the cap would otherwise pass for one within it.
        stuck = sum(leaf.weight is None for leaf in leaves.values())
        caller.warn(
            f"plan_state_formats cannot meet max_bytes_per_parameter={max_bytes_per_parameter}: "
            f"with the formats {allowed} the fewest bytes it reaches are {nbytes / total:.4g} "
            f"per parameter ({stuck} of {len(leaves)} leaves must stay float32: under min_size, "
            "without signals or with non-finite ones); the plan has meets_cap=False"
        )
    return StateFormatPlan(
        formats={path: leaf.format for path, leaf in leaves.items()},
        bytes_per_parameter=nbytes / total,
        predicted_increase=spent(),
        allowance=allowance,
        reasons=reasons,
        meets_cap=meets_cap,
        state_bytes={path: leaf.bytes[leaf.format] for path, leaf in leaves.items()},
    )
