#!/usr/bin/env bash
# The GPU checks in one run: bash tools/device_check.sh [OUTPUT_DIR [GPU_CHECK_ARGS...]]
#   e.g. SKIP_MAIN_JOB=1 bash tools/device_check.sh out --sections fused-parity bandwidth
#
# For a machine with an NVIDIA GPU whose python3 already has JAX with CUDA, flax, optax,
# orbax-checkpoint and triton (no network needed). Wheels found in .whl/ (jax-triton, say) are
# installed first into a private folder; the Fashion-MNIST IDX files in .data/fashion-mnist/, if
# present, are copied to Debian's location so that the main job trains on them. The project runs
# from this checkout (no install): triaccel_jax/ and kernels/ are assembled under a temporary folder.
#
# What runs, each under its own time limit, all output appended to OUTPUT_DIR/device.log:
#   1. versions and the GPU (nvidia-smi -L);
#   2. benchmarks/gpu_check.py GPU_CHECK_ARGS: kernel parity through jax-triton, bandwidth, fused against
#      unfused, peak_bytes_in_use of a ResNet-18 step (fp32, static bf16, planned);
#   3. unless SKIP_MAIN_JOB=1, the main job (python -m triaccel_jax): FP32, static bf16 and Tri-Accel on Fashion-MNIST,
#      results and plots in OUTPUT_DIR/main/.
# The exit status is the first failing step's.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-device_output}"
shift $(( $# > 0 ? 1 : 0 ))
mkdir -p "$out"
log="$out/device.log"
: >"$log"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

site=$(mktemp -d)
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
        || { echo "installing .whl/ failed" | tee -a "$log"; exit 1; }
fi
# The package layout that pyproject.toml maps: kernels/ ships as triaccel_jax.kernels. (`python3 -P`
# below keeps the checkout's own triaccel_jax/, which lacks it, off sys.path.)
cp -r triaccel_jax "$site/triaccel_jax"
cp -r kernels "$site/triaccel_jax/kernels"
export PYTHONPATH="$site"
if compgen -G ".data/fashion-mnist/*.gz" >/dev/null; then
    mkdir -p /usr/share/datasets/fashion-mnist && cp .data/fashion-mnist/*.gz /usr/share/datasets/fashion-mnist/
fi

status=0
step() {  # step SECONDS NAME COMMAND...
    local seconds=$1 name=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S), limit ${seconds}s): $*" | tee -a "$log"
    local start=$SECONDS rc=0
    timeout "$seconds" "$@" 2>&1 | tee -a "$log" || rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
    if ((rc != 0 && status == 0)); then status=$rc; fi
}

step 60 versions bash -c 'nvidia-smi -L; python3 -c "
import importlib.metadata as m, jax
print(\"devices:\", jax.devices())
for p in (\"jax\", \"jaxlib\", \"flax\", \"optax\", \"orbax-checkpoint\", \"triton\", \"jax-triton\"):
    try:
        print(p, m.version(p))
    except m.PackageNotFoundError:
        print(p, \"-\")
"'
step 300 gpu_check python3 benchmarks/gpu_check.py "$@"
if [[ "${SKIP_MAIN_JOB:-0}" != 1 ]]; then
    step 180 main_job python3 -P -m triaccel_jax --no-progress --output-dir "$out/main"
fi
exit "$status"
