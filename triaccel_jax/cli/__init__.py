"""The main job: ``python -m triaccel_jax`` (installed as ``triaccel``).

Trains one model with FP32 AdamW, static bf16 AdamW and Tri-Accel on the same data, seed and
order, prints a side-by-side table (time, memory at the batch each run used and at a common
batch, accuracy) with notes on what its figures can show, and writes plots. ``main(argv)`` is the
entry point (the console script ``triaccel`` is ``triaccel_jax.cli:main``). It needs the
``demo`` extra (Flax, scikit-learn, tqdm, matplotlib); without it ``main`` names every missing
package in one message.

The private modules, one job each: ``_arguments`` (the command line), ``_data_source`` (where
the data comes from: found, downloaded, installed or embedded), ``_task`` (data set, model and
loss), ``_runs`` (one run through a Controller and its figures), ``_results`` (the table, its
notes, ``results.md`` and ``results.json``), ``_plots`` (the PNG plots; given the run labels),
``_compilation_cache`` (JAX's persistent compilation cache, on by default), ``_end_to_end``
(each run in its own process and the time to FP32's accuracy, for ``benchmarks/gpu_check.py``)
``_main_job`` (the job, which ties them together) and ``_entry`` (``main``, which checks the
extra first).
"""

from triaccel_jax.cli._entry import main

__all__ = ("main",)
