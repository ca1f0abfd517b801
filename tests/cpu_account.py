"""Each test file's CPU seconds, printed at the end of the run: the test process's own, that of the processes it
waited for (ranks, workers, the studio and its servers) and that the rank pool's long-lived workers spent while its
tests ran (read from /proc before and after each test). A background job's CPU (tests/background.py) is its own
line, not the share of the test that happened to wait for it first. Processes nobody waits for (the browser that
WebDriver starts) are not counted, here or in the run's total.

The studio's tests have a budget: under 12% of the suite's CPU (the share is printed with the table). Where
$QLORA_CPU_ACCOUNT names a file, the figures are also written there as JSON: tests/lanes.py sums its two sessions'
into one table."""

from __future__ import annotations

import json
import os
import resource
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import background

STUDIO_BUDGET = 0.12
SHOWN = 15  # the costliest files listed

_BY_FILE: dict[str, float] = defaultdict(float)
_BY_TEST: dict[str, float] = {}


def cpu_seconds() -> float:
    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


_SESSION_START = cpu_seconds()  # conftest imports this before collection


def live_descendants_cpu_s(apart: frozenset[int] = frozenset()) -> float:
    """CPU of the processes under this one that are still running (the rank pool's forkserver and workers, ended
    only at exit), with that of the processes they waited for, but those under the pids `apart` (background jobs);
    Linux's /proc, 0 elsewhere."""
    parent, cpu = {}, {}
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split() if entry.name.isdigit() else []
        except OSError:
            continue
        if fields:  # after the name: state, ppid, ..., utime, stime, cutime, cstime at 11 to 14
            parent[int(entry.name)] = int(fields[1])
            cpu[int(entry.name)] = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")

    def under_me(pid: int) -> bool:
        while pid > 1 and pid not in apart:
            pid = parent.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    return sum(seconds for pid, seconds in cpu.items() if under_me(pid))


def with_pool_workers_cpu_s() -> float:
    """This process's CPU, its finished children's and its live ones' (the rank pool's workers run a test's ranks
    and live on), the background jobs' aside while they run (a finished one is counted by `background`)."""
    return cpu_seconds() + live_descendants_cpu_s(background.running_pids())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    start, jobs = with_pool_workers_cpu_s(), background.waited_cpu_s()
    yield
    jobs_cpu = background.waited_cpu_s() - jobs
    _BY_TEST[item.nodeid] = with_pool_workers_cpu_s() - start - jobs_cpu
    _BY_FILE[item.nodeid.split("::")[0]] += _BY_TEST[item.nodeid]
    if jobs_cpu:
        _BY_FILE["(background jobs: planners, real models)"] += jobs_cpu


def is_studio(file: str) -> bool:
    return Path(file).name.startswith("test_studio")


def summary_lines(by_file: dict[str, float], by_test: dict[str, float], total: float) -> list[str]:
    """The table: the costliest files and tests, and the studio's share against its budget."""
    studio = sum(cpu for file, cpu in by_file.items() if is_studio(file))
    lines = [f"{cpu:8.1f} s {cpu / total:6.1%}  {file}" for file, cpu in sorted(by_file.items(), key=lambda kv: -kv[1])]
    lines = lines[:SHOWN] + ["the costliest tests:"]
    lines += [f"{cpu:8.1f} s {cpu / total:6.1%}  {test}" for test, cpu in sorted(by_test.items(),
                                                                                key=lambda kv: -kv[1])[:SHOWN]]
    verdict = "within" if studio <= STUDIO_BUDGET * total else "OVER"
    return lines + [f"the session {total:.0f} s; the studio's tests {studio:.0f} s = {studio / total:.1%} "
                    f"({verdict} its {STUDIO_BUDGET:.0%} budget)"]


TITLE = "CPU seconds by test file (the test process, those it waited for, the pool's workers)"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # the whole session: collection, the tests, and the rank pool's workers (long-lived: their CPU is counted when
    # they end, at the session's end, in no test's figure)
    total = cpu_seconds() - _SESSION_START + live_descendants_cpu_s()
    if total < 1:
        return
    _BY_FILE["(the rest: collection, the rank pool's start)"] = total - sum(_BY_FILE.values())
    terminalreporter.write_sep("=", TITLE)
    for line in summary_lines(_BY_FILE, _BY_TEST, total):
        terminalreporter.write_line(line)
    if os.environ.get("QLORA_CPU_ACCOUNT"):
        Path(os.environ["QLORA_CPU_ACCOUNT"]).write_text(json.dumps({"by_file": _BY_FILE, "by_test": _BY_TEST,
                                                                     "total": total}))
