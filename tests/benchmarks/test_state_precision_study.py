"""benchmarks/state_precision.py --quick: every state row of the study trains, is tuned and is reported."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from triaccel_jax.data import fashion_mnist_not_found_message
from triaccel_jax.data import find_fashion_mnist

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(
    find_fashion_mnist() is None,
    reason=fashion_mnist_not_found_message().splitlines()[0]
    + " (TRIACCEL_INSTALL_SYSTEM_DATA=1 bash tools/test.sh installs Debian's package as root)",
)
def test_quick_run_reports_every_optimizer_and_state_row(tmp_path):
    command = [
        sys.executable,
        "benchmarks/state_precision.py",
        "--quick",
        "--workloads",
        "fashion_mlp",
        # AdamW's four rows: Muon's run the same code (the CI's time is kept short).
        "--optimizers",
        "adamw",
        "--out",
        str(tmp_path),
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    raw = json.loads((tmp_path / "state_precision.json").read_text())
    rows = {(r["optimizer"], r["state"]): r for r in raw["summary"]}
    expected = {("adamw", s) for s in ("fp32", "bf16", "int8", "planned")}
    assert set(rows) == expected
    table = (tmp_path / "state_precision.md").read_text()
    for optimizer, state in expected:
        label = {"adamw": "AdamW", "muon": "Muon"}[optimizer]
        assert f"| fashion_mlp | {label} | {state} |" in table, (optimizer, state)
    for (_, state), row in rows.items():
        assert row["n"] == 2 and 0 <= row["mean"] <= 100
        assert math.isfinite(row["step_ratio"]) and row["step_ratio"] > 0
        if state == "fp32":
            assert row["verdict"] == "reference"
        else:
            assert row["interval"] is not None and "bytes" in row["verdict"]
    # The state really is narrower: fp32 AdamW's 12 bytes per parameter, 8-bit blocks far fewer
    # (bytes counted, not timed: 8.056 for bf16 and 6.115 for int8 and the plan on 2026-12-06;
    # the README's headline is AdamW 12 -> 6.12).
    assert rows[("adamw", "fp32")]["bytes_per_parameter"] == pytest.approx(12.0, abs=0.01)
    assert rows[("adamw", "bf16")]["bytes_per_parameter"] <= 8.1
    assert rows[("adamw", "int8")]["bytes_per_parameter"] <= 6.2
    assert rows[("adamw", "planned")]["bytes_per_parameter"] <= 6.2
    assert (
        rows[("adamw", "int8")]["bytes_per_parameter"]
        < rows[("adamw", "bf16")]["bytes_per_parameter"]
        < 12.0
    )
