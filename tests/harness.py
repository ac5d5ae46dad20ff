"""The shared optimizer harness: every triaccel variant joins ``VARIANTS`` with one line.

A variant is a name, a factory ``learning_rate -> GradientTransformationExtraArgs``, whether it
needs the loss as an extra argument, and under which of optax's names for it (``loss_fn``,
``obj_fn``, ``value_fn``) the harness passes it. ``tests/transforms/test_harness.py`` runs every
check on every variant, in the spirit of optax's common optimizer tests; the checks of a single
update run both jitted and eagerly (``chex.variants(with_jit=True, without_jit=True)``), each
variant named as in ``NAMED_VARIANTS``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import optax

import triaccel_jax


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    make: Callable[..., optax.GradientTransformationExtraArgs]
    needs_loss: bool = False
    loss_name: str = "loss_fn"

    def extra_args(self, loss_fn: Callable[[Any], Any]) -> dict[str, Any]:
        """The extra arguments of ``update`` for a loss of the params the transform sees."""
        return {self.loss_name: loss_fn} if self.needs_loss else {}

    def update_fn(
        self, tx: optax.GradientTransformationExtraArgs, loss_fn: Callable[[Any], Any]
    ) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
        """``(grads, state, params) -> (updates, state)``, ready for chex's ``self.variant``."""
        return lambda grads, state, params: tx.update(
            grads, state, params, **self.extra_args(loss_fn)
        )

    def __str__(self) -> str:
        return self.name


VARIANTS = (
    Variant("fisher-fp32", lambda lr, **kw: triaccel_jax.triaccel(lr, **kw)),
    Variant(
        "fisher-bf16",
        lambda lr, **kw: triaccel_jax.triaccel(
            lr, config=triaccel_jax.TriAccelConfig(state_dtype=jnp.bfloat16), **kw
        ),
    ),
    Variant(
        "hutchinson-fp32",
        lambda lr, **kw: triaccel_jax.triaccel(
            lr, config=triaccel_jax.TriAccelConfig(estimator="hutchinson"), **kw
        ),
        needs_loss=True,
    ),
    Variant(
        "hutchinson-bf16",
        lambda lr, **kw: triaccel_jax.triaccel(
            lr,
            config=triaccel_jax.TriAccelConfig(estimator="hutchinson", state_dtype=jnp.bfloat16),
            **kw,
        ),
        needs_loss=True,
    ),
    Variant(
        "fisher-every-step",
        lambda lr, **kw: triaccel_jax.triaccel(
            lr, curvature_every=1, config=triaccel_jax.TriAccelConfig(block_size=4), **kw
        ),
    ),
    Variant(
        "hutchinson-value_fn",
        lambda lr, **kw: triaccel_jax.triaccel(
            lr, config=triaccel_jax.TriAccelConfig(estimator="hutchinson", num_samples=2), **kw
        ),
        needs_loss=True,
        loss_name="value_fn",
    ),
    Variant(
        "injected",
        # Every numeric hyperparameter injected (so traced inside jit), the layout in the config;
        # float32 hyperparameters, as b2 = 0.999 rounds to 1 in the bfloat16 of bf16 params.
        lambda lr, **kw: optax.inject_hyperparams(
            triaccel_jax.triaccel, hyperparam_dtype=jnp.float32
        )(lr, config=triaccel_jax.TriAccelConfig(block_size=16, rho=0.1), **kw),
    ),
)

# ``absl.testing.parameterized.named_parameters`` arguments: one ``(name, variant)`` per variant.
NAMED_VARIANTS = tuple((variant.name.replace("-", "_"), variant) for variant in VARIANTS)
