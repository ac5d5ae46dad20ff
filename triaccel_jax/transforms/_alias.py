"""``triaccel``: the full optimizer, a chain of ``scale_by_*`` pieces (optax's alias style)."""

from __future__ import annotations

from typing import Any

import jax
import optax

from triaccel_jax._src import tree as tree_lib
from triaccel_jax._src import validation
from triaccel_jax.transforms import _config as config_lib
from triaccel_jax.transforms import _fused_apply as fused_lib
from triaccel_jax.transforms import _scale_by_triaccel as transform


def triaccel(
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: Any = None,
    config: config_lib.TriAccelConfig | None = None,
    curvature_every: int = 10,
    curvature_decay: float = 0.95,
    alpha: float = 0.5,
    min_scale: float = 0.5,
    max_scale: float = 2.0,
    seed: int = 0,
    axis_name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """The Tri-Accel optimizer: AdamW with a per-leaf, curvature-derived step-size scale.

    ``chain(scale_by_triaccel(...), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate))``, so the step of leaf ``l`` is
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
      axis_name: the ``shard_map``/``pmap`` axis over which replicas average their curvature
        estimates (see :func:`triaccel_jax.scale_by_triaccel`); None for one replica or ``jit``.

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
      >>> for _ in range(200):
      ...     updates, state = tx.update(jax.grad(loss)(params), state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> bool(loss(params) < 1e-2)
      True

    References:
      Tri-Accel, arXiv 2508.16905; Loshchilov & Hutter, 2019, "Decoupled Weight Decay
      Regularization".
    """
    validation.check_learning_rate(learning_rate)
    validation.check_in_range("weight_decay", weight_decay, 0.0, float("inf"))
    config = config_lib.resolve_config(config)
    direction, parts = transform.build_scale_by_triaccel(
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
    # Weight decay and the learning rate would turn integer leaves into floats; the mask keeps
    # them untouched, as scale_by_triaccel does.
    step = optax.chain(
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
    tx = _in_gradient_dtype(optax.chain(direction, _masked_to_trainable(step)))
    # fused_apply writes this optimizer's step in one pass per leaf from the same pieces.
    spec = fused_lib.FusedSpec(
        direction=parts, learning_rate=learning_rate, weight_decay=weight_decay, mask=mask
    )
    return optax.GradientTransformationExtraArgs(
        tx.init, fused_lib.TriAccelUpdate(spec=spec, unfused=tx.update)
    )


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
