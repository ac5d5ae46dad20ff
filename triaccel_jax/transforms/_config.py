"""``TriAccelConfig``: the options of ``triaccel`` that set shapes and programs, not numbers.

Kept apart from the numeric hyperparameters so that ``optax.inject_hyperparams`` (which traces
every number it is given) passes them through unchanged (docs/design.md §3).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from triaccel_jax import kernels
from triaccel_jax import policy as policy_lib
from triaccel_jax._src import validation

ESTIMATORS = ("fisher", "hutchinson")
STATE_DTYPES = ("float32", "bfloat16")
SCALES = ("leaf", "block")
BOUNDS = ("clip", "smooth")


def normalized_state_dtype(state_dtype: Any) -> Any:
    """None, a policy, or the name of an allowed moment dtype (hashable, and never callable)."""
    if state_dtype is None or isinstance(state_dtype, policy_lib.PrecisionPolicy):
        return state_dtype
    if isinstance(state_dtype, (jax.Array, np.ndarray, np.generic)):
        # jnp.dtype() of a number is the number's dtype: a value is not a dtype.
        raise ValueError(
            f"`state_dtype` must be a dtype (e.g. jnp.bfloat16), its name or a PrecisionPolicy, "
            f"got the number {state_dtype!r}"
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
      impl: how the moments' narrow writes are computed: ``"auto"`` (default: the Triton cast
        kernel only where CUDA runs it and ``kernels/auto_table.json`` measured it
        faster than XLA, else the pure-JAX reference), ``"reference"`` (always the reference;
        bit for bit what ``triaccel`` computed before this option) or ``"triton"`` (refused with a
        RuntimeError at the first update where Triton cannot run). See
        :func:`triaccel_jax.kernels.resolve`.
      scale: granularity of the curvature step scale: ``"leaf"`` (default: one scale per leaf,
        ``clip((kappa_ref / kappa_l) ** alpha)``) or ``"block"`` (one per block of the
        curvature store, ``clip((kappa_ref / kappa_b) ** alpha)`` from the block means it
        already holds, against the same median reference; see
        :mod:`triaccel_jax.transforms._step_scale`). The signals' ``step_scale`` stays the
        per-leaf scale either way.
      bound: how ``min_scale`` and ``max_scale`` hold the step scale: ``"clip"`` (default,
        Tri-Accel's hard clip, where a leaf far from the median curvature sits at a bound; the
        accuracy study's validation split did not confirm the smooth bound over it) or
        ``"smooth"`` (``log s = L tanh(alpha log(kappa_ref / kappa) / L)``, ``L`` the log of
        the bound on that side: the clip's slope at the median, strictly inside the bounds, and
        moving with the curvature everywhere).
      axis_name: under ``shard_map`` or ``pmap`` data parallelism, the mapped axis over which
        the curvature estimate is averaged (``lax.pmean``), so that every replica folds the same
        estimate and keeps the same state, as the gradients (averaged by the caller) do. None
        (default) for a single replica or a ``jit`` over sharded data, where the estimate is
        already the global one.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import triaccel_jax
      >>> config = triaccel_jax.TriAccelConfig(block_size=8, state_dtype=jnp.bfloat16)
      >>> tx = optax.inject_hyperparams(triaccel_jax.triaccel)(learning_rate=1e-3, config=config)
      >>> state = jax.jit(tx.init)({"w": jnp.ones(16)})
      >>> state.inner_state[0].curvature_by_leaf()["w"].block_means.shape, config.state_dtype
      ((2,), 'bfloat16')

    References:
      Tri-Accel, arXiv 2508.16905; optax.inject_hyperparams.
    """

    estimator: str = "fisher"
    block_size: int = 64
    rho: float = 0.01
    num_samples: int = 1
    state_dtype: Any = None
    impl: str = "auto"
    scale: str = "leaf"
    bound: str = "clip"
    axis_name: str | None = None

    def __post_init__(self) -> None:
        validation.check_choice("estimator", self.estimator, ESTIMATORS)
        validation.check_choice("scale", self.scale, SCALES)
        validation.check_choice("bound", self.bound, BOUNDS)
        validation.check_choice("impl", self.impl, kernels.IMPLS)
        validation.check_integer("block_size", self.block_size, 1)
        validation.check_in_range("rho", self.rho, 0.0, 1.0, low_inclusive=False)
        validation.check_integer("num_samples", self.num_samples, 1)
        if self.axis_name is not None and not isinstance(self.axis_name, str):
            raise ValueError(
                f"`axis_name` must be None or the name of a mapped axis, got {self.axis_name!r}"
            )
        # Plain Python values, so that equal configs hash equal (an array would not hash).
        for name, kind in (("block_size", int), ("rho", float), ("num_samples", int)):
            object.__setattr__(self, name, kind(np.asarray(getattr(self, name))))
        object.__setattr__(self, "state_dtype", normalized_state_dtype(self.state_dtype))


def resolve_config(config: TriAccelConfig | None) -> TriAccelConfig:
    """``config``, or the default config for None; a TypeError for anything else."""
    if config is None:
        return TriAccelConfig()
    if not isinstance(config, TriAccelConfig):
        raise TypeError(
            f"`config` must be a triaccel_jax.TriAccelConfig, got {type(config).__name__}"
        )
    return config


class CurvatureSettings(NamedTuple):
    """The numeric settings of the curvature signals, declared once.

    :func:`triaccel_jax.curvature_signals`, :func:`triaccel_jax.scale_by_triaccel`,
    :func:`triaccel_jax.triaccel` and :func:`triaccel_jax.scale_by_curvature` take these as
    keyword arguments (so that ``optax.inject_hyperparams`` can trace every number) and hand
    them on as this one record, checked once by :meth:`checked`. The step scale's own numbers
    are :class:`StepScaleSettings`, which the observer alone does not take.

    Attributes:
      b1: decay of the gradient's first-moment EMA, in [0, 1).
      b2: decay of the second-moment EMA, in [0, 1).
      curvature_every: steps between curvature estimates, >= 1.
      curvature_decay: EMA decay of the curvature estimates, in [0, 1).
      seed: seed of the stochastic rounding and of Hutchinson's probes.
    """

    b1: Any = 0.9
    b2: Any = 0.999
    curvature_every: Any = 10
    curvature_decay: Any = 0.95
    seed: Any = 0

    def checked(self) -> CurvatureSettings:
        """The settings, or a ValueError naming the first one out of range."""
        validation.check_in_range("b1", self.b1, 0.0, 1.0, high_inclusive=False)
        validation.check_in_range("b2", self.b2, 0.0, 1.0, high_inclusive=False)
        validation.check_integer("curvature_every", self.curvature_every, 1)
        validation.check_in_range(
            "curvature_decay", self.curvature_decay, 0.0, 1.0, high_inclusive=False
        )
        return self


class StepScaleSettings(NamedTuple):
    """The numeric settings of Tri-Accel's step scale (docs/design.md §3.4), declared once.

    Taken, beside :class:`CurvatureSettings`, by the transforms that scale the step
    (:func:`triaccel_jax.scale_by_triaccel`, :func:`triaccel_jax.triaccel`,
    :func:`triaccel_jax.scale_by_curvature`) as keyword arguments, and checked once by
    :meth:`checked`.

    Attributes:
      alpha: exponent of the step scale, >= 0.
      min_scale: lower bound of the step scale, > 0.
      max_scale: upper bound of the step scale, >= ``min_scale``.
    """

    alpha: Any = 0.5
    min_scale: Any = 0.5
    max_scale: Any = 2.0

    def checked(self) -> StepScaleSettings:
        """The settings, or a ValueError naming the first one out of range."""
        validation.check_in_range("alpha", self.alpha, 0.0, float("inf"))
        validation.check_in_range(
            "min_scale", self.min_scale, 0.0, float("inf"), low_inclusive=False
        )
        validation.check_in_range(
            "max_scale", self.max_scale, 0.0, float("inf"), low_inclusive=False
        )
        validation.check_not_above("min_scale", self.min_scale, "max_scale", self.max_scale)
        return self
