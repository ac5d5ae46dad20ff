"""CIFAR through tensorflow-datasets, prepared offline from small archives in the official format.

The archives are written here, record by record as the official binary ones are (label bytes,
then 3,072 pixel bytes channel by channel), and the real preparation and loading code runs on
them. Only their checksums differ from the official archives', so the tests swap those in.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import re
import socket
import tarfile

import numpy as np
import pytest

from triaccel_jax.data import CifarNotFoundError
from triaccel_jax.data import _tfds
from triaccel_jax.data import load_cifar
from triaccel_jax.data import prepare_cifar

NAMES = {"cifar10": [f"class{i}" for i in range(10)], "cifar100": [f"fine{i}" for i in range(100)]}


@pytest.fixture
def tfds(monkeypatch):
    """tensorflow_datasets (skips when it or a package it needs here is missing); no network."""
    module = pytest.importorskip(
        "tensorflow_datasets", reason="tensorflow-datasets is not installed"
    )
    pytest.importorskip("array_record", reason="array-record is not installed")
    pytest.importorskip("PIL", reason="pillow is not installed")
    pytest.importorskip("importlib_resources", reason="importlib-resources is not installed")

    def refuse(*args, **kwargs):
        raise AssertionError(f"the test tried to reach the network: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    return module


def _write_archive(data_dir, name, n_train=20, n_test=10, *, truncate=False):
    """A small archive in the official binary format; returns {split: (chw images, labels)}."""
    archive = _tfds._ARCHIVES[name]
    rng = np.random.default_rng(0 if name == "cifar10" else 1)
    splits, files = {}, {}
    for split, n, batch_files in (
        ("train", n_train, archive.train_files),
        ("test", n_test, archive.test_files),
    ):
        images = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)
        if name == "cifar10":
            labels = np.arange(n, dtype=np.uint8)[:, None] % 10
        else:  # coarse, then fine: different, so the test sees which one comes back
            labels = np.stack([np.arange(n) % 20, (7 * np.arange(n) + 3) % 100], 1).astype(np.uint8)
        splits[split] = (images, labels)
        records = np.concatenate([labels, images.reshape(n, -1)], axis=1)
        for i, batch in enumerate(np.array_split(records, len(batch_files))):
            files[batch_files[i]] = batch.tobytes()[: -1 if truncate else None]
    if name == "cifar10":
        files["batches.meta.txt"] = ("\n".join(NAMES[name]) + "\n\n").encode()
    else:
        files["coarse_label_names.txt"] = "\n".join(f"coarse{i}" for i in range(20)).encode()
        files["fine_label_names.txt"] = "\n".join(NAMES[name]).encode()
    manual = data_dir / "downloads" / "manual"
    manual.mkdir(parents=True)
    path = manual / archive.filename
    with tarfile.open(path, "w:gz") as tar:
        for filename, data in files.items():
            info = tarfile.TarInfo(archive.prefix + filename)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path, splits


def _accept_checksum(monkeypatch, name, path):
    """Registers the small archive's size and SHA-256 in place of the official one's."""
    data = path.read_bytes()
    fake = _tfds._ARCHIVES[name]._replace(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(_tfds._ARCHIVES, name, fake)


def _expected(images, labels):
    return images.transpose(0, 2, 3, 1).astype(np.float32) / np.float32(255.0), labels


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_prepares_from_the_archive_and_loads_offline(tfds, tmp_path, monkeypatch, name):
    path, splits = _write_archive(tmp_path, name)
    _accept_checksum(monkeypatch, name, path)
    for split, n in (("train", 20), ("test", 10)):
        got = load_cifar(name, split, data_dir=tmp_path)
        images, labels = splits[split]
        assert got.images.shape == (n, 32, 32, 3) and got.images.dtype == np.float32
        assert got.labels.shape == (n,) and got.labels.dtype == np.int32
        assert got.images.min() >= 0.0 and got.images.max() <= 1.0
        # In the archive's order; pixels stored channel by channel come back as HWC.
        want_images, want_labels = _expected(images, labels)
        np.testing.assert_array_equal(got.images, want_images)
        np.testing.assert_array_equal(got.labels, want_labels[:, -1])  # cifar100: the fine label
        # One pixel by hand: channel 2 (blue), row 5, column 7 of the third image.
        assert got.images[2, 5, 7, 2] == np.float32(images[2, 2, 5, 7]) / np.float32(255.0)

    # tfds's own registered builder reads the prepared folder: the same data set, no TensorFlow.
    folder = tmp_path / name / "3.0.2"
    assert sorted(p.name for p in folder.glob("*.array_record*")) == [
        f"{name}-test.array_record-00000-of-00001",
        f"{name}-train.array_record-00000-of-00001",
    ]
    builder = tfds.builder(name, data_dir=str(tmp_path))
    assert builder.info.features["label"].names == NAMES[name]
    source = tfds.data_source(name, split="test", data_dir=str(tmp_path), download=False)
    example = source[0]
    index = int(example["id"].decode().removeprefix("test_"))
    np.testing.assert_array_equal(example["image"], splits["test"][0][index].transpose(1, 2, 0))
    if name == "cifar100":
        assert example["coarse_label"] == splits["test"][1][index, 0]

    # Once prepared, the archive is no longer needed, and preparing again does nothing.
    path.unlink()
    assert prepare_cifar(name, data_dir=tmp_path) == folder
    np.testing.assert_array_equal(load_cifar(name, "test", data_dir=tmp_path).labels, got.labels)


def test_missing_data_says_which_file_goes_where(tfds, tmp_path):
    with pytest.raises(CifarNotFoundError) as error:
        load_cifar("cifar100", "test", data_dir=tmp_path)
    assert isinstance(error.value, FileNotFoundError)
    message = str(error.value)
    manual = tmp_path / "downloads" / "manual"
    assert f"{manual / 'cifar-100-binary.tar.gz'} is missing" in message
    assert "https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz" in message
    assert f"mkdir -p {manual}" in message
    assert f"prepare_cifar('cifar100', data_dir={str(tmp_path)!r})" in message
    assert not (tmp_path / "cifar100").exists()


def test_foreign_or_broken_archives_are_clear_errors(tfds, tmp_path, monkeypatch):
    path, _ = _write_archive(tmp_path / "a", "cifar10")
    with pytest.raises(ValueError, match=r"is not the official cifar-10-binary\.tar\.gz"):
        prepare_cifar("cifar10", data_dir=tmp_path / "a")  # the official checksum is checked

    path, _ = _write_archive(tmp_path / "b", "cifar10", truncate=True)
    _accept_checksum(monkeypatch, "cifar10", path)
    with pytest.raises(ValueError, match=r"data_batch_1\.bin is truncated"):
        prepare_cifar("cifar10", data_dir=tmp_path / "b")
    assert not (tmp_path / "b" / "cifar10" / "3.0.2").exists()


def test_arguments_and_missing_packages(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="`name` must be one of"):
        load_cifar("cifar1000", "train", data_dir=tmp_path)
    with pytest.raises(ValueError, match="`split` must be 'train' or 'test'"):
        load_cifar("cifar10", "validation", data_dir=tmp_path)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "tensorflow_datasets" else find_spec(name, *args),
    )
    with pytest.raises(
        ImportError, match="pip install tensorflow-datasets array-record pillow importlib-resources"
    ):
        load_cifar("cifar10", "train", data_dir=tmp_path)


@pytest.mark.slow
@pytest.mark.standard_promotion(
    "optax promotes inside its own transforms (integer leaves, MultiSteps, injected hyperparameters)"
)
def test_main_job_trains_on_cifar_through_tfds(tfds, tmp_path, monkeypatch, capsys):
    from triaccel_jax.cli import _main_job as main_job

    path, _ = _write_archive(tmp_path / "tfds", "cifar10", n_train=64, n_test=16)
    _accept_checksum(monkeypatch, "cifar10", path)
    args = ["--dataset", "cifar10", "--data-dir", str(tmp_path / "tfds"), "--model", "resnet20"]
    args += ["--runs", "fp32", "--batch-size", "16", "--max-steps", "2", "--no-progress"]
    assert main_job.main([*args, "--output-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "resnet20 on cifar10 (64 train / 16 test)" in out
    # run | wall s | compile s | step s | samples/s | steps | final batch | ...
    assert re.search(r"^\| FP32 AdamW \|(?: [\d.]+ \|){4} 2 \| 16 \|", out, re.M)
