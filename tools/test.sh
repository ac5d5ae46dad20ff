#!/usr/bin/env bash
# Runs the test suite: bash tools/test.sh [PYTEST ARGS...]   (e.g. -m "not slow", -k adam, -n 0)
#
# 1. .venv (project editable with the `test` extra): pytest on 2 workers over tests/, with ARGS.
#    The Triton interpreter and sm_90 compile tests in tests/kernels/ skip there (no torch/triton).
# 2. .venv-kernels (Python 3.11, extras `kernels-dev,test`: torch's CPU wheel and triton):
#    pytest on 2 workers over tests/kernels/ with TRITON_INTERPRET=1, so the Triton kernels run
#    on CPU against their references; the sm_90 compile test runs its compiler in a subprocess
#    without the flag. Runs when no ARGS are given (as in CI) or with TRIACCEL_KERNEL_TESTS=1;
#    TRIACCEL_KERNEL_TESTS=0 skips it. It does not take ARGS (they name tests of step 1).
#
# The exit status is non-zero when either step fails; both run even if the first fails.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$REPO_ROOT"

run_kernel_tests="${TRIACCEL_KERNEL_TESTS:-}"
if [[ -z "$run_kernel_tests" ]]; then
    run_kernel_tests=$(( $# == 0 ))
fi

ensure_venv test
ensure_fashion_mnist
status=0
"$VENV_PY" -m pytest -n 2 "$@" || status=$?

if [[ "$run_kernel_tests" == "1" ]]; then
    _log "kernel tests: tests/kernels under the Triton interpreter in .venv-kernels"
    ensure_kernels_venv
    kernel_status=0
    TRITON_INTERPRET=1 "$VENV_PY" -m pytest -n 2 tests/kernels || kernel_status=$?
    if (( status == 0 )); then
        status=$kernel_status
    fi
fi
exit "$status"
