"""The step-time model against published QLoRA runs (benchmarks/data/published_runs.json): each run's settings
planned here (its model's shapes, GPUs, context, batch, offload, LoRA), its time predicted from the planner's fake
step, and MATMUL_EFFICIENCY fitted on the rows marked `fit` (half of them) and judged on the rest.

    python -m benchmarks.published_runs          # the table (about 2 minutes on 2 cores)
    python -m benchmarks.published_runs --json   # the same as JSON (tests/test_step_time.py reads it)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from qlora_fsdp.config import Config
from qlora_fsdp.config.loader import load_config
from qlora_fsdp.measure.fake_world import leave_fake_world, recipe_step
from qlora_fsdp.measure.planning import Planning
from qlora_fsdp.measure.step_tracker import StepMemory
from qlora_fsdp.plan.memory import gpu_spec
from qlora_fsdp.plan.step_time import MATMUL_EFFICIENCY, matmul_efficiency, step_time
from qlora_fsdp.run.description import planned_run

RUNS = Path(__file__).with_name("data") / "published_runs.json"
ANSWERAI_TARGETS = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
EFFICIENCIES = [round(0.10 + 0.005 * i, 3) for i in range(201)]  # 0.10 to 1.10


def row_config(row: dict[str, Any]) -> Config:
    """Our recipe with the published run's settings: its model, GPUs, context, batch, accumulation, offload and
    LoRA, and the rig's PCIe link where it is not the card's usual; full rows (their data: every sample full length,
    or packed), the full logits, bf16 LoRA weights (their pure bf16) in PEFT's unfused forward, every layer
    checkpointed."""
    targets = "[" + ",".join(row.get("targets", ANSWERAI_TARGETS)) + "]"
    overrides = [f"model.path={row['model']}", f"hardware.gpu={row['gpu']}", f"hardware.gpus_per_node={row['gpus']}",
                 "hardware.host_ram_gib=null", f"data.context_length={row['context']}",
                 f"data.micro_batch_size={row['batch']}", f"data.grad_accum_steps={row.get('accumulation', 1)}",
                 f"data.packing={str(row.get('packed', False)).lower()}",
                 f"fsdp_preset={'full_shard_cpu_offload' if row['offload'] else 'full_shard'}",
                 f"lora.r={row.get('lora_r', 64)}", f"lora.alpha={row.get('lora_alpha', 16)}",
                 f"lora.target_modules={targets}", "lora.dtype=bfloat16", "lora.fuse_projections=false",
                 "lora.compute_dtype=weights", "loss.chunked=false",
                 "model.dtype=bfloat16", "quant.compute_dtype=bfloat16"]
    overrides += [f"hardware.{key}={row[key]}" for key in ("pcie_gen", "pcie_lanes") if key in row]
    return planned_run(load_config("llama70b_2x4090", overrides)).cfg


def predicted(row: dict[str, Any], cfg: Config, step: StepMemory, efficiency: float) -> dict[str, float]:
    """The row's figure as the model predicts it (seconds for its samples, or tokens/s), and the step's split."""
    time = step_time(step, cfg.data.grad_accum_steps, gpu_spec(cfg), cfg.fsdp.cpu_offload, efficiency,
                     cfg.hardware.host_memory_gbps)
    rows_per_step = cfg.data.micro_batch * cfg.data.grad_accum_steps * cfg.hardware.world_size
    figure = row["samples"] / rows_per_step * time.total if "seconds" in row \
        else rows_per_step * cfg.data.context_length / time.total
    return {"figure": figure, "step_s": time.total, "compute_s": time.compute, "exposed_s": time.exposed}


def published(row: dict[str, Any]) -> float:
    return float(row["seconds"] if "seconds" in row else row["tokens_per_s"])


def fitted_efficiency(rows: list[dict[str, Any]], steps: list[tuple[Config, StepMemory]], gpu: str | None) -> float:
    """The efficiency whose predictions of the `fit` rows (of `gpu`, or all) have the least absolute log error (a
    median: one row far off, such as a step too small for the model, does not drag the rest)."""
    chosen = [(row, cfg, step) for row, (cfg, step) in zip(rows, steps, strict=True)
              if row["fit"] and gpu in (None, row["gpu"])]

    def error(efficiency: float) -> float:
        return sum(abs(math.log(predicted(row, cfg, step, efficiency)["figure"] / published(row)))
                   for row, cfg, step in chosen)
    return min(EFFICIENCIES, key=error)


def evaluate() -> dict[str, Any]:
    rows = json.loads(RUNS.read_text())["rows"]
    steps = []
    for row in rows:
        cfg = row_config(row)
        leave_fake_world()  # each run plans in a fake world of its own size
        steps.append((cfg, recipe_step(Planning.of(cfg))))
    leave_fake_world()
    fitted = {gpu: fitted_efficiency(rows, steps, gpu) for gpu in sorted({r["gpu"] for r in rows if r["fit"]})}
    fitted["all"] = fitted_efficiency(rows, steps, None)
    results = []
    for row, (cfg, step) in zip(rows, steps, strict=True):
        ours = predicted(row, cfg, step, matmul_efficiency(row["gpu"]))
        results.append({"id": row["id"], "fit": row["fit"], "unit": "s" if "seconds" in row else "tokens/s",
                        "published": published(row), **ours, "ratio": ours["figure"] / published(row)})
    used = {gpu: matmul_efficiency(gpu) for gpu in sorted({r["gpu"] for r in rows})}
    return {"fitted_efficiency": fitted, "matmul_efficiency": {**used, "all": MATMUL_EFFICIENCY}, "rows": results}


def table(result: dict[str, Any]) -> str:
    lines = ["| GPU | matmul efficiency used | fitted on its `fit` rows |", "| --- | ---: | ---: |"]
    lines += [f"| {gpu} | {used} | {result['fitted_efficiency'].get(gpu, '(no fit rows)')} |"
              for gpu, used in result["matmul_efficiency"].items()]
    lines += ["",
             "| run | half | published | predicted | predicted / published | step s | exposed transfers s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        lines.append(f"| {r['id']} | {'fit' if r['fit'] else 'judged'} | {r['published']:,.0f} {r['unit']} | "
                     f"{r['figure']:,.0f} {r['unit']} | {r['ratio']:.2f} | {r['step_s']:.2f} | {r['exposed_s']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    result = evaluate()
    print(json.dumps(result) if parser.parse_args().json else table(result))


if __name__ == "__main__":
    main()
