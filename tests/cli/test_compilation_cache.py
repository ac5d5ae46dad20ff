"""JAX's persistent compilation cache: the main job's (a second identical run compiles nothing)
and the controller's default."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest
from jax._src import compilation_cache as jax_cache

from triaccel_jax._src import compilation_cache
from triaccel_jax.cli import _arguments as arguments

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--dataset", "digits", "--epochs", "1", "--max-steps", "4", "--batch-size", "32"]
TINY += ["--max-batch", "64", "--check-every", "2", "--replan-every", "3", "--no-progress"]

# Runs the main job in a fresh process (JAX's in-memory caches empty, as in a second real run)
# and prints how many executables it asked XLA for and how many of them the persistent cache
# served. JAX records its backend-compile event around the cache lookup too, so the compiles
# XLA really ran are the requests less the hits.
_CHILD = """
import json, sys, jax
counts = {"compiles": 0, "hits": 0}
def on_duration(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        counts["compiles"] += 1
def on_event(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        counts["hits"] += 1
jax.monitoring.register_event_duration_secs_listener(on_duration)
jax.monitoring.register_event_listener(on_event)
from triaccel_jax.cli import main
assert main(sys.argv[1:]) == 0
print("COUNTS " + json.dumps(counts))
"""


def _run_main_job(args, env_extra):
    env = {**os.environ, **env_extra, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("COUNTS ")][-1]
    return json.loads(line[len("COUNTS ") :]), done.stdout


@pytest.mark.slow
def test_a_second_identical_run_compiles_nothing(tmp_path):
    cache = tmp_path / "cache"
    # The environment variable places the cache (the flag is tested below); every run, Tri-Accel
    # with its growing batch and re-plans included.
    args = [*TINY, "--output-dir", str(tmp_path / "out")]
    first, out = _run_main_job(args, {compilation_cache.ENVIRONMENT_VARIABLE: str(cache)})
    # (A few executables recur within a run, FP32's in the bf16 run say: those hit already.)
    assert first["compiles"] > 2 * first["hits"] and f"compilation cache {cache}" in out
    assert any(cache.iterdir()), "nothing was written to the cache"
    second, out = _run_main_job(args, {compilation_cache.ENVIRONMENT_VARIABLE: str(cache)})
    # Every executable came from the cache: XLA compiled nothing.
    assert second["compiles"] == second["hits"] == first["compiles"], (first, second)
    # Compile seconds are reported apart from step seconds for every run.
    record = json.loads((tmp_path / "out" / "results.json").read_text())
    for run in record["results"]:
        assert run["compile_seconds"] >= 0 and run["step_seconds"] > 0
        assert run["seconds"] >= run["compile_seconds"] + run["step_seconds"] * 0.5
    assert "| compile s | step s |" in out


@pytest.mark.slow
def test_no_compilation_cache_compiles_again(tmp_path):
    cache = tmp_path / "cache"
    args = [*TINY, "--runs", "fp32", "--output-dir", str(tmp_path / "out")]
    _run_main_job([*args, "--compilation-cache", str(cache)], {})
    again, out = _run_main_job([*args, "--no-compilation-cache"], {})
    assert again["compiles"] > 0 and again["hits"] == 0 and "compilation cache off" in out
    assert not any(tmp_path.glob("out/cache*"))


def test_where_the_cache_lives():
    resolve = compilation_cache.resolve_cache_dir
    home = {"XDG_CACHE_HOME": "/c"}
    assert resolve(None, False, home) == pathlib.Path("/c/triaccel_jax/jax")
    assert resolve(None, False, {**home, "TRIACCEL_COMPILATION_CACHE": "/d"}) == pathlib.Path("/d")
    for off in ("0", "off", "OFF", ""):
        assert resolve(None, False, {"TRIACCEL_COMPILATION_CACHE": off}) is None
    assert resolve(pathlib.Path("/e"), False, {"TRIACCEL_COMPILATION_CACHE": "0"}) == pathlib.Path(
        "/e"
    )
    assert resolve(None, True, {"TRIACCEL_COMPILATION_CACHE": "/d"}) is None


def test_the_flags_contradicting_each_other_are_rejected(capsys):
    with pytest.raises(SystemExit):
        arguments.parse_args(["--compilation-cache", "/x", "--no-compilation-cache"])
    assert "contradict" in capsys.readouterr().err


def test_the_cache_settings_are_restored_after_the_job(tmp_path, count_compiles):
    before = jax.config.jax_compilation_cache_dir
    with compilation_cache.persistent_cache(tmp_path):
        assert jax.config.jax_compilation_cache_dir == str(tmp_path)
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
        jax.jit(lambda x: x * 3 + 1)(2.0)
    assert jax.config.jax_compilation_cache_dir == before
    # Outside the block the folder is not read: the same function compiles afresh.
    with count_compiles():
        jax.jit(lambda x: x * 3 + 1)(2.0)
    assert count_compiles.count == 1


@pytest.fixture
def jax_cache_settings():
    """Restores JAX's cache settings after a test that changes them for the process."""
    names = (
        "jax_compilation_cache_dir",
        "jax_enable_compilation_cache",
        *compilation_cache._SETTINGS,
    )
    saved = {name: getattr(jax.config, name) for name in names}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    jax_cache.reset_cache()


def _controller(**settings):
    import jax.numpy as jnp
    import numpy as np
    import optax

    import triaccel_jax

    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    return triaccel_jax.Controller(
        lambda p, batch: jnp.mean((batch @ p) ** 2),
        jnp.ones(4),
        optax.sgd(0.1),
        x,
        min_batch=16,
        max_batch=16,
        probe=triaccel_jax.FakeMemoryProbe(10**12),
        **settings,
    )


def test_the_controller_turns_the_persistent_cache_on_by_default(
    tmp_path, monkeypatch, jax_cache_settings
):
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv(compilation_cache.ENVIRONMENT_VARIABLE, str(tmp_path / "cache"))
    _controller(compilation_cache=False).run(2)
    assert jax.config.jax_compilation_cache_dir is None  # switched off: left alone
    controller = _controller()
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cache")
    controller.run(2)
    assert any((tmp_path / "cache").iterdir()), "the step was not written to the cache"
    # A folder the user set in JAX's configuration is kept; "off" in the variable is respected.
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    _controller()
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv(compilation_cache.ENVIRONMENT_VARIABLE, "off")
    _controller()
    assert jax.config.jax_compilation_cache_dir is None
    # A cache switched off in JAX (the main job's --no-compilation-cache) stays off.
    monkeypatch.setenv(compilation_cache.ENVIRONMENT_VARIABLE, str(tmp_path / "cache"))
    jax.config.update("jax_enable_compilation_cache", False)
    _controller()
    assert jax.config.jax_compilation_cache_dir is None
    with pytest.raises(ValueError, match="compilation_cache"):
        _controller(compilation_cache="yes")
