"""The README's first command runs this demo; it must train and report both optimizers."""

from __future__ import annotations

import re

import pytest

from triaccel_jax._src import demo


def test_demo_trains_both_optimizers_and_prints_table(capsys):
    assert demo.main(["--epochs", "2", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^(adamw|triaccel)\s+([\d.]+)\s+[\d.]+\s+[\d.]+$", out, re.M))
    assert set(rows) == {"adamw", "triaccel"}
    assert all(float(loss) < 2.0 for loss in rows.values())  # ln(10) = 2.30 at chance
    assert "params/Dense_0/kernel" in out


def test_demo_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        demo.main(["--epochs", "0"])
