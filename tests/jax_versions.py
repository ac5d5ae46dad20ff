"""Markers for behaviour that depends on the installed JAX version (shared by the test modules)."""

import jax
import pytest

# Which intermediates autodiff saves (so the exact residual list) is an implementation choice of
# JAX's partial evaluation; the tests' expectations are JAX >= 0.12's. Older JAX (Python 3.11 gets
# 0.10) saves an extra fp32 copy in some cases; the dtype rules themselves are tested everywhere.
exact_residuals = pytest.mark.skipif(
    jax.__version_info__ < (0, 12), reason="exact residual lists are JAX >= 0.12's"
)
