# shellcheck shell=bash
# Shared setup for tools/*.sh: source it, then call `ensure_venv EXTRAS`.
#
#   ensure_venv test      -> .venv exists and holds `pip install -e ".[test]"` (the test extra
#                            includes the optional flax, checkpoint and tensorboard extras' packages: the
#                            suite tests those features; a plain `pip install -e .` lacks them)
#   ensure_kernels_venv   -> .venv-kernels holds `pip install -e ".[kernels-dev,test]"` in the first
#                            interpreter that can install it; $VENV_PY then points at it (or: returns 1)
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

# When set (e.g. "3.11"), the venv's Python must have exactly this minor version.
_PY_EXACT=""

# True when "$@" runs a Python >= 3.11 (exactly $_PY_EXACT when set) that has the venv module.
_py_ok() {
    "$@" -c 'import sys, venv, ensurepip
v = "%d.%d" % sys.version_info[:2]
sys.exit(sys.version_info < (3, 11) or sys.argv[1] not in ("", v))' "$_PY_EXACT" >/dev/null 2>&1
}

# Sets PY_CMD (an array) to the interpreter to build the venv with.
_find_python() {
    PY_CMD=()
    if [[ -n "$_PY_EXACT" ]]; then
        local c
        for c in "python$_PY_EXACT" python3; do
            if _py_ok "$c"; then
                PY_CMD=("$c")
                return 0
            fi
        done
        return 1
    fi
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
        if [[ -n "$_PY_EXACT" ]]; then
            _find_python || _die "no Python $_PY_EXACT with the venv module found for $VENV_DIR (tried python$_PY_EXACT, python3). Install Python $_PY_EXACT and retry."
        else
            _find_python || _die "no Python >= 3.11 with the venv module found (tried python3.12, pyenv's 3.12.x, python3, python3.13, python3.11). Install Python 3.12 (or 3.11) and retry."
        fi
        _log "creating $(basename "$VENV_DIR") with $("${PY_CMD[@]}" -c 'import sys; print("Python", sys.version.split()[0])')"
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
    _log "installing the project into $(basename "$VENV_DIR") (editable, extras: $extras)"
    rm -f "$stamp"
    "$VENV_PY" -m pip install -qq --upgrade pip || _die "could not upgrade pip in $VENV_DIR"
    # editable_mode=lenient (setuptools' default, named here on purpose): the checkout's own
    # triaccel_jax/ is what imports, from the repo root and from elsewhere.
    "$VENV_PY" -m pip install -q -e "$REPO_ROOT[$extras]" --config-settings editable_mode=lenient \
        || _die "pip install -e .[$extras] failed"
    printf '%s\n' "$want" >"$stamp"
}

# The kernel-test venv: the Triton interpreter tests need torch and triton (the `kernels-dev`
# extra). torch's pinned CPU wheel is served from this machine's disk for Python 3.11; elsewhere any
# interpreter whose pip can install the extra will do. Candidates, first success kept:
# $TRIACCEL_KERNEL_PYTHON, then python3.11, python3.12, python3, python3.13 (override the whole list
# with TRIACCEL_KERNEL_PYTHONS="a b c"). An existing .venv-kernels whose install is current is
# reused. Returns 1, with KERNEL_VENV_TRIED naming what was tried, when no candidate can install it.
ensure_kernels_venv() {
    local saved_dir="$VENV_DIR" saved_py="$VENV_PY"
    VENV_DIR="$REPO_ROOT/.venv-kernels"
    VENV_PY="$VENV_DIR/bin/python"
    KERNEL_VENV_TRIED=""
    local candidates=(${TRIACCEL_KERNEL_PYTHONS:-${TRIACCEL_KERNEL_PYTHON:-} python3.11 python3.12 python3 python3.13})
    local c ok=1
    if [[ -x "$VENV_PY" ]] && ( ensure_venv "kernels-dev,test" ); then
        ok=0  # the existing venv is current
    else
        local seen=" " real
        for c in "${candidates[@]}"; do
            if ! _py_ok "$c"; then
                KERNEL_VENV_TRIED+=" $c (not found)"
                continue
            fi
            # python3 is often python3.12 (or 3.11) under another name: one try per interpreter.
            real="$("$c" -c 'import os, sys; print(os.path.realpath(sys.executable))')"
            if [[ "$seen" == *" $real "* ]]; then
                KERNEL_VENV_TRIED+=" $c (the same interpreter as one above)"
                continue
            fi
            seen+="$real "
            rm -rf "$VENV_DIR"
            _log "kernel tests: trying $("$c" -c 'import sys; print("Python", sys.version.split()[0])') ($c)"
            if ( TRIACCEL_PYTHON="$c"; ensure_venv "kernels-dev,test" ); then
                ok=0
                break
            fi
            KERNEL_VENV_TRIED+=" $c (could not install the kernels-dev extra)"
            _log "kernel tests: $c cannot install the kernels-dev extra (the pip error above); trying the next"
            rm -rf "$VENV_DIR"
        done
    fi
    if (( ok != 0 )); then
        VENV_DIR="$saved_dir"
        VENV_PY="$saved_py"
    fi
    return "$ok"
}

# Fashion-MNIST, the real offline data set. It is looked for where triaccel_jax.data looks:
# $TRIACCEL_DATA_DIR (else ~/.cache/triaccel_jax/data), as is and its fashion-mnist/, then Debian's
# /usr/share/datasets/fashion-mnist (package dataset-fashion-mnist, MIT licence).
#
# No hidden system change: apt-get runs only with TRIACCEL_INSTALL_SYSTEM_DATA=1 (opt-in; .ci/run
# sets it), as root, and says what it is about to run first. Otherwise a missing data set is one
# message listing the ways to get it; the tests that need it skip. (The main job finds, downloads
# or installs its data itself: triaccel_jax/cli/_data_source.py.)
ensure_fashion_mnist() {
    local data_dir d name found
    data_dir="${TRIACCEL_DATA_DIR:-${XDG_CACHE_HOME:-${HOME:-/nonexistent}/.cache}/triaccel_jax/data}"
    for d in "$data_dir" "$data_dir/fashion-mnist" /usr/share/datasets/fashion-mnist; do
        found=1
        for name in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
            [[ -f "$d/$name.gz" ]] || found=0
        done
        (( found )) && return 0
    done
    if [[ "${TRIACCEL_INSTALL_SYSTEM_DATA:-0}" == "1" ]]; then
        if [[ "$(id -u)" == "0" ]] && command -v apt-get >/dev/null 2>&1; then
            _log "TRIACCEL_INSTALL_SYSTEM_DATA=1: installing Debian's dataset-fashion-mnist (Fashion-MNIST's"
            _log "  IDX files, 30 MB, into /usr/share/datasets/fashion-mnist). Running, as root:"
            _log "  apt-get update && apt-get install -y dataset-fashion-mnist"
            if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist; then
                return 0
            fi
            _log "warning: apt-get could not install dataset-fashion-mnist; Fashion-MNIST tests will skip"
        else
            _log "TRIACCEL_INSTALL_SYSTEM_DATA=1, but installing Debian's dataset-fashion-mnist needs root and"
            _log "  apt-get: nothing was installed. Fashion-MNIST tests will skip."
        fi
        return 0
    fi
    _log "Fashion-MNIST not found (looked in $data_dir, $data_dir/fashion-mnist and"
    _log "  /usr/share/datasets/fashion-mnist); its tests skip. To get it:"
    _log "  as root: TRIACCEL_INSTALL_SYSTEM_DATA=1 bash $0 (runs apt-get install -y dataset-fashion-mnist),"
    _log "  or put the four *-ubyte.gz files in a folder and set TRIACCEL_DATA_DIR=/that/folder,"
    _log "  or run the main job once (bash tools/main.sh), which downloads them (MD5s verified)"
}
