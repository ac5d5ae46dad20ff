"""The main job: ``python -m triaccel_jax`` (installed as ``triaccel``).

Trains one model with FP32 AdamW, static bf16 AdamW and Tri-Accel on the same data, seed and
order, prints a side-by-side table (time, memory at the batch each run used and at a common
batch, accuracy) and writes plots. ``main(argv)`` is the entry point (the console script
``triaccel`` is ``triaccel_jax.cli:main``).

The private modules, one job each: ``_arguments`` (the command line), ``_task`` (data set,
model and loss), ``_runs`` (one run through a Controller and its figures), ``_results`` (the
table, ``results.md`` and ``results.json``), ``_plots`` (the PNG plots; given the run labels),
``_compilation_cache`` (JAX's persistent compilation cache, on by default), ``_end_to_end``
(each run in its own process and the time to FP32's accuracy, for ``benchmarks/gpu_check.py``)
and ``_main_job`` (``main``, which ties them together).
"""

from triaccel_jax.cli._main_job import main

__all__ = ("main",)
