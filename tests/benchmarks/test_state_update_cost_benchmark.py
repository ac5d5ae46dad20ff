"""benchmarks/state_update_cost.py --quick: every row is measured and judged against its target,
and the figures that hold on a loaded machine stay within bounds.

* **peak** (XLA's predicted bytes of the compiled update, the same on every run of one jax
  version): int8 state 0.729x fp32 AdamW's and bf16 0.818x on 2026-12-06, bounded at 0.80x and
  0.90x; int8_dynamic 0.731x and int4 0.675x, bounded at 0.80x;
* **compile update** (seconds, one compile each, of a 0.2 s baseline): 1.2-3.4x on 2026-12-06,
  bounded at 15x, room for a row compiled while other jobs take two thirds of the machine (47x
  before issue 39's work on the 8-bit state).

The update and CNN step times (a fraction of a millisecond to a few milliseconds, two rounds of
one step) move by more than any useful bound on a shared machine, and are not bounded.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
VARIANTS = (
    "int8/nearest",
    "int8/stochastic",
    "bf16/nearest",
    "bf16/stochastic",
    "int8_dynamic/nearest",
    "int4/nearest",
)
TARGETS = {"update": 1.3, "peak": 1.0, "compile": 1.5, "cnn step": 1.05}
# (row kind, state format): the most the ratio may be.
BOUNDS = {
    ("peak", "int8"): 0.80,
    ("peak", "bf16"): 0.90,
    ("peak", "int8_dynamic"): 0.80,
    ("peak", "int4"): 0.80,
    ("compile update", "int8"): 15.0,
    ("compile update", "bf16"): 15.0,
    ("compile update", "int8_dynamic"): 15.0,
    ("compile update", "int4"): 15.0,
}
ROW = re.compile(
    r"^(update|peak|compile update|compile train step|cnn step) (\S+) +(\d+\.\d{3})x  "
    r"target <= (\d\.\d\d)x  (met|MISSED)  (\S.*)$"
)


@pytest.mark.slow
def test_quick_run_prints_every_row_with_its_ratio_target_and_verdict():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "benchmarks/state_update_cost.py", "--quick"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert re.match(r"jax [\d.]+, optax [\d.]+, cpu, .*, \d+ cores; Sizes\(", lines[0]), lines[0]
    rows = {}
    for line in lines[1:]:
        match = ROW.match(line)
        assert match, line
        kind, name, ratio, target, verdict, _ = match.groups()
        expected_target = TARGETS["compile" if kind.startswith("compile") else kind]
        assert float(ratio) > 0 and float(target) == expected_target, line
        assert verdict == ("met" if float(ratio) <= float(target) else "MISSED"), line
        rows[kind, name] = float(ratio)
    kinds = ("update", "peak", "compile update", "compile train step")
    expected = {(kind, v) for kind in kinds for v in VARIANTS}
    expected |= {("cnn step", v) for v in VARIANTS[:2]}
    assert set(rows) == expected
    # The peak is XLA's arithmetic, not a timing: the stored state's update stays below AdamW's.
    assert all(rows["peak", v] <= 1.0 for v in VARIANTS), rows
    over = [
        f"{kind} {variant} {rows[kind, variant]:.3f}x > {bound}x"
        for (kind, fmt), bound in BOUNDS.items()
        for variant in VARIANTS
        if variant.split("/")[0] == fmt and rows[kind, variant] > bound
    ]
    assert not over, "over their bounds: " + "; ".join(over) + "\n" + done.stdout
