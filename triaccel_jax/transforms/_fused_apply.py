"""``fused_triaccel`` and ``fused_apply``: a triaccel step that writes moments, master and
compute copy in one pass.

An optax transform returns updates; ``optax.apply_updates`` then adds them to the params and the
forward pass casts the params to their compute dtype: three trips through memory per leaf beyond
the moments. :func:`fused_apply` does what ``tx.update`` followed by ``apply_updates`` (and
:func:`triaccel_jax.cast_params`) does for a :func:`triaccel_jax.triaccel` optimizer, but hands
each leaf's moments, master write and compute copy to the one-pass fused update
(:func:`triaccel_jax.kernels.fused_update.fused_update`, docs/design.md §4, §8): the Triton
kernel on CUDA where ``impl`` (``TriAccelConfig.impl``) selects it, its pure-JAX reference
elsewhere. The curvature step, the signals and the optimizer state are those of the optax update
(the same code, :mod:`triaccel_jax.transforms._observer`).

The fused form is explicit: :func:`fused_triaccel` takes ``triaccel``'s arguments and returns a
:class:`FusedTriAccel` holding that optimizer (``tx``) and the hyperparameters the fused step
reads, which a train step is handed (``make_train_step(..., fused=...)``). Fusion is an
optimisation, never a change of what is computed beyond the rounding and random bits listed in
:func:`fused_apply`; where it does not apply (per-block step scales, moments of another dtype)
the step runs ``tx.update``.
"""

from __future__ import annotations

import inspect
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from triaccel_jax import kernels
from triaccel_jax import policy as policy_lib
from triaccel_jax._src import tree as tree_lib
from triaccel_jax.kernels import fused_update as fused_kernel
from triaccel_jax.transforms import _alias as alias
from triaccel_jax.transforms import _observer as observer
from triaccel_jax.transforms import _refresh as refresh_lib
from triaccel_jax.transforms import _step_scale as step_scale_lib
from triaccel_jax.transforms._config import CurvatureSettings
from triaccel_jax.transforms._config import StepScaleSettings
from triaccel_jax.transforms._config import TriAccelConfig
from triaccel_jax.transforms._config import resolve_config


class FusedTriAccel(NamedTuple):
    """A :func:`triaccel_jax.triaccel` optimizer and the hyperparameters of its fused step.

    Made by :func:`fused_triaccel` from one set of arguments, so the two cannot differ.

    Attributes:
      tx: the optimizer, ``triaccel(...)`` of the same arguments (its ``init`` makes the state,
        its ``update`` is the unfused step).
      learning_rate: the learning rate, a number or an optax schedule.
      weight_decay: the decoupled weight-decay rate.
      mask: which leaves get weight decay (as ``optax.adamw``'s ``mask``), or None.
      eps: added to ``sqrt(v_hat)``.
      settings: the curvature signals' settings.
      scale: the step scale's settings.
      config: the shape options.
    """

    tx: optax.GradientTransformationExtraArgs
    learning_rate: Any
    weight_decay: Any
    mask: Any
    eps: Any
    settings: CurvatureSettings
    scale: StepScaleSettings
    config: TriAccelConfig


def fused_triaccel(learning_rate: optax.ScalarOrSchedule, **hyperparameters: Any) -> FusedTriAccel:
    """The fused form of ``triaccel(learning_rate, **hyperparameters)``.

    Args:
      learning_rate: as :func:`triaccel_jax.triaccel`'s.
      **hyperparameters: any other argument of :func:`triaccel_jax.triaccel`, by name.

    Returns:
      A :class:`FusedTriAccel`: hand it to :func:`fused_apply`, or to
      ``triaccel_jax.training.make_train_step(..., fused=...)``, the Flax ``TrainState``
      (``fused=``) or ``ControllerConfig(fused_update=...)``; its ``tx`` is the optimizer.

    Raises:
      TypeError: an argument ``triaccel`` does not take.
      ValueError: a hyperparameter out of range (as ``triaccel`` raises).

    Example:
      >>> import jax.numpy as jnp, triaccel_jax
      >>> from triaccel_jax.transforms import fused_triaccel, unfused_reason
      >>> fused = fused_triaccel(1e-3, weight_decay=0.0)
      >>> state = fused.tx.init({"w": jnp.ones(3)})
      >>> unfused_reason(fused, state) is None
      True

    References:
      Tri-Accel, arXiv 2508.16905.
    """
    tx = alias.triaccel(learning_rate, **hyperparameters)
    bound = inspect.signature(alias.triaccel).bind(learning_rate, **hyperparameters)
    bound.apply_defaults()
    given = bound.arguments
    return FusedTriAccel(
        tx=tx,
        learning_rate=learning_rate,
        weight_decay=given["weight_decay"],
        mask=given["mask"],
        eps=given["eps"],
        settings=CurvatureSettings(**{name: given[name] for name in CurvatureSettings._fields}),
        scale=StepScaleSettings(**{name: given[name] for name in StepScaleSettings._fields}),
        config=resolve_config(given["config"]),
    )


class FusedApply(NamedTuple):
    """The result of :func:`fused_apply`.

    Attributes:
      params: the new params (the masters), each in its old dtype.
      opt_state: the new optimizer state, as ``tx.update`` returns it.
      compute: the new params' compute copy under ``compute_policy``, or None without one.
    """

    params: Any
    opt_state: Any
    compute: Any


def unfused_reason(fused: FusedTriAccel, opt_state: Any = None) -> str | None:
    """Why ``fused`` (with ``opt_state``) cannot take the fused path; None when it can.

    Args:
      fused: a :class:`FusedTriAccel`.
      opt_state: its optimizer's state, to check the moments' dtypes; None skips that check.

    Returns:
      A sentence naming the reason, or None.

    Raises:
      TypeError: ``fused`` is not a :class:`FusedTriAccel`.

    Example:
      >>> import triaccel_jax
      >>> from triaccel_jax.transforms import fused_triaccel, unfused_reason
      >>> unfused_reason(fused_triaccel(1e-3)) is None
      True
      >>> unfused_reason(fused_triaccel(1e-3, config=triaccel_jax.TriAccelConfig(scale="block")))
      "per-block step scales (TriAccelConfig(scale='block')) are not scalars per leaf"
    """
    _check_fused(fused)
    if fused.config.scale != "leaf":
        return "per-block step scales (TriAccelConfig(scale='block')) are not scalars per leaf"
    if opt_state is not None:
        for state in observer.find_signal_states(opt_state):
            for leaf in jax.tree.leaves((state.mu, state.nu)):
                if jnp.dtype(leaf.dtype).name not in fused_kernel.MOMENT_DTYPES:
                    return (
                        f"the fused update stores moments in float32 or bfloat16, not {leaf.dtype}"
                    )
    return None


def uses_triton(fused: FusedTriAccel, opt_state: Any) -> bool:
    """Whether :func:`fused_apply` would run ``fused``'s update in the Triton kernel here.

    True only where it can be fused, the default backend is CUDA with jax_triton, and ``impl``
    selects Triton for the moments' dtype (``"triton"``, or ``"auto"`` with the measured table
    ``kernels/auto_table.json`` saying so).
    """
    if unfused_reason(fused, opt_state) is not None:
        return False
    moments = {
        jnp.dtype(x.dtype).name
        for state in observer.find_signal_states(opt_state)
        for x in jax.tree.leaves(state.mu)
    }
    op = kernels.fused_update_op("bfloat16" if "bfloat16" in moments else "float32")
    return kernels.resolve(fused.config.impl, "fused update", op) == "triton"


def fused_apply(
    fused: FusedTriAccel,
    grads: Any,
    opt_state: Any,
    params: Any,
    *,
    learning_rate_factor: Any = 1.0,
    compute_policy: policy_lib.PrecisionPolicy | None = None,
    **extra_args: Any,
) -> FusedApply:
    """``fused.tx.update`` and ``optax.apply_updates`` in one, fused per leaf.

    For the fused form of a :func:`triaccel_jax.triaccel` optimizer (per-leaf step scales and
    float32 or bfloat16 moments; see :func:`unfused_reason`), each trained leaf's new moments, new master and compute copy come from
    one call of the fused update, with the transform's ``TriAccelConfig.impl``: the Triton kernel
    on CUDA where it is selected, the pure-JAX reference elsewhere (XLA fuses that too). The
    optimizer state is the one ``tx.update`` would return. Three things differ from the unfused
    path, on purpose: the update stays float32 until it is added to the master (the optax chain
    rounds it to the gradient's dtype first), ``learning_rate_factor`` multiplies the learning
    rate rather than the finished update (an ulp apart), and bfloat16 moments and narrow masters
    are stochastically rounded with the kernel's own random bits. Any other transform runs
    ``tx.update`` and ``optax.apply_updates``.

    Args:
      fused: the optimizer's fused form, :func:`fused_triaccel`'s.
      grads: the gradients, a tree like ``params``.
      opt_state: ``fused.tx``'s state.
      params: the masters (float32, or bfloat16/float16 policy masters).
      learning_rate_factor: multiplies every update (the controller's learning-rate scaling for
        a grown batch); 1 by default.
      compute_policy: a :class:`triaccel_jax.PrecisionPolicy` whose compute dtypes the compute
        copy takes (written in the same pass; fp8 leaves are scaled from the new master, so they
        are cast after it); None: no compute copy.
      **extra_args: passed to the update (``loss_fn=`` for Hutchinson's estimator).

    Returns:
      A :class:`FusedApply` ``(params, opt_state, compute)``.

    Raises:
      RuntimeError: ``TriAccelConfig(impl="triton")`` where Triton cannot run.
      TypeError: ``fused`` is not a :class:`FusedTriAccel`.
      ValueError: ``opt_state`` is not a state of ``fused.tx``.

    Example:
      >>> import jax.numpy as jnp, optax, triaccel_jax
      >>> from triaccel_jax.transforms import fused_apply, fused_triaccel
      >>> params = {"w": jnp.ones(4)}
      >>> fused = fused_triaccel(0.1)
      >>> state = fused.tx.init(params)
      >>> policy = triaccel_jax.PrecisionPolicy.uniform(params, "bf16")
      >>> out = fused_apply(fused, {"w": jnp.full(4, 0.5)}, state, params, compute_policy=policy)
      >>> updates, _ = fused.tx.update({"w": jnp.full(4, 0.5)}, state, params)
      >>> bool(jnp.allclose(out.params["w"], optax.apply_updates(params, updates)["w"]))
      True
      >>> out.compute["w"].dtype
      dtype(bfloat16)

    References:
      Tri-Accel, arXiv 2508.16905; Loshchilov & Hutter, 2019, "Decoupled Weight Decay
      Regularization".
    """
    _check_fused(fused)
    if compute_policy is not None:
        policy_lib.check_policy(compute_policy)
        compute_policy.check_matches(params)
    _check_state_of(opt_state)
    if unfused_reason(fused, opt_state) is not None:
        updates, opt_state = fused.tx.update(grads, opt_state, params, **extra_args)
        updates = jax.tree.map(lambda u: _times(u, learning_rate_factor), updates)
        new_params = optax.apply_updates(params, updates)
        compute = None
        if compute_policy is not None:
            compute = policy_lib.cast_params(new_params, compute_policy, impl=fused.config.impl)
        return FusedApply(new_params, opt_state, compute)
    return _fused(fused, grads, opt_state, params, learning_rate_factor, compute_policy, extra_args)


def _check_fused(fused: Any) -> None:
    if not isinstance(fused, FusedTriAccel):
        raise TypeError(
            "`fused` must be the fused form of a triaccel optimizer, "
            f"triaccel_jax.transforms.fused_triaccel(...), got {type(fused).__name__}"
        )


def _check_state_of(opt_state: Any) -> None:
    """Raises ``ValueError`` unless ``opt_state`` is shaped as a ``triaccel`` state (the
    signals', the step scale's, then the masked weight-decay and rate states), instead of
    failing inside the update on another optimizer's state."""
    if not (
        isinstance(opt_state, tuple)
        and len(opt_state) == 3
        and isinstance(opt_state[0], observer.AdamSignalsState)
        and isinstance(opt_state[2], optax.MaskedState)
    ):
        kind = type(opt_state).__name__
        first = type(opt_state[0]).__name__ if isinstance(opt_state, tuple) and opt_state else "-"
        raise ValueError(
            "`opt_state` is not a state of `fused.tx` (another optimizer's, or one saved before "
            "the state was (AdamSignalsState, EmptyState, MaskedState)?): got a "
            f"{kind} starting with {first}"
        )


def _fused(
    fused: FusedTriAccel,
    grads: Any,
    opt_state: Any,
    params: Any,
    learning_rate_factor: Any,
    compute_policy: policy_lib.PrecisionPolicy | None,
    extra_args: dict[str, Any],
) -> FusedApply:
    signals_state, scale_state, masked_state = opt_state
    decay_state, rate_state = masked_state.inner_state
    if callable(fused.learning_rate):
        # optax.scale_by_learning_rate(schedule): the rate at the count before the increment.
        rate = fused.learning_rate(rate_state.count)
        rate_state = rate_state._replace(count=optax.safe_increment(rate_state.count))
    else:
        rate = fused.learning_rate
    rate = jnp.asarray(rate, jnp.float32) * jnp.asarray(learning_rate_factor, jnp.float32)
    settings, config = fused.settings, fused.config

    step = observer.prepare(
        grads,
        signals_state,
        config,
        loss_fn=extra_args.get("loss_fn"),
        obj_fn=extra_args.get("obj_fn"),
        value_fn=extra_args.get("value_fn"),
    )
    step = step._replace(nu=step.like_updates(step.nu))
    scalars = kernels.adam_scalars(count=step.count, b1=settings.b1, b2=settings.b2, eps=fused.eps)

    def moments() -> refresh_lib.NoiseMoments:
        # Only the steps that refresh the curvature read the moments outside the kernel.
        return observer.noise_moments(observer.adam_moments(step, grads, scalars), scalars)

    refreshed = observer.refresh(
        step,
        grads,
        signals_state,
        params,
        moments,
        settings=settings,
        config=config,
        step_scales=step_scale_lib.leaf_step_scales(fused.scale, config.bound),
    )
    # The step scale of each observed leaf (a vector over them in the state), None elsewhere.
    treedef: Any = jax.tree.structure(grads)  # a PyTreeDef: no stubs mypy can see
    flags = [bool(flag) for flag in treedef.flatten_up_to(step.active)]
    signals = treedef.unflatten(refresh_lib.per_leaf(refreshed[3].step_scale, flags))
    decays = _decayed_leaves(fused.mask, grads, step.like_updates)

    def leaf(path, active, g, mu, nu, param, step_scale, key, decays_leaf):
        if not active:
            # Not trained: the chain passes the update through and apply_updates adds it.
            new = optax.apply_updates(param, _times(g, learning_rate_factor))
            return _Leaf(mu, nu, new, new)
        fmt = None
        if compute_policy is not None:
            fmt = compute_policy.compute(tree_lib.path_string(path))
        compute_dtype = (
            param.dtype if fmt in (None, "fp8_e4m3") else policy_lib.float_format(fmt).dtype
        )
        out = fused_kernel.fused_update(
            g,
            mu,
            nu,
            param,
            step_scale,
            count=step.count,
            learning_rate=rate,
            b1=settings.b1,
            b2=settings.b2,
            eps=fused.eps,
            weight_decay=fused.weight_decay if decays_leaf else 0.0,
            compute_dtype=compute_dtype,
            key=key,
            impl=config.impl,
        )
        compute = out.compute
        if fmt == "fp8_e4m3":
            compute = policy_lib.cast_by_path(out.master, lambda _: "fp8_e4m3", impl=config.impl)
        return _Leaf(out.mu, out.nu, out.master, compute)

    leaves = jax.tree_util.tree_map_with_path(
        leaf,
        step.active,
        grads,
        step.mu,
        step.nu,
        step.like_updates(params),
        signals,
        step.keys,
        decays,
    )
    pick = lambda name: jax.tree.map(
        lambda x: getattr(x, name), leaves, is_leaf=lambda x: isinstance(x, _Leaf)
    )
    new_signals_state = observer.advanced(
        observer.AdamSignalsState, signals_state, step, refreshed, mu=pick("mu"), nu=pick("nu")
    )
    new_state = (
        new_signals_state,
        scale_state,
        masked_state._replace(inner_state=(decay_state, rate_state)),
    )
    return FusedApply(
        pick("params"), new_state, pick("compute") if compute_policy is not None else None
    )


class _Leaf(NamedTuple):
    mu: Any
    nu: Any
    params: Any
    compute: Any


def _decayed_leaves(mask: Any, grads: Any, like_updates: Any) -> Any:
    """Which leaves get weight decay: ``optax.masked`` evaluates a callable mask on the updates."""
    if mask is None:
        return jax.tree.map(lambda _: True, grads)
    tree = mask(grads) if callable(mask) else mask
    return jax.tree.map(bool, like_updates(tree))


def _times(update: Any, factor: Any) -> Any:
    if not jnp.issubdtype(jnp.result_type(update), jnp.floating):
        return update
    return (update * factor).astype(update.dtype)
