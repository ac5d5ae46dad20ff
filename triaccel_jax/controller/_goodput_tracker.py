"""``GoodputTracker``: the figures goodput decides from, and the streak its moves wait for.

It holds what the controller measures for goodput (docs/design.md §5), private and changed only by
its own methods: the smoothed gradient noise scale and its recent history (AdaScale's gain reads
it), samples per second per (micro-batch, micro-batches, policy), and the hysteresis streak of a
goodput move. Each step read is folded in (:meth:`GoodputTracker.observe_noise`,
:meth:`GoodputTracker.observe_throughput`); at a memory check :meth:`GoodputTracker.decide` asks
the pure :func:`._goodput.choose_by_goodput`. How the noise is smoothed and how a bucket's
throughput is estimated live here alone, so a change to either stays in this module.

The noise estimates and the streak are saved (:meth:`GoodputTracker.state_dict`, the ``"goodput"``
part of the controller's state); throughput is a measurement of this process on this machine and
is measured again after a restart.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

from triaccel_jax.controller import _agreement as agreement
from triaccel_jax.controller import _goodput as goodput
from triaccel_jax.controller import _state_record as records

# (micro-batch, micro-batches per step, policy signature): where a throughput was measured.
ThroughputKey = tuple[int, int, str]


class GoodputMove(NamedTuple):
    """What :meth:`GoodputTracker.decide` decided.

    Attributes:
      bucket: the bucket to train at (the current one to stay, or while a move waits for its
        streak).
      reason: why, in words, for the event log.
      figures: ``{"noise_scale", "goodput"}`` for the event log.
    """

    bucket: int
    reason: str
    figures: dict[str, Any]


class GoodputTracker:
    """The noise scale, throughput and streak behind ``batch_rule="goodput"``.

    Args:
      decay: the moving averages' decay (``ControllerConfig.statistics_decay``).
      lag: steps in flight (``ControllerConfig.steps_in_flight``): AdaScale's gain of a step
        comes from the estimates of the step ``lag + 1`` before it (:meth:`noise_before`).
      reference: the batch the learning rate was tuned at (Pollux's ``B0``).
      margin, min_efficiency, model: as for :func:`._goodput.choose_by_goodput`.
      patience: checks in a row a move must be chosen at before it is taken.

    Example:
      >>> from triaccel_jax.controller._goodput_tracker import GoodputTracker
      >>> tracker = GoodputTracker(
      ...     decay=0.0,
      ...     lag=1,
      ...     reference=8,
      ...     margin=0.05,
      ...     min_efficiency=0.5,
      ...     model="linear",
      ...     patience=1,
      ... )
      >>> # |G|^2 = 1, tr(Sigma) = 64: |g_8|^2 = 1 + 64/8 = 9, |g_32|^2 = 1 + 64/32 = 3.
      >>> tracker.observe_noise(0, (3.0, 9.0), batch=32, micro=8)
      >>> tracker.observe_throughput((32, 1, "none"), samples=32, seconds=0.1)
      >>> round(tracker.noise_scale, 6)
      64.0
      >>> move = tracker.decide(
      ...     32,
      ...     [32, 64],
      ...     {32: (32, 1, "none"), 64: (64, 1, "none")},
      ...     memory_grows=False,
      ...     measurable=True,
      ... )
      >>> move.bucket
      64
      >>> tracker.noise_before(1) is None, tracker.noise_before(2).weight
      (True, 1.0)
    """

    def __init__(
        self,
        *,
        decay: float,
        lag: int,
        reference: int,
        margin: float,
        min_efficiency: float,
        model: str,
        patience: int,
    ) -> None:
        self._decay, self._lag, self._reference = decay, lag, reference
        self._margin, self._min_efficiency, self._model = margin, min_efficiency, model
        self._patience = patience
        self._noise = goodput.NoiseScale()
        # The estimates after each of the last steps read, AdaScale's gain reads them.
        self._recent: collections.deque[tuple[int, goodput.NoiseScale]] = collections.deque(
            maxlen=lag + 1
        )
        self._throughput: dict[ThroughputKey, float] = {}
        # The bucket goodput last chose to move to, and at how many checks in a row.
        self._streak: tuple[int | None, int] = (None, 0)

    @property
    def noise_scale(self) -> float | None:
        """The smoothed simple noise scale ``B_simple``, or None before the first estimate."""
        return self._noise.simple

    @property
    def throughput(self) -> dict[ThroughputKey, float]:
        """Samples per second measured at each key, smoothed (a copy)."""
        return dict(self._throughput)

    def rate(self, key: ThroughputKey) -> float | None:
        """The smoothed samples per second measured at ``key``, or None."""
        return self._throughput.get(key)

    def noise_before(self, step: int) -> goodput.NoiseScale | None:
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
        if norms is not None:
            self._noise = goodput.update_noise_scale(
                self._noise,
                grad_sq_norm=norms[0],
                micro_grad_sq_norm=norms[1],
                batch=batch,
                micro=micro,
                decay=self._decay,
            )
        self._recent.append((step, self._noise))

    def observe_throughput(self, key: ThroughputKey, *, samples: int, seconds: float) -> None:
        """Folds a step of ``samples`` in ``seconds`` at ``key`` into the moving average."""
        rate = samples / seconds
        old = self._throughput.get(key)
        self._throughput[key] = (
            rate if old is None else self._decay * old + (1 - self._decay) * rate
        )

    def decide(
        self,
        current: int,
        allowed: Sequence[int],
        keys: Mapping[int, ThroughputKey],
        *,
        memory_grows: bool,
        measurable: bool,
    ) -> GoodputMove:
        """The bucket of highest goodput among ``allowed`` (:func:`._goodput.choose_by_goodput`),
        taken once chosen at ``patience`` checks in a row.

        Args:
          current: the bucket in force (among ``allowed``).
          allowed: the buckets memory allows, ascending.
          keys: for each bucket, the key its steps' throughput is measured under.
          memory_grows: whether memory's own decision grows to the largest allowed bucket: a
            grow there already waited for memory's streak.
          measurable: whether a step at ``current`` measures the noise scale.
        """
        buckets = sorted(keys)
        # Every host decides alike: the step goes at the pace of the slowest.
        agreed = agreement.agree_on_rates([self._throughput.get(keys[b]) for b in buckets])
        rates = {b: rate for b, rate in zip(buckets, agreed, strict=True) if rate is not None}
        choice = goodput.choose_by_goodput(
            current,
            allowed,
            noise_scale=self._noise.simple,
            throughput=rates,
            reference=self._reference,
            margin=self._margin,
            min_efficiency=self._min_efficiency,
            model=self._model,
            measurable=measurable,
        )
        figures = {"noise_scale": self._noise.simple, "goodput": choice.figures}
        # Hysteresis, as for memory's moves: a move must be chosen at `patience` checks in a row
        # (measured throughput wobbles, and every move may cost a compile).
        moving = choice.bucket != current and not (choice.bucket > current and memory_grows)
        wanted, streak = self._streak
        streak = streak + 1 if moving and wanted == choice.bucket else int(moving)
        self._streak = (choice.bucket, streak) if moving else (None, 0)
        if moving and streak < self._patience:
            return GoodputMove(current, choice.reason, figures)
        self._streak = (None, 0)
        return GoodputMove(choice.bucket, choice.reason, figures)

    def state_dict(self) -> dict[str, Any]:
        """The noise estimates ``[|G|^2, tr(Sigma), weight]``, the recent ones ``[step, |G|^2,
        tr(Sigma), weight]`` and the streak ``[bucket or null, count]``, JSON-ready."""
        return {
            "noise_scale": list(self._noise),
            "recent_noise": [[step, *noise] for step, noise in self._recent],
            "streak": list(self._streak),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from :meth:`state_dict`'s output (throughput is measured afresh).

        Raises:
          ValueError: the state is malformed (the field named); nothing is changed then.
        """
        fields = records.fields(state, "goodput", self.state_dict())
        noise = goodput.NoiseScale(*_three_floats(fields["noise_scale"], "noise_scale"))
        recent = _recent_noise(fields["recent_noise"])
        streak = fields["streak"]
        if not isinstance(streak, list | tuple) or len(streak) != 2:
            raise ValueError(f"controller state: `streak` must be [bucket, count], got {streak!r}")
        wanted = None if streak[0] is None else records.integer(streak[0], "streak bucket", 1)
        count = records.integer(streak[1], "streak count", 0)
        self._noise, self._streak = noise, (wanted, count)
        self._recent = collections.deque(
            ((step, goodput.NoiseScale(*figures)) for step, *figures in recent),
            maxlen=self._lag + 1,
        )


def _three_floats(value: Any, name: str) -> tuple[float, float, float]:
    if not isinstance(value, list | tuple) or len(value) != 3:
        raise ValueError(f"controller state: `{name}` must hold 3 numbers, got {value!r}")
    first, second, third = (records.number(v, name) for v in value)
    return first, second, third


def _recent_noise(value: Any) -> list[tuple[int, float, float, float]]:
    """Saved recent noise estimates: ``[step, |G|^2, tr(Sigma), weight]`` entries, the steps
    increasing."""
    if not isinstance(value, list | tuple):
        raise ValueError(f"controller state: `recent_noise` must be a list, got {value!r}")
    entries: list[tuple[int, float, float, float]] = []
    for entry in value:
        if not isinstance(entry, list | tuple) or len(entry) != 4 or isinstance(entry[0], bool):
            raise ValueError(
                "controller state: each `recent_noise` entry must be [step, |G|^2, tr(Sigma), "
                f"weight], got {entry!r}"
            )
        step = records.integer(entry[0], "recent_noise step")
        if entries and step <= entries[-1][0]:
            raise ValueError(
                f"controller state: `recent_noise` steps must be increasing integers, got {value!r}"
            )
        grad_sq, trace, weight = _three_floats(entry[1:], "recent_noise")
        entries.append((step, grad_sq, trace, weight))
    return entries
