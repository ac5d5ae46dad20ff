"""Small image-classification data sets that need no download, as NHWC float32 arrays.

* Fashion-MNIST (Xiao et al., 2017; MIT licence), read from its IDX files: in a folder given
  as ``directory`` (the main job's ``--data-dir``), ``$TRIACCEL_DATA_DIR``, the folder
  :func:`download_fashion_mnist` writes to, or Debian's ``dataset-fashion-mnist`` package
  (``apt-get install -y dataset-fashion-mnist``); see :func:`find_fashion_mnist`.
* scikit-learn's digits (8x8 grey images, bundled with scikit-learn), the embedded fallback.
"""

from __future__ import annotations

import gzip
import os
import pathlib
import struct
from typing import NamedTuple

import numpy as np

from triaccel_jax._src import extras
from triaccel_jax.data import _fashion_mnist

FASHION_MNIST_DIR = _fashion_mnist.FASHION_MNIST_DIR
_IDX_DTYPES = {
    code: np.dtype(kind)
    for code, kind in {
        0x08: "u1",
        0x09: "i1",
        0x0B: ">i2",
        0x0C: ">i4",
        0x0D: ">f4",
        0x0E: ">f8",
    }.items()
}


class ArraySplit(NamedTuple):
    """Images ``(n, height, width, channels)`` float32 in [0, 1] and int32 labels ``(n,)``."""

    images: np.ndarray
    labels: np.ndarray


def _read_idx(path: pathlib.Path) -> np.ndarray:
    """Reads a (gzipped) IDX file: a magic number, the dimensions, then the raw values."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as stream:
        data = stream.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number)")
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    values = np.frombuffer(data, dtype=_IDX_DTYPES[data[2]], offset=4 + 4 * ndim)
    if values.size != int(np.prod(shape)):
        raise ValueError(f"{path} is truncated: {values.size} values for shape {shape}")
    return values.reshape(shape)


def load_fashion_mnist(
    split: str = "train", directory: str | os.PathLike | None = None
) -> ArraySplit:
    """Fashion-MNIST ``"train"`` (60,000) or ``"test"`` (10,000) images, 28x28x1.

    The IDX files are looked for in ``directory`` (and its ``fashion-mnist/``) first, then in
    ``$TRIACCEL_DATA_DIR`` (else ``~/.cache/triaccel_jax/data``, where
    :func:`download_fashion_mnist` writes), then in Debian's ``/usr/share/datasets/fashion-mnist``.
    Nothing is downloaded here.

    Args:
      split: ``"train"`` or ``"test"``.
      directory: a data folder searched first: it, or its ``fashion-mnist/``, holds the files.

    Returns:
      The :class:`ArraySplit`.

    Raises:
      FileNotFoundError: no folder holds the split's files; the message lists the folders
        searched and every way to get the data set.
      ValueError: a file is not an IDX file or is truncated.

    Example:
      >>> from triaccel_jax.data import find_fashion_mnist, load_fashion_mnist
      >>> if find_fashion_mnist(split="test") is not None:  # e.g. Debian's package is installed
      ...     assert load_fashion_mnist("test").images.shape == (10_000, 28, 28, 1)
    """
    names = _fashion_mnist.split_files(split)  # checks `split`
    folder = _fashion_mnist.find_fashion_mnist(directory, split)
    if folder is None:
        raise FileNotFoundError(_fashion_mnist.fashion_mnist_not_found_message(directory, split))
    images_path, labels_path = (folder / name for name in names)
    images = _read_idx(images_path)
    labels = _read_idx(labels_path)
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{folder}: {images.shape[0]} images but {labels.shape[0]} labels")
    return ArraySplit((images.astype(np.float32) / 255.0)[..., None], labels.astype(np.int32))


def load_digits(split: str = "train", *, test_size: int = 360, seed: int = 0) -> ArraySplit:
    """scikit-learn's 1,797 digits, 8x8x1, split into train and ``test_size`` test images.

    The split is a fixed permutation from ``seed``, so train and test never mix.

    Example:
      >>> from triaccel_jax.data import load_digits
      >>> split = load_digits("test")
      >>> split.images.shape, split.labels.shape
      ((360, 8, 8, 1), (360,))
    """
    if split not in ("train", "test"):
        raise ValueError(f"`split` must be 'train' or 'test', got {split!r}")
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise ImportError(
            f"the digits data set ships with scikit-learn: {extras.install_hint('demo')}"
        ) from None
    images, labels = sklearn_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(images))
    images = (images[order] / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    labels = labels[order].astype(np.int32)
    part = slice(test_size, None) if split == "train" else slice(None, test_size)
    return ArraySplit(images[part], labels[part])
