"""KTO (Ethayarajh et al. 2024) on unpaired records, as TRL 1.16's KTOTrainer computes it.

Each record is a prompt, a completion and a label (desirable or not). Its reward is the policy's log-ratio to the
reference, r = log pi(y|x) - log ref(y|x), summed over the completion's targets. The reference point z0 estimates
KL(pi || ref) from mismatched sequences (a record's prompt with another record's completion): the mean of their
log-ratios, clamped at 0 and detached. The losses are
  desirable:   w_d * (1 - sigmoid(beta * (r - z0)))
  undesirable: w_u * (1 - sigmoid(beta * (z0 - r)))
and the step's loss their mean over the step's records. TRL estimates z0 over each per-device batch and averages it
over devices; here it is the mean over the whole step (every micro-batch, every rank), which is TRL's when a step is
one micro-batch a rank, and with which k micro-batches give one batch's gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kl_reference_point(policy_kl: torch.Tensor, reference_kl: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The summed log-ratios of mismatched sequences and their count (the step sums both over micro-batches and
    ranks; z0 is their quotient, clamped at 0)."""
    return (policy_kl - reference_kl).detach().sum(), policy_kl.numel()


def kto_losses(policy: torch.Tensor, reference: torch.Tensor, z0: float, desirable: torch.Tensor, beta: float,
               desirable_weight: float, undesirable_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-record KTO losses and rewards beta * (policy - reference), for summed log-probabilities `policy` and
    `reference` of each record's completion, `desirable` its label."""
    ratio = policy - reference
    losses = torch.where(desirable, desirable_weight * (1 - F.sigmoid(beta * (ratio - z0))),
                         undesirable_weight * (1 - F.sigmoid(beta * (z0 - ratio))))
    return losses, beta * ratio.detach()
