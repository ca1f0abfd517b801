"""Where one training step's CPU time goes, by kind of op: the profile behind benchmarks/training_speed.py.

One micro-batch of the benchmark's packed rows (its model, data and settings: a folder that
`python -m benchmarks.training_speed --work DIR` prepared), forward and checkpointed backward, after one
warm-up, under torch.profiler; each op's self CPU time summed into a few kinds. Each setting runs in its own
process, one after another.

    python -m benchmarks.step_profile --work DIR                       # fused (the default) against unfused
    python -m benchmarks.step_profile --work DIR --settings "lora.compute_dtype=base"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# op name -> kind, by the first rule whose words are in the name (checked in order)
KINDS = (
    ("matmuls", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("attention", ("attention", "sdpa", "flash")),
    ("4-bit dequantization", ("bitsandbytes", "dequantize")),
    ("dtype copies", ("aten::copy_", "aten::_to_copy")),
    ("stack and split (fusion)", ("aten::cat", "aten::split", "aten::narrow", "aten::slice")),
    ("element-wise", ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::silu", "aten::neg", "aten::rsqrt",
                      "aten::pow", "aten::mean", "aten::exp", "aten::sigmoid", "aten::where", "aten::fill_",
                      "aten::zero_", "aten::cos", "aten::sin", "aten::log", "aten::sum")),
)
DEFAULT_SETTINGS = ["", "lora.fuse_projections=false"]


def kind_of(name: str) -> str:
    return next((kind for kind, words in KINDS if any(word in name for word in words)), "other")


def profile_step(work: Path, settings: list[str]) -> dict[str, float]:
    """Seconds of self CPU time by kind, for one profiled micro-batch (forward and backward)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.training_speed import CONTEXT, SETTINGS, Plan
    from qlora_fsdp.config import load_config
    from qlora_fsdp.data.batching import collate_packed, pack
    from qlora_fsdp.data.pipeline import load_dataset
    from qlora_fsdp.distributed import init_distributed
    from qlora_fsdp.loading.checkpoint import load_tokenizer
    from qlora_fsdp.loading.factory import build_sharded_model
    from qlora_fsdp.losses.forward import ForwardLoss

    plan = Plan.from_json((work / "plan.json").read_text())
    cfg = load_config("tiny_cpu", [*settings, f"model.dtype={plan.dtype}", f"quant.compute_dtype={plan.dtype}",
                                   f"model.path={plan.model}", f"data.path={plan.train}", "data.packing=true",
                                   f"data.context_length={CONTEXT}", f"lora.r={SETTINGS['r']}",
                                   f"lora.alpha={SETTINGS['alpha']}", "model.attn_implementation=auto"])
    info = init_distributed()
    model = build_sharded_model(cfg, info)
    data = load_dataset(load_tokenizer(cfg), cfg.data, SETTINGS["seed"])
    samples = data.samples(data.train, list(range(len(data.train))))
    rows = pack([len(s.input_ids) for s in samples], CONTEXT)[:plan.rows_per_micro_batch]
    batch = collate_packed([[samples[i] for i in row] for row in rows], pad_id=0, length=CONTEXT)
    loss = ForwardLoss.for_config(cfg, info.device)

    def step() -> None:
        model.zero_grad()
        loss(model, batch, info.device).backward()

    step()  # warm-up: allocator, first-call work
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    seconds: dict[str, float] = {}
    for event in prof.key_averages():
        kind = kind_of(event.key)
        seconds[kind] = seconds.get(kind, 0.0) + event.self_cpu_time_total / 1e6
    return seconds


def print_table(results: dict[str, dict[str, float]]) -> None:
    kinds = [kind for kind, _ in KINDS] + ["other"]
    names = list(results)
    print("| kind | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))
    for kind in kinds:
        cells = [f"{results[n].get(kind, 0.0):.2f} s ({results[n].get(kind, 0.0) / sum(results[n].values()):.0%})"
                 for n in names]
        print(f"| {kind} | " + " | ".join(cells) + " |")
    print("| **step** | " + " | ".join(f"**{sum(results[n].values()):.2f} s**" for n in names) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="a folder benchmarks.training_speed prepared")
    parser.add_argument("--settings", action="append", help="space-separated overrides, one profile each "
                        "(default: the defaults, and lora.fuse_projections=false)")
    parser.add_argument("--only", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only is not None:  # a child: one setting
        print(json.dumps(profile_step(args.work, args.only.split())))
        return
    results = {}
    for setting in args.settings or DEFAULT_SETTINGS:
        done = subprocess.run([sys.executable, "-m", "benchmarks.step_profile", "--work", str(args.work), "--only",
                               setting], capture_output=True, text=True, check=True, cwd=REPO,
                              env={**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"})
        results[setting or "defaults"] = json.loads(done.stdout.strip().splitlines()[-1])
    print_table(results)


if __name__ == "__main__":
    main()
