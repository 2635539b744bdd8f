"""The documentation matches the tree: every relative link in README.md, docs/*.md and
benchmarks/results/*.md resolves (the file exists, and a ``#anchor`` is one of its headings), and
the source tree drawn in
docs/design.md names real modules (and, for a package whose modules it lists, all of them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
SRC = ROOT / "src" / "meshtorch"

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str, inline_code: bool = False) -> str:
    """``text`` without fenced code blocks, and without inline code unless ``inline_code`` (links
    there are examples, not links; headings keep theirs)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line if inline_code else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*|_(?=\W)|(?<=\W)_", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text(), inline_code=True).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return out


def links(page: Path) -> list[str]:
    return LINK.findall(_prose(page.read_text()))


def test_the_link_checker_on_known_text(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# One SPMD program, three backends\n## `mt.plan`: the planner\n## Notes\n## Notes\n"
                    "[x](b.md#top) ![img](pic.png) `[not](a link)`\n```\n[nor](this.md)\n```\n")
    assert anchors(page) == {"one-spmd-program-three-backends", "mtplan-the-planner", "notes", "notes-1"}
    assert links(page) == ["b.md#top"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            where = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
            broken.append(f"{target}: no file {where}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"broken links in {page.relative_to(ROOT)}:\n" + "\n".join(broken)


def source_tree() -> list[str]:
    """The lines of the source-tree drawing in docs/design.md (the code block that starts with
    ``src/meshtorch/``)."""
    text = (ROOT / "docs" / "design.md").read_text()
    m = re.search(r"```\n(src/meshtorch/\n.*?)```", text, re.S)
    assert m, "docs/design.md has no source-tree block starting with src/meshtorch/"
    return m.group(1).splitlines()[1:]


def named_in_tree() -> dict[str, list[str]]:
    """Per package of the drawing (``""``: the package root), the ``*.py`` files it names. A line
    that starts with ``name/`` opens that package; lines indented deeper continue it."""
    named: dict[str, list[str]] = {"": []}
    package, indent = "", 0
    for line in source_tree():
        tokens = line.split()
        if not tokens:
            continue
        depth = len(line) - len(line.lstrip())
        if tokens[0].endswith("/"):
            package, indent = tokens[0].rstrip("/"), depth
            named.setdefault(package, [])
            for t in tokens[1:]:
                if t.endswith("/"):  # several packages on one line: named, not listed
                    named.setdefault(t.rstrip("/"), [])
        elif depth <= indent:
            package = ""
        named[package] += [t.strip("(),;") for t in tokens if t.strip("(),;").endswith(".py")]
    return named


def test_the_source_tree_in_design_md_names_real_modules():
    named = named_in_tree()
    missing = [f"{pkg + '/' if pkg else ''}{f}" for pkg, files in named.items()
               for f in ([] if pkg == "" else ["__init__.py"]) + files
               if not (SRC / pkg / f).exists()]
    assert not missing, "docs/design.md's source tree names modules that do not exist:\n" + "\n".join(missing)
    # a package whose modules the drawing lists is listed whole
    unlisted = [f"{pkg}/{p.name}" for pkg, files in named.items() if pkg and files
                for p in sorted((SRC / pkg).glob("*.py")) if p.name != "__init__.py" and p.name not in files]
    assert not unlisted, "docs/design.md's source tree leaves out modules of a package it lists:\n" + \
        "\n".join(unlisted)
    assert {"lowering", "comm", "ops", "launcher"} <= set(named)
