"""Optimizer and LR schedule.

bitsandbytes optimizers have no DTensor sharding rule, so every optimizer here steps each parameter's
local shard (a plain leaf tensor that shares storage with the DTensor). Element-wise updates are exact
on shards; block-wise 8-bit state differs from an unsharded run only at block boundaries.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from qlora_fsdp.config import LoraConfig, OptimConfig
from qlora_fsdp.distributed import local_shard
from qlora_fsdp.layers.trained_embeddings import embedding_parameters
from qlora_fsdp.optimizer_registry import OPTIMIZERS


def optimizer_class(name: str, shards: list[torch.Tensor]) -> type[torch.optim.Optimizer]:
    """The registry's class for `name`, or its host variant when every shard is in host memory."""
    spec = OPTIMIZERS[name]
    if spec.on_host and all(shard.device.type == "cpu" for shard in shards):
        spec = OPTIMIZERS[spec.on_host]
    return spec.load_class()


@dataclass
class ParameterGroup:
    """Trained parameters that share a learning rate (a multiple of optim.lr, so the schedule scales them all)."""

    lr_ratio: float
    params: list[nn.Parameter] = field(default_factory=list)
    full_state: bool = False  # 32-bit optimizer state under an 8-bit optimizer (embeddings: bitsandbytes' advice)


def parameter_groups(named: Iterable[tuple[str, nn.Parameter]], lora: LoraConfig,
                     embeddings: ParameterGroup | None = None) -> list[ParameterGroup]:
    """The trained parameters by learning rate, the base group first (the one the metrics log). With LoRA+
    (lora.plus_ratio), B matrices and vectors (DoRA's magnitudes, biases) take plus_ratio times the rate, as PEFT's
    create_loraplus_optimizer groups them. `embeddings`: the trained embeddings and head, their own group."""
    base, faster = ParameterGroup(1.0), ParameterGroup(lora.plus_ratio or 1.0)
    apart = {id(p) for p in embeddings.params} if embeddings is not None else set()
    for name, param in named:
        if param.requires_grad and id(param) not in apart:
            is_b_side = lora.plus_ratio is not None and ("lora_B" in name.split(".") or param.ndim == 1)
            (faster if is_b_side else base).params.append(param)
    return [group for group in (base, faster, embeddings) if group is not None and (group.params or group is base)]


class ShardedOptimizer:
    """Runs an optimizer over the local shards of (possibly DTensor) parameters, group by group."""

    def __init__(self, groups: list[ParameterGroup], optim: OptimConfig) -> None:
        self.params = [param for group in groups for param in group.params]
        self.locals = [local_shard(p).detach().requires_grad_(True) for p in self.params]
        local_of = dict(zip(map(id, self.params), self.locals, strict=True))
        inner_groups = [{"params": [local_of[id(p)] for p in group.params], "lr": optim.lr * group.lr_ratio}
                        for group in groups]
        kwargs: dict[str, Any] = {"lr": optim.lr, "betas": tuple(optim.betas), "eps": optim.eps,
                                  "weight_decay": optim.weight_decay}
        self.inner = optimizer_class(optim.name, self.locals)(inner_groups, **kwargs)
        full_state = [local_of[id(p)] for group in groups if group.full_state for p in group.params]
        if full_state and hasattr(self.inner, "mng"):  # a bitsandbytes optimizer
            keep_32bit_state(self.inner, full_state)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def step(self) -> None:
        for param, local in zip(self.params, self.locals, strict=True):
            local.grad = None if param.grad is None else local_shard(param.grad)
        self.inner.step()

    def zero_grad(self) -> None:
        for param, local in zip(self.params, self.locals, strict=True):
            param.grad = None
            local.grad = None

    def materialize_state(self) -> None:
        """Create every state buffer (paged ones included) so a checkpoint can be loaded into them in place.

        One step with zero gradients at lr 0 allocates the state without touching the weights (an update
        and a decoupled weight decay both scale by lr); the loaded values then overwrite it.
        """
        saved_lrs = [group["lr"] for group in self.inner.param_groups]
        for group in self.inner.param_groups:
            group["lr"] = 0.0
        for local in self.locals:
            local.grad = torch.zeros_like(local)
        self.inner.step()
        for group, lr in zip(self.inner.param_groups, saved_lrs, strict=True):
            group["lr"] = lr
        self.zero_grad()


def keep_32bit_state(inner: torch.optim.Optimizer, kept: list[torch.Tensor]) -> None:
    """32-bit state for `kept` under a bitsandbytes optimizer: its per-parameter override, read when a parameter's
    state is made. Given to this optimizer alone: bitsandbytes' own manager is one per process, keyed by tensor ids
    and group positions, so another optimizer's overrides (the planner's fake step's) would reach whichever tensor
    later takes the same id or place."""
    from bitsandbytes.optim import GlobalOptimManager

    manager = GlobalOptimManager.__new__(GlobalOptimManager)  # its constructor refuses: get_instance's singleton
    manager.initialize()
    manager.override_config(kept, "optim_bits", 32)
    cast(Any, inner).mng = manager


def build_optimizer(model: nn.Module, optim: OptimConfig, lora: LoraConfig) -> ShardedOptimizer:
    embeddings = None
    if lora.train_embeddings:  # their own rate (lora.embeddings_lr) and 32-bit state
        ratio = (lora.embeddings_lr or optim.lr) / optim.lr
        embeddings = ParameterGroup(ratio, embedding_parameters(model), full_state=True)
    return ShardedOptimizer(parameter_groups(model.named_parameters(), lora, embeddings), optim)


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    """optim.warmup_steps, or optim.warmup_ratio of the run's optimizer steps (rounded up, as transformers does),
    so the warmup stays the same share of the run when max_steps changes with the effective batch."""
    # rounded first: 0.1 * 30 is 3.0000000000000004 in floats, which must give 3 steps, not 4
    return optim.warmup_steps or math.ceil(round(optim.warmup_ratio * total_steps, 9))


def lr_factor(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Linear warmup to 1, then cosine/linear decay to min_lr_ratio, or constant."""
    warmup = warmup_steps(optim, total_steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if optim.scheduler == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if optim.scheduler == "cosine" else 1 - progress
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * decay


def build_scheduler(optimizer: ShardedOptimizer, optim: OptimConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer.inner, lambda step: lr_factor(step, optim, total_steps))


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> float:
    """Global L2 norm over all shards (DTensor reduces across ranks); clip in place if asked. Tensors every rank
    holds whole (a trained image side) count once, beside the shards."""
    params = [p for p in model.parameters() if p.grad is not None]
    whole = [p for p in params if not isinstance(p, DTensor)]
    if whole and len(whole) < len(params):
        return clip_mixed(params, whole, max_norm)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else math.inf, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm.item()


def clip_mixed(params: list[nn.Parameter], whole: list[nn.Parameter], max_norm: float | None) -> float:
    """The norm over sharded and whole gradients together, and both clipped by it (torch's coefficient)."""
    sharded = [cast(torch.Tensor, p.grad) for p in params if isinstance(p, DTensor)]
    shard_norm = torch.nn.utils.get_total_norm(sharded, foreach=True)
    whole_norm = torch.nn.utils.get_total_norm([cast(torch.Tensor, p.grad) for p in whole], foreach=True)
    total = math.hypot(float(cast(DTensor, shard_norm).full_tensor()), float(whole_norm))
    coefficient = min(1.0, max_norm / (total + 1e-6)) if max_norm is not None else 1.0
    if coefficient < 1.0:
        torch._foreach_mul_(sharded, coefficient)
        torch._foreach_mul_([cast(torch.Tensor, p.grad) for p in whole], coefficient)
    return total
