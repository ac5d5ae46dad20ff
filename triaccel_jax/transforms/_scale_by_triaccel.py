"""``scale_by_triaccel``: Adam moments scaled per leaf by a curvature-derived step size.

Tri-Accel (arXiv 2508.16905) steers each layer's step size with a cheap second-order signal. Here
that is, per leaf ``l`` (docs/design.md §3):

* the direction ``m_hat / (sqrt(v_hat) + eps)`` of Adam (Kingma & Ba, 2015), with the moments
  stored in the state dtype (bfloat16 writes are stochastically rounded);
* every ``curvature_every`` steps (under ``lax.cond``), a diagonal curvature estimate (empirical
  Fisher or Hutchinson) folded into an EMA that is stored compressed (block means + top-k);
* the step-size scale ``s_l = clip((kappa_ref / kappa_l) ** alpha, min_scale, max_scale)`` from the
  mean curvature ``kappa_l`` and its median ``kappa_ref`` over leaves (scale-free): flat leaves
  take longer steps, sharp ones shorter (or, with ``TriAccelConfig(scale="block")``, one scale
  per block of the store from its block means: ``_block_scale``);
* the noise-to-signal ratio ``mean(v_hat - m_hat**2) / mean(m_hat**2)``, read from the moments.

The per-leaf scalars are kept in the state for :func:`triaccel_jax.signals`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from triaccel_jax import kernels
from triaccel_jax._src import validation
from triaccel_jax.kernels import cast as cast_kernel
from triaccel_jax.transforms import _block_scale as block_scale
from triaccel_jax.transforms import _curvature_refresh as refresh_lib
from triaccel_jax.transforms import _curvature_signals as signals_lib
from triaccel_jax.transforms._config import TriAccelConfig
from triaccel_jax.transforms._config import resolve_config
from triaccel_jax.transforms._triaccel_state import ScaleByTriAccelState
from triaccel_jax.transforms._triaccel_step import CurvatureStep
from triaccel_jax.transforms._triaccel_step import StepInputs
from triaccel_jax.transforms._triaccel_step import TriAccelParts
from triaccel_jax.transforms._triaccel_step import next_state


def _write(value: jax.Array, dtype: jnp.dtype, key: jax.Array, impl: str) -> jax.Array:
    """Casts a freshly computed float32 moment to its state dtype, stochastically when narrower.

    Through the cast kernel's dispatch (``impl``): ``"reference"`` is the pure-JAX rounding,
    ``"auto"`` the Triton kernel only where the measured table says it beats XLA.
    """
    return cast_kernel.cast(value, dtype, rounding="stochastic", key=key, impl=impl)


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
        granularity (``scale``: per leaf or per store block). None: its defaults.
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
    transform, _ = build_scale_by_triaccel(
        b1,
        b2,
        eps,
        config=config,
        curvature_every=curvature_every,
        curvature_decay=curvature_decay,
        alpha=alpha,
        min_scale=min_scale,
        max_scale=max_scale,
        seed=seed,
        axis_name=axis_name,
    )
    return transform


def build_scale_by_triaccel(
    b1: Any,
    b2: Any,
    eps: Any,
    *,
    config: TriAccelConfig | None,
    curvature_every: Any,
    curvature_decay: Any,
    alpha: Any,
    min_scale: Any,
    max_scale: Any,
    seed: Any,
    axis_name: str | None,
) -> tuple[optax.GradientTransformationExtraArgs, TriAccelParts]:
    """:func:`scale_by_triaccel` and the :class:`TriAccelParts` its update is made of.

    :func:`triaccel_jax.triaccel` builds its direction here, so that its fused form
    (:func:`triaccel_jax.transforms.fused_apply`) runs the same preparation and curvature step
    as its optax update. Arguments and errors as :func:`scale_by_triaccel`'s.
    """
    validation.check_in_range("b1", b1, 0.0, 1.0, high_inclusive=False)
    validation.check_in_range("b2", b2, 0.0, 1.0, high_inclusive=False)
    validation.check_in_range("eps", eps, 0.0, float("inf"))
    config = resolve_config(config)
    validation.check_integer("curvature_every", curvature_every, 1)
    validation.check_in_range("curvature_decay", curvature_decay, 0.0, 1.0, high_inclusive=False)
    refresh_lib.check_step_scale(alpha, min_scale, max_scale)
    impl = config.impl
    estimator_tx = signals_lib.make_estimator(config, seed)

    def init_fn(params: Any) -> ScaleByTriAccelState:
        curvature, leaf_signals = signals_lib.init_curvature(params, config)
        return ScaleByTriAccelState(
            count=jnp.zeros([], jnp.int32),
            curvature_count=jnp.zeros([], jnp.int32),
            mu=signals_lib.init_moments(params, config),
            nu=signals_lib.init_moments(params, config),
            curvature=curvature,
            leaf_signals=leaf_signals,
            estimator_state=estimator_tx.init(params),
            rounding_key=jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 1)),
        )

    def prepare(
        updates: Any,
        state: ScaleByTriAccelState,
        *,
        loss_fn: Callable[..., Any] | None,
        obj_fn: Callable[..., Any] | None,
        value_fn: Callable[..., Any] | None,
    ) -> StepInputs:
        """Checks and flattens one update's inputs (shared with the fused update)."""
        loss_fn = signals_lib.require_loss_fn(
            config, loss_fn=loss_fn, obj_fn=obj_fn, value_fn=value_fn
        )
        # Checked on every trace, also for float32 moments (which no kernel writes), so that
        # impl="triton" where Triton cannot run is refused wherever it is asked for.
        kernels.resolve(impl, "moment write")
        treedef: Any  # a jaxlib PyTreeDef, which has no stubs mypy can see
        grads, treedef = jax.tree.flatten(updates)
        mu = signals_lib.flatten_like_updates(treedef, state.mu)
        count = optax.safe_increment(state.count)
        return StepInputs(
            loss_fn=loss_fn,
            grads=grads,
            treedef=treedef,
            active=signals_lib.trained_leaves(updates, grads, mu),
            mu=mu,
            nu=treedef.flatten_up_to(state.nu),
            new_count=count,
            scalars=kernels.adam_scalars(count=count, b1=b1, b2=b2, eps=eps),
            step_key=jax.random.fold_in(jax.random.wrap_key_data(state.rounding_key), state.count),
        )

    def curvature_step(
        updates: Any,
        state: ScaleByTriAccelState,
        params: Any,
        inputs: StepInputs,
        moments: Callable[[], tuple[dict[int, jax.Array], dict[int, jax.Array]]],
    ) -> CurvatureStep:
        """Every ``curvature_every`` steps: an estimate folded into the store, new signals.

        ``moments`` returns the bias-corrected moments ``(m_hat, v_hat)`` by leaf index; it is
        called only inside the branch that refreshes, so a caller that has not computed them (the
        fused update) computes them only on those steps. The signals and step scales change only
        then; the other steps reuse the stored ones.
        """
        treedef, active = inputs.treedef, inputs.active
        shapes = [getattr(g, "shape", ()) for g in inputs.grads]
        stores, estimator_state, curvature_count, new_signals = refresh_lib.refresh_when_due(
            state,
            estimate=lambda estimator_state: estimator_tx.update(
                updates, estimator_state, params, loss_fn=inputs.loss_fn
            ),
            treedef=treedef,
            active=active,
            shapes=shapes,
            moments=moments,
            curvature_every=curvature_every,
            axis_name=axis_name,
            curvature_decay=curvature_decay,
            alpha=alpha,
            min_scale=min_scale,
            max_scale=max_scale,
            bound=config.bound,
        )
        scales: dict[int, Any] = {i: new_signals[i].step_scale for i in active}
        if config.scale == "block":
            scales = block_scale.block_step_scales(
                stores,
                new_signals,
                active=active,
                shapes=shapes,
                alpha=alpha,
                min_scale=min_scale,
                max_scale=max_scale,
                bound=config.bound,
            )
        return CurvatureStep(stores, estimator_state, curvature_count, new_signals, scales)

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
        inputs = prepare(updates, state, loss_fn=loss_fn, obj_fn=obj_fn, value_fn=value_fn)
        grads, treedef, active = inputs.grads, inputs.treedef, inputs.active

        # Moments and direction (Adam, with bias correction): the math the fused update's
        # reference shares (triaccel_jax.kernels.adam_moments).
        new_mu, new_nu = list(inputs.mu), list(inputs.nu)
        m_hat, v_hat, direction = {}, {}, {}
        for i in active:
            moments = kernels.adam_moments(grads[i], inputs.mu[i], inputs.nu[i], inputs.scalars)
            m_hat[i], v_hat[i], direction[i] = moments.m_hat, moments.v_hat, moments.direction
            leaf_key = jax.random.fold_in(inputs.step_key, i)
            new_mu[i] = _write(moments.mu, new_mu[i].dtype, jax.random.fold_in(leaf_key, 0), impl)
            new_nu[i] = _write(moments.nu, new_nu[i].dtype, jax.random.fold_in(leaf_key, 1), impl)

        curvature = curvature_step(updates, state, params, inputs, lambda: (m_hat, v_hat))
        out = list(grads)
        for i in active:
            out[i] = (curvature.scales[i] * direction[i]).astype(grads[i].dtype)
        return treedef.unflatten(out), next_state(state, inputs, curvature, new_mu, new_nu)

    parts = TriAccelParts(
        b1=b1,
        b2=b2,
        eps=eps,
        impl=impl,
        scale=config.scale,
        prepare=prepare,
        curvature_step=curvature_step,
    )
    return optax.GradientTransformationExtraArgs(init_fn, update_fn), parts
