"""The main job end to end with tiny settings: the table, the plots, and its clear errors."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

from triaccel_jax.cli import _main_job as main_job

TINY = ["--dataset", "digits", "--epochs", "2", "--max-steps", "6", "--batch-size", "32"]
TINY += ["--max-batch", "64", "--check-every", "2", "--replan-every", "3", "--no-progress"]
# The grow compiles synchronously here so that it happens within the six steps.
TINY += ["--no-compile-in-background"]


@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory):
    """The main job with tiny settings, run once: (printed output, output folder)."""
    output = tmp_path_factory.mktemp("main_job")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cache = ["--compilation-cache", str(output / "jax_cache")]  # not the user's cache
        assert main_job.main([*TINY, *cache, "--output-dir", str(output)]) == 0
    return printed.getvalue(), output


def _table(out):
    """The printed table's rows as ``{run label: {column: cell}}``."""
    header = re.search(r"^\| run \|(.*)\|$", out, re.M)
    assert header, out
    columns = ["run", *(c.strip() for c in header.group(1).split("|"))]
    rows = re.findall(r"^\| (FP32 AdamW|static bf16 AdamW|Tri-Accel) \|(.*)\|$", out, re.M)
    return {
        name: dict(zip(columns, [name, *(c.strip() for c in cells.split("|"))], strict=True))
        for name, cells in rows
    }


def test_main_job_writes_the_table_and_plots(tiny_job):
    out, tmp_path = tiny_job
    table = _table(out)
    assert list(table) == ["FP32 AdamW", "static bf16 AdamW", "Tri-Accel"]
    for row in table.values():
        assert float(row["wall s"]) > 0 and int(row["steps"]) == 6
        assert float(row["step s"]) > 0 and float(row["samples/s"]) > 0
        assert float(row["wall s"]) >= float(row["compile s"])
        assert float(row["memory_report MiB at common batch"]) > 0
        assert 0 <= float(row["test accuracy"].rstrip("%")) <= 100
    # bf16 compute copies and bf16 residuals: less memory than FP32 (memory_report, exact).
    ratios = {
        name: float(row["vs FP32 at common batch"].rstrip("x")) for name, row in table.items()
    }
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


def test_every_run_reports_memory_at_the_batch_it_trained_at_and_at_a_common_batch(tiny_job):
    out, tmp_path = tiny_job
    table = _table(out)
    record = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    for name, run in record.items():
        row = table[main_job.RUN_LABELS[name]]
        trained = max(h["batch"] for h in run["history"])
        assert int(row["trained at batch"]) == run["run_batch"] == trained
        assert int(row["common batch"]) == run["common_batch"] == 32
        assert float(row["memory_report MiB at trained batch"]) == pytest.approx(
            run["run_batch_memory_mib"], abs=0.01
        )
        if trained == 32:  # one batch, one figure
            assert run["run_batch_memory_mib"] == run["common_batch_memory_mib"]
    # Tri-Accel grew to 64: at the batch it trained at it needs more than at the common batch,
    # and the table says so instead of showing only the common batch's figure.
    elastic = record["triaccel"]
    assert elastic["run_batch"] == 64
    assert elastic["run_batch_memory_mib"] > elastic["common_batch_memory_mib"]
    assert elastic["run_batch_compiled_mib"] > elastic["common_batch_compiled_mib"]
    # The ratio to FP32 compares the same batch.
    fp32 = record["fp32"]
    ratio = float(table["Tri-Accel"]["vs FP32 at common batch"].rstrip("x"))
    expected = elastic["common_batch_memory_mib"] / fp32["common_batch_memory_mib"]
    assert ratio == pytest.approx(expected, abs=1e-3)


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


def test_download_is_asked_for_only_when_the_data_is_missing_and_its_failure_is_reported(
    monkeypatch, capsys, tmp_path
):
    from triaccel_jax import data as data_lib

    calls = []

    def failing_download(data_dir=None, **kwargs):
        calls.append(data_dir)
        raise OSError("every source failed: checksum mismatch")

    monkeypatch.setattr(data_lib, "download_fashion_mnist", failing_download)
    monkeypatch.setattr(data_lib, "find_fashion_mnist", lambda directory=None, split=None: None)
    argv = [
        *TINY[2:],
        "--download",
        "--data-dir",
        str(tmp_path),
        "--output-dir",
        str(tmp_path / "o"),
    ]
    assert main_job.main(argv) == 2
    assert calls == [str(tmp_path)]
    assert "every source failed" in capsys.readouterr().err
    # Without --download nothing is fetched: "auto" falls back to digits.
    calls.clear()
    data = main_job.task.load_data("auto", data_dir=str(tmp_path), train_subset=8, test_subset=8)
    assert data.name == "digits" and calls == []
