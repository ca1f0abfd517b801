"""FSDP2's no_sync: gradients reduce-scatter only on a step's last micro-batch."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
