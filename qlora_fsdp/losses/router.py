"""The load-balancing loss of a mixture of experts, added where the model's config asks for it
(`output_router_logits: true`) as transformers adds it: `router_aux_loss_coef` times the model family's own
`load_balancing_loss_func` of the routers' logits (pad tokens left out by the attention mask).

Padding never counts (a padded batch's attention mask, a packed row's padding tail, a split row's filler), as
transformers masks a padded batch's. Under context parallel the formula's three sums (tokens sent to each expert,
router probability per expert, tokens) are added over the split, so each rank's loss is the whole row's.

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
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol

from qlora_fsdp.distributed.split_sums import summed_over_split
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


def split_balancing_loss(logits: list[torch.Tensor], experts: int, top_k: int, mask: torch.Tensor,
                         group: dist.ProcessGroup) -> torch.Tensor:
    """The load-balancing loss as every mixture-of-experts family we load defines it (transformers' shared
    `load_balancing_loss_func`: experts x the sum over experts of the share of routed tokens times the mean router
    probability), its sums added over the ranks sharing the row. The routed tokens and the token count carry no
    gradient; the probabilities' sum backpropagates each rank's own tokens."""
    flat = mask.reshape(-1).float()
    routed = flat.new_zeros(experts)
    probability = flat.new_zeros(experts)
    for layer in logits:
        weights = F.softmax(layer, dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        routed = routed.scatter_add(0, chosen.reshape(-1), flat.repeat_interleave(top_k))
        probability = probability + (weights.float() * flat.unsqueeze(-1)).sum(dim=0)
    counts = torch.cat([routed, (flat.sum() * len(logits)).reshape(1)])
    counts = funcol.wait_tensor(funcol.all_reduce(counts.detach(), "sum", group))
    routed, tokens = counts[:-1], counts[-1]
    probability = summed_over_split(probability, group)
    return (routed / tokens * probability / tokens).sum() * experts


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
             coefficient: float, split: dist.ProcessGroup | None = None) -> torch.Tensor:
        """`split`: the group of ranks sharing the row (context parallel), whose sums the loss adds up."""
        config: Any = getattr(model, "config", None)
        experts = getattr(config, "num_experts", None) or config.num_local_experts
        mask = attention_mask if attention_mask is not None and attention_mask.ndim == 2 else None
        if split is not None:
            assert mask is not None, "a split row's loss counts its real tokens"
            aux = split_balancing_loss(logits, experts, config.num_experts_per_tok, mask, split)
        else:
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
