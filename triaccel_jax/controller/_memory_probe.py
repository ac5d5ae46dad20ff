"""Memory probes: what the controller knows about free accelerator memory (docs/design.md §5).

One small interface, :class:`MemoryProbe`: ``read(batch_size=...)`` returns a
:class:`MemoryReading` with the peak bytes used since the previous reading (None when the probe
cannot measure it) and the limit. Three probes ship:

* :class:`DeviceMemoryProbe`: ``device.memory_stats()`` (GPU/TPU). ``peak_bytes_in_use`` is a
  high-water mark since the process started, so the probe reports it only when it rose above
  every mark seen since the probe was made (or reset) and since the previous reading: only then
  is it the peak of the steps in between, and not that of an earlier run in the same process. ``bytes_limit`` is XLA's
  pool (see ``XLA_PYTHON_CLIENT_MEM_FRACTION``). Backends without statistics (CPU returns None)
  or that raise give a reading of Nones.
* :class:`BudgetMemoryProbe`: a byte budget and no measurement, for CPU, where the controller
  relies on the compiled step's own memory analysis (:func:`triaccel_jax.precision.compiled_peak_bytes`).
* :class:`FakeMemoryProbe`: a scripted device for tests and notebooks.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple
from typing import Protocol

import jax
import numpy as np

from triaccel_jax._src import validation


class MemoryReading(NamedTuple):
    """One reading of a memory probe.

    Attributes:
      peak_bytes: the most bytes in use since the previous reading, or None if unknown.
      limit_bytes: the bytes the process may use, or None if unknown.
      source: which probe read it, for the event log.
    """

    peak_bytes: int | None
    limit_bytes: int | None
    source: str


class MemoryProbe(Protocol):
    """Anything with ``read(*, batch_size) -> MemoryReading`` (the batch size that last ran)."""

    def read(self, *, batch_size: int) -> MemoryReading: ...


class DeviceMemoryProbe:
    """Reads ``memory_stats()`` of the local devices (the largest peak, the smallest limit).

    ``peak_bytes_in_use`` never goes down while the process lives, and JAX has no way to reset
    it. So that each run's figures are its own (a process that trains several runs would
    otherwise start each from the first run's peak), the probe takes the mark at creation, and at
    :meth:`reset`, as a baseline: a reading reports a peak only when the mark rose above the
    baseline and the previous reading. A run that peaks lower than an earlier one reads None
    (unknown), and the controller then uses the compiled step's memory analysis.

    Args:
      devices: devices to read; default ``jax.local_devices()``.

    Example:
      >>> from triaccel_jax import DeviceMemoryProbe
      >>> reading = DeviceMemoryProbe().read(batch_size=32)  # on CPU: no statistics
      >>> reading.source
      'device'
    """

    def __init__(self, devices: Sequence[Any] | None = None) -> None:
        if devices is not None and (isinstance(devices, str) or not isinstance(devices, Iterable)):
            raise TypeError(
                f"`devices` must be a sequence of jax devices or None, got {type(devices).__name__}"
            )
        self._devices = list(devices) if devices is not None else jax.local_devices()
        if not self._devices or not all(hasattr(d, "memory_stats") for d in self._devices):
            raise TypeError(
                f"`devices` must be a non-empty sequence of jax devices, got {devices!r}"
            )
        self._last_peak: int | None = None
        self.reset()

    def reset(self) -> None:
        """Starts a new run: marks reached so far are not peaks of what runs from now on."""
        self._last_peak = self._stats()[0]

    def _stats(self) -> tuple[int | None, int | None]:
        """The largest ``peak_bytes_in_use`` and the smallest ``bytes_limit``, or Nones."""
        peaks, limits = [], []
        for device in self._devices:
            try:
                stats = device.memory_stats()
            except Exception:
                stats = None
            if not stats:
                continue
            if "peak_bytes_in_use" in stats:
                peaks.append(int(stats["peak_bytes_in_use"]))
            if "bytes_limit" in stats:
                limits.append(int(stats["bytes_limit"]))
        return (max(peaks) if peaks else None), (min(limits) if limits else None)

    def read(self, *, batch_size: int) -> MemoryReading:
        del batch_size  # the device measures what really ran
        peak, limit = self._stats()
        fresh = (
            peak
            if peak is not None and (self._last_peak is None or peak > self._last_peak)
            else None
        )
        if peak is not None:
            self._last_peak = peak
        return MemoryReading(fresh, limit, "device")

    def available(self) -> bool:
        """Whether any device reports a memory limit (without taking a reading)."""
        return self._stats()[1] is not None


class BudgetMemoryProbe:
    """A memory budget and no measurement: the controller uses compiled memory analyses.

    Args:
      budget_bytes: the budget in bytes, or a callable returning it (a budget that changes during
        a run, e.g. a simulated one in a notebook). None: ``fraction`` of the RAM available now
        (psutil).
      fraction: share of available RAM used when ``budget_bytes`` is None, in (0, 1].

    Example:
      >>> from triaccel_jax import BudgetMemoryProbe
      >>> BudgetMemoryProbe(256 * 2**20).read(batch_size=64).limit_bytes
      268435456
    """

    def __init__(
        self, budget_bytes: int | Callable[[], int] | None = None, *, fraction: float = 0.5
    ) -> None:
        validation.check_in_range("fraction", fraction, 0, 1, low_inclusive=False)
        if budget_bytes is None:
            try:
                import psutil
            except ImportError:  # pragma: no cover - psutil is a dependency
                raise ImportError(
                    "BudgetMemoryProbe needs psutil to read the available RAM; install psutil "
                    "or pass budget_bytes"
                ) from None
            budget_bytes = int(fraction * psutil.virtual_memory().available)
        if not callable(budget_bytes):
            _check_bytes("budget_bytes", budget_bytes)
        self._budget = budget_bytes

    def read(self, *, batch_size: int) -> MemoryReading:
        del batch_size
        budget = self._budget() if callable(self._budget) else self._budget
        return MemoryReading(None, _check_bytes("budget_bytes", budget), "budget")


class FakeMemoryProbe:
    """A scripted device: peak bytes as a function of the batch size, with optional noise.

    Args:
      limit_bytes: the device's limit, or a callable of the reading number (0, 1, ...) that
        returns it, to simulate memory taken and given back by someone else.
      peak_bytes: ``batch_size -> bytes`` the step peaks at; None for a probe that measures
        nothing (like :class:`BudgetMemoryProbe`).
      noise: relative noise of each reading, uniform in ``[-noise, noise]``.
      seed: seed of the noise.

    Example:
      >>> from triaccel_jax import FakeMemoryProbe
      >>> probe = FakeMemoryProbe(1000, peak_bytes=lambda batch: 10 * batch)
      >>> probe.read(batch_size=32)
      MemoryReading(peak_bytes=320, limit_bytes=1000, source='fake')
    """

    def __init__(
        self,
        limit_bytes: int | Callable[[int], int],
        *,
        peak_bytes: Callable[[int], float] | None = None,
        noise: float = 0.0,
        seed: int = 0,
    ) -> None:
        if not callable(limit_bytes):
            _check_bytes("limit_bytes", limit_bytes)
        validation.check_in_range("noise", noise, 0, 1, high_inclusive=False)
        self._limit = limit_bytes
        self._peak = peak_bytes
        self._noise = noise
        self._rng = np.random.default_rng(seed)
        self.readings = 0

    def read(self, *, batch_size: int) -> MemoryReading:
        limit = self._limit(self.readings) if callable(self._limit) else self._limit
        self.readings += 1
        peak = None
        if self._peak is not None:
            jitter = 1.0 + self._rng.uniform(-self._noise, self._noise) if self._noise else 1.0
            peak = int(self._peak(batch_size) * jitter)
        return MemoryReading(peak, _check_bytes("limit_bytes", limit), "fake")


def default_memory_probe() -> MemoryProbe:
    """:class:`DeviceMemoryProbe` where devices report a limit, else :class:`BudgetMemoryProbe`.

    Example:
      >>> from triaccel_jax.controller import default_memory_probe
      >>> type(default_memory_probe()).__name__  # on CPU, half the available RAM
      'BudgetMemoryProbe'
    """
    probe = DeviceMemoryProbe()
    return probe if probe.available() else BudgetMemoryProbe()


def prepare_probe(probe: MemoryProbe | None) -> MemoryProbe:
    """``probe`` ready for a new run: :func:`default_memory_probe` for None, reset if it can be.

    Raises:
      TypeError: ``probe`` has no ``read(*, batch_size)`` method.
    """
    probe = default_memory_probe() if probe is None else probe
    if not callable(getattr(probe, "read", None)):
        raise TypeError("`probe` must have a read(*, batch_size) method (a MemoryProbe)")
    reset = getattr(probe, "reset", None)  # optional: not part of the MemoryProbe protocol
    if callable(reset):
        reset()  # a probe used before: its earlier peaks are not this run's
    return probe


def _check_bytes(name: str, value: Any) -> int:
    return validation.check_integer(
        name, value, 1, strict=True, description="a positive integer number of bytes"
    )
