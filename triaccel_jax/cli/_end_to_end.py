"""The main job end to end, one run per process: time to FP32's accuracy, memory, throughput.

``benchmarks/gpu_check.py --sections end-to-end`` runs the main job three times, FP32
AdamW and static bf16 AdamW at a fixed batch and Tri-Accel growing its batch into free memory,
each in a process of its own (``peak_bytes_in_use`` is a process-wide high-water mark, and a
fresh process compiles from an empty in-memory cache, as a user's run does). It reads each run's
``results.json`` and prints, per run: steady-state samples per second, compile seconds,
``peak_bytes_in_use`` at the batch the run trained at and at the common batch (on CPU, which
has no memory statistics, ``memory_report``'s figure instead, labelled so), the wall time to
reach FP32's final test accuracy with and without compiles, and the final accuracy; then each
target as a ratio, "met" or "missed".
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from triaccel_jax.cli._results import time_to_accuracy

RUNS = ("fp32", "bf16", "triaccel")
LABELS = {"fp32": "FP32 AdamW", "bf16": "static bf16 AdamW", "triaccel": "Tri-Accel"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The main job's settings shared by the three runs (see ``python -m triaccel_jax -h``).

    ``timeout_s`` bounds each fixed run's process and ``triaccel_timeout_s`` (default the same)
    Tri-Accel's, which compiles a step per batch bucket and policy, so the section fits its
    budget.
    """

    dataset: str = "auto"
    model: str = "resnet18"
    image_shape: str = "32x32x3"
    epochs: int = 1
    batch_size: int = 128
    max_batch: int = 1024
    eval_every: int = 40
    check_every: int = 10
    train_subset: int | None = None
    test_subset: int | None = 2000
    max_steps: int | None = None
    timeout_s: float = 100.0
    triaccel_timeout_s: float | None = None
    # On a GPU a grown batch's step compiles on a worker thread while training goes on; a tiny
    # CPU check compiles it in the step that decides, so that the grow happens within its steps.
    compile_in_background: bool = True

    def timeout(self, run: str) -> float:
        """Seconds ``run``'s process may take."""
        if run == "triaccel" and self.triaccel_timeout_s is not None:
            return self.triaccel_timeout_s
        return self.timeout_s

    def arguments(self, run: str, output: pathlib.Path, cache: pathlib.Path) -> list[str]:
        """The main job's command-line arguments for ``run``."""
        args = ["--runs", run, "--dataset", self.dataset, "--model", self.model]
        args += ["--image-shape", self.image_shape, "--epochs", str(self.epochs)]
        args += ["--batch-size", str(self.batch_size), "--max-batch", str(self.max_batch)]
        args += ["--eval-every", str(self.eval_every), "--check-every", str(self.check_every)]
        args += ["--no-progress", "--no-plots"]
        args.append(
            "--compile-in-background"
            if self.compile_in_background
            else "--no-compile-in-background"
        )
        for name in ("train_subset", "test_subset", "max_steps"):
            if getattr(self, name) is not None:
                args += [f"--{name.replace('_', '-')}", str(getattr(self, name))]
        return [*args, "--output-dir", str(output / run), "--compilation-cache", str(cache)]


QUICK = Settings(
    dataset="digits",
    model="small_cnn",
    image_shape="16x16x3",
    epochs=2,
    batch_size=16,
    max_batch=32,
    eval_every=4,
    check_every=2,
    train_subset=256,
    test_subset=128,
    max_steps=8,
    timeout_s=120.0,
    compile_in_background=False,
)


def run_in_process(
    run: str, settings: Settings, output: pathlib.Path, cache: pathlib.Path
) -> dict[str, Any]:
    """Runs the main job for ``run`` alone in a new process; returns its ``results.json`` record.

    Raises:
      RuntimeError: the process failed or ran past ``settings.timeout_s``; the message holds
        the end of its output.
    """
    output, cache = output.resolve(), cache.resolve()
    command = [sys.executable, "-m", "triaccel_jax", *settings.arguments(run, output, cache)]
    start = time.perf_counter()
    # Run from the output folder: `-m` puts the working directory first on sys.path, and a
    # checkout's triaccel_jax/ lacks the kernels that an installed (or assembled) one has.
    (output / run).mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=settings.timeout(run), cwd=output / run
        )
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(f"{run}: ran past {settings.timeout(run):.0f} s") from error
    if done.returncode != 0:
        raise RuntimeError(f"{run}: exit {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    record = json.loads((output / run / "results.json").read_text())
    result = record["results"][0]
    result["platform"] = record["platform"]
    result["process_seconds"] = time.perf_counter() - start
    return result


def memory_figures(run: dict[str, Any]) -> tuple[str, float | None, float | None]:
    """(label, MiB at the batch trained at, MiB at the common batch) of ``run``.

    ``peak_bytes_in_use`` where the device reports it, else ``memory_report``'s total.
    """
    if run.get("peak_bytes_in_use_mib") is not None:
        return (
            "peak_bytes_in_use",
            run["peak_bytes_in_use_mib"],
            run["common_batch_peak_bytes_in_use_mib"],
        )
    return "memory_report", run["run_batch_memory_mib"], run["common_batch_memory_mib"]


def _ratio_line(name: str, value: float | None, target: float) -> tuple[str, bool]:
    if value is None or not math.isfinite(value):
        return f"{name}: n/a (target <= {target:g}) missed", False
    met = value <= target
    return f"{name}: {value:.3f} (target <= {target:g}) {'met' if met else 'missed'}", met


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def report(runs: dict[str, dict[str, Any]]) -> list[str]:
    """The per-run table and the targets' ratios, as printed lines."""
    target = runs["fp32"]["accuracy"] if "fp32" in runs else math.nan
    lines = [
        f"target: FP32's final test accuracy {100 * target:.2f}%",
        f"{'run':<18} {'samples/s':>10} {'compile s':>9} {'batch':>5} {'MiB at batch':>12} "
        f"{'MiB at common':>13} {'to target s':>11} {'w/o compile':>11} {'accuracy':>8}  memory",
    ]
    reached = {name: time_to_accuracy(run, target) for name, run in runs.items()}
    fmt = lambda v, width, digits: f"{'-':>{width}}" if v is None else f"{v:{width}.{digits}f}"
    for name, run in runs.items():
        label, at_batch, at_common = memory_figures(run)
        seconds, without = reached[name] or (None, None)
        lines.append(
            f"{LABELS[name]:<18} {run['samples_per_second']:10.0f} {run['compile_seconds']:9.1f} "
            f"{run['run_batch']:5d} {fmt(at_batch, 12, 1)} {fmt(at_common, 13, 1)} "
            f"{fmt(seconds, 11, 1)} {fmt(without, 11, 1)} {100 * run['accuracy']:7.2f}%  {label}"
        )
    if set(runs) == set(RUNS):
        lines += _targets(runs, reached)
    return lines


def _targets(runs: dict[str, dict[str, Any]], reached: dict[str, Any]) -> list[str]:
    def seconds(name: str) -> float | None:
        return None if reached[name] is None else reached[name][0]

    memory = {name: memory_figures(run)[2] for name, run in runs.items()}
    label = memory_figures(runs["fp32"])[0]
    checks = [
        ("Tri-Accel / FP32 time to FP32's accuracy", _ratio(seconds("triaccel"), seconds("fp32")), 0.9),
        ("Tri-Accel / static bf16 time to FP32's accuracy", _ratio(seconds("triaccel"), seconds("bf16")), 1.0),
        ("stretch: Tri-Accel / FP32 time to FP32's accuracy", _ratio(seconds("triaccel"), seconds("fp32")), 0.5),
        (f"Tri-Accel / static bf16 {label} at the common batch", _ratio(memory["triaccel"], memory["bf16"]), 1.0),
        (f"static bf16 / FP32 {label} at the common batch", _ratio(memory["bf16"], memory["fp32"]), 0.6),
    ]  # fmt: skip
    return ["targets (ratios):", *("  " + _ratio_line(*check)[0] for check in checks)]


def end_to_end(
    settings: Settings,
    output: pathlib.Path,
    *,
    runs: Sequence[str] = RUNS,
    echo: Callable[[str], None] = print,
) -> bool:
    """Runs each of ``runs`` in its own process and prints the report; True if every run ran.

    Args:
      settings: the main job's settings (:data:`QUICK` for a check on CPU).
      output: a folder for each run's output and the shared compilation cache.
      runs: which runs (FP32 first: its accuracy is the target).
      echo: where lines go.

    Returns:
      Whether every run finished (the targets are reported, not enforced).
    """
    cache = output / "compilation_cache"
    records, ok = {}, True
    for run in runs:
        try:
            records[run] = run_in_process(run, settings, output, cache)
        except RuntimeError as error:
            echo(f"FAIL {error}")
            ok = False
            continue
        r = records[run]
        echo(
            f"{LABELS[run]}: {r['steps']} steps, final batch {r['final_batch']}, "
            f"{r['seconds']:.1f} s ({r['compile_seconds']:.1f} s compiling), "
            f"process {r['process_seconds']:.1f} s, on {r['platform']}"
        )
    if records:
        for line in report(records):
            echo(line)
    return ok
