"""Compiling the controller's steps: the cache, the compiled peaks and the background worker.

A step is compiled per (micro-batch, micro-batches, policy) on shapes only, so its compiled peak
bytes are known before a batch of that size ever runs; that figure is what a grow is checked
against (docs/design.md §5). A precision policy is a plain hashable value, so it keys the cache
directly; compiled peaks are kept per policy signature, because the batch-size decisions fit a
line through one policy's peaks at a time.

Growing the batch or switching policy needs a step not compiled yet, and compiling it in the
step that decides stalls training for seconds. :class:`StepCompiler` can instead compile it on
one worker thread while training continues on the current executable; the controller asks
:meth:`StepCompiler.take_ready` at each step boundary and makes the switch itself. The compiler
never sees the controller: it is handed a ``make_step(key, opt_state)`` function that returns the
pure step and its abstract arguments.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax

from triaccel_jax.precision import compiled_peak_bytes

StepKey = tuple[int, int, Any]
"""``(micro-batch, micro-batches, policy)``: what a compiled step is specialised for."""


class CompiledStep(NamedTuple):
    """A newly compiled step: the executable, its compiled peak bytes (or None) and the seconds."""

    executable: Any
    peak_bytes: int | None
    seconds: float


class CompileJob(NamedTuple):
    """A compile running on the worker thread for a decided grow or re-plan.

    Attributes:
      key: the step it compiles.
      future: resolves to ``(executable, seconds)``.
      reason: why the switch was decided, for the event log.
      figures: the decision's figures, for the event log.
      plan: the new :class:`triaccel_jax.policy.PrecisionPlan` of a re-plan; None for a grow.
      switch: False once the switch was called off (a grow overtaken by a shrink or an
        out-of-memory error); the executable is still cached.
    """

    key: StepKey
    future: concurrent.futures.Future
    reason: str
    figures: dict[str, Any]
    plan: Any = None
    switch: bool = True


def build(step: Callable[..., Any], abstract_args: tuple) -> Any:
    """``step`` jitted and compiled for ``abstract_args`` (shapes only: no data touched).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from triaccel_jax.controller._compiling import build
      >>> executable = build(lambda x: x * 2, (jax.ShapeDtypeStruct((2,), jnp.float32),))
      >>> executable(jnp.ones(2)).tolist()
      [2.0, 2.0]
    """
    return jax.jit(step).lower(*abstract_args).compile()


class StepCompiler:
    """Compiled steps by :data:`StepKey`, their compiled peaks, and one background compile.

    Args:
      make_step: ``make_step(key, opt_state) -> (step, abstract_args)``: the pure step for
        ``key`` and its arguments as shapes; ``opt_state`` is the optimizer state the step will
        take (a re-plan compiles for the state converted to the new policy), or None for the
        one in force.
      builder: compiles ``(step, abstract_args)``; default :func:`build` (looked up when
        called, so a test may replace it to decide when a background compile finishes).
      clock: the clock a compile's seconds are read from (the controller's ``clock=``, read on
        the worker thread too); default ``time.perf_counter``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from triaccel_jax.controller._compiling import StepCompiler
      >>> shape = (jax.ShapeDtypeStruct((4,), jnp.float32),)
      >>> compiler = StepCompiler(lambda key, opt_state: (lambda x: x * key[0], shape))
      >>> executable, new = compiler.compiled((4, 1, None))
      >>> executable(jnp.ones(4)).tolist(), new is not None, compiler.compiled((4, 1, None))[1]
      ([4.0, 4.0, 4.0, 4.0], True, None)
    """

    def __init__(
        self,
        make_step: Callable[[StepKey, Any], tuple[Callable[..., Any], tuple]],
        builder: Callable[[Callable[..., Any], tuple], Any] | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._make_step = make_step
        self._clock = clock
        self._given_builder = builder
        self._steps: dict[StepKey, Any] = {}
        self._peaks: dict[str, dict[int, int]] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.job: CompileJob | None = None

    def _builder(self, step: Callable[..., Any], args: tuple) -> Any:
        return (self._given_builder or build)(step, args)

    def __len__(self) -> int:
        return len(self._steps)

    def __contains__(self, key: StepKey) -> bool:
        return key in self._steps

    # -- compiling now ------------------------------------------------------------------------

    def compiled(self, key: StepKey) -> tuple[Any, CompiledStep | None]:
        """The executable for ``key``, compiled now unless cached.

        Returns:
          ``(executable, new)``: ``new`` is the :class:`CompiledStep` when it was compiled by
          this call (for the caller to record its peak and log it), else None.
        """
        executable = self._steps.get(key)
        if executable is not None:
            return executable, None
        step, args = self._make_step(key, None)
        start = self._clock()
        new = self._store(key, self._builder(step, args), self._clock() - start)
        return new.executable, new

    def _store(self, key: StepKey, executable: Any, seconds: float) -> CompiledStep:
        self._steps[key] = executable
        return CompiledStep(executable, compiled_peak_bytes(executable), seconds)

    # -- compiled peaks -----------------------------------------------------------------------

    def record_peak(self, signature: str, micro: int, peak: int) -> None:
        """Notes the compiled peak bytes of bucket ``micro`` under policy ``signature``."""
        self._peaks.setdefault(signature, {})[micro] = peak

    def peaks(self, signature: str) -> dict[int, int]:
        """``{bucket: compiled peak bytes}`` under policy ``signature`` (a copy)."""
        return dict(self._peaks.get(signature, {}))

    def peaks_record(self) -> dict[str, dict[int, int]]:
        """The compiled peaks ``{signature: {bucket: bytes}}`` (a copy)."""
        return {sig: dict(peaks) for sig, peaks in self._peaks.items()}

    def load_peaks_record(self, record: Mapping[str, Mapping[Any, int]]) -> None:
        """Replaces the compiled peaks with :meth:`peaks_record`'s output (its bucket keys
        integers, or the decimal strings JSON writes them as)."""
        self._peaks = {
            sig: {int(b): int(v) for b, v in peaks.items()} for sig, peaks in record.items()
        }

    # -- compiling in the background ----------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a background compile waits to be taken."""
        return self.job is not None

    def start(
        self,
        key: StepKey,
        reason: str,
        figures: dict[str, Any],
        *,
        plan: Any = None,
        opt_state: Any = None,
    ) -> None:
        """Starts compiling ``key`` on the worker thread for a decided grow (``plan`` None) or
        re-plan (``plan`` the new plan, ``opt_state`` the state converted to its policy)."""
        if self.job is not None:
            raise RuntimeError("a background compile is already waiting")
        step, args = self._make_step(key, opt_state)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="triaccel-compile"
            )

        def timed_build() -> tuple[Any, float]:
            start = self._clock()
            return self._builder(step, args), self._clock() - start

        self.job = CompileJob(key, self._executor.submit(timed_build), reason, figures, plan)

    def call_off_grow(self) -> None:
        """A grow compiling now is not taken (its executable is still cached when ready).

        A re-plan's switch still holds: the new policy does not depend on the batch.
        """
        if self.job is not None and self.job.plan is None:
            self.job = self.job._replace(switch=False)

    def cancel(self) -> None:
        """Forgets the background compile's switch (its executable is still cached if ready)."""
        job, self.job = self.job, None
        if job is not None and job.future.done() and job.future.exception() is None:
            executable, seconds = job.future.result()
            self._store(job.key, executable, seconds)

    def wait(self) -> bool:
        """Blocks until the background compile (if any) is ready; returns whether there was one."""
        if self.job is None:
            return False
        self.job.future.result()
        return True

    def take_ready(self) -> tuple[CompileJob, CompiledStep] | None:
        """The finished background compile, now cached, or None while none is ready.

        Raises:
          Exception: the compile's own error (named by XLA) when it failed.
        """
        job = self.job
        if job is None or not job.future.done():
            return None
        self.job = None
        executable, seconds = job.future.result()
        return job, self._store(job.key, executable, seconds)
