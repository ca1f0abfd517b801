"""The input embeddings and the output head trained in full beside LoRA (`lora.train_embeddings`): a new language,
continued pretraining, new tokens. Unquantized (the head always is; the embeddings are never 4-bit), in lora.dtype,
and saved under their own names as PEFT's modules_to_save saves them.

The layers between keep their compute dtype: the embeddings' output is cast to it, and the head casts its input up
to its weights' dtype (the loss computes in fp32 anyway).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn


def embedding_modules(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(input embeddings, output head) of a causal LM (a PEFT model or the model it wraps)."""
    inner = cast(Any, model)
    return inner.get_input_embeddings(), inner.get_output_embeddings()


def embedding_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The embeddings' and the head's weights (one tensor where the head is tied to the embeddings)."""
    found: list[nn.Parameter] = []
    for module in embedding_modules(model):
        weight = cast(nn.Parameter, module.weight)
        if all(weight is not p for p in found):
            found.append(weight)
    return found


def train_embeddings(model: nn.Module, dtype: torch.dtype, compute_dtype: torch.dtype) -> list[str]:
    """Make the embeddings and the head trainable in `dtype`; PEFT's modules_to_save names for them."""
    embeddings, head = embedding_modules(model)
    for module in (embeddings, head):
        module.weight.data = module.weight.data.to(dtype)
        module.weight.requires_grad_(True)
    if dtype != compute_dtype:
        embeddings.register_forward_hook(lambda _m, _args, output: output.to(compute_dtype))
        head.register_forward_pre_hook(lambda m, args: (args[0].to(m.weight.dtype), *args[1:]))
    names = dict((id(module), name) for name, module in model.named_modules())
    return [names[id(embeddings)].rsplit(".", 1)[-1], names[id(head)].rsplit(".", 1)[-1]]
