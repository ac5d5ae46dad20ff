"""Goodput study: the best static batches against memory-only and goodput-driven elastic batches.

Protocol. Fashion-MNIST's full training set less a validation split held out of it (6,000
images, a fixed random choice), one of two models (``--model``): the small CNN
(``triaccel_jax.models.SmallCNN``) or a CNN with batch norm after each convolution
(``BatchNormCNN`` below: its noise is measured on a half beside the step, so that measuring does
not change its statistics), one of two optimizers (``--optimizer``, :func:`make_optimizer`):
AdamW (``optax.adamw``, weight decay 1e-4, the default) or the recommended configuration (the
curvature signals beside ``optax.contrib.muon``), either in ``optax.inject_hyperparams``,
``--epochs`` epochs a run (default 1), and each row trained through
``triaccel_jax.Controller``. Rows:

* ``static32``, ``static64``, ``static128`` (``--static-batches``): a fixed batch; the *best
  static* row is the one of highest validation accuracy at its tuned rate (tuning seeds);
* ``memory``: the batch grows as memory allows (``batch_rule="memory"``) from the smallest static
  batch (also ``reference_batch``; the square-root learning-rate rule) up to ``--max-batch``;
* ``goodput``: ``batch_rule="goodput"`` with its defaults (the square root of AdaScale's gain
  for the learning rate, decisions every 2% of an epoch) on this machine's measured step times;
* ``goodput_gpu_like``: the same deciding on an assumed GPU-like step time,
  ``GPU_LIKE_STEP_TIME`` (10 ms a step plus 10 us a sample: samples per second rise with the
  batch until several hundred, as on an under-used accelerator), so that the statistics decide.

The elastic rows read a fixed memory budget (``BudgetMemoryProbe``, 2 GiB), not the free RAM of a
shared machine, so their memory decisions repeat; memory never binds these models under it.

Tuning. Every row's learning rate is chosen on the tuning seeds (``--tuning-seeds``, default
100: never one of the final seeds) by mean final validation accuracy, from a log-spaced grid
(``--lr-grid``, default 5e-4, 1.41e-3, 4e-3 for AdamW and 4e-3, 1.13e-2, 3.2e-2 for Muon) that
is widened by its own ratio, one point at a
time, on the side of a best point at an edge until the best is interior (at most
``MAX_WIDENINGS`` points a side; a best still at an edge is reported). The test set is never read
to choose.

Target. The best static batch at its tuned rate is trained ``--long-epochs`` epochs (default 3)
on the tuning seed: the accuracy a long run reaches. The target is that run's final test
accuracy less ``--margin`` (default 2.5 points: a one-epoch run of the best static batch
reaches about 89% where three epochs reach about 91%, and every run here is one epoch), the same for every run; each run's steps,
samples and training seconds to it are read at its first test evaluation at or above it.

Final runs. ``--seeds`` (default 0-9), interleaved (for each seed, every row in turn, so that a
slow spell of the machine falls on every row alike). Each run is evaluated on the test set every
1/``--evals-per-epoch`` epoch of samples (default 8) and on the validation split at its end.
Wall seconds are training only: the time inside ``Controller.run`` less the XLA compiles (or
persistent-cache loads) the controller timed in them; evaluations run outside those calls.

Figures. Per row: final test accuracy (mean, sd) and its paired (same seed) 95% t-interval
against best static; steps, samples and wall seconds to the target as the median over seeds of
the per-seed ratio to best static, with a 95% bootstrap interval (resampling seeds, 10,000
times) of that median on the log scale; a seed a run does not reach counts as an infinite ratio;
per run the batch's moves and direction changes; for static rows, the controller's throughput
figure against the samples per second of the same run's steps. Targets (issue text): the GPU-like
row's steps ratio <= 0.6 with its accuracy interval's lower end >= -0.3 points, the measured
row's wall ratio <= 1.0, the batch changing direction at most once a run, and every static
throughput figure within 30% of its steps' samples per second: each printed "met" or "missed".
``goodput.md`` (tables), ``goodput.json`` (every run) and ``goodput.png`` (batch, noise scale
with its interval and measured throughput over samples, the elastic rows' first seed) go to
``--out``.

Run from the repository root::

    nice -n 10 .venv/bin/python benchmarks/goodput.py --out /tmp/goodput       # the study
    .venv/bin/python benchmarks/goodput.py --quick --out /tmp/goodput_quick      # a smoke test

``--quick`` runs every row end to end on 256 training images (1 epoch, 1 seed, a grid of 2
rates, checks every 2 steps, buckets up to 64) in about a minute; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
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

# The statistics are the accuracy study's (benchmarks/accuracy/), imported from this folder.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from accuracy.stats import first_reaching
from accuracy.stats import mean_std
from accuracy.stats import paired_interval
from accuracy.tuning import log_grid

import triaccel_jax
from triaccel_jax._src import compilation_cache
from triaccel_jax.cli import _task as task

VALIDATION = 6_000
WEIGHT_DECAY = 1e-4
BUDGET_BYTES = 2 * 2**30
# The learning-rate grid each optimizer is tuned over by default (Muon's rate is its update's
# RMS scale, about ten times AdamW's: 0.016 was its tuned rate on the accuracy study's CNN).
DEFAULT_GRIDS = {
    "adamw": tuple(log_grid(5e-4, 4e-3, 3)),
    "muon": tuple(log_grid(4e-3, 3.2e-2, 3)),
}
QUICK_GRIDS = {"adamw": (1e-3, 3e-3), "muon": (8e-3, 2.4e-2)}
OPTIMIZER_LABELS = {
    "adamw": f"AdamW (weight decay {WEIGHT_DECAY})",
    "muon": f"the curvature signals beside Muon (weight decay {WEIGHT_DECAY})",
}


def make_optimizer(name: str, lr: float) -> optax.GradientTransformation:
    """The optimizer of ``--optimizer`` at rate ``lr``, its rate injected (the batch rule scales it).

    ``adamw``: ``optax.adamw`` with weight decay 1e-4. ``muon``: the recommended configuration
    (README): the curvature signals beside ``optax.contrib.muon`` (weight decay 1e-4 on both
    parts, its Adam part at a tenth of the rate, matrices chosen by
    ``triaccel_jax.transforms.muon_dimension_numbers``).
    """
    if name == "adamw":
        return optax.inject_hyperparams(optax.adamw)(learning_rate=lr, weight_decay=WEIGHT_DECAY)

    def recommended(learning_rate):
        return optax.chain(
            triaccel_jax.curvature_signals(),
            optax.contrib.muon(
                learning_rate,
                adam_learning_rate=0.1 * learning_rate,
                weight_decay=WEIGHT_DECAY,
                adam_weight_decay=WEIGHT_DECAY,
                muon_weight_dimension_numbers=triaccel_jax.transforms.muon_dimension_numbers,
            ),
        )

    return optax.inject_hyperparams(recommended)(learning_rate=lr)


# Points a grid may grow by on each side while its best point sits at an edge.
MAX_WIDENINGS = 3
QUICK_SIZES = (256, 256, 512)  # train, validation, test images with --quick
GOODPUT_ROWS = ("goodput", "goodput_gpu_like")
# (fixed seconds, seconds per sample) of a step on the GPU-like device the statistics row assumes.
GPU_LIKE_STEP_TIME = (0.010, 1e-5)
# The targets: (row, figure, ratio bound) and the final-accuracy bound, in points.
# The GPU-like row's steps bound, by optimizer: looser over Muon, whose own steps are already
# 0.47x AdamW's.
STEPS_TARGETS = {
    "adamw": ("goodput_gpu_like", "steps", 0.6),
    "muon": ("goodput_gpu_like", "steps", 0.7),
}
WALL_TARGET = ("goodput", "seconds", 1.0)
ACCURACY_BOUND = -0.3
DIRECTION_CHANGES_BOUND = 1
THROUGHPUT_BOUND = 0.30
BOOTSTRAP_DRAWS = 10_000


@dataclasses.dataclass(frozen=True)
class Row:
    """One configuration of the study."""

    name: str
    label: str
    batch_rule: str | None  # None: a static batch
    batch: int  # the static batch, or the elastic rows' start and reference
    assumed_step_time: tuple[float, float] | None = None

    @property
    def elastic(self) -> bool:
        return self.batch_rule is not None


def make_rows(static_batches: Sequence[int]) -> list[Row]:
    """The static rows, then the elastic ones, which start at the smallest static batch."""
    start = min(static_batches)
    rows = [Row(f"static{b}", f"static batch {b}", None, b) for b in sorted(static_batches)]
    rows += [
        Row("memory", f"memory-only elastic (from {start})", "memory", start),
        Row("goodput", "goodput, measured throughput", "goodput", start),
        Row(
            "goodput_gpu_like",
            "goodput, GPU-like step time",
            "goodput",
            start,
            GPU_LIKE_STEP_TIME,
        ),
    ]
    return rows


class BatchNormCNN(nn.Module):
    """The small CNN with batch norm after each convolution (its statistics are model state)."""

    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        for width in (32, 64):
            x = nn.Conv(width, kernel_size=(3, 3), padding="SAME", use_bias=False)(x)
            x = triaccel_jax.models.BatchNorm(use_running_average=not train)(x)
            x = nn.avg_pool(nn.relu(x), window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(self.num_classes)(x)


MODELS = {"small_cnn": (triaccel_jax.models.SmallCNN, False), "bn_cnn": (BatchNormCNN, True)}


# -- data and runs ------------------------------------------------------------------------------


@dataclasses.dataclass
class Splits:
    train: dict[str, np.ndarray]
    validation: dict[str, np.ndarray]
    test: dict[str, np.ndarray]


def load_splits(quick: bool) -> Splits:
    """Fashion-MNIST: the training set less a fixed random validation split, and the test set.

    Raises:
      FileNotFoundError: Fashion-MNIST is not installed (the message says how to get it).
    """
    data = task.load_data("fashion_mnist", data_dir=None, train_subset=None, test_subset=None)
    size = len(data.train["label"])
    order = np.random.default_rng(12345).permutation(size)
    held, kept = order[:VALIDATION], order[VALIDATION:]
    test = data.test
    if quick:
        train_n, validation_n, test_n = QUICK_SIZES
        held, kept = held[:validation_n], kept[:train_n]
        test = {k: v[:test_n] for k, v in test.items()}
    return Splits(
        {k: v[kept] for k, v in data.train.items()},
        {k: v[held] for k, v in data.train.items()},
        test,
    )


@dataclasses.dataclass(frozen=True)
class Task:
    """The model, its loss (one for every run, so the evaluation compiles once) and settings."""

    model: Any
    has_state: bool
    loss_fn: Any
    evals_per_epoch: int
    max_batch: int
    check_every: int
    optimizer: str


def build_controller(
    row: Row, lr: float, train: dict[str, np.ndarray], t: Task, seed: int
) -> triaccel_jax.Controller:
    """The controller of ``row`` at learning rate ``lr``: the same init and data order per seed."""
    variables = t.model.init(jax.random.key(seed), train["image"][:2])
    tx = make_optimizer(t.optimizer, lr)
    settings: dict[str, Any] = dict(
        has_aux=True,
        seed=seed,
        check_every=t.check_every,
        reference_batch=row.batch,
        batch_size=row.batch,
        probe=triaccel_jax.BudgetMemoryProbe(BUDGET_BYTES),
        compile_in_background=False,
    )
    if t.has_state:
        settings["model_state"] = variables["batch_stats"]
    if not row.elastic:
        settings.update(
            min_batch=row.batch, max_batch=row.batch, batch_rule="memory", lr_scaling="none"
        )
    else:
        # The learning-rate rule is the controller's default for the batch rule: the square
        # root of AdaScale's gain under goodput, the square-root rule under memory.
        settings.update(
            min_batch=row.batch,
            max_batch=max(t.max_batch, row.batch),
            batch_rule=row.batch_rule,
            assumed_step_time=row.assumed_step_time,
        )
    return triaccel_jax.Controller(t.loss_fn, variables["params"], tx, train, **settings)


def direction_changes(batches: Sequence[int]) -> int:
    """How often a sequence of batch sizes turns round (up then down, or down then up)."""
    signs = [1 if b > a else -1 for a, b in itertools.pairwise(batches) if b != a]
    return sum(1 for a, b in itertools.pairwise(signs) if a != b)


def train(row: Row, lr: float, seed: int, splits: Splits, t: Task, epochs: int) -> dict[str, Any]:
    """One run: ``epochs`` epochs, evaluated on the test set every 1/``evals_per_epoch`` epoch.

    ``seconds`` (in the run and in each evaluation) is the wall time inside ``Controller.run``
    less the compiles the controller timed there: training only.
    """
    controller = build_controller(row, lr, splits.train, t, seed)
    per_epoch = len(splits.train["label"])
    points = [
        round(per_epoch * (i + 1) / t.evals_per_epoch) for i in range(epochs * t.evals_per_epoch)
    ]
    largest = max(controller.buckets)
    evals: list[dict[str, Any]] = []
    history: dict[str, list[Any]] = {"samples": [], "batch": [], "noise_scale": []}
    # At each evaluation: the noise scale's interval and the samples per second of the steps
    # since the one before.
    checkpoints: dict[str, list[Any]] = {"samples": [], "noise_interval": [], "rate": []}
    wall = 0.0
    for point in points:
        samples_before, wall_before = controller.sampler.samples_seen, wall
        while controller.sampler.samples_seen < point:
            # Counted at the largest bucket, so that a batch that grows inside the call cannot
            # carry it more than a step past the evaluation point.
            steps = max(1, -(-(point - controller.sampler.samples_seen) // largest))
            compiled = controller.timings["compile"]
            start = time.perf_counter()
            infos = controller.run(steps)
            wall += time.perf_counter() - start - (controller.timings["compile"] - compiled)
            seen = controller.sampler.samples_seen - sum(i.batch_size for i in infos)
            for info in infos:
                seen += info.batch_size
                history["samples"].append(seen)
                history["batch"].append(info.batch_size)
                history["noise_scale"].append(_finite(info.noise_scale))
        state = controller.model_state if t.has_state else None
        accuracy = task.evaluate(t.loss_fn, controller.params, state, None, splits.test)
        evals.append(
            {
                "step": controller.step_count,
                "samples": controller.sampler.samples_seen,
                "seconds": wall,
                "accuracy": accuracy,
            }
        )
        interval = controller.noise_interval
        checkpoints["samples"].append(controller.sampler.samples_seen)
        checkpoints["noise_interval"].append(
            None if interval is None else [_finite(interval[0]), _finite(interval[1])]
        )
        spent = wall - wall_before
        checkpoints["rate"].append(
            (controller.sampler.samples_seen - samples_before) / spent if spent > 0 else None
        )
    state = controller.model_state if t.has_state else None
    validation = task.evaluate(t.loss_fn, controller.params, state, None, splits.validation)
    kinds = [e.kind for e in controller.events]
    throughput = {
        f"{micro}x{count}": rate for (micro, count, _), rate in controller.throughput.items()
    }
    return {
        "row": row.name,
        "seed": seed,
        "lr": lr,
        "epochs": epochs,
        "accuracy": evals[-1]["accuracy"],
        "validation": validation,
        "steps": controller.step_count,
        "samples": controller.sampler.samples_seen,
        "seconds": wall,
        "samples_per_second": controller.sampler.samples_seen / wall if wall > 0 else None,
        "compile_seconds": controller.timings["compile"],
        "max_batch": max(history["batch"]),
        "final_batch": controller.batch_size,
        "moves": kinds.count("grow") + kinds.count("shrink"),
        "direction_changes": direction_changes(history["batch"]),
        "noise_scale": _finite(controller.noise_scale),
        "throughput": throughput,
        "evals": evals,
        "checkpoints": checkpoints,
        "history": history if row.elastic else None,
    }


def _finite(value: float | None) -> float | None:
    """``value``, or None where it is missing or not finite (JSON has no infinity)."""
    return None if value is None or not math.isfinite(value) else value


# -- figures to the target ---------------------------------------------------------------------


def to_target(evals: Sequence[dict[str, Any]], target: float) -> dict[str, float] | None:
    """Steps, samples and training seconds at the first evaluation at or above ``target``."""
    hit = first_reaching(evals, target)
    if hit is None:
        return None
    return {"steps": hit["step"], "samples": hit["samples"], "seconds": hit["seconds"]}


def bootstrap_median(
    logs: Sequence[float], draws: int = BOOTSTRAP_DRAWS, seed: int = 0
) -> tuple[float, float, float]:
    """The median of ``logs`` (log ratios, +inf for a seed not reached) and its 95% percentile
    bootstrap interval, resampling the seeds; each as a ratio (``exp``; inf stays inf)."""
    values = np.asarray(logs, dtype=float)
    rng = np.random.default_rng(seed)
    medians = np.median(values[rng.integers(0, len(values), (draws, len(values)))], axis=1)
    low, high = np.percentile(medians, [2.5, 97.5], method="lower")
    return tuple(float(np.exp(x)) for x in (np.median(values), low, high))  # type: ignore[return-value]


def target_figures(
    runs: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]], target: float
) -> dict[str, Any]:
    """A row's steps, samples and seconds to ``target`` against the reference row's, by seed.

    Returns per figure the median over the seeds that reached it (None if none did), and the
    median of the per-seed ratios to the reference with its bootstrap interval (a seed the row
    does not reach counts as an infinite ratio, a seed only the reference misses is left out;
    None for an infinite median), and ``reached`` of ``n``.
    """
    pairs = {r["seed"]: r for r in reference}
    out: dict[str, Any] = {"n": len(runs), "target": target}
    hits = [
        (to_target(r["evals"], target), to_target(pairs[r["seed"]]["evals"], target)) for r in runs
    ]
    out["reached"] = sum(1 for mine, _ in hits if mine is not None)
    for figure in ("steps", "samples", "seconds"):
        mine_values = [mine[figure] for mine, _ in hits if mine is not None]
        out[figure] = statistics.median(mine_values) if mine_values else None
        logs = [
            math.inf if mine is None else math.log(mine[figure] / ref[figure])
            for mine, ref in hits
            if ref is not None and (mine is None or mine[figure] > 0)
        ]
        if not logs:
            out[f"{figure}_ratio"], out[f"{figure}_interval"] = None, None
            continue
        ratio, low, high = bootstrap_median(logs)
        out[f"{figure}_ratio"] = _finite(ratio)
        out[f"{figure}_interval"] = [_finite(low), _finite(high)]
    return out


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Per row: final accuracy, its paired interval against best static, the target figures,
    the batch's moves; and the targets, met or missed."""
    rows = [Row(**r) for r in report["rows"]]
    runs = report["runs"]
    best = report["best_static"]
    reference = sorted(runs[best], key=lambda r: r["seed"])
    target = report["target"]
    summary: dict[str, Any] = {"best_static": best, "rows": {}, "targets": []}
    for row in rows:
        if not runs.get(row.name):
            continue
        row_runs = sorted(runs[row.name], key=lambda r: r["seed"])
        accuracies = [r["accuracy"] for r in row_runs]
        mean, sd = mean_std(accuracies)
        diff = paired_interval(accuracies, [r["accuracy"] for r in reference])
        figures: dict[str, Any] = {
            "lr": report["chosen"][row.name],
            "mean": mean,
            "sd": sd,
            "validation": statistics.mean(r["validation"] for r in row_runs),
            "diff": [x if math.isfinite(x) else None for x in diff],
            "target": target_figures(row_runs, reference, target),
            "steps": statistics.median(r["steps"] for r in row_runs),
            "seconds": statistics.median(r["seconds"] for r in row_runs),
            "max_batch": max(r["max_batch"] for r in row_runs),
            "final_batches": [r["final_batch"] for r in row_runs],
            "moves": [r["moves"] for r in row_runs],
            "direction_changes": [r["direction_changes"] for r in row_runs],
        }
        if not row.elastic:
            # The controller's figure for the one bucket against the run's own samples/second.
            errors = []
            for r in row_runs:
                figure = r["throughput"].get(f"{row.batch}x1")
                if figure is not None and r["samples_per_second"]:
                    errors.append(figure / r["samples_per_second"] - 1.0)
            figures["throughput_error"] = max(errors, key=abs) if errors else None
        summary["rows"][row.name] = figures
    found = summary["rows"]
    steps_target = STEPS_TARGETS[report["protocol"]["optimizer"]]
    for name, figure, bound in (steps_target, WALL_TARGET):
        if name in found:
            ratio = found[name]["target"][f"{figure}_ratio"]
            summary["targets"].append(
                {
                    "row": name,
                    "figure": figure,
                    "what": f"{name}: {figure} to target / best static <= {bound} (median of "
                    "per-seed ratios)",
                    "value": ratio,
                    "met": ratio is not None and ratio <= bound,
                }
            )
    for name in GOODPUT_ROWS:
        if name in found:
            low = found[name]["diff"][1]
            summary["targets"].append(
                {
                    "row": name,
                    "figure": "accuracy",
                    "what": f"{name}: final accuracy, paired 95% interval's lower end "
                    f">= {ACCURACY_BOUND} points",
                    "value": None if low is None else 100 * low,
                    "met": low is not None and 100 * low >= ACCURACY_BOUND,
                }
            )
            turns = max(found[name]["direction_changes"])
            summary["targets"].append(
                {
                    "row": name,
                    "figure": "direction_changes",
                    "what": f"{name}: the batch changes direction at most "
                    f"{DIRECTION_CHANGES_BOUND} time(s) a run (the most in any run)",
                    "value": turns,
                    "met": turns <= DIRECTION_CHANGES_BOUND,
                }
            )
    errors = [
        f["throughput_error"] for f in found.values() if f.get("throughput_error") is not None
    ]
    if errors:
        worst = max(errors, key=abs)
        summary["targets"].append(
            {
                "row": "static",
                "figure": "throughput",
                "what": "a fixed bucket's throughput figure within "
                f"{THROUGHPUT_BOUND:.0%} of its steps' samples per second (the worst run, "
                "relative error)",
                "value": worst,
                "met": abs(worst) <= THROUGHPUT_BOUND,
            }
        )
    return summary


# -- the report ---------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "not reached" if value is None else f"{value:{spec}}{suffix}"


def _ratio(t: dict[str, Any], figure: str) -> str:
    ratio, interval = t[f"{figure}_ratio"], t[f"{figure}_interval"]
    if ratio is None:
        return "not reached"
    low, high = ("inf" if x is None else f"{x:.2f}" for x in interval)
    return f"{ratio:.2f} [{low}, {high}]"


def markdown(report: dict[str, Any]) -> str:
    """The table, the targets and the tuning trials."""
    summary = report["summary"]
    best = summary["best_static"]
    labels = {r["name"]: r["label"] for r in report["rows"]}
    p = report["protocol"]
    lines = [
        f"### Goodput study: {p['model']} on Fashion-MNIST",
        "",
        f"{p['train_images']} train / {p['validation_images']} validation / {p['test_images']} "
        f"test images; {p['epochs']} epoch(s) a run; {OPTIMIZER_LABELS[p['optimizer']]}; "
        f"learning rates tuned on seed(s) {p['tuning_seeds']} by validation accuracy; final "
        f"seeds {p['seeds']}, interleaved; elastic rows from batch {p['elastic_start']} up to "
        f"{p['max_batch']} with the controller's default learning-rate rule, memory checks "
        f"every {p['check_every']} steps; test evaluated every 1/{p['evals_per_epoch']} epoch. "
        f"Best static (validation, tuning seeds): **{labels[best]}**. Target: "
        f"{100 * report['long_run']['accuracy']:.2f}% (the best static batch trained "
        f"{p['long_epochs']} epochs) less {100 * report['margin']:.1f} points = "
        f"**{100 * report['target']:.2f}%**.",
        "",
        "| row | lr | test accuracy % (mean ± sd) | vs best static, points (paired 95% CI) "
        "| reached | steps to target, x best [95% CI] | samples, x best [95% CI] "
        "| wall s to target, x best [95% CI] | largest batch | moves (median) "
        "| direction changes (max) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["rows"]:
        name = row["name"]
        s = summary["rows"][name]
        t = s["target"]
        if name == best:
            diff = "(reference)"
        elif s["diff"][1] is None:
            diff = f"{100 * s['diff'][0]:+.2f} [n/a: one seed]"
        else:
            d, low, high = (100 * x for x in s["diff"])
            diff = f"{d:+.2f} [{low:+.2f}, {high:+.2f}]"
        lines.append(
            f"| {row['label']} | {s['lr']:.3g} | {100 * s['mean']:.2f} ± {100 * s['sd']:.2f} "
            f"| {diff} | {t['reached']}/{t['n']} | {_ratio(t, 'steps')} "
            f"| {_ratio(t, 'samples')} | {_fmt(t['seconds'], '.1f', ' s')}, {_ratio(t, 'seconds')} "
            f"| {s['max_batch']} | {statistics.median(s['moves']):g} "
            f"| {max(s['direction_changes'])} |"
        )
    lines += [
        "",
        "Ratios are the median over seeds of each seed's figure over best static's in the same "
        "seed, with a 95% bootstrap interval of that median (seeds resampled); a seed not reached "
        "counts as infinite. Wall seconds are training only: time inside `Controller.run` less "
        "the compiles it timed; evaluations are outside it.",
        "",
        "Targets:",
        "",
    ]
    for target in summary["targets"]:
        value = "n/a" if target["value"] is None else f"{target['value']:.3g}"
        lines.append(f"- {target['what']}: {value}: **{'met' if target['met'] else 'missed'}**")
    lines += ["", "Tuning (validation accuracy %, mean over the tuning seeds):", ""]
    grid = sorted({float(lr) for scores in report["tuning"].values() for lr in scores})
    lines.append("| row | " + " | ".join(f"lr {lr:.3g}" for lr in grid) + " | chosen |")
    lines.append("| --- |" + " --- |" * (len(grid) + 1))
    for row in report["rows"]:
        scores = {float(k): v for k, v in report["tuning"].get(row["name"], {}).items()}
        if not scores:
            continue
        cells = " | ".join("" if lr not in scores else f"{100 * scores[lr]:.2f}" for lr in grid)
        edge = "" if report["interior"][row["name"]] else " (at an edge)"
        lines.append(f"| {row['label']} | {cells} | {report['chosen'][row['name']]:.3g}{edge} |")
    lines += ["", f"Total wall time of the study: {report['seconds'] / 60:.1f} min."]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: pathlib.Path) -> None:
    """Batch size, noise scale (with its interval) and measured throughput over samples, for the
    elastic rows' runs of the first seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = report["protocol"]["seeds"][0]
    figure, (top, middle, bottom) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    batches: set[int] = set()
    for index, row in enumerate(report["rows"]):
        run = next((r for r in report["runs"].get(row["name"], []) if r["seed"] == seed), None)
        if run is None:
            continue
        color = f"C{index % 10}"  # one colour per row in every panel
        points = run["checkpoints"]
        rates = [math.nan if v is None else v for v in points["rate"]]
        bottom.plot(points["samples"], rates, marker="o", label=row["label"], color=color)
        history = run["history"]
        if history is None:
            continue
        batches.update(history["batch"])
        top.step(
            history["samples"], history["batch"], where="post", label=row["label"], color=color
        )
        noise = [math.nan if v is None else v for v in history["noise_scale"]]
        # The memory-only row does not measure the noise scale (its steps are not split).
        if not all(math.isnan(v) for v in noise):
            middle.plot(history["samples"], noise, label=row["label"], color=color)
            spans = [
                (s, i)
                for s, i in zip(points["samples"], points["noise_interval"], strict=True)
                if i
            ]
            spans = [(s, i) for s, i in spans if i[0] is not None and i[1] is not None]
            if spans:
                middle.fill_between(
                    [s for s, _ in spans],
                    [i[0] for _, i in spans],
                    [i[1] for _, i in spans],
                    color=color,
                    alpha=0.2,
                )
    top.set_ylabel("batch size")
    top.set_yscale("log", base=2)
    top.set_yticks(sorted(batches), [str(b) for b in sorted(batches)])
    top.minorticks_off()
    top.legend(fontsize="small")
    top.set_title(f"{report['protocol']['model']}, seed {seed}")
    middle.set_ylabel("noise scale (band: 95% interval)")
    middle.set_yscale("log")
    middle.legend(fontsize="small")
    bottom.set_ylabel("samples / s (training)")
    bottom.legend(fontsize="small")
    bottom.set_xlabel("training samples")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# -- the study ----------------------------------------------------------------------------------


def widened(grid: Sequence[float], scores: Sequence[float]) -> float | None:
    """The next rate to try when the best score sits at an edge of ``grid`` (sorted, log
    spaced): one ratio beyond that edge; None when the best is interior."""
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))
    ratio = grid[1] / grid[0] if len(grid) > 1 else 2.0
    if best == 0:
        return grid[0] / ratio
    if best == len(grid) - 1:
        return grid[-1] * ratio
    return None


def run_study(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Tunes every row, trains the best static batch long for the target, then the final seeds."""
    splits = load_splits(args.quick)
    kind, has_state = MODELS[args.model]
    model = kind(num_classes=10)
    t = Task(
        model,
        has_state,
        task.make_loss(model, has_state, None),
        args.evals_per_epoch,
        args.max_batch,
        args.check_every,
        args.optimizer,
    )
    rows = [r for r in make_rows(args.static_batches) if r.name in args.rows or not r.elastic]
    log(
        f"{args.model}, {args.optimizer}: {len(splits.train['label'])} train / {len(splits.validation['label'])} "
        f"validation / {len(splits.test['label'])} test images; {args.epochs} epoch(s); grid "
        f"{[f'{x:.3g}' for x in args.lr_grid]} tuned on seed(s) {args.tuning_seeds}; seeds "
        f"{args.seeds}; rows {[r.name for r in rows]}"
    )

    def one(row: Row, lr: float, seed: int, epochs: int | None = None) -> dict[str, Any]:
        result = train(row, lr, seed, splits, t, epochs or args.epochs)
        log(
            f"  {row.name:>16} lr {lr:.3g} seed {seed}: test {100 * result['accuracy']:.2f}% "
            f"validation {100 * result['validation']:.2f}%, {result['steps']} steps, batch "
            f"<= {result['max_batch']} (final {result['final_batch']}, "
            f"{result['direction_changes']} turns), {result['seconds']:.1f} s "
            f"(+{result['compile_seconds']:.1f} s compiles)"
        )
        return result

    trials: list[dict[str, Any]] = []
    tuning: dict[str, dict[str, float]] = {}
    chosen: dict[str, float] = {}
    interior: dict[str, bool] = {}
    for row in rows:
        scores: dict[float, float] = {}

        def score(lr: float) -> None:
            results = [one(row, lr, seed) for seed in args.tuning_seeds]  # noqa: B023
            trials.extend(results)
            scores[lr] = statistics.mean(r["validation"] for r in results)  # noqa: B023

        for lr in args.lr_grid:
            score(lr)
        for _ in range(2 * MAX_WIDENINGS):
            grid = sorted(scores)
            more = widened(grid, [scores[lr] for lr in grid])
            if more is None:
                break
            score(more)
        grid = sorted(scores)
        values = [scores[lr] for lr in grid]
        interior[row.name] = widened(grid, values) is None
        tuning[row.name] = {str(lr): scores[lr] for lr in grid}
        chosen[row.name] = grid[max(range(len(grid)), key=lambda i: (values[i], -i))]
        log(f"  {row.name}: chosen lr {chosen[row.name]:.3g} (interior: {interior[row.name]})")
    static = [r for r in rows if not r.elastic]
    best = max(static, key=lambda r: tuning[r.name][str(chosen[r.name])])
    long_runs = [one(best, chosen[best.name], seed, args.long_epochs) for seed in args.tuning_seeds]
    long_accuracy = statistics.mean(r["accuracy"] for r in long_runs)
    target = long_accuracy - args.margin
    log(
        f"  best static {best.name}: {args.long_epochs} epochs reach "
        f"{100 * long_accuracy:.2f}%: target {100 * target:.2f}%"
    )
    runs: dict[str, list[dict[str, Any]]] = {r.name: [] for r in rows}
    for seed in args.seeds:
        for row in rows:
            runs[row.name].append(one(row, chosen[row.name], seed))
    for result in [*trials, *long_runs]:
        result["history"] = None  # histories are kept for the final runs only
    return {
        "rows": [dataclasses.asdict(r) for r in rows],
        "protocol": {
            "model": args.model,
            "optimizer": args.optimizer,
            "train_images": len(splits.train["label"]),
            "validation_images": len(splits.validation["label"]),
            "test_images": len(splits.test["label"]),
            "epochs": args.epochs,
            "long_epochs": args.long_epochs,
            "evals_per_epoch": args.evals_per_epoch,
            "grid": list(args.lr_grid),
            "tuning_seeds": list(args.tuning_seeds),
            "seeds": list(args.seeds),
            "elastic_start": min(args.static_batches),
            "max_batch": args.max_batch,
            "check_every": args.check_every,
            "memory_budget_bytes": BUDGET_BYTES,
        },
        "best_static": best.name,
        "long_run": {"accuracy": long_accuracy, "runs": long_runs},
        "margin": args.margin,
        "target": target,
        "chosen": chosen,
        "interior": interior,
        "tuning": tuning,
        "trials": trials,
        "runs": runs,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("goodput_output"))
    parser.add_argument("--quick", action="store_true", help="tiny subset, 1 seed, few steps")
    parser.add_argument("--model", choices=sorted(MODELS), default="small_cnn")
    parser.add_argument("--optimizer", choices=sorted(DEFAULT_GRIDS), default="adamw")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--long-epochs", type=int, default=None, help="default 3 (1 quick)")
    parser.add_argument("--evals-per-epoch", type=int, default=None, help="default 8 (4 quick)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0-9 (0 quick)")
    parser.add_argument("--tuning-seeds", type=int, nargs="+", default=[100])
    parser.add_argument("--lr-grid", type=float, nargs="+", default=None)
    parser.add_argument("--static-batches", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--max-batch", type=int, default=None, help="default 512 (64 quick)")
    parser.add_argument("--check-every", type=int, default=None, help="default 10 (2 quick)")
    parser.add_argument(
        "--margin", type=float, default=0.025, help="target = the long run's accuracy - this"
    )
    elastic = [r.name for r in make_rows([32]) if r.elastic]
    parser.add_argument("--rows", nargs="+", choices=elastic, default=elastic, help="elastic rows")
    args = parser.parse_args(argv)
    quick = args.quick
    args.seeds = args.seeds or ([0] if quick else list(range(10)))
    default_grid = (QUICK_GRIDS if quick else DEFAULT_GRIDS)[args.optimizer]
    args.lr_grid = sorted(args.lr_grid or default_grid)
    args.long_epochs = args.long_epochs or (1 if quick else 3)
    args.evals_per_epoch = args.evals_per_epoch or (4 if quick else 8)
    args.max_batch = args.max_batch or (64 if quick else 512)
    args.check_every = args.check_every or (2 if quick else 10)
    if len(args.static_batches) < 1:
        parser.error("--static-batches needs at least one size")
    if set(args.seeds) & set(args.tuning_seeds):
        parser.error("--seeds and --tuning-seeds must not share a seed (tuning is held apart)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def log(message: str) -> None:
        print(message, flush=True)

    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    start = time.perf_counter()
    try:
        # Every run compiles the same programs again; a persistent cache compiles each once.
        with (
            tempfile.TemporaryDirectory() as cache,
            compilation_cache.persistent_cache(pathlib.Path(cache)),
        ):
            report = run_study(args, log)
    except FileNotFoundError as error:
        print(f"goodput.py needs Fashion-MNIST: {error}", file=sys.stderr)
        return 2
    report.update(
        command="benchmarks/goodput.py " + " ".join(sys.argv[1:] if argv is None else argv),
        started=started,
        seconds=time.perf_counter() - start,
        machine=(
            f"{platform.machine()}, {os.cpu_count()} CPU cores, "
            f"{jax.device_count()} {jax.default_backend()} device(s)"
        ),
        jax=jax.__version__,
    )
    report["summary"] = summarize(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "goodput.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (args.out / "goodput.md").write_text(text)
    plot(report, args.out / "goodput.png")
    log(text)
    log(f"wrote {args.out / 'goodput.md'}, goodput.json and goodput.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
