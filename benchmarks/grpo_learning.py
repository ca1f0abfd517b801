"""GRPO learning from a reward on a real small instruct model: SmolLM2-135M-Instruct (`make real-model`) in NF4 with
LoRA, two CPU ranks (torchrun, gloo), locally generated addition prompts, the built-in `math_answer` reward (the
completion's last number against the record's `#### answer`).

    python -m benchmarks.grpo_learning               # 30 steps, about 10 minutes on 2 cores
    python -m benchmarks.grpo_learning --steps 10

Prints the mean reward a step, the completions of the first and the last generation with their rewards, and the time
a step takes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def write_prompts(path: Path, n: int, seed: int = 7) -> Path:
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(n):
            a, b = rng.randint(1, 20), rng.randint(1, 20)
            question = f"What is {a} plus {b}? Reply with the number only."
            out.write(json.dumps({"prompt": [{"role": "user", "content": question}], "answer": f"#### {a + b}"}) + "\n")
    return path


def run(args: argparse.Namespace) -> Path:
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    prompts = write_prompts(work / "addition.jsonl", 400)
    out = work / "run"
    overrides = [f"model.path={args.model}", "model.dtype=float32", "quant.compute_dtype=float32",
                 f"data.path={prompts}", "data.context_length=96", "data.micro_batch_size=2", "data.eval_samples=8",
                 "generation.num_generations=8", "generation.max_completion_length=12",
                 "grpo.rewards=[{function: math_answer}]",
                 "optim.lr=5e-4", f"train.max_steps={args.steps}", f"train.output_dir={out}", "train.overwrite=true",
                 "logging.plot=false"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO / "train.py"), "--recipe", "tiny_cpu_grpo", *overrides]
    subprocess.run(command, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    return out


def report(out: Path, steps: int) -> None:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in records if "reward" in r]
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    print(f"GRPO on SmolLM2-135M-Instruct (NF4 + LoRA), 2 CPU ranks, {steps} steps of 4 prompts x 8 completions\n")
    print("| steps | mean reward | completion length | step time (s) |\n| --- | ---: | ---: | ---: |")
    for start in range(0, len(rows), 5):
        part = rows[start : start + 5]
        mean = sum(r["reward"] for r in part) / len(part)
        length = sum(r["completion_length"] for r in part) / len(part)
        seconds = sum(r["step_time_s"] for r in part) / len(part)
        print(f"| {part[0]['step']}-{part[-1]['step']} | {mean:.3f} | {length:.1f} | {seconds:.1f} |")
    for label, sample in (("first", samples[0]), ("last", samples[-1])):
        print(f"\n{label} generation (step {sample['step']}): {sample['prompt'][0]['content']}")
        for text, reward in zip(sample["completions"], sample["rewards"], strict=True):
            print(f"  {reward:+.1f}  {text.strip()[:60]!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "bench-grpo-learning")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        sys.exit(f"{args.model} is missing: make real-model")
    report(run(args), args.steps)


if __name__ == "__main__":
    main()
