"""``BucketTracker``: the batch bucket in force and what is known about memory at each bucket.

It holds the controller's batch-size memory (the bucket, the hysteresis streaks, the
out-of-memory ceiling, the measured peaks and the last limit) and turns each memory reading or
out-of-memory error into a decision with :func:`triaccel_jax.controller.decide_bucket` or the
retry rule; it returns the decisions and the controller logs them (docs/design.md §5).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from triaccel_jax._src import arrays
from triaccel_jax.controller import _buckets as buckets_lib
from triaccel_jax.controller import _out_of_memory as out_of_memory


class BucketTracker:
    """The batch bucket and its memory figures.

    Args:
      buckets: the allowed micro-batch sizes, ascending.
      start: the bucket to start at.
      target, high_water, patience: as for :func:`triaccel_jax.controller.decide_bucket`.

    Attributes:
      micro: the bucket in force.
      ceiling: the smallest bucket that ran out of memory, or None.
      grow_streak, shrink_streak: consecutive checks that indicated a move.
      measured: ``{bucket: peak bytes}`` as measured by the probe under the current policy.
      limit: the memory limit at the last check, or None.

    Example:
      >>> from triaccel_jax.controller._bucket_tracker import BucketTracker
      >>> tracker = BucketTracker((16, 32, 64), 16, target=0.85, high_water=0.95, patience=1)
      >>> decision = tracker.check(1_000, 100_000, compiled_peaks={}, fixed_bytes=0)
      >>> decision.kind, decision.bucket
      ('grow', 64)
    """

    def __init__(
        self,
        buckets: Sequence[int],
        start: int,
        *,
        target: float,
        high_water: float,
        patience: int,
    ) -> None:
        self.buckets = tuple(buckets)
        self.micro = start
        self._target, self._high_water, self._patience = target, high_water, patience
        self.ceiling: int | None = None
        self.grow_streak = self.shrink_streak = 0
        self.measured: dict[int, int] = {}
        self.limit: int | None = None

    def known_peaks(self, compiled_peaks: Mapping[int, int]) -> dict[int, int]:
        """Peak bytes per bucket: measured by the probe if it measures (they include whatever
        else holds memory), else XLA's compiled analyses. The two are not mixed: a linear fit
        through figures from different sources would be meaningless."""
        return dict(self.measured) if self.measured else dict(compiled_peaks)

    def fixed_bytes(self, state: Any, params: Any) -> int:
        """Bytes of a step's peak that do not grow with the batch, for a one-point prediction.

        A compiled step holds its state twice (inputs and outputs: nothing is donated, so that
        an out-of-memory step leaves the state intact) and one gradient per parameter. Measured
        peaks also include unknown others, so they are extrapolated as proportional to the
        batch, which over-predicts: growth is then cautious, never unsafe.
        """
        if self.measured:
            return 0
        return 2 * arrays.tree_nbytes(state) + arrays.tree_nbytes(params)

    def check(
        self,
        peak: int | None,
        limit: int | None,
        *,
        compiled_peaks: Mapping[int, int],
        fixed_bytes: int,
    ) -> buckets_lib.BucketDecision:
        """Records a reading at the current bucket and decides whether to move (not moving)."""
        self.limit = limit
        if peak is not None:
            self.measured[self.micro] = peak
        decision = buckets_lib.decide_bucket(
            self.micro,
            self.buckets,
            self.known_peaks(compiled_peaks),
            limit,
            target=self._target,
            high_water=self._high_water,
            patience=self._patience,
            ceiling=self.ceiling,
            fixed_bytes=fixed_bytes,
            grow_streak=self.grow_streak,
            shrink_streak=self.shrink_streak,
        )
        self.grow_streak, self.shrink_streak = decision.grow_streak, decision.shrink_streak
        return decision

    def over_high_water(self, bucket: int, compiled_peaks: Mapping[int, int]) -> str | None:
        """Why growing to ``bucket`` is refused (its compiled peak passes the high-water mark)."""
        peak = None if self.measured else compiled_peaks.get(bucket)
        if peak is None or self.limit is None or peak <= self._high_water * self.limit:
            return None
        return (
            f"compiled peak of bucket {bucket} is {peak / self.limit:.0%} of the limit, over the "
            f"high-water mark {self._high_water:.0%}"
        )

    def retry_after_out_of_memory(
        self, micro: int, *, step: int, tried: Sequence[str], error: BaseException
    ) -> out_of_memory.RetryDecision:
        """Moves below ``micro``, the bucket a step ran out of memory at.

        The failure is charged to the bucket the step ran at, which under steps in flight and
        background compiles need not be the tracker's current one: ``micro`` becomes the
        ceiling, and the tracker moves to the next smaller bucket unless it is already below.

        Raises:
          OutOfMemoryError: ``micro`` is the smallest bucket.
        """
        decision = out_of_memory.retry_after_out_of_memory(
            micro, self.buckets, self.ceiling, step=step, tried=tried, error=error
        )
        self.ceiling, self.micro = decision.ceiling, min(self.micro, decision.bucket)
        self.grow_streak = self.shrink_streak = 0
        return decision

    def record(self) -> dict[str, Any]:
        """The tracker's state, as the controller's state record holds it."""
        return {
            "micro_batch": self.micro,
            "ceiling": self.ceiling,
            "grow_streak": self.grow_streak,
            "shrink_streak": self.shrink_streak,
            "measured_peaks": dict(self.measured),
            "limit_bytes": self.limit,
        }

    def restore(self, record: Any) -> None:
        """Continues from a :class:`ControllerRecord` (or anything with :meth:`record`'s fields)."""
        self.micro, self.ceiling = record.micro_batch, record.ceiling
        self.grow_streak, self.shrink_streak = record.grow_streak, record.shrink_streak
        self.measured, self.limit = dict(record.measured_peaks), record.limit_bytes
