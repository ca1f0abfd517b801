"""FSDP2's no_sync: gradients reduce-scatter only on a step's last micro-batch; and the gradients of trainable
tensors every rank holds whole (a vision-language checkpoint's trained image side), summed by hand."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def sum_replicated_gradients(model: nn.Module) -> None:
    """Sum over the ranks the gradients of the trainable tensors FSDP2 does not shard, as FSDP2 sums the sharded
    ones here (its divide factor is 1: the loss is already divided by the step's targets over all ranks). Every
    rank calls it once a step; a rank whose micro-batches had no images adds zeros."""
    if not isinstance(model, FSDPModule) or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([grad.flatten() for grad in grads])
    dist.all_reduce(flat)
    for param, summed in zip(params, flat.split([p.numel() for p in params]), strict=True):
        param.grad = summed.view_as(param)
