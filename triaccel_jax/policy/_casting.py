"""Applying a precision policy: compute copies, masters, updates and optimizer-state conversion.

What a leaf's precision governs (docs/design.md §3): (a) the *compute copy* the forward and backward
passes see, cast by the cast kernel; (b) the dtype of its optimizer moments; (c) with the Flax
interceptor, the dtype of the module's inputs. Masters stay fp32 by default; ``master_dtype=
"policy"`` keeps each master in its compute dtype (bf16/fp16, never fp8) and writes updates with
stochastic rounding, which keeps small updates from vanishing (Zamirai et al., 2020, "Revisiting
BFloat16 Training").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from triaccel_jax import kernels
from triaccel_jax._src import tree as tree_lib
from triaccel_jax.kernels import cast as cast_kernel
from triaccel_jax.policy import _dtypes as dtypes
from triaccel_jax.policy import _policy as policy_core

MASTER_DTYPES = ("fp32", "policy")


def _leaf_keys(key: jax.Array | None, count: int) -> list[jax.Array | None]:
    if key is None:
        return [None] * count
    return [jax.random.fold_in(key, i) for i in range(count)]


def cast_params(
    params: Any,
    policy: policy_core.PrecisionPolicy,
    *,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    impl: str = "auto",
) -> Any:
    """The compute copy of ``params`` under ``policy``, cast through the cast kernel.

    Gradients flow through the cast (straight-through: the cotangent is cast back to the master's
    dtype), so ``jax.grad`` of a loss of the compute copy, taken with respect to the masters, gives
    gradients in the masters' dtype. fp8 leaves are rounded to float8_e4m3 with a per-leaf scale
    (``max |w| / 448``) and carried in bfloat16, since XLA has no general unscaled fp8 matmul:
    each carried value is an fp8 value times the scale, rounded to bfloat16, so it is not exactly
    fp8 times ``max |w| / 448``: the scale's rounding to bfloat16 (up to 2^-8, about 0.39%
    relative) and the product's make up to about 0.5% relative. Their storage is that of bf16.

    Args:
      params: the masters.
      policy: the precision policy; must cover the trainable leaves of ``params``.
      rounding: ``"nearest"`` or ``"stochastic"`` (needs ``key``).
      key: PRNG key for stochastic rounding (one stream per leaf is derived from it).
      impl: ``"auto"``, ``"reference"`` or ``"triton"``, passed to the kernel.

    Returns:
      A tree like ``params``; trainable leaves in their compute dtype, others unchanged.

    Example:
      >>> import jax.numpy as jnp
      >>> import triaccel_jax
      >>> params = {"w": jnp.ones((2, 2)), "step": jnp.array(3)}
      >>> policy = triaccel_jax.PrecisionPolicy.uniform(params, "bf16")
      >>> compute = triaccel_jax.cast_params(params, policy)
      >>> compute["w"].dtype, compute["step"].dtype
      (dtype(bfloat16), dtype('int32'))
    """
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs a PRNG `key`")
    policy_core.check_policy(policy)
    policy.check_matches(params)
    return cast_by_path(params, policy.compute, rounding=rounding, key=key, impl=impl)


def cast_by_path(
    params: Any,
    compute_format: Callable[[str], str],
    *,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    impl: str = "auto",
) -> Any:
    """The compute copy of ``params``, each trainable leaf cast to ``compute_format(path)``.

    The loop behind :func:`cast_params`, for callers whose policy paths differ from the tree's
    (the Flax interceptor's policy may be built on ``variables``, the tree is
    ``variables["params"]``). The leaf keys are derived as :func:`cast_params` derives them.

    Args:
      params: the masters.
      compute_format: maps a leaf's ``"a/b/kernel"`` path to its format name (``"bf16"``, ...).
      rounding: ``"nearest"`` or ``"stochastic"`` (needs ``key``).
      key: PRNG key for stochastic rounding.
      impl: passed to the cast kernel.

    Returns:
      A tree like ``params``; trainable leaves in their compute dtype, others unchanged.
    """
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs a PRNG `key`")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = _leaf_keys(key, len(leaves))
    out = []
    for (path, leaf), leaf_key in zip(leaves, keys, strict=True):
        if not tree_lib.is_trainable(leaf):
            out.append(leaf)
            continue
        name = compute_format(tree_lib.path_string(path))
        out.append(_cast_leaf(leaf, name, rounding, leaf_key, impl))
    return jax.tree.unflatten(treedef, out)


def _cast_leaf(leaf, name, rounding, key, impl):
    fmt = dtypes.FORMATS[name]
    if leaf.dtype == fmt.dtype:
        return leaf
    if name != "fp8_e4m3":
        return cast_kernel.cast(leaf, fmt.dtype, rounding=rounding, key=key, impl=impl)
    scale = cast_kernel.fp8_scale(leaf)
    rounded = cast_kernel.cast(leaf, fmt.dtype, rounding=rounding, key=key, scale=scale, impl=impl)
    carrier = dtypes.carrier_dtype(name)
    return rounded.astype(carrier) * scale.astype(carrier)


def master_params(
    params: Any, policy: policy_core.PrecisionPolicy, master_dtype: str = "fp32"
) -> Any:
    """The masters to train: fp32 (default) or, with ``"policy"``, each leaf's compute dtype.

    Policy masters are never fp8 (an 8-bit master cannot accumulate updates): fp8 leaves keep a
    bf16 master. Non-trainable leaves are returned unchanged.

    Example:
      >>> import jax.numpy as jnp
      >>> import triaccel_jax
      >>> params = {"w": jnp.ones(3)}
      >>> policy = triaccel_jax.PrecisionPolicy.uniform(params, "bf16")
      >>> triaccel_jax.master_params(params, policy, "policy")["w"].dtype
      dtype(bfloat16)
    """
    if master_dtype not in MASTER_DTYPES:
        raise ValueError(f"`master_dtype` must be one of {MASTER_DTYPES}, got {master_dtype!r}")
    policy_core.check_policy(policy)
    policy.check_matches(params)

    def master(path, leaf):
        if not tree_lib.is_trainable(leaf):
            return leaf
        if master_dtype == "fp32":
            return leaf.astype(jnp.float32)
        name = policy.compute(tree_lib.path_string(path))
        return leaf.astype(dtypes.carrier_dtype(name))

    return jax.tree_util.tree_map_with_path(master, params)


def stochastic_apply_updates(
    params: Any, updates: Any, *, key: jax.Array | None = None, impl: str = "auto"
) -> Any:
    """``params + updates``, computed in fp32 and written back in each parameter's dtype.

    Unlike ``optax.apply_updates``, a parameter narrower than fp32 (a bf16/fp16 master) is
    written with stochastic rounding when ``key`` is given, so updates below half an ulp still
    move it on average; with ``key=None`` it is rounded to nearest. Leaves whose update is
    ``None`` or that are not trainable are kept.

    Args:
      params: the masters.
      updates: a tree like ``params`` (``None`` leaves keep their parameter).
      key: PRNG key for stochastic rounding of narrow masters (one stream per leaf).
      impl: how the stochastically rounded writes are computed, passed to the cast kernel:
        ``"auto"`` (Triton only where CUDA runs it and ``kernels/auto_table.json``
        measured it faster than XLA), ``"reference"`` or ``"triton"`` (a RuntimeError where Triton cannot
        run).

    Returns:
      The new parameters, each in its old dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import triaccel_jax
      >>> params = {"w": jnp.ones(10_000, jnp.bfloat16)}
      >>> updates = {"w": jnp.full(10_000, 1e-3)}
      >>> nearest = triaccel_jax.stochastic_apply_updates(params, updates)
      >>> stochastic = triaccel_jax.stochastic_apply_updates(params, updates, key=jax.random.key(0))
      >>> float(nearest["w"].astype(jnp.float32).mean())  # 1e-3 is below half a bf16 ulp at 1
      1.0
      >>> abs(float(stochastic["w"].astype(jnp.float32).mean()) - 1.001) < 2e-4
      True
    """
    # Refused up front (not only where a narrow master needs the kernel), as the optimizer does.
    kernels.resolve(impl, "master write")
    treedef: Any  # a jaxlib PyTreeDef, which has no stubs mypy can see
    leaves, treedef = jax.tree.flatten(params)
    try:
        update_leaves = treedef.flatten_up_to(updates)
    except (ValueError, TypeError) as error:
        raise ValueError(f"`updates` do not have the tree structure of `params`: {error}") from None
    keys = _leaf_keys(key, len(leaves))
    out = []
    for param, update, leaf_key in zip(leaves, update_leaves, keys, strict=True):
        if update is None:
            out.append(param)
            continue
        if not tree_lib.is_trainable(param):
            out.append(jnp.asarray(param + update).astype(param.dtype))
            continue
        total = param.astype(jnp.float32) + update.astype(jnp.float32)
        if jnp.finfo(param.dtype).bits < 32 and leaf_key is not None:
            out.append(
                cast_kernel.cast(total, param.dtype, rounding="stochastic", key=leaf_key, impl=impl)
            )
        else:
            out.append(total.astype(param.dtype))
    return jax.tree.unflatten(treedef, out)
