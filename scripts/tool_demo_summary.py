"""What `make demo-tools` shows: how often the policy called the calculator correctly and got the product right,
early in its GRPO run against late, and on the held-out prompts before and after (the run's metrics.jsonl)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

CORRECT_CALL = "rewards/examples.rewards:correct_tool_call"
KEYS = ((CORRECT_CALL, "rollouts with a correct call (share)"), ("tools/call_frequency", "calls a rollout"),
        ("tools/malformed_frequency", "unreadable calls a rollout"), ("rewards/math_answer", "right answers (share)"))


def mean(rows: list[dict], key: str) -> float:
    return sum(row.get(key, 0.0) for row in rows) / len(rows)


def main() -> None:
    run = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/tiny_cpu_tools_grpo")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward" in row]
    evals = [row for row in rows if f"eval_{CORRECT_CALL}" in row]
    if len(steps) < 4 or len(evals) < 2:
        sys.exit(f"error: {run}/metrics.jsonl holds {len(steps)} GRPO steps and {len(evals)} evaluations; "
                 "the demo's run writes 16 and 2")
    quarter = len(steps) // 4
    early, late = steps[:quarter], steps[-quarter:]
    print(f"| over GRPO's steps | first {quarter} | last {quarter} | held out, before | held out, after |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for key, words in KEYS:
        held = [f"{evals[i].get('eval_' + key, float('nan')):.2f}" for i in (0, -1)] if "rewards/" in key else ["", ""]
        print(f"| {words} | {mean(early, key):.2f} | {mean(late, key):.2f} | {held[0]} | {held[1]} |")


if __name__ == "__main__":
    main()
