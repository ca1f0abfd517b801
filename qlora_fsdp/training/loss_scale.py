"""Dynamic loss scaling for float16 compute (GPUs without bf16: T4, V100, RTX 20xx).

float16 flushes gradients below about 6e-8 to zero and overflows above 65,504. Backward runs on the loss times
`scale`, so small gradients stay representable; the gradients are divided by it again before clipping and the
update. A step whose gradients are not finite (somewhere on any rank: the global gradient norm says so) is
skipped, the scale halves, and it doubles again after `growth_interval` good steps in a row. The state is part of
the checkpoint, so a resumed run scales exactly as the uninterrupted one would have.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

BACKOFF, GROWTH = 0.5, 2.0  # powers of two: scaling and unscaling are exact in floating point


@dataclass
class LossScaler:
    enabled: bool = False
    scale: float = 65536.0
    growth_interval: int = 2000
    good_steps: int = 0  # finite steps in a row since the scale last changed
    overflows: int = 0  # steps skipped for overflowing gradients

    @property
    def factor(self) -> float:
        """What the loss is multiplied by before backward."""
        return self.scale if self.enabled else 1.0

    @torch.no_grad()
    def unscale_(self, model: nn.Module) -> None:
        """Gradients back to the loss's own scale (each rank its shards), before clipping and the update."""
        if not self.enabled:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, grad_norm: float) -> bool:
        """After a step's backward: whether its gradients overflowed (then skip it); adjusts the scale."""
        if not self.enabled:
            return False
        if math.isfinite(grad_norm):
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale, self.good_steps = self.scale * GROWTH, 0
            return False
        self.scale, self.good_steps = self.scale * BACKOFF, 0
        self.overflows += 1
        return True

    def state_dict(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if key != "enabled"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
