"""Per-sample sums of a row split over ranks (context parallel): each rank's partial sums added over the split.

A sample whose tokens lie on several ranks of a split has its log-probability (or its reward model's score) in
parts. Every rank of the split then holds the whole sums and computes the same loss from them; the backward of
the sum is the identity, so each rank's gradient is the loss's through its own tokens, and FSDP's sum over the
ranks adds those parts to the whole row's gradient, once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol


class _SumOverSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(local.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None  # each rank's part enters the sum once; every rank backpropagates the same loss


def summed_over_split(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`local` (this rank's parts of per-sample sums) summed over the ranks sharing the row."""
    return _SumOverSplit.apply(local, group)
