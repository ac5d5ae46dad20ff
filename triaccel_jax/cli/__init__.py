"""The main job: ``python -m triaccel_jax`` (installed as ``triaccel``).

Trains one model with FP32 AdamW, static bf16 AdamW and Tri-Accel on the same data, seed and
order, prints a side-by-side table (time, memory at the batch each run used and at a common
batch, accuracy) and writes plots. ``main(argv)`` is the entry point.
"""

from triaccel_jax.cli._main_job import main

__all__ = ("main",)
