"""The main job's results: the side-by-side table, and the files it writes."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

RESULT_COLUMNS = (
    "run",
    "wall s",
    "compile s",
    "step s",
    "samples/s",
    "steps",
    "final batch",
    "trained at batch",
    "memory_report MiB at trained batch",
    "compiled MiB at trained batch",
    "common batch",
    "memory_report MiB at common batch",
    "vs FP32 at common batch",
    "compiled MiB at common batch",
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
    memory of a smaller one. The last column is the time to FP32's final test accuracy, at the
    first evaluation that reaches it (``--eval-every`` sets how often; every epoch's end counts).

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

    for r in results:
        ratio = (
            f"{r.common_batch_memory_mib / base.common_batch_memory_mib:.3f}x"
            if base is not None and base.common_batch == r.common_batch
            else "-"
        )
        cells = (
            labels[r.name],
            f"{r.seconds:.1f}",
            f"{r.compile_seconds:.2f}",
            f"{r.step_seconds:.2f}",
            f"{r.samples_per_second:.0f}",
            str(r.steps),
            str(r.final_batch),
            str(r.run_batch),
            mib(r.run_batch_memory_mib, 2),
            mib(r.run_batch_compiled_mib, 1),
            str(r.common_batch),
            mib(r.common_batch_memory_mib, 2),
            ratio,
            mib(r.common_batch_compiled_mib, 1),
            f"{100 * r.accuracy:.2f}%",
            _time_to_fp32(r, base),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(
    output: pathlib.Path, table: str, args: Any, dataset: str, platform: str, results: Sequence[Any]
) -> list[pathlib.Path]:
    """Writes ``results.md`` (the table) and ``results.json`` (arguments and every figure).

    Returns:
      The paths written.
    """
    (output / "results.md").write_text(table + "\n")
    record = {
        "args": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
        "dataset": dataset,
        "platform": platform,
        "results": [dataclasses.asdict(r) for r in results],
    }
    (output / "results.json").write_text(json.dumps(record, indent=1, default=str))
    return [output / "results.md", output / "results.json"]
