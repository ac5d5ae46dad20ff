"""Shared fixtures: a backend-compile counter and deterministic settings."""

from __future__ import annotations

import contextlib
import threading

import jax
import pytest

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = 0
_lock = threading.Lock()


def _on_event(event: str, duration: float, **kwargs) -> None:
    global _compiles
    if event == _COMPILE_EVENT:
        with _lock:
            _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


class CompileCounter:
    """Counts XLA backend compilations inside a ``with`` block (measured, not assumed)."""

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def __call__(self):
        start = _compiles
        try:
            yield self
        finally:
            self.count = _compiles - start


@pytest.fixture
def count_compiles() -> CompileCounter:
    return CompileCounter()
