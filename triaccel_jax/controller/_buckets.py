"""Batch buckets and the decision to grow or shrink: pure functions of measured figures (docs/design.md §5).

The controller calls :func:`decide_bucket` with what it knows (the peak bytes of every bucket it
has run or compiled, the limit, its hysteresis counters) and does what the returned
:class:`BucketDecision` says, so every rule here is tested without a device.

Rules (Lightning's batch-size finder and Pollux adapt the batch to memory the same way, but once
or on a schedule; here it is continuous, with hysteresis):

* buckets are powers of two times the data-parallel size, between ``min_batch`` and
  ``max_batch``; a bucket that ran out of memory, and every larger one, is a *ceiling*;
* shrink when the current bucket's peak passes ``high_water * limit`` at ``patience`` consecutive
  checks: to the largest bucket predicted to fit under ``target * limit``;
* grow when a larger bucket is predicted to fit under ``target * limit`` at ``patience``
  consecutive checks: to the largest such bucket below the ceiling;
* a bucket's peak is known once it has run or been compiled; others are predicted by linear
  interpolation in the batch size (activations grow linearly; state and params do not).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from triaccel_jax._src import validation


def bucket_sizes(min_batch: int, max_batch: int, multiple: int = 1) -> tuple[int, ...]:
    """``multiple * 2**k`` for every k with the result in ``[min_batch, max_batch]``.

    Args:
      min_batch: smallest batch, >= 1.
      max_batch: largest batch, >= ``min_batch``.
      multiple: the data-parallel size every batch must be a multiple of, >= 1.

    Returns:
      The sizes, ascending.

    Raises:
      ValueError: bad sizes, or no bucket in the range.

    Example:
      >>> from triaccel_jax.controller import bucket_sizes
      >>> bucket_sizes(16, 256)
      (16, 32, 64, 128, 256)
      >>> bucket_sizes(10, 100, multiple=8)
      (16, 32, 64)
    """
    for name, value in (("min_batch", min_batch), ("max_batch", max_batch), ("multiple", multiple)):
        validation.check_integer(name, value, 1, strict=True, description="a positive integer")
    if min_batch > max_batch:
        raise ValueError(f"`min_batch` ({min_batch}) must be <= `max_batch` ({max_batch})")
    sizes, size = [], multiple
    while size <= max_batch:
        if size >= min_batch:
            sizes.append(size)
        size *= 2
    if not sizes:
        raise ValueError(
            f"no batch size of the form {multiple} * 2**k lies in [{min_batch}, {max_batch}]; "
            f"widen the range (batches must be multiples of the data-parallel size {multiple})"
        )
    return tuple(sizes)


def predict_peak(batch: int, peaks: Mapping[int, int], fixed_bytes: int = 0) -> int | None:
    """The peak bytes of ``batch``: known, or linear in the batch size from the known ones.

    Args:
      batch: the batch size.
      peaks: ``{batch size: peak bytes}`` measured or compiled.
      fixed_bytes: bytes that do not grow with the batch (params, optimizer state), used when
        only one peak is known.

    Returns:
      The bytes, or None when no peak is known.

    Example:
      >>> from triaccel_jax.controller import predict_peak
      >>> predict_peak(64, {16: 300, 32: 500})  # 100 + 12.5 per sample
      900
    """
    if batch in peaks:
        return int(peaks[batch])
    if not peaks:
        return None
    if len(peaks) == 1:
        ((known, peak),) = peaks.items()
        per_sample = max(peak - fixed_bytes, 0) / known
        return round(peak + per_sample * (batch - known))
    # The two known sizes nearest to ``batch`` (in ratio), so interpolation is preferred and
    # extrapolation starts from the closest evidence.
    low, high = sorted(sorted(peaks, key=lambda b: abs(b - batch))[:2])
    slope = max((peaks[high] - peaks[low]) / (high - low), 0.0)
    return round(peaks[low] + slope * (batch - low))


class BucketDecision(NamedTuple):
    """What :func:`decide_bucket` chose, why, and the hysteresis counters to keep."""

    bucket: int
    kind: str  # "keep", "grow" or "shrink"
    reason: str
    grow_streak: int
    shrink_streak: int


def decide_bucket(
    current: int,
    buckets: tuple[int, ...],
    peaks: Mapping[int, int],
    limit: int | None,
    *,
    target: float = 0.85,
    high_water: float = 0.95,
    patience: int = 2,
    ceiling: int | None = None,
    fixed_bytes: int = 0,
    grow_streak: int = 0,
    shrink_streak: int = 0,
) -> BucketDecision:
    """Chooses the next batch bucket from the memory figures.

    Args:
      current: the bucket in use (one of ``buckets``).
      buckets: the allowed sizes, ascending.
      peaks: ``{bucket: peak bytes}`` known so far; ``current`` should be in it.
      limit: the memory limit in bytes (None: unknown, nothing changes).
      target: grow only to buckets predicted under ``target * limit``, in (0, 1).
      high_water: shrink when the current peak passes ``high_water * limit``, in
        [target, 1].
      patience: consecutive checks a change must be indicated at before it is made, >= 1.
      ceiling: the smallest bucket that ran out of memory; it and larger ones are never chosen.
      fixed_bytes: see :func:`predict_peak`.
      grow_streak: consecutive checks that indicated growth so far.
      shrink_streak: consecutive checks that indicated shrinking so far.

    Returns:
      The :class:`BucketDecision`.

    Example:
      >>> from triaccel_jax.controller import decide_bucket
      >>> decision = decide_bucket(16, (16, 32, 64, 128), {16: 200, 32: 300}, 1000, patience=1)
      >>> decision.bucket, decision.kind  # 64 predicted at 500 bytes, 128 at 900 > 850
      (64, 'grow')
    """
    if current not in buckets:
        raise ValueError(f"`current` bucket {current!r} is not one of `buckets` {tuple(buckets)}")
    if limit is None:
        return BucketDecision(current, "keep", "no memory limit known", 0, 0)
    allowed = [b for b in buckets if ceiling is None or b < ceiling]
    peak = predict_peak(current, peaks, fixed_bytes)
    if peak is not None and peak > high_water * limit:
        shrink_streak += 1
        smaller = [b for b in allowed if b < current]
        if not smaller:
            return BucketDecision(
                current, "keep", "over the high-water mark at the smallest bucket", 0, shrink_streak
            )
        if shrink_streak < patience:
            return BucketDecision(
                current,
                "keep",
                f"peak {peak / limit:.1%} of the limit over the high-water mark "
                f"{high_water:.0%} ({shrink_streak}/{patience})",
                0,
                shrink_streak,
            )
        fitting = [b for b in smaller if _fits(b, peaks, fixed_bytes, target * limit)]
        choice = fitting[-1] if fitting else smaller[0]
        return BucketDecision(
            choice,
            "shrink",
            f"peak {peak / limit:.1%} of the limit over the high-water mark {high_water:.0%}",
            0,
            0,
        )
    larger = [b for b in allowed if b > current and _fits(b, peaks, fixed_bytes, target * limit)]
    if not larger:
        return BucketDecision(current, "keep", "no larger bucket predicted to fit", 0, 0)
    grow_streak += 1
    choice = larger[-1]
    predicted = predict_peak(choice, peaks, fixed_bytes)
    assert predicted is not None  # choice fits, so its peak is predicted
    reason = (
        f"bucket {choice} predicted at {predicted / limit:.0%} of the limit (target {target:.0%})"
    )
    if grow_streak < patience:
        return BucketDecision(
            current, "keep", f"{reason} ({grow_streak}/{patience})", grow_streak, 0
        )
    # A move starts a new streak: the next grow waits for `patience` checks again.
    return BucketDecision(choice, "grow", reason, 0, 0)


def _fits(batch: int, peaks: Mapping[int, int], fixed_bytes: int, allowance: float) -> bool:
    predicted = predict_peak(batch, peaks, fixed_bytes)
    return predicted is not None and predicted <= allowance
