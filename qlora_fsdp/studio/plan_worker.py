"""The plan in a worker process: the page asks for a recipe's plan as keys change, and a newer request kills the
older worker (a 70B plan takes seconds of CPU; a superseded one is not waited for).

    python -m qlora_fsdp.studio.plan_worker RECIPE [key=value ...]   # prints the plan as one JSON line
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Any

from qlora_fsdp.config import load_config
from qlora_fsdp.errors import UserError
from qlora_fsdp.studio.draft import Draft
from qlora_fsdp.studio.environment import child_environment

PlanData = dict[str, Any]
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
    time = recipe_time(cfg, step)
    return {"compute": time.compute, "link (exposed after overlap)": time.exposed, "optimizer": time.optimizer,
            "generation": time.generation, "vision tower": time.vision, "total": time.total}


def run_time(planned: Any, step: dict[str, float] | None) -> str:
    """The whole run's predicted time, for the plan's headline ("" where the step has no price: a CPU)."""
    from qlora_fsdp.plan.time_report import hours

    if step is None:
        return ""
    steps = planned.planned.train.max_steps
    return f"{hours(steps * step['total'])} for its {steps:,} steps ({step['total']:.1f} s a step)"


def plan_data(draft: Draft) -> PlanData:
    """What the page draws: the memory rows, the time split, the levers and the text `--plan` prints."""
    from qlora_fsdp.plan.report import plan_levers, plan_recipe, report_text

    planned = plan_recipe(load_config(draft.recipe, list(draft.overrides)))
    result, levers, step = planned.result, plan_levers(planned), time_data(planned)
    return {"fits": result.fits, "description": result.description, "capacity_gib": result.capacity_gib,
            "host_capacity_gib": result.host_capacity_gib, "gpu_rows": rows_data(result.gpu_rows),
            "generating_rows": rows_data(result.generating_rows), "host_rows": rows_data(result.host_rows),
            "time": step, "run_time": run_time(planned, step), "text": report_text(planned, levers),
            "levers": [{"label": lever.label, "overrides": lever.overrides, "gpu_gib": lever.gpu_gib,
                        "cost": lever.cost} for lever in levers]}


def main(argv: list[str]) -> int:
    try:
        data = plan_data(Draft(argv[0], tuple(argv[1:])))
    except UserError as err:
        data = {"error": f"error: {err}"}
    print(json.dumps(data), flush=True)
    return 0


class PlanWorker:
    """One plan at a time; `plan` from a newer request ends the older one's process (its caller gets None)."""

    def __init__(self, settle_s: float = SETTLE_S) -> None:
        self.lock = threading.Lock()
        self.current: subprocess.Popen[str] | None = None
        self.superseded = 0  # plans ended by a newer request (the page's tests read it)
        self.settle_s = settle_s
        self.requests = 0  # every request so far: one that is no longer the latest once settled starts nothing
        self.started = 0  # worker processes started (the page's tests read it)

    def plan(self, draft: Draft, timeout_s: float = 600.0) -> PlanData | None:
        with self.lock:
            self.requests += 1
            mine = self.requests
        time.sleep(self.settle_s)  # edits come in bursts (a field, then the next): only the last one is planned
        with self.lock:
            if mine != self.requests:
                return None
            if self.current is not None and self.current.poll() is None:
                self.current.kill()
                self.superseded += 1
            self.started += 1
            proc = subprocess.Popen([sys.executable, "-m", "qlora_fsdp.studio.plan_worker", draft.recipe,
                                     *draft.overrides], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=child_environment())
            self.current = proc
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return {"error": f"error: the plan took over {timeout_s:.0f} s and was stopped"}
        if proc.returncode < 0:  # killed: a newer request replaced it
            return None
        lines = out.strip().splitlines()
        if proc.returncode != 0 or not lines:
            return {"error": last_error_line(err)}
        return dict(json.loads(lines[-1]))

    def close(self) -> None:
        with self.lock:
            if self.current is not None and self.current.poll() is None:
                self.current.kill()


def last_error_line(stderr: str) -> str:
    """The process's `error:` line, else its last line (a traceback's exception)."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return errors[-1] if errors else (lines[-1] if lines else "error: the plan stopped without a word")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
