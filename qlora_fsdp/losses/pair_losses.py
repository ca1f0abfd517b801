"""A micro-batch of preference pairs: each sequence's log-probability under the policy (and, for DPO, under the
reference: the same 4-bit base with the adapter turned off, so no second model is held), then the pair losses.

A batch holds its pairs' sequences in order, chosen then rejected (qlora_fsdp/data/pair_encoding.py). The step's
loss is the mean over the pairs of the whole effective batch (all micro-batches, all ranks), so the micro-batch's
share is its summed pair losses over that count; ORPO adds the chosen completions' NLL over their target tokens.
KTO's records are pairs too: a record's own sequence, then its KL sequence (qlora_fsdp/losses/kto.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from qlora_fsdp.config import Config, PreferenceConfig
from qlora_fsdp.layers.expert_lora import expert_lora_off
from qlora_fsdp.losses.forward import ForwardLoss, LossBatch
from qlora_fsdp.losses.kto import kl_reference_point, kto_losses
from qlora_fsdp.losses.pair_formulas import (
    PairLogps,
    PairRewards,
    bradley_terry_losses,
    dpo_losses,
    orpo_odds_ratio_losses,
    simpo_losses,
)

# the sums a micro-batch adds to the step's metrics (each then divided by the step's pairs)
METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")
# KTO's: the mean reward of the desirable records and of the undesirable ones, and the step's z0
KTO_METRICS = ("rewards_desirable", "rewards_undesirable", "kl")


@dataclass(frozen=True)
class PairCounts:
    """What the step's loss is normalized by, summed over micro-batches and ranks."""

    pairs: float
    chosen_targets: float
    desirable: float = 0.0  # kto: the records labelled desirable
    kl: float = 0.0  # kto: the step's reference point z0

    def denominator(self, metric: str) -> float:
        """What a metric's step sum is divided by."""
        counts = {"chosen_nll": self.chosen_targets, "rewards_desirable": self.desirable,
                  "rewards_undesirable": self.pairs - self.desirable}
        return max(counts.get(metric, self.pairs), 1.0)


def pair_counts(batch: LossBatch) -> tuple[int, int, int]:
    """(pairs, target tokens of the chosen completions, kto's desirable records) of a batch of pair sequences; a
    split row's pairs are counted by its first part."""
    if not batch.counts_once():
        return 0, 0, 0
    desirable = getattr(batch, "desirable", None)
    return (batch.n_samples // 2, int(batch.targets_per_sample()[0::2].sum()),
            int(desirable.sum()) if desirable is not None else 0)


def as_pairs(sequence_logps: torch.Tensor, batch: LossBatch) -> PairLogps:
    tokens = batch.targets_per_sample().to(sequence_logps)
    return PairLogps(sequence_logps[0::2], sequence_logps[1::2], tokens[0::2], tokens[1::2])


def reward_sums(rewards: PairRewards) -> dict[str, torch.Tensor]:
    """A micro-batch's sums for the step's reward metrics."""
    return {"rewards_chosen": rewards.chosen.sum(), "rewards_rejected": rewards.rejected.sum(),
            "reward_margin": rewards.margin.sum(), "reward_accuracy": rewards.correct.sum()}


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


def no_hook() -> None:
    pass


@dataclass(frozen=True)
class PairLoss:
    """A preference objective's loss over a micro-batch of pairs; each objective's is a subclass below (its
    objective class, objectives/preference.py, names it)."""

    settings: PreferenceConfig
    forward: ForwardLoss
    beta: float
    needs_reference: bool = False
    after_reference: Callable[[], None] = no_hook  # the planner's tracker: the policy's forward comes next
    metrics: tuple[str, ...] = METRICS
    kl_pass: bool = False  # KTO: a first pass over the step's micro-batches finds z0

    @classmethod
    def with_forward(cls, cfg: Config, forward: ForwardLoss) -> PairLoss:
        """This loss with the recipe's settings over `forward`."""
        return cls(cfg.preference, forward, cfg.preference.resolved_beta(cfg.train.objective), cfg.train.kind.reference)

    def tracked(self, after_reference: Callable[[], None]) -> PairLoss:
        """The same loss, calling `after_reference` once a reference forward is done."""
        return dataclasses.replace(self, after_reference=after_reference)

    def metric_names(self) -> tuple[str, ...]:
        return self.metrics

    def sequence_logps(self, model: nn.Module, batch: LossBatch, device: torch.device) -> torch.Tensor:
        return -self.forward.per_sample(model, batch, device)

    @torch.no_grad()
    def reference_logps(self, model: nn.Module, batch: LossBatch, device: torch.device,
                        adapter_is_reference: bool = False) -> torch.Tensor:
        """The base's log-probabilities (the adapter off); `adapter_is_reference`: the model's as it is (before
        the first step of a run that starts from a saved adapter, that adapter is the reference)."""
        if adapter_is_reference:
            logps = self.sequence_logps(model, batch, device)
        else:
            with adapter_off(model):
                logps = self.sequence_logps(model, batch, device)
        self.after_reference()
        return logps

    def batch_reference(self, model: nn.Module, batch: LossBatch, device: torch.device) -> torch.Tensor:
        """The batch's reference log-probabilities: its own where they were computed before (before training, or
        by KTO's first pass over the step), else a forward with the adapter off."""
        reference = getattr(batch, "reference_logps", None)
        return self.reference_logps(model, batch, device) if reference is None else reference.to(device)

    def pair_losses(self, policy: PairLogps, reference: PairLogps | None) -> tuple[torch.Tensor, PairRewards]:
        raise NotImplementedError

    def kl_sums(self, model: nn.Module, batch: LossBatch, device: torch.device) -> tuple[float, int]:
        """A loss with `kl_pass` (KTO): its first pass over a micro-batch, (summed log-ratios, their count)."""
        raise NotImplementedError(f"{type(self).__name__} makes no first pass")

    def loss_and_sums(self, model: nn.Module, batch: LossBatch, device: torch.device,
                      totals: PairCounts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's share of the step's loss, and its sums for the step's metrics (tensors: the planner
        runs this on fake ones). The reference log-probabilities: the batch's own where they were computed before
        training, else (DPO) a forward with the adapter off."""
        reference = self.batch_reference(model, batch, device) if self.needs_reference else None
        policy = as_pairs(self.sequence_logps(model, batch, device), batch)
        losses, rewards = self.pair_losses(policy, as_pairs(reference, batch) if reference is not None else None)
        return losses.sum() / max(totals.pairs, 1.0), reward_sums(rewards)

    def __call__(self, model: nn.Module, batch: LossBatch,
                 device: torch.device, totals: PairCounts) -> tuple[torch.Tensor, dict[str, float]]:
        loss, sums = self.loss_and_sums(model, batch, device, totals)
        return loss, {key: float(value) for key, value in sums.items()}


@dataclass(frozen=True)
class DpoLoss(PairLoss):
    def pair_losses(self, policy: PairLogps, reference: PairLogps | None) -> tuple[torch.Tensor, PairRewards]:
        assert reference is not None, "DPO compares against the reference"
        return dpo_losses(policy, reference, self.beta, self.settings.loss_type, self.settings.label_smoothing)


@dataclass(frozen=True)
class SimpoLoss(PairLoss):
    def pair_losses(self, policy: PairLogps, reference: PairLogps | None) -> tuple[torch.Tensor, PairRewards]:
        return simpo_losses(policy, self.beta, self.settings.gamma, self.settings.label_smoothing)


@dataclass(frozen=True)
class OrpoLoss(PairLoss):
    metrics: tuple[str, ...] = (*METRICS, "chosen_nll")

    def pair_losses(self, policy: PairLogps, reference: PairLogps | None) -> tuple[torch.Tensor, PairRewards]:
        return orpo_odds_ratio_losses(policy, self.settings.odds_ratio_weight)

    def loss_and_sums(self, model: nn.Module, batch: LossBatch, device: torch.device,
                      totals: PairCounts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The odds-ratio term, plus the SFT term on the chosen completions, per target token."""
        policy = as_pairs(self.sequence_logps(model, batch, device), batch)
        losses, rewards = self.pair_losses(policy, None)
        nll = -policy.chosen.sum()
        loss = losses.sum() / max(totals.pairs, 1.0) + nll / max(totals.chosen_targets, 1.0)
        return loss, {**reward_sums(rewards), "chosen_nll": nll.detach()}


@dataclass(frozen=True)
class KtoLoss(PairLoss):
    """A record's own sequence, then its KL sequence; z0 from a first pass over the step (kl_sums)."""

    metrics: tuple[str, ...] = KTO_METRICS
    kl_pass: bool = True

    @torch.no_grad()
    def kl_sums(self, model: nn.Module, batch: LossBatch, device: torch.device) -> tuple[float, int]:
        """KTO's first pass over a micro-batch: the summed log-ratios of its KL sequences and their count. The
        reference it computes stays with the batch for the loss's pass."""
        reference = self.batch_reference(model, batch, device)
        cast(Any, batch).reference_logps = reference
        total, count = kl_reference_point(self.sequence_logps(model, batch, device)[1::2], reference[1::2])
        return float(total), count

    def loss_and_sums(self, model: nn.Module, batch: LossBatch, device: torch.device,
                      totals: PairCounts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        desirable = getattr(batch, "desirable", None)
        assert desirable is not None, "KTO's batches carry their records' labels"
        desirable = desirable.to(device)
        reference = self.batch_reference(model, batch, device)[0::2]
        policy = self.sequence_logps(model, batch, device)[0::2]
        losses, rewards = kto_losses(policy, reference, totals.kl, desirable, self.beta,
                                     self.settings.desirable_weight, self.settings.undesirable_weight)
        # masks by multiplication: the planner runs this on fake tensors, where boolean indexing has no shape
        sums = {"rewards_desirable": (rewards * desirable).sum(), "rewards_undesirable": (rewards * ~desirable).sum(),
                "kl": torch.tensor(totals.kl * len(losses))}
        return losses.sum() / max(totals.pairs, 1.0), sums


@dataclass(frozen=True)
class BradleyTerryLoss(PairLoss):
    """A reward model's pairs: each sequence scored, the Bradley-Terry loss on each pair's two scores."""

    def loss_and_sums(self, model: nn.Module, batch: LossBatch, device: torch.device,
                      totals: PairCounts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        scores = self.forward.sequence_rewards(model, batch, device)
        margin = getattr(batch, "margin", None)
        losses, rewards = bradley_terry_losses(scores[0::2], scores[1::2], None if margin is None else margin.to(
            scores), self.settings.center_rewards_coefficient)
        return losses.sum() / max(totals.pairs, 1.0), reward_sums(rewards)

