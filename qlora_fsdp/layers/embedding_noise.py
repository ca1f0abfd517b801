"""NEFTune: uniform noise on the input embeddings while training, as transformers' Trainer adds it.

Each element of the embeddings' output [rows, tokens, hidden] gets noise drawn uniformly from +-alpha/sqrt(tokens *
hidden), tokens being the row's length (padding and packed neighbours included), from the global random generator
(saved with every checkpoint, so a resumed run draws what the uninterrupted one would). Only forwards that build a
graph get noise: held-out evaluation, a reference forward and generation run without gradients and see none.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn


def embedding_noise(embeddings: torch.Tensor, alpha: float) -> torch.Tensor:
    """`embeddings` [rows, tokens, hidden] plus NEFTune's noise."""
    magnitude = alpha / math.sqrt(embeddings.shape[1] * embeddings.shape[2])
    return embeddings + torch.zeros_like(embeddings).uniform_(-magnitude, magnitude)


def add_embedding_noise(model: nn.Module, alpha: float) -> None:
    """Noise on `model`'s input embeddings in training forwards (a forward hook on its embedding module)."""
    def hook(module: nn.Module, _inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        if module.training and torch.is_grad_enabled():
            return embedding_noise(output, alpha)
        return output

    embeddings = cast(Any, model).get_input_embeddings()
    assert isinstance(embeddings, nn.Module), "every causal LM transformers builds has input embeddings"
    embeddings.register_forward_hook(hook)
