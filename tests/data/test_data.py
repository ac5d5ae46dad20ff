"""The offline data sets: real Fashion-MNIST IDX files (wherever they are) and scikit-learn's
digits. The download is tested in test_data_download.py."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from triaccel_jax.data import FASHION_MNIST_DIR
from triaccel_jax.data import _fashion_mnist as fashion_mnist
from triaccel_jax.data import default_data_dir
from triaccel_jax.data import find_fashion_mnist
from triaccel_jax.data import load_digits
from triaccel_jax.data import load_fashion_mnist


def _write_idx(path, array):
    codes = {np.uint8: 0x08}
    header = bytes([0, 0, codes[array.dtype.type], array.ndim]) + struct.pack(
        f">{array.ndim}I", *array.shape
    )
    with gzip.open(path, "wb") as stream:
        stream.write(header + array.tobytes())


def test_reads_idx_files_from_a_folder(tmp_path):
    images = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", images)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.array([3, 7], np.uint8))
    split = load_fashion_mnist("test", tmp_path)
    assert split.images.shape == (2, 28, 28, 1) and split.images.dtype == np.float32
    np.testing.assert_allclose(split.images[..., 0], images / 255.0)
    assert split.labels.tolist() == [3, 7]


def test_truncated_or_foreign_files_are_clear_errors(tmp_path):
    images = np.zeros((2, 28, 28), np.uint8)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.array([3, 7], np.uint8))
    with gzip.open(tmp_path / "t10k-images-idx3-ubyte.gz", "wb") as stream:
        stream.write(bytes([0, 0, 8, 3]) + struct.pack(">3I", 2, 28, 28) + images.tobytes()[:100])
    with pytest.raises(ValueError, match="truncated"):
        load_fashion_mnist("test", tmp_path)
    with gzip.open(tmp_path / "t10k-images-idx3-ubyte.gz", "wb") as stream:
        stream.write(b"\x80\x03pickle")
    with pytest.raises(ValueError, match="not an IDX file"):
        load_fashion_mnist("test", tmp_path)


@pytest.fixture
def no_fashion_mnist(tmp_path, monkeypatch):
    """A machine without Fashion-MNIST anywhere: empty data folder, no Debian package."""
    monkeypatch.setenv("TRIACCEL_DATA_DIR", str(tmp_path / "env"))
    monkeypatch.setattr(fashion_mnist, "FASHION_MNIST_DIR", tmp_path / "debian")
    return tmp_path


def test_missing_files_list_every_way_to_get_them(no_fashion_mnist):
    with pytest.raises(FileNotFoundError) as error:
        load_fashion_mnist("train", no_fashion_mnist / "arg")
    message = str(error.value)
    for folder in ("arg", "arg/fashion-mnist", "env", "env/fashion-mnist", "debian"):
        assert str(no_fashion_mnist / folder) in message, folder
    assert "apt-get install -y dataset-fashion-mnist" in message  # 1. Debian's package
    assert "TRIACCEL_DATA_DIR=" in message and "--data-dir" in message  # 2. a folder
    assert "download_fashion_mnist()" in message and "the main job does so" in message  # 3.
    assert "--dataset digits" in message  # 4. the main job's fallback
    with pytest.raises(ValueError, match="split"):
        load_fashion_mnist("validation", no_fashion_mnist)


def test_the_search_order_argument_then_environment_then_debian(no_fashion_mnist, monkeypatch):
    images = np.zeros((1, 28, 28), np.uint8)
    folders = {
        "debian": no_fashion_mnist / "debian",
        "env": no_fashion_mnist / "env" / "fashion-mnist",  # a data folder's subfolder
        "arg": no_fashion_mnist / "arg",  # the files right in it
    }
    for label, (name, folder) in enumerate(folders.items()):
        folder.mkdir(parents=True)
        _write_idx(folder / "t10k-images-idx3-ubyte.gz", images)
        _write_idx(folder / "t10k-labels-idx1-ubyte.gz", np.array([label], np.uint8))
        assert find_fashion_mnist(no_fashion_mnist / "arg", "test") == folder, name
        assert load_fashion_mnist("test", no_fashion_mnist / "arg").labels.tolist() == [label]
    assert find_fashion_mnist(None, "test") == folders["env"]  # TRIACCEL_DATA_DIR is honoured
    assert find_fashion_mnist(None, "train") is None  # only the test split is there
    monkeypatch.delenv("TRIACCEL_DATA_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(no_fashion_mnist / "cache"))
    assert default_data_dir() == no_fashion_mnist / "cache" / "triaccel_jax" / "data"
    assert find_fashion_mnist(None, "test") == folders["debian"]


@pytest.mark.skipif(
    not FASHION_MNIST_DIR.exists(),
    reason="Debian's dataset-fashion-mnist is not installed (TRIACCEL_INSTALL_SYSTEM_DATA=1 "
    "bash tools/test.sh installs it as root)",
)
def test_real_fashion_mnist():
    test = load_fashion_mnist("test")
    assert test.images.shape == (10_000, 28, 28, 1)
    assert np.bincount(test.labels).tolist() == [1000] * 10
    assert test.images.min() >= 0.0 and test.images.max() == 1.0


def test_digits_split_is_disjoint_and_fixed():
    train, test = load_digits("train"), load_digits("test")
    assert train.images.shape == (1437, 8, 8, 1) and test.images.shape == (360, 8, 8, 1)
    flat = {row.tobytes() for row in train.images.reshape(len(train.images), -1)}
    overlap = sum(row.tobytes() in flat for row in test.images.reshape(len(test.images), -1))
    assert overlap < 5  # digits has a few exact duplicate images; the split itself is disjoint
    np.testing.assert_array_equal(load_digits("test").labels, test.labels)
