"""benchmarks/noise_estimators.py: its summary on a made-up series, and --quick end to end."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from triaccel_jax.data import fashion_mnist_not_found_message
from triaccel_jax.data import find_fashion_mnist

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import noise_estimators  # noqa: E402


def test_the_summary_reads_the_estimates_their_steadiness_and_interval_width():
    # A raw estimate doubling every ten steps (ratio 2 throughout) and a flat one.
    steps = 60
    raw = [2.0 ** (i / 10) for i in range(steps)]
    run = {
        "series": {
            "raw": {"simple": raw, "low": [v / 2 for v in raw], "high": [v * 1.5 for v in raw]},
            "preconditioned": {
                "simple": [5.0] * steps,
                "low": [4.0] * steps,
                "high": [6.0] * steps,
            },
        }
    }
    summary = noise_estimators.summarize(run, skip=10)
    assert summary["raw"]["final"] == pytest.approx(raw[-1])
    assert summary["raw"]["at_50%"] == pytest.approx(raw[30])
    assert summary["raw"]["steady_5%"] == pytest.approx(2.0)
    assert summary["raw"]["steady_95%"] == pytest.approx(2.0)
    assert summary["raw"]["interval_width"] == pytest.approx(1.0)
    assert summary["preconditioned"]["steady_5%"] == summary["preconditioned"]["steady_95%"] == 1.0
    assert summary["preconditioned"]["interval_width"] == pytest.approx(0.4)


@pytest.mark.slow
@pytest.mark.skipif(
    find_fashion_mnist() is None, reason=fashion_mnist_not_found_message().splitlines()[0]
)
def test_quick_mode_prints_both_estimators():
    command = [sys.executable, "benchmarks/noise_estimators.py", "--quick"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[2:]] == ["| raw", "| preconditioned"]
    # The figures, within bounds a wrong norm or a misplaced batch factor would cross: at batch 32
    # both final estimates are 16-22 (2026-12-06); the preconditioned one is steady within 1%
    # over ten steps, and each 95% interval is finite and a few estimates wide.
    figures = {}
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("| ").split(" | ")]
        steady = [float(v) for v in cells[4].split("-")]
        figures[cells[0]] = {"final": float(cells[3]), "steady": steady, "width": float(cells[5])}
    raw, preconditioned = figures["raw"], figures["preconditioned"]
    for name, f in figures.items():
        assert 4.0 <= f["final"] <= 100.0, (name, f)
        assert 0.0 < f["width"] <= 10.0, (name, f)
        assert 0.0 < f["steady"][0] <= 1.0 <= f["steady"][1], (name, f)
    assert 0.25 <= raw["final"] / preconditioned["final"] <= 4.0, figures
    assert preconditioned["steady"][1] / preconditioned["steady"][0] <= 1.1, figures
