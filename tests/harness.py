"""The shared optimizer harness: every triaccel variant joins ``VARIANTS`` with one line.

A variant is a name, a factory ``learning_rate -> GradientTransformationExtraArgs`` and whether
it needs the loss as the extra argument ``loss_fn``. ``tests/test_harness.py`` runs every check on
every variant, in the spirit of optax's common optimizer tests.
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

    def extra_args(self, loss_fn: Callable[[Any], Any]) -> dict[str, Any]:
        """The extra arguments of ``update`` for a loss of the params the transform sees."""
        return {"loss_fn": loss_fn} if self.needs_loss else {}

    def __str__(self) -> str:
        return self.name


VARIANTS = (
    Variant("fisher-fp32", lambda lr, **kw: triaccel_jax.triaccel(lr, **kw)),
    Variant(
        "fisher-bf16", lambda lr, **kw: triaccel_jax.triaccel(lr, state_dtype=jnp.bfloat16, **kw)
    ),
    Variant(
        "hutchinson-fp32",
        lambda lr, **kw: triaccel_jax.triaccel(lr, estimator="hutchinson", **kw),
        needs_loss=True,
    ),
    Variant(
        "hutchinson-bf16",
        lambda lr, **kw: triaccel_jax.triaccel(
            lr, estimator="hutchinson", state_dtype=jnp.bfloat16, **kw
        ),
        needs_loss=True,
    ),
    Variant(
        "fisher-every-step",
        lambda lr, **kw: triaccel_jax.triaccel(
            lr, curvature_every=1, config=triaccel_jax.TriAccelConfig(block_size=4), **kw
        ),
    ),
)
