"""Effective batch -> micro-batch and accumulation steps for a world size; learning-rate scaling with batch.

The recipe states what it means to train with (rows per optimizer step over all ranks, or tokens); the
micro-batch is a memory choice. `micro_batch_size: auto` takes the largest that the planner says fits, so
the same recipe runs on 1, 2 or 8 GPUs with the same optimization, only the accumulation steps differ.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from qlora_fsdp.config import Config
from qlora_fsdp.errors import ConfigError


def effective_rows(cfg: Config) -> int | None:
    """The recipe's target in rows per optimizer step, or None when it gives micro-batch and accumulation."""
    data = cfg.data
    if data.effective_batch_tokens is None:
        return data.effective_batch
    rows, left = divmod(data.effective_batch_tokens, data.context_length)
    if left or not rows:
        near = sorted({max(1, rows) * data.context_length, (rows + 1) * data.context_length})
        raise ConfigError(f"'data.effective_batch_tokens: {data.effective_batch_tokens}' is not a multiple of "
                          f"data.context_length {data.context_length}: use {' or '.join(map(str, near))}")
    return rows


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def rows_per_rank(target: int, world_size: int) -> int:
    per_rank, left = divmod(target, world_size)
    if left or not per_rank:
        near = sorted({max(1, per_rank) * world_size, (per_rank + 1) * world_size})
        raise ConfigError(f"effective batch {target} rows does not split over {world_size} ranks: use "
                          f"data.effective_batch={' or data.effective_batch='.join(map(str, near))}")
    return per_rank


def choose_micro_batch(cfg: Config, per_rank: int, fits: Callable[[int], bool] | None) -> int:
    """The recipe's micro-batch if it divides the rank's rows; for auto, the largest divisor that fits."""
    micro = cfg.data.micro_batch_size
    if micro != "auto":
        if per_rank % micro:
            options = ", ".join(map(str, divisors(per_rank)))
            raise ConfigError(f"data.micro_batch_size {micro} does not divide the {per_rank} rows each rank takes "
                              f"per step: choose one of {options}, or auto")
        return micro
    if fits is None:
        raise ConfigError("'data.micro_batch_size: auto' needs the planner here; give a number instead")
    fitting = [d for d in divisors(per_rank) if fits(d)]
    if not fitting:
        raise ConfigError("not even micro-batch 1 fits this GPU: see `train.py --recipe ... --plan` for what does")
    return fitting[-1]


def scaled_lr(cfg: Config, batch: int) -> float:
    optim = cfg.optim
    if optim.lr_scaling == "none" or optim.lr_base_batch is None:
        return optim.lr
    ratio = batch / optim.lr_base_batch
    return optim.lr * (ratio if optim.lr_scaling == "linear" else math.sqrt(ratio))


def row_takers(cfg: Config, world_size: int) -> int:
    """Ranks (or, under context parallel, groups of ranks sharing each row) that take rows of their own."""
    return max(1, world_size // cfg.fsdp.context_parallel)


def resolve_batch(cfg: Config, world_size: int, fits: Callable[[int], bool] | None = None) -> Config:
    """A concrete copy of `cfg`: an integer micro-batch, the accumulation steps that reach the effective
    batch, and the scaled lr. The targets and the scaling are then dropped (effective batch null, lr_scaling
    none), so a saved config loads back as it is and is never scaled twice."""
    target = effective_rows(cfg)
    data = cfg.data
    world_size = row_takers(cfg, world_size)
    if target is None:
        micro, accum = data.micro_batch_size, data.grad_accum_steps
        assert micro != "auto", "the loader refuses micro_batch_size auto without an effective batch to size it"
    else:
        per_rank = rows_per_rank(target, world_size)
        micro = choose_micro_batch(cfg, per_rank, fits)
        accum = per_rank // micro
    batch = micro * accum * world_size
    new_data = dataclasses.replace(data, micro_batch_size=micro, grad_accum_steps=accum, effective_batch=None,
                                   effective_batch_tokens=None)
    new_optim = dataclasses.replace(cfg.optim, lr=scaled_lr(cfg, batch), lr_scaling="none")
    return dataclasses.replace(cfg, data=new_data, optim=new_optim)


def describe_batch(before: Config, after: Config, world_size: int) -> str:
    """One line saying what was chosen and why, for the run log and the plan."""
    data = after.data
    takers, degree = row_takers(after, world_size), after.fsdp.context_parallel
    rows = data.micro_batch_size * data.grad_accum_steps * takers
    how = " (auto: the largest that fits)" if before.data.micro_batch_size == "auto" else ""
    ranks = f"{takers} rank{'s' if takers > 1 else ''}"
    if degree > 1:
        ranks = f"{takers} group{'s' if takers > 1 else ''} of {degree} ranks splitting each row"
    line = (f"batch: micro-batch {data.micro_batch_size}{how} x {data.grad_accum_steps} accumulation steps x {ranks} "
            f"= {rows} rows a step (at most {rows * data.context_length:,} tokens)")
    if after.train.kind.generates:  # a row is a prompt; its completions are the update's rows
        completions = rows * after.generation.num_generations
        prompts = f"prompt{'s' if data.micro_batch > 1 else ''}"
        line = (f"batch: micro-batch {data.micro_batch_size}{how} {prompts} x {data.grad_accum_steps} accumulation "
                f"steps x {ranks} = {rows} prompts a step, {after.generation.num_generations} completions each: "
                f"{completions} completions (at most {completions * data.context_length:,} tokens)")
    if before.optim.lr_scaling != "none":
        line += (f"; lr {after.optim.lr:.3g} ({before.optim.lr_scaling} scaling of {before.optim.lr:g} "
                 f"tuned at {before.optim.lr_base_batch} rows)")
    return line
