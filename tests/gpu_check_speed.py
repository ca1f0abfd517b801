"""The GPU check's one-GPU training speed: train.py beside transformers' Trainer + PEFT + bitsandbytes.

Llama 3.1 8B's layer shapes and vocabulary (random weights, 8 of its layers; on the CPU its shapes / 32, 2 layers),
2,048-token rows of long-tailed samples (benchmarks/bench_data.py), the same records, steps and optimizer for both
(benchmarks/training_speed.py: the Trainer with its defaults, padded micro-batches of 8, gradient checkpointing on;
train.py packed, its defaults), each in a process of its own on the GPU. Beside both, the plan of train.py's run on
this GPU: its peak and its tokens/s. Goals: train.py at least 1.5x the Trainer's useful tokens/s; the plan within 10%
of the measured peak and 25% of the measured tokens/s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.training_speed import OUR_SETTINGS, Plan, Setting, our_overrides, prepare, run_isolated, run_one
from qlora_fsdp.config import Config, load_config
from qlora_fsdp.measure.fake_world import leave_fake_world
from qlora_fsdp.plan.report import plan_recipe
from qlora_fsdp.plan.time_report import recipe_time, step_tokens
from qlora_fsdp.run.accelerators import detect_gpu
from tests.gpu_check import Row

SPEED_GOAL = 1.5
PEAK_TOLERANCE, TIME_TOLERANCE = 0.10, 0.25
GIB = 2**30


def planned(cfg: Config) -> dict[str, float]:
    """The plan of train.py's run on its hardware: the caching allocator's peak and the step-time model's tokens/s
    (as --plan computes them)."""
    try:
        recipe = plan_recipe(cfg)
    finally:
        leave_fake_world()
    result, on_gpu = recipe.result, recipe.planned
    allocated = sum(r.bytes for r in result.gpu_rows if not r.name.lower().startswith("cuda context"))
    figures = {"plan_allocated_gib": allocated / GIB}
    if result.step is not None:
        figures["plan_tokens_per_s"] = step_tokens(on_gpu) / recipe_time(recipe.planning, on_gpu, result.step).total
    return figures


def speed_row(results: dict[str, dict[str, Any]], plan_figures: dict[str, float], cuda: bool, on: str) -> Row:
    ours, peer = results["ours"], results["peer"]
    rate = {name: r["tokens"] / r["seconds"] for name, r in results.items()}
    ratio = rate["ours"] / rate["peer"]
    figures: dict[str, Any] = {"ours_tokens_per_s": rate["ours"], "trainer_tokens_per_s": rate["peer"],
                               "ratio": ratio, "steps": ours["steps"], "useful_tokens": ours["tokens"],
                               "ours_eval_loss": ours["eval_loss"], "trainer_eval_loss": peer["eval_loss"],
                               **plan_figures}
    result = (f"{ours['steps']} steps, {ours['tokens']:,} useful tokens: train.py {rate['ours']:,.0f} tokens/s, "
              f"the Trainer {rate['peer']:,.0f} ({ratio:.2f}x); plan on {on}: "
              f"{plan_figures.get('plan_tokens_per_s', 0):,.0f} tokens/s, "
              f"{plan_figures['plan_allocated_gib']:.2f} GiB allocated")
    if not cuda:
        return Row("training_speed", "passed", f"CPU smoke run: {result}; no GPU figures", figures)
    figures.update(ours_peak_gib=ours["peak_allocated_gib"], trainer_peak_gib=peer["peak_allocated_gib"],
                   peak_ratio=ours["peak_allocated_gib"] / plan_figures["plan_allocated_gib"],
                   time_ratio=rate["ours"] / plan_figures.get("plan_tokens_per_s", float("nan")))
    result += (f"; peaks allocated: train.py {ours['peak_allocated_gib']:.2f} GiB, the Trainer "
               f"{peer['peak_allocated_gib']:.2f} GiB")
    misses = [f"under {SPEED_GOAL}x the Trainer"] * (ratio < SPEED_GOAL)
    misses += [f"peak more than {PEAK_TOLERANCE:.0%} off the plan"] * (abs(figures["peak_ratio"] - 1) > PEAK_TOLERANCE)
    misses += [f"tokens/s more than {TIME_TOLERANCE:.0%} off the plan"] * (not abs(figures["time_ratio"] - 1)
                                                                            <= TIME_TOLERANCE)
    return Row("training_speed", "failed" if misses else "passed", result + "".join(f"; {m}" for m in misses),
               figures)


def training_speed(ctx: Any, arch: Path) -> list[Row]:
    """`arch`: the 8B's config.json as the check's size asks (gpu_check_cases.arch_dir)."""
    cuda = ctx.device.type == "cuda"
    setting = Setting(arch=arch / "config.json", layers=8 if cuda else 2, context=2048 if cuda else 256,
                      device=ctx.device.type)
    work = ctx.work / "training_speed"
    work.mkdir(parents=True, exist_ok=True)
    records, held_out = (800, 64) if cuda else (48, 8)
    run_plan: Plan = prepare(work, records, held_out, seed=17, setting=setting)
    gpu = (detect_gpu(ctx.device) if cuda else None) or "h100"
    overrides = [*our_overrides(run_plan, work / "planned", OUR_SETTINGS["ours"]), f"hardware.gpu={gpu}",
                 "hardware.gpus_per_node=1", "hardware.nodes=1"]
    plan_figures = planned(load_config("tiny_cpu", overrides))  # first: no process group of a run here yet
    # on the GPU each run in a fresh process (its own peak); on the CPU in this one (the dry run's time)
    results = {which: run_isolated(which, run_plan, work, threads=8) if cuda else run_one(which, run_plan, work)
               for which in ("peer", "ours")}
    return [speed_row(results, plan_figures, cuda, gpu)]
