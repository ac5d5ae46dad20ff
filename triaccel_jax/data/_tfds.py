"""CIFAR-10 and CIFAR-100 through tensorflow-datasets (tfds), prepared offline, without TensorFlow.

Requirements: ``pip install tensorflow-datasets array-record pillow importlib-resources``
(TensorFlow is *not* needed). tfds stores the images as PNG in array_record files:
``array-record`` writes and reads those files, ``pillow`` encodes and decodes the PNGs, and
tfds 4.9.10 needs ``importlib-resources`` to prepare a data set but does not declare it
(https://github.com/tensorflow/datasets/issues/11212).

Offline set-up (once per data set; nothing is downloaded at run time):

1. On any machine with internet, download the **binary version** of the archive (not the
   "python" or "matlab" one) from https://www.cs.toronto.edu/~kriz/cifar.html:

   * CIFAR-10: ``cifar-10-binary.tar.gz`` (170,052,171 bytes, SHA-256 ``c4a38c50…``)
   * CIFAR-100: ``cifar-100-binary.tar.gz`` (168,513,733 bytes, SHA-256 ``58a81ae1…``)

2. Put it, under that file name, in tfds's manual folder ``<data_dir>/downloads/manual/``.
   ``<data_dir>`` is the ``data_dir=`` you pass, else ``$TFDS_DATA_DIR``, else
   ``~/tensorflow_datasets`` (tfds's own default)::

       mkdir -p ~/tensorflow_datasets/downloads/manual
       cp cifar-10-binary.tar.gz ~/tensorflow_datasets/downloads/manual/

3. Prepare it (under a minute; :func:`load_cifar` also does this by itself on first use)::

       python -c "from triaccel_jax.data import prepare_cifar; prepare_cifar('cifar10')"

   This checks the archive's size and SHA-256 against the checksums that tfds registers for it,
   then writes ``<data_dir>/cifar10/3.0.2/`` in array_record format: the same data set, features
   and version as tfds's own ``cifar10`` builder, so ``tfds.data_source("cifar10")`` reads it too.
   The archive may be deleted afterwards.

4. Load it: ``load_cifar("cifar10", "train")`` (50,000 images) or ``"test"`` (10,000).

Why not ``tfds.builder("cifar10").download_and_prepare()``? tfds 4.9.10 does find the official
archive in ``downloads/manual/`` by itself (its registered checksums name the file), but its
CIFAR builder then extracts the archive and reads the batches through ``tf.io.gfile`` and encodes
the images with ``tf.image.encode_png``: preparing needs TensorFlow (``tensorflow-cpu``, several
hundred MB). Here the same builder is prepared with those TensorFlow-bound steps replaced by
Python's ``tarfile`` and pillow; reading through ``tfds.data_source`` needs no TensorFlow either.
A data set that tfds prepared elsewhere in array_record format
(``tfds build cifar10 --file_format=array_record``) can be copied to ``<data_dir>`` instead;
one in tfds's default tfrecord format is read through ``tfds.load`` only when TensorFlow is
installed.

The archive's format (https://www.cs.toronto.edu/~kriz/cifar.html): each record is 1 label byte
(CIFAR-10) or 2 label bytes, coarse then fine (CIFAR-100), followed by 3,072 bytes of pixels,
channel by channel (red, green, blue), each channel 32 rows of 32 values.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
import os
import pathlib
import tarfile
from typing import Any
from typing import NamedTuple

import numpy as np

from triaccel_jax.data._arrays import ArraySplit

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/"
_REQUIREMENTS = ("tensorflow-datasets", "array-record", "pillow", "importlib-resources")
_PIXELS = 3 * 32 * 32


class _Archive(NamedTuple):
    """The official binary archive of one data set and where its parts lie inside it."""

    title: str
    filename: str
    size: int  # bytes; with sha256, the checksum that tfds 4.9.10 registers for the file
    sha256: str
    prefix: str  # the folder inside the archive
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]
    label_keys: tuple[str, ...]  # the tfds feature of each label byte, in record order
    label_files: tuple[str, ...]  # the class names of each label key, one a line


_ARCHIVES = {
    "cifar10": _Archive(
        title="CIFAR-10",
        filename="cifar-10-binary.tar.gz",
        size=170_052_171,
        sha256="c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd",
        prefix="cifar-10-batches-bin/",
        train_files=tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
        test_files=("test_batch.bin",),
        label_keys=("label",),
        label_files=("batches.meta.txt",),
    ),
    "cifar100": _Archive(
        title="CIFAR-100",
        filename="cifar-100-binary.tar.gz",
        size=168_513_733,
        sha256="58a81ae192c23a4be8b1804d68e518ed807d710a4eb253b1f2a199162a40d8ec",
        prefix="cifar-100-binary/",
        train_files=("train.bin",),
        test_files=("test.bin",),
        label_keys=("coarse_label", "label"),
        label_files=("coarse_label_names.txt", "fine_label_names.txt"),
    ),
}


class CifarNotFoundError(FileNotFoundError):
    """Neither the prepared data set nor the official archive is in the data folder.

    The message says which file to put where and which command prepares it.
    """


def _check_name(name: str) -> _Archive:
    if name not in _ARCHIVES:
        raise ValueError(f"`name` must be one of {tuple(_ARCHIVES)}, got {name!r}")
    return _ARCHIVES[name]


def _data_dir(data_dir: str | os.PathLike | None) -> pathlib.Path:
    """``data_dir``, else ``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``, as tfds resolves it."""
    if data_dir is None:
        data_dir = os.environ.get("TFDS_DATA_DIR") or os.path.join("~", "tensorflow_datasets")
    return pathlib.Path(data_dir).expanduser()


def _manual_dir(data_dir: pathlib.Path) -> pathlib.Path:
    return data_dir / "downloads" / "manual"


def _missing_message(name: str, data_dir: pathlib.Path) -> str:
    archive = _ARCHIVES[name]
    data_dir_arg = "" if data_dir == _data_dir(None) else f", data_dir={str(data_dir)!r}"
    return (
        f"{archive.title} is not prepared in {data_dir / name} and its archive "
        f"{_manual_dir(data_dir) / archive.filename} is missing; nothing can be downloaded here. "
        f"Download {CIFAR_URL}{archive.filename} ({archive.size:,} bytes, the binary version) "
        f"on a machine with internet, copy it under that name into {_manual_dir(data_dir)}/ "
        f'(mkdir -p {_manual_dir(data_dir)}), then run: python -c "from triaccel_jax.data '
        f'import prepare_cifar; prepare_cifar({name!r}{data_dir_arg})" (load_cifar also '
        "prepares it by itself when the archive is there)"
    )


def _import_tfds(*extra: str):
    """tensorflow_datasets, after checking that the modules ``extra`` are importable too."""
    pip_names = {
        "tensorflow_datasets": "tensorflow-datasets",
        "array_record": "array-record",
        "PIL": "pillow",
        # tfds 4.9.10 imports it when it prepares a data set on any Python, but declares it
        # only for Python < 3.9 (https://github.com/tensorflow/datasets/issues/11212).
        "importlib_resources": "importlib-resources",
    }
    missing = [
        pip_names[module]
        for module in ("tensorflow_datasets", *extra)
        if importlib.util.find_spec(module) is None
    ]
    if missing:
        raise ImportError(
            f"CIFAR through tensorflow-datasets needs {', '.join(missing)} (TensorFlow is not "
            f"needed): pip install {' '.join(_REQUIREMENTS)}"
        )
    import tensorflow_datasets as tfds

    return tfds


def _verify_archive(path: pathlib.Path, archive: _Archive) -> None:
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    if size != archive.size or digest.hexdigest() != archive.sha256:
        raise ValueError(
            f"{path} is not the official {archive.filename}: it has {size:,} bytes and SHA-256 "
            f"{digest.hexdigest()}, the official one {archive.size:,} bytes and SHA-256 "
            f"{archive.sha256}. Download it again from {CIFAR_URL}{archive.filename} (the binary "
            "version, not cifar-*-python.tar.gz)"
        )


def _read_members(path: pathlib.Path, names: list[str]) -> dict[str, bytes]:
    """The named files of a tar archive, read with Python's tarfile."""
    found: dict[str, bytes] = {}
    with tarfile.open(path) as tar:
        for member in tar:
            if member.name in names and member.isfile():
                file = tar.extractfile(member)
                assert file is not None  # a regular file's member always has its data
                found[member.name] = file.read()
    missing = [name for name in names if name not in found]
    if missing:
        raise ValueError(
            f"{path} lacks {missing}: is it the binary version of the archive "
            "(cifar-*-binary.tar.gz)?"
        )
    return found


def _records(data: bytes, num_labels: int, source: str) -> np.ndarray:
    """The records of one batch file as ``(n, num_labels + 3072)`` uint8 rows."""
    width = num_labels + _PIXELS
    if len(data) % width:
        raise ValueError(f"{source} is truncated: {len(data)} bytes is not a multiple of {width}")
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, width)


@functools.cache
def _builder_class(name: str):
    """tfds's registered CIFAR builder, reading the local archive without TensorFlow.

    Same name, version and features as tfds's own, so the prepared folder is the one that
    ``tfds.data_source(name)`` reads; only the TensorFlow-bound steps (tf.io.gfile, tf.image
    PNG encoding) are replaced.
    """
    tfds = _import_tfds("array_record", "PIL", "importlib_resources")
    from PIL import Image

    # Any: tfds's builders are untyped to mypy, which cannot check a class built on them.
    base: Any = {
        "cifar10": tfds.image_classification.Cifar10,
        "cifar100": tfds.image_classification.Cifar100,
    }[name]
    archive = _ARCHIVES[name]

    def png(image: np.ndarray) -> bytes:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        return buffer.getvalue()

    # skip_registration is a keyword of tfds's registry's __init_subclass__, which mypy cannot see.
    class OfflineCifar(base, skip_registration=True):  # type: ignore[call-arg]
        archive_path: pathlib.Path  # set on each instance

        def _split_generators(self, dl_manager):
            del dl_manager  # nothing to download: the archive is local
            splits = {"train": archive.train_files, "test": archive.test_files}
            names = [archive.prefix + f for f in (*archive.label_files, *sum(splits.values(), ()))]
            files = _read_members(self.archive_path, names)
            for key, label_file in zip(archive.label_keys, archive.label_files, strict=True):
                text = files[archive.prefix + label_file].decode()
                self.info.features[key].names = [line for line in text.split("\n") if line]
            return {
                split: self._generate_examples(
                    f"{split}_", [(f, files[archive.prefix + f]) for f in batch_files]
                )
                for split, batch_files in splits.items()
            }

        def _generate_examples(self, split_prefix, batches):
            # Keys and ids as tfds's own builder makes them: the same shuffle, the same data set.
            index = 0
            num_labels = len(archive.label_keys)
            for source, data in batches:
                for row in _records(data, num_labels, source):
                    record = dict(zip(archive.label_keys, row[:num_labels].tolist(), strict=True))
                    record["id"] = f"{split_prefix}{index:05d}"
                    record["image"] = png(row[num_labels:].reshape(3, 32, 32).transpose(1, 2, 0))
                    yield index, record
                    index += 1

    OfflineCifar.name = name
    OfflineCifar.__name__ = OfflineCifar.__qualname__ = f"Offline{base.__name__}"
    return OfflineCifar


def prepare_cifar(name: str, *, data_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Prepares ``"cifar10"`` or ``"cifar100"`` from the official archive, offline.

    Reads ``<data_dir>/downloads/manual/cifar-10-binary.tar.gz`` (or ``cifar-100-binary.tar.gz``),
    checks its size and SHA-256, and writes the tfds data set ``<data_dir>/<name>/3.0.2/`` in
    array_record format. Does nothing when that data set is already prepared. The module
    docstring of ``triaccel_jax.data._tfds`` gives the steps.

    Args:
      name: ``"cifar10"`` or ``"cifar100"``.
      data_dir: tfds's data folder; default ``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``.

    Returns:
      The folder of the prepared data set.

    Raises:
      CifarNotFoundError: the archive is missing; the message says where to put which file.
      ValueError: the archive is not the official one (size, checksum or contents).

    Example:
      >>> prepare_cifar("cifar10")  # doctest: +SKIP
      PosixPath('/root/tensorflow_datasets/cifar10/3.0.2')
    """
    archive = _check_name(name)
    folder = _data_dir(data_dir)
    builder_class = _builder_class(name)
    builder = builder_class(data_dir=os.fspath(folder), file_format="array_record")
    if builder.is_prepared():
        return pathlib.Path(os.fspath(builder.data_path))
    path = _manual_dir(folder) / archive.filename
    if not path.is_file():
        raise CifarNotFoundError(_missing_message(name, folder))
    _verify_archive(path, archive)
    builder.archive_path = path
    builder.download_and_prepare()
    return pathlib.Path(os.fspath(builder.data_path))


def _to_split(ids, images, labels) -> ArraySplit:
    """Examples in the archive's order (by their tfds id) as an :class:`ArraySplit`."""
    order = np.argsort(np.asarray(ids))  # "train_00000", "train_00001", ...
    images = np.asarray(images, dtype=np.uint8)[order]
    if images.shape[1:] != (32, 32, 3):
        raise ValueError(f"expected 32x32x3 CIFAR images, got shape {images.shape[1:]}")
    return ArraySplit(
        images.astype(np.float32) / np.float32(255.0), np.asarray(labels, np.int32)[order]
    )


def load_cifar(
    name: str, split: str = "train", *, data_dir: str | os.PathLike | None = None
) -> ArraySplit:
    """CIFAR-10 or CIFAR-100 ``"train"`` (50,000) or ``"test"`` (10,000) images, 32x32x3.

    Reads the tfds data set through ``tfds.data_source`` (no TensorFlow needed), preparing it
    first from the official archive in ``<data_dir>/downloads/manual/`` when it is not prepared
    yet (see :func:`prepare_cifar`). The images come in the archive's order, as float32 in
    [0, 1]; the labels are int32, for CIFAR-100 the fine label (100 classes).

    Args:
      name: ``"cifar10"`` or ``"cifar100"``.
      split: ``"train"`` or ``"test"``.
      data_dir: tfds's data folder; default ``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``.

    Returns:
      The :class:`ArraySplit`.

    Raises:
      CifarNotFoundError: neither the data set nor the archive is there; the message says
        which file to put where and which command prepares it.
      ImportError: tensorflow-datasets, array-record or pillow is missing.

    Example:
      >>> from triaccel_jax.data import load_cifar
      >>> test = load_cifar("cifar10", "test")  # doctest: +SKIP
      >>> test.images.shape, test.images.dtype, test.labels.shape  # doctest: +SKIP
      ((10000, 32, 32, 3), dtype('float32'), (10000,))
    """
    _check_name(name)
    if split not in ("train", "test"):
        raise ValueError(f"`split` must be 'train' or 'test', got {split!r}")
    tfds = _import_tfds()
    folder = _data_dir(data_dir)
    builder = tfds.builder(name, data_dir=os.fspath(folder))
    if not builder.is_prepared():
        prepare_cifar(name, data_dir=folder)
        builder = tfds.builder(name, data_dir=os.fspath(folder))
    array_record = tfds.core.file_adapters.FileFormat.ARRAY_RECORD
    if array_record in builder.info.available_file_formats():
        _import_tfds("array_record", "PIL")
        source = builder.as_data_source(split=split, file_format=array_record)
        examples = source.__getitems__(list(range(len(source))))
        return _to_split(
            [example["id"] for example in examples],
            np.stack([example["image"] for example in examples]),
            [example["label"] for example in examples],
        )
    if importlib.util.find_spec("tensorflow") is not None:
        arrays = tfds.as_numpy(builder.as_dataset(split=split, batch_size=-1))
        return _to_split(arrays["id"], arrays["image"], arrays["label"])
    raise RuntimeError(
        f"{builder.data_dir} holds {name} in tfds's {builder.info.file_format} format, which only "
        "TensorFlow reads. Either pip install tensorflow-cpu, or move that folder away and call "
        f"prepare_cifar({name!r}) with {_ARCHIVES[name].filename} in {_manual_dir(folder)}/: "
        "it writes array_record, which tfds.data_source reads without TensorFlow"
    )
