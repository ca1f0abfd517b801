"""The plan in a worker process: the page asks for a recipe's plan as keys change, and a newer request ends the
older plan (a 70B plan takes a minute of CPU; a superseded one is not waited for). The plans run in children of a
warm server (plan_server.py), which keeps the steps they measured.

    python -m qlora_fsdp.studio.plan_worker RECIPE [key=value ...]   # prints the plan as one JSON line
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from qlora_fsdp.config import load_config
from qlora_fsdp.errors import UserError
from qlora_fsdp.studio.draft import Draft
from qlora_fsdp.studio.environment import child_environment
from qlora_fsdp.studio.processes import alive

PlanData = dict[str, Any]
KEPT_PLANS = 16  # plans answered again without a process (a tiny plan is kilobytes, a 70B's levers a few more)
SETTLE_S = 1.0  # a request waits this long for a newer one before its worker starts (a start costs seconds of CPU)


def rows_data(rows: list[Any]) -> list[dict[str, Any]]:
    from qlora_fsdp.plan.memory import GIB

    return [{"name": r.name, "gib": r.bytes / GIB, "basis": r.basis} for r in rows]


def time_data(planned: Any) -> dict[str, float] | None:
    """The step's seconds by kind of work, on the recipe's GPUs; None where the GPU has no rates (a CPU)."""
    from qlora_fsdp.plan.memory import gpu_spec
    from qlora_fsdp.plan.time_report import recipe_time

    cfg, step = planned.planned, planned.result.step
    if step is None or not gpu_spec(cfg).priced:
        return None
    time = recipe_time(planned.planning, cfg, step)
    return {"compute": time.compute, "link (exposed after overlap)": time.exposed, "optimizer": time.optimizer,
            "generation": time.generation, "vision tower": time.vision, "total": time.total}


def run_time(planned: Any, step: dict[str, float] | None) -> str:
    """The whole run's predicted time, for the plan's headline ("" where the step has no price: a CPU)."""
    from qlora_fsdp.plan.time_report import hours

    if step is None:
        return ""
    steps = planned.planned.train.max_steps
    return f"{hours(steps * step['total'])} for its {steps:,} steps ({step['total']:.1f} s a step)"


def plan_data(draft: Draft, steps: dict[str, Any]) -> PlanData:
    """What the page draws: the memory rows, the time split, the levers and the text `--plan` prints. `steps`: the
    steps measured before, by setting (the plan adds its own)."""
    from qlora_fsdp.plan.report import plan_levers, plan_recipe, report_text

    planned = plan_recipe(load_config(draft.recipe, list(draft.overrides)), steps)
    result, levers, step = planned.result, plan_levers(planned), time_data(planned)
    return {"fits": result.fits, "description": result.description, "capacity_gib": result.capacity_gib,
            "host_capacity_gib": result.host_capacity_gib, "gpu_rows": rows_data(result.gpu_rows),
            "generating_rows": rows_data(result.generating_rows), "host_rows": rows_data(result.host_rows),
            "time": step, "run_time": run_time(planned, step), "text": report_text(planned, levers),
            "levers": [{"label": lever.label, "overrides": lever.overrides, "gpu_gib": lever.gpu_gib,
                        "cost": lever.cost} for lever in levers]}


def plan_or_error(draft: Draft, steps: dict[str, Any]) -> PlanData:
    try:
        return plan_data(draft, steps)
    except UserError as err:
        return {"error": f"error: {err}"}


class PlanWorker:
    """One plan at a time, in children of the warm server; `plan` from a newer request ends the older one (its caller
    gets None; the server lets its process finish where it measures the step the newer one needs), and a request
    followed within `settle_s` by a newer one starts nothing."""

    def __init__(self, settle_s: float = SETTLE_S) -> None:
        self.lock = threading.Lock()
        self.server: subprocess.Popen[str] | None = None
        self.current: int | None = None  # the pid of the plan under way
        self.results = Path(tempfile.mkdtemp(prefix="qlora-studio-plans-"))
        self.superseded = 0  # plans ended by a newer request (the page's tests read it)
        self.settle_s = settle_s
        self.requests = 0  # every request so far: one that is no longer the latest once settled starts nothing
        self.started = 0  # plans started (the page's tests read it)
        self.done: dict[tuple[Any, ...], PlanData] = {}  # the latest plans, by draft: asked again, answered at once

    def warm_server(self) -> subprocess.Popen[str]:
        """The server, started on the first request (and again should it have died)."""
        if self.server is None or self.server.poll() is not None:
            self.server = subprocess.Popen([sys.executable, "-m", "qlora_fsdp.studio.plan_server"],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                           text=True, bufsize=1, env=child_environment())
            assert self.server.stdout is not None and self.server.stdout.readline().strip() == "ready", \
                "the plan server did not start"
        return self.server

    def start(self, draft: Draft, out: Path) -> int:
        server = self.warm_server()
        assert server.stdin is not None and server.stdout is not None
        request = {"recipe": draft.recipe, "overrides": list(draft.overrides), "out": str(out)}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        answer = json.loads(server.stdout.readline())
        self.superseded += answer["ended"]  # the plans under way it ended
        return int(answer["pid"])

    def plan(self, draft: Draft, timeout_s: float = 600.0) -> PlanData | None:
        key = planned_key(draft)
        with self.lock:
            self.requests += 1
            mine = self.requests
            if key in self.done:  # planned before (a recipe picked again, the page reopened): no process at all
                self.end_current()
                return dict(self.done[key])
        time.sleep(self.settle_s)  # edits come in bursts (a field, then the next): only the last one is planned
        with self.lock:
            if mine != self.requests:
                return None
            out = self.results / f"{mine}.json"
            self.current = pid = self.start(draft, out)
            self.started += 1
        data = self.result(pid, out, mine, timeout_s)
        if data is not None and "error" not in data:
            with self.lock:
                self.done[key] = data
                while len(self.done) > KEPT_PLANS:
                    self.done.pop(next(iter(self.done)))
        return data

    def end_current(self) -> None:
        """A newer request ends the plan under way (its caller then gets None)."""
        if self.current is not None and alive(self.current):
            os.kill(self.current, signal.SIGKILL)
            self.superseded += 1

    def result(self, pid: int, out: Path, mine: int, timeout_s: float) -> PlanData | None:
        """The child's plan once written; None once a newer request has come."""
        deadline = time.monotonic() + timeout_s
        while not out.is_file():
            if mine != self.requests:  # superseded (its process ended, or spared to finish a step the newer needs)
                return None
            if not alive(pid):
                if out.is_file():  # written just before it exited
                    break
                return None if mine != self.requests else {"error": "error: the plan's process ended without a "
                                                                     "plan (out of memory?)"}
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                return {"error": f"error: the plan took over {timeout_s:.0f} s and was stopped"}
            time.sleep(0.1)
        data = dict(json.loads(out.read_text()))
        out.unlink()
        return data

    def close(self) -> None:
        with self.lock:
            if self.current is not None and alive(self.current):
                os.kill(self.current, signal.SIGKILL)
            if self.server is not None and self.server.poll() is None:
                assert self.server.stdin is not None
                self.server.stdin.close()  # the server ends the plans under way and exits
                try:
                    self.server.wait(10)
                except subprocess.TimeoutExpired:
                    self.server.kill()
                    self.server.wait()
        shutil.rmtree(self.results, ignore_errors=True)


def planned_key(draft: Draft) -> tuple[Any, ...]:
    """What a plan depends on: the recipe, its overrides, and the recipe file's time where it is a file of one's own
    (edited since, it is planned again)."""
    path = Path(draft.recipe)
    return draft.recipe, draft.overrides, path.stat().st_mtime if path.is_file() else None
