"""Figures agreed across processes, so every host takes the same decision (docs/design.md §5).

Each process reads its own memory probe; a decision taken from local figures could differ
between hosts, which would then run different shapes and deadlock in the first collective. So
the figures are all-gathered and combined conservatively: the largest peak, the smallest limit,
and the smallest measured throughput.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

# A missing figure travels as -1 (figures are byte counts, never negative). Arrays cross
# processes as int32 unless x64 is on, so each count travels as two 30-bit halves.
_MISSING = -1
_HALF = 2**30


def agree_on_memory(
    peak_bytes: int | None, limit_bytes: int | None
) -> tuple[int | None, int | None]:
    """The largest peak and smallest limit over all processes (identity with one process)."""
    if jax.process_count() == 1:
        return peak_bytes, limit_bytes
    from jax.experimental import multihost_utils

    halves = []
    for value in (peak_bytes, limit_bytes):
        halves += [_MISSING, 0] if value is None else [value // _HALF, value % _HALF]
    gathered = np.asarray(multihost_utils.process_allgather(np.array(halves, np.int32)))
    gathered = gathered.astype(np.int64).reshape(-1, 2, 2)
    values = gathered[:, :, 0] * _HALF + gathered[:, :, 1]
    present = gathered[:, :, 0] != _MISSING
    peaks = [int(v) for v, ok in zip(values[:, 0], present[:, 0], strict=True) if ok]
    limits = [int(v) for v, ok in zip(values[:, 1], present[:, 1], strict=True) if ok]
    return (max(peaks) if peaks else None), (min(limits) if limits else None)


def agree_on_rates(rates: Sequence[float | None]) -> list[float | None]:
    """Per position, the smallest rate over all processes, None where any process has none.

    A data-parallel step goes at the pace of its slowest host, so the throughput a decision uses
    is the smallest; the positions (e.g. one per batch bucket) must mean the same on every host.

    Example:
      >>> from triaccel_jax.controller._agreement import agree_on_rates
      >>> agree_on_rates([1500.0, None])  # one process: the figures themselves
      [1500.0, None]
    """
    if jax.process_count() == 1:
        return list(rates)
    from jax.experimental import multihost_utils

    local = np.array([_MISSING if r is None else r for r in rates], np.float32)
    gathered = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, len(rates))
    return [None if (column < 0).any() else float(column.min()) for column in gathered.T]


def agree_on_choice(values: Sequence[int]) -> list[int]:
    """Process 0's ``values`` on every process (identity with one process).

    A decision that rests on figures each host measures with its own noise (the spread of its
    step times) is taken once, by process 0, and applied everywhere: the positions must mean the
    same on every host.

    Example:
      >>> from triaccel_jax.controller._agreement import agree_on_choice
      >>> agree_on_choice([64, 2])  # one process: the values themselves
      [64, 2]
    """
    if jax.process_count() == 1:
        return list(values)
    from jax.experimental import multihost_utils

    chosen = multihost_utils.broadcast_one_to_all(np.array(values, np.int32))
    return [int(v) for v in np.asarray(chosen)]


def agree_on_figures(values: Sequence[float]) -> list[float]:
    """Process 0's float ``values`` on every process (identity with one process): measured
    figures that are saved, so that every process's checkpoint holds the same ones."""
    if jax.process_count() == 1:
        return list(values)
    from jax.experimental import multihost_utils

    chosen = multihost_utils.broadcast_one_to_all(np.array(values, np.float64))
    return [float(v) for v in np.asarray(chosen)]
