"""Where the main job's data comes from: found, downloaded, installed, or the embedded workload.

The first command a new user runs must show the three adaptations at work on any machine, so
``--dataset auto`` (the default) tries, in order, and says what it is doing at each step:

1. Fashion-MNIST where it is found (``--data-dir``, ``$TRIACCEL_DATA_DIR``, Debian's folder:
   :func:`triaccel_jax.data.find_fashion_mnist`);
2. the official download, checksums verified (:func:`triaccel_jax.data.download_fashion_mnist`);
3. Debian's package ``dataset-fashion-mnist``, where this process is root and has ``apt-get``
   (announced before it runs);
4. the embedded workload: scikit-learn's digits, with settings long enough that the batch grows
   and precision is re-planned (:data:`triaccel_jax.cli._arguments.WORKLOADS`); the table then
   says what such small data can and cannot show.

``--offline`` skips steps 2 and 3. ``--dataset fashion_mnist`` runs steps 1-3 and fails, naming
every way to get the data, where none works; the other data sets are taken as asked.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Callable

APT_COMMANDS = (
    ("apt-get", "update", "-qq"),
    ("apt-get", "install", "-y", "-qq", "dataset-fashion-mnist"),
)


@dataclasses.dataclass(frozen=True)
class Source:
    """The data set the job will load, and how it came to be that one.

    Attributes:
      dataset: ``"fashion_mnist"``, ``"digits"``, ``"cifar10"`` or ``"cifar100"``.
      how: one sentence for the job's header and its table's notes.
      stand_in: True when the embedded digits stand in for Fashion-MNIST, which was not had.
    """

    dataset: str
    how: str
    stand_in: bool = False


def debian_install_blocker() -> str | None:
    """Why Debian's package cannot be installed by this process, or None when it can."""
    if shutil.which("apt-get") is None:
        return "no apt-get on this machine"
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not running as root (as root: apt-get install dataset-fashion-mnist)"
    return None


def install_debian_package(announce: Callable[[str], None]) -> str | None:
    """Runs ``apt-get update`` and ``apt-get install dataset-fashion-mnist``; None when it worked,
    else what went wrong."""
    for command in APT_COMMANDS:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        except OSError as error:
            return f"{' '.join(command)} could not run: {error}"
        if done.returncode != 0:
            last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
            return f"{' '.join(command)} exited with {done.returncode}: {last[0]}"
    announce("installed Debian's dataset-fashion-mnist")
    return None


def resolve(
    name: str,
    *,
    data_dir: str | None,
    offline: bool,
    announce: Callable[[str], None] = print,
) -> Source:
    """The data set to train on, fetched or installed first where ``name`` asks for it.

    Args:
      name: the ``--dataset`` choice.
      data_dir: ``--data-dir``.
      offline: ``--offline``: neither download nor install.
      announce: prints one line (each step is announced before it runs).

    Returns:
      The :class:`Source`.

    Raises:
      FileNotFoundError: ``name`` is ``"fashion_mnist"`` and no step could provide it; the
        message names every way to get it.
    """
    from triaccel_jax import data as data_lib

    if name not in ("auto", "fashion_mnist"):
        what = {"digits": "scikit-learn's digits (embedded), as asked"}.get(
            name, f"{name}, as asked"
        )
        return Source(name, what)
    folder = data_lib.find_fashion_mnist(data_dir)
    if folder is not None:
        return Source("fashion_mnist", f"Fashion-MNIST, found in {folder}")
    failures = []
    if offline:
        failures.append("--offline: no download or install tried")
    else:
        target = data_lib.default_data_dir() if data_dir is None else data_dir
        announce(
            "Fashion-MNIST not found; downloading it from the official source (30 MB, MD5s "
            f"verified) into {target}/fashion-mnist (--offline skips this)"
        )
        try:
            folder = data_lib.download_fashion_mnist(data_dir, timeout=30.0)
        except OSError as error:
            # The last source's failure stands for all (each is logged as a warning).
            reason = str(error).splitlines()[-1].strip().replace(": download failed: ", ": ")
            announce(f"the download failed: {reason}")
            failures.append(f"the download failed ({reason})")
        else:
            return Source("fashion_mnist", f"Fashion-MNIST, downloaded into {folder}")
        blocker = debian_install_blocker()
        if blocker is None:
            announce(
                "installing Debian's package dataset-fashion-mnist (Fashion-MNIST's files, into "
                "/usr/share/datasets/fashion-mnist); running, as root: "
                + " && ".join(" ".join(c) for c in APT_COMMANDS)
            )
            problem = install_debian_package(announce)
            folder = data_lib.find_fashion_mnist(data_dir) if problem is None else None
            if folder is not None:
                return Source("fashion_mnist", f"Fashion-MNIST, from Debian's package in {folder}")
            problem = problem or "the package installed no files where they are looked for"
            announce(f"Debian's package could not be installed: {problem}")
            failures.append(f"Debian's package could not be installed ({problem})")
        else:
            failures.append(f"Debian's package was not installed ({blocker})")
    if name == "fashion_mnist":
        raise FileNotFoundError(
            "; ".join(failures) + ".\n" + data_lib.fashion_mnist_not_found_message(data_dir)
        )
    why = "; ".join(failures)
    announce(f"using the embedded workload (scikit-learn's digits) instead: {why}")
    return Source(
        "digits",
        f"scikit-learn's digits, embedded, standing in for Fashion-MNIST, which was not found "
        f"({why})",
        stand_in=True,
    )
