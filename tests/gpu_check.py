"""The one command to run on a GPU: what the CPU test suite cannot show, checked on the device.

    make gpu-check                                  # all eleven checks, at most 10 minutes on one H100/4090
    make gpu-check-quick                            # grpo_generation alone: at most 8 minutes
    python -m tests.gpu_check --out docs/gpu_check.md   # also write the table (and its figures as .json)
    python -m tests.gpu_check --only nan_canary,fsdp_real_path
    python -m tests.gpu_check --dry-run           # CPU, small sizes; what needs CUDA is listed as skipped
    python -m tests.gpu_check --wheels gpu-wheels   # an offline machine with only torch: what `make gpu-wheels`
                                                    # brought, installed into .gpu-site/ first (tests/gpu_site.py)

Checks (each in its own process, with its own time budget, so an OOM, a crash or a fake process group stays
inside it: on a GPU a fresh `python -m tests.gpu_check_cases`, on the CPU a fork of this process, which imported
torch and the checks once; `python -m tests.gpu_check_cases NAME --device cpu` runs one in the foreground, at CPU
sizes):
  grpo_generation       GRPO's decoding at Llama 3.2 1B's shapes (32 rows with and without CUDA graphs, 128 rows),
                        with the fused kernels and without: tokens/s against transformers' generate, a decoding
                        step against the plan (fused: within 25% or failed) and the memory-bandwidth bound at
                        the card's measured bandwidth (benchmarks/grpo_generation.py)
  nan_canary            all 65,536 bf16 bit patterns through FSDP2's all-gather copy-in, as bf16 and as uint8
  fsdp_real_path        Llama 3.1 70B architecture (2 layers) sharded over a fake 2-rank group: every gathered
                        4-bit weight equals this rank's loaded shard byte for byte (offload on and off)
  merge_device          a tiny adapter (2 steps) merged with --device cuda against --device cpu
  generate              scripts/generate.py's command (its main) with that adapter prints tokens
  plan_vs_measured_70b  llama70b_2x4090 as rank 0 of 2, GPU capped at 24 GiB: measured peak against the plan
  one_gpu_70b_offload   70B on one GPU with CPU offload: peak GPU memory, host RSS, tokens/s
  memory_levers         70B layer shapes and vocabulary at 8,192 tokens: peak memory and tokens/s of full vs
                        chunked loss, activation offload, selective and no checkpointing, the LoRA matmuls in fp32
                        and PEFT's unfused LoRA forward, each beside the step-time model's tokens/s
                        for this GPU (plan/step_time.py)
  packed_attention      every attention kernel here keeps packed samples apart (loss packed = alone: sdpa,
                        sdpa_varlen, flex, flash-attn if installed); per-sample vs dense mask at 4,096 tokens
  training_speed        one GPU at Llama 3.1 8B's shapes (8 layers, random weights), 2,048-token rows of long-tailed
                        samples: train.py's tokens/s and peak beside transformers' Trainer + PEFT + bitsandbytes on the
                        same records and steps, and the plan's (tests/gpu_check_speed.py)
  moe_experts           Qwen3-30B-A3B's experts (128, top-8, 2,048 tokens, bf16) four ways: unquantized as
                        transformers, 4-bit a gather per expert, 4-bit grouped (ours), one grouped matmul
  long_rows             llama3_8b_1x4090_long's and gpt_oss_20b_1x24gb_long's levers at their layer shapes (2
                        layers), GPU capped at 24 GiB: rows of 64k tokens and up until one does not fit; the
                        largest, and every trained row's peak within 10% of the plan
Nothing is fetched from a hub: the models are built locally from config.json (random weights).
Exit code: 0 when no check that ran failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CASES_COMMAND = [sys.executable, "-m", "tests.gpu_check_cases"]  # then: NAME --device D --work W --result R
CASES_COMMAND = DEFAULT_CASES_COMMAND  # a test puts fake cases here; the CPU forks only the real ones
TOTAL_SECONDS = 570  # under the 10 minutes a device command may run, start-up included
LOG_TAIL_LINES = 15


@dataclass
class Row:
    """One line of the table: a check, or one part of it."""

    check: str
    status: str  # passed | failed | skipped | info (informational: never fails the run)
    result: str
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Check:
    name: str
    budget_s: int
    cuda_only: bool


# the most telling first, so a short lease still yields them: the 70B as rank 0 of 2 against its plan, the FSDP path
# byte for byte, GRPO's generation (`make gpu-check-quick` runs it alone), long rows against their plans, offload,
# one GPU's speed beside the Trainer; then what the CPU tests already emulate
CHECKS = (
    Check("plan_vs_measured_70b", 240, cuda_only=True),
    Check("fsdp_real_path", 150, cuda_only=False),
    Check("grpo_generation", 450, cuda_only=False),
    Check("long_rows", 300, cuda_only=False),
    Check("one_gpu_70b_offload", 240, cuda_only=True),
    Check("training_speed", 240, cuda_only=False),
    Check("export_rounding", 90, cuda_only=False),
    Check("nan_canary", 60, cuda_only=False),
    Check("memory_levers", 200, cuda_only=False),
    Check("packed_attention", 90, cuda_only=False),
    Check("moe_experts", 90, cuda_only=False),
    Check("merge_device", 90, cuda_only=False),
    Check("generate", 60, cuda_only=False),
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="run on the CPU at small sizes, skip what needs CUDA (the default without a GPU)")
    parser.add_argument("--only", type=selected_checks, default=[c.name for c in CHECKS],
                        help=f"comma-separated subset of: {', '.join(c.name for c in CHECKS)}")
    parser.add_argument("--out", type=Path, help="write the table to this file and its figures to FILE.json")
    parser.add_argument("--total-seconds", type=float, default=TOTAL_SECONDS,
                        help=f"time budget of the whole run (default {TOTAL_SECONDS}); each check also has its own")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, adapter, merged models)")
    parser.add_argument("--wheels", type=Path, help="a folder from `make gpu-wheels`: installed into .gpu-site/ "
                        "(the machine's own packages untouched), then the checks run with it first on the path")
    return parser.parse_args(argv)


def selected_checks(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = {c.name for c in CHECKS}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown check {unknown[0] if unknown else '(none)'}; "
                                         f"choose from {', '.join(c.name for c in CHECKS)}")
    return names


def cuda_available() -> bool:
    # in a child process: the parent then never creates a CUDA context of its own (it would skew the figures)
    probe = "import torch; print(torch.cuda.is_available())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=child_env(None))
    return done.stdout.strip() == "True"


def child_env(device: str | None) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a dry run on a GPU machine stays on the CPU, training included
    return env


def run_check(check: Check, device: str, work: Path, timeout: float) -> tuple[list[Row], dict[str, Any]]:
    """The check in its own process; its rows, and the environment it reports (device name, versions)."""
    result, log = work / f"{check.name}.json", work / f"{check.name}.log"
    argv = [check.name, "--device", device, "--work", str(work), "--result", str(result)]
    if device == "cpu" and CASES_COMMAND == DEFAULT_CASES_COMMAND:
        code = forked_check(argv, device, log, timeout)
    else:
        code = process_check([*CASES_COMMAND, *argv], device, log, timeout)
    if code is None:
        return [Row(check.name, "failed", f"timed out after {timeout:.0f} s (killed); see {log.name}")], {}
    if not result.is_file():
        return [Row(check.name, "failed", f"crashed with exit code {code}; see {log.name}")], {}
    data = json.loads(result.read_text())
    return [Row(**row) for row in data["rows"]], data.get("env", {})


def process_check(command: list[str], device: str, log: Path, timeout: float) -> int | None:
    """The check as a fresh process: its exit code, None when it ran past `timeout` (then it is killed)."""
    try:
        with log.open("w") as out:
            return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=child_env(device), cwd=REPO,
                                  timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return None


def forked_check(argv: list[str], device: str, log: Path, timeout: float) -> int | None:
    """tests.gpu_check_cases' main(argv) in a fork of this process, which imports it (torch, transformers, PEFT,
    bitsandbytes) once for all the checks instead of once per check: each check is still a process of its own, its
    output to `log`, killed with its whole group past `timeout` (then None). The CPU only: a fork must not inherit a
    CUDA context, and this process never needs one there."""
    import tests.gpu_check_cases as cases

    gc.freeze()  # the imports' objects, out of the collector's sight: a check's gc.collect walks only its own
    sys.stdout.flush()
    sys.stderr.flush()
    with log.open("w") as out:
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller's frames
            code = 1
            try:
                os.setpgid(0, 0)  # a group of its own: a timeout ends whatever it started with it
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                os.chdir(REPO)
                os.environ.update(child_env(device))
                code = cases.main(argv)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
    try:
        os.setpgid(pid, pid)  # also here: the child may not have run yet
    except (PermissionError, ProcessLookupError):
        pass  # it has, and its group is its own already
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
    return None


def log_tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join("    " + line for line in lines[-LOG_TAIL_LINES:])


def run_all(names: list[str], device: str, work: Path, total_s: float) -> tuple[list[Row], dict[str, Any]]:
    rows: list[Row] = []
    env: dict[str, Any] = {}
    deadline = time.monotonic() + total_s
    for check in (c for c in CHECKS if c.name in names):
        left = deadline - time.monotonic()
        if check.cuda_only and device != "cuda":
            rows.append(Row(check.name, "skipped", "needs a CUDA device (dry run)"))
        elif left < 5:
            rows.append(Row(check.name, "skipped", "no time left in the total budget"))
        else:
            started = time.monotonic()
            check_rows, check_env = run_check(check, device, work, min(check.budget_s, left))
            rows += check_rows
            env = env or check_env
            took = time.monotonic() - started
            failed = any(r.status == "failed" for r in check_rows)
            print(f"{check.name}: {'failed' if failed else 'done'} in {took:.1f} s", file=sys.stderr, flush=True)
            if failed:
                print(log_tail(work / f"{check.name}.log"), file=sys.stderr, flush=True)
            continue
        print(f"{check.name}: skipped", file=sys.stderr, flush=True)
    return rows, env


def format_value(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def format_table(rows: list[Row]) -> str:
    lines = ["| check | result | figures | status |", "| --- | --- | --- | --- |"]
    for row in rows:
        figures = ", ".join(f"{k} {format_value(v)}" for k, v in row.figures.items())
        cells = [row.check, row.result, figures or "-", row.status]
        lines.append("| " + " | ".join(" ".join(c.split()).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def headline(argv: list[str], device: str, env: dict[str, Any], wall_s: float) -> str:
    command = " ".join(["python -m tests.gpu_check", *argv])
    parts = [f"`{command}`", env.get("device_name", device),
             *(f"{k} {env[k]}" for k in ("torch", "bitsandbytes") if k in env),
             datetime.date.today().isoformat(), f"{wall_s:.0f} s wall"]
    if device == "cpu":
        parts.append("dry run: CPU, small sizes")
    return "; ".join(parts)


@contextmanager
def work_dir(keep: bool) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        yield path
    finally:
        if keep:
            print(f"work folder kept: {path}", file=sys.stderr)
        else:
            shutil.rmtree(path, ignore_errors=True)


def write_outputs(out: Path, text: str, rows: list[Row], device: str, env: dict[str, Any], wall_s: float) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    figures = {"device": device, "env": env, "wall_s": wall_s, "date": datetime.date.today().isoformat(),
               "checks": [asdict(r) for r in rows]}
    json_path = out.with_suffix(".json") if out.suffix != ".json" else out.with_name(out.name + ".json")
    json_path.write_text(json.dumps(figures, indent=2) + "\n")


def without_option(argv: list[str], option: str) -> list[str]:
    """argv less `option VALUE` / `option=VALUE`."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == option:
            skip = True
        elif not item.startswith(option + "="):
            out.append(item)
    return out


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.wheels:
        from tests.gpu_site import run_with_wheels

        rest = without_option(without_option(argv, "--wheels"), "--total-seconds")
        return run_with_wheels(args.wheels, rest, args.total_seconds)
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is fetched, whatever the caller's environment says
    started = time.monotonic()
    device = "cpu" if args.dry_run or not cuda_available() else "cuda"
    if device == "cpu" and not args.dry_run:
        print("no CUDA device: dry run (CPU, small sizes)", file=sys.stderr)
    with work_dir(args.keep) as work:
        rows, env = run_all(args.only, device, work, args.total_seconds)
    wall = time.monotonic() - started
    text = headline(argv, device, env, wall) + "\n\n" + format_table(rows)
    print(text)
    if args.out:
        write_outputs(args.out, text, rows, device, env, wall)
    return 1 if any(r.status == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
