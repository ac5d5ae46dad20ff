"""Checks a built documentation site: it works offline and its internal links resolve.

    python tools/check_docs_site.py docs/_build/html [--forbid TEXT]... [--expect-fashion-mnist]

The site must open from a laptop without a network, so every page is checked for

- remote resources: a ``<script src>``, ``<link href>`` (stylesheet, font, preload, icon),
  ``<img src>``, ``<iframe src>`` or ``<source src>`` pointing off the site, and a ``url(...)`` or
  ``@import`` to another host in a stylesheet under ``_static`` (web fonts);
- internal links: every ``href``/``src`` to a local file must name a file that exists, and a
  ``#fragment`` on an HTML page must name an ``id`` on that page (a heading, an API entry);
- ``--forbid TEXT`` (repeatable): text that must not appear in any page, e.g. the build machine's
  absolute paths in an executed notebook's output;
- ``--expect-fashion-mnist``: the executed notebooks ran on Fashion-MNIST (they print the data
  set they used; on a machine without it they fall back to digits, which the text would then not
  describe).

Links to other hosts are not fetched (the build runs offline). Prints every problem and exits 1
if there is one, else prints a one-line summary.
"""

from __future__ import annotations

import argparse
import html.parser
import pathlib
import re
import sys
import urllib.parse

_REMOTE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.I)
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
# url(...) and @import "..." in CSS; the data: URIs of inline icons are local.
_CSS_URL = re.compile(r"""url\(\s*['"]?([^'")\s]+)|@import\s+['"]([^'"]+)""", re.I)
# Resource-loading tags and their attribute (an <a href> is a link, not a resource).
_RESOURCES = {"script": "src", "link": "href", "img": "src", "iframe": "src", "source": "src"}
# <link rel=...> values that only name a page (no fetch when the page loads).
_LINK_ONLY_RELS = {"canonical", "index", "search", "next", "prev", "author", "license", "help"}


class _Page(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[str, str]] = []  # (tag, url) of <a href> and local resources
        self.remote: list[tuple[str, str]] = []  # (tag, url) of resources loaded from elsewhere

    def handle_starttag(self, tag, attrs):
        attr = dict(attrs)
        for key in ("id", "name"):
            if attr.get(key):
                self.ids.add(attr[key])
        if tag == "a" and attr.get("href"):
            self.links.append((tag, attr["href"]))
        elif tag in _RESOURCES and attr.get(_RESOURCES[tag]):
            url = attr[_RESOURCES[tag]]
            rels = set((attr.get("rel") or "").lower().split())
            if tag == "link" and rels and rels <= _LINK_ONLY_RELS:
                self.links.append((tag, url))
            elif _REMOTE.match(url):
                self.remote.append((tag, url))
            else:
                self.links.append((tag, url))


def check_site(root: pathlib.Path, forbid=(), expect_fashion_mnist=False) -> tuple[list[str], str]:
    """The problems found in the site built in ``root``, and a summary line."""
    root = root.resolve()
    # _static holds the theme's Jinja macro files (*.html templates, not pages) and _sources the
    # pages' source text.
    pages = sorted(
        p
        for p in root.rglob("*.html")
        if not {"_static", "_sources"} & set(p.relative_to(root).parts)
    )
    if not (root / "index.html").is_file():
        return [f"{root}: no index.html (was the site built?)"], ""
    parsed: dict[pathlib.Path, _Page] = {}
    texts: dict[pathlib.Path, str] = {}
    for page in pages:
        texts[page] = page.read_text(encoding="utf-8", errors="replace")
        parser = _Page()
        parser.feed(texts[page])
        parsed[page] = parser

    problems: list[str] = []
    internal = external = 0
    for page, parser in parsed.items():
        name = page.relative_to(root).as_posix()
        for tag, url in parser.remote:
            problems.append(f"{name}: <{tag}> loads a remote resource: {url}")
        for tag, url in parser.links:
            if _SCHEME.match(url) or _REMOTE.match(url):
                external += 1
                continue
            internal += 1
            parts = urllib.parse.urlsplit(url)
            target = page
            if parts.path:
                target = (page.parent / urllib.parse.unquote(parts.path)).resolve()
                if target.is_dir():
                    target = target / "index.html"
                if not target.is_file():
                    problems.append(f"{name}: <{tag}> links to a missing file: {url}")
                    continue
            fragment = urllib.parse.unquote(parts.fragment)
            if fragment and target in parsed and fragment not in parsed[target].ids:
                problems.append(f"{name}: <{tag}> links to a missing anchor: {url}")
        for text in forbid:
            if text in texts[page]:
                problems.append(f"{name}: contains {text!r}")

    for sheet in sorted(root.rglob("*.css")):
        css = sheet.read_text(encoding="utf-8", errors="replace")
        for match in _CSS_URL.finditer(css):
            url = match.group(1) or match.group(2)
            if _REMOTE.match(url):
                problems.append(f"{sheet.relative_to(root)}: loads a remote resource: {url}")

    if expect_fashion_mnist:
        notebooks = [p for p in pages if p.parent.name == "notebooks"]
        if not notebooks:
            problems.append("no executed notebook pages under notebooks/")
        for page in notebooks:
            name = page.relative_to(root).as_posix()
            if "Fashion-MNIST: " not in texts[page] or "digits: " in texts[page]:
                problems.append(f"{name}: the notebook did not print that it ran on Fashion-MNIST")

    summary = (
        f"{len(pages)} pages: {internal} internal links and anchors resolve, no remote "
        f"scripts, stylesheets or fonts ({external} links to other sites not fetched)"
    )
    return problems, summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=pathlib.Path, help="the built site, e.g. docs/_build/html")
    parser.add_argument("--forbid", action="append", default=[], metavar="TEXT")
    parser.add_argument("--expect-fashion-mnist", action="store_true")
    args = parser.parse_args(argv)
    problems, summary = check_site(args.site, args.forbid, args.expect_fashion_mnist)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"{len(problems)} problems in the site built in {args.site}", file=sys.stderr)
        return 1
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
