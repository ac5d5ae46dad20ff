#!/usr/bin/env bash
# The lowest declared versions: bash tools/lowest_versions.sh   (CI runs it; ~1 minute once pip's
# cache holds the wheels)
#
# pyproject.toml's [project] dependencies each declare a floor (`name>=X`). This installs the
# project with every one of them pinned to its floor (`name==X` as a pip constraints file made
# from pyproject.toml at run time, so the floors and this check cannot drift apart) into
# .venv-lowest, with the oldest Python that requires-python admits (the floors' wheels exist for
# it), binary wheels only, then runs tools/lowest_versions_smoke.py from outside the checkout:
# `import triaccel_jax`, the README's example (read from README.md) and an optax-only step.
# A dependency without a single `>=` floor is an error here.
#
# The extras' floors (flax, orbax-checkpoint, tensorboardX) are not installed here, to keep this
# to about a minute; they were checked by hand (CHANGELOG.md), and
# tests/package/test_optional_extras.py checks the tensorboard extra's requirements.
#
# .venv-lowest is reused when pyproject.toml and the interpreter are unchanged (the project itself
# is reinstalled every run); TRIACCEL_REINSTALL=1 rebuilds it. TRIACCEL_LOWEST_PYTHON=/path/to/python
# picks another interpreter (it must have wheels for every floor).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$REPO_ROOT"
start=$SECONDS

VENV_DIR="$REPO_ROOT/.venv-lowest"
VENV_PY="$VENV_DIR/bin/python"

# The oldest Python requires-python admits (">=3.11" -> 3.11). Any Python >= 3.11 can read it.
_PY_EXACT=""
_find_python || _die "no Python >= 3.11 found to read pyproject.toml"
_PY_EXACT="$("${PY_CMD[@]}" - <<'EOF'
import re, tomllib
spec = tomllib.load(open("pyproject.toml", "rb"))["project"]["requires-python"]
match = re.fullmatch(r"\s*>=\s*3\.(\d+)\s*", spec)
if not match:
    raise SystemExit(f"requires-python = {spec!r} is not of the form '>=3.N'")
print(f"3.{match[1]}")
EOF
)"
if [[ -n "${TRIACCEL_LOWEST_PYTHON:-}" ]]; then
    PY_CMD=("$TRIACCEL_LOWEST_PYTHON")
else
    _find_python || _die "no Python $_PY_EXACT (requires-python's lowest) found: tried python$_PY_EXACT, python3. Install it or set TRIACCEL_LOWEST_PYTHON=/path/to/python."
fi

# name>=X -> name==X for every [project] dependency.
constraints="$("${PY_CMD[@]}" - <<'EOF'
import re, sys, tomllib
pins = []
for requirement in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*>=\s*([0-9][0-9A-Za-z.!+-]*)\s*", requirement)
    if not match:
        sys.exit(f"pyproject.toml: the dependency {requirement!r} declares no single '>=' floor "
                 "(tools/lowest_versions.sh installs each dependency at its floor)")
    pins.append(f"{match[1]}=={match[2]}")
print("\n".join(pins))
EOF
)"

stamp="$VENV_DIR/.triaccel-lowest"
want="$(printf '%s\n' "$constraints" "$("${PY_CMD[@]}" -c 'import sys; print(sys.version)')" | sha256sum | cut -d' ' -f1)"
if [[ "${TRIACCEL_REINSTALL:-0}" == "1" || ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]] || ! _py_ok "$VENV_PY"; then
    rm -rf "$VENV_DIR"
    _log "creating .venv-lowest with $("${PY_CMD[@]}" -c 'import sys; print("Python", sys.version.split()[0])')"
    "${PY_CMD[@]}" -m venv "$VENV_DIR" || _die "could not create $VENV_DIR"
    "$VENV_PY" -m pip install -qq --upgrade pip || _die "could not upgrade pip in $VENV_DIR"
fi
rm -f "$stamp"
printf '%s\n' "$constraints" >"$VENV_DIR/constraints.txt"
_log "installing the project with its dependencies at their floors:" $constraints
# Not editable: the smoke test imports the installed package, as a user would (pip reinstalls a
# local folder every time). --only-binary: an old release without a wheel for this Python fails
# here instead of compiling for minutes.
"$VENV_PY" -m pip install -qq --only-binary=:all: -c "$VENV_DIR/constraints.txt" . \
    || _die "pip could not install the project with its dependencies at their floors ($VENV_DIR/constraints.txt)"
"$VENV_PY" -m pip check || _die "the installed dependencies conflict (pip check, above)"
printf '%s\n' "$want" >"$stamp"

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
(cd "$scratch" && "$VENV_PY" "$REPO_ROOT/tools/lowest_versions_smoke.py" "$REPO_ROOT/README.md")
_log "lowest declared versions: ok in $(( SECONDS - start )) s"
