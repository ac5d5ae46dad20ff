"""``fused_apply``: a triaccel step that writes moments, master and compute copy in one pass.

An optax transform returns updates; ``optax.apply_updates`` then adds them to the params and the
forward pass casts the params to their compute dtype: three trips through memory per leaf beyond
the moments. :func:`fused_apply` does what ``tx.update`` followed by ``apply_updates`` (and
:func:`triaccel_jax.cast_params`) does, but for a transform made by
:func:`triaccel_jax.triaccel` it hands each leaf's moments, master write and compute copy to the
one-pass fused update (:func:`triaccel_jax.kernels.fused_update.fused_update`, docs/design.md §4,
§8): the Triton kernel on CUDA where ``impl`` (``TriAccelConfig.impl``) selects it, its pure-JAX
reference elsewhere. The curvature step, the signals and the optimizer state are those of the
optax update (the same code, :mod:`triaccel_jax.transforms._triaccel_step`).

Any other transform (a chain around ``triaccel``, ``optax.inject_hyperparams``, per-block step
scales) takes the unfused path, with the same results: fusion is an optimisation, never a change
of what is computed beyond the rounding and random bits listed in :func:`fused_apply`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from triaccel_jax import kernels
from triaccel_jax import policy as policy_lib
from triaccel_jax._src import tree as tree_lib
from triaccel_jax.kernels import fused_update as fused_kernel
from triaccel_jax.transforms import _triaccel_state as triaccel_state
from triaccel_jax.transforms._triaccel_step import TriAccelParts
from triaccel_jax.transforms._triaccel_step import next_state


class FusedSpec(NamedTuple):
    """The hyperparameters :func:`triaccel_jax.triaccel`'s fused form is built from.

    Attributes:
      direction: the :class:`TriAccelParts` of its ``scale_by_triaccel``.
      learning_rate: the learning rate, a number or an optax schedule.
      weight_decay: the decoupled weight-decay rate.
      mask: which leaves get weight decay (as ``optax.adamw``'s ``mask``), or None.
    """

    direction: TriAccelParts
    learning_rate: Any
    weight_decay: Any
    mask: Any


@dataclasses.dataclass(frozen=True, eq=False)
class TriAccelUpdate:
    """The ``update`` of a transform made by :func:`triaccel_jax.triaccel`.

    A callable with optax's update signature that runs ``unfused`` (the optax chain's update),
    and declares ``spec``: the same hyperparameters, from which :func:`fused_apply` builds the
    fused step. The transform stays a plain ``(init, update)`` pair; what the fused path needs is
    a declared, typed field of its update rather than something attached to a function. Compared
    and hashed by identity, as a function is (so a Flax train state can hold it as a static
    field).

    Attributes:
      spec: the :class:`FusedSpec`.
      unfused: ``(updates, state, params=None, **extra_args) -> (updates, state)``.
    """

    spec: FusedSpec
    unfused: Callable[..., tuple[Any, Any]]

    def __call__(
        self, updates: Any, state: Any, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Any]:
        return self.unfused(updates, state, params, **extra_args)


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


def _spec(tx: Any) -> FusedSpec | None:
    update = getattr(tx, "update", None)
    return update.spec if isinstance(update, TriAccelUpdate) else None


def unfused_reason(tx: Any, opt_state: Any = None) -> str | None:
    """Why ``tx`` (with ``opt_state``) cannot take the fused path; None when it can.

    Args:
      tx: an optax transform.
      opt_state: its state, to check the moments' dtypes; None skips that check.

    Returns:
      A sentence naming the reason, or None.

    Example:
      >>> import optax, triaccel_jax
      >>> from triaccel_jax.transforms import unfused_reason
      >>> unfused_reason(triaccel_jax.triaccel(1e-3)) is None
      True
      >>> unfused_reason(optax.adam(1e-3))
      'the transform was not made by triaccel_jax.triaccel (a chain or a wrapper around it is not fused)'
    """
    spec = _spec(tx)
    if spec is None:
        return (
            "the transform was not made by triaccel_jax.triaccel (a chain or a wrapper around "
            "it is not fused)"
        )
    if spec.direction.scale != "leaf":
        return "per-block step scales (TriAccelConfig(scale='block')) are not scalars per leaf"
    if opt_state is not None:
        for moments in (opt_state[0].mu, opt_state[0].nu):
            for leaf in jax.tree.leaves(moments):
                if jnp.dtype(leaf.dtype).name not in fused_kernel.MOMENT_DTYPES:
                    return (
                        f"the fused update stores moments in float32 or bfloat16, not {leaf.dtype}"
                    )
    return None


def uses_triton(tx: Any, opt_state: Any) -> bool:
    """Whether :func:`fused_apply` would run ``tx``'s update in the Triton kernel here.

    True only where the transform can be fused, the default backend is CUDA with jax_triton,
    and ``impl`` selects Triton for the moments' dtype (``"triton"``, or ``"auto"`` with the
    measured table ``kernels/auto_table.json`` saying so). The controller fuses its
    step by default exactly then.
    """
    if unfused_reason(tx, opt_state) is not None:
        return False
    spec = _spec(tx)
    assert spec is not None
    moments = {jnp.dtype(x.dtype).name for x in jax.tree.leaves(opt_state[0].mu)}
    op = kernels.fused_update_op("bfloat16" if "bfloat16" in moments else "float32")
    return kernels.resolve(spec.direction.impl, "fused update", op) == "triton"


def fused_apply(
    tx: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    *,
    learning_rate_factor: Any = 1.0,
    compute_policy: policy_lib.PrecisionPolicy | None = None,
    **extra_args: Any,
) -> FusedApply:
    """``tx.update`` and ``optax.apply_updates`` in one, fused per leaf for ``triaccel``.

    For a transform made by :func:`triaccel_jax.triaccel` (with per-leaf step scales and float32
    or bfloat16 moments), each trained leaf's new moments, new master and compute copy come from
    one call of the fused update, with the transform's ``TriAccelConfig.impl``: the Triton kernel
    on CUDA where it is selected, the pure-JAX reference elsewhere (XLA fuses that too). The
    optimizer state is the one ``tx.update`` would return. Three things differ from the unfused
    path, on purpose: the update stays float32 until it is added to the master (the optax chain
    rounds it to the gradient's dtype first), ``learning_rate_factor`` multiplies the learning
    rate rather than the finished update (an ulp apart), and bfloat16 moments and narrow masters
    are stochastically rounded with the kernel's own random bits. Any other transform runs
    ``tx.update`` and ``optax.apply_updates``.

    Args:
      tx: the optimizer.
      grads: the gradients, a tree like ``params``.
      opt_state: ``tx``'s state.
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

    Example:
      >>> import jax.numpy as jnp, optax, triaccel_jax
      >>> from triaccel_jax.transforms import fused_apply
      >>> params = {"w": jnp.ones(4)}
      >>> tx = triaccel_jax.triaccel(0.1)
      >>> state = tx.init(params)
      >>> policy = triaccel_jax.PrecisionPolicy.uniform(params, "bf16")
      >>> out = fused_apply(tx, {"w": jnp.full(4, 0.5)}, state, params, compute_policy=policy)
      >>> updates, _ = tx.update({"w": jnp.full(4, 0.5)}, state, params)
      >>> bool(jnp.allclose(out.params["w"], optax.apply_updates(params, updates)["w"]))
      True
      >>> out.compute["w"].dtype
      dtype(bfloat16)

    References:
      Tri-Accel, arXiv 2508.16905; Loshchilov & Hutter, 2019, "Decoupled Weight Decay
      Regularization".
    """
    if compute_policy is not None:
        policy_lib.check_policy(compute_policy)
        compute_policy.check_matches(params)
    spec = _spec(tx)
    if spec is not None:
        _check_state_of(opt_state)
    if spec is None or unfused_reason(tx, opt_state) is not None:
        updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
        updates = jax.tree.map(lambda u: _times(u, learning_rate_factor), updates)
        new_params = optax.apply_updates(params, updates)
        compute = None
        if compute_policy is not None:
            compute = policy_lib.cast_params(new_params, compute_policy, impl=_impl(spec))
        return FusedApply(new_params, opt_state, compute)
    return _fused(spec, grads, opt_state, params, learning_rate_factor, compute_policy, extra_args)


def _check_state_of(opt_state: Any) -> None:
    """Raises ``ValueError`` unless ``opt_state`` is shaped as a ``triaccel`` state (the
    direction's state, then the masked weight-decay and rate states), instead of failing inside
    the update on another optimizer's state. Any other transform's update checks its own."""
    if not (
        isinstance(opt_state, tuple)
        and len(opt_state) == 2
        and triaccel_state.is_triaccel_state(opt_state[0])
        and isinstance(opt_state[1], optax.MaskedState)
    ):
        kind = type(opt_state).__name__
        first = type(opt_state[0]).__name__ if isinstance(opt_state, tuple) and opt_state else "-"
        raise ValueError(
            "`opt_state` is not a state of `tx` (another optimizer's?): a triaccel optimizer's "
            f"state is (ScaleByTriAccelState, MaskedState), got a {kind} starting with {first}"
        )


def _impl(spec: FusedSpec | None) -> str:
    return "auto" if spec is None else spec.direction.impl


def _fused(
    spec: FusedSpec,
    grads: Any,
    opt_state: Any,
    params: Any,
    learning_rate_factor: Any,
    compute_policy: policy_lib.PrecisionPolicy | None,
    extra_args: dict[str, Any],
) -> FusedApply:
    parts = spec.direction
    direction_state, masked_state = opt_state
    decay_state, rate_state = masked_state.inner_state
    if callable(spec.learning_rate):
        # optax.scale_by_learning_rate(schedule): the rate at the count before the increment.
        rate = spec.learning_rate(rate_state.count)
        rate_state = rate_state._replace(count=optax.safe_increment(rate_state.count))
    else:
        rate = spec.learning_rate
    rate = jnp.asarray(rate, jnp.float32) * jnp.asarray(learning_rate_factor, jnp.float32)

    inputs = parts.prepare(
        grads,
        direction_state,
        loss_fn=extra_args.get("loss_fn"),
        obj_fn=extra_args.get("obj_fn"),
        value_fn=extra_args.get("value_fn"),
    )
    grad_leaves, treedef, active = inputs.grads, inputs.treedef, inputs.active

    def moments() -> tuple[dict[int, jax.Array], dict[int, jax.Array]]:
        # Only the steps that refresh the curvature read the moments outside the kernel.
        out = {
            i: kernels.adam_moments(grad_leaves[i], inputs.mu[i], inputs.nu[i], inputs.scalars)
            for i in active
        }
        return {i: m.m_hat for i, m in out.items()}, {i: m.v_hat for i, m in out.items()}

    curvature = parts.curvature_step(grads, direction_state, params, inputs, moments)
    with_paths = jax.tree_util.tree_flatten_with_path(params)[0]
    param_leaves = treedef.flatten_up_to(params)
    decays = _decayed_leaves(spec.mask, grads, treedef)
    new_params, compute = list(param_leaves), list(param_leaves)
    new_mu, new_nu = list(inputs.mu), list(inputs.nu)
    for i, param in enumerate(param_leaves):
        if i not in curvature.scales:
            # Not trained: the chain passes the update through and apply_updates adds it.
            update = _times(grad_leaves[i], learning_rate_factor)
            new_params[i] = compute[i] = optax.apply_updates(param, update)
            continue
        fmt = None
        if compute_policy is not None:
            fmt = compute_policy.compute(tree_lib.path_string(with_paths[i][0]))
        compute_dtype = (
            param.dtype if fmt in (None, "fp8_e4m3") else policy_lib.float_format(fmt).dtype
        )
        out = fused_kernel.fused_update(
            grad_leaves[i],
            inputs.mu[i],
            inputs.nu[i],
            param,
            curvature.scales[i],
            count=inputs.new_count,
            learning_rate=rate,
            b1=parts.b1,
            b2=parts.b2,
            eps=parts.eps,
            weight_decay=spec.weight_decay if decays[i] else 0.0,
            compute_dtype=compute_dtype,
            key=jax.random.fold_in(inputs.step_key, i),
            impl=parts.impl,
        )
        new_mu[i], new_nu[i], new_params[i], compute[i] = out
        if fmt == "fp8_e4m3":
            compute[i] = policy_lib.cast_by_path(out.master, lambda _: "fp8_e4m3", impl=parts.impl)
    new_direction_state = next_state(direction_state, inputs, curvature, new_mu, new_nu)
    new_state = (
        new_direction_state,
        masked_state._replace(inner_state=(decay_state, rate_state)),
    )
    return FusedApply(
        treedef.unflatten(new_params),
        new_state,
        treedef.unflatten(compute) if compute_policy is not None else None,
    )


def _decayed_leaves(mask: Any, grads: Any, treedef: Any) -> list[bool]:
    """Which leaves get weight decay: ``optax.masked`` evaluates a callable mask on the updates."""
    if mask is None:
        return [True] * treedef.num_leaves
    tree = mask(grads) if callable(mask) else mask
    return [bool(m) for m in treedef.flatten_up_to(tree)]


def _times(update: Any, factor: Any) -> Any:
    if not jnp.issubdtype(jnp.result_type(update), jnp.floating):
        return update
    return (update * factor).astype(update.dtype)
