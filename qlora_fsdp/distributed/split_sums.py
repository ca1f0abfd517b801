"""Per-sample sums of a row split over ranks (context parallel): each rank's partial sums added over the split.

A sample whose tokens lie on several ranks of a split has its log-probability (or its reward model's score) in
parts. Two ways to differentiate through the sum, for two kinds of loss:

- `summed_over_split`: every rank of the split computes the same loss from the whole sums (a pair's loss); the
  backward is the identity, so each rank's gradient is the loss's through its own tokens, and FSDP's sum over the
  ranks adds those parts to the whole row's gradient, once. The loss's value counts once (the first part's).
- `all_reduced_over_split`: each rank's loss is its part of the step's (GRPO's token terms, which read their
  completion's whole mean): the backward sums every rank's gradient of the sum, as the step's loss is the sum of
  the ranks' (a term every rank computes whole then counts on the first part alone, times 0 elsewhere).
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


class _AllReduceOverSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return funcol.wait_tensor(funcol.all_reduce(local.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


def summed_over_split(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`local` (this rank's parts of per-sample sums) summed over the ranks sharing the row; every rank then
    computes the same loss from them (the backward is the identity)."""
    return _SumOverSplit.apply(local, group)


def all_reduced_over_split(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`local` summed over the ranks sharing the row, for losses each rank holds a part of (the backward sums the
    ranks' gradients)."""
    return _AllReduceOverSplit.apply(local, group)


def gathered_over_split(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A 1-D tensor of each rank's (lengths may differ) joined in the ranks' order; no gradient."""
    sizes = funcol.wait_tensor(funcol.all_gather_tensor(torch.tensor([local.numel()], device=local.device), 0, group))
    longest = int(sizes.max())
    padded = torch.cat([local.detach(), local.new_zeros(longest - local.numel())])
    parts = funcol.wait_tensor(funcol.all_gather_tensor(padded, 0, group)).view(len(sizes), longest)
    return torch.cat([part[: int(size)] for part, size in zip(parts, sizes, strict=True)])


def from_first_part(value: Any, group: dist.ProcessGroup) -> Any:
    """The first rank of the split's `value` (any picklable object), on every rank of the split."""
    box = [value]
    dist.broadcast_object_list(box, group_src=0, group=group)
    return box[0]
