#!/usr/bin/env bash
# Builds the documentation site: bash tools/docs.sh [SPHINX ARGS...]
#
# 1. .venv holds the project with the `test` extra (as `bash tools/test.sh` makes it; created here
#    when missing) and the documentation tools below, pinned (the `docs` extra lists the same).
# 2. sphinx-build -W --keep-going -E: every warning is an error, and every page is read afresh so
#    that no warning hides in an incremental build. Output: docs/_build/html (git-ignored).
#
# myst-nb executes the three notebooks and the pages with code cells (getting started, the GPU and
# multi-device guide on 8 simulated CPU devices) on the CPU, offline; a cell that raises fails the
# build. Executed results are cached in docs/_build/.jupyter_cache keyed by the cells' code, so a
# second local build re-runs only what changed; with CI=true (or TRIACCEL_DOCS_EXECUTE=force) every
# page is executed again. Extra arguments go to sphinx-build (e.g. -q).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$REPO_ROOT"

# Keep in step with the `docs` extra in pyproject.toml.
DOCS_REQUIREMENTS=(
    "sphinx==9.1.1"
    "myst-parser==5.2.0"
    "myst-nb==1.4.0"
    "sphinx-book-theme==1.4.0"
    "ipykernel"
    "jupyter-cache"
)

ensure_venv test
if ! "$VENV_PY" - "${DOCS_REQUIREMENTS[@]}" <<'EOF' >/dev/null 2>&1
import importlib.metadata as m, sys
for req in sys.argv[1:]:
    name, _, want = req.partition("==")
    have = m.version(name)
    if want and have != want:
        sys.exit(1)
EOF
then
    _log "installing the documentation tools into $(basename "$VENV_DIR"): ${DOCS_REQUIREMENTS[*]}"
    "$VENV_PY" -m pip install -qq "${DOCS_REQUIREMENTS[@]}" || _die "could not install ${DOCS_REQUIREMENTS[*]}"
fi

if [[ "${CI:-}" == "true" ]]; then
    export TRIACCEL_DOCS_EXECUTE="${TRIACCEL_DOCS_EXECUTE:-force}"
fi
export TRIACCEL_DOCS_EXECUTE="${TRIACCEL_DOCS_EXECUTE:-cache}"
# The pages are executed on the CPU; the multi-device page asks for 8 host devices itself.
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"

_log "building the documentation (notebooks: $TRIACCEL_DOCS_EXECUTE) into docs/_build/html"
start=$SECONDS
"$VENV_PY" -m sphinx -W --keep-going -E -b html -d docs/_build/doctrees docs docs/_build/html "$@"
_log "documentation built in $((SECONDS - start)) s: docs/_build/html/index.html"
