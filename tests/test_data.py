"""The offline data sets: real Fashion-MNIST IDX files and scikit-learn's digits."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from triaccel_jax.data import FASHION_MNIST_DIR
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


def test_missing_files_say_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        load_fashion_mnist("train", tmp_path)
    with pytest.raises(ValueError, match="split"):
        load_fashion_mnist("validation", tmp_path)


@pytest.mark.skipif(
    not FASHION_MNIST_DIR.exists(),
    reason="Debian's dataset-fashion-mnist is not installed (tools/test.sh installs it as root)",
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
