"""Every relative link and image in README.md and docs/ resolves: the file exists and, for `page.md#anchor`, the page
has a heading with that anchor (GitHub's rule: lower case, punctuation dropped, spaces to hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target) and ![alt](target "title")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def links(page: Path) -> list[str]:
    """The link targets of a markdown page, outside fenced code blocks and inline code."""
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_link_helpers_find_links_and_anchors(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# The sandbox (`sandbox/`)\n## Limits\n## Limits\n[a](x.md) ![b](img/y.png \"t\")\n"
                    "`[not](a-link.md)`\n```\n[nor](this.md)\n# Not a heading\n```\n[c](https://e.org) [d](#limits)\n")
    assert links(page) == ["x.md", "img/y.png", "https://e.org", "#limits"]
    assert anchors(page) == {"the-sandbox-sandbox", "limits", "limits-1"}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{page.relative_to(ROOT)}: " + ", ".join(broken)


def test_the_readme_is_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md") if t.endswith(".md")
              or ".md#" in t}
    manual = {p.resolve() for p in (ROOT / "docs").glob("*.md")}
    assert manual <= linked, sorted(str(p.relative_to(ROOT)) for p in manual - linked)  # every manual page linked


def test_the_benchmarks_page_names_every_bench_script() -> None:
    """docs/benchmarks.md is the index of bench/: a script it does not name is one a reader cannot find."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "bench").iterdir()
                     if p.suffix in (".py", ".sh") and p.name != "__init__.py")
    assert scripts, "bench/ has no scripts"
    assert [s for s in scripts if f"`{s}`" not in page and f"bench/{s}" not in page] == []
