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
    """run(x) of a per-token module in tiles of `tile` tokens along dim `dim` (the MLP's -2, the attention side's 1:
    its head norms see [rows, tokens, heads, dim]); `params` the module's trainable tensors."""

    @staticmethod
    def forward(ctx: Any, run: Callable[[torch.Tensor], Any], module: nn.Module, tile: int, dim: int,
                x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.module, ctx.tile, ctx.dim = run, module, tile, dim  # backward finds the weights on the module
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([hidden_of(run(part)) for part in x.detach().split(tile, dim=dim)], dim=dim)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        params = tuple(p for p in ctx.module.parameters() if p.requires_grad)
        grad_x = torch.zeros_like(x) if ctx.needs_input_grad[4] else None
        grads: list[torch.Tensor] = []
        for start in range(0, x.shape[ctx.dim], ctx.tile):
            part = x.narrow(ctx.dim, start, min(ctx.tile, x.shape[ctx.dim] - start))
            part = part.detach().requires_grad_(grad_x is not None)
            with torch.enable_grad():
                out = hidden_of(ctx.run(part))
            wanted = [part] if grad_x is not None else []
            # a mixture of experts: an expert no token of this tile chose has no gradient from it
            found = tuple(torch.zeros_like(t) if g is None else g for t, g in zip(
                [*wanted, *params], torch.autograd.grad(out, [*wanted, *params],
                                                        grad_out.narrow(ctx.dim, start, part.shape[ctx.dim]),
                                                        allow_unused=True),
                strict=True))
            if grad_x is not None:
                grad_x.narrow(ctx.dim, start, part.shape[ctx.dim]).copy_(found[0])
            grads = list(found[len(wanted):]) if not grads else [a + b for a, b in zip(grads, found[len(wanted):],
                                                                                       strict=True)]
        return (None, None, None, None, grad_x, *grads)


def hidden_of(output: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """An MLP's hidden states: gpt-oss' returns them with its router's scores."""
    return output[0] if isinstance(output, tuple) else output


def tile_mlp(mlp: nn.Module, tile: int) -> None:
    """Make `mlp`'s forward run in tiles of `tile` tokens (rows no longer than a tile run as they are). An MLP that
    returns its router's scores beside its output returns None for them when tiled: nothing reads them but the
    load-balancing loss, which is refused with tiles."""
    plain = mlp.forward
    returns_scores = [False]

    def run(x: torch.Tensor) -> torch.Tensor:
        output = plain(x)
        returns_scores[0] = isinstance(output, tuple)
        return output

    def forward(x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, None]:
        if x.shape[-2] <= tile:
            return plain(x)
        params = tuple(p for p in mlp.parameters() if p.requires_grad)
        out = TiledForward.apply(run, mlp, tile, -2, x, *params)
        return (out, None) if returns_scores[0] else out

    mlp.forward = forward


def tile_mlps(layers: list[nn.Module], tile: int, dropout: float, router_loss: bool = False) -> int:
    """Tile every decoder layer's MLP; returns how many. A mixture of experts' load-balancing loss (`router_loss`:
    it counts the whole row's routing together) and LoRA dropout (its masks would differ between forward and
    backward) are refused in one line."""
    if dropout:
        raise ConfigError(f"'activation_checkpointing.mlp_tile_tokens' with 'lora.dropout: {dropout}': the tiles' "
                          "dropout masks would differ between forward and backward; set lora.dropout to 0")
    count = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise ConfigError(f"'activation_checkpointing.mlp_tile_tokens': {type(layer).__name__} has no `mlp`")
        if router_loss and (hasattr(mlp, "gate") or hasattr(mlp, "experts") or hasattr(mlp, "router")):
            raise ConfigError(f"'activation_checkpointing.mlp_tile_tokens' with {type(mlp).__name__}'s load-balancing "
                              "loss (output_router_logits, or GRPO with router_aux_loss_coef): it counts the whole "
                              "row's routing together; turn the loss off or set mlp_tile_tokens to 0")
        tile_mlp(mlp, tile)
        count += 1
    return count
