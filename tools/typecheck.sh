#!/usr/bin/env bash
# Type-checks the package with mypy (configured in pyproject.toml), as CI does: triaccel_jax/,
# kernels (triaccel_jax/kernels/) included, laid out in the checkout as it is installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mypy=".venv/bin/mypy"
[[ -x "$mypy" ]] || .venv/bin/python -m pip install -q mypy
echo "mypy: triaccel_jax/"
"$mypy"
