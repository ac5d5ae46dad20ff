"""benchmarks/state_precision.py --quick: every state row of the study trains, is tuned and is
reported with its targets, and XLA's bytes per parameter of each row stay where they belong."""

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
        # AdamW's rows: Muon's run the same code (the CI's time is kept short).
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
    states = ("fp32", "bf16", "int8", "int8_dynamic", "int4", "planned", "blind")
    expected = {("adamw", s) for s in states}
    assert set(rows) == expected
    table = (tmp_path / "state_precision.md").read_text()
    for state in states:
        assert f"| fashion_mlp | AdamW | {state} |" in table, state
    assert "Targets (issue 40):" in table
    assert "fashion_mlp AdamW plan vs blind" in table
    for (_, state), row in rows.items():
        assert row["n"] == 2 and 0 <= row["mean"] <= 100
        assert math.isfinite(row["step_ratio"]) and row["step_ratio"] > 0
        if state == "fp32":
            assert row["verdict"] == "reference"
        else:
            assert row["interval"] is not None
        if state in ("int8", "int4"):
            assert "met" in row["verdict"] or "MISSED" in row["verdict"]

    # Bytes per parameter, params + state, from XLA's compiled update (counted, not timed):
    # fp32 AdamW 12; bf16 moments 8 (+ the biases' fp32 state); 8-bit blocks 6.1-6.15 (codes and
    # a scale per block along the last axis, two copies); int4 two codes a byte and a scale per
    # block for both moments (no factored second moment): 5.16 on this MLP (2026-12-05), above
    # the 5.0 (missed). The plan at the cap 5.0: below uniform int4 here, so unmet and at
    # the fewest bytes it reaches, which the planner counts as XLA does (the registry prices
    # what is stored); the signal-blind assignment at the plan's bytes, within one leaf's step.
    bpp = {state: rows[("adamw", state)]["bytes_per_parameter"] for _, state in rows}
    assert bpp["fp32"] == pytest.approx(12.0, abs=0.01)
    assert 7.9 <= bpp["bf16"] <= 8.1
    assert 6.0 <= bpp["int8"] <= 6.2
    assert 6.0 <= bpp["int8_dynamic"] <= 6.2
    assert 5.1 <= bpp["int4"] <= 5.2
    planned = rows[("adamw", "planned")]
    cap = 5.0
    assert planned["bytes_per_parameter"] <= max(cap, bpp["int4"]) + 0.01
    assert planned["plan_bytes_per_parameter"] == pytest.approx(
        planned["bytes_per_parameter"], abs=0.01
    )
    blind = rows[("adamw", "blind")]
    assert blind["plan_bytes_per_parameter"] <= planned["plan_bytes_per_parameter"] + 1e-6
    # One leaf's step: at most the largest leaf's move from int8 to int4 (AdamW, 2 copies).
    assert abs(blind["bytes_per_parameter"] - planned["bytes_per_parameter"]) <= 1.6
    assert blind["bytes_per_parameter"] <= planned["bytes_per_parameter"] + 0.01
    assert bpp["int4"] < bpp["int8"] < bpp["bf16"] < bpp["fp32"]
