# shellcheck shell=bash
# Shared setup for tools/*.sh: source it, then call `ensure_venv EXTRAS`.
#
#   ensure_venv test    -> .venv exists and holds `pip install -e ".[test]"`
#
# It creates .venv in the repository root when it is missing or broken (Python 3.12 preferred,
# any Python >= 3.11 accepted), upgrades pip, and installs the project editable with EXTRAS.
# The install is skipped when pyproject.toml and EXTRAS are unchanged since the last one
# (set TRIACCEL_REINSTALL=1 to force it). After it, $VENV_PY is the venv's python.
# TRIACCEL_PYTHON=/path/to/python picks the interpreter for a new .venv (e.g. python3.11).

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="$REPO_ROOT/.venv"
VENV_PY="$VENV_DIR/bin/python"

_log() { printf '[triaccel] %s\n' "$*" >&2; }
_die() { printf '[triaccel] error: %s\n' "$*" >&2; exit 1; }

# True when "$@" runs a Python >= 3.11 that has the venv module.
_py_ok() {
    "$@" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1
}

# Sets PY_CMD (an array) to the interpreter to build .venv with.
_find_python() {
    PY_CMD=()
    if [[ -n "${TRIACCEL_PYTHON:-}" ]]; then
        _py_ok "$TRIACCEL_PYTHON" || _die "TRIACCEL_PYTHON=$TRIACCEL_PYTHON is not a Python >= 3.11 with venv"
        PY_CMD=("$TRIACCEL_PYTHON")
        return 0
    fi
    if _py_ok python3.12; then
        PY_CMD=(python3.12)
        return 0
    fi
    # pyenv: the python3.12 shim only works with PYENV_VERSION set to an installed 3.12.x.
    if command -v pyenv >/dev/null 2>&1; then
        local v
        v="$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -n 1 || true)"
        if [[ -n "$v" ]] && _py_ok env PYENV_VERSION="$v" python3.12; then
            PY_CMD=(env PYENV_VERSION="$v" python3.12)
            return 0
        fi
    fi
    local c
    for c in python3 python3.13 python3.11; do
        if _py_ok "$c"; then
            PY_CMD=("$c")
            return 0
        fi
    done
    return 1
}

_venv_ok() {
    [[ -x "$VENV_PY" ]] && _py_ok "$VENV_PY"
}

ensure_venv() {
    local extras="${1:?ensure_venv needs the extras to install, e.g. test}"

    if ! _venv_ok; then
        if [[ -e "$VENV_DIR" ]]; then
            _log "$VENV_DIR is broken or too old; recreating it"
            rm -rf "$VENV_DIR"
        fi
        _find_python || _die "no Python >= 3.11 with the venv module found (tried python3.12, pyenv's 3.12.x, python3, python3.13, python3.11). Install Python 3.12 (or 3.11) and retry."
        _log "creating .venv with $("${PY_CMD[@]}" -c 'import sys; print("Python", sys.version.split()[0])')"
        "${PY_CMD[@]}" -m venv "$VENV_DIR" || _die "could not create $VENV_DIR"
        "$VENV_PY" -m pip install -qq --upgrade pip || _die "could not upgrade pip in $VENV_DIR"
    fi

    # Reinstall only when what decides the install changed (a no-op `pip install -e` still takes 5-10 s).
    local stamp="$VENV_DIR/.triaccel-install-$extras" want
    want="$("$VENV_PY" - "$REPO_ROOT/pyproject.toml" "$extras" <<'EOF'
import hashlib, sys
h = hashlib.sha256(open(sys.argv[1], "rb").read())
h.update(sys.argv[2].encode())
h.update(sys.argv[1].encode())  # a moved checkout needs a new editable install
h.update(sys.version.encode())
print(h.hexdigest())
EOF
)"
    if [[ "${TRIACCEL_REINSTALL:-0}" != "1" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]] \
        && "$VENV_PY" -c 'import importlib.metadata as m; m.version("triaccel-jax")' >/dev/null 2>&1; then
        return 0
    fi
    _log "installing the project into .venv (editable, extras: $extras)"
    rm -f "$stamp"
    "$VENV_PY" -m pip install -qq --upgrade pip || _die "could not upgrade pip in $VENV_DIR"
    # editable_mode=lenient (setuptools' default, named here on purpose) is the only mode that maps
    # kernels/ to triaccel_jax.kernels both from the repo root and from elsewhere: `compat` drops
    # the mapping and exposes a top-level `kernels`; `strict` fails from the repo root.
    "$VENV_PY" -m pip install -qq -e "$REPO_ROOT[$extras]" --config-settings editable_mode=lenient \
        || _die "pip install -e .[$extras] failed"
    printf '%s\n' "$want" >"$stamp"
}
