"""Kernels of triaccel_jax, each beside its pure-JAX reference (docs/design.md §4).

Every kernel module holds the reference implementation that is the tested truth; nothing here
imports triton or jax_triton at import time. The public modules are :mod:`triaccel_jax.kernels.cast`,
:mod:`triaccel_jax.kernels.fused_update` and :mod:`triaccel_jax.kernels.quantize` (block-wise
8-bit optimizer state); the package also exports what the optimizer and the
casts above it share with the kernels: the implementation choice (:data:`IMPLS`, :func:`resolve`,
:func:`fused_update_op`) and Adam's moments (:func:`adam_scalars`, :func:`adam_moments`, whose
:class:`Scalars` every implementation reads in one order).
"""

from triaccel_jax.kernels._adam import AdamMoments
from triaccel_jax.kernels._adam import Scalars
from triaccel_jax.kernels._adam import adam_moments
from triaccel_jax.kernels._adam import adam_scalars
from triaccel_jax.kernels._dispatch import IMPLS
from triaccel_jax.kernels._dispatch import fused_update_op
from triaccel_jax.kernels._dispatch import resolve

__all__ = (
    "IMPLS",
    "AdamMoments",
    "Scalars",
    "adam_moments",
    "adam_scalars",
    "fused_update_op",
    "resolve",
)
