#!/usr/bin/env bash
# Runs the test suite: bash tools/test.sh [--fast] [PYTEST ARGS...]   (e.g. -k adam, -n 0)
#
# --fast: the fast tier, the one to run all the time (about 7 minutes on 2 busy cores, where the whole
#    suite takes about 20 and the kernel tests 2 more): step 1 only, without the tests marked `slow` (-m "not slow": end-to-end
#    runs, benchmark and notebook runs, the optimizer harness beyond harness.FAST_VARIANTS) and
#    under the "fast" Hypothesis profile (at most 10 examples a property; tests/conftest.py). The
#    kernel step runs only with TRIACCEL_KERNEL_TESTS=1. CI (.ci/run) runs everything.
#
# 1. .venv (project editable with the `test` extra): pytest on 2 workers over tests/, with ARGS.
#    The Triton interpreter and sm_90 compile tests in tests/kernels/ skip there (no torch/triton).
# 2. .venv-kernels (extras `kernels-dev,test`: torch's CPU wheel and triton, in the first Python
#    that can install them; see tools/_venv.sh): pytest on 2 workers over tests/kernels/ with
#    TRITON_INTERPRET=1, so the Triton kernels run on CPU against their references; the sm_90
#    compile test runs its compiler in a subprocess without the flag. Runs when no ARGS are given
#    or with TRIACCEL_KERNEL_TESTS=1; TRIACCEL_KERNEL_TESTS=0 skips it. Where no Python can install
#    the extra, it says so and the exit status is that of step 1, unless TRIACCEL_KERNEL_TESTS=require
#    (as .ci/run sets), which makes that a failure. It does not take ARGS (they name tests of step 1).
#    Where it runs and no ARGS are given, step 1 leaves tests/kernels to it (--ignore), so that
#    folder's pure-JAX tests run once, not in both steps.
#
# The exit status is non-zero when either step fails; both run even if the first fails.
#
# Fashion-MNIST's tests use the data set where it is found ($TRIACCEL_DATA_DIR, Debian's package)
# and skip otherwise; TRIACCEL_INSTALL_SYSTEM_DATA=1, as root, installs Debian's package with
# apt-get first (announced; .ci/run sets it). Nothing is installed on the system otherwise.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$REPO_ROOT"

fast=()
if [[ "${1:-}" == "--fast" ]]; then
    shift
    fast=(-m "not slow")
    export TRIACCEL_HYPOTHESIS_PROFILE="${TRIACCEL_HYPOTHESIS_PROFILE:-fast}"
fi

run_kernel_tests="${TRIACCEL_KERNEL_TESTS:-}"
if [[ -z "$run_kernel_tests" ]]; then
    run_kernel_tests=$(( $# == 0 && ${#fast[@]} == 0 ))
fi

ensure_venv test
main_py="$VENV_PY"
ensure_fashion_mnist

# The kernel venv is made first: where it can run tests/kernels (all of them, the pure-JAX ones
# included), step 1 leaves that folder to it instead of running it twice.
kernels_ready=0
kernel_py=""
if [[ "$run_kernel_tests" == "1" || "$run_kernel_tests" == "require" ]]; then
    _log "kernel tests: tests/kernels under the Triton interpreter in .venv-kernels"
    if ensure_kernels_venv; then
        kernels_ready=1
        kernel_py="$VENV_PY"
    fi
    VENV_PY="$main_py"
fi
leave_kernels=()
if (( kernels_ready && $# == 0 )); then
    leave_kernels=(--ignore=tests/kernels)
fi

status=0
start=$SECONDS
"$main_py" -m pytest -n 2 "${fast[@]}" "${leave_kernels[@]}" "$@" || status=$?
if (( ${#fast[@]} )); then
    _log "fast tier: $((SECONDS - start)) s (the whole suite and the kernel tests: bash tools/test.sh)"
else
    _log "tests: $((SECONDS - start)) s"
fi

if [[ "$run_kernel_tests" == "1" || "$run_kernel_tests" == "require" ]]; then
    kernel_status=0
    if (( kernels_ready )); then
        kernel_start=$SECONDS
        TRITON_INTERPRET=1 "$kernel_py" -m pytest -n 2 tests/kernels || kernel_status=$?
        _log "kernel tests: $((SECONDS - kernel_start)) s"
    else
        _log "kernel tests NOT RUN: no Python here could install the kernels-dev extra (torch and"
        _log "  triton; tried:$KERNEL_VENV_TRIED). Install Python 3.11, or a Python whose pip can"
        _log "  fetch torch==2.13.0 and triton==3.8.0, or set TRIACCEL_KERNEL_PYTHON=/path/to/python."
        if [[ "$run_kernel_tests" == "require" ]]; then
            kernel_status=1
        fi
    fi
    if (( status == 0 )); then
        status=$kernel_status
    fi
fi
exit "$status"
