"""The fake process group the planner works in, and the recipe's step measured in it on fake tensors (a launched
run, already in a real group, measures in a fresh process of its own)."""

from __future__ import annotations

import copy
import multiprocessing
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from transformers import PretrainedConfig

from qlora_fsdp.config import Config
from qlora_fsdp.distributed import data_parallel_mesh, init_fake_distributed
from qlora_fsdp.measure.fake_step import planned_step
from qlora_fsdp.measure.planning import Planning
from qlora_fsdp.measure.step_setting import step_setting
from qlora_fsdp.measure.step_tracker import StepMemory

T = TypeVar("T")


def planning_mesh(world_size: int, shard_size: int | None = None) -> DeviceMesh:
    """A mesh of the recipe's world size over a fake process group, unless one exists (then it must match)."""
    if not dist.is_initialized():
        return init_fake_distributed(world_size, torch.device("cpu"), shard_size=shard_size).mesh
    if dist.get_world_size() != world_size:
        raise ValueError(f"planning for world size {world_size} inside a process group of {dist.get_world_size()}")
    return data_parallel_mesh("cpu", world_size, shard_size)


def leave_fake_world() -> None:
    """End the fake group a plan made, so the next plan (another world size) can make its own."""
    if dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()


def in_fake_world(cfg: Config, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a fresh process acting as rank 0 of a fake world of the recipe's size. For a process already
    in a real process group (a launched run sizing its auto micro-batch, the GPU check): the fake step's
    collectives must not reach the real ranks, and a process has one default group."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(run_in_fake_world, (cfg.hardware.world_size, cfg.fsdp.shard_size, fn, args))


def run_in_fake_world(world_size: int, shard_size: int | None, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    planning_mesh(world_size, shard_size)
    return fn(*args)


def in_real_world() -> bool:
    return dist.is_initialized() and dist.get_backend() != "fake"


def recipe_step(planning: Planning, cfg: Config | None = None) -> StepMemory:
    """The step of the planning's recipe, or of `cfg` (a variant of it, resolved: a micro-batch, a misfit's fix),
    measured on fake tensors once per setting (kept in the planning: the auto micro-batch and the fixes plan many)."""
    built = planning.built(planning.cfg if cfg is None else cfg)
    key = step_setting(built, planning.hf_config)
    if key not in planning.steps:
        if in_real_world():
            planning.steps[key] = in_fake_world(built, measured_step_of, built, planning.hf_config)
        else:
            planning.steps[key] = measured_step_of(built, planning.hf_config)
    return planning.steps[key]


def measured_step_of(cfg: Config, hf_config: PretrainedConfig) -> StepMemory:
    # on a copy: building the model turns its config's use_cache off, which would change the key of the same
    # setting planned next (and measure it again)
    return planned_step(cfg, copy.deepcopy(hf_config), planning_mesh(cfg.hardware.world_size, cfg.fsdp.shard_size))
