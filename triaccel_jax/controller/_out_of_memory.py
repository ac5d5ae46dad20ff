"""The out-of-memory retry: which bucket to re-run a step at after ``RESOURCE_EXHAUSTED``.

An out-of-memory step changed nothing (the state is not donated), so the controller re-runs the
*same samples* as accumulated micro-batches of the next smaller bucket and marks the failed
bucket as a ceiling; at the smallest bucket there is nothing left to try (docs/design.md §5).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax


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
