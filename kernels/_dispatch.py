"""Choosing a kernel's implementation at trace time: ``"auto" | "reference" | "triton"``.

``"auto"`` picks the Triton kernel when the default JAX backend is a CUDA GPU and ``jax_triton``
imports, and the pure-JAX reference everywhere else (docs/design.md §4). The check runs when a function is
traced, never at import time, so ``import triaccel_jax`` never imports triton or jax_triton; and
on a CPU backend it does not even try to import them.
"""

from __future__ import annotations

import functools
import importlib

import jax

IMPLS = ("auto", "reference", "triton")


def _cuda_backend() -> bool:
    """True when JAX's default backend is an NVIDIA GPU (CUDA, not ROCm)."""
    if jax.default_backend() != "gpu":
        return False
    try:
        version = jax.devices()[0].client.platform_version
    except Exception:  # a backend without the attribute: judge by the platform name alone
        return True
    return "rocm" not in str(version).lower()


@functools.cache
def _jax_triton_import_error() -> str | None:
    """Why ``jax_triton`` cannot be imported, or None when it can (tried once per process)."""
    try:
        importlib.import_module("jax_triton")
    except Exception as error:  # jax_triton raises ValueError, not ImportError, without GPU jaxlib
        return f"{type(error).__name__}: {error}"
    return None


def triton_unavailable_reason() -> str | None:
    """Why the Triton kernels cannot run here, or None when they can.

    Returns:
      None on a CUDA backend where ``jax_triton`` imports; else a sentence saying what is missing.
    """
    if not _cuda_backend():
        return (
            f"JAX's default backend is {jax.default_backend()!r}; the Triton kernels need a CUDA "
            "GPU backend (install jax[cuda12] on a machine with an NVIDIA GPU)"
        )
    error = _jax_triton_import_error()
    if error is not None:
        return f"jax_triton cannot be imported ({error}); install the `gpu` extra (jax-triton)"
    return None


def resolve(impl: str, kernel: str) -> str:
    """Resolves ``impl`` to ``"reference"`` or ``"triton"`` for the kernel named ``kernel``.

    Args:
      impl: ``"auto"``, ``"reference"`` or ``"triton"``.
      kernel: the kernel's name, for error messages.

    Returns:
      ``"triton"`` or ``"reference"``.

    Raises:
      ValueError: ``impl`` is not one of :data:`IMPLS`.
      RuntimeError: ``impl="triton"`` where the Triton kernels cannot run.
    """
    if impl not in IMPLS:
        raise ValueError(f"`impl` must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return "reference"
    reason = triton_unavailable_reason()
    if impl == "triton" and reason is not None:
        raise RuntimeError(f"impl='triton' for the {kernel} kernel is not available here: {reason}")
    return "reference" if reason is not None else "triton"
