"""The optimizer registry: every entry builds, steps, and holds exactly the state bytes the planner counts."""

from __future__ import annotations

import pytest
import torch

from qlora_fsdp.optimizer import optimizer_class
from qlora_fsdp.optimizer_registry import OPTIMIZERS


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("n_elements", [1024, 65536])  # below and above bitsandbytes' 8-bit threshold
def test_registry_state_bytes_are_the_optimizers_own(name, n_elements):
    spec = OPTIMIZERS[name]
    param = torch.nn.Parameter(torch.randn(n_elements))
    before = param.detach().clone()
    optimizer = optimizer_class(name, [param])([param], lr=1e-3)
    param.grad = torch.randn(n_elements)
    optimizer.step()
    assert state_bytes(optimizer) == spec.state_bytes(n_elements, param.element_size())
    assert not torch.equal(param.detach(), before)  # it updated the weights


def test_host_shards_use_the_unpaged_variant():
    host = [torch.zeros(4)]
    assert optimizer_class("paged_adamw_8bit", host).__name__ == "AdamW8bit"
    assert optimizer_class("adamw", host) is torch.optim.AdamW
