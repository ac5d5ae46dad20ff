"""Kernel tests: the Triton kernels run under Triton's interpreter on CPU.

``TRITON_INTERPRET=1`` must be set before a ``@triton.jit`` function is defined, so it is set here,
before any test module imports a kernel module (``tools/test.sh`` sets it too). Tests that need
torch and triton skip, with the reason, where they are not installed (the main ``.venv``); the
``kernels-dev`` extra in ``.venv-kernels`` has them. The sm_90 compile test runs in a subprocess
without the interpreter flag.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
