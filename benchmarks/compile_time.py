"""Compile time of the curvature transforms against the optax optimizer inside each.

Each row compiles one training step (loss, gradient, ``tx.update``, ``optax.apply_updates``) of the
same model with ``jax.jit(step).lower(...).compile()`` and reports the best of ``--repeats``
compiles (a fresh function each time, so nothing is reused from JAX's in-memory caches; the
persistent compilation cache is switched off for this process), split into tracing and lowering
(``lower``) and XLA's compile (``compile``), with the number of HLO instructions XLA compiled.
The ratios divide each row's total by the row of the optax optimizer it is built over, measured
in the same run:

* ``triaccel`` and ``curvature_signals`` + ``adamw`` over ``adamw``;
* ``scale_by_curvature(muon)`` over ``muon`` (optax.contrib's).

The model is six 256 x 256 tanh layers (the compile-time workload the adoption review used). This
is a report, not a test: it exits 0 whatever the figures, and 1 only when a figure is not finite.
Run it from the repository root::

    python benchmarks/compile_time.py            # best of 2 compiles per row
    python benchmarks/compile_time.py --quick    # two layers, one compile: a smoke test

The target: every ratio <= 1.5.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

import jax
import jax.numpy as jnp
import optax

import triaccel_jax

TARGET = 1.5
LEARNING_RATE = 1e-3


def rows() -> dict[str, tuple[Callable[[], optax.GradientTransformation], str | None]]:
    """``{name: (optimizer factory, the name of the row it is compared with)}``."""

    def muon() -> optax.GradientTransformation:
        return optax.contrib.muon(LEARNING_RATE, adam_learning_rate=LEARNING_RATE)

    return {
        "adamw": (lambda: optax.adamw(LEARNING_RATE), None),
        "triaccel": (lambda: triaccel_jax.triaccel(LEARNING_RATE), "adamw"),
        "curvature_signals + adamw": (
            lambda: optax.chain(triaccel_jax.curvature_signals(), optax.adamw(LEARNING_RATE)),
            "adamw",
        ),
        "muon": (muon, None),
        "scale_by_curvature(muon)": (lambda: triaccel_jax.scale_by_curvature(muon()), "muon"),
    }


def model(layers: int, width: int) -> tuple[dict[str, jax.Array], Callable, tuple]:
    keys = jax.random.split(jax.random.key(0), layers + 1)
    params = {
        f"layer{i}": {
            "kernel": jax.random.normal(keys[i], (width, width)) / math.sqrt(width),
            "bias": jnp.zeros(width),
        }
        for i in range(layers)
    }
    batch = (jax.random.normal(keys[-1], (64, width)), jnp.zeros((64, width)))

    def loss(p, batch):
        x, y = batch
        for i in range(layers):
            x = jnp.tanh(x @ p[f"layer{i}"]["kernel"] + p[f"layer{i}"]["bias"])
        return jnp.mean((x - y) ** 2)

    return params, loss, batch


class Timing(NamedTuple):
    """One compile of a training step: seconds to lower, seconds to compile, HLO instructions."""

    lower: float
    compile: float
    instructions: int

    @property
    def total(self) -> float:
        return self.lower + self.compile


def compile_seconds(
    tx_factory: Callable[[], optax.GradientTransformation], layers: int, width: int
) -> Timing:
    """Lowers and compiles one fresh training step."""
    params, loss, batch = model(layers, width)
    tx = optax.with_extra_args_support(tx_factory())
    opt_state = tx.init(params)

    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    start = time.perf_counter()
    lowered = jax.jit(step).lower(params, opt_state, batch)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    instructions = sum(" = " in line for line in compiled.as_text().splitlines())
    return Timing(lowered_at - start, done - lowered_at, instructions)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="compiles per row (the best counts)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="two layers, one compile")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.layers = 1, 2
    print(
        f"compile time: {args.layers} x {args.width}x{args.width} tanh layers, best of "
        f"{args.repeats}; jax {jax.__version__}, optax {optax.__version__}, "
        f"{jax.default_backend()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores"
    )
    table = rows()
    best: dict[str, Timing] = {}
    # Round-robin, so that a slow moment of the machine hits every row alike.
    for _ in range(args.repeats):
        for name, (factory, _) in table.items():
            timing = compile_seconds(factory, args.layers, args.width)
            if name not in best or timing.total < best[name].total:
                best[name] = timing
    finite = True
    print(
        f"{'transform':<28} {'lower s':>8} {'compile s':>10} {'total s':>8} {'HLO':>6} "
        f"{'ratio':>7}  against"
    )
    for name, (_, baseline) in table.items():
        timing = best[name]
        ratio = timing.total / best[baseline].total if baseline else 1.0
        finite &= math.isfinite(ratio)
        verdict = "" if baseline is None else ("met" if ratio <= TARGET else "MISSED")
        against = baseline or "(baseline)"
        print(
            f"{name:<28} {timing.lower:>8.2f} {timing.compile:>10.2f} {timing.total:>8.2f} "
            f"{timing.instructions:>6} {ratio:>6.2f}x  {against} {verdict}"
        )
    print(f"target: each ratio <= {TARGET}x (of the total: lower + compile)")
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
