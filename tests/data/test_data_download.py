"""download_fashion_mnist: explicit, checksummed, and leaves nothing corrupt behind.

No network: the "official source" is a local folder served through file:// URLs, which
urllib.request.urlopen opens like any other.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import shutil
import struct

import numpy as np
import pytest

from triaccel_jax.data import FASHION_MNIST_DIR
from triaccel_jax.data import _fashion_mnist as fashion_mnist
from triaccel_jax.data import download_fashion_mnist
from triaccel_jax.data import load_fashion_mnist

NAMES = tuple(fashion_mnist.FASHION_MNIST_FILES)


def _idx_gz(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return gzip.compress(header + array.tobytes(), mtime=0)


def _small_data_set(folder):
    """Four tiny IDX files in ``folder``; returns the checksum table that makes them official."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train-images-idx3-ubyte.gz": np.full((3, 28, 28), 7, np.uint8),
        "train-labels-idx1-ubyte.gz": np.array([0, 1, 2], np.uint8),
        "t10k-images-idx3-ubyte.gz": np.full((2, 28, 28), 9, np.uint8),
        "t10k-labels-idx1-ubyte.gz": np.array([4, 5], np.uint8),
    }
    table = {}
    for name, array in arrays.items():
        data = _idx_gz(array)
        (folder / name).write_bytes(data)
        md5 = lambda b: hashlib.md5(b, usedforsecurity=False).hexdigest()
        table[name] = (md5(data), md5(gzip.decompress(data)), len(data))
    return table


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A local "official source" whose files the checksum table accepts; its file:// URL."""
    table = _small_data_set(tmp_path / "mirror")
    monkeypatch.setattr(fashion_mnist, "FASHION_MNIST_FILES", table)
    return (tmp_path / "mirror").as_uri() + "/"


def _leftovers(folder):
    return sorted(p.name for p in folder.rglob("*") if p.is_file())


def test_downloads_verifies_and_loads(tmp_path, mirror):
    folder = download_fashion_mnist(tmp_path / "data", urls=[mirror])
    assert folder == tmp_path / "data" / "fashion-mnist"
    assert _leftovers(folder) == sorted(NAMES)  # no temporary file left
    assert load_fashion_mnist("test", tmp_path / "data").labels.tolist() == [4, 5]
    # Verified files are kept: a second call needs no source at all.
    assert download_fashion_mnist(tmp_path / "data", urls=["file:///nonexistent/"]) == folder


def test_the_default_folder_is_the_environment_variables(tmp_path, mirror, monkeypatch):
    monkeypatch.setenv("TRIACCEL_DATA_DIR", str(tmp_path / "env"))
    assert download_fashion_mnist(urls=[mirror]) == tmp_path / "env" / "fashion-mnist"
    assert load_fashion_mnist("train").labels.tolist() == [0, 1, 2]


def test_a_checksum_mismatch_raises_and_leaves_no_file(tmp_path, mirror, caplog):
    bad = tmp_path / "mirror"
    (bad / "t10k-images-idx3-ubyte.gz").write_bytes(_idx_gz(np.zeros((2, 28, 28), np.uint8)))
    with (
        caplog.at_level(logging.WARNING, logger=fashion_mnist.__name__),
        pytest.raises(OSError, match=r"t10k-images-idx3-ubyte\.gz.*\n.*MD5 mismatch"),
    ):
        download_fashion_mnist(tmp_path / "data", urls=[mirror])
    folder = tmp_path / "data" / "fashion-mnist"
    assert "t10k-images-idx3-ubyte.gz" not in _leftovers(folder)
    assert not any(name.endswith(".part") for name in _leftovers(folder))
    assert "MD5 mismatch" in caplog.text and "nothing of it was kept" in caplog.text


def test_a_corrupt_first_source_falls_back_to_the_next(tmp_path, mirror, caplog):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in NAMES:
        (broken / name).write_bytes(b"\x1f\x8b not really gzip")
    with caplog.at_level(logging.WARNING, logger=fashion_mnist.__name__):
        folder = download_fashion_mnist(tmp_path / "data", urls=[broken.as_uri(), mirror])
    assert _leftovers(folder) == sorted(NAMES)
    assert caplog.text.count("nothing of it was kept") == len(NAMES)


def test_a_missing_source_and_an_oversized_reply_are_reported(tmp_path, mirror):
    # The source sends far more than the official size: cut off, not written to the end.
    (tmp_path / "mirror" / "train-images-idx3-ubyte.gz").write_bytes(bytes(1 << 20))
    missing = (tmp_path / "nowhere").as_uri()
    with pytest.raises(OSError) as error:
        download_fashion_mnist(tmp_path / "data", urls=[missing, mirror])
    message = str(error.value)
    assert "nowhere/train-images-idx3-ubyte.gz: download failed" in message
    assert "bytes: not the official file" in message
    assert _leftovers(tmp_path / "data") == []
    with pytest.raises(ValueError, match="urls"):
        download_fashion_mnist(tmp_path / "data", urls=[])


def test_urlopen_is_what_fetches(tmp_path, mirror, monkeypatch):
    # Whatever urlopen returns is checked: a monkeypatched one serving junk is caught too.
    import io
    import urllib.request

    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: io.BytesIO(b"junk"))
    with pytest.raises(OSError, match="not a gzip file"):
        download_fashion_mnist(tmp_path / "data", urls=["https://example.invalid/"])
    assert _leftovers(tmp_path / "data") == []


@pytest.mark.skipif(
    not all((FASHION_MNIST_DIR / name).exists() for name in NAMES),
    reason="Debian's dataset-fashion-mnist is not installed",
)
def test_the_official_checksums_accept_debians_files(tmp_path):
    # Debian recompressed the official .gz files (the gzip header lost the file name), so their
    # .gz MD5s differ from the published ones while the IDX contents are the same bytes.
    for name in NAMES:
        assert fashion_mnist.verify(FASHION_MNIST_DIR / name) is None, name
    folder = download_fashion_mnist(tmp_path, urls=[FASHION_MNIST_DIR.as_uri()])
    assert _leftovers(folder) == sorted(NAMES)
    # One flipped byte inside the data is caught.
    data = bytearray(gzip.decompress((folder / NAMES[3]).read_bytes()))
    data[-1] ^= 1
    (folder / NAMES[3]).write_bytes(gzip.compress(bytes(data)))
    assert "MD5 mismatch" in fashion_mnist.verify(folder / NAMES[3])
    shutil.rmtree(folder)


def test_the_main_job_downloads_unless_offline():
    from triaccel_jax.cli import _arguments as arguments

    assert not arguments.parse_args([]).offline
    assert arguments.parse_args(["--offline"]).offline
    with pytest.raises(SystemExit):
        arguments.parse_args(["--download"])  # downloading is the default; one way to say it
