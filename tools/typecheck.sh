#!/usr/bin/env bash
# Type-checks the package with mypy (configured in pyproject.toml), as CI does, in one run over
# triaccel_jax/ and the top-level kernels/ folder laid out as they install: kernels/ is
# triaccel_jax.kernels (pyproject.toml's package-dir). mypy has no package-dir mapping, so it reads
# a temporary tree of links: triaccel_jax/<each entry> plus triaccel_jax/kernels -> kernels/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo="$PWD"
mypy="$repo/.venv/bin/mypy"
[[ -x "$mypy" ]] || .venv/bin/python -m pip install -q mypy
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/triaccel_jax"
for entry in triaccel_jax/*; do
    [[ "$(basename "$entry")" == "kernels" ]] && { echo "triaccel_jax/kernels must not exist: the kernels live in kernels/" >&2; exit 1; }
    ln -s "$repo/$entry" "$tree/triaccel_jax/"
done
ln -s "$repo/kernels" "$tree/triaccel_jax/kernels"
echo "mypy: triaccel_jax/ and kernels/ (as triaccel_jax.kernels)"
cd "$tree"
"$mypy" --config-file "$repo/pyproject.toml" --cache-dir "$repo/.mypy_cache" -p triaccel_jax
