"""The packages are layered: each imports only packages below it, and only their public names.

Read from the source with ``ast`` (nothing is imported), every ``import`` and ``from ... import``
of every module under ``triaccel_jax/``, at module level or inside a function, is checked against
``LAYERS``:

(a) a package imports only itself and packages in a lower layer (so there is no cycle);
(b) it imports no private module (``_name``) of another package, ``triaccel_jax._src`` (the shared
    private base) excepted;
(c) what it takes from another package is public: a name that package's ``__init__.py`` lists in
    ``__all__``, or a public submodule; and where it imports the package itself
    (``from triaccel_jax import policy as policy_lib``), every ``policy_lib.name`` it reads is
    listed there too.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from triaccel_jax._src import packages

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "triaccel_jax"
MAPPED = {package: ROOT / folder for package, folder in packages.FOLDERS.items()}


def _folder(package: str) -> pathlib.Path:
    """Where the subpackage ``triaccel_jax.<package>`` lies in the checkout."""
    return MAPPED.get(package, PACKAGE / package)


# Bottom-up (triaccel_jax._src.packages, the one list of the subpackages); "" is the top level
# itself: triaccel_jax/__init__.py and __main__.py.
LAYERS: tuple[tuple[str, ...], ...] = (*packages.LAYERS, ("",))
LAYER = {package: level for level, packages in enumerate(LAYERS) for package in packages}
SHARED_PRIVATE = "_src"


def _modules() -> dict[str, pathlib.Path]:
    """``{dotted module name: path}`` of every module under triaccel_jax/."""
    modules = {}
    paths = [(path, path.relative_to(ROOT)) for path in sorted(PACKAGE.rglob("*.py"))]
    for package, folder in MAPPED.items():
        paths += [
            (path, pathlib.Path("triaccel_jax", package, path.relative_to(folder)))
            for path in sorted(folder.rglob("*.py"))
        ]
    for path, relative in paths:
        parts = relative.with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _package_of(module: str) -> str:
    """The top-level subpackage a dotted name lies in ("" for triaccel_jax itself)."""
    parts = module.split(".")
    if len(parts) < 2 or f"triaccel_jax.{parts[1]}" not in MODULES:
        return ""
    if _folder(parts[1]).is_dir():
        return parts[1]
    return ""  # a module of the top level (triaccel_jax.__main__)


def _exports(package: str) -> set[str]:
    """The names ``triaccel_jax.<package>``'s __init__.py lists in ``__all__``."""
    tree = ast.parse((_folder(package) / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return {ast.literal_eval(e) for e in node.value.elts}  # type: ignore[attr-defined]
    return set()


def _public_submodules(package: str) -> set[str]:
    folder = _folder(package)
    names = {p.stem for p in folder.glob("*.py")} | {
        p.name for p in folder.iterdir() if (p / "__init__.py").exists()
    }
    return {n for n in names if not n.startswith("_")}


class Import:
    """One imported module (and the name taken from it) in one module, at one line."""

    def __init__(self, module: str, line: int, target: str, name: str | None, alias: str | None):
        self.module, self.line, self.target, self.name, self.alias = (
            module,
            line,
            target,
            name,
            alias,
        )

    def __str__(self) -> str:
        what = f"from {self.target} import {self.name}" if self.name else f"import {self.target}"
        return f"{self.module} (line {self.line}): {what}"


def _imports(module: str, path: pathlib.Path) -> tuple[list[Import], ast.Module]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "triaccel_jax" or alias.name.startswith("triaccel_jax."):
                    found.append(Import(module, node.lineno, alias.name, None, alias.asname))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target != "triaccel_jax" and not target.startswith("triaccel_jax."):
                continue
            for alias in node.names:
                found.append(Import(module, node.lineno, target, alias.name, alias.asname))
    return found, tree


def _edges() -> list[tuple[str, str, Import]]:
    """``(importing package, imported package, the import)`` for every import in the package."""
    edges = []
    for module, path in MODULES.items():
        imports, _ = _imports(module, path)
        for imp in imports:
            target = imp.target
            # `from triaccel_jax import policy` imports the subpackage; a top-level name is the
            # top level's.
            if imp.target == "triaccel_jax" and (_folder(str(imp.name)) / "__init__.py").exists():
                target = f"triaccel_jax.{imp.name}"
            edges.append((_package_of(module), _package_of(target), imp))
    return edges


EDGES = _edges()


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} | set(MAPPED)
    assert packages == set(LAYER) - {""}, (
        f"packages without a layer in LAYERS: {sorted(packages - set(LAYER))}; "
        f"layers without a package: {sorted(set(LAYER) - packages - {''})}"
    )


def test_the_reader_finds_imports_of_every_kind():
    # A reader that finds nothing would make every check below pass quietly.
    kinds = {(source, target) for source, target, _ in EDGES}
    assert ("transforms", "policy") in kinds and ("policy", "kernels") in kinds
    assert ("controller", "training") in kinds and ("", "controller") in kinds
    assert any(imp.name is None or imp.alias for _, _, imp in EDGES)
    # Imports inside functions count too (the lazy kernel imports of the cast and fused update).
    assert any(
        imp.module == "triaccel_jax.kernels.cast" and imp.name == "_cast_triton"
        for _, _, imp in EDGES
    )


def test_no_package_imports_a_package_above_it_or_beside_it():
    wrong = [
        f"{imp}: {source or 'triaccel_jax'} (layer {LAYER[source]}) imports "
        f"{target or 'triaccel_jax'} (layer {LAYER[target]})"
        for source, target, imp in EDGES
        if source != target and LAYER[target] >= LAYER[source]
    ]
    assert not wrong, "imports against the layering (see LAYERS):\n" + "\n".join(wrong)


def test_no_module_imports_another_packages_private_module():
    wrong = []
    for source, target, imp in EDGES:
        if source == target or target == SHARED_PRIVATE:
            continue
        parts = imp.target.split(".")[1:] + ([imp.name] if imp.name else [])
        # The name taken from a package may be a private module (`from pkg import _mod`); from a
        # module, a private name (`from pkg.mod import _name`).
        if any(part.startswith("_") for part in parts):
            wrong.append(str(imp))
    assert not wrong, "imports of another package's private modules or names:\n" + "\n".join(wrong)


def test_what_a_package_takes_from_another_is_public():
    wrong = []
    for module, path in MODULES.items():
        source = _package_of(module)
        imports, tree = _imports(module, path)
        aliases: dict[str, str] = {}
        for imp in imports:
            if imp.target == "triaccel_jax" and imp.name and _folder(imp.name).is_dir():
                package, name = imp.name, None  # the subpackage itself, used through an alias
                aliases[imp.alias or imp.name] = package
            else:
                package, name = _package_of(imp.target), imp.name
                if imp.target != f"triaccel_jax.{package}":
                    continue  # from a module: its privacy is the previous test's
            if package in (source, SHARED_PRIVATE, ""):
                continue
            if name is not None and name not in _exports(package) | _public_submodules(package):
                wrong.append(f"{imp}: {name!r} is not in triaccel_jax.{package}.__all__")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                package = aliases[node.value.id]
                if package in (source, SHARED_PRIVATE):
                    continue
                if node.attr not in _exports(package) | _public_submodules(package):
                    wrong.append(
                        f"{module} (line {node.lineno}): {node.value.id}.{node.attr} is not in "
                        f"triaccel_jax.{package}.__all__"
                    )
    assert not wrong, "non-public names taken from another package:\n" + "\n".join(wrong)


@pytest.mark.parametrize("package", [p for p in LAYER if p])
def test_each_package_lists_only_names_it_defines_or_its_own_modules_export(package):
    # __all__ names resolve to an import in the package's own __init__.py (from its own modules).
    tree = ast.parse((_folder(package) / "__init__.py").read_text())
    bound = {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    } | {
        t.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    missing = _exports(package) - bound
    assert not missing, f"triaccel_jax.{package}.__all__ lists names it does not bind: {missing}"
