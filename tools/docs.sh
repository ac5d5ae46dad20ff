#!/usr/bin/env bash
# Builds the documentation site: bash tools/docs.sh [SPHINX ARGS...]
#
# 1. .venv holds the project with the `docs` extra (pyproject.toml): the pinned Sphinx tools and
#    what the executed pages import (Flax, orbax, matplotlib, scikit-learn). It is created when
#    missing; a .venv made by `bash tools/test.sh` keeps its test extra (pip only adds packages).
# 2. sphinx-build -W --keep-going -E: every warning is an error, and every page is read afresh so
#    that no warning hides in an incremental build. Output: docs/_build/html (git-ignored).
# 3. tools/check_docs_site.py checks the built site: every internal link and anchor resolves, no
#    page loads a script, stylesheet or font from another host, no page shows this machine's
#    paths, and, where Fashion-MNIST is installed, the notebooks ran on it.
#
# myst-nb executes the three notebooks and the pages with code cells (getting started, the guide,
# logging, the GPU and multi-device guide on 8 simulated CPU devices) on the CPU, offline; a cell
# that raises fails the build. Executed results are cached in docs/_build/.jupyter_cache keyed by
# the cells' code, so a second local build re-runs only what changed; with CI=true (or
# TRIACCEL_DOCS_EXECUTE=force) every page is executed again. With TRIACCEL_EXECUTED_NOTEBOOKS=FOLDER
# (as .ci/run sets it, after the tests wrote the notebooks they executed and checked there) the
# notebooks are rendered with those outputs instead of being executed a second time; the pages with
# code cells still are. Extra arguments go to sphinx-build (e.g. -q).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$REPO_ROOT"

ensure_venv docs
# The notebooks use Fashion-MNIST where it is installed and say so; without it they fall back to
# scikit-learn's digits. This reports how to get it (and installs it only where asked to).
ensure_fashion_mnist

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

check_args=(--forbid "$REPO_ROOT/" --forbid "/site-packages/")
if "$VENV_PY" -c 'import sys, triaccel_jax.data as d; sys.exit(d.find_fashion_mnist() is None)'; then
    check_args+=(--expect-fashion-mnist)
fi
"$VENV_PY" tools/check_docs_site.py docs/_build/html "${check_args[@]}" \
    || _die "the built site failed its checks (above)"
