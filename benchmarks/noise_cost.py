"""What ``value_and_grad_with_noise`` costs over ``jax.value_and_grad`` in a user's own loop.

The loop is a Flax linen ``triaccel_jax.models.SmallCNN`` (two 3 x 3 conv blocks of 32 and 64
channels, a dense layer of 128, ten classes) on a batch of 128 random 28 x 28 x 1 images, and
its jitted training step: the mean softmax cross-entropy's value and gradient, ``optax.adamw``'s
update and ``optax.apply_updates``, with params and optimizer state donated and the batch an
argument, as a hand-written loop has it. The two steps differ only in the gradient call:
``jax.value_and_grad(loss)`` (the baseline) or ``value_and_grad_with_noise(loss)`` (the same
gradient from two half batches, with the noise scale's two squared norms). It is a report, not a
test: it exits 0 whatever the figures, 1 only when one is not finite. Rows, each a ratio to the
baseline judged against its target ("met", else "MISSED"):

* **step**: each step is compiled and warmed up, then the two take turns, round-robin with the
  first one rotating, each turn ``--steps`` consecutive steps and a block until ready. The
  ratio is the median over ``--rounds`` rounds of a turn's time over the baseline's turn in the
  same round; the per-step medians are printed beside it. Target <= 1.05x.
* **peak**: XLA's predicted peak of each compiled step (temp + argument + output - alias bytes,
  :func:`triaccel_jax.precision.compiled_peak_bytes`). Target <= 1.0x.

``--loop`` adds a reference step row for the halves differentiated in a ``lax.scan`` (not
unrolled), as ``value_and_grad_with_noise`` did before: XLA:CPU runs a convolution's gradient in
a loop body an order of magnitude slower. ``--quick`` shrinks the batch to 16 and runs 2 rounds
of 1 step: a smoke test of a few seconds whose figures mean little. ``--cpu-time`` times the
turns in the process's CPU seconds (all its threads) instead of wall seconds, which other jobs
on a shared machine disturb less. Other scripts import :func:`rows` (``benchmarks/compile_time.py``
prints them among its contributed rows) or :func:`measure`.

Usage, from the repository root::

    python benchmarks/noise_cost.py [--quick] [--batch 128] [--rounds 15] [--steps 5] [--loop]
        [--cpu-time]
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

from triaccel_jax.models import SmallCNN
from triaccel_jax.precision import compiled_peak_bytes
from triaccel_jax.training import value_and_grad_with_noise

TARGETS = {"step": 1.05, "peak": 1.0}
BASELINE = "jax.value_and_grad"
NOISE = "value_and_grad_with_noise"
LOOP = "lax.scan over the halves"
NAME_WIDTH = 40


class Sizes(NamedTuple):
    batch: int
    rounds: int
    steps: int


FULL = Sizes(batch=128, rounds=15, steps=5)
QUICK = Sizes(batch=16, rounds=2, steps=1)


class Row(NamedTuple):
    """One figure: ``name``'s ``ratio`` to the baseline, its ``target`` and a ``note``."""

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


# Turns are timed with wall-clock seconds, or (--cpu-time) this process's CPU seconds over all
# its threads.
CLOCK: Callable[[], float] = time.perf_counter


def scan_halves(fun: Callable[..., Any]) -> Callable[..., tuple[Any, Any, dict[str, Any]]]:
    """The halves in a ``lax.scan`` that is not unrolled: the reference ``--loop`` row."""
    grad_fn = jax.value_and_grad(fun)

    def sq_norm(tree: Any) -> jax.Array:
        return sum((jnp.sum(jnp.square(g)) for g in jax.tree.leaves(tree)), jnp.float32(0))

    def wrapped(params: Any, batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        halves = jax.tree.map(lambda x: x.reshape(2, x.shape[0] // 2, *x.shape[1:]), batch)

        def body(total: Any, half: Any) -> tuple[Any, Any]:
            value, grads = grad_fn(params, half)
            return jax.tree.map(jnp.add, total, grads), (value, sq_norm(grads))

        zeros = jax.tree.map(jnp.zeros_like, params)
        total, (values, norms) = jax.lax.scan(body, zeros, halves)
        grads = jax.tree.map(lambda g: g / 2, total)
        return (
            jnp.mean(values),
            grads,
            {"grad_sq_norm": sq_norm(grads), "micro_grad_sq_norm": jnp.mean(norms)},
        )

    return wrapped


def training_steps(batch: int, loop: bool) -> tuple[dict[str, Callable[..., Any]], Any, Any]:
    """``({name: jitted step}, (params, opt_state), batch)`` of the SmallCNN loop."""
    net = SmallCNN(num_classes=10)
    kx, ky, kp = jax.random.split(jax.random.key(0), 3)
    data = (
        jax.random.normal(kx, (batch, 28, 28, 1)),
        jax.random.randint(ky, (batch,), 0, 10),
    )
    params = net.init(kp, data[0][:1])["params"]
    tx = optax.adamw(1e-3)

    def loss(params: Any, batch: Any) -> jax.Array:
        images, labels = batch
        logits = net.apply({"params": params}, images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def plain(params: Any, batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        value, grads = jax.value_and_grad(loss)(params, batch)
        return value, grads, {}

    grads_of: dict[str, Callable[..., Any]] = {
        BASELINE: plain,
        NOISE: value_and_grad_with_noise(loss),
    }
    if loop:
        grads_of[LOOP] = scan_halves(loss)

    def step_of(grad_fn: Callable[..., Any]) -> Callable[..., Any]:
        def step(carry: tuple[Any, Any], batch: Any) -> tuple[tuple[Any, Any], Any]:
            params, opt_state = carry
            value, grads, norms = grad_fn(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), (value, norms)

        return jax.jit(step, donate_argnums=0)

    steps = {name: step_of(grad_fn) for name, grad_fn in grads_of.items()}
    return steps, (params, tx.init(params)), data


def peak_bytes(step: Any, state: Any, data: Any) -> int:
    """XLA's predicted peak of the jitted ``step`` compiled for ``state`` and ``data``."""
    peak = compiled_peak_bytes(step.lower(state, data).compile())
    if peak is None:
        raise RuntimeError(f"the {jax.default_backend()} backend gives no memory analysis")
    return peak


def interleaved(turns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, tuple[float, float]]:
    """``{name: (median ratio to the baseline's turn, median seconds a turn)}``, after one
    warm-up turn each; the turns go round-robin, the first one rotating each round."""
    names = list(turns)
    for name in names:
        turns[name]()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = CLOCK()
            turns[name]()
            seconds[name].append(CLOCK() - start)
    base = seconds[BASELINE]
    return {
        name: (
            statistics.median(s / b for s, b in zip(times, base, strict=True)),
            statistics.median(times),
        )
        for name, times in seconds.items()
    }


def measure(sizes: Sizes = FULL, loop: bool = False) -> list[Row]:
    """The step and peak rows at ``sizes`` (with ``loop``, the scan's reference row too)."""
    steps, state, data = training_steps(sizes.batch, loop)
    turns: dict[str, Callable[[], Any]] = {}
    for name, step in steps.items():
        # Each step donates its own copy of the params and optimizer state.
        carry = [jax.tree.map(jnp.copy, state)]

        def turn(step: Callable[..., Any] = step, carry: list[Any] = carry) -> None:
            for _ in range(sizes.steps):
                carry[0], out = step(carry[0], data)
            jax.block_until_ready((carry[0], out))

        turns[name] = turn
    measured = interleaved(turns, sizes.rounds)
    per_step = {name: seconds / sizes.steps * 1e3 for name, (_, seconds) in measured.items()}
    where = f"SmallCNN, batch {sizes.batch}, adamw"
    report = [
        Row(
            f"step {name}",
            ratio,
            TARGETS["step"],
            f"{per_step[name]:.2f} ms vs {per_step[BASELINE]:.2f} ms a step ({where})",
        )
        for name, (ratio, _) in measured.items()
        if name != BASELINE
    ]
    peaks = {name: peak_bytes(steps[name], state, data) for name in (BASELINE, NOISE)}
    report.append(
        Row(
            f"peak {NOISE}",
            peaks[NOISE] / peaks[BASELINE],
            TARGETS["peak"],
            f"{peaks[NOISE] / 2**20:.2f} MiB vs {peaks[BASELINE] / 2**20:.2f} MiB ({where})",
        )
    )
    return report


def rows(quick: bool) -> list[tuple[str, float, float, str]]:
    """``(name, ratio, target, note)`` of every row ("met" when ratio <= target), for other
    scripts (benchmarks/compile_time.py's contributed rows)."""
    return [(r.name, r.ratio, r.target, r.note) for r in measure(QUICK if quick else FULL)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 16, 2 rounds of 1 step")
    parser.add_argument("--batch", type=int, help="images a step (even)")
    parser.add_argument("--rounds", type=int, help="timed rounds")
    parser.add_argument("--steps", type=int, help="steps per timed turn")
    parser.add_argument("--loop", action="store_true", help="add the lax.scan reference row")
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
        + (" (--quick: figures mean little)" if args.quick else "")
    )
    report = measure(sizes, loop=args.loop)
    for row in report:
        print(row.line())
    return 0 if all(math.isfinite(row.ratio) for row in report) else 1


if __name__ == "__main__":
    sys.exit(main())
