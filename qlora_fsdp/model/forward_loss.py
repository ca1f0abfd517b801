"""A micro-batch's forward and summed loss as the recipe runs it: the model code that training's step and the
planner's measured step share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from qlora_fsdp.config import Config
from qlora_fsdp.model.activation_offload import ActivationOffloader
from qlora_fsdp.model.attention import attach_sample_bounds, flattens_packed_rows
from qlora_fsdp.model.loss import summed_loss


class LossBatch(Protocol):
    """What the loss needs of a batch (qlora_fsdp.data.batching.Batch; model code does not import data)."""

    labels: torch.Tensor
    target_positions: torch.Tensor
    segments: Any

    def model_inputs(self, device: torch.device, one_row: bool) -> dict[str, Any]: ...

    def sample_bounds(self, one_row: bool) -> Any: ...


@dataclass(frozen=True)
class ForwardLoss:
    """A micro-batch's forward and summed loss as the recipe runs it: chunked or full logits, and what
    checkpointing keeps offloaded to host memory or not. Training and the planner's measured step share it."""

    chunk_tokens: int | None = None  # None: the full logits
    offloader: ActivationOffloader | None = None

    @classmethod
    def for_config(cls, cfg: Config, device: torch.device) -> ForwardLoss:
        chunk = cfg.loss.chunk_tokens if cfg.loss.chunked else None
        offload = ActivationOffloader(device) if cfg.activation_checkpointing.offload else None
        return cls(chunk, offload)

    def __call__(self, model: nn.Module, batch: LossBatch, device: torch.device) -> torch.Tensor:
        """Summed cross-entropy over the batch's target tokens (labels are pre-shifted)."""
        one_row = flattens_packed_rows(getattr(getattr(model, "config", None), "_attn_implementation", ""))
        inputs, labels = batch.model_inputs(device, one_row), batch.labels.to(device)
        positions = inputs.get("position_ids")
        if isinstance(positions, torch.Tensor) and batch.segments is not None:
            attach_sample_bounds(positions, batch.sample_bounds(one_row))
        targets = batch.target_positions.to(device)
        if self.offloader is None or not torch.is_grad_enabled():
            return summed_loss(model, inputs, labels, self.chunk_tokens, targets)
        with self.offloader.offloading():  # what the forward saves for backward waits in host memory
            return summed_loss(model, inputs, labels, self.chunk_tokens, targets)


def loss_sum(model: nn.Module, batch: LossBatch, device: torch.device) -> torch.Tensor:
    """The full loss, the reference the chunked one is held to."""
    return ForwardLoss()(model, batch, device)
