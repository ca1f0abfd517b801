"""A reward model's scalar head: one linear map of the final hidden state at a sequence's last token, trained in full
beside LoRA, as transformers' *ForSequenceClassification (num_labels 1) scores a sequence.

It sits beside the language model's own head as `score` (PEFT's name for it, saved as a sequence-classification
adapter's modules_to_save), so the decoder, its LoRA and its sharding are the causal LM's.
"""

from __future__ import annotations

import peft
import torch
import torch.nn.functional as F
from torch import nn

REWARD_HEAD = "score"


def attach_reward_head(model: nn.Module, hidden_size: int, dtype: torch.dtype) -> None:
    """A trainable [1, hidden] `score` on `model` (the transformers model inside the PEFT wrapper), on meta; the
    loader initializes it (fill.init_lora)."""
    head = nn.Linear(hidden_size, 1, bias=False, device="meta", dtype=dtype)
    head.weight.requires_grad_(True)
    setattr(model, REWARD_HEAD, head)


def reward_head(model: nn.Module) -> nn.Linear | None:
    """The reward head of a built model (a PEFT model or the model it wraps), or None for a causal LM."""
    inner = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    head = getattr(inner, REWARD_HEAD, None)
    return head if isinstance(head, nn.Linear) else None


def sequence_scores(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """Each sequence's reward from its last token's final hidden state, [sequences, hidden] -> [sequences], in the
    head's dtype."""
    weight = head.weight
    return F.linear(hidden.to(weight.dtype), weight).squeeze(-1)
