"""Compile time and steady step of the curvature transforms against the optax optimizer inside each.

Every cost figure of the "at optax's price" issue, in one report. It is a report, not a test: it
exits 0 whatever the figures, and 1 only when a figure is not finite (or a contributed module
raised, so that its figures are missing). Run it from the repository root::

    python benchmarks/compile_time.py                    # every model, best of 2 compiles per row
    python benchmarks/compile_time.py --model transformer
    python benchmarks/compile_time.py --quick            # smallest sizes, one compile: a smoke test

**Compile tables** (one per model). Each row compiles one training step (loss, gradient,
``tx.update``, ``optax.apply_updates``) with ``jax.jit(step).lower(...).compile()`` and reports
the best of ``--repeats`` compiles, taken round-robin over the rows (a fresh function each time, so
nothing is reused from JAX's in-memory caches of the step; the persistent compilation cache is
switched off for this process), split into tracing and lowering (``lower``) and XLA's compile
(``compile``), with the number of instructions in the compiled HLO module (every ``=`` line, those
of fused computations included) and the number of fusion instructions in it. The models:

* ``mlp``: ``--layers`` x ``--width`` x ``--width`` tanh layers (6 x 256 x 256), batch 64;
* ``transformer``: ``--blocks`` pre-norm blocks (12) of d = 128, each with q/k/v/o kernels
  (d x d) and biases, an MLP d -> 4d -> d (kernels and biases) and two layer norms (scale and
  bias), and a d x d readout: 16 leaves a block plus one (193 at 12 blocks), few distinct shapes;
  a real forward (4-head attention over batch 8 x sequence 16, residuals, layer norms), MSE loss;
* ``cnn``: ``triaccel_jax.models.SmallCNN`` (Flax linen) on 28 x 28 x 1 images, batch 64,
  softmax cross-entropy: what a user's linen loop compiles.

The rows, each ratio dividing the row's total (lower + compile) by its baseline's, measured in the
same run:

* ``triaccel``, ``curvature_signals + adamw`` and ``quantize_state(adamw, int8)`` over ``adamw``;
* ``scale_by_curvature(muon)`` and the README's recommended chain
  (``optax.chain(curvature_signals(), muon)``, without ``inject_hyperparams``) over ``muon``:
  ``optax.contrib.muon`` with the README's settings and
  ``muon_weight_dimension_numbers=triaccel_jax.transforms.muon_dimension_numbers`` (so conv
  kernels are Muon's too).

Target: every compile ratio <= 1.5x ("met", else "MISSED"); "stretch" marks <= 1.2x.

**Steady-step table** (the ``mlp`` model, whatever ``--model``). The jitted training step of each
variant (params and optimizer state donated) is warmed up, then the variants take turns,
round-robin with the starting one rotating: each turn runs ``--steps`` consecutive steps and
blocks. A row's ratio is the median over the rounds of its turn's time over its baseline's turn
in the same round; the per-step medians are printed beside it. Targets:
``curvature_signals + adamw`` <= 1.02x ``adamw``; ``quantize_state(adamw, int8)`` <= 1.10x
(docs/results.md's step-time target for stored state).

**Contributed rows.** Other benchmark scripts add rows to the report by exposing one function::

    def rows(quick: bool) -> list[tuple[str, float, float, str]]:
        '''(name, ratio, target, note) per row: "met" when ratio <= target.'''

Each module named in ``CONTRIBUTORS`` (looked up beside this script, in ``benchmarks/``) is
imported when present and its ``rows(quick=args.quick)`` printed in a last table; a module that
is missing, or that lacks ``rows``, is skipped with a line saying so.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import pathlib
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

import jax
import jax.numpy as jnp
import optax

import triaccel_jax

TARGET = 1.5
STRETCH = 1.2
LEARNING_RATE = 1e-3
MODELS = ("mlp", "transformer", "cnn")
# Modules of benchmarks/ that contribute rows through ``rows(quick) -> [(name, ratio, target,
# note)]`` (see the module docstring).
CONTRIBUTORS = ("noise_cost", "state_update_cost")
NAME_WIDTH = 40

Factory = Callable[[], optax.GradientTransformation]


def muon() -> optax.GradientTransformation:
    """``optax.contrib.muon`` as the README's recommended configuration sets it."""
    return optax.contrib.muon(
        LEARNING_RATE,
        adam_learning_rate=0.1 * LEARNING_RATE,
        weight_decay=1e-4,
        adam_weight_decay=1e-4,
        muon_weight_dimension_numbers=triaccel_jax.transforms.muon_dimension_numbers,
    )


def adamw() -> optax.GradientTransformation:
    return optax.adamw(LEARNING_RATE)


def rows() -> dict[str, tuple[Factory, str | None]]:
    """``{name: (optimizer factory, the name of the row it is compared with)}``."""
    return {
        "adamw": (adamw, None),
        "triaccel": (lambda: triaccel_jax.triaccel(LEARNING_RATE), "adamw"),
        "curvature_signals + adamw": (
            lambda: optax.chain(triaccel_jax.curvature_signals(), adamw()),
            "adamw",
        ),
        "quantize_state(adamw, int8)": (
            lambda: triaccel_jax.quantize_state(adamw(), format="int8"),
            "adamw",
        ),
        "muon": (muon, None),
        "scale_by_curvature(muon)": (lambda: triaccel_jax.scale_by_curvature(muon()), "muon"),
        "curvature_signals + muon (recommended)": (
            lambda: optax.chain(triaccel_jax.curvature_signals(), muon()),
            "muon",
        ),
    }


def steady_rows() -> dict[str, tuple[Factory, str | None, float | None]]:
    """``{name: (optimizer factory, baseline row, target ratio)}`` of the steady-step table."""
    table = rows()
    return {
        "adamw": (adamw, None, None),
        "curvature_signals + adamw": (table["curvature_signals + adamw"][0], "adamw", 1.02),
        "quantize_state(adamw, int8)": (table["quantize_state(adamw, int8)"][0], "adamw", 1.10),
    }


class Model(NamedTuple):
    """A loss ``loss(params, batch)``, its params and batch, and a line describing them."""

    params: Any
    loss: Callable[[Any, Any], jax.Array]
    batch: Any
    description: str


def mlp(layers: int, width: int) -> Model:
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

    return Model(params, loss, batch, f"{layers} x {width}x{width} tanh layers, batch 64")


def _layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-6) * p["scale"] + p["bias"]


def transformer(blocks: int, d: int = 128, heads: int = 4, batch: int = 8, seq: int = 16) -> Model:
    keys = iter(jax.random.split(jax.random.key(1), 6 * blocks + 3))

    def dense(n_in: int, n_out: int) -> dict[str, jax.Array]:
        kernel = jax.random.normal(next(keys), (n_in, n_out)) / math.sqrt(n_in)
        return {"kernel": kernel, "bias": jnp.zeros(n_out)}

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
    params["readout"] = jax.random.normal(next(keys), (d, d)) / math.sqrt(d)
    data = (jax.random.normal(next(keys), (batch, seq, d)), jnp.zeros((batch, seq, d)))

    def apply(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return x @ p["kernel"] + p["bias"]

    def split(x: jax.Array) -> jax.Array:  # (b, s, d) -> (b, heads, s, d / heads)
        return x.reshape(batch, seq, heads, d // heads).transpose(0, 2, 1, 3)

    def loss(p, data):
        x, y = data
        for i in range(blocks):
            b = p[f"block{i}"]
            h = _layer_norm(x, b["ln1"])
            q, k, v = (split(apply(b[name], h)) for name in ("q", "k", "v"))
            weights = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // heads), axis=-1)
            attended = (weights @ v).transpose(0, 2, 1, 3).reshape(batch, seq, d)
            x = x + apply(b["o"], attended)
            h = _layer_norm(x, b["ln2"])
            x = x + apply(b["mlp_out"], jax.nn.gelu(apply(b["mlp_in"], h)))
        return jnp.mean((x @ p["readout"] - y) ** 2)

    leaves = len(jax.tree.leaves(params))
    return Model(
        params,
        loss,
        data,
        f"{blocks} blocks, d {d}, {heads} heads, batch {batch} x seq {seq}, {leaves} leaves",
    )


def cnn(batch: int = 64) -> Model:
    from triaccel_jax.models import SmallCNN

    net = SmallCNN(num_classes=10)
    kx, ky, kp = jax.random.split(jax.random.key(2), 3)
    images = jax.random.normal(kx, (batch, 28, 28, 1))
    labels = jax.random.randint(ky, (batch,), 0, 10)
    params = net.init(kp, images)["params"]

    def loss(p, data):
        x, y = data
        logits = net.apply({"params": p}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    leaves = len(jax.tree.leaves(params))
    return Model(
        params, loss, (images, labels), f"SmallCNN, 28x28x1, batch {batch}, {leaves} leaves"
    )


def build(name: str, args: argparse.Namespace) -> Model:
    if name == "mlp":
        return mlp(args.layers, args.width)
    if name == "transformer":
        return transformer(args.blocks)
    return cnn()


def training_step(model: Model, tx: optax.GradientTransformationExtraArgs) -> Callable:
    def step(params, opt_state, batch):
        grads = jax.grad(model.loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


class Timing(NamedTuple):
    """One compile of a training step: seconds to lower and to compile, HLO counts."""

    lower: float
    compile: float
    instructions: int
    fusions: int

    @property
    def total(self) -> float:
        return self.lower + self.compile


def compile_seconds(factory: Factory, model: Model) -> Timing:
    """Lowers and compiles one fresh training step."""
    tx = optax.with_extra_args_support(factory())
    opt_state = tx.init(model.params)
    step = training_step(model, tx)
    start = time.perf_counter()
    lowered = jax.jit(step).lower(model.params, opt_state, model.batch)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    instructions = fusions = 0
    for line in (compiled.as_text() or "").splitlines():
        if " = " in line:
            instructions += 1
            fusions += " fusion(" in line
    return Timing(lowered_at - start, done - lowered_at, instructions, fusions)


def verdict(ratio: float, target: float, stretch: float | None = None) -> str:
    if ratio > target:
        return "MISSED"
    return "met stretch" if stretch is not None and ratio <= stretch else "met"


def compile_table(name: str, args: argparse.Namespace) -> bool:
    """Prints one model's compile table; returns whether every figure is finite."""
    model = build(name, args)
    print(f"\nmodel {name}: {model.description}; compile, best of {args.repeats}")
    table = rows()
    best: dict[str, Timing] = {}
    failed: dict[str, str] = {}
    # Round-robin, so that a slow moment of the machine hits every row alike.
    for _ in range(args.repeats):
        for row, (factory, _) in table.items():
            if row in failed:
                continue
            try:
                timing = compile_seconds(factory, model)
            except Exception as error:  # a broken row is reported; the others still run
                failed[row] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
                continue
            if row not in best or timing.total < best[row].total:
                best[row] = timing
    print(
        f"{'transform':<{NAME_WIDTH}} {'lower s':>8} {'compile s':>10} {'total s':>8} "
        f"{'HLO':>6} {'fusions':>7} {'ratio':>7}  against"
    )
    finite = True
    for row, (_, baseline) in table.items():
        if row in failed or (baseline is not None and baseline in failed):
            print(f"{row:<{NAME_WIDTH}} FAILED  {failed.get(row) or f'{baseline} failed'}")
            finite = False
            continue
        timing = best[row]
        ratio = timing.total / best[baseline].total if baseline else 1.0
        finite &= all(map(math.isfinite, (timing.lower, timing.compile, ratio)))
        mark = "" if baseline is None else verdict(ratio, TARGET, STRETCH)
        print(
            f"{row:<{NAME_WIDTH}} {timing.lower:>8.2f} {timing.compile:>10.2f} "
            f"{timing.total:>8.2f} {timing.instructions:>6} {timing.fusions:>7} "
            f"{ratio:>6.2f}x  {baseline or '(baseline)'} {mark}".rstrip()
        )
    return finite


def steady_table(args: argparse.Namespace) -> bool:
    """Prints the steady-step table on the mlp model; returns whether every figure is finite."""
    model = mlp(args.layers, args.width)
    table = steady_rows()
    print(
        f"\nsteady step, model mlp: {model.description}; median of {args.rounds} interleaved "
        f"rounds of {args.steps} steps after warm-up"
    )
    steps: dict[str, Callable] = {}
    states: dict[str, tuple[Any, Any]] = {}
    for row, (factory, _, _) in table.items():
        tx = optax.with_extra_args_support(factory())
        params = jax.tree.map(jnp.copy, model.params)
        steps[row] = jax.jit(training_step(model, tx), donate_argnums=(0, 1))
        state = (params, tx.init(params))
        for _ in range(3):  # warm-up: compile, then a couple of steps
            state = steps[row](*state, model.batch)
        jax.block_until_ready(state)
        states[row] = state
    names = list(table)
    seconds: dict[str, list[float]] = {row: [] for row in names}
    for round_ in range(args.rounds):
        for row in names[round_ % len(names) :] + names[: round_ % len(names)]:
            state = states[row]
            start = time.perf_counter()
            for _ in range(args.steps):
                state = steps[row](*state, model.batch)
            jax.block_until_ready(state)
            seconds[row].append((time.perf_counter() - start) / args.steps)
            states[row] = state
    print(
        f"{'transform':<{NAME_WIDTH}} {'step ms':>8} {'base ms':>8} {'ratio':>7}  against (target)"
    )
    finite = True
    for row, (_, baseline, target) in table.items():
        own = statistics.median(seconds[row])
        if baseline is None or target is None:
            ratio, base, mark = 1.0, own, "(baseline)"
        else:
            ratio = statistics.median(
                a / b for a, b in zip(seconds[row], seconds[baseline], strict=True)
            )
            base = statistics.median(seconds[baseline])
            mark = f"{baseline} {verdict(ratio, target)} (<= {target:.2f}x)"
        finite &= math.isfinite(own) and math.isfinite(ratio)
        print(f"{row:<{NAME_WIDTH}} {1e3 * own:>8.3f} {1e3 * base:>8.3f} {ratio:>6.3f}x  {mark}")
    return finite


def contributed_table(quick: bool) -> bool:
    """Prints the rows of ``CONTRIBUTORS``; returns whether every figure is finite."""
    print("\ncontributed rows: rows(quick) of " + ", ".join(f"{m}.py" for m in CONTRIBUTORS))
    here = pathlib.Path(__file__).resolve().parent
    if str(here) not in sys.path:
        sys.path.insert(0, str(here))
    finite = True
    for module_name in CONTRIBUTORS:
        if not (here / f"{module_name}.py").is_file():
            print(f"{module_name}: skipped (no benchmarks/{module_name}.py)")
            continue
        try:
            module = importlib.import_module(module_name)
            contribute = getattr(module, "rows", None)
            if not callable(contribute):
                print(f"{module_name}: skipped (no rows(quick) function)")
                continue
            contributed = list(contribute(quick=quick))
        except Exception:  # a broken contributor is reported, and the others still run
            print(f"{module_name}: FAILED, its figures are missing")
            traceback.print_exc(file=sys.stdout)
            finite = False
            continue
        for name, ratio, target, note in contributed:
            finite &= math.isfinite(ratio) and math.isfinite(target)
            label = f"{module_name}: {name}"
            print(
                f"{label:<{NAME_WIDTH}} {ratio:>6.3f}x  target {target:.2f}x "
                f"{verdict(ratio, target)}  {note}".rstrip()
            )
    return finite


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=(*MODELS, "all"), default="all")
    parser.add_argument("--repeats", type=int, default=2, help="compiles per row (the best counts)")
    parser.add_argument("--layers", type=int, default=6, help="mlp layers")
    parser.add_argument("--width", type=int, default=256, help="mlp width")
    parser.add_argument("--blocks", type=int, default=12, help="transformer blocks")
    parser.add_argument("--rounds", type=int, default=15, help="steady-step rounds")
    parser.add_argument("--steps", type=int, default=20, help="steady steps per round and turn")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 layers, 2 blocks, one compile, 3 rounds of 5 steady steps: a smoke test",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.layers, args.blocks, args.rounds, args.steps = 1, 2, 2, 3, 5
    print(
        f"compile time and steady step at optax's price: jax {jax.__version__}, "
        f"optax {optax.__version__}, {jax.default_backend()}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"triaccel_jax from {pathlib.Path(triaccel_jax.__file__).parent}"
        + (" (--quick: figures mean little)" if args.quick else "")
    )
    finite = True
    for name in MODELS if args.model == "all" else (args.model,):
        finite &= compile_table(name, args)
    print(f"target: each ratio <= {TARGET}x (of the total: lower + compile); stretch <= {STRETCH}x")
    finite &= steady_table(args)
    finite &= contributed_table(args.quick)
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
