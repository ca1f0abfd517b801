"""The attention side of a decoder layer over the row in tiles (`activation_checkpointing.attention_tile_tokens`):
the layer's norms and its attention's projections (q, k, v, o with their LoRA; the head norms of Qwen3 and Gemma 3)
run `tile` tokens at a time, in forward and in backward, like the MLP tiles.

Each of these modules is per token, so tiling changes no number but the order of the LoRA weights' gradient sums.
What a module keeps for its backward shrinks to its input: an RMSNorm's fp32 copies of the row (two or three
[tokens, hidden] fp32 tensors a norm), PEFT's cast input and A product, exist for one tile at a time. What remains
whole is what attention itself needs: the layer's input, the normed input the projections share, q, k, v and the
attention's output (each a [tokens, hidden]-sized tensor, in the compute dtype).

The attention kernel (and anything else in the attention module: sinks, rotary) runs over the whole row as before.
Inside a checkpointed layer the recompute runs the tiled forwards again, which save only their inputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qlora_fsdp.errors import ConfigError
from qlora_fsdp.layers.tiled_mlp import TiledForward

TOKENS_DIM = 1  # [rows, tokens, ...] for the norms and projections alike ([rows, tokens, heads, dim] for head norms)


def per_token_modules(layer: nn.Module) -> list[nn.Module]:
    """The layer's norms and its attention's projections and head norms: every family names them `*norm` and
    `*_proj` (the MLP, tiled on its own, is left out; so is a recurrent mixer's inside, which is not per token)."""
    norms = [child for name, child in layer.named_children() if name.endswith("norm")]
    attention = getattr(layer, "self_attn", None)
    if not isinstance(attention, nn.Module):
        return norms
    return norms + [child for name, child in attention.named_children() if name.endswith(("_proj", "norm"))]


def tile_module(module: nn.Module, tile: int) -> None:
    """Make `module`'s forward run in tiles of `tile` tokens along dim 1 (inputs no longer than a tile run as they
    are: generation's single tokens, short rows)."""
    plain = module.forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or x.dim() < 2 or x.shape[TOKENS_DIM] <= tile:
            return plain(x, *args, **kwargs)
        params = tuple(p for p in module.parameters() if p.requires_grad)
        return TiledForward.apply(plain, module, tile, TOKENS_DIM, x, *params)

    module.forward = forward


def tile_attention_sides(layers: list[nn.Module], tile: int, dropout: float) -> int:
    """Tile every decoder layer's norms and attention projections; returns how many modules. LoRA dropout is
    refused in one line (its masks would differ between forward and backward)."""
    if dropout:
        raise ConfigError(f"'activation_checkpointing.attention_tile_tokens' with 'lora.dropout: {dropout}': the "
                          "tiles' dropout masks would differ between forward and backward; set lora.dropout to 0")
    if not any(isinstance(getattr(layer, "self_attn", None), nn.Module) for layer in layers):
        raise ConfigError(f"'activation_checkpointing.attention_tile_tokens': {type(layers[0]).__name__} has no "
                          "`self_attn`; set attention_tile_tokens to 0")
    count = 0
    for layer in layers:
        for module in per_token_modules(layer):
            tile_module(module, tile)
            count += 1
    return count
