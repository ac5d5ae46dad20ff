"""``scale_by_triaccel``: Adam moments scaled per leaf by a curvature-derived step size.

Tri-Accel (arXiv 2508.16905) steers each layer's step size with a cheap second-order signal. Here
that is, per leaf ``l`` (docs/design.md §3):

* the direction ``m_hat / (sqrt(v_hat) + eps)`` of Adam (Kingma & Ba, 2015), with the moments
  stored in the state dtype (bfloat16 writes are stochastically rounded);
* every ``curvature_every`` steps (under ``lax.cond``), a diagonal curvature estimate (empirical
  Fisher or Hutchinson) folded into an EMA that is stored compressed (block means + top-k);
* the step-size scale ``s_l = clip((kappa_ref / kappa_l) ** alpha, min_scale, max_scale)`` from the
  mean curvature ``kappa_l`` and its median ``kappa_ref`` over leaves (scale-free): flat leaves
  take longer steps, sharp ones shorter;
* the noise-to-signal ratio ``mean(v_hat - m_hat**2) / mean(m_hat**2)``, read from the moments.

The per-leaf scalars are kept in the state for :func:`triaccel_jax.signals`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from triaccel_jax._src import tree as tree_lib
from triaccel_jax._src import validation
from triaccel_jax.kernels import cast as cast_kernel
from triaccel_jax.precision import _dtypes as dtypes
from triaccel_jax.precision import _policy as policy_lib
from triaccel_jax.transforms import _compression as compression
from triaccel_jax.transforms import _compression_sharded as compression_sharded
from triaccel_jax.transforms import _curvature as curvature_lib

ESTIMATORS = ("fisher", "hutchinson")
STATE_DTYPES = ("float32", "bfloat16")

_TINY = float(jnp.finfo(jnp.float32).tiny)
_HUGE = float(jnp.finfo(jnp.float32).max)


class LeafSignals(NamedTuple):
    """Per-leaf float32 scalars that ``scale_by_triaccel`` keeps for the planner and controller.

    All are refreshed on curvature steps (every ``curvature_every`` steps, from the first).

    Attributes:
      mean_curvature: mean of the (bias-corrected) curvature EMA over the leaf, ``kappa_l``.
      max_curvature: largest magnitude of the curvature EMA in the leaf.
      trace: sum of the curvature EMA over the leaf.
      noise_to_signal: ``mean(v_hat - m_hat**2) / mean(m_hat**2)``, the gradient noise.
      step_scale: the step-size multiplier ``s_l`` applied on the last update.
      dropped_estimates: int32 number of this leaf's curvature estimates left out of the EMA
        because they (or the EMA they would give) were not finite, saturating.
    """

    mean_curvature: jax.Array
    max_curvature: jax.Array
    trace: jax.Array
    noise_to_signal: jax.Array
    step_scale: jax.Array
    dropped_estimates: jax.Array


class ScaleByTriAccelState(NamedTuple):
    """State of :func:`scale_by_triaccel`; arrays only.

    Trees are shaped like the params; leaves the optimizer does not act on (integer, boolean,
    empty) hold ``optax.MaskedNode()``.

    Attributes:
      count: int32 number of updates, saturating.
      curvature_count: int32 number of curvature estimates taken, saturating; a leaf's EMA holds
        ``curvature_count - dropped_estimates`` of them (see :class:`LeafSignals`).
      mu: first moments, in the state dtype.
      nu: second moments, in the state dtype.
      curvature: the curvature EMA per leaf, a :class:`triaccel_jax.transforms.CompressedDiagonal`.
      leaf_signals: :class:`LeafSignals` per leaf.
      estimator_state: the curvature estimator's state.
      rounding_key: uint32 PRNG key data for the stochastic rounding of the moments.
    """

    count: jax.Array
    curvature_count: jax.Array
    mu: Any
    nu: Any
    curvature: Any
    leaf_signals: Any
    estimator_state: Any
    rounding_key: jax.Array


def _state_dtype(path: str, param_dtype: Any, state_dtype: Any) -> jnp.dtype:
    if state_dtype is None:
        # Never below float32 by default: half-precision params keep float32 moments.
        return jnp.promote_types(param_dtype, jnp.float32)
    if isinstance(state_dtype, policy_lib.PrecisionPolicy):
        if path not in state_dtype:
            raise ValueError(f"the precision policy has no entry for leaf {path!r}")
        return dtypes.FORMATS[state_dtype.state(path)].dtype
    return jnp.dtype(state_dtype)


def _normalized_state_dtype(state_dtype: Any) -> Any:
    """None, a policy, or the name of an allowed moment dtype (hashable, and never callable)."""
    if state_dtype is None or isinstance(state_dtype, policy_lib.PrecisionPolicy):
        return state_dtype
    if isinstance(state_dtype, (jax.Array, np.ndarray, np.generic)):
        # optax.inject_hyperparams takes a dtype type such as jnp.bfloat16 (callable) for a
        # schedule and hands its value at step 0 to the factory.
        raise ValueError(
            f"`state_dtype` arrived as the number {state_dtype!r}: optax.inject_hyperparams takes "
            "a dtype type such as jnp.bfloat16 for a schedule; pass "
            "config=triaccel_jax.TriAccelConfig(state_dtype=jnp.bfloat16) or the name 'bfloat16'"
        )
    try:
        name = jnp.dtype(state_dtype).name
    except TypeError:
        name = None
    if name not in STATE_DTYPES:
        raise ValueError(
            f"`state_dtype` must be None or one of {STATE_DTYPES} (moments are never stored below "
            f"bfloat16), got {state_dtype!r}"
        )
    return name


@dataclasses.dataclass(frozen=True)
class TriAccelConfig:
    """The options of :func:`triaccel_jax.triaccel` that are not numbers to tune.

    They set the shapes of the optimizer state (the curvature store's layout), the estimator's
    program, or the moments' dtype, so they must be known when the state is initialised. Kept in
    one frozen, hashable object, they stay out of what ``optax.inject_hyperparams`` injects: it
    turns every int and float argument into a traced array, and passes this object through, so
    ``jax.jit(tx.init)`` works without ``static_args`` while every numeric hyperparameter stays
    injectable.

    Attributes:
      estimator: ``"fisher"`` (squared gradient; needs no extra argument) or ``"hutchinson"``
        (Hessian diagonal from HVPs; needs ``loss_fn=`` in ``update``).
      block_size: elements per block of the compressed curvature store, >= 1.
      rho: fraction of each leaf's curvature entries kept exactly, in (0, 1].
      num_samples: Hutchinson probes per estimate, >= 1.
      state_dtype: dtype of the moments: None (float32, or float64 for float64 params),
        ``"float32"`` or ``"bfloat16"`` (a dtype is stored as its name; bfloat16 writes are
        stochastically rounded), or a :class:`triaccel_jax.PrecisionPolicy` giving each leaf's.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import triaccel_jax
      >>> config = triaccel_jax.TriAccelConfig(block_size=8, state_dtype=jnp.bfloat16)
      >>> tx = optax.inject_hyperparams(triaccel_jax.triaccel)(learning_rate=1e-3, config=config)
      >>> state = jax.jit(tx.init)({"w": jnp.ones(16)})
      >>> state.inner_state[0].curvature["w"].block_means.shape, config.state_dtype
      ((2,), 'bfloat16')

    References:
      Tri-Accel, arXiv 2508.16905; optax.inject_hyperparams.
    """

    estimator: str = "fisher"
    block_size: int = 64
    rho: float = 0.01
    num_samples: int = 1
    state_dtype: Any = None

    def __post_init__(self) -> None:
        validation.check_choice("estimator", self.estimator, ESTIMATORS)
        validation.check_integer("block_size", self.block_size, 1)
        validation.check_in_range("rho", self.rho, 0.0, 1.0, low_inclusive=False)
        validation.check_integer("num_samples", self.num_samples, 1)
        # Plain Python values, so that equal configs hash equal (an array would not hash). A
        # traced value only comes from the deprecated keywords under inject_hyperparams: the
        # update reads the layout from the store's shapes and loops over traced probes, and
        # init says what to do instead (see `scale_by_triaccel`).
        for name, kind in (("block_size", int), ("rho", float), ("num_samples", int)):
            value = getattr(self, name)
            if not isinstance(value, jax.core.Tracer):
                object.__setattr__(self, name, kind(np.asarray(value)))
        object.__setattr__(self, "state_dtype", _normalized_state_dtype(self.state_dtype))


_DEPRECATED_KEYWORDS = ("block_size", "rho", "num_samples")


def resolve_config(config: TriAccelConfig | None, **keywords: Any) -> TriAccelConfig:
    """The config that ``config`` and the factory's config keywords (None: not given) describe.

    ``estimator`` and ``state_dtype`` are plain keywords as well (never numbers, so
    ``inject_hyperparams`` leaves them alone); ``block_size``, ``rho`` and ``num_samples`` as
    keywords are deprecated, because ``inject_hyperparams`` traces them.
    """
    if config is not None and not isinstance(config, TriAccelConfig):
        raise TypeError(
            f"`config` must be a triaccel_jax.TriAccelConfig, got {type(config).__name__}"
        )
    given = {name: value for name, value in keywords.items() if value is not None}
    deprecated = [name for name in _DEPRECATED_KEYWORDS if name in given]
    if deprecated:
        listed = ", ".join(f"{name}=" for name in deprecated)
        warnings.warn(
            f"{listed} as keyword(s) of triaccel/scale_by_triaccel are deprecated: "
            "optax.inject_hyperparams traces every number, and these set array shapes; pass "
            f"config=triaccel_jax.TriAccelConfig({listed}...) instead",
            DeprecationWarning,
            stacklevel=3,
        )
    if config is None:
        return TriAccelConfig(**given)
    for name in given:
        raise ValueError(
            f"`{name}` given both as a keyword and in `config`: pass it in `config` only"
        )
    return config


def _make_estimator(estimator: str, num_samples: int, seed: int):
    if estimator == "hutchinson":
        return curvature_lib.hutchinson_diagonal(num_samples, seed=seed)
    return curvature_lib.fisher_diagonal()


def _write(value: jax.Array, dtype: jnp.dtype, key: jax.Array) -> jax.Array:
    """Casts a freshly computed float32 moment to its state dtype, stochastically when narrower."""
    return cast_kernel.cast_reference(value, dtype, rounding="stochastic", key=key)


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
    axis_name: str | None = None,
    estimator: str | None = None,
    state_dtype: Any = None,
    block_size: int | None = None,
    rho: float | None = None,
    num_samples: int | None = None,
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
        (``block_size``, ``rho``), Hutchinson probes and moment dtype. None: its defaults.
      curvature_every: estimate curvature every this many steps (>= 1), starting at the first.
      curvature_decay: EMA decay of the curvature estimates, in [0, 1).
      alpha: exponent of the step-size scale (>= 0; 0 turns the scaling off).
      min_scale: lower clip of the step-size scale, > 0.
      max_scale: upper clip of the step-size scale, >= min_scale.
      seed: seed of the PRNG keys for stochastic rounding and Hutchinson probes.
      axis_name: under ``shard_map`` or ``pmap`` data parallelism, the mapped axis over which the
        curvature estimate is averaged (``lax.pmean``), so that every replica folds the same
        estimate and keeps the same state, as the gradients (averaged by the caller) do. None
        (default) for a single replica or a ``jit`` over sharded data, where the estimate is
        already the global one.
      estimator: shorthand for ``config.estimator`` (``"fisher"`` or ``"hutchinson"``).
      state_dtype: shorthand for ``config.state_dtype`` (under ``inject_hyperparams`` give a
        dtype as its name, or in ``config``: a dtype type looks like a schedule there).
      block_size: deprecated, use ``config``.
      rho: deprecated, use ``config``.
      num_samples: deprecated, use ``config``.

    Returns:
      An ``optax.GradientTransformationExtraArgs``. Its ``update`` takes the keyword-only extra
      argument ``loss_fn`` (used by the Hutchinson estimator, ignored otherwise; optax's names
      ``obj_fn`` and ``value_fn`` for the same function are accepted too) and ignores other
      extra arguments. The update has each gradient's dtype.

    Raises:
      ValueError: a hyperparameter is out of range, or an option is given both as a keyword
        and in ``config``.

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
    validation.check_in_range("b1", b1, 0.0, 1.0, high_inclusive=False)
    validation.check_in_range("b2", b2, 0.0, 1.0, high_inclusive=False)
    validation.check_in_range("eps", eps, 0.0, float("inf"))
    config = resolve_config(
        config,
        estimator=estimator,
        state_dtype=state_dtype,
        block_size=block_size,
        rho=rho,
        num_samples=num_samples,
    )
    validation.check_in_range("curvature_every", curvature_every, 1.0, float("inf"))
    validation.check_in_range("curvature_decay", curvature_decay, 0.0, 1.0, high_inclusive=False)
    validation.check_in_range("alpha", alpha, 0.0, float("inf"))
    validation.check_in_range("min_scale", min_scale, 0.0, float("inf"), low_inclusive=False)
    validation.check_in_range("max_scale", max_scale, 0.0, float("inf"), low_inclusive=False)
    validation.check_not_above("min_scale", min_scale, "max_scale", max_scale)
    estimator = config.estimator
    state_dtype = config.state_dtype
    estimator_tx = _make_estimator(estimator, config.num_samples, seed)

    def init_fn(params: Any) -> ScaleByTriAccelState:
        def zeros_or_skip(path, leaf):
            if jnp.issubdtype(getattr(leaf, "dtype", None), jnp.complexfloating):
                raise ValueError(
                    f"leaf {tree_lib.path_string(path)!r} is {leaf.dtype}: triaccel trains real "
                    "floating-point leaves only (keep the real and imaginary parts as two leaves)"
                )
            if not tree_lib.is_trainable(leaf):
                return optax.MaskedNode()
            dtype = _state_dtype(tree_lib.path_string(path), leaf.dtype, state_dtype)
            return _placed(jnp.zeros(leaf.shape, dtype), leaf, same_shape=True)

        # The store's layout sets shapes, so it must be concrete here (the update reads it back
        # from the store's shapes).
        static_block_size = validation.static_value("block_size", config.block_size, int)
        static_rho = validation.static_value("rho", config.rho, float)

        def store_or_skip(leaf):
            if not tree_lib.is_trainable(leaf):
                return optax.MaskedNode()
            store = compression.empty_store(
                leaf.shape, block_size=static_block_size, rho=static_rho
            )
            return jax.tree.map(lambda x: _placed(x, leaf, same_shape=False), store)

        def signals_or_skip(leaf):
            if not tree_lib.is_trainable(leaf):
                return optax.MaskedNode()
            # Distinct arrays, never one shared buffer: callers donate the state to `jit`.
            zeros = [jnp.zeros((), jnp.float32) for _ in range(4)]
            return LeafSignals(
                *zeros,
                step_scale=jnp.ones((), jnp.float32),
                dropped_estimates=jnp.zeros((), jnp.int32),
            )

        return ScaleByTriAccelState(
            count=jnp.zeros([], jnp.int32),
            curvature_count=jnp.zeros([], jnp.int32),
            mu=jax.tree_util.tree_map_with_path(zeros_or_skip, params),
            nu=jax.tree_util.tree_map_with_path(zeros_or_skip, params),
            curvature=jax.tree.map(store_or_skip, params),
            leaf_signals=jax.tree.map(signals_or_skip, params),
            estimator_state=estimator_tx.init(params),
            rounding_key=jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 1)),
        )

    def update_fn(
        updates: Any,
        state: ScaleByTriAccelState,
        params: Any = None,
        *,
        loss_fn: Callable[..., Any] | None = None,
        obj_fn: Callable[..., Any] | None = None,
        value_fn: Callable[..., Any] | None = None,
        **extra_args: Any,
    ) -> tuple[Any, ScaleByTriAccelState]:
        del extra_args  # optax's contract: ignore extra arguments meant for other transforms
        if estimator == "hutchinson":
            # Checked here, outside lax.cond, so that a missing loss is reported on every step.
            loss_fn = curvature_lib.resolve_loss_fn(loss_fn, obj_fn=obj_fn, value_fn=value_fn)
            if loss_fn is None:
                raise ValueError(curvature_lib._LOSS_FN_HELP)
        grads, treedef = jax.tree.flatten(updates)
        try:
            mu = treedef.flatten_up_to(state.mu)
        except (ValueError, TypeError) as error:
            raise ValueError(
                "the updates do not have the tree structure of the params the optimizer state "
                f"was initialised with: {error}"
            ) from None
        # The state decides which leaves are trained (init saw the params): a float gradient for
        # an integer parameter, say, passes through like the parameter's other updates.
        active = [
            i
            for i, (g, m) in enumerate(zip(grads, mu, strict=True))
            if not isinstance(m, optax.MaskedNode) and tree_lib.is_trainable(g)
        ]
        for i in active:
            if grads[i].shape != mu[i].shape:
                path = jax.tree_util.tree_flatten_with_path(updates)[0][i][0]
                raise ValueError(
                    f"the update of leaf {tree_lib.path_string(path)!r} has shape "
                    f"{grads[i].shape}, its parameter had shape {mu[i].shape} at init"
                )
        nu = treedef.flatten_up_to(state.nu)
        stores = [
            _as(compression.CompressedDiagonal, x) for x in treedef.flatten_up_to(state.curvature)
        ]
        old_signals = [_as(LeafSignals, x) for x in treedef.flatten_up_to(state.leaf_signals)]

        # Moments and direction (Adam, with bias correction).
        count = optax.safe_increment(state.count)
        step = count.astype(jnp.float32)
        b1_f = jnp.asarray(b1, jnp.float32)
        b2_f = jnp.asarray(b2, jnp.float32)
        bias1 = 1 - b1_f**step
        bias2 = 1 - b2_f**step
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rounding_key), state.count)
        new_mu, new_nu = list(mu), list(nu)
        m_hat, v_hat, direction = {}, {}, {}
        for i in active:
            g = grads[i].astype(jnp.float32)
            mu_f = b1_f * mu[i].astype(jnp.float32) + (1 - b1_f) * g
            nu_f = b2_f * nu[i].astype(jnp.float32) + (1 - b2_f) * jnp.square(g)
            m_hat[i] = mu_f / bias1
            v_hat[i] = nu_f / bias2
            direction[i] = m_hat[i] / (jnp.sqrt(v_hat[i]) + eps)
            leaf_key = jax.random.fold_in(step_key, i)
            new_mu[i] = _write(mu_f, mu[i].dtype, jax.random.fold_in(leaf_key, 0))
            new_nu[i] = _write(nu_f, nu[i].dtype, jax.random.fold_in(leaf_key, 1))

        # Every `curvature_every` steps: a curvature estimate folded into the compressed EMA, and
        # from it the per-leaf signals and step-size scales. They change only then, so the other
        # steps reuse the stored ones instead of recomputing them (and the noise reductions).
        def refresh(operand):
            stores, estimator_state, curvature_count, signals = operand
            diagonal, estimator_state = estimator_tx.update(
                updates, estimator_state, params, loss_fn=loss_fn
            )
            diagonal = treedef.flatten_up_to(diagonal)
            if axis_name is not None:
                # Each replica's Hutchinson estimate sees only its shard of the batch; left alone,
                # the replicas' EMAs and step scales drift apart. The mean over replicas is the
                # estimate of the global batch (the HVP is linear in the loss).
                active_diagonals = lax.pmean([diagonal[i] for i in active], axis_name)
                for i, averaged in zip(active, active_diagonals, strict=True):
                    diagonal[i] = averaged
            stores, signals = list(stores), list(signals)
            curvature_count = optax.safe_increment(curvature_count)
            decay = jnp.asarray(curvature_decay, jnp.float32)
            summaries, kappa, dropped = {}, {}, {}
            for i in active:
                # A non-finite estimate (|x|**1.5 at 0, an overflowing HVP) would stay in the EMA
                # for good: it is left out, and the leaf's bias correction counts only the
                # estimates it kept.
                candidate = compression_sharded.update_compressed_ema(
                    stores[i], diagonal[i], curvature_decay
                )
                keep = jnp.all(jnp.isfinite(diagonal[i])) & _all_finite(candidate)
                stores[i] = jax.tree.map(
                    lambda new, old, keep=keep: jnp.where(keep, new, old), candidate, stores[i]
                )
                old_dropped = signals[i].dropped_estimates
                dropped[i] = jnp.where(keep, old_dropped, optax.safe_increment(old_dropped))
                kept = jnp.maximum(curvature_count - dropped[i], 0)
                correction = jnp.maximum(1 - decay**kept, _TINY)
                summary = compression.summarize_diagonal(stores[i], grads[i].shape)
                summaries[i] = jax.tree.map(lambda x, c=correction: x / c, summary)
                kappa[i] = jnp.maximum(summaries[i].mean, 0.0)
            kappa_ref = _finite_median([kappa[i] for i in active]) if active else None
            exponent = jnp.asarray(alpha, jnp.float32)
            for i in active:
                scale = jnp.clip(
                    ((kappa_ref + _TINY) / (kappa[i] + _TINY)) ** exponent, min_scale, max_scale
                )
                # No finite curvature anywhere (or a NaN one here): leave the step unscaled.
                scale = jnp.where(jnp.isnan(scale), 1.0, scale)
                signal = jnp.mean(jnp.square(m_hat[i]))
                noise = jnp.maximum(jnp.mean(v_hat[i]) - signal, 0.0)
                signals[i] = LeafSignals(
                    mean_curvature=summaries[i].mean,
                    max_curvature=summaries[i].max_abs,
                    trace=summaries[i].trace,
                    # m_hat can cancel to exactly 0 while v_hat > 0: keep the ratio finite.
                    noise_to_signal=jnp.minimum(noise / (signal + _TINY), _HUGE),
                    step_scale=scale.astype(jnp.float32),
                    dropped_estimates=dropped[i],
                )
            return stores, estimator_state, curvature_count, signals

        due = state.count % jnp.asarray(curvature_every, jnp.int32) == 0
        operand = (stores, state.estimator_state, state.curvature_count, old_signals)
        stores, estimator_state, curvature_count, new_signals = lax.cond(
            due, refresh, lambda operand: operand, operand
        )
        out = list(grads)
        for i in active:
            out[i] = (new_signals[i].step_scale * direction[i]).astype(grads[i].dtype)

        new_state = ScaleByTriAccelState(
            count=count,
            curvature_count=curvature_count,
            mu=treedef.unflatten(new_mu),
            nu=treedef.unflatten(new_nu),
            curvature=treedef.unflatten(stores),
            leaf_signals=treedef.unflatten(new_signals),
            estimator_state=estimator_state,
            rounding_key=state.rounding_key,
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _all_finite(tree: Any) -> jax.Array:
    """Whether every floating-point entry of ``tree`` is finite (a boolean scalar)."""
    checks = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def _finite_median(values: list[jax.Array]) -> jax.Array:
    """The median of the finite ``values`` (NaN when none is): one leaf cannot poison the rest."""
    stacked = jnp.stack(values)
    return jnp.nanmedian(jnp.where(jnp.isfinite(stacked), stacked, jnp.nan))


def _as(cls: type, node: Any) -> Any:
    """``node`` as the NamedTuple ``cls`` if it came back as a mapping of its fields.

    ``nnx.Optimizer`` keeps the optimizer state in ``nnx.Variable``s and returns nested
    NamedTuples as dicts of their fields; ``lax.cond`` needs the same structure in both branches.
    """
    if isinstance(node, Mapping) and set(node) == set(cls._fields):
        return cls(**{name: node[name] for name in cls._fields})
    return node


def _placed(state_leaf: jax.Array, param: Any, *, same_shape: bool) -> jax.Array:
    """``state_leaf`` on the devices of a concrete, sharded ``param``.

    Moments take the param's own sharding, so the state of a sharded model is sharded the same
    way instead of landing on one device; the compressed curvature store (other shapes, about
    ``1 / block_size`` of the leaf) is replicated over the param's mesh. Under ``jit`` (tracers)
    and for ``jax.ShapeDtypeStruct`` leaves without a sharding nothing is placed: the caller's
    ``out_shardings`` decide there.
    """
    sharding = getattr(param, "sharding", None)
    if isinstance(param, jax.core.Tracer) or not isinstance(sharding, jax.sharding.NamedSharding):
        return state_leaf
    if not same_shape:
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jax.device_put(state_leaf, sharding)
