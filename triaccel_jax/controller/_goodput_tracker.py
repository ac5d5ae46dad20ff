"""``GoodputTracker``: the figures goodput decides from, and the trial a move may be on.

It holds what the controller measures for goodput (docs/design.md §5.3), private and changed only
by its own methods: the gradient noise scale averaged per sample with its interval
(:mod:`._noise_scale`) and its recent history (AdaScale's gain reads it), the sums of the timed
steps at each (micro-batch, micro-batches, policy) (:mod:`._throughput`), and the trial an
exploring move is on. Each step read is folded in (:meth:`GoodputTracker.observe_noise`,
:meth:`GoodputTracker.observe_throughput`); at a memory check :meth:`GoodputTracker.decide` asks
the pure :func:`._goodput.decide_batch`.

Everything it holds is saved (:meth:`GoodputTracker.state_dict`, the ``"goodput"`` part of the
controller's state), so that a resumed run decides as the uninterrupted one would.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Annotated
from typing import Any

from triaccel_jax.controller import _agreement as agreement
from triaccel_jax.controller import _goodput as goodput
from triaccel_jax.controller import _state_record as state_record
from triaccel_jax.controller._buckets import BucketDecision
from triaccel_jax.controller._noise_scale import NoiseScaleEstimate
from triaccel_jax.controller._noise_scale import observe_noise
from triaccel_jax.controller._throughput import StepTimes

# (micro-batch, micro-batches per step, policy signature): where a throughput was measured.
ThroughputKey = tuple[int, int, str]

# Timed steps an assumed step-time model stands for at each size: enough to count as known.
_ASSUMED_STEPS = 10_000


class GoodputTracker:
    """The noise scale, step times and trial behind ``batch_rule="goodput"``.

    Args:
      horizon: the samples over which the noise averages forget (``ControllerConfig.
        noise_horizon``).
      lag: steps in flight (``ControllerConfig.steps_in_flight``): AdaScale's gain of a step
        comes from the estimates of the step ``lag + 1`` before it (:meth:`noise_before`).
      reference: the batch the learning rate was tuned at (Pollux's ``B0``): the floor.
      margin, critical_multiple: as for :func:`._goodput.decide_batch`.
      assumed_step_time: ``(fixed_seconds, seconds_per_sample)``: decide with this step-time
        model instead of the measured one (a study of the statistics alone); None: measured.
      block: the consecutive steps timed as one block (``ControllerConfig.check_every``: the
        steps between two memory checks, each block holding one check's flush), whose means'
        spread is the throughput's uncertainty (:class:`._throughput.StepTimes`).
      every: the samples between decisions (``ControllerConfig.goodput_every`` of an epoch):
        the decisions run on a sample clock, so that each rests on about the same new evidence
        whatever the batch (a check sooner than that keeps the batch).

    Example:
      >>> from triaccel_jax.controller._goodput_tracker import GoodputTracker
      >>> tracker = GoodputTracker(
      ...     horizon=1e6,
      ...     lag=1,
      ...     reference=32,
      ...     margin=0.05,
      ...     critical_multiple=1.0,
      ...     assumed_step_time=(0.010, 1e-5),  # a GPU-like device
      ...     every=64,
      ... )
      >>> # |G|^2 = 1, tr(Sigma) = 256: |g_16|^2 = 1 + 256/16 = 17, |g_32|^2 = 1 + 256/32 = 9.
      >>> for step in range(3):
      ...     tracker.observe_noise(step, (9.0, 17.0), batch=32, micro=16)
      >>> round(tracker.noise_scale, 6)
      256.0
      >>> keys = {b: (b, 1, "none") for b in (32, 64, 128, 256)}
      >>> decision, figures = tracker.decide(32, [32, 64, 128, 256], keys, measurable=True)
      >>> decision.batch, decision.kind
      (256, 'move')
    """

    def __init__(
        self,
        *,
        horizon: float,
        lag: int,
        reference: int,
        margin: float,
        critical_multiple: float,
        assumed_step_time: tuple[float, float] | None = None,
        block: int = 1,
        every: int = 1,
    ) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"`block` must be a whole number of steps >= 1, got {block!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"`every` must be a whole number of samples >= 1, got {every!r}")
        self._horizon, self._lag, self._reference = horizon, lag, reference
        self._every, self._block = every, block
        # The block being timed at last_key: (steps, seconds) not yet added to its sums.
        self._pending: tuple[int, float] = (0, 0.0)
        # The sample clock: samples read so far, and the reading at the last decision.
        self._samples = 0
        self._decided_at = 0
        self._margin, self._critical_multiple = margin, critical_multiple
        self._assumed = assumed_step_time
        self._noise = NoiseScaleEstimate()
        # The estimates after each of the last steps read, AdaScale's gain reads them.
        self._recent: collections.deque[tuple[int, NoiseScaleEstimate]] = collections.deque(
            maxlen=lag + 1
        )
        self._times: dict[ThroughputKey, StepTimes] = {}
        # The key of the last step read: a step at another key is the first after a move.
        self._last_key: ThroughputKey | None = None
        # (the bucket a trial left, the bucket on trial), while an exploration is undecided.
        self._trial: tuple[int, int] | None = None

    @property
    def noise_scale(self) -> float | None:
        """The simple noise scale ``B_simple`` averaged per sample, or None before any estimate."""
        return self._noise.simple

    @property
    def noise_interval(self) -> tuple[float, float] | None:
        """The noise scale's 95% interval, or None before two estimates."""
        return self._noise.interval()

    @property
    def throughput(self) -> dict[ThroughputKey, float]:
        """Samples per second at each key: the samples of its timed steps over their seconds."""
        keys = [*self._times, *([self._last_key] if self._last_key is not None else [])]
        return {key: rate for key in dict.fromkeys(keys) if (rate := self.rate(key)) is not None}

    def rate(self, key: ThroughputKey) -> float | None:
        """The samples per second measured at ``key`` (their sums' ratio), or None."""
        times = self._timed(key)
        if times is None or times.steps == 0 or times.seconds <= 0.0:
            return None
        return key[0] * key[1] / times.mean

    def noise_before(self, step: int) -> NoiseScaleEstimate | None:
        """The estimates AdaScale's gain for ``step`` is taken from: those after the latest step
        read at or before ``step - 1 - lag`` (None if none is).

        With ``lag`` the steps in flight, that step has always been read when ``step`` is
        dispatched, however the run is cut into calls: the gain is the same in every run of the
        same steps (a flush that reads more steps early does not change it).
        """
        chosen = None
        for done, noise in self._recent:
            if done <= step - 1 - self._lag:
                chosen = noise
        return chosen

    def observe_noise(
        self, step: int, norms: tuple[float, float] | None, *, batch: int, micro: int
    ) -> None:
        """Folds step ``step``'s squared gradient norms ``(|g_B|^2, |g_b|^2)`` in (None: the
        step carries no estimate) and records the estimates after it."""
        self._samples += batch
        if norms is not None:
            self._noise = observe_noise(
                self._noise,
                grad_sq_norm=norms[0],
                sub_grad_sq_norm=norms[1],
                batch=batch,
                sub_batch=micro,
                horizon=self._horizon,
            )
        self._recent.append((step, self._noise))

    def observe_throughput(self, key: ThroughputKey, *, seconds: float) -> None:
        """Adds a step of ``seconds`` at ``key`` to the block being timed there, and a full
        block to its sums; the first step read at a key after steps at another (the first after
        a move, when pipelines and caches are cold) is left out, and the block timed at the key
        before is added as it stands. Steps that compiled or re-ran after an out-of-memory error
        are not given here."""
        first = key != self._last_key
        if first:
            self._close_block()
        self._last_key = key
        if first or not math.isfinite(seconds) or seconds <= 0.0:
            return
        steps, total = self._pending
        self._pending = (steps + 1, total + seconds)
        if steps + 1 >= self._block:
            self._close_block()

    def _timed(self, key: ThroughputKey) -> StepTimes | None:
        """The sums at ``key``, with the block being timed there as it stands."""
        times = self._times.get(key)
        steps, total = self._pending
        if key != self._last_key or not steps:
            return times
        return (times or StepTimes()).add(total, steps)

    def _close_block(self) -> None:
        """Adds the block being timed at ``last_key`` to its sums."""
        steps, total = self._pending
        if steps and self._last_key is not None:
            key = self._last_key
            self._times[key] = self._times.get(key, StepTimes()).add(total, steps)
        self._pending = (0, 0.0)

    def decide(
        self,
        current: int,
        allowed: Sequence[int],
        keys: Mapping[int, ThroughputKey],
        *,
        measurable: bool,
    ) -> tuple[goodput.BatchDecision, dict[str, Any]]:
        """The bucket of highest goodput among ``allowed`` that the figures' intervals support
        (:func:`._goodput.decide_batch`), and the figures for the event log
        (``{"noise_scale", "noise_interval", "decision", "goodput"}``; empty when nothing was
        weighed).

        Args:
          current: the bucket in force (among ``allowed``).
          allowed: the buckets memory allows, ascending.
          keys: for each bucket, the key its steps' times are kept under.
          measurable: whether a step at ``current`` measures the noise scale; without a noise
            scale an unmeasurable bucket gives way to the next larger allowed one.
        """
        if self._trial is not None and self._trial[1] != current:
            self._trial = None  # the trial's move was not taken (memory refused it)
        larger = [b for b in allowed if b > current]
        if self._noise.simple is None and not measurable and larger:
            return goodput.BatchDecision(
                larger[0],
                "move",
                f"a step of micro-batch {current} cannot measure the noise scale (it cannot be "
                f"halved on every device): to {larger[0]} to measure it",
                {},
            ), {}
        # A step that cannot measure waits for nothing: no evidence comes in at this bucket.
        if self._samples - self._decided_at < self._every:
            return goodput.BatchDecision(
                current,
                "stay",
                f"goodput decides every {self._every} samples: next at "
                f"{self._decided_at + self._every}, {self._samples} read",
                {},
            ), {}
        self._decided_at = self._samples
        times = self._agreed_times(keys)
        interval = self._noise.interval()
        decision = goodput.decide_batch(
            current,
            allowed,
            noise_scale=self._noise.simple,
            noise_interval=interval,
            times=times,
            reference=self._reference,
            margin=self._margin,
            critical_multiple=self._critical_multiple,
            trial_from=None if self._trial is None else self._trial[0],
        )
        # Each host's step times carry its own noise: process 0 decides for every host.
        kinds = ("stay", "move", "explore", "keep", "revert")
        bucket, kind_index = agreement.agree_on_choice([decision.batch, kinds.index(decision.kind)])
        decision = decision._replace(batch=bucket, kind=kinds[kind_index])
        if decision.kind == "explore":
            self._trial = (current, decision.batch)
        elif decision.kind in ("keep", "revert"):
            self._trial = None
        figures = {
            "noise_scale": self._noise.simple,
            "noise_interval": interval,
            "decision": decision.kind,
            "goodput": decision.figures,
        }
        return decision, figures

    def within_memory(
        self,
        memory: BucketDecision,
        current: int,
        buckets: Sequence[int],
        ceiling: int | None,
        key_of: Callable[[int], ThroughputKey],
        *,
        measurable: bool,
    ) -> tuple[BucketDecision, dict[str, Any]]:
        """Memory's decision with goodput's choice of bucket: the bucket of highest goodput
        among those memory allows (:meth:`decide`), up to the memory decision's bucket when it
        grows, else up to ``current``, and below an out-of-memory ``ceiling``.

        Args:
          memory: what :func:`triaccel_jax.controller.decide_bucket` chose (not a shrink for
            memory pressure: that one is taken as it is).
          current: the bucket in force.
          buckets: every bucket, ascending.
          ceiling: the smallest bucket that ran out of memory, or None.
          key_of: the key a bucket's step times are kept under.
          measurable: whether a step at ``current`` measures the noise scale.

        Returns:
          ``(decision, figures)``: a "keep", "grow" or "shrink" to goodput's bucket, and the
          figures it decided from, for the event log.
        """
        cap = memory.bucket if memory.kind == "grow" else current
        allowed = [b for b in buckets if b <= cap and (ceiling is None or b < ceiling)]
        if current not in allowed:
            allowed = sorted({*allowed, current})
        choice, figures = self.decide(
            current, allowed, {b: key_of(b) for b in allowed}, measurable=measurable
        )
        if choice.batch == current:
            return memory._replace(kind="keep", bucket=current), figures
        kind = "grow" if choice.batch > current else "shrink"
        return memory._replace(kind=kind, bucket=choice.batch, reason=choice.reason), figures

    def _agreed_times(self, keys: Mapping[int, ThroughputKey]) -> dict[int, StepTimes]:
        """The step times of each bucket, as every process agrees on them (the pace of the
        slowest: each process's sums are scaled to the agreed mean)."""
        if self._assumed is not None:
            fixed, per_sample = self._assumed
            return {
                b: StepTimes(
                    _ASSUMED_STEPS,
                    _ASSUMED_STEPS * (fixed + per_sample * b),
                    _ASSUMED_STEPS * (fixed + per_sample * b) ** 2,
                    _ASSUMED_STEPS,
                )
                for b in keys
            }
        buckets = sorted(keys)
        local = [self.rate(keys[b]) for b in buckets]
        agreed = agreement.agree_on_rates(local)
        times = {}
        for bucket, mine, common in zip(buckets, local, agreed, strict=True):
            if mine is None or common is None:
                continue
            own = self._timed(keys[bucket])
            assert own is not None  # it has a rate
            slower = mine / common  # >= 1 on the slowest process's pace
            times[bucket] = own.scaled(slower)
        return times

    def saved_state(self) -> GoodputTrackerState:
        """The tracker's saved state (:meth:`state_dict` encodes it); each process times its own
        steps, so every process saves process 0's step-time sums."""
        keys = list(self._times)
        width = len(StepTimes._fields)
        flat = agreement.agree_on_figures(
            [f for key in keys for f in self._times[key]] + list(self._pending)
        )
        step_times = tuple(
            (
                *key,
                int(flat[width * i]),
                flat[width * i + 1],
                flat[width * i + 2],
                int(flat[width * i + 3]),
            )
            for i, key in enumerate(keys)
        )
        return GoodputTrackerState(
            noise=self._noise,
            recent_noise=tuple((step, *noise) for step, noise in self._recent),
            step_times=step_times,
            last_key=self._last_key,
            trial=self._trial,
            clock=(self._samples, self._decided_at),
            block=(int(flat[-2]), flat[-1]),
        )

    def load_saved_state(self, saved: GoodputTrackerState) -> None:
        """Continues from :meth:`saved_state`'s output.

        Raises:
          ValueError: the recent noise estimates' steps do not increase, or the clock's last
            decision is past the samples read; nothing is changed then.
        """
        steps = [entry[0] for entry in saved.recent_noise]
        if any(later <= earlier for earlier, later in itertools.pairwise(steps)):
            raise ValueError(
                f"controller state: `goodput.recent_noise` steps must be increasing, got {steps}"
            )
        samples, decided_at = saved.clock
        if decided_at > samples:
            raise ValueError(
                "controller state: `goodput.clock` must be [samples read, samples at the last "
                f"decision], the second no larger, got {list(saved.clock)}"
            )
        self._noise = NoiseScaleEstimate(*saved.noise)
        self._times = {entry[:3]: StepTimes(*entry[3:]) for entry in saved.step_times}
        self._last_key, self._trial = saved.last_key, saved.trial
        self._samples, self._decided_at = samples, decided_at
        self._pending = saved.block
        self._recent = collections.deque(
            ((entry[0], NoiseScaleEstimate(*entry[1:])) for entry in saved.recent_noise),
            maxlen=self._lag + 1,
        )

    def state_dict(self) -> dict[str, Any]:
        """The noise averages, the recent ones ``[step, *averages]``, the step-time sums
        ``[micro, micro-batches, policy, steps, seconds, seconds_sq, blocks]``, the block being
        timed ``[steps, seconds]``, the last key timed and
        the trial ``[from, to]`` (or null) and the sample clock ``[samples read, samples at the
        last decision]``, JSON-ready."""
        return state_record.encode(self.saved_state())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from :meth:`state_dict`'s output.

        Raises:
          ValueError: the state is malformed (the field named); nothing is changed then.
        """
        self.load_saved_state(state_record.decode(GoodputTrackerState, state, "goodput"))


_Count = Annotated[int, state_record.AtLeast(0)]
_Size = Annotated[int, state_record.AtLeast(1)]
_Seconds = Annotated[float, state_record.AtLeast(0.0)]
# NoiseScaleEstimate's fields in order: seven weighted sums, then the samples.
NoiseRecord = tuple[float, float, float, float, float, float, float, _Count]
# [step, *NoiseScaleEstimate].
RecentNoiseRecord = tuple[int, float, float, float, float, float, float, float, _Count]
# [micro, micro-batches, policy signature, *StepTimes].
StepTimesRecord = tuple[_Size, _Size, str, _Count, _Seconds, _Seconds, _Count]


@dataclasses.dataclass(frozen=True)
class GoodputTrackerState:
    """What a :class:`GoodputTracker` saves, the ``"goodput"`` part of the controller's state.

    Attributes:
      noise: the noise averages (a :class:`NoiseScaleEstimate`'s fields in order).
      recent_noise: the recent ones, ``(step, *averages)``, the steps increasing.
      step_times: the step-time sums, ``(micro, micro-batches, policy, *StepTimes)``.
      last_key: the last ``(micro, micro-batches, policy)`` timed, or None.
      trial: the goodput trial ``(from, to)``, or None.
      clock: ``(samples read, samples at the last decision)``.
      block: the block being timed, ``(steps, seconds)``.
    """

    noise: NoiseRecord
    recent_noise: tuple[RecentNoiseRecord, ...]
    step_times: tuple[StepTimesRecord, ...]
    last_key: tuple[_Size, _Size, str] | None
    trial: tuple[_Size, _Size] | None
    clock: tuple[_Count, _Count]
    block: tuple[_Count, Annotated[float, state_record.AtLeast(0.0, finite=True)]]
