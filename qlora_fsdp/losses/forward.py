"""A micro-batch's forward and summed loss as the recipe runs it: the model code that training's step and the
planner's measured step share."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from qlora_fsdp.config import Config
from qlora_fsdp.distributed.split_sums import summed_over_split
from qlora_fsdp.layers.activation_offload import ActivationOffloader
from qlora_fsdp.layers.attention import attach_sample_bounds, flattens_packed_rows
from qlora_fsdp.layers.reward_head import reward_head, sequence_scores
from qlora_fsdp.layers.split_rows import model_trade
from qlora_fsdp.losses.router import RouterLoss, router_loss_coefficient
from qlora_fsdp.losses.tokens import (
    TokenWeight,
    per_sample_loss,
    summed_loss,
    target_hidden_states,
    target_logps,
)
from qlora_fsdp.vision.image_embeddings import RowPart, images_in_embeddings


class LossBatch(Protocol):
    """What the loss needs of a batch (qlora_fsdp.data.batching.Batch; model code does not import data)."""

    labels: torch.Tensor
    target_positions: torch.Tensor
    segments: Any
    n_targets: int

    def model_inputs(self, device: torch.device, one_row: bool) -> dict[str, Any]: ...

    def sample_bounds(self, one_row: bool) -> Any: ...

    def real_tokens(self) -> torch.Tensor: ...

    def last_tokens(self) -> torch.Tensor: ...

    def target_samples(self) -> torch.Tensor: ...

    def targets_per_sample(self) -> torch.Tensor: ...

    def whole_batch_targets(self) -> int: ...

    def numbered_samples(self) -> int: ...

    def counts_once(self) -> bool: ...

    def last_token_samples(self) -> torch.Tensor: ...

    @property
    def n_samples(self) -> int: ...


@dataclass(frozen=True)
class PolicyTokens:
    """GRPO's forward over a micro-batch of completions, at its target tokens (flat, in target order)."""

    logps: torch.Tensor  # log-probability of each target at the sampling temperature
    entropies: torch.Tensor  # the next-token distribution's entropy there (no gradient: logged only)
    router_aux: torch.Tensor | None  # a mixture of experts' load-balancing loss over the real tokens, where asked


@dataclass(frozen=True)
class ForwardLoss:
    """A micro-batch's forward and summed loss as the recipe runs it: chunked or full logits, and what
    checkpointing keeps offloaded to host memory or not. Training and the planner's measured step share it."""

    chunk_tokens: int | None = None  # None: the full logits
    offloader: ActivationOffloader | None = None
    router: RouterLoss = field(default_factory=RouterLoss)  # a mixture of experts' load balancing, if asked for
    token_weight: TokenWeight | None = None  # the objective's weight of each target token's loss (DFT's); None: 1

    @classmethod
    def for_config(cls, cfg: Config, device: torch.device) -> ForwardLoss:
        chunk = cfg.loss.chunk_tokens if cfg.loss.chunked else None
        offload = ActivationOffloader(device) if cfg.activation_checkpointing.offload else None
        return cls(chunk, offload)

    def __call__(self, model: nn.Module, batch: LossBatch, device: torch.device) -> torch.Tensor:
        """Summed cross-entropy over the batch's target tokens (labels are pre-shifted; each weighted by
        `token_weight`, where set); in training, plus the load-balancing loss times the batch's targets where the
        model's config asks for it (router_loss.py)."""
        inputs, labels, targets = model_inputs(model, batch, device)
        coefficient = router_loss_coefficient(model) if torch.is_grad_enabled() else None
        with (self.offloading(), self.router.catching(model, coefficient is not None) as router_logits,
              batch_images(model, batch, device)):
            total = summed_loss(model, inputs, labels, self.chunk_tokens, targets, self.token_weight)
        if coefficient is not None:
            trade = model_trade(model)
            aux = self.router.loss(model, router_logits, real_token_mask(batch, inputs, device), coefficient,
                                   trade.group if trade is not None else None)
            total = total + counted_once(aux * batch.whole_batch_targets(), batch)
        return total

    def per_sample(self, model: nn.Module, batch: LossBatch, device: torch.device) -> torch.Tensor:
        """Each sample's summed cross-entropy (minus its targets' log-probability), a vector of the batch's samples
        (a split row's: the whole row's sums on every rank of the split)."""
        inputs, labels, targets = model_inputs(model, batch, device)
        with self.offloading(), batch_images(model, batch, device):
            sums = per_sample_loss(model, inputs, labels, self.chunk_tokens, targets,
                                   batch.target_samples().to(device), batch.numbered_samples())
        return whole_row_sums(model, sums)

    def sequence_rewards(self, model: nn.Module, batch: LossBatch, device: torch.device) -> torch.Tensor:
        """A reward model's score of each sample (its reward head on the last token's final hidden state; in a
        split row, the rank holding that token scores it, and every rank of the split gets every score)."""
        head = reward_head(model)
        assert head is not None, "train.objective reward builds the model with its reward head"
        inputs, labels, _ = model_inputs(model, batch, device)
        with self.offloading(), batch_images(model, batch, device):
            _, hidden, _ = target_hidden_states(model, inputs, labels, batch.last_tokens().to(device))
        scores = sequence_scores(head, hidden)
        if model_trade(model) is None:
            return scores
        placed = scores.new_zeros(batch.numbered_samples()).index_add(0, batch.last_token_samples().to(device), scores)
        return whole_row_sums(model, placed)

    def token_logps(self, model: nn.Module, batch: LossBatch, device: torch.device, temperature: float = 1.0,
                    router_aux: bool = False) -> PolicyTokens:
        """Each target token's log-probability at `temperature` and the entropy there, flat in the batch's target
        order (GRPO); with `router_aux`, the routers' load-balancing loss over the batch's real tokens (padding
        left out, packed or not: the tokens a padded batch's attention mask keeps, as TRL's forward gets)."""
        inputs, labels, targets = model_inputs(model, batch, device)
        with (self.offloading(), self.router.catching(model, router_aux) as router_logits,
              batch_images(model, batch, device)):
            logps, entropies = target_logps(model, inputs, labels, self.chunk_tokens, targets, temperature)
        aux = None
        if router_aux:  # over a split row: the whole row's, on every rank of it
            trade = model_trade(model)
            aux = self.router.loss(model, router_logits, real_token_mask(batch, inputs, device), 1.0,
                                   trade.group if trade is not None else None)
        return PolicyTokens(logps, entropies, aux)

    def offloading(self) -> AbstractContextManager[Any]:
        """What the forward saves for backward waits in host memory (when the recipe offloads, and only where
        there will be a backward)."""
        if self.offloader is None or not torch.is_grad_enabled():
            return nullcontext()
        return self.offloader.offloading()


def model_inputs(model: nn.Module, batch: LossBatch,
                 device: torch.device) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """(the model's inputs, the shifted labels, the flat target positions) on the device."""
    one_row = flattens_packed_rows(getattr(getattr(model, "config", None), "_attn_implementation", ""))
    inputs = batch.model_inputs(device, one_row)
    positions = inputs.get("position_ids")
    if isinstance(positions, torch.Tensor) and batch.segments is not None:
        attach_sample_bounds(positions, batch.sample_bounds(one_row))
    return inputs, batch.labels.to(device), batch.target_positions.to(device)


def batch_images(model: nn.Module, batch: LossBatch, device: torch.device) -> AbstractContextManager[None]:
    """The batch's images embedded at its image tokens during the block (a split row's part: its own tokens')."""
    row_ids = getattr(batch, "row_ids", None)
    part = None if row_ids is None else RowPart(row_ids, getattr(batch, "part_start", 0))
    return images_in_embeddings(model, getattr(batch, "vision", None), device, part)


def real_token_mask(batch: LossBatch, inputs: dict[str, Any], device: torch.device) -> torch.Tensor:
    """1 at the tokens of samples, 0 at padding, in the shape the model took the batch."""
    return batch.real_tokens().reshape(inputs["input_ids"].shape).to(device)


def counted_once(value: torch.Tensor, batch: LossBatch) -> torch.Tensor:
    """A term every rank of a split row computes whole (the load-balancing loss over the row): each rank's
    backward needs all of it, the step's loss once (the split's first part's; the others add 0 of the same
    gradient)."""
    return value if batch.counts_once() else value - value.detach()


def whole_row_sums(model: nn.Module, sums: torch.Tensor) -> torch.Tensor:
    """Per-sample sums of this rank's part of a split row added over the split (context parallel); else as they
    are."""
    trade = model_trade(model)
    return sums if trade is None else summed_over_split(sums, trade.group)


def loss_sum(model: nn.Module, batch: LossBatch, device: torch.device) -> torch.Tensor:
    """The full loss, the reference the chunked one is held to."""
    return ForwardLoss()(model, batch, device)
