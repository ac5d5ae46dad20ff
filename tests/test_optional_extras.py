"""Flax and orbax are extras: optax-only use works without them, and a feature that needs one
says which extra to install.

Each check runs in a fresh interpreter where the packages are blocked (``sys.modules[name] =
None`` makes ``import name`` fail as if it were not installed), since this process has them.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

from triaccel_jax._src import extras

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCK = (
    "import sys\n"
    "for name in ('flax', 'orbax', 'matplotlib', 'clu'):\n"
    "    sys.modules[name] = None\n"
)


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize(
    ("statement", "feature", "extra"),
    [
        ("import triaccel_jax.flax", "triaccel_jax.flax", "flax"),
        ("from triaccel_jax.flax import TrainState", "triaccel_jax.flax", "flax"),
        ("import triaccel_jax; triaccel_jax.flax", "triaccel_jax.flax", "flax"),
        ("from triaccel_jax.models import SmallCNN", "triaccel_jax.models", "flax"),
        ("import triaccel_jax.checkpoint", "triaccel_jax.checkpoint", "checkpoint"),
        ("from triaccel_jax import Checkpointer", "triaccel_jax.checkpoint", "checkpoint"),
        (
            "import triaccel_jax; triaccel_jax.CheckpointError",
            "triaccel_jax.checkpoint",
            "checkpoint",
        ),
        ("import triaccel_jax.cli", "triaccel_jax.flax", "flax"),
    ],
)
def test_a_feature_without_its_extra_names_the_extra(statement, feature, extra):
    out = _run(
        "try:\n"
        f"    {statement}\n"
        "except ImportError as error:\n"
        "    print(type(error).__name__, error.name, '|', error)\n"
        "else:\n"
        "    print('imported')\n"
    )
    kind, _, message = out.strip().partition(" | ")
    assert kind.split()[0] == "ModuleNotFoundError", out
    assert message.startswith(f"{feature} needs "), message
    assert f"pip install 'triaccel-jax[{extra}]'" in message


def test_optax_only_use_works_without_flax_and_orbax():
    out = _run(
        """
import jax, jax.numpy as jnp, numpy as np, optax
import triaccel_jax

params = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}
tx = triaccel_jax.triaccel(1e-2)
state = tx.init(params)
loss = lambda p: jnp.sum((jnp.ones((4, 64)) @ p["w"] + p["b"]) ** 2)
for _ in range(2):
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    params = optax.apply_updates(params, updates)
plan = triaccel_jax.plan_precision(triaccel_jax.signals(state), params, budget=float("inf"))
print("plan", plan.policy.compute("w"))

x = np.random.default_rng(0).normal(size=(128, 4)).astype(np.float32)
y = x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)
def loss_fn(params, batch, *, policy, rng):
    inputs, targets = batch
    return jnp.mean((inputs @ params["w"] - targets) ** 2)
controller = triaccel_jax.Controller(
    loss_fn, {"w": jnp.zeros(4)}, triaccel_jax.triaccel(0.05), (x, y),
    min_batch=16, max_batch=32, probe=triaccel_jax.BudgetMemoryProbe(2**30), check_every=5,
)
infos = controller.run(10)
print("steps", len(infos), bool(np.isfinite(infos[-1].loss)))
print("loaded", sorted(m for m in sys.modules if m.split(".")[0] in ("flax", "orbax", "clu")
                      and sys.modules[m] is not None))
"""
    )
    assert "plan fp32" in out or "plan bf16" in out, out
    assert "steps 10 True" in out, out
    assert "loaded []" in out, out


def test_is_installed_finds_without_importing(monkeypatch):
    assert extras.is_installed("optax")
    assert not extras.is_installed("no_such_module_triaccel")
    assert not extras.is_installed("no_such_module_triaccel.sub")
    monkeypatch.setitem(sys.modules, "flax", None)
    assert not extras.is_installed("flax")
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'triaccel-jax\[flax\]'"):
        extras.require("flax", "this feature")
    with pytest.raises(ValueError, match="unknown extra"):
        extras.require("flask", "this feature")


def test_every_extra_named_in_a_message_is_declared_in_pyproject():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = declared["optional-dependencies"]
    for extra, (_module, package) in extras.EXTRAS.items():
        assert extra in optional, extra
        assert any(req.startswith(package.lower()) for req in optional[extra])
        # Tests, the main job and `all` install it; the base install does not.
        assert any(req.startswith(package.lower()) for req in optional["test"]), extra
        assert any(req.startswith(package.lower()) for req in optional["all"]), extra
        assert not any(req.startswith(package.lower()) for req in declared["dependencies"])
    assert any(req.startswith("flax") for req in optional["demo"])


def test_the_docs_extra_pins_what_tools_docs_sh_installs():
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    script = (ROOT / "tools" / "docs.sh").read_text()
    block = re.search(r"DOCS_REQUIREMENTS=\((.*?)\)", script, re.S).group(1)
    assert re.findall(r'"([^"]+)"', block) == optional["optional-dependencies"]["docs"]
