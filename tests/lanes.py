"""`make test`: the suite as two pytest sessions at once, each with its own files, so both cores work.

One session keeps about 1.2 of a 2-core machine busy (tests/background.py): most tests are one process, and a
pool test's two ranks wait on each other as much as they compute. Two sessions side by side take about two thirds
of one session's time (measured: `make test` 46.9 -> 31.6 min). LANE_B holds the files that load real models,
drive the studio or run subprocesses on their own (kept together: the studio's tests read the same outputs/
folder, the real models' tests share one conversion, tests/conftest.py); every other file runs in lane A, the
planner's with its one background job. A second lane starts its own rank pool and its own background jobs; a
real model asked for by both is converted once (qlora_fsdp/tools/real_model.py waits on a lock).

Each lane's lines are printed as they come, prefixed `[a]` or `[b]`; at the end, each lane's wall time and one
CPU table of both sessions (tests/cpu_account.py). The exit status is the first failing lane's.

    python -m tests.lanes [pytest options]   # what `make test` runs: the options go to both sessions
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from tests import cpu_account

TESTS = Path(__file__).resolve().parent
# about half of the suite's wall time (docs/benchmarks/test-suite.md has the lanes' figures of the last run)
LANE_B = ("test_studio_browser.py", "test_studio.py", "test_studio_data.py", "test_studio_hardware.py",
          "test_gguf_export.py", "test_real_model.py", "test_prequantized.py", "test_real_gemma.py",
          "test_lora_inits.py", "test_gpu_check.py", "test_compile.py", "test_resume.py")


def lanes() -> dict[str, list[str]]:
    """Lane name -> its test files (paths relative to the repository)."""
    files = sorted(path.name for path in TESTS.glob("test_*.py"))
    missing = sorted(set(LANE_B) - set(files))
    if missing:
        raise SystemExit(f"tests/lanes.py: LANE_B names {', '.join(missing)}, which tests/ lacks: update LANE_B")
    return {"a": [f"tests/{name}" for name in files if name not in LANE_B], "b": [f"tests/{name}" for name in LANE_B]}


def stream(name: str, proc: subprocess.Popen[str], started: float, took: dict[str, float]) -> None:
    """The lane's lines, prefixed, as they come; then its wall time."""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()
    proc.wait()
    took[name] = time.monotonic() - started


def combined_table(accounts: list[Path]) -> list[str]:
    by_file: dict[str, float] = defaultdict(float)
    by_test: dict[str, float] = {}
    total = 0.0
    for path in accounts:
        if not path.is_file():  # a session that ended before its summary (collection error, ^C)
            continue
        account = json.loads(path.read_text())
        for file, cpu in account["by_file"].items():
            by_file[file] += cpu
        by_test.update(account["by_test"])
        total += account["total"]
    return cpu_account.summary_lines(by_file, by_test, total) if total >= 1 else []


def main(pytest_args: list[str]) -> int:
    scratch = Path(tempfile.mkdtemp(prefix="qlora-lanes-"))
    procs: dict[str, subprocess.Popen[str]] = {}
    threads: list[threading.Thread] = []
    started, took = time.monotonic(), {}
    chosen = lanes()
    for name, files in chosen.items():
        env = {**os.environ, "QLORA_CPU_ACCOUNT": str(scratch / f"{name}.json")}
        procs[name] = subprocess.Popen([sys.executable, "-m", "pytest", *pytest_args, *files], cwd=TESTS.parent,
                                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       bufsize=1)
        threads.append(threading.Thread(target=stream, args=(name, procs[name], started, took), daemon=True))
        threads[-1].start()
    try:
        for thread in threads:
            thread.join()
    except KeyboardInterrupt:
        for proc in procs.values():
            proc.terminate()
        raise
    print("\n".join([f"= both lanes: {cpu_account.TITLE} =", *combined_table(sorted(scratch.glob("*.json")))]))
    for name, proc in procs.items():
        print(f"[lanes] lane {name}: {len(chosen[name])} files, exit {proc.returncode}, {took[name]:.0f} s wall")
    shutil.rmtree(scratch, ignore_errors=True)
    return next((proc.returncode for proc in procs.values() if proc.returncode), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
