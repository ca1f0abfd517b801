"""The `--plan` lines on time: the step's split, tokens/s, MFU and the run's hours, on the recipe's GPUs."""

from __future__ import annotations

from qlora_fsdp.config import Config
from qlora_fsdp.plan.held import Held
from qlora_fsdp.plan.memory import gpu_spec
from qlora_fsdp.plan.step_time import StepTime, step_time
from qlora_fsdp.plan.step_tracker import StepMemory


def recipe_time(cfg: Config, step: StepMemory) -> StepTime:
    return step_time(step, cfg.data.grad_accum_steps, gpu_spec(cfg), cfg.fsdp.cpu_offload)


def step_tokens(cfg: Config) -> int:
    """Tokens a step trains on at full rows (packed rows, or the longest row of a padded batch)."""
    return cfg.data.micro_batch * cfg.data.context_length * cfg.data.grad_accum_steps * cfg.hardware.world_size


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def time_lines(cfg: Config, held: Held, step: StepMemory) -> list[str]:
    """The table of the step's time and the run's, for a GPU recipe (none on the CPU: no rates to price with)."""
    gpu = gpu_spec(cfg)
    if not gpu.bf16_tflops or not gpu.memory_gbps:
        return []
    time = recipe_time(cfg, step)
    tokens = step_tokens(cfg)
    rate = tokens / time.total
    mfu = rate * 6 * held.base_parameters / (gpu.bf16_tflops * 1e12 * cfg.hardware.world_size)
    rows = [("matmuls (each on the roofline: FLOPs or bytes, whichever is slower)", time.matmul),
            ("attention", time.attention), ("element-wise ops (bytes read and written)", time.elementwise),
            ("4-bit dequantization", time.dequant),
            ("collectives on their own (all-gather, reduce-scatter)", time.collectives),
            ("host<->GPU copies on their own (offload)", time.copies), ("optimizer update", time.optimizer),
            ("transfers left exposed after overlapping the compute", time.exposed)]
    return ["", f"time per optimizer step on {cfg.hardware.world_size} x {cfg.hardware.gpu} (predicted from the "
                "step's counted work; docs/benchmarks.md compares the model with published runs):",
            "| part | seconds |", "| --- | ---: |", *(f"| {name} | {seconds:.2f} |" for name, seconds in rows),
            f"| **step** | **{time.total:.2f}** |",
            f"{tokens:,} tokens a step: {rate:,.0f} tokens/s, MFU {mfu:.0%} (6N FLOP a token); "
            f"train.max_steps {cfg.train.max_steps}: {hours(cfg.train.max_steps * time.total)}"]
