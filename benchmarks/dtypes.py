"""Seconds per training step of a real pretrained model in each compute dtype, on this machine, in one process.

    python -m benchmarks.dtypes                          # SmolLM2-135M-Instruct, float32 then bfloat16
    python -m benchmarks.dtypes --tokens 512 --rows 2 --dtypes float32 bfloat16 float16

Why `auto` picks float32 on a CPU without bf16 units: there, bf16 arithmetic is emulated. Each dtype trains the
same rows (chat records made from the shipped tasks) for `--steps` optimizer steps; the table gives the first
step (warm-up included) and the mean of the others, and the ratio to the first dtype.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from qlora_fsdp.api import train
from qlora_fsdp.tools.real_model import DEFAULT_DIR, make_real_model

DATA = Path("data/tiny_instruct.jsonl")


def chat_records(out: Path, n: int = 200) -> Path:
    with DATA.open() as source, out.open("w") as sink:
        for _, line in zip(range(n), source, strict=False):
            record = json.loads(line)
            user = record["instruction"] + (f"\n\n{record['input']}" if record["input"] else "")
            sink.write(json.dumps({"messages": [{"role": "user", "content": user},
                                                {"role": "assistant", "content": record["output"]}]}) + "\n")
    return out


def step_times(model: Path, data: Path, out: Path, dtype: str, args: argparse.Namespace) -> list[float]:
    overrides = [f"model.path={model}", f"data.path={data}", "data.format=chat", f"model.dtype={dtype}",
                 f"quant.compute_dtype={dtype}", "data.packing=true", f"data.context_length={args.tokens}",
                 f"data.micro_batch_size={args.rows}", "data.grad_accum_steps=1", "data.eval_samples=0",
                 f"train.max_steps={args.steps}", "train.eval_every=0", "train.save_every=0",
                 f"train.output_dir={out}", "train.overwrite=true", "logging.plot=false"]
    train("tiny_cpu", overrides)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in records if "step_time_s" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=256, help="packed row length")
    parser.add_argument("--rows", type=int, default=1, help="rows per step")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    model = make_real_model(args.model)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        data = chat_records(Path(scratch) / "chat.jsonl")
        for dtype in args.dtypes:
            times = step_times(model, data, Path(scratch) / dtype, dtype, args)
            rest = times[1:] or times
            rows.append((dtype, times[0], sum(rest) / len(rest)))
    print(f"\n{model.name}, {args.rows} x {args.tokens} tokens a step, one process\n")
    print("| dtype | first step (s) | later steps (s, mean) | vs " + rows[0][0] + " |\n| --- | ---: | ---: | ---: |")
    for dtype, first, later in rows:
        print(f"| {dtype} | {first:.2f} | {later:.2f} | {later / rows[0][2]:.1f}x |")


if __name__ == "__main__":
    main()
