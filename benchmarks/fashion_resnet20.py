"""Tri-Accel against FP32 AdamW: ResNet-20 on Fashion-MNIST, several seeds (issue 5's targets).

For each seed, the main job's ``fp32`` and ``triaccel`` runs (``triaccel_jax.cli._runs``:
the same model, data order, epochs and evaluation) train ResNet-20 on the real Fashion-MNIST
(60,000 / 10,000 images), with the test accuracy measured every ``--eval-every`` steps. It
prints, per seed and as mean and spread over seeds:

* the final test accuracy of each run (target: Tri-Accel's mean >= FP32's mean - 0.3 points);
* the ``memory_report`` total of one step at the reference batch under each run's final policy
  (target: Tri-Accel <= 0.70x FP32);
* the steps (and samples) Tri-Accel needed to first reach FP32's final accuracy, read from its
  evaluations (None: not reached).

Run from the repository root (the project installed, e.g. by ``bash tools/test.sh``)::

    .venv/bin/python benchmarks/fashion_resnet20.py                # 3 seeds, 1 epoch
    .venv/bin/python benchmarks/fashion_resnet20.py --quick        # a smoke test

The default takes about an hour on 2 CPU cores (ResNet-20 steps are slow on a CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from tqdm.auto import tqdm

from triaccel_jax.cli import _arguments as arguments
from triaccel_jax.cli import _runs as runs
from triaccel_jax.cli import _task as task


def steps_to_reach(evals, accuracy):
    for point in evals:
        if point["accuracy"] >= accuracy:
            return point["step"], point["samples"]
    return None, None


def spread(values):
    return f"{100 * statistics.mean(values):.2f}% (min {100 * min(values):.2f}, max {100 * max(values):.2f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--quick", action="store_true", help="2 seeds, 20 steps, data subsets")
    args = parser.parse_args(argv)
    job = ["--dataset", "fashion_mnist", "--model", "resnet20", "--epochs", str(args.epochs)]
    job += ["--eval-every", str(args.eval_every), "--no-progress"]
    if args.quick:
        args.seeds = args.seeds[:2]
        job += ["--max-steps", "20", "--train-subset", "4096", "--test-subset", "1000"]
        job += ["--eval-every", "10", "--replan-every", "10"]
    job_args = arguments.fill_workload(arguments.parse_args(job), "fashion_mnist")
    data = task.load_data(
        "fashion_mnist",
        data_dir=None,
        train_subset=job_args.train_subset,
        test_subset=job_args.test_subset,
    )
    print(f"ResNet-20 on {data.name} ({len(data.train['label'])} / {len(data.test['label'])})")
    rows = []
    for seed in args.seeds:
        job_args.seed = seed
        results = {}
        for run in ("fp32", "triaccel"):
            start = time.perf_counter()
            results[run] = runs.train_run(run, data, job_args, tqdm(disable=True))
            print(
                f"seed {seed} {run:>8}: accuracy {100 * results[run].accuracy:.2f}%, "
                f"{results[run].steps} steps, final batch {results[run].final_batch}, "
                f"memory_report {results[run].memory_mib:.1f} MiB, "
                f"{time.perf_counter() - start:.0f} s",
                flush=True,
            )
        reach_step, reach_samples = steps_to_reach(
            results["triaccel"].evals, results["fp32"].accuracy
        )
        rows.append(
            {
                "seed": seed,
                "fp32_accuracy": results["fp32"].accuracy,
                "triaccel_accuracy": results["triaccel"].accuracy,
                "fp32_steps": results["fp32"].steps,
                "triaccel_steps": results["triaccel"].steps,
                "memory_ratio": results["triaccel"].memory_mib / results["fp32"].memory_mib,
                "fp32_memory_mib": results["fp32"].memory_mib,
                "triaccel_memory_mib": results["triaccel"].memory_mib,
                "steps_to_fp32_final": reach_step,
                "samples_to_fp32_final": reach_samples,
                "triaccel_policy": results["triaccel"].policies[-1]["leaves"]
                if results["triaccel"].policies
                else None,
            }
        )
        print(
            f"seed {seed}: Tri-Accel reached FP32's final accuracy after {reach_step} steps "
            f"({reach_samples} samples; FP32 took {results['fp32'].steps} steps)",
            flush=True,
        )

    fp32 = [r["fp32_accuracy"] for r in rows]
    tri = [r["triaccel_accuracy"] for r in rows]
    ratios = [r["memory_ratio"] for r in rows]
    print("\n== summary ==")
    print(f"FP32 AdamW test accuracy: {spread(fp32)}")
    print(f"Tri-Accel  test accuracy: {spread(tri)}")
    difference = 100 * (statistics.mean(tri) - statistics.mean(fp32))
    print(f"difference of means: {difference:+.2f} points (target >= -0.30)")
    print(
        f"memory_report Tri-Accel / FP32: mean {statistics.mean(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}; target <= 0.70)"
    )
    print(
        "steps for Tri-Accel to reach FP32's final accuracy: "
        + ", ".join(f"seed {r['seed']}: {r['steps_to_fp32_final']}" for r in rows)
        + f" (FP32 ran {rows[0]['fp32_steps']} steps)"
    )
    if args.json:
        with open(args.json, "w") as stream:
            json.dump(rows, stream, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
