"""The study's table: accuracy, paired difference, steps and seconds to a target, memory."""

from __future__ import annotations

import math
import statistics
from typing import Any

from .runs import ROW_LABELS
from .stats import first_reaching
from .stats import mean_std
from .stats import paired_interval


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
            summary["samples_to_target"] = (
                statistics.median(h["samples"] for h in hits) if hits else None
            )
            summary["seconds_to_target"] = (
                statistics.median(h["seconds"] - h["compile_seconds"] for h in hits)
                if hits
                else None
            )
        summary["steps"] = statistics.median(r["steps"] for r in row_runs)
        summary["seconds"] = statistics.median(
            r["seconds"] - r["evals"][-1]["compile_seconds"] for r in row_runs
        )
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
        f"| configuration | test accuracy % (mean ± std, n) | vs FP32 AdamW, points (paired 95% CI) "
        f"| steps to {target_text} (seeds reaching) | samples to it | seconds to it "
        "| steps | seconds | batch | memory_report MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in summary:
        diff = "—"
        if "diff" in s:
            d, low, high = (100 * x for x in s["diff"])
            diff = f"{d:+.2f} [{low:+.2f}, {high:+.2f}]"
        steps_to = "—" if s.get("steps_to_target") is None else f"{s['steps_to_target']:.0f}"
        samples_to = "—" if s.get("samples_to_target") is None else f"{s['samples_to_target']:.0f}"
        seconds_to = "—" if s.get("seconds_to_target") is None else f"{s['seconds_to_target']:.1f}"
        lines.append(
            f"| {ROW_LABELS[s['row']]} | {100 * s['mean']:.2f} ± {100 * s['std']:.2f} ({s['n']}) "
            f"| {diff} | {steps_to} ({s.get('reached', 0)}/{s['n']}) | {samples_to} "
            f"| {seconds_to} | {s['steps']:.0f} | {s['seconds']:.1f} | {s['run_batch']} "
            f"| {s['memory_mib']:.2f} |"
        )
    chosen = result["chosen"]
    tri = chosen["triaccel"]
    lines.append("")
    lines.append(
        "Seconds exclude evaluations and XLA compiles; steps, samples and seconds to the target "
        "are medians over the seeds that reached it, read at per-epoch evaluations; memory is "
        "`memory_report`'s analytic total of one step at the batch in the batch column."
    )
    lines.append("")
    lines.append(
        f"Chosen on validation: AdamW lr {chosen['fp32']['lr']:.3g}; Tri-Accel lr {tri['lr']:.3g}, "
        f"alpha {tri['alpha']}, clip [{tri['min_scale']}, {tri['max_scale']}]."
    )
    return "\n".join(lines)


def convergence_epochs(result: dict[str, Any]) -> int:
    """The number of final epochs :func:`convergence` measures: a quarter of training, >= 1."""
    return max(1, result["epochs"] // 4)


def convergence(result: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Per row, the mean change of test accuracy over the last :func:`convergence_epochs` epochs,
    and the seed spread of the final accuracy: training was long enough where the first is well
    within the second."""
    changes = {}
    for row, row_runs in result["runs"].items():
        deltas = []
        for run in row_runs:
            evals = run["evals"]
            back = convergence_epochs(result) * len(evals) // result["epochs"]
            # With no evaluation that far back (a one-epoch run) the change is unknown.
            earlier = evals[-1 - back]["accuracy"] if back < len(evals) else math.nan
            deltas.append(evals[-1]["accuracy"] - earlier)
        changes[row] = (
            statistics.mean(deltas),
            mean_std([r["accuracy"] for r in row_runs])[1],
        )
    return changes


def tuning_table(result: dict[str, Any]) -> str:
    """Every tuning trial and its validation accuracy, in the order they ran."""
    lines = [
        "| optimizer | learning rate | alpha | scale clip | validation accuracy |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, label in (("fp32", "AdamW"), ("triaccel", "Tri-Accel")):
        for trial in result["tuning"][name]:
            hyper = trial["hyper"]
            shape = (
                ("—", "—")
                if name == "fp32"
                else (f"{hyper['alpha']}", f"[{hyper['min_scale']}, {hyper['max_scale']}]")
            )
            lines.append(
                f"| {label} | {hyper['lr']:.3g} | {shape[0]} | {shape[1]} "
                f"| {100 * trial['validation']:.2f}% |"
            )
    return "\n".join(lines)


def section(result: dict[str, Any], margin: float) -> str:
    """The workload's markdown section: its setting, the table, convergence and tuning."""
    seeds = [run["seed"] for run in next(iter(result["runs"].values()))]
    changes = convergence(result)
    change_text = "; ".join(
        f"{ROW_LABELS[row]} {100 * delta:+.2f} (seed std {100 * spread:.2f})"
        for row, (delta, spread) in changes.items()
    )
    return (
        f"### {result['workload']}: {result['description']}\n\n"
        f"{result['train_images']} train / {result['validation_images']} validation / "
        f"{result['test_images']} test images, {result['epochs']} epochs, batch "
        f"{result['batch']} (elastic rows up to {result['max_batch']}), seeds {seeds}, "
        f"{result['trials']} tuning trials per optimizer "
        + (
            f"({result['tuning_seconds'] / 60:.1f} min of tuning).\n\n"
            if not result.get("chosen_from")
            else "(the trials of an earlier tuning, listed below, reused).\n\n"
        )
        + markdown_table(result, margin)
        + f"\n\nChange of the mean test accuracy over the last {convergence_epochs(result)} "
        "epoch(s), points: "
        + change_text
        + ".\n\nTuning trials (tuning seed, validation split):\n\n"
        + tuning_table(result)
    )
