"""The README and docs/ link to files and sections that exist: a relative link or an anchor
left dangling when a file moves or a heading is renamed fails here, not in a reader's browser."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.MULTILINE)
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores
    dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache  # read once, not once per link to it
def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))  # a `# comment` in a code block is no heading
    return {_anchor(h) for h in _HEADING.findall(text)}


def _links(page: Path) -> list[str]:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return [link for link in _LINK.findall(text) if not re.match(r"[a-z]+:", link)]


def test_the_pages_are_there() -> None:
    assert (ROOT / "README.md").exists()
    assert len(PAGES) > 1, "docs/*.md"


def _broken(page: Path) -> list[str]:
    """The relative links of ``page`` whose file, or heading, is not there."""
    broken = []
    for link in _links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: no heading with anchor #{anchor} in {target.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = _broken(page)
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_a_missing_file_and_a_missing_heading_are_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A title\n\n[a](missing.md) [b](#no-such-heading) [c](#a-title) [d](page.md#a-title) "
        "[e](https://example.com/x)\n\n```bash\n# not a heading\n```\n[f](#not-a-heading)\n",
        encoding="utf-8",
    )
    assert _broken(page) == [
        "missing.md: no such file",
        "#no-such-heading: no heading with anchor #no-such-heading in page.md",
        "#not-a-heading: no heading with anchor #not-a-heading in page.md",
    ]
