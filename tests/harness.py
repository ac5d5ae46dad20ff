"""The shared optimizer harness: every triaccel variant joins ``VARIANTS`` with one line.

The variants are ``triaccel`` itself under its options, and optax optimizers with the observer
``curvature_signals`` chained before them (whose signals the checks read the same way).

A variant is a name, a factory ``learning_rate -> GradientTransformationExtraArgs``, whether it
needs the loss as an extra argument, and under which of optax's names for it (``loss_fn``,
``obj_fn``, ``value_fn``) the harness passes it. ``tests/transforms/test_harness.py`` runs every
check on every variant, in the spirit of optax's common optimizer tests; the checks of a single
update run both jitted and eagerly (``chex.variants(with_jit=True, without_jit=True)``), each
variant named as in ``NAMED_VARIANTS``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest

import triaccel_jax


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    make: Callable[..., optax.GradientTransformationExtraArgs]
    needs_loss: bool = False
    loss_name: str = "loss_fn"
    # Why the variant needs JAX's standard dtype promotion (optax's own optimizers promote
    # inside, e.g. adam's bias correction raises a float to the int32 count), or None: strict.
    standard_promotion: str | None = None
    # The controller check's bar: the mean of the last 5 of 60 losses must fall under this
    # fraction of the first 5's.
    controller_loss_drop: float = 0.05

    @contextlib.contextmanager
    def promotion(self) -> Iterator[None]:
        """The variant's dtype promotion, for tests that cannot take a per-variant marker."""
        with jax.numpy_dtype_promotion("standard" if self.standard_promotion else "strict"):
            yield

    def param(self) -> Any:
        """The variant as a ``pytest.param``, marked ``standard_promotion`` where it needs it,
        and ``slow`` unless it is one of ``FAST_VARIANTS``."""
        marks = (
            [pytest.mark.standard_promotion(self.standard_promotion)]
            if self.standard_promotion
            else []
        )
        if self.name not in FAST_VARIANTS:
            marks.append(pytest.mark.slow)
        return pytest.param(self, marks=marks, id=self.name)

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


# The variants the fast tier (`bash tools/test.sh --fast`, `-m "not slow"`) runs every check on:
# triaccel itself, the observer beside an optax optimizer, stored 8-bit state and the step scale
# over Muon. The others are marked slow (they run in the full suite and CI).
FAST_VARIANTS = frozenset(
    {"fisher-fp32", "observer-adamw", "int8-state-adamw", "curvature-scaled-muon"}
)

_OPTAX_PROMOTES = "optax's own optimizer promotes inside (a float to the power of an int32 count)"

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
        "block-scale",
        lambda lr, **kw: triaccel_jax.triaccel(
            lr, curvature_every=1, config=triaccel_jax.TriAccelConfig(scale="block"), **kw
        ),
    ),
    Variant(
        "smooth-bound",
        lambda lr, **kw: triaccel_jax.triaccel(
            lr, config=triaccel_jax.TriAccelConfig(bound="smooth"), **kw
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
    # The observer beside other optimizers: the same signals, the optimizer's own steps.
    Variant(
        "observer-adamw",
        lambda lr, **kw: optax.chain(triaccel_jax.curvature_signals(), optax.adamw(lr, **kw)),
        standard_promotion=_OPTAX_PROMOTES,
    ),
    Variant(
        "observer-hutchinson-bf16-adamw",
        lambda lr, **kw: optax.chain(
            triaccel_jax.curvature_signals(
                config=triaccel_jax.TriAccelConfig(estimator="hutchinson", state_dtype="bfloat16")
            ),
            optax.adamw(lr, **kw),
        ),
        needs_loss=True,
        loss_name="obj_fn",
        standard_promotion=_OPTAX_PROMOTES,
    ),
    # Tri-Accel's step scale over another optimizer's whole step.
    Variant(
        "curvature-scaled-adamw",
        lambda lr, **kw: triaccel_jax.scale_by_curvature(optax.adamw(lr, **kw)),
        standard_promotion=_OPTAX_PROMOTES,
    ),
    Variant(
        "observer-muon",
        # Muon on the 2-D kernels, Adam (optax's own fallback) on the conv kernel and the biases.
        lambda lr, **kw: optax.chain(
            triaccel_jax.curvature_signals(curvature_every=1), optax.contrib.muon(lr, **kw)
        ),
        standard_promotion=_OPTAX_PROMOTES,
    ),
    # AdamW's moments in 8-bit blocks (small blocks and leaves, so the harness's leaves convert).
    Variant(
        "int8-state-adamw",
        lambda lr, **kw: optax.chain(
            triaccel_jax.curvature_signals(),
            triaccel_jax.quantize_state(optax.adamw(lr, **kw), block_size=8, min_size=16),
        ),
        standard_promotion=_OPTAX_PROMOTES,
    ),
    # The guide's recipe: Tri-Accel's step scale over Muon's step.
    Variant(
        "curvature-scaled-muon",
        lambda lr, **kw: triaccel_jax.scale_by_curvature(optax.contrib.muon(lr, **kw)),
        standard_promotion=_OPTAX_PROMOTES,
        # Muon's steps have a fixed norm whatever the gradient's size, so a leaf whose step is
        # scaled up settles higher: on the controller check's regression the bias's scale sits
        # at 2 and 60 steps take the loss from 12.0 to 1.27 (Muon alone: to 0.23).
        controller_loss_drop=0.15,
    ),
)

# ``absl.testing.parameterized.named_parameters`` arguments: one ``(name, variant)`` per variant.
NAMED_VARIANTS = tuple((variant.name.replace("-", "_"), variant) for variant in VARIANTS)
