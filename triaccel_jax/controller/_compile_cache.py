"""``CompileCache``: one compiled step per (micro-batch, micro-batches, policy), and their peaks.

A precision policy is a plain hashable value, so it keys the cache directly; the compiled peak
bytes XLA reports are kept per policy signature (docs/design.md §5), because the batch-size
decisions fit a line through the peaks of one policy at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax

from triaccel_jax.controller import _memory_probe as memory_probe


class CompiledStep(NamedTuple):
    """A newly compiled step: the executable, its compiled peak bytes (or None) and the seconds."""

    executable: Any
    peak_bytes: int | None
    seconds: float


def build(step: Callable[..., Any], abstract_args: tuple) -> Any:
    """``step`` jitted and compiled for ``abstract_args`` (shapes only: no data touched)."""
    return jax.jit(step).lower(*abstract_args).compile()


class CompileCache:
    """Compiled steps by ``(micro, num_micro, policy)`` and compiled peak bytes by policy.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from triaccel_jax.controller._compile_cache import CompileCache
      >>> cache = CompileCache()
      >>> new = cache.compile(
      ...     (4, 1, None), lambda x: x * 2, (jax.ShapeDtypeStruct((4,), jnp.float32),)
      ... )
      >>> cache.get((4, 1, None)) is new.executable, len(cache)
      (True, 1)
    """

    def __init__(self) -> None:
        self._steps: dict[tuple[int, int, Any], Any] = {}
        self._peaks: dict[str, dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self._steps)

    def get(self, key: tuple[int, int, Any]) -> Any | None:
        """The executable compiled for ``key``, or None."""
        return self._steps.get(key)

    def compile(
        self, key: tuple[int, int, Any], step: Callable[..., Any], abstract_args: tuple
    ) -> CompiledStep:
        """Compiles ``step`` for ``abstract_args`` (no data touched) and keeps it under ``key``."""
        start = time.perf_counter()
        executable = build(step, abstract_args)
        return self.store(key, executable, time.perf_counter() - start)

    def store(self, key: tuple[int, int, Any], executable: Any, seconds: float) -> CompiledStep:
        """Keeps ``executable`` (built by :func:`build`, e.g. in a background thread) under ``key``."""
        self._steps[key] = executable
        return CompiledStep(executable, memory_probe.compiled_peak_bytes(executable), seconds)

    def record_peak(self, signature: str, micro: int, peak: int) -> None:
        """Notes the compiled peak bytes of bucket ``micro`` under policy ``signature``."""
        self._peaks.setdefault(signature, {})[micro] = peak

    def peaks(self, signature: str) -> dict[int, int]:
        """``{bucket: compiled peak bytes}`` under policy ``signature`` (a copy)."""
        return dict(self._peaks.get(signature, {}))

    def peaks_record(self) -> dict[str, dict[str, int]]:
        """The compiled peaks as JSON-ready data (bucket keys as strings)."""
        return {sig: {str(b): v for b, v in peaks.items()} for sig, peaks in self._peaks.items()}

    def load_peaks_record(self, record: Mapping[str, Mapping[str, int]]) -> None:
        """Replaces the compiled peaks with :meth:`peaks_record`'s output."""
        self._peaks = {
            sig: {int(b): int(v) for b, v in peaks.items()} for sig, peaks in record.items()
        }
