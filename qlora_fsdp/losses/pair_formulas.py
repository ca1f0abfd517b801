"""Preference losses on the log-probabilities of each pair's two completions: DPO (and its variants), SimPO, ORPO;
and a reward model's Bradley-Terry loss on each pair's two scores.

Every function takes per-pair tensors and returns per-pair losses, so the training step can sum them over a
micro-batch and divide by the pairs of the whole effective batch (the mean over the global batch, exact under
accumulation and sharding, as the SFT loss is by target tokens).

Inputs are summed log-probabilities of a completion's target tokens given its prompt, and their token counts:
- DPO compares the policy's log-ratio against a frozen reference's (Rafailov et al. 2023); `ipo` (Azar et al.
  2023) uses per-token averages, as its authors' and TRL's code do;
- SimPO (Meng et al. 2024) needs no reference: the per-token average log-probability is the reward, with a
  margin gamma;
- ORPO (Hong et al. 2024) needs no reference: the chosen completion's NLL (per token, added by the step) plus
  a weighted log-sigmoid of the log odds ratio of the per-token average probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qlora_fsdp.config import DpoLossType


@dataclass(frozen=True)
class PairLogps:
    """Per pair: the summed log-probability of the chosen and the rejected completion, and their target tokens."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    def averaged(self) -> PairLogps:
        """Per-token averages in place of sums (counts kept)."""
        return PairLogps(self.chosen / self.chosen_tokens.clamp(min=1), self.rejected / self.rejected_tokens.clamp(
            min=1), self.chosen_tokens, self.rejected_tokens)


@dataclass(frozen=True)
class PairRewards:
    """Per pair: the implicit rewards of the two completions (what the loss pushes apart)."""

    chosen: torch.Tensor
    rejected: torch.Tensor

    @property
    def margin(self) -> torch.Tensor:
        return self.chosen - self.rejected

    @property
    def correct(self) -> torch.Tensor:
        """1 where the chosen completion has the higher reward, 0.5 for a tie (no preference yet: the policy equals
        the reference at the start of DPO), else 0; its mean is the reward accuracy."""
        return (self.chosen > self.rejected).float() + 0.5 * (self.chosen == self.rejected).float()


def smoothed_logistic(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-log sigmoid(z), with a fraction `label_smoothing` of the pairs taken as mislabelled (conservative DPO)."""
    return -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def dpo_losses(policy: PairLogps, reference: PairLogps, beta: float, loss_type: DpoLossType = "sigmoid",
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, PairRewards]:
    """Per-pair DPO losses and rewards beta * (policy - reference) log-probabilities."""
    if loss_type == "ipo":
        policy, reference = policy.averaged(), reference.averaged()
    chosen_ratio = policy.chosen - reference.chosen
    rejected_ratio = policy.rejected - reference.rejected
    h = chosen_ratio - rejected_ratio
    z = beta * h
    if loss_type == "sigmoid":
        losses = smoothed_logistic(z, label_smoothing)
    elif loss_type == "robust":  # unbiased under a known label-noise rate (Chowdhury et al. 2024)
        losses = (-(1.0 - label_smoothing) * F.logsigmoid(z) + label_smoothing * F.logsigmoid(-z)) / (
            1.0 - 2.0 * label_smoothing)
    elif loss_type == "hinge":  # SLiC
        losses = torch.relu(1.0 - z)
    elif loss_type == "ipo":  # regresses the log-ratio gap to 1 / (2 beta) instead of pushing it to infinity
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}")
    return losses, PairRewards(beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def simpo_losses(policy: PairLogps, beta: float, gamma: float,
                 label_smoothing: float = 0.0) -> tuple[torch.Tensor, PairRewards]:
    """Per-pair SimPO losses: the per-token average log-probabilities, scaled by beta, apart by at least gamma."""
    average = policy.averaged()
    z = beta * (average.chosen - average.rejected) - gamma
    return smoothed_logistic(z, label_smoothing), PairRewards(beta * average.chosen.detach(),
                                                              beta * average.rejected.detach())


def log_odds(average_logp: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) of p = exp(average log-probability); log(-expm1(x)) stays accurate near p = 1."""
    return average_logp - torch.log(-torch.expm1(average_logp))


def orpo_odds_ratio_losses(policy: PairLogps, weight: float) -> tuple[torch.Tensor, PairRewards]:
    """Per-pair ORPO odds-ratio terms, -weight * log sigmoid(log odds(chosen) - log odds(rejected)); the NLL of the
    chosen completion is added by the step (it is normalized by tokens, not pairs). Rewards: weight times the
    average log-probabilities, as TRL reports them."""
    average = policy.averaged()
    ratio = F.logsigmoid(log_odds(average.chosen) - log_odds(average.rejected))
    return -weight * ratio, PairRewards(weight * average.chosen.detach(), weight * average.rejected.detach())


def bradley_terry_losses(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None,
                         center_coefficient: float | None) -> tuple[torch.Tensor, PairRewards]:
    """Per-pair reward-model losses, as TRL's RewardTrainer computes them: -log sigmoid(r_chosen - r_rejected -
    margin), plus center_coefficient * (r_chosen + r_rejected)^2 (its mean over pairs keeps the rewards centred)."""
    gap = chosen - rejected - (margin if margin is not None else 0.0)
    losses = -F.logsigmoid(gap)
    if center_coefficient is not None:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    return losses, PairRewards(chosen.detach(), rejected.detach())
