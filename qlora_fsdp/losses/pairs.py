"""A micro-batch of preference pairs: each sequence's log-probability under the policy (and, for DPO, under the
reference: the same 4-bit base with the adapter turned off, so no second model is held), then the pair losses.

A batch holds its pairs' sequences in order, chosen then rejected (qlora_fsdp/data/pair_encoding.py). The step's
loss is the mean over the pairs of the whole effective batch (all micro-batches, all ranks), so the micro-batch's
share is its summed pair losses over that count; ORPO adds the chosen completions' NLL over their target tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from qlora_fsdp.config import Config, Objective, PreferenceConfig
from qlora_fsdp.layers.expert_lora import expert_lora_off
from qlora_fsdp.losses.forward import ForwardLoss, LossBatch
from qlora_fsdp.losses.preference import PairLogps, PairRewards, dpo_losses, orpo_odds_ratio_losses, simpo_losses

# the sums a micro-batch adds to the step's metrics (each then divided by the step's pairs)
METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")


@dataclass(frozen=True)
class PairCounts:
    """What the step's loss is normalized by, summed over micro-batches and ranks."""

    pairs: float
    chosen_targets: float


def pair_counts(batch: LossBatch) -> tuple[int, int]:
    """(pairs, target tokens of the chosen completions) of a batch of pair sequences."""
    return batch.n_samples // 2, int(batch.targets_per_sample()[0::2].sum())


def as_pairs(sequence_logps: torch.Tensor, batch: LossBatch) -> PairLogps:
    tokens = batch.targets_per_sample().to(sequence_logps)
    return PairLogps(sequence_logps[0::2], sequence_logps[1::2], tokens[0::2], tokens[1::2])


@contextmanager
def adapter_off(model: nn.Module) -> Iterator[None]:
    """The frozen base alone: a PEFT model's adapter layers pass their input through, and so do the experts' LoRA.
    (Trained routers cannot be switched off: a run that trains them precomputes its reference.)"""
    disable = getattr(model, "disable_adapter", None)
    if disable is None:  # a plain model (tests): it is its own reference
        yield
        return
    with disable(), expert_lora_off(model):
        yield


@dataclass(frozen=True)
class PairLoss:
    """The recipe's preference objective over a micro-batch of pairs."""

    objective: Objective
    settings: PreferenceConfig
    forward: ForwardLoss

    @classmethod
    def for_config(cls, cfg: Config, device: torch.device) -> PairLoss:
        return cls(cfg.train.objective, cfg.preference, ForwardLoss.for_config(cfg, device))

    def metric_names(self) -> tuple[str, ...]:
        return (*METRICS, "chosen_nll") if self.objective == "orpo" else METRICS

    @property
    def needs_reference(self) -> bool:
        return self.objective == "dpo"

    def sequence_logps(self, model: nn.Module, batch: LossBatch, device: torch.device) -> torch.Tensor:
        return -self.forward.per_sample(model, batch, device)

    @torch.no_grad()
    def reference_logps(self, model: nn.Module, batch: LossBatch, device: torch.device,
                        adapter_is_reference: bool = False) -> torch.Tensor:
        """The base's log-probabilities (the adapter off); `adapter_is_reference`: the model's as it is (before
        the first step of a run that starts from a saved adapter, that adapter is the reference)."""
        if adapter_is_reference:
            return self.sequence_logps(model, batch, device)
        with adapter_off(model):
            return self.sequence_logps(model, batch, device)

    def pair_losses(self, policy: PairLogps, reference: PairLogps | None) -> tuple[torch.Tensor, PairRewards]:
        beta = self.settings.resolved_beta(self.objective)
        if self.objective == "dpo":
            assert reference is not None, "DPO compares against the reference"
            return dpo_losses(policy, reference, beta, self.settings.loss_type, self.settings.label_smoothing)
        if self.objective == "simpo":
            return simpo_losses(policy, beta, self.settings.gamma, self.settings.label_smoothing)
        assert self.objective == "orpo", self.objective
        return orpo_odds_ratio_losses(policy, self.settings.odds_ratio_weight)

    def loss_and_sums(self, model: nn.Module, batch: LossBatch, device: torch.device,
                      totals: PairCounts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's share of the step's loss, and its sums for the step's metrics (tensors: the planner
        runs this on fake ones). The reference log-probabilities: the batch's own where they were computed before
        training, else (DPO) a forward with the adapter off."""
        reference = getattr(batch, "reference_logps", None) if self.needs_reference else None
        if self.needs_reference and reference is None:
            reference = self.reference_logps(model, batch, device)
        policy = as_pairs(self.sequence_logps(model, batch, device), batch)
        reference_pairs = as_pairs(reference.to(device), batch) if reference is not None else None
        losses, rewards = self.pair_losses(policy, reference_pairs)
        loss = losses.sum() / max(totals.pairs, 1.0)
        sums = {"rewards_chosen": rewards.chosen.sum(), "rewards_rejected": rewards.rejected.sum(),
                "reward_margin": rewards.margin.sum(), "reward_accuracy": rewards.correct.sum()}
        if self.objective == "orpo":  # the SFT term on the chosen completions, per target token
            nll = -policy.chosen.sum()
            loss = loss + nll / max(totals.chosen_targets, 1.0)
            sums["chosen_nll"] = nll.detach()
        return loss, sums

    def __call__(self, model: nn.Module, batch: LossBatch,
                 device: torch.device, totals: PairCounts) -> tuple[torch.Tensor, dict[str, float]]:
        loss, sums = self.loss_and_sums(model, batch, device, totals)
        return loss, {key: float(value) for key, value in sums.items()}
