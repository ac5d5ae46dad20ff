"""The out-of-memory retry: which bucket to re-run a step at after ``RESOURCE_EXHAUSTED``.

An out-of-memory step changed nothing (the state is not donated), so the controller re-runs the
*same samples* as accumulated micro-batches of the next smaller bucket and marks the failed
bucket as a ceiling; at the smallest bucket there is nothing left to try (docs/design.md §5).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from typing import NamedTuple

import jax

from triaccel_jax._src import validation


class OutOfMemoryError(RuntimeError):
    """The step ran out of memory at the smallest allowed batch size."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is XLA running out of memory (``RESOURCE_EXHAUSTED``).

    Example:
      >>> import jax
      >>> from triaccel_jax.controller import is_out_of_memory
      >>> is_out_of_memory(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: 2.0GiB"))
      True
      >>> is_out_of_memory(ValueError("RESOURCE_EXHAUSTED"))  # only XLA's runtime errors
      False
    """
    if not isinstance(error, jax.errors.JaxRuntimeError):
        return False
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


class RetryDecision(NamedTuple):
    """Where to re-run a step that ran out of memory.

    Attributes:
      bucket: the smaller micro-batch to re-run the same samples at.
      ceiling: the new ceiling (no bucket at or above it is tried again).
      reason: why, in words, for the event log.
    """

    bucket: int
    ceiling: int
    reason: str


def retry_after_out_of_memory(
    micro: int,
    buckets: Sequence[int],
    ceiling: int | None,
    *,
    step: int,
    tried: Sequence[str],
    error: BaseException,
) -> RetryDecision:
    """The bucket to retry at after micro-batch ``micro`` ran out of memory.

    Args:
      micro: the micro-batch that ran out of memory.
      buckets: the allowed micro-batches.
      ceiling: the ceiling so far, or None.
      step: the step number, for the message.
      tried: the attempts so far (``"micro-batches x micro-batch"``), for the message.
      error: XLA's error.

    Returns:
      A :class:`RetryDecision`.

    Raises:
      OutOfMemoryError: ``micro`` is the smallest bucket.

    Example:
      >>> from triaccel_jax.controller._out_of_memory import retry_after_out_of_memory
      >>> retry_after_out_of_memory(
      ...     64, (16, 32, 64), None, step=3, tried=["1x64"], error=MemoryError("OOM")
      ... )[:2]
      (32, 64)
    """
    smaller = [b for b in buckets if b < micro]
    ceiling = micro if ceiling is None else min(ceiling, micro)
    if not smaller:
        raise OutOfMemoryError(
            f"step {step} ran out of memory at the smallest batch bucket {micro} "
            f"(tried micro-batches {', '.join(tried)}; buckets {tuple(buckets)}). Lower "
            f"`min_batch`, free device memory or use lower precision. XLA said: "
            f"{str(error).splitlines()[0]}"
        ) from error
    new = smaller[-1]
    reason = (
        f"out of memory at micro-batch {micro}: re-running the same samples as micro-batches "
        f"of {new}; {micro} is now a ceiling"
    )
    return RetryDecision(new, ceiling, reason)


class FaultSite(NamedTuple):
    """Where the controller is about to touch the device, as a fault injector sees it.

    Attributes:
      where: ``"dispatch"`` (the compiled step is about to be called) or ``"read"`` (the step's
        metrics are about to be copied to the host: under asynchronous dispatch that is where
        a device's out-of-memory error may first surface).
      step: the step's index (0 for the first step).
      micro: the micro-batch it runs at.
      num_micro: micro-batches it accumulates.
    """

    where: str
    step: int
    micro: int
    num_micro: int


def simulated_out_of_memory(site: FaultSite) -> jax.errors.JaxRuntimeError:
    """The error XLA raises when a device runs out of memory, for ``site``.

    Example:
      >>> from triaccel_jax.controller import FaultSite, is_out_of_memory, simulated_out_of_memory
      >>> is_out_of_memory(simulated_out_of_memory(FaultSite("read", 3, 64, 1)))
      True
    """
    return jax.errors.JaxRuntimeError(
        f"RESOURCE_EXHAUSTED: injected out-of-memory error at the {site.where} of step "
        f"{site.step} (micro-batch {site.micro} x {site.num_micro})"
    )


class OutOfMemoryFaults:
    """A fault injector: out-of-memory errors at chosen steps, for chaos-testing a run.

    Pass it as ``Controller(..., faults=OutOfMemoryFaults(...))``. The controller calls it at
    every dispatch and every read (:class:`FaultSite`); where a step is scheduled it raises the
    error a device raises (:func:`simulated_out_of_memory`), so the recovery taken is exactly the
    one a real out-of-memory error takes: the step is re-run on its same samples at a smaller
    bucket, and a failed read also re-runs the steps queued behind it. Any callable taking a
    :class:`FaultSite` can be given instead (e.g. one failing whenever ``site.micro`` passes a
    size, to emulate a smaller device).

    Args:
      at_dispatch: ``{step: how many attempts at it fail at dispatch}``.
      at_read: ``{step: how many attempts at it fail when its metrics are read}``.

    Attributes:
      injected: the :class:`FaultSite` of every error raised, in order.

    Example:
      >>> import jax.numpy as jnp, numpy as np, triaccel_jax
      >>> from triaccel_jax.controller import OutOfMemoryFaults
      >>> faults = OutOfMemoryFaults(at_read={2: 1})
      >>> controller = triaccel_jax.Controller(
      ...     lambda p, b: jnp.mean((b @ p - 1.0) ** 2),
      ...     jnp.zeros(2),
      ...     triaccel_jax.triaccel(0.05),
      ...     np.ones((64, 2), np.float32),
      ...     min_batch=8,
      ...     max_batch=16,
      ...     batch_size=16,
      ...     probe=triaccel_jax.BudgetMemoryProbe(2**30),
      ...     faults=faults,
      ... )
      >>> infos = controller.run(4)
      >>> [info.micro_batch for info in infos], [e.kind for e in controller.events].count("oom")
      ([16, 16, 8, 8], 1)

    References:
      Basiri et al., 2016, "Chaos Engineering" (inject the failures a system must survive).
    """

    def __init__(
        self,
        at_dispatch: Mapping[int, int] | None = None,
        at_read: Mapping[int, int] | None = None,
    ) -> None:
        self._left = {"dispatch": dict(at_dispatch or {}), "read": dict(at_read or {})}
        for where, schedule in self._left.items():
            for step, count in schedule.items():
                validation.check_integer(f"at_{where} step", step, 0)
                validation.check_integer(f"at_{where}[{step}]", count, 0)
        self.injected: list[FaultSite] = []

    def add(self, where: str, step: int, count: int = 1) -> None:
        """Schedules ``count`` more failures of step ``step`` at ``where`` (``"dispatch"`` or
        ``"read"``), e.g. from a callback while the run goes on."""
        if where not in self._left:
            raise ValueError(f"`where` must be 'dispatch' or 'read', got {where!r}")
        validation.check_integer("step", step, 0)
        validation.check_integer("count", count, 0)
        self._left[where][step] = self._left[where].get(step, 0) + count

    def __call__(self, site: FaultSite) -> None:
        left = self._left[site.where]
        if left.get(site.step, 0) > 0:
            left[site.step] -= 1
            self.injected.append(site)
            raise simulated_out_of_memory(site)
