"""``python -m triaccel_jax``: the main job (see ``triaccel_jax.cli._main_job``)."""

import sys

from triaccel_jax.cli._main_job import main

if __name__ == "__main__":
    sys.exit(main())
