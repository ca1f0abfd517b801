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


def test_the_readme_says_what_the_suite_took_when_last_measured():
    """README.md's figures for `make test` and `.ci/run` are within 25% of the latest fresh-clone measurement that
    docs/benchmarks/test-suite.md records (its first table), so neither goes stale silently when the suite grows."""
    readme = (REPO / "README.md").read_text()
    said = re.search(r"about (\d+) minutes on 2 cores, `CI=true bash \.ci/run` about (\d+)", readme)
    assert said, "README.md's `make test` line says its minutes and .ci/run's"
    latest = (REPO / "docs" / "benchmarks" / "test-suite.md").read_text().split("## Latest", 1)[1]
    measured = {name: float(wall) for name, wall in
                re.findall(r"^\| `([^`]+)` \| ([\d.]+) min \|", latest, re.M)}
    for name, minutes in zip(("make test", "CI=true bash .ci/run"), said.groups(), strict=True):
        assert abs(float(minutes) - measured[name]) <= 0.25 * measured[name], (name, minutes, measured[name])
