#!/usr/bin/env bash
# Runs the main job: bash tools/main.sh [ARGS...]
# Creates/updates .venv (project editable with the `demo` extra), then `python -m triaccel_jax ARGS`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
ensure_venv demo
ensure_fashion_mnist
cd "$REPO_ROOT"
exec "$VENV_PY" -m triaccel_jax "$@"
