"""Work that runs in a process of its own from the moment the session's tests are collected.

The test sequence keeps about 1.2 of a 2-core machine busy on average (pool ranks and torchrun runs use both cores,
the in-process tests one). A job registered here (a planner, the real model's conversion) starts as soon as a
selected test needs it, at a lower priority (nice 10), so it takes the core the sequence leaves idle and not the one
it uses; the tests that need a result run last (conftest orders them), so they seldom wait for it. Nothing with a
time limit of its own belongs here: a starved process overruns it.

A module registers a job at import under the name of the fixture that hands its result to tests (collection imports
every test module before conftest starts the jobs); the fixture calls `result(name)`. A job that no selected test
needs never starts. `register_shared` makes one process serve several fixtures (the planners: one import of torch,
one cache of measured steps); `{parts}` in its command becomes the fixtures the selected tests use.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NICENESS = 10
PLANNER_TIMEOUT_S = 1800  # a test that waits for a whole replan (18 minutes of a core): the job's own limit too
WORK = "{work}"  # in a job's command: its own scratch folder
PARTS = "{parts}"  # in a shared job's command: the fixtures it serves that a selected test uses, comma-separated


@dataclass
class Job:
    name: str
    command: list[str]
    env: dict[str, str]
    timeout: float
    parts: tuple[str, ...] = ()  # a shared job: the fixtures it serves
    work: Path | None = None
    proc: subprocess.Popen | None = None
    done: subprocess.CompletedProcess | None = field(default=None, repr=False)

    def start(self, root: Path, parts: Sequence[str] = ()) -> None:
        self.work = root / self.name
        self.work.mkdir()
        served = ",".join(parts or self.parts)
        command = [part.replace(WORK, str(self.work)).replace(PARTS, served) for part in self.command]
        self.proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=self.env, preexec_fn=lambda: os.nice(NICENESS))

    def wait(self) -> subprocess.CompletedProcess:
        if self.proc is None:  # a test the collection hook did not see (run from a plain function): start it now
            self.start(scratch_root())
        if self.done is None:
            assert self.proc is not None
            before = children_cpu_s()
            try:
                stdout, stderr = self.proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                stdout, stderr = self.proc.communicate()
                stderr += f"\nbackground job {self.name} took over {self.timeout:.0f} s and was killed"
            self.done = subprocess.CompletedProcess(self.proc.args, self.proc.returncode, stdout, stderr)
            _WAITED_CPU[0] += children_cpu_s() - before  # the job's CPU, counted once it is waited for
        return self.done

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


_JOBS: dict[str, Job] = {}
_ROOT: list[Path] = []
_WAITED_CPU = [0.0]  # CPU seconds of the jobs waited for so far


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def waited_cpu_s() -> float:
    """The CPU seconds of the jobs finished and waited for so far (tests/cpu_account.py keeps them apart)."""
    return _WAITED_CPU[0]


def register(fixture: str, command: Sequence[str], env: dict[str, str], timeout: float = 600) -> None:
    """A job for the tests that use `fixture` (directly or through other fixtures); `{work}` in the command is a
    folder of its own. `env` is the whole environment of the job."""
    _JOBS[fixture] = Job(fixture, list(command), env, timeout)


def register_shared(fixtures: Sequence[str], command: Sequence[str], env: dict[str, str], timeout: float = 600) -> None:
    """One job for the tests that use any of `fixtures`; `{parts}` in the command: those of them a selected test
    uses (all of them where the job starts from a plain call). Each fixture's `result` is the whole process."""
    job = Job("+".join(fixtures), list(command), env, timeout, parts=tuple(fixtures))
    for fixture in fixtures:
        _JOBS[fixture] = job


def running_pids() -> frozenset[int]:
    """The jobs' processes not yet waited for (their CPU is counted apart from the tests')."""
    jobs = {id(job): job for job in _JOBS.values()}.values()
    return frozenset(job.proc.pid for job in jobs if job.proc is not None and job.done is None)


def job_names() -> set[str]:
    return set(_JOBS)


def scratch_root() -> Path:
    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="qlora-background-")))
    return _ROOT[0]


def start_for(fixtures_of_selected_tests: Iterable[Iterable[str]]) -> list[str]:
    """Start every job whose fixture a selected test uses; returns their names."""
    used = {name for fixtures in fixtures_of_selected_tests for name in fixtures}
    jobs = {id(job): job for job in _JOBS.values()}.values()  # a shared job once
    needed = [job for job in jobs if job.proc is None and (used & set(job.parts or (job.name,)))]
    for job in needed:
        job.start(scratch_root(), [part for part in job.parts if part in used])
    return [job.name for job in needed]


def result(name: str) -> subprocess.CompletedProcess:
    """The job's finished process (waits for it); its scratch folder is `work(name)`."""
    return _JOBS[name].wait()


def work(name: str) -> Path:
    folder = _JOBS[name].work
    assert folder is not None, f"background job {name} was never started"
    return folder


def stop_all() -> None:
    for job in {id(job): job for job in _JOBS.values()}.values():
        job.stop()
    for root in _ROOT:
        shutil.rmtree(root, ignore_errors=True)
