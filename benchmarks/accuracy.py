"""Accuracy study (issue 24): AdamW, Tri-Accel, Muon and Tri-Accel's scale over Muon, tuned alike.

Protocol (issue 24, extending the earlier study's; the goodput study's splits). Each workload
trains on Fashion-MNIST's full training set less a validation split held out of it (6,000
images, the same fixed random choice as benchmarks/goodput.py: 54,000 training images); the test
set (10,000 images) is read by the final runs only. Workloads (``--workloads``):

* ``fashion_cnn``: ``triaccel_jax.models.SmallCNN``, 2 epochs;
* ``fashion_mlp``: the 784-128-10 MLP with a sigmoid hidden layer of AlgoPerf's MNIST workload,
  3 epochs;

both at batch 128 (``--epochs`` overrides the epochs; ``digits_mlp`` and ``fashion_resnet20``
remain available but are not in the default set). Every run trains through
``triaccel_jax.Controller``.

Rows (``--rows``). Four optimizers, each at a fixed batch of 128 in float32 (one bucket,
``batch_rule="memory"``, no learning-rate scaling):

* ``adamw``: ``optax.adamw`` (weight decay 1e-4), the reference;
* ``triaccel``: ``triaccel_jax.triaccel`` as today (AdamW's direction with the curvature step
  scale);
* ``muon``: ``optax.contrib.muon`` alone (weight decay 1e-4 on both parts; its Adam part's
  learning rate is ``adam_ratio`` times Muon's; conv kernels trained by Muon as folded matrices
  through ``triaccel_jax.transforms.muon_dimension_numbers``, or by Adam, as tuned);
* ``triaccel_muon``: ``triaccel_jax.scale_by_curvature`` over that Muon (Tri-Accel's step scale
  over Muon's direction);

and each again with planned precision and the goodput batch on (``adamw_adapt``,
``triaccel_adapt``, ``muon_adapt``, ``triaccel_muon_adapt``): precision re-planned at step 20 and
every 100 steps (the controller's default ``precision_rule="speed"``; on a CPU it lowers a leaf
only where memory needs it), the batch moved by goodput (``batch_rule="goodput"``) from 128
within [32, 512] with square-root learning-rate scaling, under a fixed 2 GiB
``BudgetMemoryProbe``. AdamW and Muon get ``triaccel_jax.curvature_signals()`` first in their
chain there (the updates are unchanged; the planner and the controller read its signals); each
optimizer is built inside ``optax.inject_hyperparams`` so that the controller scales its one
injected ``learning_rate`` (Muon's Adam part follows it).

Tuning: every optimizer gets the same ``--trials`` (default 6) trials on the validation split,
one run each at tuning seed 1000 (not an evaluation seed), scored by the final validation
accuracy (ties to the earlier trial): AdamW 6 log-spaced learning rates; Tri-Accel 4 rates over
the same range at its defaults, then ``bound="smooth"`` and ``alpha`` 1 with [0.25, 4] at the best
rate; Muon 4 rates over its own range (Muon's step is an orthogonalized matrix), then conv kernels
to Adam (the CNN only; the MLP has none, and tries the Adam part at 0.03x instead) and its Adam
part at 0.3x Muon's rate; Tri-Accel over Muon starts from Muon's chosen options, 4 rates, then
Tri-Accel's two options (see accuracy/tuning.py). The ``_adapt`` rows are not tuned again: they
train at their base row's choice (the tables say so).

Final runs: every row at its chosen hyperparameters for each of ``--seeds`` (default 0-4; a seed
fixes the initialisation and the data order in every row), evaluated on the test set 8 times per
epoch. Figures per workload: test accuracy mean ± sd; the paired (same seed) 95% t-interval
against AdamW; per seed the steps, samples and wall seconds (training only: inside
``Controller.run`` less the compiles it timed) to AdamW's final test accuracy in that seed (less
``--margin``, default 0), as medians and as the median of per-seed ratios to AdamW's own figures
to it; the largest batch; re-plans; ``memory_report``'s total. The ablation gives paired intervals
of what Tri-Accel's step scale adds over its direction alone (``triaccel - adamw``,
``triaccel_muon - muon``, and the same with the adaptations on) and what the adaptations add to
each optimizer. Targets, each printed met or missed: a configuration the library ships (every row
but ``adamw`` and ``muon``) beats tuned AdamW on ``fashion_cnn`` by at least +0.5 points with a
paired 95% interval that excludes 0, or reaches AdamW's final accuracy in at most 0.7x its steps;
and the ablation reports the step scale's intervals. ``accuracy.md`` (tables) and
``accuracy.json`` (every run, every tuning trial, the summaries) go to ``--out``.

Run from the repository root::

    nice -n 10 .venv/bin/python benchmarks/accuracy.py --out /tmp/accuracy       # the study
    .venv/bin/python benchmarks/accuracy.py --quick --out /tmp/accuracy_quick      # a smoke test
    .venv/bin/python benchmarks/accuracy.py --from-json /tmp/accuracy/accuracy.json --out /tmp/t
    nice -n 10 .venv/bin/python benchmarks/accuracy.py \
        --confirm-from /tmp/accuracy/accuracy.json --out /tmp/confirm                 # a default

The report ends with what the validation split picks: the configurations ranked by their chosen
trial's validation accuracy, and for Tri-Accel's step scale (over Adam's and over Muon's
direction) the option with the largest mean gain over the defaults at the same learning rate.
A picked option changes a library default only after ``--confirm-from`` (accuracy/confirm.py)
has run it against the defaults on the validation split at four more tuning seeds (1001-1004)
and the paired 95% interval over every (workload, seed) pair lies above 0.

Runtime (an estimate, not a measured full study): on 2 quiet CPU cores one 54,000-image epoch of
the small CNN at batch 128 measured 24-26 s of training under AdamW and Tri-Accel, 31-32 s under
the Muon rows and 19-29 s under the adapt rows (their batch moves), and a test evaluation 1.1 s;
the MLP's epoch 0.7-2.3 s. The default study is, per workload, 4 x 6 tuning runs and 8 rows x 5
seeds = 64 runs: about 70 minutes for ``fashion_cnn`` (25 of them tuning) and about 10 for
``fashion_mlp``, so about 1.5 hours in all, and about twice that beside other jobs.

``--quick`` runs every row end to end on ``fashion_mlp`` (unless ``--workloads`` says otherwise)
with 768 training, 256 validation and 512 test images, 1 epoch, batch 32 growing to 64, checks
every 2 steps and re-plans from step 4 every 8, 3 trials per optimizer and seeds 0 and 1: about
45 s here (the CNN's adds about 2.5 minutes, mostly compiles); its figures mean nothing.
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

from accuracy.confirm import confirm
from accuracy.report import defaults_text
from accuracy.report import section
from accuracy.report import summarize
from accuracy.runs import BASE_ROWS
from accuracy.runs import LEGACY_ROWS
from accuracy.runs import ROWS
from accuracy.runs import Hyper
from accuracy.runs import Schedule
from accuracy.runs import base_row
from accuracy.runs import train
from accuracy.tuning import tune
from accuracy.workloads import DEFAULT_WORKLOADS
from accuracy.workloads import WORKLOADS
from accuracy.workloads import Workload
from accuracy.workloads import load_splits

from triaccel_jax._src import compilation_cache

# --quick: batch 32 growing to 64 (two buckets: each is a compile per run), checks every 2
# steps, a first plan at step 4 and re-plans every 8.
QUICK_BATCH, QUICK_MAX_BATCH = 32, 64
QUICK_SCHEDULE = Schedule(check_every=2, first_replan=4, replan_every=8)
QUICK_WORKLOADS = ("fashion_mlp",)


def run_workload(
    workload: Workload, args: argparse.Namespace, log: Callable[[str], None]
) -> dict[str, Any]:
    """Tunes the base rows, then trains every row for every seed; returns the raw figures."""
    schedule = Schedule()
    if args.quick:
        workload = dataclasses.replace(workload, batch=QUICK_BATCH, max_batch=QUICK_MAX_BATCH)
        schedule = QUICK_SCHEDULE
    splits = load_splits(workload, args.quick)
    epochs = args.epochs or (1 if args.quick else workload.epochs)
    evals_per_epoch = args.evals_per_epoch or (4 if args.quick else workload.evals_per_epoch)
    bases = [row for row in BASE_ROWS if any(base_row(r) == row for r in args.rows)]
    log(
        f"{workload.name}: {len(splits.train.train['label'])} train / "
        f"{len(splits.validation['label'])} validation / {len(splits.test['label'])} test, "
        f"{epochs} epochs, rows {args.rows}"
    )
    start = time.perf_counter()
    trials = args.trials or workload.trials
    if args.chosen_from is not None:
        chosen = chosen_earlier(args.chosen_from, workload.name)
        missing = [b for b in bases if b not in chosen]
        if missing:
            raise SystemExit(f"{args.chosen_from} chose nothing for {missing} on {workload.name}")
        log(f"  chosen earlier ({args.chosen_from}): {chosen}")
    else:
        chosen = tune(workload, splits, trials, epochs, log, rows=bases, schedule=schedule)
    tuning_seconds = time.perf_counter() - start
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row in args.rows}
    for seed in args.seeds:
        for row in args.rows:
            result = train(
                row,
                chosen[base_row(row)],
                workload,
                splits.train,
                splits.test,
                seed,
                epochs=epochs,
                evals_per_epoch=evals_per_epoch,
                schedule=schedule,
            )
            runs[row].append(result)
            log(
                f"  seed {seed} {row:>19}: test {100 * result['accuracy']:.2f}%, "
                f"{result['steps']} steps, batch <= {result['run_batch']}, "
                f"{result['seconds']:.1f} s (+{result['compile_seconds']:.1f} s compiles), "
                f"{result['plans']} re-plans ({result['replans']} changed the policy)"
            )
    return {
        "workload": workload.name,
        "description": workload.description,
        "has_conv": workload.has_conv,
        "train_images": len(splits.train.train["label"]),
        "validation_images": len(splits.validation["label"]),
        "test_images": len(splits.test["label"]),
        "epochs": epochs,
        "evals_per_epoch": evals_per_epoch,
        "batch": workload.batch,
        "max_batch": workload.max_batch,
        "schedule": dataclasses.asdict(schedule),
        "trials": trials,
        "chosen": {k: dataclasses.asdict(chosen[k]) for k in bases},
        "tuning": chosen["trials"],
        "tuning_seconds": tuning_seconds,
        "seconds": time.perf_counter() - start,
        "chosen_from": None if args.chosen_from is None else str(args.chosen_from),
        "runs": runs,
    }


def chosen_earlier(path: pathlib.Path, workload: str) -> dict[str, Any]:
    """The hyperparameters (and tuning trials) an earlier study chose for ``workload``.

    An earlier study's ``fp32`` and ``triaccel`` choices stand for ``adamw`` and ``triaccel``.
    """
    legacy = {**LEGACY_ROWS, "triaccel": "triaccel"}
    for result in json.loads(path.read_text())["workloads"]:
        if result["workload"] == workload:
            chosen = {
                legacy.get(name, name): Hyper(**hyper) for name, hyper in result["chosen"].items()
            }
            trials = {legacy.get(name, name): t for name, t in result["tuning"].items()}
            return {**chosen, "trials": trials}
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
        help="tuning trials per optimizer (default: the workload's, 6; --quick 3)",
    )
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument(
        "--epochs", type=int, default=None, help="override every workload's (CNN 2, MLP 3)"
    )
    parser.add_argument(
        "--evals-per-epoch", type=int, default=None, help="test evaluations per epoch (default 8)"
    )
    parser.add_argument(
        "--margin",
        type=float,
        default=0.0,
        help="target per seed = AdamW's final test accuracy less this (a fraction; default 0)",
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("accuracy_output"))
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test: every row on a tiny subset of fashion_mlp (unless --workloads), "
        "1 epoch, 2 seeds, 3 trials",
    )
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
    parser.add_argument(
        "--confirm-from",
        type=pathlib.Path,
        nargs="+",
        default=None,
        help="no study: run the step-scale options these accuracy.json files pick against the "
        "defaults on the validation split at more tuning seeds (confirm.json)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        # The MLP's programs compile in seconds; the CNN's adapt rows take minutes of compiles.
        args.workloads = args.workloads or list(QUICK_WORKLOADS)
        args.seeds = args.seeds or [0, 1]
        args.trials = args.trials or 3
    args.workloads = args.workloads or list(DEFAULT_WORKLOADS)
    args.seeds = args.seeds or [0, 1, 2, 3, 4]
    args.rows = [row for row in ROWS if row in args.rows]  # the table's order
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(message, flush=True)

    if args.confirm_from is not None:
        results = [
            w for path in args.confirm_from for w in json.loads(path.read_text())["workloads"]
        ]
        verdicts = [confirm(results, row, log) for row in ("triaccel", "triaccel_muon")]
        kept = [v for v in verdicts if v is not None]
        (args.out / "confirm.json").write_text(json.dumps(kept, indent=1))
        for verdict in kept:
            log(
                f"{verdict['row']}: option {verdict['option']} - defaults, validation, "
                f"{verdict['pairs']} (workload, seed) pairs: {100 * verdict['mean']:+.2f} points "
                f"[{100 * verdict['low']:+.2f}, {100 * verdict['high']:+.2f}]: "
                + ("confirmed" if verdict["confirmed"] else "not confirmed: the defaults stay")
            )
        return 0

    if args.from_json is not None:
        # Re-renders the tables from raw figures already measured: nothing is trained.
        report: dict[str, Any] = {"workloads": [], "seconds": 0.0}
        for path in args.from_json:
            loaded = json.loads(path.read_text())
            report = {
                **loaded,
                "workloads": report["workloads"] + loaded["workloads"],
                # Studies run one after another: their wall times add up.
                "seconds": report["seconds"] + loaded.get("seconds", 0.0),
            }
        report["margin"] = args.margin
        write_markdown(report, args.out / "accuracy.md", log)
        return 0

    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    start = time.perf_counter()
    try:
        # Every seed compiles the same programs again; a persistent cache compiles each once.
        with (
            tempfile.TemporaryDirectory() as cache,
            compilation_cache.persistent_cache(pathlib.Path(cache)),
        ):
            results = [run_workload(WORKLOADS[name], args, log) for name in args.workloads]
    except FileNotFoundError as error:
        print(f"accuracy.py needs its data set: {error}", file=sys.stderr)
        return 2
    for result in results:
        result["summary"] = summarize(result, args.margin)
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
    text = "\n\n".join(section(r, report["margin"]) for r in report["workloads"])
    text += "\n\n" + defaults_text(report["workloads"])
    if "seconds" in report:
        text += f"\n\nTotal wall time of the study: {report['seconds'] / 60:.1f} min."
    path.write_text(text + "\n")
    log(text)
    log(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
