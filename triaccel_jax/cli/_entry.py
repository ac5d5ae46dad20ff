"""The console script's entry point: the main job, once its extra is known to be installed."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from triaccel_jax._src import extras


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the main job; returns the exit status (2, with one message, without its extra).

    Args:
      argv: the command-line arguments (default ``sys.argv[1:]``); ``--help`` lists them.

    Returns:
      The exit status: 0 on success, 2 when the data or the ``demo`` extra is missing.

    Example::

      $ python -m triaccel_jax --runs triaccel --epochs 1
    """
    try:
        extras.require("demo", "the main job (triaccel, python -m triaccel_jax)")
    except ModuleNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from triaccel_jax.cli._main_job import main as run

    return run(argv)
