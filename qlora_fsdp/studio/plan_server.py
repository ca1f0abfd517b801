"""The warm plan server the page's PlanWorker starts (`python -m qlora_fsdp.studio.plan_server`): one process imports
the planner once (torch, transformers and the planner take about 13 s of CPU, more than a tiny recipe's whole plan)
and forks a child per plan. The child writes its plan to a file, whole, and the steps it measured beside it; the
server keeps those steps, so no later plan measures them again (an edit of the steps, the lr or the output folder
plans in a fraction of a second; a step of a 70B takes tens of seconds).

A request ends the plans under way, except one measuring the very step the request needs: that one finishes, and
the new plan waits for it and plans with its steps, so a burst of such edits during a long measurement measures it
once.
Requests are lines on stdin ({"recipe", "overrides", "out"}); each is answered with {"pid", "ended"}: the new
plan's process and how many plans under way it ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import sys
import time
from pathlib import Path
from typing import Any

from qlora_fsdp.config import load_config
from qlora_fsdp.studio.draft import Draft
from qlora_fsdp.studio.plan_worker import plan_or_error
from qlora_fsdp.studio.processes import alive

STEPS_SUFFIX = ".steps"  # a child's measured steps, beside its plan


class Children:
    """The plans under way: pid -> the step it measures (None: a plan waiting for another's, or of a known step)
    and the file its plan goes to."""

    def __init__(self) -> None:
        self.measuring: dict[int, tuple[str | None, Path]] = {}

    def measurer(self, key: str | None) -> tuple[int, Path] | None:
        """The plan under way measuring `key`'s step, if any: its process and its plan's file."""
        return next(((pid, out) for pid, (k, out) in list(self.measuring.items())
                     if key is not None and k == key and alive(pid)), None)

    def end_all_but(self, spared: int | None) -> int:
        """Kill every plan under way but `spared`; how many were still running."""
        ended = 0
        for pid in list(self.measuring):
            if pid != spared:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    ended += 1
                self.measuring.pop(pid, None)
        return ended

    def reap(self, signum: int, frame: Any) -> None:
        """Wait for the children as they end: none lingers, and their CPU time counts in the server's."""
        with contextlib.suppress(ChildProcessError):
            while (pid := os.waitpid(-1, os.WNOHANG)[0]) != 0:
                self.measuring.pop(pid, None)


def serve() -> None:
    import qlora_fsdp.plan.levers  # noqa: F401  (what the children run, imported before they are forked)
    import qlora_fsdp.plan.report  # noqa: F401

    children = Children()
    signal.signal(signal.SIGCHLD, children.reap)
    steps: dict[str, Any] = {}  # every step the plans have measured, by setting: each forked plan starts with them
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        take_measured_steps(Path(request["out"]).parent, steps)
        key = step_key(Draft(request["recipe"], tuple(request["overrides"])), steps)
        awaited = children.measurer(key)
        ended = children.end_all_but(awaited[0] if awaited else None)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the planner waits for processes of its own
            os._exit(write_plan(request, awaited, steps))
        children.measuring[pid] = (key if awaited is None else None, Path(request["out"]))
        print(json.dumps({"pid": pid, "ended": ended}), flush=True)
    children.end_all_but(None)  # the page closed the pipe: no plan outlives it


def step_key(draft: Draft, steps: dict[str, Any]) -> str | None:
    """The setting of the step the draft's plan measures first (None where the draft does not load, or the step is
    among `steps` already: no plan need wait for it)."""
    from qlora_fsdp.plan.report import first_step_setting

    try:
        key = first_step_setting(load_config(draft.recipe, list(draft.overrides)))
    except Exception:  # the plan itself says what is wrong with the draft
        return None
    return None if key in steps else key


def write_plan(request: dict[str, Any], awaited: tuple[int, Path] | None, steps: dict[str, Any]) -> int:
    """The plan (a child of the server, `steps` its copy of the server's): its data to `out`, and the steps it
    measured beside it. Where another plan was measuring its step (`awaited`: its process and plan file), it plans
    once that one has ended, with its steps."""
    out = Path(request["out"])
    if awaited is not None:
        while alive(awaited[0]):
            time.sleep(0.05)
        with contextlib.suppress(FileNotFoundError):  # none where it failed (or the server took them: only at a
            # newer request, which ends this plan too)
            steps.update(pickle.loads(awaited[1].with_suffix(STEPS_SUFFIX).read_bytes()))
    known = set(steps)
    try:
        data = plan_or_error(Draft(request["recipe"], tuple(request["overrides"])), steps)
    except Exception as err:  # a planner's failure, said in one line (the page shows it; the server goes on)
        data = {"error": f"error: the plan failed: {type(err).__name__}: {err}"}
    new_steps = {key: step for key, step in steps.items() if key not in known}
    data["steps_measured"] = len(new_steps)
    if new_steps:
        write_whole(out.with_suffix(STEPS_SUFFIX), pickle.dumps(new_steps))
    write_whole(out, json.dumps(data).encode())
    return 0


def write_whole(path: Path, data: bytes) -> None:
    """`path` appears whole or not at all (a plan killed while writing leaves only a .partial)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    partial.replace(path)


def take_measured_steps(folder: Path, steps: dict[str, Any]) -> None:
    """The steps finished plans measured, kept in the server's `steps` (the files, the children's own in the worker's
    private folder, removed), so that every plan forked later has them."""
    for path in sorted(folder.glob(f"*{STEPS_SUFFIX}")):
        steps.update(pickle.loads(path.read_bytes()))
        path.unlink()


if __name__ == "__main__":
    serve()
