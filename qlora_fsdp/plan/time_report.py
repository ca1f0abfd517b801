"""The `--plan` lines on time: the step's split, tokens/s, MFU and the run's hours, on the recipe's GPUs."""

from __future__ import annotations

import math
from pathlib import Path

from qlora_fsdp.config import Config
from qlora_fsdp.plan.fake_step import plans_reference_forward
from qlora_fsdp.plan.hardware import GPU
from qlora_fsdp.plan.held import Held
from qlora_fsdp.plan.memory import gpu_spec
from qlora_fsdp.plan.step_time import StepTime, matmul_efficiency, step_time
from qlora_fsdp.plan.step_tracker import StepMemory


def recipe_time(cfg: Config, step: StepMemory) -> StepTime:
    return step_time(step, cfg.data.grad_accum_steps, gpu_spec(cfg), cfg.fsdp.cpu_offload,
                     matmul_efficiency(cfg.hardware.gpu), cfg.hardware.host_memory_gbps)


def step_tokens(cfg: Config) -> int:
    """Tokens a step trains on at full rows (packed rows, or the longest row of a padded batch)."""
    return cfg.data.micro_batch * cfg.data.context_length * cfg.data.grad_accum_steps * cfg.hardware.world_size


def dataset_records(cfg: Config) -> int | None:
    """The recipe's `data.records`, else the lines of its local JSON-lines file (a hub dataset is never read)."""
    if cfg.data.records:
        return cfg.data.records
    path = Path(cfg.data.path)
    if not cfg.data.sources and path.suffix == ".jsonl" and path.is_file():
        with path.open("rb") as lines:
            return sum(1 for line in lines if line.strip())
    return None


def epoch_line(cfg: Config, step_seconds: float) -> str:
    """One epoch's time: a record a row, or packed rows of `mean_record_tokens`-token records."""
    records = dataset_records(cfg)
    if records is None:
        return "one epoch: set data.records (and, with packing, data.mean_record_tokens) to see its time"
    rows_per_step = cfg.data.micro_batch * cfg.data.grad_accum_steps * cfg.hardware.world_size
    if cfg.data.packing and not cfg.data.mean_record_tokens:
        steps = math.ceil(records / rows_per_step)
        return (f"one epoch of {records:,} records: at most {steps:,} steps, {hours(steps * step_seconds)} (a record "
                "a row; packing puts several in a row: set data.mean_record_tokens for the packed figure)")
    tokens = records * (cfg.data.mean_record_tokens or 0)
    rows = math.ceil(tokens / cfg.data.context_length) if cfg.data.packing else records
    steps = math.ceil(rows / rows_per_step)
    return f"one epoch of {records:,} records: {steps:,} steps, {hours(steps * step_seconds)}"


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def link_description(gpu: GPU) -> str:
    """The links the collectives and copies cross (hardware.pcie_gen and hardware.pcie_lanes override the card's)."""
    pcie = f"PCIe {gpu.pcie_gen}.0 x{gpu.pcie_lanes}"
    if gpu.nvlink_gbps:
        return f"NVLink {gpu.nvlink_gbps:.0f} GB/s each way, {pcie} to the host"
    return pcie if gpu.peer_to_peer else f"{pcie}, no peer-to-peer: collectives through host memory"


def time_lines(cfg: Config, held: Held, step: StepMemory) -> list[str]:
    """The table of the step's time and the run's, for a GPU recipe (none on the CPU: no rates to price with)."""
    gpu = gpu_spec(cfg)
    if not gpu.priced:
        return []
    time = recipe_time(cfg, step)
    tokens = step_tokens(cfg)
    rate = tokens / time.total
    flops_per_token = 8 if plans_reference_forward(cfg) else 6  # DPO's reference forward: 2N more, as training counts
    mfu = rate * flops_per_token * held.active_parameters / (gpu.bf16_tflops * 1e12 * cfg.hardware.world_size)
    rows = [("matmuls (each on the roofline: FLOPs or bytes, whichever is slower)", time.matmul),
            ("attention", time.attention), ("element-wise ops (bytes read and written)", time.elementwise),
            ("4-bit dequantization", time.dequant),
            ("collectives on their own (all-gather, reduce-scatter)", time.collectives),
            ("host<->GPU copies on their own (offload)", time.copies), ("optimizer update", time.optimizer),
            ("transfers left exposed after overlapping the compute", time.exposed)]
    active = ", N the active parameters" if held.active_parameters < held.base_parameters else ""
    unpriced = "; the network between nodes is not priced: optimistic" if cfg.hardware.nodes > 1 else ""
    return ["", f"time per optimizer step on {cfg.hardware.world_size} x {cfg.hardware.gpu} ({link_description(gpu)}"
                f"{unpriced}), predicted from the step's counted work (docs/benchmarks/step-time.md compares the "
                "model with published runs):",
            "| part | seconds |", "| --- | ---: |", *(f"| {name} | {seconds:.2f} |" for name, seconds in rows),
            f"| **step** | **{time.total:.2f}** |",
            f"{tokens:,} tokens a step: {rate:,.0f} tokens/s, MFU {mfu:.0%} ({flops_per_token}N FLOP a token{active}); "
            f"train.max_steps {cfg.train.max_steps}: {hours(cfg.train.max_steps * time.total)}",
            epoch_line(cfg, time.total)]
