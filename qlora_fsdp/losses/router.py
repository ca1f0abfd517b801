"""The load-balancing loss of a mixture of experts, added where the model's config asks for it
(`output_router_logits: true`) as transformers adds it: `router_aux_loss_coef` times the model family's own
`load_balancing_loss_func` of the routers' logits (pad tokens left out by the attention mask).

transformers adds it to a batch's mean cross-entropy. Training here sums cross-entropy over the effective batch's
target tokens and divides by their count, so a micro-batch adds coef x its auxiliary loss x its target tokens: one
micro-batch gives transformers' loss exactly, several give the mean of their auxiliary losses weighted by targets.
The routers' logits are caught by forward hooks during the forward alone (checkpointing's recompute adds nothing).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qlora_fsdp.families import router_loss_coefficient as router_coefficient
from qlora_fsdp.layers.experts4bit import router_class


def router_loss_coefficient(model: nn.Module) -> float | None:
    """The coefficient where the model's config asks for the loss, else None."""
    return router_coefficient(getattr(model, "config", None))


def grpo_router_coefficient(model: nn.Module) -> float | None:
    """GRPO's rule (TRL 1.16's): the load-balancing loss joins the update wherever the config has the switch at all
    (`output_router_logits`, even false) and a non-zero `router_aux_loss_coef`; None elsewhere."""
    return router_coefficient(getattr(model, "config", None), grpo=True)


def balancing_function(model: nn.Module) -> Any:
    """The family's own load_balancing_loss_func (each family's modeling module defines one)."""
    for module in model.modules():
        function = getattr(sys.modules[type(module).__module__], "load_balancing_loss_func", None)
        if function is not None:
            return function
    raise ValueError(f"{type(model).__name__} asks for a router loss but its family defines none")


@dataclass
class RouterLoss:
    """Catches the routers' logits of one forward and turns them into the auxiliary loss; keeps what it added."""

    added: list[float] = field(default_factory=list)  # each micro-batch's auxiliary loss (before the coefficient)

    @contextmanager
    def catching(self, model: nn.Module, wanted: bool) -> Iterator[list[torch.Tensor]]:
        found = router_class(model) if wanted else None
        caught: list[torch.Tensor] = []
        if found is None:
            yield caught
            return
        router, index = found

        def keep(_module: nn.Module, _args: Any, output: Any) -> None:
            caught.append(output[index])

        handles = [m.register_forward_hook(keep) for m in model.modules() if isinstance(m, router)]
        try:
            yield caught
        finally:
            for handle in handles:
                handle.remove()

    def loss(self, model: nn.Module, logits: list[torch.Tensor], attention_mask: torch.Tensor | None,
             coefficient: float) -> torch.Tensor:
        config: Any = getattr(model, "config", None)
        experts = getattr(config, "num_experts", None) or config.num_local_experts
        mask = attention_mask if attention_mask is not None and attention_mask.ndim == 2 else None
        aux = balancing_function(model)(tuple(logits), experts, config.num_experts_per_tok, mask)
        self.added.append(float(aux))
        return coefficient * aux

    def mean_added(self) -> float | None:
        """The auxiliary loss of the micro-batches since the last call (reported each step), then forgotten."""
        if not self.added:
            return None
        mean = sum(self.added) / len(self.added)
        self.added.clear()
        return mean
