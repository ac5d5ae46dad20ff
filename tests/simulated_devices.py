"""Scripts run in a fresh Python on simulated CPU devices.

XLA fixes the number of host devices when jax starts, so a test that needs several devices (or a
distributed runtime) runs its check as a script in a subprocess with these settings.
"""

from __future__ import annotations

import os
import subprocess
import sys


def device_env(devices: int = 1) -> dict[str, str]:
    """This process's environment, on the CPU, with ``devices`` simulated host devices."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # Kept beside the device count: the compile flags tests/conftest.py sets for every test.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    return env


def run_script(script: str, *, devices: int, timeout: float = 600) -> str:
    """Runs ``script`` with ``devices`` simulated devices; asserts it succeeded and printed ``ok``
    last, and returns its standard output."""
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=device_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("ok"), result.stdout[-2000:]
    return result.stdout
