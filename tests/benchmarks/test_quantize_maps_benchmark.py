"""benchmarks/quantize_maps.py on a small leaf: each map's one-shot errors where a broken map
would move them, and the two searches for the dynamic maps' codes agree and are both timed."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
ERROR_ROW = re.compile(
    r"^(m \(signed\)|v \(non-negative\)) +(\S+) +(\S+) +([\d.]+) +(\S+) +([\d.]+)% +(\S+) +([\d.]+)$"
)
SEARCH_ROW = re.compile(r"^(dynamic|dynamic_unsigned) +([\d.]+) +([\d.]+) +([\d.]+)x$")


def test_small_run_reports_every_map_and_both_searches():
    command = [
        sys.executable,
        "benchmarks/quantize_maps.py",
        *("--rows", "64", "--columns", "256", "--rounds", "2"),
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    errors, searches = {}, {}
    for line in done.stdout.splitlines():
        if match := ERROR_ROW.match(line):
            moment, mapping, blocks, norm, _, zeroed, update, _ = match.groups()
            errors[moment[0], mapping, blocks] = (float(norm), float(zeroed), float(update))
        elif match := SEARCH_ROW.match(line):
            searches[match[1]] = (float(match[2]), float(match[3]))
    assert len(errors) == 8, done.stdout
    assert set(searches) == {"dynamic", "dynamic_unsigned"}, done.stdout
    assert all(a > 0 and b > 0 for a, b in searches.values())
    # On 2026-12-06 (64 x 256): the linear map zeroes 13% of the first moment's non-zeros and
    # 66% of the second's, the dynamic maps none; the dynamic first moment's update error is
    # 0.041 against the linear map's 0.41, and 8-bit norm errors stay near 0.014.
    assert errors["m", "linear", "256"][1] > 5.0
    assert (
        errors["m", "dynamic", "256"][1] == 0.0 and errors["v", "dynamic_unsigned", "256"][1] == 0.0
    )
    assert errors["m", "dynamic", "256"][2] < errors["m", "linear", "256"][2] / 4
    for key in (("m", "linear", "256"), ("m", "dynamic", "256"), ("v", "sqrt", "256")):
        assert errors[key][0] < 0.03, (key, errors[key])
