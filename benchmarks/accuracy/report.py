"""The study's table: accuracy, paired difference, steps and seconds to a target, memory."""

from __future__ import annotations

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
