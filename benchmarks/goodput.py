"""Goodput study (issue 23): static batches against memory-only and goodput-driven elastic batches.

Protocol. Fashion-MNIST's full training set less a validation split held out of it (6,000
images, a fixed random choice), the small CNN (``triaccel_jax.models.SmallCNN``), AdamW
(``optax.adamw``, weight decay 1e-4; the Hessian row runs ``triaccel_jax.triaccel`` with
``alpha=0``, whose step scale is exactly 1: AdamW's update with the curvature store beside it
that the Hessian-weighted noise scale reads), ``--epochs`` epochs (default 1), and each row
trained through ``triaccel_jax.Controller``. Rows:

* ``static32``, ``static64``, ``static128`` (``--static-batches``): a fixed batch; the *best
  static* row is the one of highest mean final validation accuracy over the seeds;
* ``memory``: the batch grows as memory allows (``batch_rule="memory"``) from the smallest static
  batch (also ``reference_batch``; square-root learning-rate scaling) up to ``--max-batch``;
* ``goodput``: ``batch_rule="goodput"`` on this machine's measured step times (a model fitted
  to them);
* ``goodput_gpu_like``: goodput on an assumed GPU-like step time, ``GPU_LIKE_STEP_TIME`` (10 ms a
  step plus 10 us a sample: samples per second rise with the batch until several hundred, as
  on an under-used accelerator), so that the statistics decide;
* ``goodput_hessian``: as ``goodput`` with ``noise_estimator="hessian"`` (the Hessian-weighted
  noise scale).

The elastic rows read a fixed memory budget (``BudgetMemoryProbe``, 2 GiB), not the free RAM of a
shared machine, so their memory decisions repeat; memory never binds the small CNN under it.

Tuning: every row's learning rate is chosen from the same grid (``--lr-grid``, default 5e-4,
1.41e-3, 4e-3: log-spaced) by the mean final validation accuracy over the tuning seeds
(``--tuning-seeds``, default 0; ties to the smaller rate); the test set is never read to choose.
A tuning run is a full run, so its run at the chosen rate is also that seed's final run; the
other seeds (default 1 2 3 4) then train at the chosen rate. The default full study is 7 rows x 3
rates + 7 rows x 4 seeds = 49 runs of one epoch: about 33 minutes
on 2 quiet CPU cores, where a run is 20-45 s of training and ~12 s of evaluations, and about
twice that beside other jobs; see benchmarks/README.md.

Figures. Each run is evaluated on the test set every 1/``--evals-per-epoch`` epoch of samples
(default 8) and on the validation split at its end. Wall seconds are training only: the time
spent inside ``Controller.run`` less the XLA compiles (or persistent-cache loads) the controller
timed in them (``timings["compile"]``); evaluations run outside those calls. Per seed the target
is the best static row's final test accuracy in that seed less ``--margin`` (0.3 points), and each
row's steps, samples and wall seconds to it are read at the first evaluation at or above it
("not reached" if none). The table gives final test accuracy (mean, sd) and its paired (same
seed) 95% t-interval against best static, and, for the figures to the target, the median over
seeds and the median over seeds of the per-seed ratio to best static (a seed not reached counts
as an infinite ratio). Targets: ``goodput_gpu_like`` steps ratio <= 0.6, ``goodput`` wall ratio
<= 1.0, and every goodput row's interval lower end >= -0.3 points; each printed "met" or
"missed". ``goodput.md`` (table), ``goodput.json`` (every run) and ``goodput.png`` (batch and
noise scale over samples of the elastic rows, seed 0) go to ``--out``.

Run from the repository root::

    nice -n 10 .venv/bin/python benchmarks/goodput.py --out /tmp/goodput       # the study
    .venv/bin/python benchmarks/goodput.py --quick --out /tmp/goodput_quick      # a smoke test

``--quick`` runs every row end to end on 256 training images (1 epoch, 1 seed, a grid of 2
rates, checks every 2 steps, buckets up to 64) in under a minute; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
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

import jax
import numpy as np
import optax

# The statistics are the accuracy study's (benchmarks/accuracy/), imported from this folder.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from accuracy.stats import first_reaching
from accuracy.stats import mean_std
from accuracy.stats import paired_interval
from accuracy.stats import to_reference
from accuracy.tuning import log_grid

import triaccel_jax
from triaccel_jax.cli import _compilation_cache as compilation_cache
from triaccel_jax.cli import _task as task

VALIDATION = 6_000
WEIGHT_DECAY = 1e-4
BUDGET_BYTES = 2 * 2**30
DEFAULT_GRID = tuple(log_grid(5e-4, 4e-3, 3))
QUICK_SIZES = (256, 256, 512)  # train, validation, test images with --quick
GOODPUT_ROWS = ("goodput", "goodput_gpu_like", "goodput_hessian")
# (fixed seconds, seconds per sample) of a step on the GPU-like device the statistics row assumes.
GPU_LIKE_STEP_TIME = (0.010, 1e-5)
# The targets: (row, figure, ratio bound) and the final-accuracy bound, in points.
STEPS_TARGET = ("goodput_gpu_like", "steps", 0.6)
WALL_TARGET = ("goodput", "seconds", 1.0)
ACCURACY_BOUND = -0.3


@dataclasses.dataclass(frozen=True)
class Row:
    """One configuration of the study."""

    name: str
    label: str
    batch_rule: str | None  # None: a static batch
    batch: int  # the static batch, or the elastic rows' start and reference
    assumed_step_time: tuple[float, float] | None = None
    noise_estimator: str | None = None

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
        Row(
            "goodput_hessian",
            "goodput, Hessian noise scale",
            "goodput",
            start,
            noise_estimator="hessian",
        ),
    ]
    return rows


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
class Settings:
    """What every run shares."""

    epochs: int
    evals_per_epoch: int
    max_batch: int
    check_every: int


def build_controller(
    row: Row,
    lr: float,
    train: dict[str, np.ndarray],
    loss_fn: Any,
    model: Any,
    seed: int,
    s: Settings,
) -> triaccel_jax.Controller:
    """The controller of ``row`` at learning rate ``lr``: the same init and data order per seed."""
    params = model.init(jax.random.key(seed), train["image"][:2])["params"]
    if row.noise_estimator is not None:
        tx = optax.inject_hyperparams(triaccel_jax.triaccel)(
            learning_rate=lr, weight_decay=WEIGHT_DECAY, alpha=0.0
        )
    else:
        tx = optax.inject_hyperparams(optax.adamw)(learning_rate=lr, weight_decay=WEIGHT_DECAY)
    settings: dict[str, Any] = dict(
        has_aux=True,
        seed=seed,
        check_every=s.check_every,
        reference_batch=row.batch,
        batch_size=row.batch,
        probe=triaccel_jax.BudgetMemoryProbe(BUDGET_BYTES),
        compile_in_background=False,
    )
    if not row.elastic:
        settings.update(
            min_batch=row.batch, max_batch=row.batch, batch_rule="memory", lr_scaling="none"
        )
    else:
        settings.update(
            min_batch=row.batch,
            max_batch=max(s.max_batch, row.batch),
            batch_rule=row.batch_rule,
            assumed_step_time=row.assumed_step_time,
            lr_scaling="sqrt",
        )
        if row.noise_estimator is not None:
            settings["noise_estimator"] = row.noise_estimator
    return triaccel_jax.Controller(loss_fn, params, tx, train, **settings)


def train(
    row: Row, lr: float, seed: int, splits: Splits, loss_fn: Any, model: Any, s: Settings
) -> dict[str, Any]:
    """One run: ``s.epochs`` epochs, evaluated on the test set every 1/``evals_per_epoch`` epoch.

    ``seconds`` (in the run and in each evaluation) is the wall time inside ``Controller.run``
    less the compiles the controller timed there: training only.
    """
    controller = build_controller(row, lr, splits.train, loss_fn, model, seed, s)
    per_epoch = len(splits.train["label"])
    points = [
        round(per_epoch * (i + 1) / s.evals_per_epoch) for i in range(s.epochs * s.evals_per_epoch)
    ]
    largest = max(controller.buckets)
    evals: list[dict[str, Any]] = []
    history: dict[str, list[Any]] = {"samples": [], "batch": [], "noise_scale": []}
    wall = 0.0
    for point in points:
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
        accuracy = task.evaluate(loss_fn, controller.params, None, None, splits.test)
        evals.append(
            {
                "step": controller.step_count,
                "samples": controller.sampler.samples_seen,
                "seconds": wall,
                "accuracy": accuracy,
            }
        )
    validation = task.evaluate(loss_fn, controller.params, None, None, splits.validation)
    kinds = [e.kind for e in controller.events]
    return {
        "row": row.name,
        "seed": seed,
        "lr": lr,
        "accuracy": evals[-1]["accuracy"],
        "validation": validation,
        "steps": controller.step_count,
        "samples": controller.sampler.samples_seen,
        "seconds": wall,
        "compile_seconds": controller.timings["compile"],
        "max_batch": max(history["batch"]),
        "final_batch": controller.batch_size,
        "grows": kinds.count("grow"),
        "shrinks": kinds.count("shrink"),
        "noise_scale": _finite(controller.noise_scale),
        "throughput": {
            f"{micro}x{count}": rate for (micro, count, _), rate in controller.throughput.items()
        },
        "evals": evals,
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


def target_figures(
    runs: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]], margin: float
) -> dict[str, Any]:
    """A row's steps, samples and seconds to the target against the reference row's, by seed.

    Per seed the target is the reference run's final accuracy less ``margin``; a row's figure
    is read at its first evaluation at or above it. Returns per figure the median over seeds
    that reached it and the median of the per-seed ratios to the reference (a seed that did not
    reach counts as an infinite ratio; None when the median is infinite), and ``reached``: the
    accuracy study's ``to_reference``, with its ``step`` named ``steps`` as this table names it.
    """
    out = to_reference(runs, reference, margin, figures=("step", "samples", "seconds"))
    out["steps"], out["steps_ratio"] = out.pop("step"), out.pop("step_ratio")
    return out


def best_static(runs: dict[str, list[dict[str, Any]]], rows: Sequence[Row]) -> str:
    """The static row of highest mean final validation accuracy (ties: the first)."""
    static = [r.name for r in rows if not r.elastic and runs.get(r.name)]
    return max(static, key=lambda name: statistics.mean(x["validation"] for x in runs[name]))


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Per row: final accuracy, its paired interval against best static, the target figures;
    and the targets, met or missed."""
    rows = [Row(**r) for r in report["rows"]]
    runs = report["runs"]
    best = best_static(runs, rows)
    reference = runs[best]
    margin = report["margin"]
    summary: dict[str, Any] = {"best_static": best, "rows": {}, "targets": []}
    for row in rows:
        if not runs.get(row.name):
            continue
        row_runs = sorted(runs[row.name], key=lambda r: r["seed"])
        ref_runs = sorted(reference, key=lambda r: r["seed"])
        accuracies = [r["accuracy"] for r in row_runs]
        mean, sd = mean_std(accuracies)
        diff = paired_interval(accuracies, [r["accuracy"] for r in ref_runs])
        summary["rows"][row.name] = {
            "lr": report["chosen"][row.name],
            "mean": mean,
            "sd": sd,
            "validation": statistics.mean(r["validation"] for r in row_runs),
            "diff": [x if math.isfinite(x) else None for x in diff],
            "target": target_figures(row_runs, ref_runs, margin),
            "steps": statistics.median(r["steps"] for r in row_runs),
            "seconds": statistics.median(r["seconds"] for r in row_runs),
            "max_batch": max(r["max_batch"] for r in row_runs),
        }
    for name, figure, bound in (STEPS_TARGET, WALL_TARGET):
        if name in summary["rows"]:
            ratio = summary["rows"][name]["target"][f"{figure}_ratio"]
            summary["targets"].append(
                {
                    "row": name,
                    "figure": figure,
                    "what": f"{name}: {figure} to target / best static <= {bound}",
                    "value": ratio,
                    "met": ratio is not None and ratio <= bound,
                }
            )
    for name in GOODPUT_ROWS:
        if name in summary["rows"]:
            low = summary["rows"][name]["diff"][1]
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
    return summary


# -- the report ---------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "not reached" if value is None else f"{value:{spec}}{suffix}"


def markdown(report: dict[str, Any]) -> str:
    """The table, the targets and the tuning trials."""
    summary = report["summary"]
    best = summary["best_static"]
    labels = {r["name"]: r["label"] for r in report["rows"]}
    p = report["protocol"]
    lines = [
        "### Goodput study: SmallCNN on Fashion-MNIST",
        "",
        f"{p['train_images']} train / {p['validation_images']} validation / {p['test_images']} "
        f"test images; {p['epochs']} epoch(s); AdamW (weight decay {WEIGHT_DECAY}; the Hessian "
        f"row: triaccel with alpha=0); learning-rate grid {[f'{x:.3g}' for x in p['grid']]} "
        f"tuned on seed(s) {p['tuning_seeds']} by validation accuracy; seeds {p['seeds']}; "
        f"elastic rows from batch {p['elastic_start']} up to {p['max_batch']} (square-root "
        f"learning-rate scaling), memory checks every {p['check_every']} steps; test evaluated "
        f"every 1/{p['evals_per_epoch']} epoch. Best static (validation): "
        f"**{labels[best]}**. Target per seed: its final test accuracy less "
        f"{100 * report['margin']:.1f} points.",
        "",
        "| row | lr | test accuracy % (mean ± sd) | vs best static, points (paired 95% CI) "
        "| steps to target (reached) | x best | samples to target | x best "
        "| wall s to target | x best | largest batch |",
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
            f"| {diff} | {_fmt(t['steps'], '.0f')} ({t['reached']}/{t['n']}) "
            f"| {_fmt(t['steps_ratio'], '.2f')} | {_fmt(t['samples'], '.0f')} "
            f"| {_fmt(t['samples_ratio'], '.2f')} | {_fmt(t['seconds'], '.1f')} "
            f"| {_fmt(t['seconds_ratio'], '.2f')} | {s['max_batch']} |"
        )
    lines += [
        "",
        "Figures to the target are medians over seeds, read at the test evaluations; ratios are "
        "medians of the per-seed ratios to best static (a seed not reached counts as infinite). "
        "Wall seconds are training only: time inside `Controller.run` less the compiles it "
        "timed; evaluations are outside it.",
        "",
        "Targets:",
        "",
    ]
    for target in summary["targets"]:
        value = "n/a" if target["value"] is None else f"{target['value']:.2f}"
        lines.append(f"- {target['what']}: {value}: **{'met' if target['met'] else 'missed'}**")
    lines += ["", "Tuning (validation accuracy %, mean over the tuning seeds):", ""]
    grid = report["protocol"]["grid"]
    lines.append("| row | " + " | ".join(f"lr {lr:.3g}" for lr in grid) + " | chosen |")
    lines.append("| --- |" + " --- |" * (len(grid) + 1))
    for row in report["rows"]:
        scores = report["tuning"].get(row["name"])
        if scores is None:
            continue
        cells = " | ".join(f"{100 * scores[str(lr)]:.2f}" for lr in grid)
        lines.append(f"| {row['label']} | {cells} | {report['chosen'][row['name']]:.3g} |")
    lines += ["", f"Total wall time of the study: {report['seconds'] / 60:.1f} min."]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: pathlib.Path) -> None:
    """Batch size and noise scale over samples of the elastic rows' seed-0 (first seed) runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = report["protocol"]["seeds"][0]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    batches: set[int] = set()
    for index, row in enumerate(report["rows"]):
        run = next((r for r in report["runs"].get(row["name"], []) if r["seed"] == seed), None)
        if run is None or run["history"] is None:
            continue
        history, color = run["history"], f"C{index % 10}"  # one colour per row in both panels
        batches.update(history["batch"])
        top.step(
            history["samples"], history["batch"], where="post", label=row["label"], color=color
        )
        noise = [math.nan if v is None else v for v in history["noise_scale"]]
        # The memory-only row does not measure the noise scale (its steps are not split).
        if not all(math.isnan(v) for v in noise):
            bottom.plot(history["samples"], noise, label=row["label"], color=color)
    top.set_ylabel("batch size")
    top.set_yscale("log", base=2)
    top.set_yticks(sorted(batches), [str(b) for b in sorted(batches)])
    top.minorticks_off()
    top.legend(fontsize="small")
    top.set_title(f"Elastic rows, seed {seed}")
    bottom.set_ylabel("noise scale (controller's, smoothed)")
    bottom.set_yscale("log")
    bottom.legend(fontsize="small")
    bottom.set_xlabel("training samples")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# -- the study ----------------------------------------------------------------------------------


def run_study(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Tunes every row on the tuning seeds, then trains the other seeds at the chosen rates."""
    splits = load_splits(args.quick)
    settings = Settings(args.epochs, args.evals_per_epoch, args.max_batch, args.check_every)
    model = triaccel_jax.models.SmallCNN(num_classes=10)
    loss_fn = task.make_loss(model, False, None)  # one loss: the evaluation compiles once
    rows = [r for r in make_rows(args.static_batches) if r.name in args.rows or not r.elastic]
    log(
        f"{len(splits.train['label'])} train / {len(splits.validation['label'])} validation / "
        f"{len(splits.test['label'])} test images; {args.epochs} epoch(s); grid "
        f"{[f'{x:.3g}' for x in args.lr_grid]} tuned on seed(s) {args.tuning_seeds}; seeds "
        f"{args.seeds}; rows {[r.name for r in rows]}"
    )

    def one(row: Row, lr: float, seed: int) -> dict[str, Any]:
        result = train(row, lr, seed, splits, loss_fn, model, settings)
        log(
            f"  {row.name:>15} lr {lr:.3g} seed {seed}: test {100 * result['accuracy']:.2f}% "
            f"validation {100 * result['validation']:.2f}%, {result['steps']} steps, batch "
            f"<= {result['max_batch']}, {result['seconds']:.1f} s (+{result['compile_seconds']:.1f}"
            " s compiles)"
        )
        return result

    trials: dict[str, dict[tuple[float, int], dict[str, Any]]] = {r.name: {} for r in rows}
    tuning: dict[str, dict[str, float]] = {}
    chosen: dict[str, float] = {}
    for row in rows:
        scores = []
        for lr in args.lr_grid:
            for seed in args.tuning_seeds:
                trials[row.name][(lr, seed)] = one(row, lr, seed)
            scores.append(
                statistics.mean(
                    trials[row.name][(lr, seed)]["validation"] for seed in args.tuning_seeds
                )
            )
        tuning[row.name] = {str(lr): score for lr, score in zip(args.lr_grid, scores, strict=True)}
        chosen[row.name] = args.lr_grid[max(range(len(scores)), key=lambda i: (scores[i], -i))]
        log(f"  {row.name}: chosen lr {chosen[row.name]:.3g}")
    runs: dict[str, list[dict[str, Any]]] = {r.name: [] for r in rows}
    for seed in args.seeds:
        for row in rows:
            lr = chosen[row.name]
            done = trials[row.name].get((lr, seed))
            runs[row.name].append(done if done is not None else one(row, lr, seed))
    # Histories are kept for the final runs only.
    for row_trials in trials.values():
        for result in row_trials.values():
            if not any(result is r for rs in runs.values() for r in rs):
                result["history"] = None
    return {
        "rows": [dataclasses.asdict(r) for r in rows],
        "protocol": {
            "train_images": len(splits.train["label"]),
            "validation_images": len(splits.validation["label"]),
            "test_images": len(splits.test["label"]),
            "epochs": args.epochs,
            "evals_per_epoch": args.evals_per_epoch,
            "grid": list(args.lr_grid),
            "tuning_seeds": list(args.tuning_seeds),
            "seeds": list(args.seeds),
            "elastic_start": min(args.static_batches),
            "max_batch": args.max_batch,
            "check_every": args.check_every,
            "memory_budget_bytes": BUDGET_BYTES,
        },
        "margin": args.margin,
        "chosen": chosen,
        "tuning": tuning,
        "trials": [t for row_trials in trials.values() for t in row_trials.values()],
        "runs": runs,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("goodput_output"))
    parser.add_argument("--quick", action="store_true", help="tiny subset, 1 seed, few steps")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--evals-per-epoch", type=int, default=None, help="default 8 (4 quick)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 3 4")
    parser.add_argument("--tuning-seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--lr-grid", type=float, nargs="+", default=None)
    parser.add_argument("--static-batches", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--max-batch", type=int, default=None, help="default 512 (64 quick)")
    parser.add_argument("--check-every", type=int, default=None, help="default 10 (2 quick)")
    parser.add_argument("--margin", type=float, default=0.003, help="target = best static - this")
    elastic = [r.name for r in make_rows([32]) if r.elastic]
    parser.add_argument("--rows", nargs="+", choices=elastic, default=elastic, help="elastic rows")
    args = parser.parse_args(argv)
    quick = args.quick
    args.seeds = args.seeds or ([0] if quick else [0, 1, 2, 3, 4])
    args.lr_grid = args.lr_grid or ([1e-3, 3e-3] if quick else list(DEFAULT_GRID))
    args.evals_per_epoch = args.evals_per_epoch or (4 if quick else 8)
    args.max_batch = args.max_batch or (64 if quick else 512)
    args.check_every = args.check_every or (2 if quick else 10)
    if len(args.static_batches) < 1:
        parser.error("--static-batches needs at least one size")
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
