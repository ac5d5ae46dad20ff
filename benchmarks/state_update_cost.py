"""What ``quantize_state`` costs over AdamW: update time, compiled peak, compile seconds, a CNN step.

Every figure is a ratio to ``optax.adamw`` with its state in float32, measured in one run of
this script on this machine, and judged against its target ("met", else "MISSED"). It is a
report, not a test: it exits 0 whatever the figures, 1 only when one is not finite. Rows:

* **update**: the jitted update alone (``tx.update``, the state donated) on four 1024 x 1024
  float32 leaves, for ``quantize_state(adamw)`` with int8 and bf16 state, each rounding, and
  with int8_dynamic and int4 state, rounded to nearest. The
  variants take turns round-robin, each turn ``--steps`` updates and a block until ready; the
  ratio is the median over ``--rounds`` rounds of a turn's time over AdamW's turn in the same
  round (the per-update medians are printed beside it). Target <= 1.3x.
* **peak**: XLA's predicted peak of the same compiled update (temp + argument + output - alias
  bytes, :func:`triaccel_jax.precision.compiled_peak_bytes`). Target <= 1.0x fp32 AdamW's.
* **compile update**: lowering and compiling a fresh update step (``tx.update`` then
  ``optax.apply_updates``) on a transformer-shaped tree: 12 blocks of q/k/v/o d x d kernels and
  biases (d = 128), an MLP d -> 4d -> d and two layer norms (scale and bias), and a d x d
  readout, 193 leaves. **compile train step**: the same for the whole training step of
  benchmarks/compile_time.py's transformer on that tree (forward, gradient, update), as its
  compile table measures it. Best of ``--repeats`` compiles, taken round-robin. Target <= 1.5x.
* **cnn step**: the whole jitted training step (gradient of softmax cross-entropy, update,
  ``apply_updates``; params and state donated) of ``triaccel_jax.models.SmallCNN`` on a batch
  of 128 28 x 28 x 1 images, int8 state against float32 state, timed as the update rows are.
  Target <= 1.05x.

``--quick`` shrinks every size (4 leaves of 128 x 128, 1 block, a batch of 8, 2 rounds of 1
step) for a smoke test well under a minute; its figures mean little. Other scripts import :func:`rows`
(``benchmarks/compile_time.py`` prints them among its contributed rows).

``--cpu-time`` times the turns in the process's CPU seconds (all its threads) instead of wall
seconds: on a machine other jobs share, their load then disturbs the ratios far less.
``--sections`` measures only some of the rows.

Usage::

    python benchmarks/state_update_cost.py [--quick] [--rounds 9] [--steps 5] [--repeats 2]
        [--sections update peak compile cnn] [--cpu-time]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

import jax
import jax.numpy as jnp
import optax

import triaccel_jax

LEARNING_RATE = 1e-3
TARGETS = {"update": 1.3, "peak": 1.0, "compile": 1.5, "cnn step": 1.05}
NAME_WIDTH = 40

Factory = Callable[[], optax.GradientTransformation]


def adamw() -> optax.GradientTransformation:
    return optax.adamw(LEARNING_RATE)


def stored(fmt: str, rounding: str) -> Factory:
    """``quantize_state(adamw)`` with its state in ``fmt``, stored with ``rounding``."""
    return lambda: triaccel_jax.quantize_state(adamw(), format=fmt, rounding=rounding)


VARIANTS: dict[str, Factory] = {
    "int8/nearest": stored("int8", "nearest"),
    "int8/stochastic": stored("int8", "stochastic"),
    "bf16/nearest": stored("bf16", "nearest"),
    "bf16/stochastic": stored("bf16", "stochastic"),
    "int8_dynamic/nearest": stored("int8_dynamic", "nearest"),
    "int4/nearest": stored("int4", "nearest"),
}
CNN_VARIANTS = ("int8/nearest", "int8/stochastic")


class Row(NamedTuple):
    """One figure: ``name``'s ``ratio`` to its baseline, its ``target`` and a ``note``."""

    name: str
    ratio: float
    target: float
    note: str

    @property
    def verdict(self) -> str:
        return "met" if self.ratio <= self.target else "MISSED"

    def line(self) -> str:
        return (
            f"{self.name:<{NAME_WIDTH}} {self.ratio:>6.3f}x  target <= {self.target:.2f}x  "
            f"{self.verdict}  {self.note}".rstrip()
        )


def square_leaves(count: int, size: int) -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(0), count)
    return {f"w{i}": jax.random.normal(k, (size, size)) * 0.02 for i, k in enumerate(keys)}


def transformer_params(blocks: int, d: int = 128) -> dict[str, Any]:
    """The transformer-shaped tree: 16 leaves a block and a readout (193 at 12 blocks)."""

    def dense(n_in: int, n_out: int) -> dict[str, jax.Array]:
        return {"kernel": jnp.zeros((n_in, n_out)), "bias": jnp.zeros(n_out)}

    def norm() -> dict[str, jax.Array]:
        return {"scale": jnp.ones(d), "bias": jnp.zeros(d)}

    params: dict[str, Any] = {
        f"block{i}": {
            "ln1": norm(),
            "q": dense(d, d),
            "k": dense(d, d),
            "v": dense(d, d),
            "o": dense(d, d),
            "ln2": norm(),
            "mlp_in": dense(d, 4 * d),
            "mlp_out": dense(4 * d, d),
        }
        for i in range(blocks)
    }
    params["readout"] = jnp.zeros((d, d))
    return params


# The clock turns are timed with: wall-clock seconds, or (--cpu-time) this process's CPU
# seconds over all its threads, which other processes on a shared machine disturb far less.
CLOCK: Callable[[], float] = time.perf_counter


def interleaved(
    steps: dict[str, Callable[[], Any]], baseline: str, rounds: int
) -> dict[str, tuple[float, float]]:
    """``{name: (median ratio to the baseline's turn, median seconds a turn)}``.

    Each entry of ``steps`` runs one turn (several steps, blocked on) when called; the turns
    go round-robin, the first one rotating each round, after one warm-up turn each.
    """
    names = list(steps)
    for name in names:
        steps[name]()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = CLOCK()
            steps[name]()
            seconds[name].append(CLOCK() - start)
    return {
        name: (
            statistics.median(s / b for s, b in zip(seconds[name], seconds[baseline], strict=True)),
            statistics.median(seconds[name]),
        )
        for name in names
    }


def turns(step: Callable[..., tuple[Any, ...]], carry: list[Any], count: int) -> Callable[[], Any]:
    """A turn: ``count`` calls of ``step``, ``carry[0]`` threaded through (it is donated)."""

    def turn() -> None:
        for _ in range(count):
            carry[0] = step(carry[0])
        jax.block_until_ready(carry[0])

    return turn


def update_rows(leaves: int, size: int, rounds: int, steps: int) -> list[Row]:
    params = square_leaves(leaves, size)
    grads = jax.tree.map(lambda p: p * 0.1 + 1e-3, params)
    runs: dict[str, Callable[[], Any]] = {}
    for name, factory in {"adamw": adamw, **VARIANTS}.items():
        tx = factory()
        update = jax.jit(tx.update, donate_argnums=1)
        runs[name] = turns(
            lambda s, update=update: update(grads, s, params)[1], [tx.init(params)], steps
        )
    measured = interleaved(runs, "adamw", rounds)
    base = measured["adamw"][1] / steps * 1e3
    return [
        Row(
            f"update {name}",
            ratio,
            TARGETS["update"],
            f"{seconds / steps * 1e3:.2f} ms vs {base:.2f} ms ({leaves} x {size}^2)",
        )
        for name, (ratio, seconds) in measured.items()
        if name != "adamw"
    ]


def update_peak_bytes(tx: optax.GradientTransformation, params: Any) -> int:
    """XLA's predicted peak of ``tx``'s jitted update with the state donated."""
    abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    state = jax.eval_shape(tx.init, abstract)
    compiled = jax.jit(tx.update, donate_argnums=1).lower(abstract, state, abstract).compile()
    peak = triaccel_jax.precision.compiled_peak_bytes(compiled)
    if peak is None:
        raise RuntimeError(f"the {jax.default_backend()} backend gives no memory analysis")
    return peak


def peak_rows(leaves: int, size: int) -> list[Row]:
    params = square_leaves(leaves, size)
    base = update_peak_bytes(adamw(), params)
    rows = []
    for name, factory in VARIANTS.items():
        peak = update_peak_bytes(factory(), params)
        rows.append(
            Row(
                f"peak {name}",
                peak / base,
                TARGETS["peak"],
                f"{peak / 2**20:.2f} MiB vs {base / 2**20:.2f} MiB",
            )
        )
    return rows


def compile_seconds(factory: Factory, params: Any) -> float:
    """Seconds to lower and compile one fresh update step on ``params``."""
    tx = factory()
    state = tx.init(params)

    def step(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    start = time.perf_counter()
    jax.jit(step).lower(params, state, params).compile()
    return time.perf_counter() - start


def train_compile_seconds(factory: Factory, model: Any) -> float:
    """Seconds to lower and compile one fresh training step of compile_time.py's ``model``."""
    from compile_time import training_step

    tx = optax.with_extra_args_support(factory())
    state = tx.init(model.params)
    start = time.perf_counter()
    jax.jit(training_step(model, tx)).lower(model.params, state, model.batch).compile()
    return time.perf_counter() - start


def compile_rows(blocks: int, repeats: int) -> list[Row]:
    from compile_time import transformer

    params = transformer_params(blocks)
    model = transformer(blocks)
    factories = {"adamw": adamw, **VARIANTS}
    update = {name: math.inf for name in factories}
    step = {name: math.inf for name in factories}
    for _ in range(repeats):
        for name, factory in factories.items():
            update[name] = min(update[name], compile_seconds(factory, params))
            step[name] = min(step[name], train_compile_seconds(factory, model))
    leaves = len(jax.tree.leaves(params))
    rows = []
    for kind, best in (("compile update", update), ("compile train step", step)):
        rows += [
            Row(
                f"{kind} {name}",
                seconds / best["adamw"],
                TARGETS["compile"],
                f"{seconds:.2f} s vs {best['adamw']:.2f} s ({leaves} leaves)",
            )
            for name, seconds in best.items()
            if name != "adamw"
        ]
    return rows


def cnn_rows(batch: int, rounds: int, steps: int) -> list[Row]:
    from triaccel_jax.models import SmallCNN

    net = SmallCNN(num_classes=10)
    kx, ky, kp = jax.random.split(jax.random.key(2), 3)
    images = jax.random.normal(kx, (batch, 28, 28, 1))
    labels = jax.random.randint(ky, (batch,), 0, 10)

    def loss(params: Any) -> jax.Array:
        logits = net.apply({"params": params}, images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    runs: dict[str, Callable[[], Any]] = {}
    for name, factory in {"fp32": adamw, **{n: VARIANTS[n] for n in CNN_VARIANTS}}.items():
        tx = factory()

        def step(carry: tuple[Any, Any], tx: optax.GradientTransformation = tx) -> tuple[Any, Any]:
            params, state = carry
            updates, state = tx.update(jax.grad(loss)(params), state, params)
            return optax.apply_updates(params, updates), state

        params = net.init(kp, images)["params"]
        runs[name] = turns(jax.jit(step, donate_argnums=0), [(params, tx.init(params))], steps)
    measured = interleaved(runs, "fp32", rounds)
    base = measured["fp32"][1] / steps * 1e3
    return [
        Row(
            f"cnn step {name}",
            ratio,
            TARGETS["cnn step"],
            f"{seconds / steps * 1e3:.1f} ms vs {base:.1f} ms (SmallCNN, batch {batch})",
        )
        for name, (ratio, seconds) in measured.items()
        if name != "fp32"
    ]


class Sizes(NamedTuple):
    leaves: int
    size: int
    blocks: int
    batch: int
    rounds: int
    steps: int
    repeats: int


FULL = Sizes(leaves=4, size=1024, blocks=12, batch=128, rounds=9, steps=5, repeats=2)
QUICK = Sizes(leaves=4, size=128, blocks=1, batch=8, rounds=2, steps=1, repeats=1)


SECTIONS = ("update", "peak", "compile", "cnn")


def measure(sizes: Sizes, sections: tuple[str, ...] = SECTIONS) -> list[Row]:
    """The rows of ``sections`` (every one by default) at ``sizes``."""
    report = []
    if "update" in sections:
        report += update_rows(sizes.leaves, sizes.size, sizes.rounds, sizes.steps)
    if "peak" in sections:
        report += peak_rows(sizes.leaves, sizes.size)
    if "compile" in sections:
        report += compile_rows(sizes.blocks, sizes.repeats)
    if "cnn" in sections:
        report += cnn_rows(sizes.batch, sizes.rounds, sizes.steps)
    return report


def rows(quick: bool) -> list[tuple[str, float, float, str]]:
    """``(name, ratio, target, note)`` of every row ("met" when ratio <= target), for other
    scripts (benchmarks/compile_time.py's contributed rows)."""
    return [tuple(row) for row in measure(QUICK if quick else FULL)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    parser.add_argument("--rounds", type=int, help="timed rounds (update and cnn rows)")
    parser.add_argument("--steps", type=int, help="steps per timed turn")
    parser.add_argument("--repeats", type=int, help="compiles per compile row (the best counts)")
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="rows to measure"
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time turns in this process's CPU seconds (steadier on a shared machine)",
    )
    args = parser.parse_args(argv)
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    sizes = QUICK if args.quick else FULL
    sizes = sizes._replace(
        **{k: v for k, v in vars(args).items() if k in Sizes._fields and v is not None}
    )
    print(
        f"jax {jax.__version__}, optax {optax.__version__}, {jax.default_backend()}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; {sizes}"
        + ("; CPU time" if args.cpu_time else "")
    )
    report = measure(sizes, tuple(args.sections))
    for row in report:
        print(row.line())
    return 0 if all(math.isfinite(r.ratio) for r in report) else 1


if __name__ == "__main__":
    sys.exit(main())
