"""DPO's two reference strategies side by side: a forward with the adapter off on every micro-batch, and the
reference log-probabilities computed once before training (preference.reference).

Each run is `torchrun --nproc_per_node 2 train.py --recipe tiny_cpu_dpo` (or --recipe/--model given here) with one
strategy; the table gives the median step time (steps 4 on), the run's peak memory (largest rank), the time before
the first step that precomputing adds, the whole run's wall time, and the final held-out reward accuracy.

    python -m benchmarks.dpo_reference            # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
STRATEGIES = ("adapter_off", "precomputed")


def run(strategy: str, out: Path, overrides: list[str], recipe: str) -> dict[str, Any]:
    command = [TORCHRUN, "--standalone", "--nproc_per_node", "2", "train.py", "--recipe", recipe,
               f"train.output_dir={out}", "train.overwrite=true", f"preference.reference={strategy}", *overrides]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{strategy} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_time_s" in r]
    summary = records[-1]
    return {"strategy": strategy, "step_s": statistics.median(r["step_time_s"] for r in steps[3:]),
            "peak_gib": max(r["peak_memory_gib"] for r in steps), "train_s": summary["train_runtime_s"],
            "wall_s": wall, "accuracy": summary.get("eval_reward_accuracy_end", float("nan"))}


def table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    lines = ["| reference | step time (median) | vs adapter off | peak memory, largest rank | training time | "
             "whole run (wall) | held-out reward accuracy |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['strategy']} | {row['step_s'] * 1000:.0f} ms | {row['step_s'] / base['step_s']:.2f}x | "
                     f"{row['peak_gib']:.3f} GiB | {row['train_s']:.1f} s | {row['wall_s']:.1f} s | "
                     f"{row['accuracy']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny_cpu_dpo")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides for both runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        rows = [run(s, Path(scratch) / s, args.overrides, args.recipe) for s in STRATEGIES]
    print(table(rows))


if __name__ == "__main__":
    main()
