"""The main job end to end with tiny settings: the table, the plots, and its clear errors."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import re
import subprocess
import sys

import pytest

from triaccel_jax import controller as controller_lib
from triaccel_jax.cli import _main_job as main_job

TINY = ["--dataset", "digits", "--epochs", "2", "--max-steps", "6", "--batch-size", "32"]
TINY += ["--max-batch", "64", "--check-every", "2", "--replan-every", "3", "--no-progress"]
TINY += ["--state-plan-step", "3"]  # Tri-Accel's state planned from its own signals at step 3
# The grow compiles synchronously here so that it happens within the six steps.
TINY += ["--no-compile-in-background"]


def _run_tiny_job(output, *extra: str) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cache = ["--compilation-cache", str(output / "jax_cache")]  # not the user's cache
        assert main_job.main([*TINY, *extra, *cache, "--output-dir", str(output)]) == 0
    return printed.getvalue()


@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory):
    """The main job with tiny settings, run once: (printed output, output folder)."""
    output = tmp_path_factory.mktemp("main_job")
    return _run_tiny_job(output), output


class _MemoryRuleController(controller_lib.Controller):
    """The controller with ``batch_rule="memory"``: its batch grows to what memory allows."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("batch_rule", "memory")
        super().__init__(*args, **kwargs)


@pytest.fixture(scope="module")
def grown_job(tmp_path_factory):
    """The tiny job with the Tri-Accel run's batch grown by memory, so that it trains at a batch
    above the common one (the default goodput rule grows only where the larger batch is measured
    faster, which six steps on a shared CPU do not promise): (printed output, output folder). No
    re-plan within its six steps: a precision trial would hold the bucket until it is judged."""
    output = tmp_path_factory.mktemp("main_job_grown")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(controller_lib, "Controller", _MemoryRuleController)
        return _run_tiny_job(output, "--replan-every", "100"), output


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


@pytest.mark.slow
def test_main_job_writes_the_table_and_plots(tiny_job):
    out, tmp_path = tiny_job
    table = _table(out)
    assert list(table) == ["FP32 AdamW", "static bf16 AdamW", "Tri-Accel"]
    for row in table.values():
        assert float(row["wall s"]) > 0 and int(row["steps"]) == 6
        assert float(row["step s"]) > 0 and float(row["samples/s"]) > 0
        assert float(row["wall s"]) >= float(row["compile s"])
        assert float(row["memory_report estimate MiB at common batch"]) > 0
        assert float(row["compiled step MiB at common batch"]) > 0
        assert 0 <= float(row["test accuracy"].rstrip("%")) <= 100
    # bf16 compute copies and bf16 residuals: less memory than FP32 (memory_report, exact).
    ratios = {
        name: float(row["estimate vs FP32 at common batch"].rstrip("x"))
        for name, row in table.items()
    }
    assert ratios["FP32 AdamW"] == 1.0 and ratios["static bf16 AdamW"] < 0.9
    for name in (
        "results.md",
        "results.json",
        "curves.png",
        "batch_memory.png",
        "precision_map.png",
        "step_scales.png",
        "state_memory.png",
    ):
        path = tmp_path / name
        assert path.exists() and path.stat().st_size > 0, name
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((tmp_path / "results.json").read_text())
    elastic = record["results"][2]
    assert elastic["name"] == "triaccel"
    # Every run's policies are recorded from its first step, for the precision map's panels.
    policies = {run["name"]: run["policies"] for run in record["results"]}
    assert all(runs[0]["step"] == 0 for runs in policies.values())
    dtypes = {
        name: {d for p in runs for d in p["leaves"].values()} for name, runs in policies.items()
    }
    assert dtypes["fp32"] == {"fp32"} and dtypes["bf16"] == {"bf16"}
    assert set(policies["fp32"][0]["leaves"]) == set(policies["triaccel"][0]["leaves"])
    # The default batch rule, goodput: every step measures the gradient noise scale, the batch
    # stays among the buckets, and any move is goodput's (a run grown by memory: grown_job).
    assert all(h["noise_scale"] is not None for h in elastic["history"])
    assert {h["batch"] for h in elastic["history"]} <= {32, 64}
    moves = [e for e in elastic["events"] if e["kind"] in ("grow", "shrink")]
    assert all(e["reason"].startswith("goodput ") for e in moves), moves
    # Every epoch's end is among the evaluations, so steps-to-accuracy can be read from them.
    assert [e["step"] for e in elastic["evals"]][-1] == 6
    assert elastic["evals"][-1]["accuracy"] == elastic["epoch_accuracy"][-1]


@pytest.mark.slow
def test_the_triaccel_row_holds_its_state_in_planned_low_bit_formats(tiny_job):
    out, tmp_path = tiny_job
    table = _table(out)
    record = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    fp32, elastic = record["fp32"], record["triaccel"]
    # The record carries every run's state bytes by format; the fixed runs' AdamW is float32.
    for run in (fp32, record["bf16"]):
        assert set(run["state_bytes"]) == {"fp32", "other"} and run["state_plan"] is None
        assert run["state_compiled_bytes"] == pytest.approx(8 * run["parameters"], rel=1e-3)
    # Tri-Accel's moments are stored in the plan's low-bit formats, read back from its leaves.
    plan = elastic["state_plan"]
    low = {f for f in plan["formats"].values() if f not in ("fp32", "bf16")}
    assert low and low <= set(elastic["state_bytes"])
    assert plan["plan_step"] == 3 and plan["meets_cap"] and plan["cap"] == 6.5
    # Size alone chose the same formats at the start: the run kept its controller.
    assert plan["formats"] == plan["initial_formats"] and not plan["switched"]
    # Its compiled state, and its compiled step at the common batch, are below FP32 AdamW's.
    assert elastic["state_compiled_bytes"] < 0.9 * fp32["state_compiled_bytes"]
    assert elastic["common_batch_compiled_mib"] < fp32["common_batch_compiled_mib"]
    row = table["Tri-Accel"]
    assert float(row["state vs FP32"].rstrip("x")) == pytest.approx(
        elastic["state_compiled_bytes"] / fp32["state_compiled_bytes"], abs=1e-3
    )
    assert float(row["state B/param (XLA compiled)"]) == pytest.approx(
        elastic["state_compiled_bytes"] / elastic["parameters"], abs=1e-3
    )
    cells = dict(
        part.rsplit(" ", 1) for part in row["state MiB by format (stored leaves)"].split(" + ")
    )
    assert set(cells) == set(elastic["state_bytes"])
    for name, mib in cells.items():
        assert float(mib) == pytest.approx(elastic["state_bytes"][name] / 2**20, rel=5e-3)
    seconds, step = row["state plan s (at step)"].split()
    assert step == "(3)" and float(seconds) == pytest.approx(plan["plan_seconds"], abs=0.01)
    # The plan's seconds are in the wall time; it trains no step of its own.
    assert elastic["seconds"] >= plan["plan_seconds"] + elastic["compile_seconds"]
    assert elastic["steps"] == fp32["steps"] == 6
    assert "**Tri-Accel's state.** Adam's moments planned under a cap of 6.5 B/param" in out


@pytest.mark.standard_promotion("Flax's avg_pool promotes internally")
def test_a_plan_that_differs_converts_the_state_and_the_run_goes_on_from_the_same_step(
    tmp_path,
):
    """Started with every moment in float32, the run's plan at step 3 lowers Dense_0/kernel: the
    state is converted and a new controller carries on from step 3 with its samples, compiles
    and events, to the same six steps as the fixed runs."""
    from triaccel_jax.cli import _state as state_lib

    by_size = state_lib.initial_state_formats

    def all_fp32(params, *, learning_rate, cap):
        return dict.fromkeys(by_size(params, learning_rate=learning_rate, cap=cap), "fp32")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(state_lib, "initial_state_formats", all_fp32)
        _run_tiny_job(tmp_path, "--runs", "fp32", "triaccel")
    record = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    fp32, elastic = record["fp32"], record["triaccel"]
    plan = elastic["state_plan"]
    assert plan["switched"] and plan["plan_step"] == 3
    assert set(plan["initial_formats"].values()) == {"fp32"}
    assert plan["formats"]["Dense_0/kernel"] in ("int8", "int4")
    # The moments are stored in the plan's formats at the end, and the run is one run: its
    # steps counted on from 3, and its sampler's samples those of all six steps (a controller
    # that started its own count would have seen only the last three steps' samples).
    assert plan["formats"]["Dense_0/kernel"] in elastic["state_bytes"]
    assert elastic["steps"] == fp32["steps"] == 6
    assert [h["step"] for h in elastic["history"]] == list(range(1, 7))
    assert elastic["evals"][-1]["samples"] == sum(h["batch"] for h in elastic["history"])
    # The first controller's compile counts with the second's: two steps compiled at least.
    assert elastic["compile_seconds"] >= elastic["evals"][0]["compile_seconds"] > 0
    assert elastic["state_compiled_bytes"] < 0.9 * fp32["state_compiled_bytes"]


@pytest.mark.slow
def test_every_run_reports_memory_at_the_batch_it_trained_at_and_at_a_common_batch(grown_job):
    out, tmp_path = grown_job
    table = _table(out)
    record = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    for name, run in record.items():
        row = table[main_job.RUN_LABELS[name]]
        trained = max(h["batch"] for h in run["history"])
        assert int(row["trained at batch"]) == run["run_batch"] == trained
        assert int(row["common batch"]) == run["common_batch"] == 32
        assert float(row["memory_report estimate MiB at trained batch"]) == pytest.approx(
            run["run_batch_memory_mib"], abs=0.01
        )
        if trained == 32:  # one batch, one figure
            assert run["run_batch_memory_mib"] == run["common_batch_memory_mib"]
    # Tri-Accel grew to 64: at the batch it trained at it needs more than at the common batch,
    # and the table says so instead of showing only the common batch's figure.
    elastic = record["triaccel"]
    assert any(e["kind"] == "grow" for e in elastic["events"])
    assert elastic["run_batch"] == 64
    assert elastic["run_batch_memory_mib"] > elastic["common_batch_memory_mib"]
    assert elastic["run_batch_compiled_mib"] > elastic["common_batch_compiled_mib"]
    # The ratio to FP32 compares the same batch.
    fp32 = record["fp32"]
    ratio = float(table["Tri-Accel"]["estimate vs FP32 at common batch"].rstrip("x"))
    expected = elastic["common_batch_memory_mib"] / fp32["common_batch_memory_mib"]
    assert ratio == pytest.approx(expected, abs=1e-3)
    # XLA's compiled figure leads, with its own ratio at the same batch.
    header = re.search(r"^\| run \|(.*)\|$", out, re.M).group(1)
    assert header.index("compiled step MiB at common batch") < header.index(
        "memory_report estimate MiB at common batch"
    )
    compiled = float(table["Tri-Accel"]["compiled vs FP32 at common batch"].rstrip("x"))
    expected = elastic["common_batch_compiled_mib"] / fp32["common_batch_compiled_mib"]
    assert compiled == pytest.approx(expected, abs=1e-3)


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
    "bad",
    [
        ["--epochs", "0"],
        ["--lr", "-1"],
        ["--budget-mib", "0"],
        ["--max-steps", "0"],
        ["--state-cap", "0"],
        ["--state-cap", "inf"],
        ["--state-plan-step", "0"],
    ],
)
def test_bad_numbers_are_rejected(bad):
    with pytest.raises(SystemExit):
        main_job.main(bad)


@pytest.fixture
def no_fashion_mnist(monkeypatch, tmp_path):
    """A machine without Fashion-MNIST, no network and no way to install Debian's package: every
    step of the data chain is recorded, none reaches outside."""
    from triaccel_jax import data as data_lib
    from triaccel_jax.cli import _data_source as data_source
    from triaccel_jax.data import _fashion_mnist

    # Nothing where the data is looked for: an empty data folder, no Debian folder.
    monkeypatch.setenv(data_lib.DATA_DIR_ENV, str(tmp_path / "empty"))
    monkeypatch.setattr(_fashion_mnist, "FASHION_MNIST_DIR", tmp_path / "no-debian-package")
    tried = []

    def failing_download(data_dir=None, **kwargs):
        tried.append(("download", data_dir))
        raise OSError(
            "could not download it intact:\n  https://example/x: Name or service not known"
        )

    monkeypatch.setattr(data_lib, "download_fashion_mnist", failing_download)
    monkeypatch.setattr(data_source, "debian_install_blocker", lambda: "not root (test)")
    monkeypatch.setattr(
        data_source, "install_debian_package", lambda announce: tried.append(("apt", None))
    )
    return tried


def test_the_data_chain_downloads_then_installs_then_falls_back_saying_so(no_fashion_mnist):
    from triaccel_jax.cli import _data_source as data_source

    said = []
    source = data_source.resolve("auto", data_dir=None, offline=False, announce=said.append)
    assert no_fashion_mnist == [("download", None)]
    assert source.dataset == "digits" and source.stand_in
    assert "the download failed (https://example/x: Name or service not known)" in source.how
    assert "Debian's package was not installed (not root (test))" in source.how
    assert said[0].startswith("Fashion-MNIST not found; downloading it")
    assert said[-1].startswith("using the embedded workload")
    # --offline tries nothing; asking for Fashion-MNIST by name fails, listing every way.
    no_fashion_mnist.clear()
    source = data_source.resolve("auto", data_dir=None, offline=True, announce=said.append)
    assert source.dataset == "digits" and no_fashion_mnist == []
    with pytest.raises(
        FileNotFoundError, match=r"(?s)download failed.*not installed.*apt-get install"
    ):
        data_source.resolve("fashion_mnist", data_dir=None, offline=False, announce=said.append)


def test_debians_package_is_installed_where_possible_and_announced(monkeypatch):
    from triaccel_jax import data as data_lib
    from triaccel_jax.cli import _data_source as data_source

    installed = []
    monkeypatch.setattr(
        data_lib,
        "find_fashion_mnist",
        lambda directory=None, split=None: data_lib.FASHION_MNIST_DIR if installed else None,
    )
    monkeypatch.setattr(
        data_lib, "download_fashion_mnist", lambda *a, **k: (_ for _ in ()).throw(OSError("no"))
    )
    monkeypatch.setattr(data_source, "debian_install_blocker", lambda: None)
    monkeypatch.setattr(data_source, "install_debian_package", lambda announce: installed.append(1))
    said = []
    source = data_source.resolve("auto", data_dir=None, offline=False, announce=said.append)
    assert installed and source.dataset == "fashion_mnist" and not source.stand_in
    assert any("apt-get install -y -qq dataset-fashion-mnist" in line for line in said)


def test_the_progress_bar_never_overruns_its_total():
    from triaccel_jax.cli import _runs as runs

    class Bar:
        def __init__(self, total):
            self.n, self.total = 0, total

        def update(self, n):
            self.n += n
            assert self.n <= self.total

        def refresh(self):
            """Nothing is drawn: the test reads ``n`` and ``total``."""

    bar = Bar(100)
    for size in (32, 32, 64):  # a batch that grew: 128 samples against 100 planned
        runs._advance(bar, size)
    assert bar.n == bar.total == 128


@pytest.mark.slow
@pytest.mark.standard_promotion("Flax's avg_pool promotes internally")
def test_the_default_main_job_without_fashion_mnist_shows_every_adaptation(
    no_fashion_mnist, tmp_path
):
    # The README's first command on a fresh machine without the data: the embedded workload is
    # long enough that the batch can change and precision is re-planned, and the table says so.
    # The batch moves by goodput (the default batch rule), from throughput measured on this
    # machine: whether it changes depends on the machine, so the test reads what it did.
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cache = ["--compilation-cache", str(tmp_path / "jax_cache")]
        assert main_job.main(["--no-progress", *cache, "--output-dir", str(tmp_path)]) == 0
    out = printed.getvalue()
    assert "[data] using the embedded workload" in out
    assert "**Data.** scikit-learn's digits, embedded, standing in for Fashion-MNIST" in out
    assert "one test image is 0.28 points" in out
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["data_source"]["stand_in"]
    elastic = next(r for r in record["results"] if r["name"] == "triaccel")
    batches = [h["batch"] for h in elastic["history"]]
    moves = [e for e in elastic["events"] if e["kind"] in ("grow", "shrink", "oom")]
    assert all(e["reason"].startswith("goodput ") for e in moves if e["kind"] != "oom"), moves
    assert set(batches) <= {32, 64, 128}  # the buckets from --batch-size to --max-batch
    if moves:
        path = " -> ".join([str(batches[0]), *(str(e["new"]) for e in moves)])
        assert f"the batch went {path}" in out
    else:
        assert f"the batch stayed at {batches[0]}: no other bucket's goodput" in out
    kinds = [e["kind"] for e in elastic["events"]]
    # Memory is plentiful and bf16 is emulated on a CPU: precision stays float32, and says why.
    assert "replan" not in kinds
    assert set(elastic["policies"][-1]["leaves"].values()) == {"fp32"}
    assert "precision stayed float32: memory never needed a lower one" in out
    scales = elastic["step_scales"][-1]["scales"]
    assert len(set(round(v, 3) for v in scales.values())) > 1  # per-layer scales differ
    noise = [h["noise_scale"] for h in elastic["history"]]
    assert all(n > 0 for n in noise[1:]), "the gradient noise scale was not measured"
    assert "the gradient noise scale B_simple" in out
    for run in record["results"]:
        samples = [h["samples"] for h in run["history"]]
        # One point per step along the x axis of the loss curve (no flat runs of equal x).
        assert all(b > a for a, b in itertools.pairwise(samples)), run["name"]
        planned = 1437 * record["args"]["epochs"]
        assert planned <= samples[-1] < planned + max(batches), run["name"]
    names = ("curves.png", "batch_memory.png", "precision_map.png", "step_scales.png")
    for name in (*names, "state_memory.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_the_command_without_its_extra_names_every_missing_package_at_once():
    # A base install ships the `triaccel` command: run without the demo extra, it says in one
    # message everything to install, instead of one extra per attempt.
    code = (
        "import sys\n"
        "for name in ('flax', 'sklearn', 'matplotlib'):\n"
        "    sys.modules[name] = None\n"
        "from triaccel_jax.cli import main\n"
        "sys.exit(main(['--help']))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "error: the main job (triaccel, python -m triaccel_jax) needs Flax, scikit-learn and "
        "matplotlib, which are not installed: pip install -e '.[demo]' (in a clone of triaccel_jax)"
    )
