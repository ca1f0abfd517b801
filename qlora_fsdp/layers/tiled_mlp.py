"""The MLP over the sequence in tiles (`activation_checkpointing.mlp_tile_tokens`): its intermediate tensors (rows x
tokens x intermediate size, the largest of a layer) then exist for one tile at a time, in forward and in backward,
so a layer's peak stops growing with the row beyond its input and output.

The MLP is per token, so tiling along the sequence changes no number but the order of the weights' gradient sums.
Forward runs the tiles without keeping their graphs and saves only the input; backward runs each tile's forward
again and its backward, summing the trainable weights' gradients over the tiles and handing them to autograd as
the function's own (no gradient is written behind autograd's back, so FSDP2's reduce-scatter sees them as always).
Inside a checkpointed layer the recompute runs the tiled forward again, which saves only the input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from qlora_fsdp.errors import ConfigError


class TiledForward(torch.autograd.Function):
    """forward(x) of a per-token module in tiles of `tile` tokens along dim -2; `params` its trainable tensors."""

    @staticmethod
    def forward(ctx: Any, run: Callable[[torch.Tensor], torch.Tensor], tile: int, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.tile = run, tile  # the weights are found again in backward, on the module, in this order
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([run(part) for part in x.detach().split(tile, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        params = tuple(p for p in ctx.run.__self__.parameters() if p.requires_grad)
        grad_x = torch.zeros_like(x) if ctx.needs_input_grad[2] else None
        grads: list[torch.Tensor] = []
        for start in range(0, x.shape[-2], ctx.tile):
            part = x[..., start : start + ctx.tile, :].detach().requires_grad_(ctx.needs_input_grad[2])
            with torch.enable_grad():
                out = ctx.run(part)
            wanted = [part] if grad_x is not None else []
            found = torch.autograd.grad(out, [*wanted, *params], grad_out[..., start : start + ctx.tile, :])
            if grad_x is not None:
                grad_x[..., start : start + ctx.tile, :] = found[0]
            grads = list(found[len(wanted):]) if not grads else [a + b for a, b in zip(grads, found[len(wanted):],
                                                                                       strict=True)]
        return (None, None, grad_x, *grads)


def tile_mlp(mlp: nn.Module, tile: int) -> None:
    """Make `mlp`'s forward run in tiles of `tile` tokens (rows no longer than a tile run as they are)."""
    plain = mlp.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] <= tile:
            return plain(x)
        params = tuple(p for p in mlp.parameters() if p.requires_grad)
        return TiledForward.apply(plain, tile, x, *params)

    mlp.forward = forward


def tile_mlps(layers: list[nn.Module], tile: int, dropout: float) -> int:
    """Tile every decoder layer's MLP; returns how many. A mixture of experts (its router's loss sums over the whole
    row) and LoRA dropout (its masks would differ between forward and backward) are refused in one line."""
    if dropout:
        raise ConfigError(f"'activation_checkpointing.mlp_tile_tokens' with 'lora.dropout: {dropout}': the tiles' "
                          "dropout masks would differ between forward and backward; set lora.dropout to 0")
    count = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise ConfigError(f"'activation_checkpointing.mlp_tile_tokens': {type(layer).__name__} has no `mlp`")
        if hasattr(mlp, "gate") or hasattr(mlp, "experts") or hasattr(mlp, "router"):
            raise ConfigError(f"'activation_checkpointing.mlp_tile_tokens': {type(mlp).__name__} is a mixture of "
                              "experts, whose tiles are not supported yet; set it to 0")
        tile_mlp(mlp, tile)
        count += 1
    return count
