"""The main job's results: the side-by-side table, and the files it writes."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

# Memory leads with XLA's compiled figure of one whole training step (forward, backward and the
# optimizer's update); memory_report's analytic estimate (of the parts it counts) follows,
# labelled as such; then the optimizer state alone: XLA's compiled figure, per parameter, and the
# stored leaves' bytes by format.
RESULT_COLUMNS = (
    "run",
    "wall s",
    "compile s",
    "step s",
    "samples/s",
    "steps",
    "final batch",
    "trained at batch",
    "compiled step MiB at trained batch",
    "memory_report estimate MiB at trained batch",
    "common batch",
    "compiled step MiB at common batch",
    "compiled vs FP32 at common batch",
    "memory_report estimate MiB at common batch",
    "estimate vs FP32 at common batch",
    "optimizer state MiB (XLA compiled)",
    "state vs FP32",
    "state B/param (XLA compiled)",
    "state MiB by format (stored leaves)",
    "state plan s (at step)",
    "test accuracy",
    "s to FP32's accuracy (less compiles)",
)


def time_to_accuracy(run: dict[str, Any], target: float) -> tuple[float, float] | None:
    """(wall seconds, wall seconds less compiles) at ``run``'s first evaluation reaching
    ``target``, or None if none did. Evaluations themselves are not counted.

    Example::

      >>> evals = [{"accuracy": 0.5, "seconds": 3.0, "compile_seconds": 2.0},
      ...          {"accuracy": 0.9, "seconds": 5.0, "compile_seconds": 2.5}]
      >>> time_to_accuracy({"evals": evals}, 0.8)
      (5.0, 2.5)
    """
    for e in run["evals"]:
        if e["accuracy"] >= target:
            return e["seconds"], e["seconds"] - e["compile_seconds"]
    return None


# The order formats are listed and stacked in: the registry's, most precise first.
FORMAT_ORDER = ("fp32", "bf16", "fp16", "int8", "int8_dynamic", "int4", "other")


def ordered_formats(formats: Any) -> list[str]:
    """``formats`` in :data:`FORMAT_ORDER` (any other name after them, sorted).

    Example::

      >>> ordered_formats({"other": 1, "int8": 2, "fp32": 3})
      ['fp32', 'int8', 'other']
    """
    known = [f for f in FORMAT_ORDER if f in formats]
    return known + sorted(f for f in formats if f not in FORMAT_ORDER)


def state_by_format(state_bytes: dict[str, int]) -> str:
    """A run's state bytes by format as a table cell, in MiB to three significant digits (a
    format's few counts and keys stay visible), or "-" with none.

    Example::

      >>> state_by_format({"int8": 2**20, "fp32": 2**19, "other": 20})
      'fp32 0.5 + int8 1 + other 1.91e-05'
    """
    if not state_bytes:
        return "-"
    return " + ".join(f"{f} {state_bytes[f] / 2**20:.3g}" for f in ordered_formats(state_bytes))


def _state_total(run: Any) -> float | None:
    """The state's bytes: XLA's compiled figure, else the stored leaves' sum (None without)."""
    if run.state_compiled_bytes is not None:
        return run.state_compiled_bytes
    return sum(run.state_bytes.values()) or None


def _plan_cost(plan: dict[str, Any] | None) -> str:
    """A state plan's host seconds and the step it was taken at, "-" for a run without one."""
    if plan is None:
        return "-"
    return f"{plan['plan_seconds']:.2f} ({plan['plan_step']})"


def _state_mib(run: Any) -> float | None:
    total = _state_total(run)
    return None if total is None else total / 2**20


def _time_to_fp32(run: Any, base: Any) -> str:
    """``"wall (less compiles)"`` seconds at ``run``'s first evaluation reaching FP32's final
    accuracy; "not reached", or "-" without an FP32 run."""
    if base is None:
        return "-"
    reached = time_to_accuracy({"evals": run.evals}, base.accuracy)
    return "not reached" if reached is None else f"{reached[0]:.1f} ({reached[1]:.1f})"


def results_table(results: Sequence[Any], labels: Mapping[str, str]) -> str:
    """The side-by-side table, in Markdown.

    Wall time (without evaluations) is split into compile seconds (or loading from the
    persistent cache) and step seconds; samples/s is over the wall time less compiles. Memory
    is given at two batches, each in its own labelled columns: the largest batch the run
    trained at, and the common batch of all runs, where the "vs FP32" ratio is taken (the FP32
    run's figure at the same batch), so that a run that grew its batch is not credited with the
    memory of a smaller one. The compiled figure is XLA's of one whole training step (forward,
    backward and the optimizer's update), so that the optimizer state's format shows in it. The
    optimizer state follows alone: XLA's compiled bytes of it (in the update), its ratio to
    FP32's, per trainable parameter, and the stored leaves' bytes by format; then Tri-Accel's
    state plan's probe (its seconds are in the wall time). The last column is the time to FP32's
    final test accuracy, at the first evaluation that reaches it (``--eval-every`` sets how
    often; every epoch's end counts; Tri-Accel's probe counted).

    Args:
      results: the runs' :class:`triaccel_jax.cli._runs.RunResult`, in table order.
      labels: the label of each run name (the table's first column).

    Returns:
      The table as Markdown text.
    """
    base = next((r for r in results if r.name == "fp32"), None)
    lines = [
        "| " + " | ".join(RESULT_COLUMNS) + " |",
        "| --- |" + " ---: |" * (len(RESULT_COLUMNS) - 1),
    ]

    def mib(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def ratio(run: Any, value: float | None, base_value: float | None) -> str:
        if value is None or base_value is None or base is None:
            return "-"
        if base.common_batch != run.common_batch:
            return "-"
        return f"{value / base_value:.3f}x"

    def state_ratio(run: Any) -> str:
        mine, theirs = _state_total(run), None if base is None else _state_total(base)
        return "-" if mine is None or not theirs else f"{mine / theirs:.3f}x"

    for r in results:
        cells = (
            labels[r.name],
            f"{r.seconds:.2f}",  # as compile s and step s, so that wall >= compile reads true
            f"{r.compile_seconds:.2f}",
            f"{r.step_seconds:.2f}",
            f"{r.samples_per_second:.0f}",
            str(r.steps),
            str(r.final_batch),
            str(r.run_batch),
            mib(r.run_batch_compiled_mib, 1),
            mib(r.run_batch_memory_mib, 2),
            str(r.common_batch),
            mib(r.common_batch_compiled_mib, 1),
            ratio(r, r.common_batch_compiled_mib, base and base.common_batch_compiled_mib),
            mib(r.common_batch_memory_mib, 2),
            ratio(r, r.common_batch_memory_mib, base and base.common_batch_memory_mib),
            mib(_state_mib(r), 3),
            state_ratio(r),
            "-" if r.state_bytes_per_parameter is None else f"{r.state_bytes_per_parameter:.3f}",
            state_by_format(r.state_bytes),
            _plan_cost(r.state_plan),
            f"{100 * r.accuracy:.2f}%",
            _time_to_fp32(r, base),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def precision_summary(elastic: Any, platform: str) -> str:
    """What Tri-Accel's precision did and why, as a clause (for the notes and the precision map).

    Args:
      elastic: the Tri-Accel run's result (``events``, ``policies``).
      platform: the JAX platform the run ran on.

    Returns:
      E.g. ``"precision stayed float32: memory never needed a lower one, ..."``.
    """
    kinds = [e["kind"] for e in elastic.events]
    trials = [e for e in elastic.events if e["kind"] == "precision_trial"]
    for_memory = [
        e
        for e in elastic.events
        if e["kind"] == "replan" and str(e["reason"]).startswith("memory needs")
    ]
    last = elastic.policies[-1]["leaves"] if elastic.policies else {}
    counts = {dtype: list(last.values()).count(dtype) for dtype in sorted(set(last.values()))}
    mix = ", ".join(f"{n} leaves {dtype}" for dtype, n in counts.items()) or "the start"
    parts = [f"{len(for_memory)} re-plan(s) for memory"] if for_memory else []
    parts += [f"a trial of lower precision: {e['reason']}" for e in trials]
    if parts:
        precision = f"precision: {'; '.join(parts)}; it ended at {mix}"
    elif kinds.count("replan"):
        precision = f"precision was re-planned {kinds.count('replan')} time(s), ending at {mix}"
    elif platform == "cpu":
        precision = (
            "precision stayed float32: memory never needed a lower one, and on a CPU, where "
            "bf16 is emulated, a lower precision is not tried for speed (precision_rule="
            "'speed')"
        )
    else:
        precision = (
            "precision stayed float32: memory never needed a lower one and no plan lowered a leaf"
        )
    return precision


def state_plan_summary(elastic: Any) -> str:
    """What Tri-Accel's state plan chose and what it cost, as a sentence (for the notes and the
    state plot).

    Args:
      elastic: the Tri-Accel run's result (``state_plan``, ``state_bytes``).

    Returns:
      E.g. ``"Adam's moments planned under a cap of 6.5 B/param (parameters plus moments) from
      the run's signals at step 20 (0.05 s), as it started: Dense_0/kernel int8, 7 leaves fp32;
      6.35 B/param planned"``.
    """
    plan = elastic.state_plan
    by_format: dict[str, list[str]] = {}
    for path, name in sorted(plan["formats"].items()):
        by_format.setdefault(name, []).append(path)
    parts = []
    for name in ordered_formats(by_format):
        paths = by_format[name]
        what = ", ".join(paths) if len(paths) <= 2 else f"{len(paths)} leaves"
        parts.append(f"{what} {name}")
    met = "" if plan["meets_cap"] else ", over the cap: no plan of these formats meets it"
    return (
        f"Adam's moments planned under a cap of {plan['cap']:g} B/param (parameters plus "
        f"moments) from the run's own signals at step {plan['plan_step']} "
        f"({plan['plan_seconds']:.2f} s, counted in the wall time), "
        f"{'converted from the formats its sizes gave at the start' if plan['switched'] else 'as it started (by size)'}"
        f": {'; '.join(parts)}; {plan['bytes_per_parameter']:.2f} B/param planned{met}"
    )


def reading_notes(
    results: Sequence[Any], source: Any, platform: str, args: Any, test_size: int
) -> str:
    """What the table's figures can and cannot show, in Markdown: the data it used, what its
    accuracies are worth, what Tri-Accel's adaptations did, and which memory figure is which.

    Args:
      results: the runs' results, as given to :func:`results_table`.
      source: the :class:`triaccel_jax.cli._data_source.Source` the data came from.
      platform: the JAX platform the runs ran on (``"cpu"``, ``"gpu"``, ...).
      args: the main job's arguments (epochs, batch sizes, re-plan steps).
      test_size: the number of test images the accuracies are measured on.

    Returns:
      Paragraphs of Markdown.
    """
    notes = [f"**Data.** {source.how}."]
    if source.dataset == "digits":
        notes.append(
            f"**Accuracy.** The digits are a small embedded workload (8x8 images, {test_size} for "
            f"testing: one test image is {100 / test_size:.2f} points): with one seed the accuracy differences between the runs say nothing about which "
            "optimizer is better (the tuned, five-seed comparison is docs/accuracy.md). What these "
            "runs do show is each adaptation at work, and time and memory side by side."
            + (
                " Install Fashion-MNIST for the real comparison (the [data] lines above say what "
                "was tried)."
                if source.stand_in
                else ""
            )
        )
    else:
        notes.append(
            "**Accuracy.** One seed at one learning rate, not tuned per run: differences under "
            "about half a point are within seed noise (tuned, multi-seed comparisons are in "
            "docs/accuracy.md)."
        )
    elastic = next((r for r in results if r.name == "triaccel"), None)
    if elastic is not None and elastic.history:
        batches = [int(h["batch"]) for h in elastic.history]
        moves = [e for e in elastic.events if e["kind"] in ("grow", "shrink", "oom")]
        if moves:
            path = " -> ".join([str(batches[0]), *(str(e["new"]) for e in moves)])
            batch = f"the batch went {path} (last move: {moves[-1]['reason']})"
        else:
            batch = (
                f"the batch stayed at {batches[0]}: no other bucket's goodput (measured samples/s "
                "x statistical efficiency) beat it by the margin, within memory"
            )
        precision = precision_summary(elastic, platform)
        scales = elastic.step_scales[-1]["scales"] if elastic.step_scales else {}
        spread = (
            f"per-layer step scales ended between {min(scales.values()):.2f} and "
            f"{max(scales.values()):.2f}"
            if scales
            else "no step scales were recorded"
        )
        noise = [h["noise_scale"] for h in elastic.history if math.isfinite(h["noise_scale"])]
        measured = (
            f"; the gradient noise scale B_simple (McCandlish et al., 2018; the batch beyond "
            f"which a step helps less per sample) went from {noise[0]:.0f} to {noise[-1]:.0f} "
            "samples (batch_memory.png)"
            if noise
            else ""
        )
        notes.append(f"**Tri-Accel's adaptations.** {batch}; {precision}; {spread}{measured}.")
    notes.append(
        "**Memory.** *compiled step MiB* is XLA's compiled memory analysis of one whole training "
        "step: forward, backward and the optimizer's update, parameters and optimizer state "
        "donated as the controller's step donates them (on a CPU, XLA computes bf16 "
        "convolutions in float32, so it understates bf16's saving); *memory_report estimate* "
        "is an analytic count of the parts it covers (parameters, gradients, optimizer state as "
        "stored, activations saved for backward) at their dtypes. Each is given at the batch "
        f"the run trained at and at the common batch {args.batch_size}, where the ratios to FP32 "
        "are taken. *optimizer state MiB (XLA compiled)* is the state's bytes in the compiled "
        "update (transforms.compiled_state_bytes), *state B/param* the same per trainable "
        "parameter, and *state MiB by format* the stored leaves' bytes by the format each is "
        "kept in (other: counts, the curvature store's indices, keys)."
    )
    if elastic is not None and elastic.state_plan is not None:
        notes.append("**Tri-Accel's state.** " + state_plan_summary(elastic) + ".")
    if platform == "cpu":
        notes.append(
            "**Time.** On a CPU bfloat16 is emulated, so lower precision costs time here; read "
            "the ratios between runs of one job, not the seconds (shared cores vary)."
        )
    return "\n\n".join(notes)


def write_results(
    output: pathlib.Path,
    table: str,
    notes: str,
    args: Any,
    source: Any,
    platform: str,
    results: Sequence[Any],
) -> list[pathlib.Path]:
    """Writes ``results.md`` (the table and its notes) and ``results.json`` (arguments, the data
    source and every figure).

    Returns:
      The paths written.
    """
    (output / "results.md").write_text(table + "\n\n" + notes + "\n")
    record = {
        "args": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
        "dataset": source.dataset,
        "data_source": dataclasses.asdict(source),
        "platform": platform,
        "results": [dataclasses.asdict(r) for r in results],
    }
    (output / "results.json").write_text(json.dumps(record, indent=1, default=str))
    return [output / "results.md", output / "results.json"]
