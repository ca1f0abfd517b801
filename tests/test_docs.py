"""The README and docs/ as a newcomer reads them: short, current (no issue numbers), and every link lands."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import REPO

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lowercase, punctuation but hyphens dropped, spaces as hyphens."""
    headings = [line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_the_readme_is_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


def test_no_page_names_an_issue_number():
    found = [f"{page.relative_to(REPO)}: {line}" for page in PAGES for line in page.read_text().splitlines()
             if re.search(r"\bissues? #?\d+|#\d{2,}\b", line, re.IGNORECASE)]
    assert found == []


def test_every_relative_link_lands_on_a_file_and_heading():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert broken == []
