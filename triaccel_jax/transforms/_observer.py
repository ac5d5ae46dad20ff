"""The curvature signals: Tri-Accel's per-leaf curvature and noise, the one place they are kept.

The precision planner, the controller and Tri-Accel's step scale read per-leaf curvature and
gradient noise. This module estimates and keeps them (docs/design.md §3, §3.9):

* every ``curvature_every`` steps (under one ``lax.cond``), a diagonal curvature estimate
  (empirical Fisher or Hutchinson) folded into an EMA stored compressed (block means + top-k)
  (:mod:`triaccel_jax.transforms._refresh`);
* the noise-to-signal ratio ``mean(v_hat - m_hat**2) / mean(m_hat**2)`` of the gradients it sees,
  from an element-wise EMA of the gradient (``mu``, in the config's state dtype, bfloat16 writes
  stochastically rounded) and an EMA of the squared gradient (``nu``).

Two transforms keep them, each with its own state; they share the steps of an update as plain
functions (:func:`prepare`, :func:`refresh`, :func:`advanced`, also the fused update's):

* :func:`curvature_signals` (:func:`observe`), the observer, state :class:`CurvatureSignalsState`:
  it leaves the updates untouched and keeps ``nu`` as a per-leaf scalar (the mean over a leaf of
  Adam's ``v``, all the ratio needs), so it can sit in a chain beside ``optax.adamw``,
  ``optax.sgd`` or ``optax.contrib.muon``;
* :func:`adam_with_signals`, state :class:`AdamSignalsState`, beside Adam's direction
  (:func:`triaccel_jax.scale_by_triaccel`): the same moments are Adam's, ``nu`` element-wise,
  and it returns Adam's direction from them, so the moments exist once.

Each transform observes the updates that reach it: put it first in the chain, where they are the
gradients (the Fisher estimate is their square); the Hutchinson estimate reads only the params
and the loss, so it is the same anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import TypeVar

import jax
import jax.numpy as jnp
import optax

from triaccel_jax import kernels
from triaccel_jax import policy as policy_lib
from triaccel_jax._src import tree as tree_lib
from triaccel_jax.kernels import cast as cast_kernel
from triaccel_jax.transforms import _compression as compression
from triaccel_jax.transforms import _compression_grouped as compression_grouped
from triaccel_jax.transforms import _estimators as estimators
from triaccel_jax.transforms import _refresh as refresh_lib
from triaccel_jax.transforms import _step_scale as step_scale_lib
from triaccel_jax.transforms._config import CurvatureSettings
from triaccel_jax.transforms._config import StepScaleSettings
from triaccel_jax.transforms._config import TriAccelConfig
from triaccel_jax.transforms._config import resolve_config
from triaccel_jax.transforms._refresh import LeafSignals

# The curvature store's outlier indices are int32 flat indices into a leaf (and XLA's top_k
# over a flattened leaf counts in int32).
MAX_LEAF_SIZE = 2**31 - 1

# The type of a signals state a shared step is given, and returns.
StateT = TypeVar("StateT", "CurvatureSignalsState", "AdamSignalsState")


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


def init_curvature(
    params: Any, config: TriAccelConfig
) -> tuple[compression_grouped.CurvatureStores, LeafSignals]:
    """Empty compressed curvature stores and zero :class:`LeafSignals` of the trained leaves.

    Both are laid end to end over the observed leaves (vectors of one entry per leaf). On a
    sharded model they are replicated over the mesh of the first sharded parameter: they are
    small (about ``1 / block_size`` of the params), and every device reads all of them.
    """
    leaves = [leaf for leaf in jax.tree.leaves(params) if tree_lib.is_trainable(leaf)]
    stores = compression_grouped.CurvatureStores.of(
        [
            compression.empty_store(leaf.shape, block_size=config.block_size, rho=config.rho)
            for leaf in leaves
        ]
    )
    count = len(leaves)
    # Distinct arrays, never one shared buffer: callers donate the state to `jit`.
    signals = LeafSignals(
        mean_curvature=jnp.zeros((count,), jnp.float32),
        max_curvature=jnp.zeros((count,), jnp.float32),
        trace=jnp.zeros((count,), jnp.float32),
        noise_to_signal=jnp.zeros((count,), jnp.float32),
        step_scale=jnp.ones((count,), jnp.float32),
        dropped_estimates=jnp.zeros((count,), jnp.int32),
    )
    mesh_leaf = next(
        (
            leaf
            for leaf in leaves
            if isinstance(getattr(leaf, "sharding", None), jax.sharding.NamedSharding)
        ),
        None,
    )
    if mesh_leaf is not None:
        stores, signals = jax.tree.map(
            lambda x: placed(x, mesh_leaf, same_shape=False), (stores, signals)
        )
    return stores, signals


def make_estimator(config: TriAccelConfig, seed: int) -> optax.GradientTransformationExtraArgs:
    """The config's curvature estimator (Hutchinson's probes seeded by ``seed``)."""
    if config.estimator == "hutchinson":
        return estimators.hutchinson_diagonal(config.num_samples, seed=seed)
    return estimators.fisher_diagonal()


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
    loss_fn = estimators.resolve_loss_fn(loss_fn, obj_fn=obj_fn, value_fn=value_fn)
    if config.estimator == "hutchinson" and loss_fn is None:
        raise ValueError(estimators._LOSS_FN_HELP)
    return loss_fn


class Step(NamedTuple):
    """One update's checked inputs, shaped like the updates.

    Attributes:
      loss_fn: the loss (Hutchinson's estimator), resolved from its accepted names, or None.
      like_updates: a tree of the state's -> its nodes in the updates' structure.
      active: True where the signals observe the leaf (a tree of Python bools).
      mu: the first moments (``MaskedNode`` where not observed).
      nu: the state's second moments, as the state holds them: the observer's vector of leaf
        means (:class:`CurvatureSignalsState`'s); Adam's (:class:`AdamSignalsState`'s) element-
        wise, which its callers put in the updates' structure with ``like_updates``.
      count: the new step number (the state's count plus one).
      keys: each leaf's PRNG key for this step.
    """

    loss_fn: Callable[..., Any] | None
    like_updates: Callable[[Any], Any]
    active: Any
    mu: Any
    nu: Any
    # Shadows tuple.count, as the states do.
    count: jax.Array  # type: ignore[assignment]
    keys: Any


def prepare(
    updates: Any,
    state: SignalsState,
    config: TriAccelConfig,
    *,
    loss_fn: Callable[..., Any] | None,
    obj_fn: Callable[..., Any] | None,
    value_fn: Callable[..., Any] | None,
) -> Step:
    """Checks one update's inputs against the state (shared with the fused update).

    The state decides which leaves are observed (init saw the params): a float gradient for an
    integer parameter, say, passes through like the parameter's other updates.
    """
    loss_fn = require_loss_fn(config, loss_fn=loss_fn, obj_fn=obj_fn, value_fn=value_fn)
    # Checked on every trace, also for float32 moments (which no kernel writes), so that
    # impl="triton" where Triton cannot run is refused wherever it is asked for.
    kernels.resolve(config.impl, "moment write")
    treedef: Any  # a jaxlib PyTreeDef, which has no stubs mypy can see
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(updates)

    def like_updates(tree: Any) -> Any:
        try:
            return treedef.unflatten(treedef.flatten_up_to(tree))
        except (ValueError, TypeError) as error:
            raise ValueError(
                "the updates do not have the tree structure of the params the optimizer state "
                f"was initialised with: {error}"
            ) from None

    mu = like_updates(state.mu)

    def observed(path: Any, g: Any, m: Any) -> bool:
        if refresh_lib.is_masked(m) or not tree_lib.is_trainable(g):
            return False
        if g.shape != m.shape:
            raise ValueError(
                f"the update of leaf {tree_lib.path_string(path)!r} has shape {g.shape}, its "
                f"parameter had shape {m.shape} at init"
            )
        return True

    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rounding_key), state.count)
    return Step(
        loss_fn=loss_fn,
        like_updates=like_updates,
        active=jax.tree_util.tree_map_with_path(observed, updates, mu),
        mu=mu,
        nu=state.nu,
        count=optax.safe_increment(state.count),
        keys=treedef.unflatten([jax.random.fold_in(step_key, i) for i in range(len(with_paths))]),
    )


def refresh(
    step: Step,
    updates: Any,
    state: SignalsState,
    params: Any,
    moments: Callable[[], refresh_lib.NoiseMoments],
    *,
    settings: CurvatureSettings,
    config: TriAccelConfig,
    step_scales: Callable[[jax.Array], jax.Array] | None,
) -> tuple[Any, Any, jax.Array, Any]:
    """The curvature step when it is due: ``(stores, estimator_state, curvature_count,
    signals)`` (:func:`triaccel_jax.transforms._refresh.refresh_when_due`).

    ``moments()`` gives the observed leaves' :class:`NoiseMoments`; it is called only on the
    steps that refresh, so a caller that has not computed them (the fused update) computes them
    then. ``step_scales`` computes the leaves' step scales from their mean curvatures
    (:func:`triaccel_jax.transforms._step_scale.leaf_step_scales`); None: 1, nothing is scaled.
    """
    estimator_tx = make_estimator(config, settings.seed)
    return refresh_lib.refresh_when_due(
        state,
        estimate=lambda estimator_state: estimator_tx.update(
            updates, estimator_state, params, loss_fn=step.loss_fn
        ),
        like_updates=step.like_updates,
        updates=updates,
        active=step.active,
        moments=moments,
        settings=settings,
        step_scales=step_scales,
        axis_name=config.axis_name,
        fisher=config.estimator == "fisher",
    )


def advanced(
    cls: type[StateT],
    state: SignalsState,
    step: Step,
    refreshed: tuple[Any, Any, jax.Array, Any],
    *,
    mu: Any,
    nu: Any,
) -> StateT:
    """The state of type ``cls`` after a step, from its new moments and the refresh's result."""
    stores, estimator_state, curvature_count, signals = refreshed
    return cls(
        count=step.count,
        curvature_count=curvature_count,
        mu=mu,
        nu=nu,
        curvature=stores,
        leaf_signals=signals,
        estimator_state=estimator_state,
        rounding_key=state.rounding_key,
    )


def adam_moments(step: Step, updates: Any, scalars: kernels.Scalars) -> Any:
    """Adam's new moments of each observed leaf (None on the others), in float32.

    The math the fused update's reference shares (:func:`triaccel_jax.kernels.adam_moments`).
    """
    return jax.tree.map(
        lambda a, g, m, v: kernels.adam_moments(g, m, v, scalars) if a else None,
        step.active,
        updates,
        step.mu,
        step.nu,
    )


def noise_moments(moments: Any, scalars: kernels.Scalars) -> refresh_lib.NoiseMoments:
    """What the noise ratio reads of :func:`adam_moments`' result (Adam's element-wise moments),
    for the observed leaves in tree order."""
    held = [m for m in jax.tree.leaves(moments, is_leaf=_is_moments_or_none) if m is not None]
    return refresh_lib.NoiseMoments(
        m=[m.mu for m in held],
        v=[m.nu for m in held],
        inv_bias_correction1=scalars.inv_bias_correction1,
        inv_bias_correction2=scalars.inv_bias_correction2,
    )


def written_first_moment(moments: Any, step: Step, config: TriAccelConfig) -> Any:
    """Adam's new first moment in each observed leaf's stored dtype (None on the others), with
    the rounding key both signals transforms give it."""
    return observed_moments(
        lambda m, old, key: write_moment(m.mu, old, jax.random.fold_in(key, 0), config.impl),
        moments,
        step.mu,
        step.keys,
    )


def write_moment(value: jax.Array, old: jax.Array, key: jax.Array, impl: str) -> jax.Array:
    """A freshly computed float32 moment in its stored dtype, stochastically rounded when
    narrower, through the cast kernel's dispatch (``impl``)."""
    return cast_kernel.cast(value, old.dtype, rounding="stochastic", key=key, impl=impl)


def initial_state(
    cls: type[StateT],
    params: Any,
    config: TriAccelConfig,
    settings: CurvatureSettings,
    estimator_tx: optax.GradientTransformation,
    *,
    nu: Callable[[LeafSignals], Any],
) -> StateT:
    """A fresh signals state of type ``cls``: zero moments and counts, empty curvature stores;
    ``nu(leaf_signals)`` is its second moment (it sees the zero signals, one entry per observed
    leaf)."""
    mu = init_moments(params, config)
    curvature, leaf_signals = init_curvature(params, config)
    return cls(
        count=jnp.zeros([], jnp.int32),
        curvature_count=jnp.zeros([], jnp.int32),
        mu=mu,
        nu=nu(leaf_signals),
        curvature=curvature,
        leaf_signals=leaf_signals,
        estimator_state=estimator_tx.init(params),
        rounding_key=jax.random.key_data(jax.random.fold_in(jax.random.key(settings.seed), 1)),
    )


def observed_moments(fn: Callable[..., Any], moments: Any, *trees: Any) -> Any:
    """``fn(moments, *nodes)`` on the observed leaves (those with :func:`adam_moments`), None
    on the others."""
    return jax.tree.map(
        lambda m, *nodes: None if m is None else fn(m, *nodes),
        moments,
        *trees,
        is_leaf=_is_moments_or_none,
    )


def kept_where_unobserved(new: Any, old: Any) -> Any:
    """``new``, with ``old``'s node wherever ``new`` holds None (the leaves not observed)."""
    return jax.tree.map(lambda n, o: o if n is None else n, new, old, is_leaf=_is_none_or_masked)


class _SignalFields(NamedTuple):
    """The fields both signals states hold, and their readers by leaf; each state is a subclass
    (:class:`CurvatureSignalsState`, :class:`AdamSignalsState`), so that its type says what its
    ``nu`` is."""

    # Shadows tuple.count, as optax's states do; the field name is part of the state's structure.
    count: jax.Array  # type: ignore[assignment]
    curvature_count: jax.Array
    mu: Any
    nu: Any
    curvature: Any
    leaf_signals: Any
    estimator_state: Any
    rounding_key: jax.Array

    def leaf_paths(self) -> list[str]:
        """The ``"a/b/kernel"`` paths of the observed leaves: the order of every per-leaf vector
        in the state (the leaves of ``mu``; the others hold ``optax.MaskedNode``)."""
        with_paths, _ = jax.tree_util.tree_flatten_with_path(self.mu)
        return [tree_lib.path_string(path) for path, _ in with_paths]

    def signals_by_leaf(self) -> dict[str, LeafSignals]:
        """Each observed leaf's :class:`LeafSignals` (scalars), keyed by its path."""
        paths = self.leaf_paths()
        vectors = refresh_lib.as_named_tuple(LeafSignals, self.leaf_signals)
        if any(jnp.shape(field) != (len(paths),) for field in vectors):
            raise ValueError(
                f"the state holds signals of shapes {[jnp.shape(f) for f in vectors]} for "
                f"{len(paths)} observed leaves: it is not a state of this version of triaccel_jax"
            )
        return {path: LeafSignals(*(field[i] for field in vectors)) for i, path in enumerate(paths)}

    def curvature_by_leaf(self) -> dict[str, compression.CompressedDiagonal]:
        """Each observed leaf's curvature EMA (not bias-corrected), keyed by its path."""
        return dict(zip(self.leaf_paths(), self.curvature.leaves(), strict=True))


class CurvatureSignalsState(_SignalFields):
    """State of the observer :func:`curvature_signals` (also inside
    :func:`triaccel_jax.scale_by_curvature`); arrays only.

    ``mu`` is shaped like the params, with ``optax.MaskedNode()`` at the leaves it does not
    observe (integer, boolean, empty). Everything kept per leaf besides ``mu`` is a vector over
    the observed leaves, in the params' leaf order, so that the compiled update does not grow
    with the number of leaves. Beside Adam's direction the signals keep Adam's element-wise
    moments instead: :class:`AdamSignalsState`.

    Attributes:
      count: int32 number of updates, saturating.
      curvature_count: int32 number of curvature estimates taken, saturating; a leaf's EMA holds
        ``curvature_count - dropped_estimates`` of them (see :class:`LeafSignals`).
      mu: EMA of the gradients (decay ``b1``), in the state dtype.
      nu: a float32 vector with one entry per observed leaf: the EMA (decay ``b2``) of
        ``mean(g**2)`` over the leaf, all the noise ratio reads of the second moment.
      curvature: every observed leaf's curvature EMA, laid end to end
        (:class:`triaccel_jax.transforms.CurvatureStores`; its ``leaves()`` are the per-leaf
        :class:`triaccel_jax.transforms.CompressedDiagonal`).
      leaf_signals: one :class:`triaccel_jax.transforms.LeafSignals` whose fields are vectors
        with one entry per observed leaf.
      estimator_state: the curvature estimator's state.
      rounding_key: uint32 PRNG key data for the stochastic rounding of the moments.

    Example:
      >>> import jax.numpy as jnp
      >>> import triaccel_jax
      >>> state = triaccel_jax.curvature_signals().init({"w": jnp.ones((2, 3)), "b": jnp.ones(3)})
      >>> state.mu["w"].shape, state.nu.shape  # nu: one mean per observed leaf
      ((2, 3), (2,))

    References:
      Tri-Accel, arXiv 2508.16905.
    """

    # The fields and readers are _SignalFields'; a type of its own says which nu it holds.
    __slots__ = ()


def curvature_signals(
    b1: float = 0.9,
    b2: float = 0.999,
    *,
    config: TriAccelConfig | None = None,
    curvature_every: int = 10,
    curvature_decay: float = 0.95,
    seed: int = 0,
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
        layout, Hutchinson's probes, ``state_dtype`` for the gradient EMA (``impl`` chooses
        its narrow writes; ``scale`` is not read) and ``axis_name`` under ``shard_map`` or
        ``pmap``. None: its defaults.
      curvature_every: estimate curvature every this many steps (>= 1), starting at the first.
      curvature_decay: EMA decay of the curvature estimates, in [0, 1).
      seed: seed of the stochastic rounding and of Hutchinson's probes.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`CurvatureSignalsState` and whose ``update`` returns the updates it is given (the
      same objects) and takes the keyword-only extra argument ``loss_fn`` (also under optax's
      names ``obj_fn`` and ``value_fn``; needed by the Hutchinson estimator only).

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
    return observe(CurvatureSettings(b1, b2, curvature_every, curvature_decay, seed), config)


def observe(
    settings: CurvatureSettings,
    config: TriAccelConfig | None,
    scale: StepScaleSettings | None = None,
) -> optax.GradientTransformationExtraArgs:
    """The observer: keeps the curvature signals of the updates and returns them untouched.

    Args:
      settings: the numeric settings (checked here).
      config: the shape options (None: defaults).
      scale: the step scale the signals report and a later step scale applies
        (:func:`triaccel_jax.scale_by_curvature`); None where nothing is scaled (the observer
        alone): every leaf's ``step_scale`` is 1.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`CurvatureSignalsState` (``nu`` one float32 scalar per observed leaf).
    """
    settings = settings.checked()
    config = resolve_config(config)
    step_scales = (
        None if scale is None else step_scale_lib.leaf_step_scales(scale.checked(), config.bound)
    )
    estimator_tx = make_estimator(config, settings.seed)

    def init_fn(params: Any) -> CurvatureSignalsState:
        return initial_state(
            CurvatureSignalsState,
            params,
            config,
            settings,
            estimator_tx,
            nu=lambda signals: jnp.zeros_like(signals.mean_curvature),
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
        step = prepare(updates, state, config, loss_fn=loss_fn, obj_fn=obj_fn, value_fn=value_fn)
        scalars = kernels.adam_scalars(count=step.count, b1=settings.b1, b2=settings.b2, eps=0.0)
        # Adam's update of the first moment; the second is kept as each leaf's mean (below), so
        # Adam's element-wise one is computed from zeros and unused.
        moments = adam_moments(
            step._replace(nu=jax.tree.map(jnp.zeros_like, step.mu)), updates, scalars
        )
        mu = written_first_moment(moments, step, config)
        # The EMA of each leaf's mean(g**2): b2 * nu + (1 - b2) * mean(g**2), one segmented
        # mean over all observed leaves.
        observed = [
            g
            for g, flag in zip(jax.tree.leaves(updates), jax.tree.leaves(step.active), strict=True)
            if flag
        ]
        squares = refresh_lib.leaf_means(observed, jnp.square)
        nu = scalars.b2 * step.nu + scalars.one_minus_b2 * squares

        def noise() -> refresh_lib.NoiseMoments:
            return refresh_lib.NoiseMoments(
                m=[
                    m.mu
                    for m in jax.tree.leaves(moments, is_leaf=_is_moments_or_none)
                    if m is not None
                ],
                v=nu,
                inv_bias_correction1=scalars.inv_bias_correction1,
                inv_bias_correction2=scalars.inv_bias_correction2,
            )

        refreshed = refresh(
            step,
            updates,
            state,
            params,
            noise,
            settings=settings,
            config=config,
            step_scales=step_scales,
        )
        new_state = advanced(
            CurvatureSignalsState,
            state,
            step,
            refreshed,
            mu=kept_where_unobserved(mu, step.mu),
            nu=nu,
        )
        return updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class AdamSignalsState(_SignalFields):
    """State of the curvature signals that keep Adam's moments and return Adam's direction
    (:func:`adam_with_signals`, inside :func:`triaccel_jax.scale_by_triaccel` and
    :func:`triaccel_jax.triaccel`); arrays only.

    The fields are :class:`CurvatureSignalsState`'s, with Adam's second moment element-wise:
    ``mu`` and ``nu`` are shaped like the params, with ``optax.MaskedNode()`` at the leaves not
    observed (integer, boolean, empty), in the state dtype. Everything else kept per leaf is a
    vector over the observed leaves, in the params' leaf order.

    Attributes:
      count: int32 number of updates, saturating.
      curvature_count: int32 number of curvature estimates taken, saturating; a leaf's EMA holds
        ``curvature_count - dropped_estimates`` of them (see :class:`LeafSignals`).
      mu: Adam's first moment, the EMA of the gradients (decay ``b1``).
      nu: Adam's second moment, the EMA of the squared gradients (decay ``b2``).
      curvature: every observed leaf's curvature EMA, laid end to end
        (:class:`triaccel_jax.transforms.CurvatureStores`).
      leaf_signals: one :class:`triaccel_jax.transforms.LeafSignals` whose fields are vectors
        with one entry per observed leaf.
      estimator_state: the curvature estimator's state.
      rounding_key: uint32 PRNG key data for the stochastic rounding of the moments.

    Example:
      >>> import jax.numpy as jnp
      >>> import triaccel_jax
      >>> tx = triaccel_jax.scale_by_triaccel()
      >>> (state,) = triaccel_jax.transforms.find_signal_states(tx.init({"w": jnp.ones((2, 3))}))
      >>> type(state).__name__, state.nu["w"].shape  # nu: Adam's, element-wise
      ('AdamSignalsState', (2, 3))

    References:
      Tri-Accel, arXiv 2508.16905; Kingma & Ba, 2015, "Adam".
    """

    # The fields and readers are _SignalFields'; a type of its own says which nu it holds.
    __slots__ = ()


def adam_with_signals(
    settings: CurvatureSettings,
    scale: StepScaleSettings,
    config: TriAccelConfig | None,
    eps: Any,
) -> optax.GradientTransformationExtraArgs:
    """The curvature signals keeping Adam's moments, returning Adam's direction from them.

    The moments exist once: Adam's direction and the noise ratio read the same ``mu`` and
    element-wise ``nu``.

    Args:
      settings: the numeric settings (checked here).
      scale: the step scale the signals hold for the step scale that follows.
      config: the shape options (None: defaults).
      eps: added to ``sqrt(v_hat)`` in Adam's denominator.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is an :class:`AdamSignalsState`
      and whose ``update`` returns ``m_hat / (sqrt(v_hat) + eps)`` in float32 on the observed
      leaves (the others pass through).
    """
    settings = settings.checked()
    config = resolve_config(config)
    step_scales = step_scale_lib.leaf_step_scales(scale.checked(), config.bound)
    estimator_tx = make_estimator(config, settings.seed)

    def init_fn(params: Any) -> AdamSignalsState:
        return initial_state(
            AdamSignalsState,
            params,
            config,
            settings,
            estimator_tx,
            nu=lambda signals: init_moments(params, config),
        )

    def update_fn(
        updates: Any,
        state: AdamSignalsState,
        params: Any = None,
        *,
        loss_fn: Callable[..., Any] | None = None,
        obj_fn: Callable[..., Any] | None = None,
        value_fn: Callable[..., Any] | None = None,
        **extra_args: Any,
    ) -> tuple[Any, AdamSignalsState]:
        del extra_args  # optax's contract: ignore extra arguments meant for other transforms
        step = prepare(updates, state, config, loss_fn=loss_fn, obj_fn=obj_fn, value_fn=value_fn)
        step = step._replace(nu=step.like_updates(step.nu))
        scalars = kernels.adam_scalars(count=step.count, b1=settings.b1, b2=settings.b2, eps=eps)
        moments = adam_moments(step, updates, scalars)
        mu = written_first_moment(moments, step, config)
        nu = observed_moments(
            lambda m, old, key: write_moment(m.nu, old, jax.random.fold_in(key, 1), config.impl),
            moments,
            step.nu,
            step.keys,
        )
        refreshed = refresh(
            step,
            updates,
            state,
            params,
            lambda: noise_moments(moments, scalars),
            settings=settings,
            config=config,
            step_scales=step_scales,
        )
        new_state = advanced(
            AdamSignalsState,
            state,
            step,
            refreshed,
            mu=kept_where_unobserved(mu, step.mu),
            nu=kept_where_unobserved(nu, step.nu),
        )
        direction = jax.tree.map(
            lambda m, g: g if m is None else m.direction,
            moments,
            updates,
            is_leaf=_is_moments_or_none,
        )
        return direction, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# Either state that keeps curvature signals: what the planner, signals() and the step scale read.
SignalsState = CurvatureSignalsState | AdamSignalsState


def _is_moments_or_none(node: Any) -> bool:
    return node is None or isinstance(node, kernels.AdamMoments)


def _is_none_or_masked(node: Any) -> bool:
    return node is None or refresh_lib.is_masked(node)


def is_signal_state(node: Any) -> bool:
    """Whether ``node`` keeps curvature signals: a :class:`CurvatureSignalsState` or an
    :class:`AdamSignalsState` (an ``is_leaf`` for tree functions)."""
    return isinstance(node, CurvatureSignalsState | AdamSignalsState)


def find_signal_states(opt_state: Any) -> list[CurvatureSignalsState | AdamSignalsState]:
    """Every state keeping curvature signals inside ``opt_state``, in tree order.

    Args:
      opt_state: any pytree: an optax state (chain, ``inject_hyperparams``, ``MultiSteps``,
        ``masked``, ``multi_transform``), a train state, or a state holding none.

    Returns:
      The :class:`CurvatureSignalsState` (the observer's) and :class:`AdamSignalsState` (the
      signals beside Adam's direction) nodes found, in tree order (an empty list when there is
      none).
    """
    nodes = jax.tree.leaves(opt_state, is_leaf=is_signal_state)
    return [node for node in nodes if is_signal_state(node)]
