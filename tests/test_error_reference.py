"""docs/troubleshooting.md shows the bad-input corpus as it is: every case, in its section, with its situation and
fix, and an error line its test accepts. Checked without running the cases (`python -m tests.error_reference` runs
them)."""

import re

from tests.error_reference import PAGE, REGENERATE, recorded_lines, render
from tests.test_bad_inputs import CASES

STALE = f"docs/troubleshooting.md is out of date with tests/test_bad_inputs.py: run {REGENERATE}"


def test_every_case_has_a_situation():
    assert [case.name for case in CASES if not case.situation] == [], "give each case a one-line docstring"


def test_the_troubleshooting_page_shows_the_corpus():
    page = PAGE.read_text() if PAGE.is_file() else ""
    lines = recorded_lines(page)
    assert sorted(lines) == sorted(case.name for case in CASES), STALE
    for case in CASES:  # the line shown is one the case's test would accept
        assert re.search(case.expected, lines[case.name].removeprefix("error: ")), f"{case.name}: {STALE}"
    assert page == render(lines), STALE
