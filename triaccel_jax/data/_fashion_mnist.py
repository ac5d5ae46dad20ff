"""Where Fashion-MNIST's IDX files are found, and an explicit, checksummed download of them.

Search order (first folder holding the split's two files wins; each data folder ``D`` is looked
at as ``D`` and ``D/fashion-mnist``):

1. the ``directory`` argument (the main job's ``--data-dir``);
2. ``$TRIACCEL_DATA_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/triaccel_jax/data`` (where
   :func:`download_fashion_mnist` writes by default);
3. Debian's ``/usr/share/datasets/fashion-mnist`` (``apt-get install dataset-fashion-mnist``).

Nothing is downloaded unless :func:`download_fashion_mnist` is called (the main job calls it,
announced, where the data is found nowhere, unless given ``--offline``).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import logging
import os
import pathlib
import urllib.error
import urllib.request
from collections.abc import Sequence

DATA_DIR_ENV = "TRIACCEL_DATA_DIR"
FASHION_MNIST_DIR = pathlib.Path("/usr/share/datasets/fashion-mnist")  # Debian's package
SUBFOLDER = "fashion-mnist"

# The official source (https://github.com/zalandoresearch/fashion-mnist, MIT licence) and its
# S3 mirror, which serves the same files (over http only: S3 website endpoints have no TLS; the
# checksums below are what protects the data, on either).
FASHION_MNIST_URLS = (
    "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
)
# file: (MD5 of the .gz as the official repository publishes it, MD5 of its decompressed IDX
# contents, size of the official .gz in bytes). Debian's package recompresses the files (without
# the original name in the gzip header, so the .gz MD5 differs) but its IDX contents have these
# MD5s: a file is accepted when either MD5 matches.
FASHION_MNIST_FILES = {
    "train-images-idx3-ubyte.gz": (
        "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "f4a8712d7a061bf5bd6d2ca38dc4d50a",
        26_421_880,
    ),
    "train-labels-idx1-ubyte.gz": (
        "25c81989df183df01b3e8a0aad5dffbe",
        "9018921c3c673c538a1fc5bad174d6f9",
        29_515,
    ),
    "t10k-images-idx3-ubyte.gz": (
        "bef4ecab320f06d8554ea6380940ec79",
        "8181f5470baa50b63fa0f6fddb340f0a",
        4_422_102,
    ),
    "t10k-labels-idx1-ubyte.gz": (
        "bb300cfdad3c16e7a12a480ee83cd310",
        "15d484375f8d13e6eb1aabb0c3f46965",
        5_148,
    ),
}
_CHUNK = 1 << 20

logger = logging.getLogger(__name__)


def split_files(split: str | None) -> tuple[str, ...]:
    """The IDX file names of ``"train"``, ``"test"``, or of both (``None``)."""
    if split is None:
        return tuple(FASHION_MNIST_FILES)
    if split not in ("train", "test"):
        raise ValueError(f"`split` must be 'train' or 'test', got {split!r}")
    prefix = "train" if split == "train" else "t10k"
    return (f"{prefix}-images-idx3-ubyte.gz", f"{prefix}-labels-idx1-ubyte.gz")


def default_data_dir() -> pathlib.Path:
    """The data folder when none is given: ``$TRIACCEL_DATA_DIR``, else a per-user cache folder.

    Returns:
      ``$TRIACCEL_DATA_DIR`` when set and not empty, else
      ``${XDG_CACHE_HOME:-~/.cache}/triaccel_jax/data`` (which need not exist).

    Example:
      >>> import os
      >>> from unittest import mock
      >>> from triaccel_jax.data import default_data_dir
      >>> with mock.patch.dict(os.environ, {"TRIACCEL_DATA_DIR": "/srv/data"}):
      ...     default_data_dir()
      PosixPath('/srv/data')
    """
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return pathlib.Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return pathlib.Path(cache).expanduser() / "triaccel_jax" / "data"


def search_path(directory: str | os.PathLike | None = None) -> list[pathlib.Path]:
    """The folders searched for Fashion-MNIST's IDX files, in order (see the module docstring)."""
    roots = [] if directory is None else [pathlib.Path(directory).expanduser()]
    roots.append(default_data_dir())
    folders = []
    for root in roots:
        folders += [root, root / SUBFOLDER]
    folders.append(FASHION_MNIST_DIR)
    return list(dict.fromkeys(folders))  # without repeats, in order


def find_fashion_mnist(
    directory: str | os.PathLike | None = None, split: str | None = None
) -> pathlib.Path | None:
    """The first folder of the search path that holds Fashion-MNIST's IDX files, or None.

    Args:
      directory: a data folder searched first (the files in it, or in its ``fashion-mnist/``).
      split: ``"train"`` or ``"test"`` to need only that split's two files; ``None``: all four.

    Returns:
      The folder, or None when no folder of the search path holds the files.

    Example:
      >>> from triaccel_jax.data import find_fashion_mnist
      >>> folder = find_fashion_mnist()  # Debian's folder, where the package is installed
      >>> folder is None or (folder / "t10k-labels-idx1-ubyte.gz").exists()
      True
    """
    names = split_files(split)
    for folder in search_path(directory):
        if all((folder / name).is_file() for name in names):
            return folder
    return None


def fashion_mnist_not_found_message(
    directory: str | os.PathLike | None = None, split: str | None = None
) -> str:
    """Says where Fashion-MNIST was looked for and every way to get it.

    Args:
      directory: the data folder searched first, as for :func:`find_fashion_mnist`.
      split: ``"train"``, ``"test"`` or ``None`` (all four files), for the files it names.

    Returns:
      The message :func:`load_fashion_mnist` raises when the files are missing.

    Example:
      >>> from triaccel_jax.data import fashion_mnist_not_found_message
      >>> "apt-get install -y dataset-fashion-mnist" in fashion_mnist_not_found_message()
      True
    """
    searched = ", ".join(str(folder) for folder in search_path(directory))
    files = ", ".join(split_files(split))
    return (
        f"Fashion-MNIST ({files}) not found; searched {searched}. Any one of these provides it:\n"
        "  1. Debian/Ubuntu, as root: apt-get update && apt-get install -y dataset-fashion-mnist "
        f"(installs {FASHION_MNIST_DIR}; the main job does it when run as root, and "
        "tools/test.sh with TRIACCEL_INSTALL_SYSTEM_DATA=1);\n"
        "  2. put the four *-ubyte.gz files in a folder and point to it: "
        f"{DATA_DIR_ENV}=/that/folder, or the main job's --data-dir /that/folder, or "
        "load_fashion_mnist(split, directory=...);\n"
        "  3. download them from the official source, checksums verified (the main job does so "
        "where it finds them nowhere, into --data-dir, else $TRIACCEL_DATA_DIR, else "
        '~/.cache/triaccel_jax/data), or python -c "from triaccel_jax.data import '
        'download_fashion_mnist; download_fashion_mnist()";\n'
        "  4. the main job without it: --dataset digits (scikit-learn's digits, bundled; "
        "--dataset auto falls back to them by itself)."
    )


def _md5():
    return hashlib.md5(usedforsecurity=False)  # identifies the published files; not a secret


def verify(path: pathlib.Path, name: str | None = None) -> str | None:
    """None when ``path`` is the official file ``name`` (default its own name), else what is
    wrong with it."""
    expected_gz, expected_idx, _ = FASHION_MNIST_FILES[name or path.name]
    digest = _md5()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(_CHUNK), b""):
            digest.update(chunk)
    got_gz = digest.hexdigest()
    if got_gz == expected_gz:
        return None
    # Recompressed (as Debian's package is): the IDX contents decide.
    digest = _md5()
    try:
        with gzip.open(path, "rb") as stream:
            for chunk in iter(lambda: stream.read(_CHUNK), b""):
                digest.update(chunk)
    except (OSError, EOFError) as error:
        return f"not a gzip file ({error})"
    if digest.hexdigest() == expected_idx:
        return None
    return (
        f"MD5 mismatch: {got_gz} (.gz) and {digest.hexdigest()} (contents), expected "
        f"{expected_gz} (.gz, as published) or {expected_idx} (contents)"
    )


def _fetch(url: str, target: pathlib.Path, limit: int, timeout: float) -> None:
    """Writes ``url`` to ``target``, failing past ``limit`` bytes (a wrong or endless reply)."""
    size = 0
    with (
        contextlib.closing(urllib.request.urlopen(url, timeout=timeout)) as reply,
        target.open("wb") as out,
    ):
        for chunk in iter(lambda: reply.read(_CHUNK), b""):
            size += len(chunk)
            if size > limit:
                raise ValueError(f"more than {limit:,} bytes: not the official file")
            out.write(chunk)


def download_fashion_mnist(
    data_dir: str | os.PathLike | None = None,
    *,
    urls: Sequence[str] = FASHION_MNIST_URLS,
    timeout: float = 60.0,
) -> pathlib.Path:
    """Downloads Fashion-MNIST's four IDX files from the official source, checksums verified.

    Files already there and verified are kept. Each file is written to a temporary name, its MD5
    checked against the official one, and only then renamed; a corrupt or failed download is
    deleted, logged as a warning, and the next URL tried.

    Args:
      data_dir: the data folder; the files go in its ``fashion-mnist/``. Default
        :func:`default_data_dir` (``$TRIACCEL_DATA_DIR``, else ``~/.cache/triaccel_jax/data``),
        which :func:`load_fashion_mnist` searches.
      urls: base URLs tried in order, each followed by the file name; default the official
        GitHub repository, then its S3 mirror.
      timeout: seconds to wait for each connection.

    Returns:
      The folder holding the four files.

    Raises:
      OSError: a file could not be downloaded intact from any URL; the message says what went
        wrong with each (no partial or corrupt file is left behind).

    Example:
      >>> from triaccel_jax.data import download_fashion_mnist, load_fashion_mnist
      >>> folder = download_fashion_mnist("/tmp/data")  # doctest: +SKIP
      >>> load_fashion_mnist("test", "/tmp/data").images.shape  # doctest: +SKIP
      (10000, 28, 28, 1)
    """
    if not urls:
        raise ValueError("`urls` is empty: give at least one base URL")
    folder = (pathlib.Path(data_dir).expanduser() if data_dir else default_data_dir()) / SUBFOLDER
    folder.mkdir(parents=True, exist_ok=True)
    for name, (_, _, size) in FASHION_MNIST_FILES.items():
        target = folder / name
        if target.is_file():
            problem = verify(target)
            if problem is None:
                continue
            logger.warning(
                "%s is not the official file (%s); downloading it again", target, problem
            )
        failures = [f"{target}: not the official file, left as it was"] if target.is_file() else []
        for base in urls:
            url = base if base.endswith("/") else base + "/"
            url += name
            part = target.with_name(f".{name}.part")
            logger.info("downloading %s to %s", url, target)
            try:
                _fetch(url, part, limit=size + size // 8 + 65_536, timeout=timeout)
                problem = verify(part, name)
            except (OSError, ValueError, urllib.error.URLError) as error:
                problem = f"download failed: {error}"
            if problem is None:
                os.replace(part, target)
                break
            part.unlink(missing_ok=True)
            logger.warning("%s: %s; nothing of it was kept", url, problem)
            failures.append(f"{url}: {problem}")
        else:
            raise OSError(
                f"could not download {name} intact into {folder} (no download was kept):\n  "
                + "\n  ".join(failures)
            )
    return folder
