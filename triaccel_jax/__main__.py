"""``python -m triaccel_jax``: the demo run (see ``triaccel_jax._src.demo``)."""

import sys

from triaccel_jax._src.demo import main

if __name__ == "__main__":
    sys.exit(main())
