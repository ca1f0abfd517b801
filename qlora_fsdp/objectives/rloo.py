"""RLOO (train.objective rloo): REINFORCE Leave-One-Out as TRL 1.16's RLOOTrainer computes it, on GRPO's rollouts
(the same generation, rewards, batches, checkpoints and plan: objectives/grpo.py); what differs is here.

Rewards: the weighted sum of the functions' scores (NaN where none scored), clamped to rloo.reward_clip_range,
less beta times the completion's KL to the reference: the sum over its tokens of (policy - reference)
log-probabilities at generation (the first-order estimate, so it may be negative).

Advantages: a completion's reward less the mean of its group's other scored rewards (the leave-one-out baseline);
with normalize_advantages, less their mean over the step's scored completions (every rank's) and over their
unbiased standard deviation plus 1e-4; unscored completions get 0.

Loss: per completion, the ratio r = exp(sum of token log-probabilities - the same at generation) (one number a
sequence), -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A), averaged over the step's completions.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from qlora_fsdp.config import Config, RlooConfig
from qlora_fsdp.distributed import all_reduce_sums
from qlora_fsdp.distributed.split_sums import all_reduced_over_split
from qlora_fsdp.losses.policy import STD_EPSILON, StepCounts, TokenTerms, std_from_sums
from qlora_fsdp.objectives.grpo import Grpo


def leave_one_out(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each reward less the mean of its group's other non-NaN rewards (NaN where it or all others are NaN)."""
    groups = rewards.view(-1, group_size)
    scored = (~torch.isnan(groups)).sum(dim=1, keepdim=True)
    baselines = (torch.nansum(groups, dim=1, keepdim=True) - groups) / (scored - 1)
    return rewards - baselines.flatten()


def sequence_sums(values: torch.Tensor, terms: TokenTerms) -> torch.Tensor:
    """Each completion's sum over its tokens (over a split, of its tokens on every rank of it)."""
    sums = values.new_zeros(terms.n_samples).index_add(0, terms.sample_ids, values)
    return all_reduced_over_split(sums, terms.split) if terms.split is not None else sums


class Rloo(Grpo):
    """RLOO: GRPO's rollouts, TRL's RLOO rewards, advantages and sequence-level clipped loss."""

    SECTION: ClassVar[str] = "rloo"
    SECTIONS: ClassVar[tuple[str, ...]] = ("generation", "rloo")
    CLIPPED_PER: ClassVar[str] = "completions"

    @classmethod
    def section_of(cls, cfg: Config) -> RlooConfig:
        return cfg.rloo

    @property
    def rloo(self) -> RlooConfig:
        return self.cfg.rloo

    def keeps_old_logps(self) -> bool:
        """The policy's log-probabilities at generation: the ratio's denominator over iterations, and the KL."""
        return self.rloo.num_iterations > 1 or self.rloo.beta != 0.0

    def advantages(self, rewards: torch.Tensor, old: list[torch.Tensor] | None,
                   ref: list[torch.Tensor] | None) -> torch.Tensor:
        if self.rloo.reward_clip_range is not None:
            low, high = self.rloo.reward_clip_range
            rewards = rewards.clamp(min=low, max=high)
        if self.rloo.beta != 0.0:
            assert old is not None and ref is not None, "RLOO's KL penalty reads the kept log-probabilities"
            kl = torch.tensor([float((o - r).double().sum()) for o, r in zip(old, ref, strict=True)])
            rewards = rewards - self.rloo.beta * kl.to(rewards.dtype)
        advantages = leave_one_out(rewards, self.generation.num_generations)
        if self.rloo.normalize_advantages:  # over every rank's scored completions of the step
            present = advantages[~torch.isnan(advantages)].double()
            count, total, squares = all_reduce_sums(
                [present.numel() * self.counts_once, present.sum().item() * self.counts_once,
                 (present**2).sum().item() * self.counts_once], self.info.device)
            advantages = (advantages - total / max(count, 1.0)) / (std_from_sums(count, total, squares) + STD_EPSILON)
        return torch.nan_to_num(advantages, nan=0.0)

    def ratios(self, terms: TokenTerms) -> torch.Tensor:
        """Each completion's whole-sequence probability ratio to generation's."""
        old = terms.old_logps if terms.old_logps is not None else terms.logps.detach()
        return torch.exp(sequence_sums(terms.logps - old, terms))

    def update_share(self, terms: TokenTerms, counts: StepCounts) -> torch.Tensor:
        """The micro-batch's completions' clipped sequence losses over the step's completions (a split's first
        part counts them)."""
        ratio = self.ratios(terms)
        clipped = ratio.clamp(1 - self.rloo.epsilon, 1 + self.rloo.resolved_epsilon_high)
        losses = -torch.min(ratio * terms.advantages, clipped * terms.advantages)
        return losses.sum() / max(counts.completions, 1.0) * (1.0 if terms.first_part else 0.0)

    def clipped(self, terms: TokenTerms) -> tuple[float, float]:
        """(low, high): completions whose ratio the clip cut, below with a negative advantage, above with a
        positive one (a split's first part counts them)."""
        with torch.no_grad():
            ratio, advantage = self.ratios(terms), terms.advantages
            low = ((ratio < 1 - self.rloo.epsilon) & (advantage < 0)).sum().item()
            high = ((ratio > 1 + self.rloo.resolved_epsilon_high) & (advantage > 0)).sum().item()
        counted = 1.0 if terms.first_part else 0.0
        return float(low) * counted, float(high) * counted

    def kl_of(self, terms: TokenTerms) -> float:
        """The micro-batch's KL at generation, TRL's logged estimate: policy less reference, summed over tokens."""
        if terms.ref_logps is None or terms.old_logps is None:
            return 0.0
        return float((terms.old_logps - terms.ref_logps).sum())
