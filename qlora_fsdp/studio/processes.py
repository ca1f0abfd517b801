"""The studio's helpers for the processes it starts (plans, runs, chat workers): whether one is alive, the ones a
launcher started, and the line that says why one failed."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def child_processes(pid: int) -> list[int]:
    """The processes `pid` started (torchrun's ranks), from /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def last_error_line(stderr: str) -> str:
    """The process's `error:` line, else its last line (a traceback's exception)."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return errors[-1] if errors else (lines[-1] if lines else "error: the plan stopped without a word")
