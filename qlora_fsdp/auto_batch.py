"""`micro_batch_size: auto` at launch: sized by the planner for the GPU memory this process really has."""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from qlora_fsdp.config import Config, HardwareConfig
from qlora_fsdp.distributed import DistInfo
from qlora_fsdp.measure.fake_world import in_fake_world, in_real_world
from qlora_fsdp.measure.held import Held, held_bytes
from qlora_fsdp.measure.planning import Planning
from qlora_fsdp.plan.memory import CUDA_CONTEXT_GIB, GIB, micro_batch_fits
from qlora_fsdp.run.batch_size import resolve_batch


def this_run_hardware(cfg: Config, info: DistInfo) -> HardwareConfig:
    """The hardware a run really has, for `micro_batch_size: auto` at launch: the GPU memory this process can
    use (or no limit on CPU), the ranks torchrun started; the recipe's host RAM figure is kept."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    memory = None
    if info.device.type == "cuda":
        # free now (a display or another process may hold part of the total) plus what this process holds: this
        # runs with the shards allocated, and the plan counts them; it counts the CUDA context too, which is
        # spent already (not free), so that is added back at the plan's estimate
        free, total = torch.cuda.mem_get_info(info.device)
        available = free + torch.cuda.memory_reserved(info.device) + CUDA_CONTEXT_GIB * GIB
        memory = min(total, available) / GIB
        if memory < total / GIB and cfg.data.micro_batch_size == "auto":
            print(f"micro_batch_size auto: sized for {memory:.1f} GiB of this GPU's {total / GIB:.1f} GiB; other "
                  "processes (a display, another run) hold the rest", flush=True)
    return dataclasses.replace(cfg.hardware, gpu="cpu", gpu_memory_gib=memory, gpus_per_node=local,
                               nodes=max(1, info.world_size // local))


def _resolve_with_plans(cfg: Config, run_cfg: Config, held: Held, world_size: int) -> Config:
    planning = Planning.of(run_cfg)
    return resolve_batch(cfg, world_size, micro_batch_fits(planning, planning.cfg, held))


def resolve_run_batch(cfg: Config, model: nn.Module, info: DistInfo) -> Config:
    """`resolve_batch` for a launched run: the planner measures the model this rank really holds. Its step is
    measured in a fake world of its own (one process start, every candidate micro-batch in it)."""
    run_cfg = dataclasses.replace(cfg, hardware=this_run_hardware(cfg, info))
    held = held_bytes(model, cfg)
    if cfg.data.micro_batch_size != "auto":  # nothing to size: no step to measure
        return resolve_batch(cfg, info.world_size)
    if in_real_world():
        return in_fake_world(run_cfg, _resolve_with_plans, cfg, run_cfg, held, info.world_size)
    return _resolve_with_plans(cfg, run_cfg, held, info.world_size)
