#!/usr/bin/env bash
# Type-checks the package with mypy (configured in pyproject.toml), as CI does:
#   1. triaccel_jax/ and kernels/ as they lie in the checkout;
#   2. triaccel_jax/ with kernels/ under its installed name, triaccel_jax.kernels (setuptools maps
#      the folder at install time, which mypy cannot follow), so that calls into the kernels are
#      checked too. kernels/ is not named in the second run: mypy would see each module twice.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mypy=".venv/bin/mypy"
[[ -x "$mypy" ]] || .venv/bin/python -m pip install -q mypy
echo "mypy: triaccel_jax/ and kernels/"
"$mypy"
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
mkdir "$root/triaccel_jax"
ln -s "$PWD/kernels" "$root/triaccel_jax/kernels"
echo "mypy: triaccel_jax/ with kernels/ as triaccel_jax.kernels"
MYPYPATH="$root" "$mypy" triaccel_jax
