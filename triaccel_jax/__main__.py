"""``python -m triaccel_jax``: the main job (see :mod:`triaccel_jax.cli`)."""

import sys

from triaccel_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
