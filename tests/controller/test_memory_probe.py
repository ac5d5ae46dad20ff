"""Memory probes: device statistics (missing, raising, monotone), budgets, the fake, compiled peaks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from triaccel_jax import BudgetMemoryProbe
from triaccel_jax import DeviceMemoryProbe
from triaccel_jax import FakeMemoryProbe
from triaccel_jax.controller import MemoryReading
from triaccel_jax.controller import default_memory_probe
from triaccel_jax.precision import compiled_peak_bytes


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats


def test_device_probe_reports_a_peak_only_when_it_rose():
    device = _Device({"peak_bytes_in_use": 10, "bytes_limit": 1000})
    probe = DeviceMemoryProbe([device])
    device.stats = {"peak_bytes_in_use": 100, "bytes_limit": 1000}
    assert probe.read(batch_size=8) == MemoryReading(100, 1000, "device")
    # peak_bytes_in_use is a high-water mark since start: unchanged means "not known".
    assert probe.read(batch_size=8) == MemoryReading(None, 1000, "device")
    device.stats = {"peak_bytes_in_use": 250, "bytes_limit": 1000}
    assert probe.read(batch_size=8).peak_bytes == 250


def test_device_probe_takes_the_largest_peak_and_smallest_limit():
    devices = [_Device({"bytes_limit": 1000}), _Device({"bytes_limit": 800})]
    probe = DeviceMemoryProbe(devices)
    devices[0].stats = {"peak_bytes_in_use": 100, "bytes_limit": 1000}
    devices[1].stats = {"peak_bytes_in_use": 300, "bytes_limit": 800}
    assert probe.read(batch_size=1) == MemoryReading(300, 800, "device")


@pytest.mark.parametrize("stats", [None, {}, RuntimeError("UNIMPLEMENTED"), ValueError("no")])
def test_device_probe_without_statistics_reads_none(stats):
    probe = DeviceMemoryProbe([_Device(stats)])
    assert probe.read(batch_size=1) == MemoryReading(None, None, "device")
    assert not probe.available()


def test_default_probe_on_cpu_is_a_budget_of_available_ram():
    probe = default_memory_probe()
    assert isinstance(probe, BudgetMemoryProbe)  # CPU has no memory_stats
    assert probe.read(batch_size=1).limit_bytes > 0


def test_budget_probe_follows_a_callable_budget():
    budget = [100]
    probe = BudgetMemoryProbe(lambda: budget[0])
    assert probe.read(batch_size=4) == MemoryReading(None, 100, "budget")
    budget[0] = 50
    assert probe.read(batch_size=4).limit_bytes == 50
    budget[0] = 0
    with pytest.raises(ValueError, match="budget_bytes"):
        probe.read(batch_size=4)


@pytest.mark.parametrize("bad", [0, -5, 1.5, "1GB"])
def test_budget_probe_rejects_bad_budgets(bad):
    with pytest.raises(ValueError, match="budget_bytes"):
        BudgetMemoryProbe(bad)
    with pytest.raises(ValueError, match="limit_bytes"):
        FakeMemoryProbe(bad)


def test_fake_probe_noise_is_bounded_and_seeded():
    probe = FakeMemoryProbe(10_000, peak_bytes=lambda b: 100.0 * b, noise=0.05, seed=1)
    peaks = [probe.read(batch_size=10).peak_bytes for _ in range(200)]
    assert min(peaks) >= 950 and max(peaks) <= 1050 and len(set(peaks)) > 20
    again = FakeMemoryProbe(10_000, peak_bytes=lambda b: 100.0 * b, noise=0.05, seed=1)
    assert [again.read(batch_size=10).peak_bytes for _ in range(200)] == peaks
    shrinking = FakeMemoryProbe(lambda n: 1000 - 100 * n)
    assert [shrinking.read(batch_size=1).limit_bytes for _ in range(3)] == [1000, 900, 800]


def test_compiled_peak_counts_arguments_outputs_and_temps():
    x = jnp.ones((256, 256))
    compiled = jax.jit(lambda a: (a @ a) @ a).lower(x).compile()
    peak = compiled_peak_bytes(compiled)
    assert peak >= 2 * x.nbytes  # the argument and the output at least
    donated = jax.jit(lambda a: a + 1, donate_argnums=0).lower(x).compile()
    assert compiled_peak_bytes(donated) <= compiled_peak_bytes(
        jax.jit(lambda a: a + 1).lower(x).compile()
    )


def test_compiled_peak_without_analysis_is_none():
    class NoAnalysis:
        def memory_analysis(self):
            raise NotImplementedError

    assert compiled_peak_bytes(NoAnalysis()) is None


def test_a_new_probe_does_not_report_an_earlier_runs_peak():
    # peak_bytes_in_use is a high-water mark since the process started: a first run peaked at
    # 900 bytes; a second run in the same process, with its own probe, peaks at 400. That run's
    # figures must be its own: 900 is not a peak of it, so it is reported as unknown.
    device = _Device({"peak_bytes_in_use": 900, "bytes_in_use": 50, "bytes_limit": 1000})
    probe = DeviceMemoryProbe([device])
    device.stats = {"peak_bytes_in_use": 900, "bytes_in_use": 400, "bytes_limit": 1000}
    assert probe.read(batch_size=8) == MemoryReading(None, 1000, "device")
    # Once the mark rises past the earlier run's, the rise is this run's peak.
    device.stats = {"peak_bytes_in_use": 950, "bytes_in_use": 60, "bytes_limit": 1000}
    assert probe.read(batch_size=8).peak_bytes == 950
    # reset() starts a new run on the same probe: the earlier marks are not its peaks.
    probe.reset()
    assert probe.read(batch_size=8).peak_bytes is None
    device.stats = {"peak_bytes_in_use": 990, "bytes_limit": 1000}
    assert probe.read(batch_size=8).peak_bytes == 990
