"""Overhead of triaccel against AdamW and Sophia-H: step time, update time and state bytes.

For each model, one jitted training step (forward, backward, optimizer update; the training
state is donated) is timed under each optimizer on the same fixed batch. The optimizers are
interleaved round-robin, so that slow drifts of the machine (other processes, thermal limits)
hit them all alike, and each round runs ``--steps-per-round`` consecutive steps, so that the
curvature estimate that triaccel and Sophia compute every 10 steps is amortised the same way in
every round. The optimizer update alone (``tx.update`` and ``optax.apply_updates`` on fixed
gradients) is timed the same way. Optimizer-state bytes come from the shapes of ``tx.init``.

This is a report, not a test: it exits 0 whatever the figures, and 1 only when a figure is not
finite. Run it from the repository root::

    python benchmarks/overhead.py            # both models, 30 rounds of 10 steps
    python benchmarks/overhead.py --quick    # a smoke test; its figures mean little

See ``benchmarks/README.md`` for what each figure means.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import triaccel_jax
from triaccel_jax.models import ResNet20
from triaccel_jax.models import SmallCNN

LEARNING_RATE = 1e-3
BASELINE = "adamw"

# Targets for triaccel relative to fp32 AdamW.
MAX_STEP_RATIO = 1.10
MAX_STATE_RATIO_FP32 = 1.15
MAX_STATE_RATIO_BF16 = 0.60


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model under test and the shape of one image (HWC)."""

    make: Callable[[], nn.Module]
    image_shape: tuple[int, int, int]
    num_classes: int = 10


MODELS = {
    "small_cnn": ModelSpec(SmallCNN, (28, 28, 1)),
    "resnet20": ModelSpec(ResNet20, (32, 32, 3)),
}


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer, whether ``update`` needs ``obj_fn=`` (the loss of the params), whether it
    is timed unless ``--optimizers`` says otherwise (state bytes are reported for all), and its
    targets relative to AdamW."""

    label: str
    make: Callable[[], optax.GradientTransformation]
    needs_obj_fn: bool = False
    timed_by_default: bool = True
    max_state_ratio: float | None = None
    max_step_ratio: float | None = None


OPTIMIZERS = {
    "adamw": OptimizerSpec("optax.adamw(1e-3)", lambda: optax.adamw(LEARNING_RATE)),
    "triaccel": OptimizerSpec(
        "triaccel_jax.triaccel(1e-3, curvature_every=10)",
        lambda: triaccel_jax.triaccel(learning_rate=LEARNING_RATE, curvature_every=10),
        max_state_ratio=MAX_STATE_RATIO_FP32,
        max_step_ratio=MAX_STEP_RATIO,
    ),
    "sophia": OptimizerSpec(
        "optax.contrib.sophia(1e-3), Hutchinson Hessian every 10 steps",
        lambda: optax.contrib.sophia(LEARNING_RATE),
        needs_obj_fn=True,
    ),
    "triaccel-bf16": OptimizerSpec(
        "triaccel_jax.triaccel(1e-3, config=TriAccelConfig(state_dtype=jnp.bfloat16))",
        lambda: triaccel_jax.triaccel(
            LEARNING_RATE, config=triaccel_jax.TriAccelConfig(state_dtype=jnp.bfloat16)
        ),
        timed_by_default=False,
        max_state_ratio=MAX_STATE_RATIO_BF16,
        max_step_ratio=MAX_STEP_RATIO,
    ),
}


class TrainState(NamedTuple):
    params: Any
    batch_stats: Any  # {} for models without BatchNorm
    opt_state: Any


@dataclasses.dataclass
class Timings:
    """Per-round seconds per step of each optimizer, for the full step and the update alone."""

    step: dict[str, list[float]]
    update: dict[str, list[float]]
    final_loss: dict[str, float]


# --------------------------------------------------------------------------------------------
# Building blocks: loss, training step, update-only step.
# --------------------------------------------------------------------------------------------


def make_loss(model: nn.Module, has_batch_stats: bool) -> Callable[..., tuple[jax.Array, Any]]:
    """Returns ``loss(params, batch_stats, x, y) -> (mean cross-entropy, new batch_stats)``."""

    def loss(params, batch_stats, x, y):
        if has_batch_stats:
            logits, updates = model.apply(
                {"params": params, "batch_stats": batch_stats},
                x,
                train=True,
                mutable=["batch_stats"],
            )
            batch_stats = updates["batch_stats"]
        else:
            logits = model.apply({"params": params}, x, train=True)
        value = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return value, batch_stats

    return loss


def make_train_step(loss: Callable, tx: optax.GradientTransformation, needs_obj_fn: bool):
    """Returns a jitted ``step(state, x, y) -> (state, loss)`` that donates ``state``."""

    def step(state: TrainState, x, y):
        def loss_of_params(params):
            return loss(params, state.batch_stats, x, y)

        (value, batch_stats), grads = jax.value_and_grad(loss_of_params, has_aux=True)(state.params)
        extra = {"obj_fn": lambda p: loss_of_params(p)[0]} if needs_obj_fn else {}
        updates, opt_state = tx.update(grads, state.opt_state, state.params, **extra)
        params = optax.apply_updates(state.params, updates)
        return TrainState(params, batch_stats, opt_state), value

    return jax.jit(step, donate_argnums=0)


def make_update_step(loss: Callable, tx: optax.GradientTransformation, needs_obj_fn: bool):
    """Returns a jitted ``update(params, opt_state, grads, batch_stats, x, y)`` that applies one
    optimizer update on the given gradients, donating ``params`` and ``opt_state``."""

    def update(params, opt_state, grads, batch_stats, x, y):
        # Sophia's Hessian estimate needs the loss; it is part of its update's cost.
        extra = {"obj_fn": lambda p: loss(p, batch_stats, x, y)[0]} if needs_obj_fn else {}
        updates, opt_state = tx.update(grads, opt_state, params, **extra)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(update, donate_argnums=(0, 1))


def tree_bytes(tree: Any) -> int:
    """Bytes held by the array leaves of ``tree`` (arrays or ``jax.ShapeDtypeStruct``)."""
    return sum(int(x.size) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def fresh_copy(tree: Any) -> Any:
    # Every optimizer gets its own buffers: the steps donate them, and a buffer that appears
    # twice in a donated argument cannot be donated.
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


# --------------------------------------------------------------------------------------------
# Measurement.
# --------------------------------------------------------------------------------------------


def run_rounds(
    names: Sequence[str],
    run_one: Callable[[str, int], None],
    rounds: int,
    steps_per_round: int,
) -> dict[str, list[float]]:
    """Times ``run_one(name, steps)`` round-robin and returns seconds per step, per round.

    The starting optimizer rotates each round, so none always runs right after the same one.
    ``run_one`` must block until its results are ready.
    """
    per_step = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            start = time.perf_counter()
            run_one(name, steps_per_round)
            per_step[name].append((time.perf_counter() - start) / steps_per_round)
    return per_step


def benchmark_model(
    spec: ModelSpec,
    timed: Sequence[str],
    batch_size: int,
    rounds: int,
    steps_per_round: int,
    seed: int,
) -> tuple[Timings, dict[str, int], int]:
    """Times every optimizer in ``timed`` on one model; returns timings, state bytes, #params."""
    model = spec.make()
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((batch_size, *spec.image_shape), dtype=np.float32))
    y = jnp.asarray(rng.integers(0, spec.num_classes, size=batch_size, dtype=np.int32))

    variables = model.init(jax.random.key(seed), x[:1], train=False)
    params = variables["params"]
    has_batch_stats = "batch_stats" in variables
    batch_stats = variables.get("batch_stats", {})
    num_params = sum(p.size for p in jax.tree.leaves(params))
    loss = make_loss(model, has_batch_stats)

    txs = {name: OPTIMIZERS[name].make() for name in OPTIMIZERS}
    state_bytes = {name: tree_bytes(jax.eval_shape(tx.init, params)) for name, tx in txs.items()}

    print(f"  compiling and warming up ({', '.join(timed)}) ...", flush=True)
    start = time.perf_counter()
    train_steps, update_steps, states, update_states = {}, {}, {}, {}
    grads = jax.jit(jax.grad(lambda p: loss(p, batch_stats, x, y)[0]))(params)
    last_loss = {}
    for name in timed:
        tx, needs_obj_fn = txs[name], OPTIMIZERS[name].needs_obj_fn
        train_steps[name] = make_train_step(loss, tx, needs_obj_fn)
        update_steps[name] = make_update_step(loss, tx, needs_obj_fn)
        states[name] = TrainState(fresh_copy(params), fresh_copy(batch_stats), tx.init(params))
        update_states[name] = (fresh_copy(params), tx.init(params))

    def run_train(name: str, steps: int) -> None:
        state, value = states[name], None
        for _ in range(steps):
            state, value = train_steps[name](state, x, y)
        states[name] = jax.block_until_ready(state)
        last_loss[name] = float(value)

    def run_update(name: str, steps: int) -> None:
        p, s = update_states[name]
        for _ in range(steps):
            p, s = update_steps[name](p, s, grads, batch_stats, x, y)
        update_states[name] = jax.block_until_ready((p, s))

    # One warm-up round compiles each step and runs it through a curvature step.
    for name in timed:
        run_train(name, steps_per_round)
        run_update(name, steps_per_round)

    print(f"  ... {time.perf_counter() - start:.1f} s", flush=True)
    print(f"  timing {rounds} rounds x {steps_per_round} steps ...", flush=True)
    start = time.perf_counter()
    step_times = run_rounds(list(timed), run_train, rounds, steps_per_round)
    update_times = run_rounds(list(timed), run_update, rounds, steps_per_round)
    print(f"  ... {time.perf_counter() - start:.1f} s", flush=True)
    return Timings(step_times, update_times, last_loss), state_bytes, num_params


# --------------------------------------------------------------------------------------------
# Report.
# --------------------------------------------------------------------------------------------


def ratio_stats(times: dict[str, list[float]], name: str) -> tuple[float, float, float]:
    """Median and quartiles of the per-round ratios ``name / BASELINE``."""
    ratios = [a / b for a, b in zip(times[name], times[BASELINE], strict=True)]
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return median, q1, q3


def verdict(value: float, limit: float | None) -> str:
    if limit is None:
        return ""
    return f"<={limit:.2f} {'PASS' if value <= limit else 'FAIL'}"


def report_model(
    model_name: str,
    timings: Timings,
    state_bytes: dict[str, int],
    figures: list[float],
) -> list[str]:
    """Prints the table of one model; appends every number to ``figures``; returns verdicts."""
    header = (
        f"{'optimizer':<14} {'step ms':>9} {'/adamw':>7} {'[IQR]':>13} {'target':>12}"
        f" {'update ms':>10} {'/adamw':>7} {'[IQR]':>13}"
        f" {'state MiB':>10} {'/adamw':>7} {'target':>12} {'loss':>8}"
    )
    print(header)
    print("-" * len(header))
    verdicts = []
    for name, spec in OPTIMIZERS.items():
        mib = state_bytes[name] / 2**20
        bytes_ratio = state_bytes[name] / state_bytes[BASELINE]
        figures += [mib, bytes_ratio]
        state_target = verdict(bytes_ratio, spec.max_state_ratio)
        if state_target:
            verdicts.append(f"{model_name} {name} state bytes {bytes_ratio:.3f} {state_target}")
        if name in timings.step:
            step_ms = statistics.median(timings.step[name]) * 1e3
            update_ms = statistics.median(timings.update[name]) * 1e3
            step_r, step_q1, step_q3 = ratio_stats(timings.step, name)
            upd_r, upd_q1, upd_q3 = ratio_stats(timings.update, name)
            loss = timings.final_loss[name]
            figures += [step_ms, update_ms, step_r, step_q1, step_q3, upd_r, upd_q1, upd_q3, loss]
            step_target = verdict(step_r, spec.max_step_ratio)
            if step_target:
                verdicts.append(f"{model_name} {name} step time {step_r:.3f} {step_target}")
            timing = (
                f"{step_ms:>9.2f} {step_r:>7.3f} {f'[{step_q1:.2f}-{step_q3:.2f}]':>13}"
                f" {step_target:>12} {update_ms:>10.3f} {upd_r:>7.2f}"
                f" {f'[{upd_q1:.2f}-{upd_q3:.2f}]':>13}"
            )
            loss_text = f"{loss:>8.4f}"
        else:
            timing = f"{'-':>9} {'-':>7} {'':>13} {'':>12} {'-':>10} {'-':>7} {'':>13}"
            loss_text = f"{'-':>8}"
        print(
            f"{name:<14} {timing} {mib:>10.3f} {bytes_ratio:>7.3f} {state_target:>12} {loss_text}"
        )
    return verdicts


def machine_description() -> list[str]:
    device = jax.devices()[0]
    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable_cpus = os.cpu_count()
    return [
        f"platform: {platform.platform()} ({platform.machine()}), python {platform.python_version()}",
        f"cpus: {os.cpu_count()} ({usable_cpus} usable), load average {_load_average()}",
        f"jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__},"
        f" triaccel_jax {triaccel_jax.__version__}",
        f"backend: {jax.default_backend()}, {jax.device_count()} device(s),"
        f" device kind: {device.device_kind}",
    ]


def _load_average() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        nargs="+",
        choices=sorted(MODELS),
        default=list(MODELS),
        help="models to benchmark (default: all)",
    )
    others = [name for name in OPTIMIZERS if name != BASELINE]
    default_timed = [name for name in others if OPTIMIZERS[name].timed_by_default]
    parser.add_argument(
        "--optimizers",
        nargs="+",
        choices=others,
        default=default_timed,
        help=f"optimizers to time besides {BASELINE}, which is always timed (default:"
        f" {' '.join(default_timed)}); state bytes are reported for all",
    )
    parser.add_argument("--rounds", type=int, help="timed rounds (default 30; 2 with --quick)")
    parser.add_argument(
        "--steps-per-round",
        type=int,
        help="consecutive steps per optimizer per round (default 10, the curvature interval)",
    )
    parser.add_argument(
        "--batch-size", type=int, help="images per batch (default 128; 16 with --quick)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the init")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="few rounds and a small batch: checks that the script runs",
    )
    args = parser.parse_args(argv)
    defaults = {"rounds": 2, "batch_size": 16} if args.quick else {"rounds": 30, "batch_size": 128}
    for key, value in {**defaults, "steps_per_round": 10}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("rounds", "steps_per_round", "batch_size"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    timed = [BASELINE, *(name for name in OPTIMIZERS if name in args.optimizers)]
    print("triaccel overhead benchmark")
    for line in machine_description():
        print("  " + line)
    print(
        f"  {args.rounds} rounds x {args.steps_per_round} steps, batch {args.batch_size},"
        f" seed {args.seed}{', QUICK (smoke test)' if args.quick else ''}"
    )
    print("  optimizers:")
    for name, spec in OPTIMIZERS.items():
        measured = "timed, state bytes" if name in timed else "state bytes only"
        print(f"    {name:<14} {spec.label} ({measured})")

    figures: list[float] = []
    verdicts: list[str] = []
    for model_name in args.models:
        spec = MODELS[model_name]
        image = "x".join(map(str, spec.image_shape))
        print(f"\n== {model_name}: batch {args.batch_size}x{image}, {spec.num_classes} classes ==")
        timings, state_bytes, num_params = benchmark_model(
            spec,
            timed,
            args.batch_size,
            args.rounds,
            args.steps_per_round,
            args.seed,
        )
        print(f"  {num_params:,} parameters ({num_params * 4 / 2**20:.3f} MiB in float32)\n")
        verdicts += report_model(model_name, timings, state_bytes, figures)

    print("\nTargets (triaccel against fp32 AdamW):")
    for line in verdicts:
        print("  " + line)
    print(f"  load average at the end: {_load_average()}")
    bad = [v for v in figures if not math.isfinite(v)]
    if bad:
        print(f"\nERROR: {len(bad)} figure(s) are not finite", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
