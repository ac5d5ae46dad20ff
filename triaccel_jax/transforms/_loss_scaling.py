"""Dynamic loss scaling with per-leaf finite checks, as an optax wrapper (docs/design.md §3).

fp16 and fp8 have narrow exponent ranges: small gradients underflow unless the loss is multiplied
by a large scale before differentiation (Micikevicius et al., 2018, "Mixed Precision Training").
The scale is dynamic: it backs off when a step overflows and grows after a run of finite steps,
as PyTorch's GradScaler and Flax's ``DynamicScale`` do. Here the wrapper also counts non-finite
gradients per leaf (which layer overflows), and a skipped step returns updates of ``-0.0``:
``x + (-0.0) == x`` bit for bit for every ``x`` (``+0.0`` would turn a ``-0.0`` parameter into
``+0.0``), so the parameters and the inner state stay bit-identical.

The scale's rule lives in one place, :class:`LossScaling`, which the wrapper, the controller's
compiled step and :class:`triaccel_jax.flax.TrainState` share. Gradients are unscaled in float32:
dividing a float16 gradient by the scale in float16 would underflow exactly the small values the
scale was there to keep.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from triaccel_jax._src import tree as tree_lib
from triaccel_jax._src import validation

# Compute formats whose exponent range is too narrow for small gradients: a policy putting any
# leaf in one of these trains with a scaled loss.
NARROW_FORMATS = ("fp16", "fp8_e4m3")


class LossScaleState(NamedTuple):
    """The dynamic loss scale carried across steps by the controller and the Flax train state.

    Attributes:
      scale: float32 loss scale to multiply the loss by before differentiating.
      good_steps: int32 consecutive finite steps since the scale last changed.
      skipped_steps: int32 total steps skipped for non-finite gradients (saturating).

    Example:
      >>> from triaccel_jax.transforms import LossScaling
      >>> state = LossScaling().init()
      >>> float(state.scale), int(state.good_steps), int(state.skipped_steps)
      (32768.0, 0, 0)
    """

    scale: jax.Array
    good_steps: jax.Array
    skipped_steps: jax.Array


@dataclasses.dataclass(frozen=True)
class LossScaling:
    """The dynamic loss scale's rule: back off on overflow, grow after a run of finite steps.

    Attributes:
      initial_scale: starting scale, > 0.
      growth_interval: finite steps in a row before the scale grows, >= 1.
      growth_factor: multiplier on growth, >= 1.
      backoff_factor: multiplier on overflow, in (0, 1].
      min_scale: the scale never backs off below this, > 0.
      max_scale: the scale never grows above this, >= min_scale.

    The controller (``Controller(..., loss_scaling=...)``) and
    :class:`triaccel_jax.flax.TrainState` apply it while the precision policy computes any leaf
    in fp16 or fp8; :func:`dynamic_loss_scale` applies it as an optax wrapper.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.transforms import LossScaling
      >>> rule = LossScaling(initial_scale=8.0, growth_interval=2)
      >>> state = rule.update(rule.init(), jnp.asarray(False))  # an overflow: back off, skip
      >>> float(state.scale), int(state.skipped_steps)
      (4.0, 1)
      >>> for _ in range(2):  # two finite steps in a row: grow
      ...     state = rule.update(state, jnp.asarray(True))
      >>> float(state.scale)
      8.0

    References:
      Micikevicius et al., 2018, "Mixed Precision Training".
    """

    initial_scale: float = 2.0**15
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def __post_init__(self) -> None:
        validation.check_in_range(
            "initial_scale", self.initial_scale, 0.0, float("inf"), low_inclusive=False
        )
        validation.check_integer("growth_interval", self.growth_interval, 1)
        validation.check_in_range("growth_factor", self.growth_factor, 1.0, float("inf"))
        validation.check_in_range(
            "backoff_factor", self.backoff_factor, 0.0, 1.0, low_inclusive=False
        )
        validation.check_in_range(
            "min_scale", self.min_scale, 0.0, float("inf"), low_inclusive=False
        )
        validation.check_not_above("min_scale", self.min_scale, "max_scale", self.max_scale)

    def init(self) -> LossScaleState:
        """The state before the first step."""
        return LossScaleState(
            scale=jnp.asarray(self.initial_scale, jnp.float32),
            good_steps=jnp.zeros([], jnp.int32),
            skipped_steps=jnp.zeros([], jnp.int32),
        )

    def update(self, state: LossScaleState, finite: jax.Array) -> LossScaleState:
        """The state after a step whose gradients were all finite (``finite``) or not."""
        good = optax.safe_increment(state.good_steps)
        grow = finite & (good >= self.growth_interval)
        scale = jnp.where(
            finite,
            jnp.where(
                grow, jnp.minimum(state.scale * self.growth_factor, self.max_scale), state.scale
            ),
            jnp.maximum(state.scale * self.backoff_factor, self.min_scale),
        ).astype(jnp.float32)
        return LossScaleState(
            scale=scale,
            good_steps=jnp.where(finite & ~grow, good, 0).astype(jnp.int32),
            skipped_steps=jnp.where(
                finite, state.skipped_steps, optax.safe_increment(state.skipped_steps)
            ).astype(jnp.int32),
        )


def needs_loss_scaling(policy: Any) -> bool:
    """Whether a precision policy (or None) computes any leaf in fp16 or fp8."""
    return policy is not None and any(policy.compute(path) in NARROW_FORMATS for path in policy)


def unscale(grads: Any, scale: jax.Array) -> Any:
    """Gradients of a scaled loss, divided by the scale in float32 (non-trainable leaves kept)."""
    return jax.tree.map(
        lambda g: g.astype(jnp.float32) / scale if tree_lib.is_trainable(g) else g, grads
    )


def leaf_finite(grads: Any) -> Any:
    """Per trainable leaf, whether every element is finite (``MaskedNode`` for the others)."""
    return jax.tree.map(
        lambda g: jnp.all(jnp.isfinite(g)) if tree_lib.is_trainable(g) else optax.MaskedNode(),
        grads,
    )


def all_finite(finite: Any) -> jax.Array:
    """Whether every leaf of :func:`leaf_finite`'s tree is finite (True for no leaf)."""
    return jnp.all(jnp.stack([jnp.asarray(True), *jax.tree.leaves(finite)]))


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """``on_true`` where the scalar ``pred`` holds, else ``on_false``, leaf by leaf.

    The one way a step with a non-finite gradient is skipped (the loss-scaled training step and
    :func:`dynamic_loss_scale` both use it): both trees are computed and one is selected, as
    jmp's ``select_tree`` and Flax's ``DynamicScale`` do, so that no device-side branch is
    needed and a skipped step returns ``on_false`` bit for bit.

    Args:
      pred: a scalar boolean.
      on_true: a pytree.
      on_false: a pytree of the same structure, shapes and dtypes (PRNG key leaves included).

    Returns:
      The selected pytree.

    Raises:
      ValueError: the trees differ in structure, or ``pred`` is not a scalar boolean.
      TypeError: two leaves differ in shape or dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from triaccel_jax.transforms import select_tree
      >>> new, old = {"w": jnp.array([1.0, jnp.inf])}, {"w": jnp.array([0.5, 0.5])}
      >>> select_tree(jnp.asarray(False), new, old)["w"].tolist()
      [0.5, 0.5]

    References:
      jmp (DeepMind's mixed precision library), ``jmp.select_tree``; Flax,
      ``flax.training.dynamic_scale.DynamicScale``.
    """
    pred = jnp.asarray(pred)
    if pred.shape != () or pred.dtype != jnp.bool_:
        raise ValueError(f"`pred` must be a scalar boolean, got {pred.dtype}{list(pred.shape)}")
    return jax.tree.map(
        lambda a, b: lax.select(pred, jnp.asarray(a), jnp.asarray(b)), on_true, on_false
    )


class DynamicLossScaleState(NamedTuple):
    """State of :func:`dynamic_loss_scale`.

    Attributes:
      scale: float32 loss scale to multiply the loss by before differentiating.
      good_steps: int32 consecutive finite steps since the scale last changed.
      skipped_steps: int32 total steps skipped for non-finite gradients (saturating).
      nonfinite_count: int32 per leaf, steps in which that leaf's gradient was not finite.
      inner_state: the wrapped transform's state.
    """

    scale: jax.Array
    good_steps: jax.Array
    skipped_steps: jax.Array
    nonfinite_count: Any
    inner_state: Any


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    *,
    initial_scale: float = 2.0**15,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner``: unscales the gradients, and skips the step where any leaf is non-finite.

    Multiply the loss by :func:`loss_scale` of the state before taking gradients; pass the scaled
    gradients to ``update``. On a finite step the gradients are divided by the scale in float32
    and handed to ``inner`` in float32 (unscaling in a float16 gradient's own dtype would
    underflow the small values the scale preserved); after ``growth_interval`` finite steps in a row the scale grows by
    ``growth_factor``. On a step where any leaf's gradient holds inf or nan, the updates are
    ``-0.0``, ``inner``'s state is left untouched, the scale is multiplied by ``backoff_factor``
    and the offending leaves are counted.

    Args:
      inner: the optimizer to protect (e.g. :func:`triaccel_jax.triaccel`).
      initial_scale: starting scale, > 0.
      growth_interval: finite steps in a row before the scale grows, >= 1.
      growth_factor: multiplier on growth, >= 1.
      backoff_factor: multiplier on overflow, in (0, 1].
      min_scale: the scale never backs off below this, > 0.
      max_scale: the scale never grows above this, >= min_scale.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` that forwards extra arguments to ``inner``.

    Example:
      >>> import jax.numpy as jnp
      >>> import triaccel_jax
      >>> tx = triaccel_jax.transforms.dynamic_loss_scale(
      ...     triaccel_jax.triaccel(0.1), initial_scale=8.0
      ... )
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
      >>> (
      ...     float(triaccel_jax.transforms.loss_scale(state)),
      ...     int(state.skipped_steps),
      ...     updates["w"].tolist(),
      ... )
      (4.0, 1, [-0.0, -0.0])

    References:
      Micikevicius et al., 2018, "Mixed Precision Training".
    """
    rule = LossScaling(
        initial_scale, growth_interval, growth_factor, backoff_factor, min_scale, max_scale
    )
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> DynamicLossScaleState:
        start = rule.init()
        return DynamicLossScaleState(
            scale=start.scale,
            good_steps=start.good_steps,
            skipped_steps=start.skipped_steps,
            nonfinite_count=jax.tree.map(
                lambda p: (
                    jnp.zeros([], jnp.int32) if tree_lib.is_trainable(p) else optax.MaskedNode()
                ),
                params,
            ),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        grads = unscale(updates, state.scale)
        finite_leaves = leaf_finite(grads)
        finite = all_finite(finite_leaves)

        new_updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)

        def skipped(update, grad):
            if tree_lib.is_trainable(update):
                return jnp.full(update.shape, -0.0, update.dtype)
            return grad  # integer leaves pass through, as the inner update passes them

        # A skipped step: -0.0 updates in the dtypes the inner update gives, its state kept.
        new_updates, inner_state = select_tree(
            finite,
            (new_updates, inner_state),
            (jax.tree.map(skipped, new_updates, grads), state.inner_state),
        )
        scale_state = rule.update(
            LossScaleState(state.scale, state.good_steps, state.skipped_steps), finite
        )
        counts = jax.tree.map(
            lambda count, leaf_ok: jnp.where(leaf_ok, count, optax.safe_increment(count)),
            state.nonfinite_count,
            finite_leaves,
        )
        return new_updates, DynamicLossScaleState(
            scale=scale_state.scale,
            good_steps=scale_state.good_steps,
            skipped_steps=scale_state.skipped_steps,
            nonfinite_count=counts,
            inner_state=inner_state,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def holds_loss_scale(opt_state: Any) -> bool:
    """Whether ``opt_state`` holds a :func:`dynamic_loss_scale` state anywhere."""

    def is_scale_state(node):
        return isinstance(node, DynamicLossScaleState)

    return any(is_scale_state(n) for n in jax.tree.leaves(opt_state, is_leaf=is_scale_state))


def loss_scale(opt_state: Any) -> jax.Array:
    """The current loss scale in an optimizer state holding a :func:`dynamic_loss_scale` state.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import triaccel_jax
      >>> tx = optax.chain(
      ...     optax.clip(1.0), triaccel_jax.transforms.dynamic_loss_scale(optax.sgd(0.1))
      ... )
      >>> float(triaccel_jax.transforms.loss_scale(tx.init({"w": jnp.ones(2)})))
      32768.0
    """

    def is_scale_state(node):
        return isinstance(node, DynamicLossScaleState)

    found = [n for n in jax.tree.leaves(opt_state, is_leaf=is_scale_state) if is_scale_state(n)]
    if len(found) != 1:
        raise ValueError(
            f"expected one dynamic_loss_scale state in `opt_state`, found {len(found)}"
        )
    return found[0].scale
