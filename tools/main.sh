#!/usr/bin/env bash
# Runs the main job: bash tools/main.sh [ARGS...]
# Creates/updates .venv (project editable with the `demo` extra: Flax, scikit-learn, tqdm,
# matplotlib), then `python -m triaccel_jax ARGS`. The job finds its data itself and says what it
# does at each step: Fashion-MNIST where it is found (--data-dir, $TRIACCEL_DATA_DIR, Debian's
# /usr/share/datasets/fashion-mnist), else the official download (MD5s verified), else, as root,
# Debian's dataset-fashion-mnist package (announced before apt-get runs), else the embedded
# digits workload. --offline tries neither the download nor the package.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
ensure_venv demo
cd "$REPO_ROOT"
exec "$VENV_PY" -m triaccel_jax "$@"
