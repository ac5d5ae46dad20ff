"""``curvature_signals``: Tri-Accel's curvature and noise signals as an observer transform.

The precision planner and the controller read per-leaf curvature and gradient noise. Inside
:func:`triaccel_jax.scale_by_triaccel` those come for free from its Adam moments; this transform
keeps the same figures for *any* optax optimizer while leaving the updates it is given
untouched, so it can sit in a chain beside ``optax.adamw``, ``optax.sgd`` or
``optax.contrib.muon`` (docs/design.md §3.9):

* every ``curvature_every`` steps (under ``lax.cond``), a diagonal curvature estimate (empirical
  Fisher or Hutchinson) folded into an EMA stored compressed (block means + top-k), exactly as
  ``scale_by_triaccel`` folds it (:mod:`triaccel_jax.transforms._curvature_refresh`);
* the noise-to-signal ratio ``mean(v_hat - m_hat**2) / mean(m_hat**2)`` of the gradients it sees,
  from an element-wise EMA of the gradient (``m``, in the config's state dtype: the one copy of
  the params this transform costs) and a per-leaf scalar EMA of ``mean(g**2)`` (the mean over a
  leaf of Adam's ``v``, which is all the ratio needs).

The transform observes the updates that reach it: put it first in the chain, where they are the
gradients (the Fisher estimate is their square); the Hutchinson estimate reads only the params
and the loss, so it is the same anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from triaccel_jax import kernels
from triaccel_jax import policy as policy_lib
from triaccel_jax._src import tree as tree_lib
from triaccel_jax._src import validation
from triaccel_jax.kernels import cast as cast_kernel
from triaccel_jax.transforms import _compression as compression
from triaccel_jax.transforms import _curvature as curvature_lib
from triaccel_jax.transforms import _curvature_refresh as refresh_lib
from triaccel_jax.transforms._config import TriAccelConfig
from triaccel_jax.transforms._config import resolve_config
from triaccel_jax.transforms._triaccel_state import LeafSignals
from triaccel_jax.transforms._triaccel_state import ScaleByTriAccelState

# The curvature store's outlier indices are int32 flat indices into a leaf (and XLA's top_k
# over a flattened leaf counts in int32).
MAX_LEAF_SIZE = 2**31 - 1


class CurvatureSignalsState(NamedTuple):
    """State of :func:`curvature_signals`; arrays only.

    Trees are shaped like the params; leaves it does not observe (integer, boolean, empty) hold
    ``optax.MaskedNode()``.

    Attributes:
      count: int32 number of updates, saturating.
      curvature_count: int32 number of curvature estimates taken, saturating.
      mu: EMA of the gradients (decay ``b1``), in the state dtype.
      nu_mean: per-leaf float32 scalar, EMA of ``mean(g**2)`` over the leaf (decay ``b2``).
      curvature: the curvature EMA per leaf, a :class:`triaccel_jax.transforms.CompressedDiagonal`.
      leaf_signals: :class:`triaccel_jax.transforms.LeafSignals` per leaf (``step_scale`` is 1
        for :func:`curvature_signals`, which scales nothing, and the scale
        :func:`triaccel_jax.scale_by_curvature` applies inside that transform).
      estimator_state: the curvature estimator's state.
      rounding_key: uint32 PRNG key data for the stochastic rounding of ``mu``.
    """

    # Shadows tuple.count, as optax's states do; the field name is part of the state's structure.
    count: jax.Array  # type: ignore[assignment]
    curvature_count: jax.Array
    mu: Any
    nu_mean: Any
    curvature: Any
    leaf_signals: Any
    estimator_state: Any
    rounding_key: jax.Array


def check_leaf(path: Any, leaf: Any) -> None:
    """Refuses, naming the leaf, what the curvature store cannot hold."""
    if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.complexfloating):
        raise ValueError(
            f"leaf {tree_lib.path_string(path)!r} is {leaf.dtype}: triaccel trains real "
            "floating-point leaves only (keep the real and imaginary parts as two leaves)"
        )
    if tree_lib.is_trainable(leaf) and math.prod(leaf.shape) > MAX_LEAF_SIZE:
        raise ValueError(
            f"leaf {tree_lib.path_string(path)!r} has {math.prod(leaf.shape):,} elements; "
            f"triaccel holds at most {MAX_LEAF_SIZE:,} (2**31 - 1) per leaf, because its "
            "curvature store indexes a leaf's elements with int32: split the leaf in two"
        )


def moment_dtype(path: str, param_dtype: Any, state_dtype: Any) -> jnp.dtype:
    """A leaf's moment dtype under ``TriAccelConfig.state_dtype`` (never below float32 by default)."""
    if state_dtype is None:
        # Half-precision params keep float32 moments.
        return jnp.promote_types(param_dtype, jnp.float32)
    if isinstance(state_dtype, policy_lib.PrecisionPolicy):
        if path not in state_dtype:
            raise ValueError(f"the precision policy has no entry for leaf {path!r}")
        return policy_lib.float_format(state_dtype.state(path)).dtype
    return jnp.dtype(state_dtype)


def placed(state_leaf: jax.Array, param: Any, *, same_shape: bool) -> jax.Array:
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


def init_moments(params: Any, config: TriAccelConfig) -> Any:
    """Zero moments in each leaf's moment dtype; ``MaskedNode`` for leaves not trained."""

    def zeros_or_skip(path, leaf):
        check_leaf(path, leaf)
        if not tree_lib.is_trainable(leaf):
            return optax.MaskedNode()
        dtype = moment_dtype(tree_lib.path_string(path), leaf.dtype, config.state_dtype)
        return placed(jnp.zeros(leaf.shape, dtype), leaf, same_shape=True)

    return jax.tree_util.tree_map_with_path(zeros_or_skip, params)


def init_curvature(params: Any, config: TriAccelConfig) -> tuple[Any, Any]:
    """Empty compressed curvature stores and zero :class:`LeafSignals`, one per trained leaf."""

    def store_or_skip(leaf):
        if not tree_lib.is_trainable(leaf):
            return optax.MaskedNode()
        store = compression.empty_store(leaf.shape, block_size=config.block_size, rho=config.rho)
        return jax.tree.map(lambda x: placed(x, leaf, same_shape=False), store)

    def signals_or_skip(leaf):
        if not tree_lib.is_trainable(leaf):
            return optax.MaskedNode()
        # Distinct arrays, never one shared buffer: callers donate the state to `jit`.
        zeros = [jnp.zeros((), jnp.float32) for _ in range(4)]
        # mypy cannot tell that `zeros` fills exactly the four fields before step_scale.
        return LeafSignals(  # type: ignore[misc]
            *zeros,
            step_scale=jnp.ones((), jnp.float32),
            dropped_estimates=jnp.zeros((), jnp.int32),
        )

    return jax.tree.map(store_or_skip, params), jax.tree.map(signals_or_skip, params)


def make_estimator(config: TriAccelConfig, seed: int) -> optax.GradientTransformationExtraArgs:
    """The config's curvature estimator (Hutchinson's probes seeded by ``seed``)."""
    if config.estimator == "hutchinson":
        return curvature_lib.hutchinson_diagonal(config.num_samples, seed=seed)
    return curvature_lib.fisher_diagonal()


def flatten_like_updates(treedef: Any, tree: Any) -> list[Any]:
    """``tree``'s nodes at the leaves of the updates' ``treedef``; a clear error if it differs."""
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as error:
        raise ValueError(
            "the updates do not have the tree structure of the params the optimizer state "
            f"was initialised with: {error}"
        ) from None


def trained_leaves(updates: Any, grads: list[Any], moments: list[Any]) -> list[int]:
    """Indices of the leaves the transform acts on, each checked against its shape at init.

    The state decides which leaves are trained (init saw the params): a float gradient for an
    integer parameter, say, passes through like the parameter's other updates.
    """
    active = [
        i
        for i, (g, m) in enumerate(zip(grads, moments, strict=True))
        if not isinstance(m, optax.MaskedNode) and tree_lib.is_trainable(g)
    ]
    for i in active:
        if grads[i].shape != moments[i].shape:
            path = jax.tree_util.tree_flatten_with_path(updates)[0][i][0]
            raise ValueError(
                f"the update of leaf {tree_lib.path_string(path)!r} has shape "
                f"{grads[i].shape}, its parameter had shape {moments[i].shape} at init"
            )
    return active


def require_loss_fn(
    config: TriAccelConfig,
    *,
    loss_fn: Callable[..., Any] | None,
    obj_fn: Callable[..., Any] | None,
    value_fn: Callable[..., Any] | None,
) -> Callable[..., Any] | None:
    """The loss under any of its accepted names; a ValueError when Hutchinson's needs one.

    Checked outside ``lax.cond``, so that a missing loss is reported on every step.
    """
    loss_fn = curvature_lib.resolve_loss_fn(loss_fn, obj_fn=obj_fn, value_fn=value_fn)
    if config.estimator == "hutchinson" and loss_fn is None:
        raise ValueError(curvature_lib._LOSS_FN_HELP)
    return loss_fn


def curvature_signals(
    b1: float = 0.9,
    b2: float = 0.999,
    *,
    config: TriAccelConfig | None = None,
    curvature_every: int = 10,
    curvature_decay: float = 0.95,
    seed: int = 0,
    axis_name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Keeps Tri-Accel's per-leaf curvature and noise signals, leaving the updates untouched.

    An observer for any optax chain: with it, :func:`triaccel_jax.signals`, the precision
    planner and the :class:`triaccel_jax.Controller` (precision plans, the goodput batch, the
    Hessian-weighted noise scale) work over any optimizer, without Tri-Accel's step sizes. Put
    it first, before the optimizer's direction, so that it sees the gradients; every numeric
    argument may be injected by ``optax.inject_hyperparams``.

    Args:
      b1: decay of the gradient EMA the noise-to-signal ratio reads, in [0, 1).
      b2: decay of the EMA of ``mean(g**2)``, in [0, 1).
      config: a :class:`triaccel_jax.TriAccelConfig`: the estimator, the curvature store's
        layout, Hutchinson's probes, and ``state_dtype`` for the gradient EMA (``impl`` chooses
        its narrow writes; ``scale`` is not read). None: its defaults.
      curvature_every: estimate curvature every this many steps (>= 1), starting at the first.
      curvature_decay: EMA decay of the curvature estimates, in [0, 1).
      seed: seed of the stochastic rounding and of Hutchinson's probes.
      axis_name: under ``shard_map`` or ``pmap``, the mapped axis over which the curvature
        estimate is averaged (see :func:`triaccel_jax.scale_by_triaccel`); None otherwise.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update`` returns the updates it is
      given (the same objects) and takes the keyword-only extra argument ``loss_fn`` (also
      under optax's names ``obj_fn`` and ``value_fn``; needed by the Hutchinson estimator only).

    Raises:
      ValueError: a hyperparameter is out of range.
      TypeError: ``config`` is not a :class:`triaccel_jax.TriAccelConfig`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import triaccel_jax
      >>> tx = optax.chain(triaccel_jax.curvature_signals(), optax.sgd(0.1))
      >>> params = {"w": jnp.ones(4)}
      >>> state = tx.init(params)
      >>> _, state = tx.update({"w": jnp.full(4, 0.5)}, state, params)
      >>> triaccel_jax.signals(state)["w"]["mean_curvature"]  # the Fisher: 0.5 ** 2
      0.25

    References:
      Tri-Accel, arXiv 2508.16905; Kunstner et al., 2019, "Limitations of the Empirical Fisher
      Approximation"; Yao et al., 2021, "ADAHESSIAN" (Hutchinson's diagonal).
    """
    # alpha 0 with bounds 1: the observer's step scale is 1.
    return signals_with_scales(
        b1,
        b2,
        config=config,
        curvature_every=curvature_every,
        curvature_decay=curvature_decay,
        seed=seed,
        axis_name=axis_name,
        alpha=0.0,
        min_scale=1.0,
        max_scale=1.0,
    )


def signals_with_scales(
    b1: Any,
    b2: Any,
    *,
    config: TriAccelConfig | None,
    curvature_every: Any,
    curvature_decay: Any,
    seed: Any,
    axis_name: str | None,
    alpha: Any,
    min_scale: Any,
    max_scale: Any,
) -> optax.GradientTransformationExtraArgs:
    """:func:`curvature_signals` whose signals also hold Tri-Accel's step scale at ``alpha``.

    The scales are refreshed with the curvature (``refresh_when_due``), as
    ``scale_by_triaccel``'s are; :func:`triaccel_jax.scale_by_curvature` applies them. The
    updates are returned untouched.
    """
    validation.check_in_range("b1", b1, 0.0, 1.0, high_inclusive=False)
    validation.check_in_range("b2", b2, 0.0, 1.0, high_inclusive=False)
    config = resolve_config(config)
    validation.check_integer("curvature_every", curvature_every, 1)
    validation.check_in_range("curvature_decay", curvature_decay, 0.0, 1.0, high_inclusive=False)
    refresh_lib.check_step_scale(alpha, min_scale, max_scale)
    estimator_tx = make_estimator(config, seed)

    def init_fn(params: Any) -> CurvatureSignalsState:
        mu = init_moments(params, config)
        curvature, leaf_signals = init_curvature(params, config)
        nu_mean = jax.tree.map(
            lambda m: m if isinstance(m, optax.MaskedNode) else jnp.zeros((), jnp.float32),
            mu,
            is_leaf=lambda x: isinstance(x, optax.MaskedNode),
        )
        return CurvatureSignalsState(
            count=jnp.zeros([], jnp.int32),
            curvature_count=jnp.zeros([], jnp.int32),
            mu=mu,
            nu_mean=nu_mean,
            curvature=curvature,
            leaf_signals=leaf_signals,
            estimator_state=estimator_tx.init(params),
            rounding_key=jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 1)),
        )

    def update_fn(
        updates: Any,
        state: CurvatureSignalsState,
        params: Any = None,
        *,
        loss_fn: Callable[..., Any] | None = None,
        obj_fn: Callable[..., Any] | None = None,
        value_fn: Callable[..., Any] | None = None,
        **extra_args: Any,
    ) -> tuple[Any, CurvatureSignalsState]:
        del extra_args  # optax's contract: ignore extra arguments meant for other transforms
        loss_fn = require_loss_fn(config, loss_fn=loss_fn, obj_fn=obj_fn, value_fn=value_fn)
        kernels.resolve(config.impl, "moment write")
        treedef: Any  # a jaxlib PyTreeDef, which has no stubs mypy can see
        grads, treedef = jax.tree.flatten(updates)
        mu = flatten_like_updates(treedef, state.mu)
        nu_mean = treedef.flatten_up_to(state.nu_mean)
        active = trained_leaves(updates, grads, mu)
        count = optax.safe_increment(state.count)
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rounding_key), state.count)
        decay1 = jnp.asarray(b1, jnp.float32)
        decay2 = jnp.asarray(b2, jnp.float32)
        t = count.astype(jnp.float32)
        correction1 = 1 - decay1**t
        correction2 = 1 - decay2**t
        new_mu, new_nu = list(mu), list(nu_mean)
        m_hat, v_hat = {}, {}
        for i in active:
            g = grads[i].astype(jnp.float32)
            m = decay1 * mu[i].astype(jnp.float32) + (1 - decay1) * g
            new_nu[i] = decay2 * nu_mean[i] + (1 - decay2) * jnp.mean(jnp.square(g))
            new_mu[i] = cast_kernel.cast(
                m,
                mu[i].dtype,
                rounding="stochastic",
                key=jax.random.fold_in(step_key, i),
                impl=config.impl,
            )
            m_hat[i] = m / correction1
            v_hat[i] = new_nu[i] / correction2

        stores, estimator_state, curvature_count, new_signals = refresh_lib.refresh_when_due(
            state,
            estimate=lambda estimator_state: estimator_tx.update(
                updates, estimator_state, params, loss_fn=loss_fn
            ),
            treedef=treedef,
            active=active,
            shapes=[getattr(g, "shape", ()) for g in grads],
            moments=lambda: (m_hat, v_hat),
            curvature_every=curvature_every,
            axis_name=axis_name,
            curvature_decay=curvature_decay,
            alpha=alpha,
            min_scale=min_scale,
            max_scale=max_scale,
            bound=config.bound,
        )
        new_state = CurvatureSignalsState(
            count=count,
            curvature_count=curvature_count,
            mu=treedef.unflatten(new_mu),
            nu_mean=treedef.unflatten(new_nu),
            curvature=treedef.unflatten(stores),
            leaf_signals=treedef.unflatten(new_signals),
            estimator_state=estimator_state,
            rounding_key=state.rounding_key,
        )
        return updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def is_signal_state(node: Any) -> bool:
    """Whether ``node`` keeps curvature signals: a triaccel or a ``curvature_signals`` state."""
    return isinstance(node, (ScaleByTriAccelState, CurvatureSignalsState))


def find_signal_states(opt_state: Any) -> list[ScaleByTriAccelState | CurvatureSignalsState]:
    """Every state keeping curvature signals inside ``opt_state``, in tree order.

    Args:
      opt_state: any pytree: an optax state (chain, ``inject_hyperparams``, ``MultiSteps``,
        ``masked``, ``multi_transform``), a train state, or a state holding none.

    Returns:
      The :class:`ScaleByTriAccelState` and :class:`CurvatureSignalsState` nodes found (an
      empty list when there is none).
    """
    nodes = jax.tree.leaves(opt_state, is_leaf=is_signal_state)
    return [node for node in nodes if is_signal_state(node)]
