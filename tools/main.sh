#!/usr/bin/env bash
# Runs the main job: bash tools/main.sh [ARGS...]
# Creates/updates .venv (project editable with the `demo` extra: Flax, scikit-learn, tqdm,
# matplotlib), then `python -m triaccel_jax ARGS`. Fashion-MNIST is used where it is found
# (--data-dir, $TRIACCEL_DATA_DIR, Debian's package); `--download` fetches it (checksums
# verified); TRIACCEL_INSTALL_SYSTEM_DATA=1, as root, installs Debian's package with apt-get
# first (announced). Nothing is downloaded or installed otherwise.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
ensure_venv demo
# When the arguments pick the data themselves, the job's own messages say what it found.
data_note=""
for arg in "$@"; do
    case "$arg" in
        --data-dir | --data-dir=* | --download | --dataset | --dataset=*) data_note=quiet ;;
    esac
done
ensure_fashion_mnist "$data_note"
cd "$REPO_ROOT"
exec "$VENV_PY" -m triaccel_jax "$@"
