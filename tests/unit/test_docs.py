"""The user docs (README.md and docs/): short README with a contents list, every relative link resolving,
and every page reachable from the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.doc_blocks import MARKER, output_blocks

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 250

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (links there are examples, not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    return LINK.findall(prose(text))


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, inline markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2, ... for repeated headings."""
    seen: dict[str, int] = {}
    result = set()
    text = FENCE.sub("", path.read_text())
    for _, heading in HEADING.findall(text):
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        result.add(anchor if count == 0 else f"{anchor}-{count}")
    return result


def broken_links(path: Path) -> list[str]:
    """Relative links of ``path`` that do not resolve to a file or folder inside the repository, or whose
    anchor names no heading of the Markdown file they point to."""
    broken = []
    for target in links(path.read_text()):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path.resolve()
        if file_part and (not resolved.is_relative_to(REPO.resolve()) or not resolved.exists()):
            broken.append(f"{target}: no such file in the repository")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    return broken


def test_the_docs_exist() -> None:
    assert README.is_file()
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    expected = "architecture cluster development operations reliability serving simulator".split()
    assert {f"{name}.md" for name in expected} <= set(pages), pages


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path) == []


def test_the_readme_is_short_and_has_a_contents_list() -> None:
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    section = re.search(r"^## Contents\s*$(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert section, "README.md has no '## Contents' section"
    entries = re.findall(r"^\s*(?:[-*]|\d+\.)\s+\[[^\]]+\]\(#([^)]+)\)", section.group(1), re.MULTILINE)
    assert len(entries) >= 3, section.group(1)
    assert set(entries) <= anchors(README), set(entries) - anchors(README)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README.read_text())}
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert unlinked == []


def test_the_checks_catch_what_they_look_for(tmp_path: Path) -> None:
    page = DOCS / "architecture.md"
    bad = tmp_path / "bad.md"
    bad.write_text(
        "# Bad\n\nSee [missing](no-such-file.md), [gone](#nowhere) and [fine](#bad), "
        "but not `[code](ignored.md)`.\n\n```\n[also code](ignored.md)\n```\n"
    )
    assert broken_links(bad) == [
        "no-such-file.md: no such file in the repository",
        "#nowhere: no heading #nowhere in bad.md",
    ]
    outside = tmp_path / "docs" / "outside.md"
    outside.parent.mkdir()
    outside.write_text("[the repository's README, but from outside it](../bad.md)\n")
    assert broken_links(outside) == ["../bad.md: no such file in the repository"]  # exists, not in the repository
    assert links(f"[a](../{page.name}) and [b](https://example.com/x)") == [f"../{page.name}", "https://example.com/x"]
    assert github_anchor("3. Simulate an H100: `pdserve sim --demo`") == "3-simulate-an-h100-pdserve-sim---demo"
    assert github_anchor("The A/B benchmark: `pdserve bench`") == "the-ab-benchmark-pdserve-bench"


# ---- command blocks that claim an output --------------------------------------------------------------------


def test_every_command_block_that_shows_an_output_is_checked_or_an_illustration() -> None:
    """What a page shows a command printing is either run by a named test, or marked as an example of it (its
    figures come from one run, or depend on timing): ``<!-- checked by tests/...py::test_x -->`` or
    ``<!-- illustration -->`` above the block in its section (the last one above it counts)."""
    unmarked = [f"{b.path.relative_to(REPO)}:{b.line}: {b.command.strip().splitlines()[0][:80]}"
                for p in doc_files() for b in output_blocks(p) if b.marker is None]  # fmt: skip
    assert unmarked == []


def test_every_doc_check_names_a_test_that_exists() -> None:
    missing = []
    for path in doc_files():
        for block in output_blocks(path):
            m = MARKER.match(f"<!-- {block.marker} -->") if block.marker else None
            if m is None or m.group(1) == "illustration":
                continue
            test_file = REPO / m.group(2)
            if not test_file.is_file() or not re.search(rf"^def {m.group(3)}\(", test_file.read_text(), re.M):
                missing.append(f"{path.relative_to(REPO)}:{block.line}: {block.marker}")
    assert missing == []
