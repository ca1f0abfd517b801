"""GRPO's reference when a run starts from an adapter (`model.adapter`, beta > 0): a frozen copy of that adapter,
as TRL 1.16 makes one (its "ref" adapter) for a model that arrives with an adapter, so the KL term holds the policy
near where it started (an SFT warm start, say), not near the base. A run from a fresh adapter keeps the adapter off
as its reference (TRL's way for a new adapter: the same model, the adapter's B being zero).

The copy is of this rank's shards of the trained parameters, taken when the objective attaches: after loading the
adapter, before a checkpoint's weights are restored, so a resumed run keeps the adapter it started from.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of a parameter (its shard under FSDP2)."""
    return param.to_local() if isinstance(param, DTensor) else param


def frozen_adapter(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of this rank's shards of the trained parameters, now."""
    return {name: local(param).detach().clone() for name, param in model.named_parameters() if param.requires_grad}


@contextmanager
def adapter_weights(model: nn.Module, frozen: dict[str, torch.Tensor]) -> Iterator[None]:
    """Within the block the trained parameters hold the frozen copy (no gradients flow); their own values after."""
    params = dict(model.named_parameters())
    kept = {name: local(params[name]).detach().clone() for name in frozen}
    try:
        with torch.no_grad():
            for name, value in frozen.items():
                local(params[name]).copy_(value)
        yield
    finally:
        with torch.no_grad():
            for name, value in kept.items():
                local(params[name]).copy_(value)
