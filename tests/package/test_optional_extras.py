"""Flax and orbax are extras: optax-only use works without them, and a feature that needs one
says which extra to install.

Each check runs in a fresh interpreter where the packages are blocked (``sys.modules[name] =
None`` makes ``import name`` fail as if it were not installed), since this process has them.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

from triaccel_jax._src import extras

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCK = (
    "import sys\n"
    "for name in ('flax', 'orbax', 'matplotlib', 'tensorboardX'):\n"
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
    assert f"pip install -e '.[{extra}]' (in a clone of triaccel_jax)" in message


@pytest.mark.slow
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
print("loaded", sorted(m for m in sys.modules if m.split(".")[0] in ("flax", "orbax", "tensorboardX")
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
    with pytest.raises(ModuleNotFoundError, match=r"pip install -e '\.\[flax\]'"):
        extras.require("flax", "this feature")
    with pytest.raises(ValueError, match="unknown extra"):
        extras.require("flask", "this feature")


def test_every_extra_named_in_a_message_is_declared_in_pyproject():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = declared["optional-dependencies"]
    for extra, provided in extras.EXTRAS.items():
        assert extra in optional, extra
        for _module, package in provided:
            assert any(req.lower().startswith(package.lower()) for req in optional[extra])
            # Tests and `all` install it; the base install does not.
            assert any(req.lower().startswith(package.lower()) for req in optional["test"]), extra
            assert any(req.lower().startswith(package.lower()) for req in optional["all"]), extra
            assert not any(
                req.lower().startswith(package.lower()) for req in declared["dependencies"]
            )
    assert any(req.startswith("flax") for req in optional["demo"])


def test_tools_docs_sh_installs_the_docs_extra_which_pins_the_sphinx_tools():
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    script = (ROOT / "tools" / "docs.sh").read_text()
    assert re.search(r"^ensure_venv docs$", script, re.M)
    docs = optional["optional-dependencies"]["docs"]
    sphinx_tools = [req for req in docs if req.startswith(("sphinx", "myst"))]
    assert sphinx_tools and all("==" in req for req in sphinx_tools), sphinx_tools


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalized(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(
        isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names
    )


def _module_level_imports(root: pathlib.Path, module: str) -> set[str]:
    """Top-level names of what ``module`` (under the package folder ``root``) imports when it is
    imported, following its imports inside the same package (module level only: a function's
    import runs only when called)."""
    package = root.name
    found: set[str] = set()
    seen: set[str] = set()

    def source(name: str) -> pathlib.Path | None:
        parts = name.split(".")[1:]
        candidates = [root.joinpath(*parts, "__init__.py")]
        if parts:
            candidates.append(root.joinpath(*parts[:-1], f"{parts[-1]}.py"))
        return next((path for path in candidates if path.is_file()), None)

    def visit(name: str) -> None:
        if name in seen or (path := source(name)) is None:
            return
        seen.add(name)
        is_package = path.name == "__init__.py"
        # Importing a submodule runs its parent packages' __init__ first.
        if "." in name:
            visit(name.rsplit(".", 1)[0])
        nodes = list(ast.parse(path.read_text(encoding="utf-8")).body)
        while nodes:
            node = nodes.pop()
            if isinstance(node, ast.If):
                nodes.extend(node.body + node.orelse)
                continue
            if isinstance(node, ast.Try):
                # An import the module guards with `except ImportError` is optional: not followed.
                optional = any(_catches_import_error(h) for h in node.handlers)
                nodes.extend(([] if optional else node.body) + node.orelse + node.finalbody)
                for handler in node.handlers:
                    nodes.extend(handler.body)
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's package, one level up per extra dot
                    parts = name.split(".")
                    parts = parts[: len(parts) - node.level + is_package]
                    target = ".".join([*parts, node.module] if node.module else parts)
                else:
                    target = node.module or ""
                # `from package import name` may import the submodule package.name.
                targets = [target, *(f"{target}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in targets:
                top = target.split(".")[0]
                if top == package:
                    visit(target)
                elif top not in sys.stdlib_module_names and top != "__future__":
                    found.add(top)

    visit(module)
    return found


def test_the_tensorboard_extra_provides_every_module_the_writer_imports():
    """TensorBoardWriter imports tensorboardX. Each module tensorboardX imports when imported must
    come from a requirement of the tensorboard extra, of tensorboardX itself or of triaccel-jax,
    not from another package's dependencies; and none of them is TensorFlow."""
    spec = importlib.util.find_spec("tensorboardX")
    assert spec is not None and spec.submodule_search_locations, "tensorboardX is not installed"
    root = pathlib.Path(next(iter(spec.submodule_search_locations)))
    imported = _module_level_imports(root, "tensorboardX")
    assert "numpy" in imported and "tensorflow" not in imported, imported

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["tensorboard"]
    own = [r for r in importlib.metadata.requires("tensorboardX") or [] if "extra ==" not in r]
    provided = {_requirement_name(r) for r in [*extra, *own, *project["dependencies"]]}
    installed = importlib.metadata.packages_distributions()
    for module in sorted(imported):
        providers = {_normalized(d) for d in installed.get(module, [])}
        assert providers, f"{module}: no installed distribution provides it"
        assert providers & provided, (
            f"tensorboardX imports {module} (from {sorted(providers)}), which no requirement of "
            f"the tensorboard extra {extra}, of tensorboardX ({own}) or of triaccel-jax provides"
        )
    # `all` brings every feature's extra: the tensorboard extra's requirements, as written there.
    assert set(extra) <= set(project["optional-dependencies"]["all"])
