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


# -- docs/architecture.md against the code ---------------------------------------------------

_NOTE = re.compile(r"\[Note: ([^\]]+)\]")


def _notes_written() -> dict[str, str]:
    """Every ``[Note: ...]`` written in adaptmem -> the file it is written in: a note begins
    a comment block or a docstring paragraph (``# [Note: x]`` or ``[Note: x]`` at the start
    of a line after a blank one); elsewhere the name refers to it."""
    written: dict[str, str] = {}
    for path in sorted((ROOT / "adaptmem").rglob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            match = re.match(r"\s*(# )?\[Note: ([^\]]+)\]", line)
            if not match:
                continue
            before = lines[i - 1].strip() if i else ""
            if (before.lstrip("#").strip() == "" or before.endswith('"""')
                    or (match.group(1) and not before.startswith("#"))):
                assert match.group(2) not in written, f"[Note: {match.group(2)}] written twice"
                written[match.group(2)] = str(path.relative_to(ROOT))
    return written


def test_every_note_named_is_written_somewhere() -> None:
    written = _notes_written()
    here = Path(__file__).resolve()  # whose patterns name no note
    sources = [*(ROOT / "adaptmem").rglob("*.py"),
               *(p for p in (ROOT / "tests").rglob("*.py") if p.resolve() != here), *PAGES]
    missing = set()
    for path in sources:
        for name in _NOTE.findall(path.read_text()):
            name = re.sub(r"\s*\n\s*(#\s*)?", " ", name)  # a name wrapped over lines
            if name not in written and not name.endswith("..."):
                missing.add(f"[Note: {name}] in {path.relative_to(ROOT)}")
    assert not missing, f"named but written nowhere: {sorted(missing)}"


def test_the_architecture_page_lists_every_note_where_it_is_written() -> None:
    table = {}
    for row in re.findall(r"^\| (\[Note: .*) \| `([^`]+)` \|$",
                          (ROOT / "docs" / "architecture.md").read_text(), re.M):
        for name in _NOTE.findall(row[0]):
            table[name] = row[1]
    assert table == _notes_written()


def test_the_architecture_page_describes_every_module_of_each_package() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    undescribed = []
    for package in sorted(p for p in (ROOT / "adaptmem").iterdir()
                          if p.is_dir() and p.name.startswith("_")):
        match = re.search(rf"^\*\*`{package.name}/`\*\*(.*?)(?=^\*\*|^## )", page, re.S | re.M)
        assert match, f"docs/architecture.md has no paragraph for {package.name}/"
        undescribed += [f"{package.name}/{m.name}" for m in sorted(package.glob("*.py"))
                        if m.name != "__init__.py" and f"`{m.name}`" not in match.group(1)]
    assert not undescribed, f"docs/architecture.md does not describe {undescribed}"
