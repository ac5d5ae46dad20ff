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
import os
import pathlib
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax

# The study's parts are the package benchmarks/accuracy/, imported from this folder.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from accuracy.report import section
from accuracy.runs import ROWS
from accuracy.runs import Hyper
from accuracy.runs import train
from accuracy.tuning import tune
from accuracy.workloads import DEFAULT_WORKLOADS
from accuracy.workloads import WORKLOADS
from accuracy.workloads import Workload
from accuracy.workloads import load_splits

from triaccel_jax.cli import _compilation_cache as compilation_cache


def run_workload(
    workload: Workload, args: argparse.Namespace, log: Callable[[str], None]
) -> dict[str, Any]:
    """Tunes, then trains every row for every seed; returns the raw figures."""
    if args.quick:
        # One batch bucket above the start, not two: each bucket is a compile per run.
        workload = dataclasses.replace(
            workload, max_batch=min(workload.max_batch, 2 * workload.batch)
        )
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
    if args.chosen_from is not None:
        chosen = chosen_earlier(args.chosen_from, workload.name)
        log(f"  chosen earlier ({args.chosen_from}): {chosen['fp32']}, {chosen['triaccel']}")
    else:
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
        "chosen_from": None if args.chosen_from is None else str(args.chosen_from),
        "runs": runs,
    }


def chosen_earlier(path: pathlib.Path, workload: str) -> dict[str, Any]:
    """The hyperparameters (and tuning trials) an earlier study chose for ``workload``."""
    for result in json.loads(path.read_text())["workloads"]:
        if result["workload"] == workload:
            chosen = {name: Hyper(**result["chosen"][name]) for name in ("fp32", "triaccel")}
            return {**chosen, "trials": result["tuning"]}
    raise ValueError(f"{path} holds no results of {workload!r}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=sorted(WORKLOADS),
        default=None,
        help=f"default: {' '.join(DEFAULT_WORKLOADS)}",
    )
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
    parser.add_argument(
        "--chosen-from",
        type=pathlib.Path,
        default=None,
        help="skip tuning: train at the hyperparameters chosen in this earlier accuracy.json",
    )
    parser.add_argument(
        "--from-json",
        type=pathlib.Path,
        nargs="+",
        default=None,
        help="only write the tables from these accuracy.json files (no training)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.workloads = args.workloads or ["digits_mlp"]
        args.seeds = args.seeds or [0, 1]
        args.trials = args.trials or 2
    args.workloads = args.workloads or list(DEFAULT_WORKLOADS)
    args.seeds = args.seeds or [0, 1, 2, 3, 4]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(message, flush=True)

    if args.from_json is not None:
        # Re-renders the tables from raw figures already measured: nothing is trained.
        report = {"workloads": []}
        for path in args.from_json:
            loaded = json.loads(path.read_text())
            report = {**loaded, "workloads": report["workloads"] + loaded["workloads"]}
        report["margin"] = args.margin
        write_markdown(report, args.out / "accuracy.md", log)
        return 0

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
        "machine": (
            f"{platform.machine()}, {os.cpu_count()} CPU cores, "
            f"{jax.device_count()} {jax.default_backend()} device(s)"
        ),
        "jax": jax.__version__,
        "margin": args.margin,
        "workloads": results,
    }
    (args.out / "accuracy.json").write_text(json.dumps(report, indent=1))
    write_markdown(report, args.out / "accuracy.md", log)
    return 0


def write_markdown(report: dict[str, Any], path: pathlib.Path, log: Callable[[str], None]) -> None:
    """Writes (and logs) the markdown sections of every workload in ``report``."""
    text = "\n\n".join(section(r, report["margin"]) for r in report["workloads"]) + "\n"
    path.write_text(text)
    log(text)
    log(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
