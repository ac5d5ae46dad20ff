"""Accuracy study: Tri-Accel against tuned FP32 AdamW, with an ablation of its three adaptations.

Protocol (docs/accuracy.md): each workload's training set is split into a training part and a
validation part; FP32 AdamW and Tri-Accel each get ``--trials`` tuning trials scored on the
validation part; then every ablation row trains at its chosen hyperparameters for each seed and
is scored on the test set. The table gives test accuracy mean and standard deviation, the paired
(same seed) 95% t-interval of the difference against FP32 AdamW, steps and seconds to a target
accuracy, and ``memory_report``'s analytic total at the batch each run trained at.

Rows (each switches on one adaptation, then all of them):

* ``fp32``: ``optax.adamw`` in float32 at a fixed batch;
* ``curvature``: ``triaccel_jax.triaccel`` (curvature step sizes) in float32 at a fixed batch;
* ``precision``: AdamW's update with the planner re-planning each leaf's precision. The planner
  reads curvature signals that only a triaccel state holds, so this row runs ``triaccel`` with
  ``alpha=0``, whose step scale is exactly 1: AdamW's update with a curvature store beside it;
* ``elastic``: AdamW in float32 with the batch growing into a fixed memory budget (square-root
  learning-rate scaling, as the main job);
* ``triaccel``: all three, as the main job runs Tri-Accel;
* ``bf16``: AdamW with every layer computing in bfloat16 (float32 masters and state).

Hyperparameters: ``fp32``, ``precision``, ``elastic`` and ``bf16`` use AdamW's tuned learning
rate; ``curvature`` and ``triaccel`` use Tri-Accel's tuned learning rate, ``alpha`` and clip.

Run from the repository root::

    nice -n 10 .venv/bin/python benchmarks/accuracy.py --out /tmp/accuracy   # the study
    .venv/bin/python benchmarks/accuracy.py --quick --out /tmp/accuracy_quick  # a smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
import scipy.stats

import triaccel_jax
from triaccel_jax.cli import _compilation_cache as compilation_cache
from triaccel_jax.cli import _task as task

ROWS = ("fp32", "curvature", "precision", "elastic", "triaccel", "bf16")
ROW_LABELS = {
    "fp32": "FP32 AdamW",
    "curvature": "+ curvature step sizes only",
    "precision": "+ planned precision only",
    "elastic": "+ elastic batch only",
    "triaccel": "Tri-Accel (all three)",
    "bf16": "static bf16 AdamW",
}
# Tri-Accel's variants of (alpha, min_scale, max_scale) tried at its best learning rate, in order.
TRIACCEL_VARIANTS = ((1.0, 0.25, 4.0), (0.25, 0.5, 2.0), (0.5, 0.25, 4.0), (1.0, 0.5, 2.0))
DEFAULT_SHAPE = (0.5, 0.5, 2.0)  # triaccel's defaults: alpha, min_scale, max_scale
WEIGHT_DECAY = 1e-4
TUNING_SEED = 1000  # tuning trials train at a seed that is not an evaluation seed


# ---------------------------------------------------------------------------------------------
# Statistics


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; 0 for a single value)."""
    values = list(values)
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def paired_interval(
    a: Sequence[float], b: Sequence[float], confidence: float = 0.95
) -> tuple[float, float, float]:
    """Mean of ``a - b`` paired by index and its two-sided Student-t confidence interval.

    ``half = t_{(1 + confidence) / 2, n - 1} * sd(a - b) / sqrt(n)``: the interval of the mean
    per-pair difference, which removes the variation the pairs share (same seed: same
    initialisation and data order).

    Returns:
      ``(mean, low, high)``; with one pair the interval is infinite.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"need two equally long, non-empty samples, got {len(a)} and {len(b)}")
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    mean, sd = mean_std(diffs)
    if len(diffs) < 2:
        return mean, -math.inf, math.inf
    half = (
        float(scipy.stats.t.ppf((1 + confidence) / 2, len(diffs) - 1)) * sd / math.sqrt(len(diffs))
    )
    return mean, mean - half, mean + half


def first_reaching(evals: Sequence[dict[str, float]], target: float) -> dict[str, float] | None:
    """The first evaluation whose accuracy is at least ``target`` (None: never reached)."""
    return next((e for e in evals if e["accuracy"] >= target), None)


# ---------------------------------------------------------------------------------------------
# Workloads


class MLP(nn.Module):
    """A ReLU multilayer perceptron on flattened images."""

    hidden: Sequence[int] = (256, 128)
    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        del train
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model and data set, how long it trains and the learning rates tuned over."""

    name: str
    description: str
    model: Callable[[], nn.Module]
    dataset: str
    train_subset: int | None  # training images used (before the validation split), None: all
    validation: int  # images held out of the training set for tuning
    test_subset: int | None
    epochs: int
    batch: int
    max_batch: int  # the elastic rows grow up to this bucket
    lr_range: tuple[float, float]
    evals_per_epoch: int
    trials: int  # tuning trials per optimizer unless --trials says otherwise


WORKLOADS = {
    "digits_mlp": Workload(
        "digits_mlp",
        "MLP 64-256-128-10 on scikit-learn digits",
        lambda: MLP(),
        "digits",
        None,
        287,
        None,
        epochs=40,
        batch=32,
        max_batch=128,
        lr_range=(1e-3, 3e-2),
        evals_per_epoch=1,
        trials=6,
    ),
    "fashion_cnn": Workload(
        "fashion_cnn",
        "SmallCNN on Fashion-MNIST",
        lambda: triaccel_jax.models.SmallCNN(num_classes=10),
        "fashion_mnist",
        12_000,
        2_000,
        None,
        epochs=5,
        batch=128,
        max_batch=512,
        lr_range=(5e-4, 8e-3),
        evals_per_epoch=1,
        trials=4,
    ),
}


@dataclasses.dataclass
class Splits:
    """The training part, the validation part (held out of the training set) and the test set."""

    train: task.Data  # ``test`` here is the validation part, scored while tuning
    test: dict[str, np.ndarray]

    @property
    def validation(self) -> dict[str, np.ndarray]:
        return self.train.test


def load_splits(workload: Workload, quick: bool) -> Splits:
    """The workload's splits: the validation images are a fixed random choice of training ones."""
    data = task.load_data(
        workload.dataset,
        data_dir=None,
        train_subset=None,
        test_subset=workload.test_subset if not quick else 1000,
    )
    size = len(data.train["label"])
    order = np.random.default_rng(12345).permutation(size)
    validation = workload.validation if not quick else min(workload.validation, 500)
    used = workload.train_subset if workload.train_subset is not None else size
    if quick:
        used = min(used, 2000)
    held, kept = order[:validation], order[validation:used]
    train = {k: v[kept] for k, v in data.train.items()}
    held_out = {k: v[held] for k, v in data.train.items()}
    return Splits(task.Data(data.name, train, held_out, data.num_classes, None), data.test)


# ---------------------------------------------------------------------------------------------
# Runs


@dataclasses.dataclass(frozen=True)
class Hyper:
    """A configuration's tunable hyperparameters."""

    lr: float
    alpha: float = DEFAULT_SHAPE[0]
    min_scale: float = DEFAULT_SHAPE[1]
    max_scale: float = DEFAULT_SHAPE[2]


def build_controller(
    row: str, hyper: Hyper, workload: Workload, data: task.Data, seed: int
) -> tuple[triaccel_jax.Controller, Callable[..., Any]]:
    """The controller and loss of ``row`` at ``hyper``: the same init and data order per seed."""
    model = workload.model()
    loss_fn = task.make_loss(model, False, None)
    params = model.init(jax.random.key(seed), data.train["image"][:2])["params"]
    fixed = dict(min_batch=workload.batch, max_batch=workload.batch, lr_scaling="none")
    # A fixed budget, not the free RAM of a shared machine, so the batch decisions repeat.
    elastic = dict(
        min_batch=min(32, workload.batch),
        max_batch=workload.max_batch,
        batch_size=workload.batch,
        probe=triaccel_jax.BudgetMemoryProbe(2 * 2**30),
        lr_scaling="sqrt",
    )
    curvature = dict(alpha=hyper.alpha, min_scale=hyper.min_scale, max_scale=hyper.max_scale)
    adamw = optax.inject_hyperparams(optax.adamw)
    tri = optax.inject_hyperparams(triaccel_jax.triaccel)
    policy = None
    replan_every = None
    if row in ("fp32", "bf16"):
        tx, batching = adamw(learning_rate=hyper.lr, weight_decay=WEIGHT_DECAY), fixed
        if row == "bf16":
            policy = triaccel_jax.PrecisionPolicy.uniform(params, "bf16")
    elif row == "curvature":
        tx, batching = tri(learning_rate=hyper.lr, weight_decay=WEIGHT_DECAY, **curvature), fixed
    elif row == "precision":
        tx, batching = tri(learning_rate=hyper.lr, weight_decay=WEIGHT_DECAY, alpha=0.0), fixed
        replan_every = 100
    elif row == "elastic":
        tx, batching = adamw(learning_rate=hyper.lr, weight_decay=WEIGHT_DECAY), elastic
    elif row == "triaccel":
        tx = tri(learning_rate=hyper.lr, weight_decay=WEIGHT_DECAY, **curvature)
        batching, replan_every = elastic, 100
    else:
        raise ValueError(f"unknown row {row!r}; choose from {ROWS}")
    controller = triaccel_jax.Controller(
        loss_fn,
        params,
        tx,
        data.train,
        has_aux=True,
        seed=seed,
        reference_batch=workload.batch,
        check_every=10,
        policy=policy,
        replan_every=replan_every,
        **batching,
    )
    return controller, loss_fn


def analytic_memory_mib(controller: Any, loss_fn: Any, data: task.Data, batch: int) -> float:
    """``memory_report``'s total (params, copies, gradients, state, residuals) of one step."""
    index = np.arange(batch) % len(data.train["label"])
    batch_arrays = {k: v[index] for k, v in data.train.items()}
    policy = controller.policy

    def step_fn(params, arrays):
        return loss_fn(params, arrays, policy=policy, rng=jax.random.key(0))[0]

    report = triaccel_jax.memory_report(
        controller.params, controller.opt_state, policy, step_fn, batch_arrays, compiled=False
    )
    return report.total / 2**20


def train(
    row: str,
    hyper: Hyper,
    workload: Workload,
    data: task.Data,
    evaluate_on: dict[str, np.ndarray],
    seed: int,
    *,
    epochs: int,
    evals_per_epoch: int,
) -> dict[str, Any]:
    """Trains one run for ``epochs`` epochs, evaluating on ``evaluate_on`` along the way.

    ``seconds`` counts training only (compiles included, evaluations excluded).
    """
    controller, loss_fn = build_controller(row, hyper, workload, data, seed)
    samples_per_epoch = len(data.train["label"])
    eval_points = [
        round(samples_per_epoch * (e + (i + 1) / evals_per_epoch))
        for e in range(epochs)
        for i in range(evals_per_epoch)
    ]
    evals, batches = [], []
    train_seconds = 0.0
    for point in eval_points:
        start = time.perf_counter()
        while controller.sampler.samples_seen < point:
            info = controller.step()
            batches.append(info.batch_size)
        train_seconds += time.perf_counter() - start
        accuracy = task.evaluate(
            loss_fn, controller.params, controller.model_state, controller.policy, evaluate_on
        )
        evals.append(
            {
                "step": controller.step_count,
                "samples": controller.sampler.samples_seen,
                "seconds": train_seconds,
                # Compiles are one-off costs that the persistent cache hides from later runs.
                "compile_seconds": controller.timings["compile"],
                "accuracy": accuracy,
            }
        )
    run_batch = max(batches)
    policy = controller.policy
    leaves = {} if policy is None else {path: policy.compute(path) for path in policy}
    return {
        "row": row,
        "seed": seed,
        "hyper": dataclasses.asdict(hyper),
        "accuracy": evals[-1]["accuracy"],
        "steps": controller.step_count,
        "seconds": train_seconds,
        "run_batch": run_batch,
        "memory_mib": analytic_memory_mib(controller, loss_fn, data, run_batch),
        "evals": evals,
        "final_policy": {k: str(v) for k, v in leaves.items()},
        "replans": sum(1 for e in controller.event_records() if e.get("kind") == "replan"),
    }


# ---------------------------------------------------------------------------------------------
# Tuning


def log_grid(low: float, high: float, count: int) -> list[float]:
    """``count`` log-spaced values from ``low`` to ``high`` (``low`` alone for one)."""
    if count == 1:
        return [low]
    return [float(low * (high / low) ** (i / (count - 1))) for i in range(count)]


def tuning_trials(trials: int, lr_range: tuple[float, float]) -> tuple[list[Hyper], int, int]:
    """AdamW's trials, and how Tri-Accel splits the same number into learning rates and variants.

    Returns:
      ``(adamw_trials, triaccel_learning_rates, triaccel_variants)``: AdamW's ``trials``
      log-spaced learning rates; Tri-Accel first tries ``triaccel_learning_rates`` log-spaced
      learning rates over the same range at its default alpha and clip, then the first
      ``triaccel_variants`` of :data:`TRIACCEL_VARIANTS` at the best of them.
    """
    if trials < 2:
        raise ValueError(f"`trials` must be >= 2, got {trials}")
    variants = min(trials // 3, len(TRIACCEL_VARIANTS))
    adamw = [Hyper(lr) for lr in log_grid(*lr_range, trials)]
    return adamw, trials - variants, variants


def tune(
    workload: Workload, splits: Splits, trials: int, epochs: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """Chooses AdamW's and Tri-Accel's hyperparameters on the validation split."""
    adamw_trials, lr_count, variant_count = tuning_trials(trials, workload.lr_range)
    records: dict[str, list[dict[str, Any]]] = {"fp32": [], "triaccel": []}

    def trial(row: str, hyper: Hyper) -> float:
        result = train(
            row,
            hyper,
            workload,
            splits.train,
            splits.validation,
            TUNING_SEED,
            epochs=epochs,
            evals_per_epoch=1,
        )
        records[row].append({"hyper": dataclasses.asdict(hyper), "validation": result["accuracy"]})
        log(f"  tune {row:>8} {hyper}: validation {100 * result['accuracy']:.2f}%")
        return result["accuracy"]

    best_adamw = max(adamw_trials, key=lambda h: trial("fp32", h))
    lr_trials = [Hyper(lr) for lr in log_grid(*workload.lr_range, lr_count)]
    scored = [(trial("triaccel", h), i, h) for i, h in enumerate(lr_trials)]
    for alpha, low, high in TRIACCEL_VARIANTS[:variant_count]:
        best_lr = max(scored)[2].lr
        hyper = Hyper(best_lr, alpha, low, high)
        scored.append((trial("triaccel", hyper), len(scored), hyper))
    # Ties go to the earlier trial (the default shape first).
    best_tri = max(scored, key=lambda s: (s[0], -s[1]))[2]
    return {"fp32": best_adamw, "triaccel": best_tri, "trials": records}


# ---------------------------------------------------------------------------------------------
# The study and its report


def run_workload(
    workload: Workload, args: argparse.Namespace, log: Callable[[str], None]
) -> dict[str, Any]:
    """Tunes, then trains every row for every seed; returns the raw figures."""
    splits = load_splits(workload, args.quick)
    epochs = 1 if args.quick else workload.epochs
    if args.epochs is not None:
        epochs = args.epochs
    log(
        f"{workload.name}: {len(splits.train.train['label'])} train / "
        f"{len(splits.validation['label'])} validation / {len(splits.test['label'])} test, "
        f"{epochs} epochs"
    )
    start = time.perf_counter()
    trials = args.trials or workload.trials
    chosen = tune(workload, splits, trials, epochs, log)
    tuning_seconds = time.perf_counter() - start
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row in args.rows}
    for seed in args.seeds:
        for row in args.rows:
            hyper = chosen["triaccel"] if row in ("curvature", "triaccel") else chosen["fp32"]
            result = train(
                row,
                hyper,
                workload,
                splits.train,
                splits.test,
                seed,
                epochs=epochs,
                evals_per_epoch=workload.evals_per_epoch,
            )
            runs[row].append(result)
            log(
                f"  seed {seed} {row:>9}: test {100 * result['accuracy']:.2f}%, "
                f"{result['steps']} steps, batch {result['run_batch']}, {result['seconds']:.1f} s"
            )
    return {
        "workload": workload.name,
        "description": workload.description,
        "train_images": len(splits.train.train["label"]),
        "validation_images": len(splits.validation["label"]),
        "test_images": len(splits.test["label"]),
        "epochs": epochs,
        "batch": workload.batch,
        "max_batch": workload.max_batch,
        "trials": trials,
        "chosen": {k: dataclasses.asdict(chosen[k]) for k in ("fp32", "triaccel")},
        "tuning": chosen["trials"],
        "tuning_seconds": tuning_seconds,
        "runs": runs,
    }


def summarize(result: dict[str, Any], margin: float) -> list[dict[str, Any]]:
    """One table row per ablation row: accuracy, paired difference, time to target, memory."""
    runs = result["runs"]
    reference = [r["accuracy"] for r in runs["fp32"]] if "fp32" in runs else None
    target = statistics.mean(reference) - margin if reference else None
    rows = []
    for row, row_runs in runs.items():
        accuracies = [r["accuracy"] for r in row_runs]
        mean, std = mean_std(accuracies)
        summary: dict[str, Any] = {"row": row, "mean": mean, "std": std, "n": len(accuracies)}
        if reference is not None and row != "fp32":
            summary["diff"] = paired_interval(accuracies, reference)
        if target is not None:
            reached = [first_reaching(r["evals"], target) for r in row_runs]
            hits = [h for h in reached if h is not None]
            summary["target"] = target
            summary["reached"] = len(hits)
            summary["steps_to_target"] = (
                statistics.median(h["step"] for h in hits) if hits else None
            )
            summary["seconds_to_target"] = (
                statistics.median(h["seconds"] - h["compile_seconds"] for h in hits)
                if hits
                else None
            )
        summary["steps"] = statistics.median(r["steps"] for r in row_runs)
        summary["seconds"] = statistics.median(r["seconds"] for r in row_runs)
        summary["run_batch"] = max(r["run_batch"] for r in row_runs)
        summary["memory_mib"] = statistics.median(r["memory_mib"] for r in row_runs)
        rows.append(summary)
    return rows


def markdown_table(result: dict[str, Any], margin: float) -> str:
    """The workload's table in markdown."""
    summary = summarize(result, margin)
    target = summary[0].get("target")
    target_text = "target" if target is None else f"{100 * target:.2f}%"
    lines = [
        f"| configuration | test accuracy (mean ± std, n) | vs FP32 AdamW (paired 95% CI), points "
        f"| steps to {target_text} (reached) | seconds to {target_text} (no compiles) | steps | batch "
        f"| memory_report MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in summary:
        diff = "—"
        if "diff" in s:
            d, low, high = (100 * x for x in s["diff"])
            diff = f"{d:+.2f} [{low:+.2f}, {high:+.2f}]"
        steps_to = "—" if s.get("steps_to_target") is None else f"{s['steps_to_target']:.0f}"
        seconds_to = "—" if s.get("seconds_to_target") is None else f"{s['seconds_to_target']:.1f}"
        lines.append(
            f"| {ROW_LABELS[s['row']]} | {100 * s['mean']:.2f} ± {100 * s['std']:.2f} ({s['n']}) "
            f"| {diff} | {steps_to} ({s.get('reached', 0)}/{s['n']}) | {seconds_to} "
            f"| {s['steps']:.0f} | {s['run_batch']} | {s['memory_mib']:.2f} |"
        )
    chosen = result["chosen"]
    tri = chosen["triaccel"]
    lines.append("")
    lines.append(
        f"Chosen on validation: AdamW lr {chosen['fp32']['lr']:.3g}; Tri-Accel lr {tri['lr']:.3g}, "
        f"alpha {tri['alpha']}, clip [{tri['min_scale']}, {tri['max_scale']}]."
    )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 3 4")
    parser.add_argument(
        "--trials",
        type=int,
        default=None,
        help="tuning trials per optimizer (default: the workload's)",
    )
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--epochs", type=int, default=None, help="override every workload's")
    parser.add_argument("--margin", type=float, default=0.005, help="target = FP32 mean - margin")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("accuracy_output"))
    parser.add_argument("--quick", action="store_true", help="digits only, 2 seeds, 1 epoch")
    args = parser.parse_args(argv)
    if args.quick:
        args.workloads = args.workloads or ["digits_mlp"]
        args.seeds = args.seeds or [0, 1]
        args.trials = args.trials or 2
    args.workloads = args.workloads or list(WORKLOADS)
    args.seeds = args.seeds or [0, 1, 2, 3, 4]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(message, flush=True)

    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    start = time.perf_counter()
    # Every seed compiles the same programs again; a persistent cache compiles each once.
    with (
        tempfile.TemporaryDirectory() as cache,
        compilation_cache.persistent_cache(pathlib.Path(cache)),
    ):
        results = [run_workload(WORKLOADS[name], args, log) for name in args.workloads]
    report = {
        "command": "benchmarks/accuracy.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "started": started,
        "seconds": time.perf_counter() - start,
        "machine": f"{platform.machine()}, {jax.device_count()} {jax.default_backend()} device(s)",
        "jax": jax.__version__,
        "margin": args.margin,
        "workloads": results,
    }
    (args.out / "accuracy.json").write_text(json.dumps(report, indent=1))
    sections = [
        f"## {r['workload']}: {r['description']}\n\n"
        f"{r['train_images']} train / {r['validation_images']} validation / {r['test_images']} "
        f"test images, {r['epochs']} epochs, batch {r['batch']} (elastic up to {r['max_batch']}), "
        f"seeds {args.seeds}, {r['trials']} tuning trials per optimizer.\n\n"
        + markdown_table(r, args.margin)
        for r in results
    ]
    (args.out / "accuracy.md").write_text("\n\n".join(sections) + "\n")
    log("\n\n".join(sections))
    log(f"wrote {args.out / 'accuracy.json'} and {args.out / 'accuracy.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
