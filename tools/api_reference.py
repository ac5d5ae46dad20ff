"""Writes the API reference as plain Markdown, readable where nothing is built (GitHub, an editor).

    .venv/bin/python tools/api_reference.py           # writes docs/reference/*.md
    .venv/bin/python tools/api_reference.py --check   # exit 1 where a committed page is stale

The built reference (docs/api/*.md, expanded by docs/conf.py into autodoc entries) is the one
with links and rendered docstrings; this is the same reference, page for page and name for name,
as text: each page's own prose, then every name its markers place, in their order, with the
signature and the docstring as written. tests/package/test_docs.py checks that the committed
pages are what this writes, so they cannot fall behind the code.

Markers read (docs/conf.py explains them): ``<!-- api: MODULE: name ... -->`` (those names, in
that order), ``<!-- api-rest: MODULE -->`` (the names of MODULE.__all__ no marker places) and
hand-written ``.. py:data:: NAME`` blocks (kept as they are). Summary markers become lists.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pathlib
import re
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = ROOT / "docs" / "api"
OUT = ROOT / "docs" / "reference"
MARKER = re.compile(r"<!-- (api-contents|api-summary|api-rest|api)(?::\s*(.*?))?\s*-->", re.S)
HEADER = (
    "<!-- Written by tools/api_reference.py from docs/api/{name} and the docstrings; edit those, "
    "then run the tool. -->\n\n"
)
# The built pages' MyST roles, as plain text: {py:obj}`Name <target>` -> `Name`.
_ROLE = re.compile(r"\{py:\w+\}`~?([^`<]+?)(?:\s*<[^>]+>)?`")
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # a default's repr carries its address


def _placed(texts: dict[str, str]) -> set[tuple[str, str]]:
    placed = set()
    for text in texts.values():
        for match in MARKER.finditer(text):
            if match.group(1) == "api":
                module, _, names = (match.group(2) or "").partition(":")
                placed.update((module.strip(), name) for name in names.split())
    return placed


def _signature(obj: Any, name: str) -> str:
    try:
        signature = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return name
    # Annotations are strings under `from __future__ import annotations`: shown unquoted.
    signature = re.sub(r"(: |-> )'([^']*)'", r"\1\2", signature)
    return _ADDRESS.sub("", f"{name}{signature}")


def _doc(obj: Any) -> str:
    doc = inspect.getdoc(obj) or "(no docstring)"
    return doc.replace("```", "'''")


def _members(cls: type) -> list[tuple[str, Any]]:
    """The public methods and properties ``cls`` defines itself or takes from one of the
    library's private bases (which no reader sees), not those it inherits from public classes."""
    members = []
    own = [
        klass
        for klass in cls.__mro__
        if klass is cls
        or (klass.__name__.startswith("_") and klass.__module__.startswith("triaccel_jax"))
    ]
    seen: set[str] = set()
    for name, value in (item for klass in own for item in vars(klass).items()):
        if name.startswith("_") or name in getattr(cls, "_fields", ()) or name in seen:
            continue
        seen.add(name)
        if isinstance(value, (staticmethod, classmethod)):
            value = getattr(cls, name)  # bound: a classmethod's signature without cls
        documented = inspect.getdoc(value) is not None
        if documented and (callable(value) or hasattr(value, "__get__")):
            members.append((name, value))
    return members


def _entry(module: str, name: str) -> str:
    obj = getattr(importlib.import_module(module), name)
    lines = [f"### `{module}.{name}`", ""]
    if inspect.isclass(obj) or callable(obj):
        kind = "class" if inspect.isclass(obj) else "function"
        lines += ["```python", f"{kind} {_signature(obj, name)}", "```", ""]
        lines += ["```text", _doc(obj), "```", ""]
        if inspect.isclass(obj):
            for member, value in _members(obj):
                target = value.fget if isinstance(value, property) else value
                shown = member if isinstance(value, property) else _signature(target, member)
                lines += [f"#### `{name}.{shown}`", "", "```text", _doc(value), "```", ""]
    else:
        lines += ["```python", f"{name} = {_ADDRESS.sub('', repr(obj))}", "```", ""]
    return "\n".join(lines)


_EVAL_RST = re.compile(r"```\{eval-rst\}\n(.*?)```", re.S)
_AUTOMODULE = re.compile(r"^\.\. automodule:: ([\w.]+)\n(?:\s+:members: (.*)\n)?", re.M)


def _rst_block(match: re.Match) -> str:
    """An ``eval-rst`` block as Markdown: automodule's module and members, or the text as is."""
    block = match.group(1)
    modules = list(_AUTOMODULE.finditer(block))
    if not modules:
        return f"```text\n{block}```"
    parts = []
    for module in modules:
        name, members = module.group(1), module.group(2)
        if members is None:
            parts.append(_doc(importlib.import_module(name)))
        else:
            parts += [_entry(name, member.strip()) for member in members.split(",")]
    return "\n\n".join(parts)


def render(page: pathlib.Path, texts: dict[str, str]) -> str:
    """The Markdown of one page of docs/api/: its prose, then its names' entries."""
    text = texts[page.name]
    placed = _placed(texts)

    def expand(match: re.Match) -> str:
        kind, arg = match.group(1), (match.group(2) or "").strip()
        if kind == "api":
            module, _, names = arg.partition(":")
            return "\n".join(_entry(module.strip(), n) for n in names.split())
        if kind == "api-rest":
            rest = [n for n in importlib.import_module(arg).__all__ if (arg, n) not in placed]
            return "\n".join(_entry(arg, n) for n in rest)
        if kind == "api-summary":
            module, _, names = arg.partition(":")
            listed = names.split() or importlib.import_module(module.strip()).__all__
            return "\n".join(f"- `{name}`" for name in listed)
        return ""  # api-contents: the entries follow, each under its own heading

    body = _EVAL_RST.sub(_rst_block, MARKER.sub(expand, text))
    body = _ROLE.sub(lambda m: f"`{m.group(1).strip()}`", body)
    # The built pages link to each other as `name.md`; here each page is `name.md` too.
    body = re.sub(r"\]\(api/(\w+)\.md", r"](\1.md", body)
    body = re.sub(r"\]\(\.\./", "](../", body)
    return HEADER.format(name=page.name) + re.sub(r"\n{3,}", "\n\n", body).rstrip() + "\n"


def pages() -> dict[str, str]:
    """docs/reference/ file name -> its text, one for docs/api.md (README.md) and each page."""
    texts = {p.name: p.read_text() for p in sorted(PAGES.glob("*.md"))}
    out = {name: render(PAGES / name, texts) for name in texts}
    index = (ROOT / "docs" / "api.md").read_text()
    index = re.sub(r"```\{toctree\}.*?```", "", index, flags=re.S)
    index = MARKER.sub(lambda m: "", index)
    index = re.sub(r"\]\(api/(\w+)\.md\)", r"](\1.md)", index)
    index = _ROLE.sub(lambda m: f"`{m.group(1).strip()}`", index)
    out["README.md"] = (
        HEADER.replace("docs/api/{name}", "docs/api.md")
        + re.sub(r"\n{3,}", "\n\n", index).strip()
        + "\n"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where a page is stale")
    args = parser.parse_args(argv)
    written = pages()
    stale = sorted(
        name
        for name, text in written.items()
        if not (OUT / name).exists() or (OUT / name).read_text() != text
    )
    extra = (
        sorted(p.name for p in OUT.glob("*.md") if p.name not in written) if OUT.exists() else []
    )
    if args.check:
        for name in stale + extra:
            print(f"docs/reference/{name} is stale: run .venv/bin/python tools/api_reference.py")
        return 1 if stale or extra else 0
    OUT.mkdir(exist_ok=True)
    for name in extra:
        (OUT / name).unlink()
    for name in stale:
        (OUT / name).write_text(written[name])
    print(f"docs/reference/: {len(stale)} written, {len(extra)} removed, {len(written)} pages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
