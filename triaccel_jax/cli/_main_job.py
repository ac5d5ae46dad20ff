"""The main job: FP32 AdamW, static bf16 AdamW and Tri-Accel side by side on real data.

``python -m triaccel_jax`` (or the ``triaccel`` console script) trains one model three times on
the same data and seed, each run through a :class:`triaccel_jax.Controller` (the runs are
described in :mod:`triaccel_jax.cli._runs`; arguments in ``_arguments``, data, model and loss in
``_task``, the table and files in ``_results``, plots in ``_plots``).

It prints a table (wall time, steps, memory by ``memory_report`` and by XLA's compiled analysis,
test accuracy) and writes it with PNG plots and a JSON record to ``--output-dir``. Each run's
memory is given twice, each labelled with its batch: at the largest batch the run trained at
(what it really needed), and at the common batch ``--batch-size`` (the like-for-like comparison
the "vs FP32" ratio is taken at). Each run's compile seconds are given apart from its step
seconds. JAX's persistent compilation cache is on by default (``_compilation_cache`` says where
and how to move or turn it off), so a second identical run compiles nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import jax

from triaccel_jax._src import compilation_cache
from triaccel_jax.cli import _arguments as arguments
from triaccel_jax.cli import _data_source as data_source
from triaccel_jax.cli import _results as results_lib
from triaccel_jax.cli import _runs as runs
from triaccel_jax.cli import _task as task
from triaccel_jax.cli._runs import RUN_LABELS

__all__ = ("RUN_LABELS", "main")


def _announce(message: str) -> None:
    print(f"[data] {message}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the comparison; returns the exit status."""
    args = arguments.parse_args(argv)
    output = arguments.check_output_dir(args.output_dir)
    try:
        source = data_source.resolve(
            args.dataset, data_dir=args.data_dir, offline=args.offline, announce=_announce
        )
        arguments.fill_workload(args, source.dataset)
        data = task.load_data(
            source.dataset,
            data_dir=args.data_dir,
            train_subset=args.train_subset,
            test_subset=args.test_subset,
            image_shape=args.image_shape,
        )
    except (FileNotFoundError, ImportError) as error:
        print(f"error: data set {args.dataset!r} is not available: {error}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as error:  # a bad argument, or a data file that failed
        print(f"error: {error}", file=sys.stderr)
        return 2
    model_name = "small_cnn" if args.model == "auto" else args.model
    args.model = model_name
    cache_dir = compilation_cache.resolve_cache_dir(
        args.compilation_cache, args.no_compilation_cache
    )
    args.compilation_cache = cache_dir
    print(
        f"triaccel_jax main job: {model_name} on {data.name} ({len(data.train['label'])} train / "
        f"{len(data.test['label'])} test), {args.epochs} epochs, batch {args.batch_size} (Tri-Accel "
        f"up to {args.max_batch}), seed {args.seed}, runs {', '.join(args.runs)}; "
        f"{jax.device_count()} x {jax.devices()[0].platform}; compilation cache "
        f"{cache_dir or 'off'}\ndata: {source.how}"
    )
    from tqdm.auto import tqdm

    results = []
    with (
        compilation_cache.persistent_cache(cache_dir),
        tqdm(
            total=runs.planned_samples(data, args) * len(args.runs),
            unit="img",
            disable=args.no_progress,
            dynamic_ncols=True,
        ) as progress,
    ):
        for done, run in enumerate(args.runs, start=1):
            results.append(runs.train_run(run, data, args, progress))
            # A run that trained more or fewer samples than planned moves the total, not the
            # runs still to come.
            progress.total = progress.n + runs.planned_samples(data, args) * (len(args.runs) - done)
            progress.refresh()
    platform = jax.devices()[0].platform
    table = results_lib.results_table(results, RUN_LABELS)
    notes = results_lib.reading_notes(
        results, source, platform, args, test_size=len(data.test["label"])
    )
    print("\n" + table + "\n\n" + notes)

    pictures = []
    if not args.no_plots:
        from triaccel_jax.cli import _plots as plots

        elastic = next((r for r in results if r.name == "triaccel"), None)
        note = (
            None
            if elastic is None
            else "Tri-Accel: " + results_lib.precision_summary(elastic, platform) + "."
        )
        pictures = plots.write_plots(results, output, labels=RUN_LABELS, precision_note=note)
    written = results_lib.write_results(output, table, notes, args, source, platform, results)
    print("\nwrote " + ", ".join(str(p) for p in [*written, *pictures]))
    return 0
