"""benchmarks/compile_time.py --quick: every row compiles and prints its ratio to its baseline."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quick_run_prints_each_transform_against_its_optax_optimizer():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_time.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = {line.split("  ")[0].strip(): line for line in result.stdout.splitlines()}
    expected = {
        "triaccel": "adamw",
        "curvature_signals + adamw": "adamw",
        "scale_by_curvature(muon)": "muon",
    }
    for name, baseline in expected.items():
        match = re.search(rf"([\d.]+)x\s+{re.escape(baseline)} (met|MISSED)", lines[name])
        assert match and float(match.group(1)) > 0, lines[name]
    assert "target: each ratio <= 1.5x" in result.stdout
