"""The fake process group the planner works in, and the recipe's step measured in it on fake tensors (a launched
run, already in a real group, measures in a fresh process of its own)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from qlora_fsdp.config import Config
from qlora_fsdp.distributed import data_parallel_mesh, init_fake_distributed
from qlora_fsdp.measure.fake_step import cached_step
from qlora_fsdp.measure.step_tracker import StepMemory
from qlora_fsdp.run.description import planned_run

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


def recipe_step(cfg: Config) -> StepMemory:
    """The recipe's step measured on fake tensors (once per setting: see fake_step.cached_step)."""
    run = planned_run(cfg)
    cfg = run.cfg
    if in_real_world():
        return in_fake_world(cfg, recipe_step, cfg)
    return cached_step(run.built, run.hf_config,
                       planning_mesh(cfg.hardware.world_size, cfg.fsdp.shard_size))
