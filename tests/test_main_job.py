"""The main job end to end with tiny settings: the table, the plots, and its clear errors."""

from __future__ import annotations

import json
import re

import pytest

from triaccel_jax._src import main_job

TINY = ["--dataset", "digits", "--epochs", "2", "--max-steps", "6", "--batch-size", "32"]
TINY += ["--max-batch", "64", "--check-every", "2", "--replan-every", "3", "--no-progress"]


def test_main_job_writes_the_table_and_plots(tmp_path, capsys):
    assert main_job.main([*TINY, "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (FP32 AdamW|static bf16 AdamW|Tri-Accel) \|(.*)\|$", out, re.M)
    assert [name for name, _ in rows] == ["FP32 AdamW", "static bf16 AdamW", "Tri-Accel"]
    for _, cells in rows:
        seconds, steps, _, mib, _, _, accuracy = (c.strip() for c in cells.split("|"))
        assert float(seconds) > 0 and int(steps) == 6 and float(mib) > 0
        assert 0 <= float(accuracy.rstrip("%")) <= 100
    # bf16 compute copies and bf16 residuals: less memory than FP32 (memory_report, exact).
    ratios = {name: float(cells.split("|")[4].strip().rstrip("x")) for name, cells in rows}
    assert ratios["FP32 AdamW"] == 1.0 and ratios["static bf16 AdamW"] < 0.9
    for name in (
        "results.md",
        "results.json",
        "curves.png",
        "batch_memory.png",
        "precision_map.png",
    ):
        path = tmp_path / name
        assert path.exists() and path.stat().st_size > 0, name
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((tmp_path / "results.json").read_text())
    elastic = record["results"][2]
    assert elastic["name"] == "triaccel" and max(h["batch"] for h in elastic["history"]) == 64
    assert any(e["kind"] == "grow" for e in elastic["events"])
    # Every epoch's end is among the evaluations, so steps-to-accuracy can be read from them.
    assert [e["step"] for e in elastic["evals"]][-1] == 6
    assert elastic["evals"][-1]["accuracy"] == elastic["epoch_accuracy"][-1]


def test_unknown_names_list_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        main_job.main(["--model", "vgg"])
    err = capsys.readouterr().err
    assert "invalid choice: 'vgg'" in err and "resnet18" in err and "efficientnet_b0" in err
    with pytest.raises(SystemExit):
        main_job.main(["--dataset", "imagenet"])
    assert "cifar100" in capsys.readouterr().err


def test_a_missing_data_set_says_how_to_get_it(tmp_path, capsys):
    args = ["--dataset", "cifar10", "--data-dir", str(tmp_path / "tfds"), "--no-progress"]
    assert main_job.main([*args, "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "cifar-10-binary.tar.gz" in err and "downloads/manual" in err


def test_an_unwritable_output_dir_is_reported_before_training(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match=r"output dir .* is not writable"):
        main_job.main([*TINY, "--output-dir", str(blocker / "out")])
    assert "main job:" not in capsys.readouterr().out  # nothing was trained


@pytest.mark.parametrize(
    "bad", [["--epochs", "0"], ["--lr", "-1"], ["--budget-mib", "0"], ["--max-steps", "0"]]
)
def test_bad_numbers_are_rejected(bad):
    with pytest.raises(SystemExit):
        main_job.main(bad)
