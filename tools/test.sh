#!/usr/bin/env bash
# Runs the test suite: bash tools/test.sh [PYTEST ARGS...]   (e.g. -m "not slow", -k adam, -n 0)
# Creates/updates .venv (project editable with the `test` extra), then pytest on 2 workers.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
ensure_venv test
cd "$REPO_ROOT"
exec "$VENV_PY" -m pytest -n 2 "$@"
