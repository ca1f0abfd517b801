"""Wheels carried to an offline GPU machine (`make gpu-wheels`), installed for the GPU check in a folder of its own.

The machine's own packages are never touched: `pip install --no-index --no-deps --target` into `.gpu-site/`, which
the check's processes find first on PYTHONPATH (a later run with the same wheels reuses it). Then the package must
import there; what it still lacks is said in one line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SITE = REPO / ".gpu-site"
# what the checks import (the package's training, planning and tools, transformers' Trainer for the speed check)
PROBE = "import qlora_fsdp.api, qlora_fsdp.plan.report, tests.gpu_check_cases, transformers.trainer, peft"


def install(wheels: Path, site: Path = SITE) -> None:
    """The folder's wheels into `site`, unless it holds exactly them already."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise SystemExit(f"error: no wheels in {wheels}: build the folder with `make gpu-wheels` where a package "
                         "index is reachable, then carry it here")
    stamp, names = site / ".wheels", "\n".join(wheel.name for wheel in found)
    if stamp.is_file() and stamp.read_text() == names:
        return
    shutil.rmtree(site, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", str(site),
               *map(str, found)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: installing {wheels} into {site} failed: {last_line(done.stderr)}")
    stamp.write_text(names)


def environment(site: Path = SITE) -> dict[str, str]:
    """This process's environment with the site folder, then the checkout, first on the path."""
    paths = [str(site), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def missing(env: dict[str, str], probe: str = PROBE) -> str | None:
    """None when the checks import under `env`; else the one line saying what the machine lacks."""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode == 0:
        return None
    return (f"error: with the carried wheels the checks still do not import ({last_line(done.stderr)}); build the "
            "folder again with `make gpu-wheels FULL=1` (the scientific base too) or for this Python and CUDA")


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def run_with_wheels(wheels: Path, argv: list[str], budget_s: float) -> int:
    """Install, check the imports, then run the GPU check (`argv`, without a total budget) in a process that sees
    the site folder first, with what is left of `budget_s`: the install counts against the same 10 minutes."""
    started = time.monotonic()
    install(wheels)
    env = environment()
    problem = missing(env)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    left = budget_s - (time.monotonic() - started)
    print(f"carried wheels ready in {time.monotonic() - started:.0f} s ({SITE.name}/)", file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "tests.gpu_check", *argv, "--total-seconds", f"{left:.0f}"]
    return subprocess.run(command, env=env, cwd=REPO).returncode
