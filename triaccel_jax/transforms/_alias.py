"""The optimizers, composed from the curvature signals, a direction and the step scale.

As optax's ``alias.py`` builds ``adamw`` from ``scale_by_adam`` and ``optax.contrib.muon``
from ``scale_by_muon``, each optimizer here only composes (docs/design.md §3):

* :func:`scale_by_triaccel`: the curvature signals keeping Adam's moments, which return Adam's
  direction (:func:`._observer.adam_with_signals`), then Tri-Accel's step scale
  (:func:`._step_scale.scale_by_step_scale`);
* :func:`triaccel`: the same, then decoupled weight decay and the learning rate;
* :func:`scale_by_curvature`: the observer (:func:`._observer.observe`), any given direction,
  then the step scale.

:func:`with_signals` composes them. The signals' settings and the step scale's are one record
each (:class:`._config.CurvatureSettings`, :class:`._config.StepScaleSettings`); the factories
take them as keyword arguments so that ``optax.inject_hyperparams`` can trace every number.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from triaccel_jax._src import tree as tree_lib
from triaccel_jax._src import validation
from triaccel_jax.transforms import _observer as observer
from triaccel_jax.transforms import _step_scale as step_scale_lib
from triaccel_jax.transforms._config import CurvatureSettings
from triaccel_jax.transforms._config import StepScaleSettings
from triaccel_jax.transforms._config import TriAccelConfig
from triaccel_jax.transforms._config import resolve_config


def scale_by_triaccel(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    config: TriAccelConfig | None = None,
    curvature_every: int = 10,
    curvature_decay: float = 0.95,
    alpha: float = 0.5,
    min_scale: float = 0.5,
    max_scale: float = 2.0,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Rescales updates by Adam's moments times a per-leaf curvature step-size scale.

    The direction part of :func:`triaccel_jax.triaccel` (no learning rate, no weight decay), under
    optax's ``scale_by_*`` contract: chain it with ``optax.scale_by_learning_rate``. Every
    numeric argument may be injected by ``optax.inject_hyperparams`` (``jax.jit(tx.init)`` needs
    no ``static_args``); the options that set shapes live in ``config``.

    Args:
      b1: decay of the first moment, in [0, 1).
      b2: decay of the second moment, in [0, 1).
      eps: added to ``sqrt(v_hat)`` in the denominator, >= 0.
      config: a :class:`triaccel_jax.TriAccelConfig`: estimator, curvature-store layout
        (``block_size``, ``rho``), Hutchinson probes, moment dtype and the step scale's
        granularity (``scale``: per leaf or per store block), and ``axis_name``, the
        ``shard_map``/``pmap`` axis over which replicas average their curvature estimates.
        None: its defaults.
      curvature_every: estimate curvature every this many steps (>= 1), starting at the first.
      curvature_decay: EMA decay of the curvature estimates, in [0, 1).
      alpha: exponent of the step-size scale (>= 0; 0 turns the scaling off).
      min_scale: lower clip of the step-size scale, > 0.
      max_scale: upper clip of the step-size scale, >= min_scale.
      seed: seed of the PRNG keys for stochastic rounding and Hutchinson probes.

    Returns:
      An ``optax.GradientTransformationExtraArgs``. Its ``update`` takes the keyword-only extra
      argument ``loss_fn`` (used by the Hutchinson estimator, ignored otherwise; optax's names
      ``obj_fn`` and ``value_fn`` for the same function are accepted too) and ignores other
      extra arguments. The update has each gradient's dtype.

    Raises:
      ValueError: a hyperparameter is out of range.
      TypeError: ``config`` is not a :class:`triaccel_jax.TriAccelConfig`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from triaccel_jax import scale_by_triaccel
      >>> tx = optax.chain(scale_by_triaccel(), optax.scale_by_learning_rate(0.1))
      >>> params = {"w": jnp.array([1.0, -2.0])}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.array([0.5, -0.5])}, state, params)
      >>> [round(float(u), 3) for u in updates["w"]]
      [-0.1, 0.1]

    References:
      Tri-Accel, arXiv 2508.16905. Kingma & Ba, 2015, "Adam". Yao et al., 2021, "ADAHESSIAN".
    """
    validation.check_in_range("eps", eps, 0.0, float("inf"))
    settings = CurvatureSettings(b1, b2, curvature_every, curvature_decay, seed)
    scale = StepScaleSettings(alpha, min_scale, max_scale)
    return _in_gradient_dtype(_adam_with_step_scale(settings, scale, resolve_config(config), eps))


def triaccel(
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: Any = None,
    config: TriAccelConfig | None = None,
    curvature_every: int = 10,
    curvature_decay: float = 0.95,
    alpha: float = 0.5,
    min_scale: float = 0.5,
    max_scale: float = 2.0,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """The Tri-Accel optimizer: AdamW with a per-leaf, curvature-derived step-size scale.

    The curvature signals keeping Adam's moments (Adam's direction), Tri-Accel's step scale,
    ``add_decayed_weights(weight_decay, mask)`` and ``scale_by_learning_rate(learning_rate)``,
    composed (:func:`scale_by_triaccel`'s pieces, then optax's), so the step of leaf ``l`` is
    ``-learning_rate * (s_l * m_hat / (sqrt(v_hat) + eps) + weight_decay * param)`` (decoupled
    weight decay, Loshchilov & Hutter, 2019). Integer, boolean and empty leaves pass through.

    Args:
      learning_rate: a constant >= 0 or an optax schedule.
      b1: decay of the first moment, in [0, 1).
      b2: decay of the second moment, in [0, 1).
      eps: added to ``sqrt(v_hat)``, >= 0.
      weight_decay: decoupled weight-decay rate, >= 0.
      mask: which leaves get weight decay: a tree of bools or a callable of the params returning
        one, as in ``optax.adamw`` (None: all).
      config: a :class:`triaccel_jax.TriAccelConfig` with the options that are not numbers:
        estimator (``"fisher"``, the default, needs no extra argument; ``"hutchinson"`` needs
        ``loss_fn=`` in ``update``), curvature-store layout (``block_size``, ``rho``),
        Hutchinson probes (``num_samples``) and moment dtype (``state_dtype``: None for
        float32, ``jnp.bfloat16``, or a :class:`triaccel_jax.PrecisionPolicy` giving each
        leaf's), e.g. ``TriAccelConfig(estimator="hutchinson", state_dtype=jnp.bfloat16)``.
        None: defaults.
      curvature_every: steps between curvature estimates, >= 1.
      curvature_decay: EMA decay of the curvature estimates, in [0, 1).
      alpha: exponent of the step-size scale, >= 0.
      min_scale: lower clip of the step-size scale, > 0.
      max_scale: upper clip of the step-size scale, >= min_scale.
      seed: seed of the stochastic rounding and of the Hutchinson probes.

    Returns:
      An ``optax.GradientTransformationExtraArgs``. Works under ``optax.inject_hyperparams``
      without ``static_args``: every numeric argument is injectable (and may be changed in the
      state between steps without recompiling), ``config`` is passed through untouched.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import triaccel_jax
      >>> params = {"w": jnp.zeros(3)}
      >>> loss = lambda p: jnp.sum((p["w"] - jnp.array([1.0, 2.0, 3.0])) ** 2)
      >>> tx = triaccel_jax.triaccel(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> @jax.jit
      ... def step(params, state):
      ...     updates, state = tx.update(jax.grad(loss)(params), state, params)
      ...     return optax.apply_updates(params, updates), state
      >>> for _ in range(200):
      ...     params, state = step(params, state)
      >>> bool(loss(params) < 1e-2)
      True

    References:
      Tri-Accel, arXiv 2508.16905; Loshchilov & Hutter, 2019, "Decoupled Weight Decay
      Regularization".
    """
    validation.check_learning_rate(learning_rate)
    validation.check_in_range("weight_decay", weight_decay, 0.0, float("inf"))
    validation.check_in_range("eps", eps, 0.0, float("inf"))
    settings = CurvatureSettings(b1, b2, curvature_every, curvature_decay, seed)
    scale = StepScaleSettings(alpha, min_scale, max_scale)
    # Weight decay and the learning rate would turn integer leaves into floats; the mask keeps
    # them untouched, as the direction does.
    step = optax.chain(
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
    return _in_gradient_dtype(
        _adam_with_step_scale(
            settings, scale, resolve_config(config), eps, _masked_to_trainable(step)
        )
    )


def _adam_with_step_scale(
    settings: CurvatureSettings,
    scale: StepScaleSettings,
    config: TriAccelConfig,
    eps: Any,
    *after: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
    """The signals keeping Adam's moments (Adam's direction), the step scale, then ``after``."""
    return with_signals(
        observer.adam_with_signals(settings, scale, config, eps),
        step_scale_lib.scale_by_step_scale(scale, config),
        *after,
    )


def scale_by_curvature(
    direction: optax.GradientTransformation,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    config: TriAccelConfig | None = None,
    curvature_every: int = 10,
    curvature_decay: float = 0.95,
    alpha: float = 0.5,
    min_scale: float = 0.5,
    max_scale: float = 2.0,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Multiplies each leaf of ``direction``'s output by Tri-Accel's curvature step scale.

    The curvature is estimated on the gradients this transform receives (before the direction),
    by the estimator of ``config``; the scale of leaf ``l`` is
    ``clip((kappa_ref / kappa_l) ** alpha, min_scale, max_scale)`` with ``kappa_l`` its mean
    curvature and ``kappa_ref`` the median over leaves: flat leaves take longer steps, sharp
    ones shorter. Leaves the direction returns that the signals do not hold (integer leaves)
    pass through as the direction returns them. Every numeric argument may be injected by
    ``optax.inject_hyperparams``; the direction is passed through it untouched.

    Args:
      direction: any optax transform: a ``scale_by_*`` piece, or a whole optimizer (its
        learning rate commutes with the per-leaf scale). Extra arguments of ``update`` are
        passed to it.
      b1: decay of the gradient EMA the noise-to-signal signal reads, in [0, 1).
      b2: decay of the EMA of ``mean(g**2)``, in [0, 1).
      config: a :class:`triaccel_jax.TriAccelConfig` (estimator, store layout, probes, the
        gradient EMA's dtype, the replicas' ``axis_name``). Its ``scale`` must be ``"leaf"``.
        None: its defaults.
      curvature_every: estimate curvature every this many steps (>= 1), from the first.
      curvature_decay: EMA decay of the curvature estimates, in [0, 1).
      alpha: exponent of the step scale (>= 0; 0 turns the scaling off).
      min_scale: lower clip of the step scale, > 0.
      max_scale: upper clip of the step scale, >= min_scale.
      seed: seed of the stochastic rounding and of Hutchinson's probes.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is the tuple of the signals'
      :class:`triaccel_jax.transforms.CurvatureSignalsState`, the direction's state and the
      step scale's (empty);
      ``update`` takes ``loss_fn`` (or ``obj_fn``, ``value_fn``; Hutchinson's estimator needs
      it) and passes every extra argument on.

    Raises:
      ValueError: a hyperparameter is out of range, or ``config.scale`` is ``"block"``.
      TypeError: ``direction`` is not an optax transform, or ``config`` not a TriAccelConfig.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import triaccel_jax
      >>> tx = triaccel_jax.scale_by_curvature(optax.sgd(0.1), curvature_every=1)
      >>> params = {"flat": jnp.ones(2), "mid": jnp.ones(2), "sharp": jnp.ones(2)}
      >>> grads = {"flat": jnp.full(2, 0.1), "mid": jnp.ones(2), "sharp": jnp.full(2, 10.0)}
      >>> updates, state = tx.update(grads, tx.init(params), params)
      >>> signals = triaccel_jax.signals(state)  # Fisher curvatures 0.01, 1 and 100
      >>> [signals[k]["step_scale"] for k in ("flat", "mid", "sharp")]  # sqrt(1 / kappa), clipped
      [2.0, 1.0, 0.5]
      >>> updates["sharp"].tolist()  # -0.1 * 10.0 * 0.5
      [-0.5, -0.5]

    References:
      Tri-Accel, arXiv 2508.16905; Yao et al., 2021, "ADAHESSIAN".
    """
    if not isinstance(
        direction, optax.GradientTransformation | optax.GradientTransformationExtraArgs
    ):
        raise TypeError(
            "`direction` must be an optax transform (e.g. optax.scale_by_adam() or "
            f"optax.contrib.muon(1e-3)), got {type(direction).__name__}"
        )
    config = resolve_config(config)
    if config.scale != "leaf":
        raise ValueError(
            "scale_by_curvature scales each leaf by one number: TriAccelConfig(scale='block') "
            "is scale_by_triaccel's (Adam's direction) only"
        )
    settings = CurvatureSettings(b1, b2, curvature_every, curvature_decay, seed)
    scale = StepScaleSettings(alpha, min_scale, max_scale)
    return with_signals(
        observer.observe(settings, config, scale),
        direction,
        step_scale_lib.scale_by_step_scale(scale, config),
    )


def with_signals(
    signals_tx: optax.GradientTransformation, *rest: optax.GradientTransformation
) -> optax.GradientTransformationExtraArgs:
    """``optax.chain(signals_tx, *rest)`` in which ``rest`` reads the signals' new state.

    Each transform of ``rest`` gets, besides the caller's extra arguments, the extra argument
    ``curvature_signals``: the signals' state (:func:`._observer.find_signal_states`, by type)
    in the state ``signals_tx`` returned this step. The state is the tuple of the members'
    states, as ``optax.chain``'s is.

    Args:
      signals_tx: a transform whose state holds exactly one curvature-signals state.
      *rest: the transforms that follow (plain optax transforms too: ``optax.chain`` gives them
        extra-argument support).

    Returns:
      An ``optax.GradientTransformationExtraArgs``.
    """
    # optax.chain hands every member the caller's extra arguments, never what an earlier member
    # returned: the step scale needs the signals' state of this step, so the signals run first
    # here and ``rest`` is an optax.chain given that state as one more extra argument.
    after = optax.chain(*rest)

    def init_fn(params: Any) -> tuple[Any, ...]:
        return (signals_tx.init(params), *after.init(params))

    def update_fn(
        updates: Any, state: tuple[Any, ...], params: Any = None, **extra_args: Any
    ) -> tuple[Any, tuple[Any, ...]]:
        updates, first = signals_tx.update(updates, state[0], params, **extra_args)
        (kept,) = observer.find_signal_states(first)
        updates, rest_state = after.update(
            updates, tuple(state[1:]), params, **{**extra_args, "curvature_signals": kept}
        )
        return updates, (first, *rest_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _in_gradient_dtype(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` with each update cast back to its gradient's dtype.

    A learning rate or weight decay held as a float32 array (as ``optax.inject_hyperparams``
    holds them) would otherwise promote bfloat16 updates to float32, a second copy of the
    gradients at twice their size.
    """

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        out, state = inner.update(updates, state, params, **extra_args)
        out = jax.tree.map(
            lambda u, g: u.astype(g.dtype) if hasattr(u, "astype") and hasattr(g, "dtype") else u,
            out,
            updates,
        )
        return out, state

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def _masked_to_trainable(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``optax.masked(inner)`` on the leaves trainable in both the updates and the params.

    ``optax.masked`` computes a callable mask from the updates alone, so a float gradient of an
    integer parameter (e.g. after a cast) would get weight decay and the learning rate, where
    scale_by_triaccel passes it through.
    """

    def init_fn(params: Any) -> Any:
        return optax.masked(inner, tree_lib.trainable_mask).init(params)

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        mask = tree_lib.trainable_mask(updates)
        if params is not None:
            mask = jax.tree.map(lambda m, p: m and tree_lib.is_trainable(p), mask, params)
        return optax.masked(inner, mask).update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
