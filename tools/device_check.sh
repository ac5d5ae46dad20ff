#!/usr/bin/env bash
# The GPU checks in one run: bash tools/device_check.sh [OUTPUT_DIR [GPU_CHECK_ARGS...]]
#   e.g. SKIP_END_TO_END=1 bash tools/device_check.sh out --sections fused-parity bandwidth
#
# For a machine with an NVIDIA GPU whose python3 already has JAX with CUDA, flax, optax,
# orbax-checkpoint and triton (no network needed). Wheels found in .whl/ (jax-triton, say) are
# installed first into a private folder; the Fashion-MNIST IDX files in .data/fashion-mnist/, if
# present, are copied to Debian's location so that the main job trains on them. The project runs
# from this checkout (no install): triaccel_jax/ is copied to a temporary folder.
#
# What runs, each under its own time limit (together at most 30 + 200 + 240 = 470 s, under the 8
# minutes a device check may take), all output appended to OUTPUT_DIR/device.log:
#   1. versions and the GPU (nvidia-smi -L), 30 s;
#   2. benchmarks/gpu_check.py GPU_CHECK_ARGS (default: every section but end-to-end), 200 s:
#      kernel parity through jax-triton, bandwidth (every launch candidate of each kernel against
#      XLA and a device copy: the casts, the fused update, the block-wise 8-bit quantize and
#      dequantize; the auto table, a row for every op impl="auto" dispatches, written to
#      OUTPUT_DIR/auto_table.json), fused against unfused, peak_bytes_in_use of a ResNet-18 step
#      (fp32, static bf16, planned);
#   3. unless SKIP_END_TO_END=1, gpu_check.py --sections end-to-end, 240 s: the main job three
#      times, one process per run (FP32 and static bf16 AdamW at batch 128, Tri-Accel growing
#      its batch), ResNet-18 on 32x32x3 Fashion-MNIST (CIFAR-10 when its archive is in
#      ~/tensorflow_datasets/downloads/manual/); its runs' results in OUTPUT_DIR/end_to_end/.
#      Each fixed run's process is stopped after 55 s and Tri-Accel's after 120 s, so the step
#      cannot overrun its limit. (This replaces the separate main-job step: the end-to-end runs
#      are the main job, at ResNet-18 scale.)
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
# The package as installed, from the checkout (`python3 -P` below keeps the checkout itself off
# sys.path, so that the copy is what runs).
cp -r triaccel_jax "$site/triaccel_jax"
export PYTHONPATH="$site"
if compgen -G ".data/fashion-mnist/*.gz" >/dev/null; then
    mkdir -p /usr/share/datasets/fashion-mnist && cp .data/fashion-mnist/*.gz /usr/share/datasets/fashion-mnist/
fi
if [[ -f .data/cifar-10-binary.tar.gz ]]; then  # the end-to-end section then trains on CIFAR-10
    manual="${TFDS_DATA_DIR:-$HOME/tensorflow_datasets}/downloads/manual"
    mkdir -p "$manual" && cp .data/cifar-10-binary.tar.gz "$manual/"
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

step 30 versions bash -c 'nvidia-smi -L; python3 -c "
import importlib.metadata as m, jax
print(\"devices:\", jax.devices())
for p in (\"jax\", \"jaxlib\", \"flax\", \"optax\", \"orbax-checkpoint\", \"triton\", \"jax-triton\"):
    try:
        print(p, m.version(p))
    except m.PackageNotFoundError:
        print(p, \"-\")
"'
# The bandwidth section writes the auto table it measured (kernels/auto_table.json's
# format) beside the log: copy it over kernels/auto_table.json to make impl="auto"
# follow this device's figures.
step 200 gpu_check python3 benchmarks/gpu_check.py --auto-table "$out/auto_table.json" "$@"
if [[ "${SKIP_END_TO_END:-0}" != 1 ]]; then
    step 240 end_to_end python3 benchmarks/gpu_check.py --sections end-to-end --output-dir "$out/end_to_end"
fi
exit "$status"
