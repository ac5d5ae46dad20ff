"""Kernels of triaccel_jax, each beside its pure-JAX reference (docs/design.md §4).

This folder is installed as ``triaccel_jax.kernels``. Every kernel module holds the reference
implementation that is the tested truth; nothing here imports triton or jax_triton at import time.
"""
