"""Dynamic fine-tuning (train.objective dft; Wu et al. 2025, "On the Generalization of SFT"): SFT whose token
losses are each weighted by the model's probability of that token, held constant (no gradient through it).

A token the model finds unlikely (-log p large) has its gradient scaled down by p, which the paper reads as
rectifying SFT's implicit reward; TRL 1.16 ships it as SFTTrainer's `loss_type="dft"`. The step's normalizer is
SFT's: the target tokens of the whole effective batch, so k micro-batches still equal one batch. The held-out
record is SFT's plain loss and perplexity, comparable with an SFT run's.
"""

from __future__ import annotations

import dataclasses

import torch

from qlora_fsdp.config import Config
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.objectives.supervised import Supervised


def token_probability(token_losses: torch.Tensor) -> torch.Tensor:
    """p(token) = exp(-its cross-entropy): DFT's weight of that token's loss (the losses come detached)."""
    return torch.exp(-token_losses)


class Dft(Supervised):
    """Supervised's batches and step, over the probability-weighted token loss."""

    def __init__(self, cfg: Config, forward_loss: ForwardLoss) -> None:
        super().__init__(cfg, dataclasses.replace(forward_loss, token_weight=token_probability))
        self.plain_loss = forward_loss

    @property
    def held_out_loss(self) -> ForwardLoss:
        return self.plain_loss
