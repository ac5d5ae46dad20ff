"""GPU check of the Triton kernels: parity, bandwidth, fused against unfused, memory of a step.

For a machine with an NVIDIA GPU (written for an H200), ``jax[cuda12]`` and the ``gpu`` extra
(jax-triton). One run, a few minutes (well under 8 on an H200), prints every figure:

1. **Parity** through jax-triton against the pure-JAX references, for every cast target x
   rounding x (un)scaled, and for the fused update in six dtype configurations. The reference is
   evaluated operation by operation (``jax.disable_jit``), which is what the kernels compute
   (IEEE ``div.rn``/``sqrt.rn``, no FMA contraction, the same Philox bits): the cast's on the
   GPU, the fused update's on the CPU, because XLA:GPU divides float32 with the approximate
   ``div.full.f32`` (the run of 2026-11-30 on an H200 saw the master 96 to 256 ulps away from
   that GPU reference where the update nearly cancels it, and prints that distance too). The cast
   must match bit for bit; the fused update within 2 float32 ulps and 1 ulp of a narrow dtype.
   Inputs avoid float32 subnormals, which XLA may flush to zero.
2. **Bandwidth**: each kernel's bytes moved per second against a measured device copy
   (``jnp.copy`` of a large array: the practical ceiling, about 4.3 TB/s on an H200), beside the
   same cast's reference compiled by XLA (what ``impl="auto"`` chooses the kernel over); the same
   for the block-wise 8-bit quantize (both maps x both roundings) and dequantize (both maps), so
   ``--auto-table`` writes a row for every operation the dispatch lists. Calls are queued and
   waited for once per round, so the figure is the kernel's time, not the dispatch's.
3. **Fused against unfused**: the fused update kernel, the same reference jitted (XLA fuses what
   it can), and an unfused pipeline (moments and direction, master update, compute cast as three
   separately jitted steps, each a round trip through memory, as an optax chain does).
4. **Memory**: ``peak_bytes_in_use`` of one training step of a ResNet-18 (the CIFAR variant,
   ``ResNet(stage_sizes=(2, 2, 2, 2), num_filters=64)``) on 32x32x3 images with
   ``triaccel_jax.triaccel``: float32 (model and optimizer state), static bfloat16 (bfloat16
   compute, bfloat16 moments, float32 masters) and the planner's policy. Each configuration runs
   in its own process, because the peak is a process-wide high-water mark, with XLA's autotuner
   off (its scratch buffers would set the peak); the compiled memory analysis is printed beside it.

5. **End to end** (issue 14): the main job three times, each run in its own process, ResNet-18
   on 32x32x3 images (CIFAR-10 when its archive and tensorflow-datasets are present, else
   Fashion-MNIST padded to 32x32 and replicated to three channels): FP32 AdamW and static bf16
   AdamW at batch 128, Tri-Accel (planner, batch growing into free memory up to 512). Prints
   steady-state samples/s, compile seconds, ``peak_bytes_in_use`` at the batch each run trained
   at and at 128, the wall time to FP32's final accuracy with and without compiles, the final
   accuracy, and issue 14's targets as ratios ("met"/"missed"). See
   :mod:`triaccel_jax.cli._end_to_end`. Budget on an H200: one epoch of 30,000 images per run,
   each fixed run's process stopped after 55 s and Tri-Accel's after 120 s (at most 4 minutes).

Usage::

    python benchmarks/gpu_check.py              # on the GPU machine
    python benchmarks/gpu_check.py --dry-run    # anywhere: tiny sizes, reference kernels only
    python benchmarks/gpu_check.py --quick      # --dry-run, and a tiny end-to-end section (CPU)
    python benchmarks/gpu_check.py --sections fused-parity bandwidth   # some checks only

Exit status: 0 when every parity check passed (and every end-to-end run finished), 1 when one
failed, 2 when the Triton kernels cannot run here (no CUDA backend or no jax_triton) and
``--dry-run`` (or ``--quick``) was not given. Missed targets are reported, not failures.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import pathlib
import sys
import time

import jax

from triaccel_jax.kernels import _dispatch

# The sections live beside this script: importable when it runs as a script (its folder is then
# sys.path[0]) and when it is loaded by path (the kernel tests).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from gpu_sections import _bandwidth
from gpu_sections import _common as common
from gpu_sections import _end_to_end
from gpu_sections import _memory
from gpu_sections import _parity

# The end-to-end section runs when named (tools/device_check.sh gives it a step of its own) or,
# without --sections, with --quick.
DEFAULT_SECTIONS = ("cast-parity", "fused-parity", "bandwidth", "memory")
SECTIONS = (*DEFAULT_SECTIONS, "end-to-end")


# --- main ----------------------------------------------------------------------------------------


def _versions() -> str:
    found = []
    for package in ("jax", "jaxlib", "jax-triton", "triton"):
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{package} -")
    return ", ".join(found)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny sizes and the reference implementation: runs anywhere (CPU)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="--dry-run, and the end-to-end section with a tiny model, data and steps (CPU)",
    )
    parser.add_argument(
        "--output-dir",
        default=None,
        help="folder for the end-to-end runs' output (default: a new temporary folder)",
    )
    parser.add_argument(
        "--parity-size",
        type=int,
        default=None,
        help="elements per parity check (default 2**20 + 123; dry run 4099)",
    )
    parser.add_argument(
        "--bandwidth-log2",
        type=int,
        default=None,
        help="log2 of the elements per bandwidth array (default 27; dry run 14)",
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="timed calls per figure (default 20; dry run 2)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="images per training step for the memory figures (default 128)",
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=None,
        help="which checks to run (default: all but end-to-end; with --quick, all)",
    )
    parser.add_argument(
        "--skip-memory",
        action="store_true",
        help="skip the memory figures (same as leaving `memory` out of --sections)",
    )
    parser.add_argument(
        "--auto-table",
        default=None,
        help="write the auto table (kernels/auto_table.json's format) measured by "
        "the bandwidth section to this file; pass kernels/auto_table.json to change "
        "what impl='auto' does",
    )
    parser.add_argument(
        "--memory-child", choices=("fp32", "static-bf16", "planned"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    args.dry_run = dry = args.dry_run or args.quick
    if args.sections is None:
        args.sections = list(SECTIONS if args.quick else DEFAULT_SECTIONS)
    if args.parity_size is None:
        args.parity_size = 4099 if dry else 2**20 + 123
    if args.bandwidth_log2 is None:
        # 2^27 float32 (512 MiB an array) is far past every cache, and leaves time to screen
        # every launch candidate of every kernel within the device check's limit.
        args.bandwidth_log2 = 14 if dry else 27
    if args.iterations is None:
        args.iterations = 2 if dry else 20
    if args.batch_size is None:
        args.batch_size = 8 if dry else 128
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_child:
        _memory.memory_child(args.memory_child, args.batch_size, args.dry_run)
        return 0
    start = time.perf_counter()
    reason = _dispatch.triton_unavailable_reason()
    common.echo(f"devices: {jax.devices()}; {_versions()}")
    if reason is not None and not args.dry_run:
        common.echo(
            f"the Triton kernels cannot run here: {reason}\n(use --dry-run to check the script)"
        )
        return 2
    impl = "reference" if args.dry_run else "triton"
    if args.dry_run:
        common.echo("dry run: reference implementation, tiny sizes; the figures mean nothing")
    else:
        common.echo(f"impl='auto' resolves to {_dispatch.resolve('auto', 'cast')!r} here")
    sections = set(args.sections) - ({"memory"} if args.skip_memory else set())
    results = []
    if "cast-parity" in sections:
        results += _parity.cast_parity(args.parity_size, impl)
    if "fused-parity" in sections:
        results += _parity.fused_parity(args.parity_size, impl)
    if "bandwidth" in sections:
        rows = _bandwidth.bandwidth(2**args.bandwidth_log2, impl, args.iterations)
        if args.auto_table:
            source = (
                f"benchmarks/gpu_check.py --sections bandwidth: 2^{args.bandwidth_log2} float32 "
                f"elements, median of 5 rounds of {args.iterations} queued calls; {_versions()}"
            )
            _bandwidth.write_table(args.auto_table, rows, dry_run=args.dry_run, source=source)
    if "memory" in sections:
        _memory.memory(args.batch_size, args.dry_run)
    if "end-to-end" in sections:
        results.append(_end_to_end.end_to_end(args.quick, args.output_dir))
    failed = results.count(False)
    common.echo(
        f"\nparity: {len(results) - failed} passed, {failed} failed; "
        f"total {time.perf_counter() - start:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
