"""The preference objectives (train.objective dpo, orpo, simpo, kto, reward): one class, a subclass each naming
its loss (qlora_fsdp/losses/pair_losses.py).

A unit is a pair (KTO: a record, read as a pair of its own and its KL sequence), laid out a pair a row (its two
sequences side by side) or packed rows of pairs. The reference log-probabilities (DPO, KTO) are a forward with
the adapter off each micro-batch, or computed once before training (preference.reference) and carried by the
batches.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from qlora_fsdp.config import Config
from qlora_fsdp.data.batching import Batch, Sample, collate_packed
from qlora_fsdp.data.pipeline import Dataset, TokenizedData
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.losses.pair_losses import (
    BradleyTerryLoss,
    DpoLoss,
    KtoLoss,
    OrpoLoss,
    PairCounts,
    PairLoss,
    SimpoLoss,
)
from qlora_fsdp.objectives.base import Objective, RunParts, StepResult, full_length_batches
from qlora_fsdp.objectives.pair_reference import reference_logps
from qlora_fsdp.objectives.pair_steps import accumulate_pairs, evaluate_pairs, pair_rows, with_pair_extras
from qlora_fsdp.objectives.row_shards import row_part


class Pairs(Objective):
    LOSS: ClassVar[type[PairLoss]]  # each preference objective's, below
    PROGRESS_METRICS: ClassVar[tuple[str, ...]] = ("reward_accuracy", "reward_margin")
    EVAL_METRICS: ClassVar[tuple[str, ...]] = ("eval_loss", "eval_reward_accuracy", "eval_reward_margin")
    SECTIONS: ClassVar[tuple[str, ...]] = ("preference",)

    def __init__(self, cfg: Config, forward_loss: ForwardLoss) -> None:
        super().__init__(cfg, forward_loss)
        self.loss = self.LOSS.with_forward(cfg, forward_loss)
        self.references: dict[str, torch.Tensor] | None = None  # computed before training (preference.reference)
        self.extras: dict[str, dict[str, list]] = {"train": {}, "eval": {}}

    def attach(self, run: RunParts) -> None:
        super().attach(run)
        # KTO's labels, a reward model's margins
        self.extras = {name: Dataset.pair_extras(split) for name, split in (("train", self.data.train),
                                                                              ("eval", self.data.eval))}

    @property
    def data(self) -> TokenizedData:
        return self.parts.data

    # ---- the reference -----------------------------------------------------------------------------------------

    def precomputes_reference(self) -> bool:
        """DPO with preference.reference precomputed, or auto and a run that sees every training pair."""
        setting = self.cfg.preference.reference
        if not self.loss.needs_reference or setting == "adapter_off":
            return False
        # the saved adapter, or trained routers (which no switch turns off): the reference is the start's model
        if setting == "precomputed" or self.cfg.model.adapter or self.cfg.lora.train_router:
            return True
        sampler = self.parts.sampler
        assert sampler is not None, "a training run's objective draws from the loop's sampler"
        pairs_per_step = sampler.units_per_step * len(self.data.train) / self.data.n_units
        return self.cfg.train.max_steps * pairs_per_step >= len(self.data.train)

    def planned_extra_forwards(self) -> int:
        """A reference forward each micro-batch where it may run: adapter_off, or auto (which chooses by the data's
        size, unknown to a plan: the plan takes the larger)."""
        return int(self.loss.needs_reference and self.cfg.preference.reference != "precomputed"
                   and not self.cfg.model.adapter and not self.cfg.lora.train_router)

    def watch_forwards(self, hook: Callable[[], None]) -> None:
        self.loss = self.loss.tracked(hook)

    def extra_forwards(self) -> int:
        return int(self.loss.needs_reference and not self.precomputes_reference())

    def prepare(self, step: int) -> None:
        if self.precomputes_reference() and self.references is None:
            run = self.parts
            run.write("reference log-probabilities: computed once before training (preference.reference)")
            self.references = reference_logps(self.cfg, run.model, self.data, self.loss, run.pad_id, run.info,
                                              Path(self.cfg.train.output_dir), step, run.split)

    # ---- the steps ---------------------------------------------------------------------------------------------

    def pair_batch(self, pair_ids: list[int], rows: list[list[Sample]], length: int | None = None) -> Batch:
        """The rows as the model takes them: under context parallel, this rank's part of them laid end to end."""
        batch = collate_packed(rows, self.parts.pad_id, length)
        if self.references is not None:  # each pair's chosen, then its rejected sequence, as the rows hold them
            batch.reference_logps = self.references["train"][pair_ids].flatten()
        return row_part(with_pair_extras(batch, self.extras["train"], pair_ids), self.parts.split, self.parts.pad_id)

    def micro_batches(self) -> list[Batch]:
        """A pair a row, its two sequences side by side, or packed rows of pairs."""
        data, sampler = self.data, self.parts.sampler
        assert sampler is not None, "a training run's objective draws from the loop's sampler"
        if data.packs is None:
            return [self.pair_batch(units, pair_rows(data.samples(data.train, units)))
                    for units in sampler.next_step()]
        packs = data.packs
        return [self.pair_batch([p for u in units for p in packs[u]],
                                [data.samples(data.train, packs[u]) for u in units], self.cfg.data.context_length)
                for units in sampler.next_step()]

    def step(self, loss_factor: float) -> StepResult:
        return accumulate_pairs(self.parts.model, self.micro_batches(), self.parts.info.device, self.loss,
                                loss_factor)

    def evaluate(self, step: int) -> dict[str, float]:
        run = self.parts
        references = self.references["eval"] if self.references is not None else None
        return evaluate_pairs(run.model, self.held_out, self.cfg.data.eval_batch_size, run.pad_id, run.info,
                              self.loss, references, self.extras["eval"], run.split)

    # ---- a plan ------------------------------------------------------------------------------------------------

    def planned_batches(self) -> list[Batch]:
        rows = self.planned_rows()
        batches = full_length_batches(self.cfg, rows)  # a pair's two sequences share a row
        for batch in batches[:1]:  # one batch object, repeated
            if self.loss.needs_reference and not self.planned_extra_forwards():  # computed ahead
                batch.reference_logps = torch.zeros(batch.n_samples)
            if self.cfg.train.kind.unpaired:  # each record's label
                batch.desirable = torch.arange(rows) % 2 == 0
        return batches

    def planned_micro_step(self, model: nn.Module, batch: Batch, device: torch.device) -> None:
        pairs = PairCounts(pairs=float(max(batch.n_samples // 2, 1)), chosen_targets=float(max(batch.n_targets, 1)))
        self.loss.loss_and_sums(model, batch, device, pairs)[0].backward()


class Dpo(Pairs):
    LOSS = DpoLoss


class Orpo(Pairs):
    LOSS = OrpoLoss


class Simpo(Pairs):
    LOSS = SimpoLoss


class Kto(Pairs):
    LOSS = KtoLoss
    PROGRESS_METRICS: ClassVar[tuple[str, ...]] = ("kl",)
    EVAL_METRICS: ClassVar[tuple[str, ...]] = ("eval_loss", "eval_rewards_desirable", "eval_rewards_undesirable")


class RewardModel(Pairs):
    LOSS = BradleyTerryLoss
