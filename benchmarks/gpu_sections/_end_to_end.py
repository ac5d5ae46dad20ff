"""End to end: the main job's three runs, one process each (see triaccel_jax.cli._end_to_end)."""

from __future__ import annotations

import os
import pathlib
import tempfile

from gpu_sections import _common as common


def _end_to_end_dataset() -> str:
    """CIFAR-10 when its archive (or prepared set) and tensorflow-datasets are here, else the
    main job's ``auto`` (Fashion-MNIST if installed, else digits)."""
    import importlib.util

    data_dir = pathlib.Path(os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets").expanduser()
    present = (data_dir / "cifar10").exists() or (
        data_dir / "downloads" / "manual" / "cifar-10-binary.tar.gz"
    ).exists()
    return "cifar10" if present and importlib.util.find_spec("tensorflow_datasets") else "auto"


def end_to_end(quick: bool, output: str | None) -> bool:
    """The end-to-end section; False if a run failed."""
    from triaccel_jax.cli import _end_to_end as e2e

    if quick:
        settings = e2e.QUICK
    else:
        # One epoch of 30,000 images (234 steps at batch 128). FP32 and bf16 compile one step,
        # Tri-Accel one per batch bucket (128 to 512) and policy: 55 + 55 + 120 s at most, so the
        # section fits the 240 s that tools/device_check.sh gives it.
        settings = e2e.Settings(
            dataset=_end_to_end_dataset(),
            train_subset=30_000,
            eval_every=39,
            max_batch=512,
            timeout_s=55.0,
            triaccel_timeout_s=120.0,
        )
    common.echo(
        f"\n== end to end: {settings.model} on {settings.dataset} as {settings.image_shape}, "
        f"batch {settings.batch_size} (Tri-Accel up to {settings.max_batch}), one process per run"
    )
    folder = pathlib.Path(output or tempfile.mkdtemp(prefix="gpu_check_e2e_"))
    return e2e.end_to_end(settings, folder, echo=common.echo)


# --- main ----------------------------------------------------------------------------------------
