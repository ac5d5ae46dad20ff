"""Growing the batch without stalling: the bigger bucket's step compiles in a background thread.

Growing needs the bigger bucket's compiled step, and its compiled peak decides whether the grow
is safe. Compiled synchronously, that compile stalls training for seconds. Here a grow is
decided (``"grow_decided"``), the step is compiled on a worker thread while the controller keeps
stepping on the current bucket, and at the first step after the compile is ready its peak is
checked: the bucket switches (``"grow"``) or the grow is refused (``"reject"``). The compile is
the same one the synchronous path runs and is cached under the same key, so the number of
compiles is unchanged (docs/design.md §5 and §8).
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any
from typing import NamedTuple

from triaccel_jax.controller import _step_compiler as step_compiler


class CompileJob(NamedTuple):
    """A compile running in the background for a decided grow."""

    key: tuple
    future: concurrent.futures.Future
    reason: str
    figures: dict[str, Any]


class BackgroundCompiler:
    """One worker thread and at most one grow waiting for its compile.

    Example:
      >>> from triaccel_jax.controller._background_compile import BackgroundCompiler
      >>> BackgroundCompiler().busy
      False
    """

    def __init__(self) -> None:
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.job: CompileJob | None = None
        self._switch = True

    @property
    def busy(self) -> bool:
        """Whether a grow waits for its compile."""
        return self.job is not None

    def start_grow(self, controller: Any, bucket: int, reason: str, figures: dict) -> None:
        """Logs the decision to grow to ``bucket`` and starts compiling its step."""
        key, step, args = step_compiler.step_to_compile(
            controller, bucket, controller._num_micro(bucket)
        )
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="triaccel-compile"
            )

        def timed_build():
            start = time.perf_counter()
            return controller._build_step(step, args), time.perf_counter() - start

        self.job = CompileJob(key, self._executor.submit(timed_build), reason, figures)
        self._switch = True
        controller._log(
            "grow_decided",
            controller._micro,
            bucket,
            f"{reason}; compiling micro-batch {bucket} in the background",
            **figures,
        )

    def cancel_switch(self) -> None:
        """The compile in flight is kept (cached) but its grow is not taken."""
        self._switch = False

    def poll(self, controller: Any) -> None:
        """At a step's start: when the compile is ready, checks its peak and switches or refuses."""
        job = self.job
        if job is None or not job.future.done():
            return
        self.job = None
        executable, seconds = job.future.result()  # a failed compile raises here, named by XLA
        step_compiler.keep_compiled(controller, job.key, executable, seconds, background=True)
        bucket, _, policy = job.key
        if policy != controller.policy or not self._switch or bucket <= controller._micro:
            return  # re-planned or shrunk meanwhile: the decision no longer holds
        compiled = controller._compiled.peaks(controller._policy_signature())
        refused = controller._bucket.over_high_water(bucket, compiled)
        if refused is not None:
            controller._log(
                "reject",
                controller._micro,
                bucket,
                refused,
                compiled_peak_bytes=compiled[bucket],
                limit_bytes=controller._bucket.limit,
            )
            return
        controller._log("grow", controller._micro, bucket, job.reason, **job.figures)
        controller._bucket.micro = bucket
        controller._set_learning_rate()
