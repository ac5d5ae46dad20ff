"""Trial of one improvement to Tri-Accel: per-block step scales (``TriAccelConfig(scale="block")``).

Issue 15 asks, since Tri-Accel does not beat tuned FP32 AdamW (docs/accuracy.md), for an
improvement within the design's spirit, validated on the validation split. This driver compares
three optimizers with the study's protocol and pieces (``benchmarks/accuracy/``: workloads,
splits, controllers, tuning grid, statistics), each at a fixed batch in float32 so that only the
step rule differs:

* ``adamw``: ``optax.adamw`` (the study's ``fp32`` row);
* ``leaf``: ``triaccel`` with its default per-leaf scale (the study's ``curvature`` row);
* ``block``: the same with ``config=TriAccelConfig(scale="block")``.

Tuning: each optimizer gets the same number of trials on the validation split at the study's
tuning seed: AdamW that many log-spaced learning rates; each Tri-Accel variant the study's
Tri-Accel scheme (``trials - trials // 3`` learning rates over the same range, then the study's
``alpha``/clip variants at the best of them). Unlike the study, the Tri-Accel variants are tuned
on the fixed-batch ``curvature`` row, not the elastic-batch ``triaccel`` row, because the option
changes the step rule only. Final runs: every optimizer at its chosen hyperparameters for each
seed, scored on the validation split (the figures that may justify a default) and on the test
set; paired (same seed) 95% t-intervals of the differences.

Run from the repository root::

    nice -n 10 .venv/bin/python benchmarks/improvement_trial.py --workload digits_mlp \\
        --out /tmp/improvement
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import pathlib
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import jax

# The study's parts are the package benchmarks/accuracy/, imported from this folder.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from accuracy.runs import Hyper
from accuracy.runs import build_controller
from accuracy.stats import mean_std
from accuracy.stats import paired_interval
from accuracy.tuning import TRIACCEL_VARIANTS
from accuracy.tuning import TUNING_SEED
from accuracy.tuning import log_grid
from accuracy.tuning import tuning_trials
from accuracy.workloads import WORKLOADS
from accuracy.workloads import Splits
from accuracy.workloads import Workload
from accuracy.workloads import load_splits

import triaccel_jax
from triaccel_jax._src import compilation_cache
from triaccel_jax.cli import _task as task

OPTIMIZERS = ("adamw", "leaf", "block")
STUDY_ROW = {"adamw": "fp32", "leaf": "curvature", "block": "curvature"}


@contextlib.contextmanager
def step_scale(kind: str) -> Iterator[None]:
    """Within the block, the study's controllers build ``triaccel`` with ``scale=kind``.

    ``build_controller`` looks ``triaccel_jax.triaccel`` up when it is called; swapping it for a
    wrapper that adds the config reuses the study's controller unchanged. The wrapper keeps the
    factory's signature (``functools.wraps``), which ``optax.inject_hyperparams`` binds against.
    """
    original = triaccel_jax.triaccel

    @functools.wraps(original)
    def with_scale(*args: Any, **kwargs: Any) -> Any:
        # inject_hyperparams applies the defaults, so config arrives as None.
        if kwargs.pop("config", None) is not None:
            raise ValueError("the trial sets the config itself")
        return original(*args, config=triaccel_jax.TriAccelConfig(scale=kind), **kwargs)

    triaccel_jax.triaccel = with_scale
    try:
        yield
    finally:
        triaccel_jax.triaccel = original


def train(
    name: str, hyper: Hyper, workload: Workload, splits: Splits, seed: int, epochs: int
) -> dict[str, Any]:
    """Trains one run; returns its validation and test accuracy at the end."""
    kind = "block" if name == "block" else "leaf"
    with step_scale(kind):
        controller, loss_fn = build_controller(STUDY_ROW[name], hyper, workload, splits.train, seed)
    samples = epochs * len(splits.train.train["label"])
    start = time.perf_counter()
    while controller.sampler.samples_seen < samples:
        controller.step()
    seconds = time.perf_counter() - start

    def accuracy(data: dict[str, Any]) -> float:
        return task.evaluate(
            loss_fn, controller.params, controller.model_state, controller.policy, data
        )

    return {
        "optimizer": name,
        "seed": seed,
        "hyper": dataclasses.asdict(hyper),
        "validation": accuracy(splits.validation),
        "test": accuracy(splits.test),
        "steps": controller.step_count,
        "seconds": seconds,
    }


def tune(
    name: str,
    workload: Workload,
    splits: Splits,
    trials: int,
    epochs: int,
    log: Callable[[str], None],
) -> tuple[Hyper, list[dict[str, Any]]]:
    """The study's tuning scheme for one optimizer, on the validation split at the tuning seed."""
    adamw_trials, lr_count, variant_count = tuning_trials(trials, workload.lr_range)
    records: list[dict[str, Any]] = []

    def score(hyper: Hyper) -> float:
        result = train(name, hyper, workload, splits, TUNING_SEED, epochs)
        records.append({"hyper": dataclasses.asdict(hyper), "validation": result["validation"]})
        log(f"  tune {name:>5} {hyper}: validation {100 * result['validation']:.2f}%")
        return result["validation"]

    if name == "adamw":
        scored = [(score(h), i, h) for i, h in enumerate(adamw_trials)]
    else:
        lrs = log_grid(*workload.lr_range, lr_count)
        scored = [(score(Hyper(lr)), i, Hyper(lr)) for i, lr in enumerate(lrs)]
        for alpha, low, high in TRIACCEL_VARIANTS[:variant_count]:
            best_lr = max(scored, key=lambda s: (s[0], -s[1]))[2].lr
            hyper = Hyper(best_lr, alpha, low, high)
            scored.append((score(hyper), len(scored), hyper))
    # Ties go to the earlier trial, as in the study.
    return max(scored, key=lambda s: (s[0], -s[1]))[2], records


def summary_table(result: dict[str, Any]) -> str:
    """Markdown: per optimizer, chosen hyperparameters, validation and test figures."""
    runs = result["runs"]
    lines = [
        "| optimizer | chosen lr, alpha, clip | validation % (mean ± std) "
        "| vs AdamW (val, paired 95% CI) | test % (mean ± std) | vs AdamW (test, paired 95% CI) "
        "| vs leaf (test, paired 95% CI) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    def interval(a: list[float], b: list[float]) -> str:
        d, low, high = (100 * x for x in paired_interval(a, b))
        return f"{d:+.2f} [{low:+.2f}, {high:+.2f}]"

    figures = {
        name: {split: [r[split] for r in runs[name]] for split in ("validation", "test")}
        for name in runs
    }
    for name in runs:
        hyper = result["chosen"][name]
        chosen = f"{hyper['lr']:.3g}"
        if name != "adamw":
            chosen += f", {hyper['alpha']}, [{hyper['min_scale']}, {hyper['max_scale']}]"
        cells = [name, chosen]
        for split in ("validation", "test"):
            mean, std = mean_std(figures[name][split])
            cells.append(f"{100 * mean:.2f} ± {100 * std:.2f} ({len(figures[name][split])})")
            cells.append(
                interval(figures[name][split], figures["adamw"][split])
                if name != "adamw" and "adamw" in figures
                else "—"
            )
        cells.append(
            interval(figures[name]["test"], figures["leaf"]["test"])
            if name == "block" and "leaf" in figures
            else "—"
        )
        lines.append("| " + " | ".join(cells) + " |")
    if "block" in figures and "leaf" in figures:
        lines.append("")
        lines.append(
            "block vs leaf on validation (paired 95% CI): "
            + interval(figures["block"]["validation"], figures["leaf"]["validation"])
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="digits_mlp")
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--trials", type=int, default=None, help="default: the workload's")
    parser.add_argument("--epochs", type=int, default=None, help="default: the workload's")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("improvement_output"))
    parser.add_argument(
        "--chosen",
        nargs="+",
        default=[],
        metavar="NAME=LR[,ALPHA,MIN,MAX]",
        help="skip tuning NAME: train at these hyperparameters (e.g. chosen by an earlier tuning "
        "with the same protocol, such as the accuracy study's AdamW)",
    )
    parser.add_argument("--quick", action="store_true", help="1 epoch, 2 seeds, 2 trials")
    args = parser.parse_args(argv)
    given = {}
    for item in args.chosen:
        name, _, values = item.partition("=")
        if name not in OPTIMIZERS:
            parser.error(f"--chosen: unknown optimizer {name!r}")
        given[name] = Hyper(*(float(v) for v in values.split(",")))
    args.chosen = given
    if args.quick:
        args.seeds, args.trials, args.epochs = args.seeds[:2], args.trials or 2, args.epochs or 1
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    workload = WORKLOADS[args.workload]
    epochs = args.epochs or workload.epochs
    trials = args.trials or workload.trials

    def log(message: str) -> None:
        print(message, flush=True)

    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    splits = load_splits(workload, args.quick)
    chosen, tuning, runs = {}, {}, {}
    # Every seed compiles the same programs again; a persistent cache compiles each once.
    with (
        tempfile.TemporaryDirectory() as cache,
        compilation_cache.persistent_cache(pathlib.Path(cache)),
    ):
        for name in args.optimizers:
            if name in args.chosen:
                chosen[name], tuning[name] = args.chosen[name], []
            else:
                chosen[name], tuning[name] = tune(name, workload, splits, trials, epochs, log)
            log(f"{name}: chose {chosen[name]}")
        for name in args.optimizers:
            runs[name] = []
            for seed in args.seeds:
                run = train(name, chosen[name], workload, splits, seed, epochs)
                runs[name].append(run)
                log(
                    f"  seed {seed} {name:>5}: validation {100 * run['validation']:.2f}%, "
                    f"test {100 * run['test']:.2f}%, {run['seconds']:.1f} s"
                )
                # Written after every run, so that a run cut short keeps what it measured.
                write_json(args, workload, epochs, trials, started, chosen, tuning, runs)
    result = write_json(args, workload, epochs, trials, started, chosen, tuning, runs)
    table = summary_table({**result, "runs": {k: v for k, v in runs.items() if v}})
    (args.out / "improvement.md").write_text(table + "\n")
    log(table)
    return 0


def write_json(
    args: argparse.Namespace,
    workload: Workload,
    epochs: int,
    trials: int,
    started: str,
    chosen: dict[str, Hyper],
    tuning: dict[str, Any],
    runs: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    """Writes the raw figures so far to ``improvement.json``; returns them."""
    result = {
        "workload": workload.name,
        "epochs": epochs,
        "trials": trials,
        "seeds": args.seeds,
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {jax.default_backend()}, jax {jax.__version__}",
        "chosen": {k: dataclasses.asdict(v) for k, v in chosen.items()},
        "chosen_given": sorted(args.chosen),
        "tuning": tuning,
        "runs": runs,
    }
    (args.out / "improvement.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(main())
