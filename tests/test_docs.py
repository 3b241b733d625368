"""The README is a front door: its set-up commands come first, and every link in it and in
docs/ leads somewhere that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
LEVER_PAGES = ["adaptive-execution.md", "paging.md", "chunk-and-split.md", "loading.md",
               "planning.md", "spilling.md", "testing-without-a-gpu.md"]

_FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """``text`` without code blocks and code spans, where brackets are not links."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``path`` (a repeated one gets ``-1``, ...)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in _FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).replace("`", "").strip().lower())
        slug = slug.replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _relative_links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: are not ours


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_points_at_an_existing_file_and_heading(page: Path) -> None:
    broken = []
    for target in _relative_links(page):
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{target} (no such file: {resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.name})")
    assert not broken, f"{page.relative_to(ROOT)} has broken links: {broken}"


def test_readme_starts_with_make_demo_then_make_test() -> None:
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"^```\w*\n(.*?)^```", text, re.S | re.M)
    assert first_block is not None, "README.md has no code block"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()
                if line.strip()]
    assert commands[:2] == ["make demo", "make test"], commands


def test_readme_links_every_lever_page_and_each_links_its_limitations() -> None:
    readme_links = {t.partition("#")[0] for t in _relative_links(ROOT / "README.md")}
    for name in [*LEVER_PAGES, "limitations.md", "architecture.md"]:
        assert f"docs/{name}" in readme_links, f"README.md does not link docs/{name}"
    for name in LEVER_PAGES:
        page = ROOT / "docs" / name
        links = {t.partition("#")[0] for t in _relative_links(page)}
        assert "limitations.md" in links, f"docs/{name} does not link limitations.md"
        # What the lever is for comes first, then the example, then the reference.
        headings = re.findall(r"^## (.+)$", _FENCE.sub("", page.read_text()), re.M)
        assert headings[:2] == ["Example", "Reference"], (name, headings)
