"""``BucketTracker``: the batch bucket in force and what is known about memory at each bucket.

It holds the controller's batch-size memory (the bucket, the hysteresis streaks, the
out-of-memory ceiling, the measured peaks and the last limit), private and changed only by its
own methods, and turns each memory reading or out-of-memory error into a decision with
:func:`triaccel_jax.controller.decide_bucket` or the retry rule; it returns the decisions and the
controller logs them (docs/design.md §5). Its :meth:`BucketTracker.state_dict` is the ``"bucket"``
part of the controller's saved state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from triaccel_jax._src import arrays
from triaccel_jax.controller import _buckets as buckets_lib
from triaccel_jax.controller import _out_of_memory as out_of_memory
from triaccel_jax.controller import _state_record as state_record


class BucketTracker:
    """The batch bucket and its memory figures.

    Args:
      buckets: the allowed micro-batch sizes, ascending.
      start: the bucket to start at.
      target, high_water, patience: as for :func:`triaccel_jax.controller.decide_bucket`.

    Example:
      >>> from triaccel_jax.controller._bucket_tracker import BucketTracker
      >>> tracker = BucketTracker((16, 32, 64), 16, target=0.85, high_water=0.95, patience=1)
      >>> decision = tracker.check(1_000, 100_000, compiled_peaks={}, fixed_bytes=0)
      >>> decision.kind, decision.bucket
      ('grow', 64)
      >>> tracker.move_to(decision.bucket)
      >>> tracker.micro, tracker.state_dict()["measured_peaks"]
      (64, {'16': 1000})
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
        self._buckets = tuple(buckets)
        self._micro = start
        self._target, self._high_water, self._patience = target, high_water, patience
        self._ceiling: int | None = None
        self._grow_streak = self._shrink_streak = 0
        self._measured: dict[int, int] = {}
        self._limit: int | None = None

    @property
    def micro(self) -> int:
        """The bucket in force."""
        return self._micro

    @property
    def ceiling(self) -> int | None:
        """The smallest bucket that ran out of memory, or None."""
        return self._ceiling

    @property
    def limit(self) -> int | None:
        """The memory limit at the last check, or None."""
        return self._limit

    def move_to(self, bucket: int) -> None:
        """Puts ``bucket`` in force (a grow, shrink or rollback the controller takes).

        Raises:
          ValueError: ``bucket`` is not one of the buckets.
        """
        if bucket not in self._buckets:
            raise ValueError(f"{bucket!r} is not one of the buckets {self._buckets}")
        self._micro = bucket

    def forget_measured(self) -> None:
        """Forgets the probe's measured peaks: they were for a policy no longer in force."""
        self._measured = {}

    def known_peaks(self, compiled_peaks: Mapping[int, int]) -> dict[int, int]:
        """Peak bytes per bucket: measured by the probe if it measures (they include whatever
        else holds memory), else XLA's compiled analyses. The two are not mixed: a linear fit
        through figures from different sources would be meaningless."""
        return dict(self._measured) if self._measured else dict(compiled_peaks)

    def fixed_bytes(self, state: Any, params: Any) -> int:
        """Bytes of a step's peak that do not grow with the batch, for a one-point prediction.

        A compiled step holds its state twice (inputs and outputs: nothing is donated, so that
        an out-of-memory step leaves the state intact) and one gradient per parameter. Measured
        peaks also include unknown others, so they are extrapolated as proportional to the
        batch, which over-predicts: growth is then cautious, never unsafe.
        """
        if self._measured:
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
        self._limit = limit
        if peak is not None:
            self._measured[self._micro] = peak
        decision = buckets_lib.decide_bucket(
            self._micro,
            self._buckets,
            self.known_peaks(compiled_peaks),
            limit,
            target=self._target,
            high_water=self._high_water,
            patience=self._patience,
            ceiling=self._ceiling,
            fixed_bytes=fixed_bytes,
            grow_streak=self._grow_streak,
            shrink_streak=self._shrink_streak,
        )
        self._grow_streak, self._shrink_streak = decision.grow_streak, decision.shrink_streak
        return decision

    def over_high_water(self, bucket: int, compiled_peaks: Mapping[int, int]) -> str | None:
        """Why growing to ``bucket`` is refused (its compiled peak passes the high-water mark)."""
        peak = None if self._measured else compiled_peaks.get(bucket)
        if peak is None or self._limit is None or peak <= self._high_water * self._limit:
            return None
        return (
            f"compiled peak of bucket {bucket} is {peak / self._limit:.0%} of the limit, over the "
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
            micro, self._buckets, self._ceiling, step=step, tried=tried, error=error
        )
        self._ceiling, self._micro = decision.ceiling, min(self._micro, decision.bucket)
        self._grow_streak = self._shrink_streak = 0
        return decision

    def saved_state(self) -> BucketTrackerState:
        """The tracker's saved state (:meth:`state_dict` encodes it)."""
        return BucketTrackerState(
            micro_batch=self._micro,
            ceiling=self._ceiling,
            grow_streak=self._grow_streak,
            shrink_streak=self._shrink_streak,
            measured_peaks=dict(self._measured),
            limit_bytes=self._limit,
        )

    def load_saved_state(self, saved: BucketTrackerState) -> None:
        """Continues from :meth:`saved_state`'s output; everything is checked before anything
        is taken.

        Raises:
          ValueError: the state names a bucket this tracker does not have.
        """
        for name, bucket in (("micro_batch", saved.micro_batch), ("ceiling", saved.ceiling)):
            if bucket is not None and bucket not in self._buckets:
                raise ValueError(f"controller state: {name} {bucket!r} is not a bucket")
        self._micro, self._ceiling = saved.micro_batch, saved.ceiling
        self._measured, self._limit = dict(saved.measured_peaks), saved.limit_bytes
        self._grow_streak, self._shrink_streak = saved.grow_streak, saved.shrink_streak

    def state_dict(self) -> dict[str, Any]:
        """The tracker's state as JSON-ready data: the bucket, ceiling, streaks, measured peaks
        (``{"bucket": bytes}``) and the last limit."""
        return state_record.encode(self.saved_state())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from :meth:`state_dict`'s output; everything is checked before anything is
        taken.

        Raises:
          ValueError: the state is malformed (the field named), or names a bucket this tracker
            does not have.
        """
        self.load_saved_state(state_record.decode(BucketTrackerState, state, "bucket"))


@dataclasses.dataclass(frozen=True)
class BucketTrackerState:
    """What a :class:`BucketTracker` saves, the ``"bucket"`` part of the controller's state.

    Attributes:
      micro_batch: the bucket in force.
      ceiling: the smallest bucket that ran out of memory, or None.
      grow_streak, shrink_streak: the hysteresis streaks.
      measured_peaks: the measured peak bytes by bucket (saved with the buckets as strings).
      limit_bytes: the last memory limit read, or None.
    """

    micro_batch: int
    ceiling: int | None
    grow_streak: int
    shrink_streak: int
    measured_peaks: dict[int, int]
    limit_bytes: int | None
