"""How each test of a planted bug's run ended, for tests/mutation_check.py, which counts only a test that fails an
assertion as a catch: a collection or setup error, an exception in the test's own call (an import the bug broke, a
shape it made wrong), or a rank that crashed says the code broke, not that the test saw what it claims to.

`OutcomeRecorder` is the pytest plugin the checker's fork runs with: one JSON line a report (test id, phase,
outcome, the exception's class, whether it was a failed assertion). The checker's own process reads the lines
without importing this module (it imports nothing of the repo before planting)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def failed_an_assertion(error: BaseException) -> bool:
    """An assertion that failed: `assert`, torch.testing's checks, pytest.fail and pytest.raises' DID NOT RAISE.
    A task on pool ranks counts when a rank failed one (its peers may then fail of other errors)."""
    ranks = getattr(error, "rank_assertions", None)  # tests/rank_pool.RanksFailed
    if ranks is not None:
        return any(ranks)
    return isinstance(error, (AssertionError, pytest.fail.Exception))


class OutcomeRecorder:
    """Every failed collection and each test's setup, call and teardown report, appended to `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, test: str, phase: str, outcome: str, error: BaseException | None) -> None:
        record = {"test": test, "phase": phase, "outcome": outcome,
                  "exception": type(error).__name__ if error is not None else "",
                  "assertion": error is not None and failed_an_assertion(error)}
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
        report = (yield).get_result()  # type: ignore[attr-defined]
        failed = report.outcome == "failed" and call.excinfo is not None
        self.write(item.nodeid, call.when, report.outcome, call.excinfo.value if failed else None)  # type: ignore[union-attr]

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.write(report.nodeid, "collect", "failed", None)
