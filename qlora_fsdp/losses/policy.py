"""GRPO's update from rewards, as TRL 1.16 defines it (its GRPOTrainer, one process, the whole generation batch
in one micro-batch), written over the flat target tokens of a micro-batch so that any split into micro-batches and
ranks sums to the same step loss.

Advantages: each completion's reward minus its group's mean (the `num_generations` completions of one prompt),
divided by the group's (or the whole batch's) unbiased standard deviation plus 1e-4, or not divided (`none`).

Per token t of completion i: the ratio r = exp(logp - old_logp), or GSPO's sequence ratio (the mean of the
completion's log-ratios, exponentiated, the same for all its tokens); the policy term -min(r A, clip(r) A) with
clip to [1 - epsilon, 1 + epsilon_high] (and r capped at `delta` where set); plus beta times the k3 estimate of
the KL to the reference, exp(ref - logp) - (ref - logp) - 1, times r (TRL's bias correction). Normalized by
loss type over the whole step: grpo, each completion's token mean, then the mean over completions; dapo, the sum over
every token of the step over their count; bnpo, each micro-batch's token mean, then the mean over the micro-batches
of every rank (TRL normalizes bnpo per micro-batch, so it depends on the split); dr_grpo, the sum over completions x
max_completion_length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qlora_fsdp.config import GrpoConfig
from qlora_fsdp.distributed.split_sums import all_reduced_over_split

STD_EPSILON = 1e-4  # added to the standard deviation, not under the root, as TRL does


def nan_std(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased standard deviation over the non-NaN entries (NaN where fewer than two)."""
    present = ~torch.isnan(values)
    count = present.sum() if dim is None else present.sum(dim)
    mean = torch.nanmean(values) if dim is None else torch.nanmean(values, dim=dim, keepdim=True)
    squares = torch.where(present, (values - mean) ** 2, torch.zeros_like(values))
    summed = squares.sum() if dim is None else squares.sum(dim)
    return torch.where(count > 1, (summed / (count - 1).clamp(min=1)).sqrt(), torch.full_like(summed, math.nan))


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str,
                     batch_std: torch.Tensor | float | None = None) -> torch.Tensor:
    """Advantages of the completions, groups consecutive: (r - group mean) / (std + 1e-4), std over the group or
    the whole generation batch (`batch_std`, over every rank's rewards; else these rewards'), or no division for
    `none`. A NaN reward (no function scored it) and a group without two scores give 0."""
    groups = rewards.view(-1, group_size)
    mean = torch.nanmean(groups, dim=1, keepdim=True)
    advantages = groups - mean
    if scale == "group":
        advantages = advantages / (nan_std(groups, dim=1).unsqueeze(1) + STD_EPSILON)
    elif scale == "batch":
        advantages = advantages / ((nan_std(rewards) if batch_std is None else batch_std) + STD_EPSILON)
    return torch.nan_to_num(advantages.flatten(), nan=0.0)


def std_from_sums(count: float, total: float, squares: float) -> float:
    """The unbiased standard deviation from (n, sum, sum of squares) summed over ranks; NaN below two values."""
    if count < 2:
        return math.nan
    return math.sqrt(max(squares - total * total / count, 0.0) / (count - 1))


@dataclass(frozen=True)
class TokenTerms:
    """A micro-batch's completion tokens, flat: which completion each belongs to and the per-token inputs."""

    logps: torch.Tensor  # under the policy, with gradients
    old_logps: torch.Tensor | None  # at generation (num_iterations > 1); None: the policy's own, detached
    ref_logps: torch.Tensor | None  # under the reference (beta > 0)
    advantages: torch.Tensor  # per completion of the micro-batch
    sample_ids: torch.Tensor  # per token: its completion's index in the micro-batch
    n_samples: int
    # context parallel: the ranks sharing the micro-batch's rows (a completion's tokens on several of them), and
    # whether this rank holds the rows' first part (which counts what every rank of the split computes whole)
    split: dist.ProcessGroup | None = None
    first_part: bool = True


@dataclass(frozen=True)
class StepCounts:
    """What the step's loss is divided by, summed over every micro-batch and rank of the step."""

    completions: float
    tokens: float
    micro_batches: float = 1.0  # bnpo: each micro-batch's token mean is one of this many (all ranks')


def per_sample_mean(values: torch.Tensor, sample_ids: torch.Tensor, n_samples: int,
                    split: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Each completion's mean over its tokens (over a split, of its tokens on every rank of it)."""
    sums = values.new_zeros(n_samples).index_add(0, sample_ids, values)
    counts = values.new_zeros(n_samples).index_add(0, sample_ids, torch.ones_like(values))
    if split is not None:
        sums = all_reduced_over_split(sums, split)
        counts = all_reduced_over_split(counts, split)
    return sums / counts.clamp(min=1)


def ratios(terms: TokenTerms, level: str) -> torch.Tensor:
    """Per token: exp(logp - old_logp), or GSPO's per-completion exp(mean log-ratio) broadcast to its tokens."""
    old = terms.old_logps if terms.old_logps is not None else terms.logps.detach()
    log_ratio = terms.logps - old
    if level == "sequence":
        log_ratio = per_sample_mean(log_ratio, terms.sample_ids, terms.n_samples, terms.split)[terms.sample_ids]
    return torch.exp(log_ratio)


def token_losses(terms: TokenTerms, grpo: GrpoConfig) -> torch.Tensor:
    """Each completion token's loss: the clipped policy term, plus beta times the ratio-weighted k3 KL."""
    ratio = ratios(terms, grpo.importance_sampling_level)
    advantage = terms.advantages[terms.sample_ids]
    clipped = ratio.clamp(1 - grpo.epsilon, 1 + grpo.resolved_epsilon_high)
    capped = ratio.clamp(max=grpo.delta) if grpo.delta is not None else ratio
    losses = -torch.min(capped * advantage, clipped * advantage)
    if grpo.beta != 0.0:
        assert terms.ref_logps is not None, "beta > 0 needs the reference's log-probabilities"
        gap = terms.ref_logps - terms.logps
        losses = losses + grpo.beta * (torch.exp(gap) - gap - 1) * ratio
    return losses


def step_share(terms: TokenTerms, grpo: GrpoConfig, counts: StepCounts, completion_tokens: int) -> torch.Tensor:
    """This micro-batch's share of the step's loss (`completion_tokens`: generation.max_completion_length, dr_grpo's
    constant) (the shares of all micro-batches and ranks sum to it; over a
    split, each rank's is its tokens' part, or the whole on the first part alone)."""
    losses = token_losses(terms, grpo)
    if grpo.loss_type == "grpo":
        means = per_sample_mean(losses, terms.sample_ids, terms.n_samples, terms.split)
        return means.sum() / max(counts.completions, 1.0) * (1.0 if terms.first_part else 0.0)
    if grpo.loss_type == "dr_grpo":
        return losses.sum() / (counts.completions * completion_tokens)
    if grpo.loss_type == "bnpo":  # TRL's: the micro-batch's own token mean, averaged over micro-batches and ranks
        tokens = losses.new_tensor(float(losses.numel()))
        if terms.split is not None:  # the micro-batch's tokens on every rank of the split
            tokens = all_reduced_over_split(tokens, terms.split)
        return losses.sum() / tokens.clamp(min=1.0) / counts.micro_batches
    return losses.sum() / max(counts.tokens, 1.0)  # dapo: one token count over the whole step


def clip_fractions(terms: TokenTerms, grpo: GrpoConfig) -> tuple[float, float]:
    """(low, high): tokens whose ratio the clip cut, below with a negative advantage, above with a positive one;
    sums over the micro-batch (for the step's metrics)."""
    with torch.no_grad():
        ratio = ratios(terms, grpo.importance_sampling_level)
        advantage = terms.advantages[terms.sample_ids]
        low = ((ratio < 1 - grpo.epsilon) & (advantage < 0)).sum().item()
        high = ((ratio > 1 + grpo.resolved_epsilon_high) & (advantage > 0)).sum().item()
    return float(low), float(high)


def kl_sum(terms: TokenTerms) -> float:
    """The k3 estimate of the KL to the reference, summed over the micro-batch's tokens (0 without a reference)."""
    if terms.ref_logps is None:
        return 0.0
    with torch.no_grad():
        gap = terms.ref_logps - terms.logps
        return float((torch.exp(gap) - gap - 1).sum())
