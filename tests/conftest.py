"""Shared fixtures: a backend-compile counter and deterministic settings."""

from __future__ import annotations

import contextlib
import os
import threading

import jax
import pytest

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles: list[str] = []  # the name of every function compiled, in order
_lock = threading.Lock()


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event == _COMPILE_EVENT:
        with _lock:
            _compiles.append(str(kwargs.get("fun_name", "")))


jax.monitoring.register_event_duration_secs_listener(_on_event)

# TRIACCEL_STRICT_PROMOTION=1 makes accidental promotions (a bfloat16 moment times a float32
# array, an int32 count times a float) fail instead of silently widening. Not the default: under
# strict promotion Flax's own avg_pool and normalisation layers fail (they mix int or float32
# constants with the input's dtype), as do optax's updates of the integer leaves that the tests
# pass through, so the check is run on purpose, not on every test run.
if os.environ.get("TRIACCEL_STRICT_PROMOTION") == "1":
    jax.config.update("jax_numpy_dtype_promotion", "strict")


class CompileCounter:
    """Counts XLA backend compilations inside a ``with`` block (measured, not assumed)."""

    def __init__(self) -> None:
        self.count = 0
        self.names: list[str] = []

    @contextlib.contextmanager
    def __call__(self):
        start = len(_compiles)
        try:
            yield self
        finally:
            self.names = _compiles[start:]
            self.count = len(self.names)

    def of(self, name: str) -> int:
        """Compilations of functions whose name contains ``name``."""
        return sum(name in compiled for compiled in self.names)


@pytest.fixture
def count_compiles() -> CompileCounter:
    return CompileCounter()
