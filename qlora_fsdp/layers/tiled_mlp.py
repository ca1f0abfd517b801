"""The MLP over the sequence in tiles (`activation_checkpointing.mlp_tile_tokens`): its intermediate tensors (rows x
tokens x intermediate size, the largest of a layer) then exist for one tile at a time, in forward and in backward,
so a layer's peak stops growing with the row beyond its input and output.

The MLP is per token, so tiling along the sequence changes no number but the order of the weights' gradient sums.
Forward runs the tiles without keeping their graphs and saves only the input; backward runs each tile's forward
again and its backward, summing the trainable weights' gradients over the tiles and handing them to autograd as
the function's own (no gradient is written behind autograd's back, so FSDP2's reduce-scatter sees them as always).
Inside a checkpointed layer the recompute runs the tiled forward again, which saves only the input.

On the planner's fake tensors only the first two tiles run (each allocates and frees the same transients, and the
second adds the gradient sums'): the others' work is the planner's op counter's to repeat, between two marker ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from qlora_fsdp.errors import ConfigError

PLANNED_TILES = 2  # tiles a fake step runs; the rest are priced as repeats of them


@torch.library.custom_op("qlora_fsdp::tile_work_begin", mutates_args=())
def tile_work_begin(anchor: torch.Tensor) -> None:
    """Nothing at run time: under fake tensors, where the tiles a fake step runs begin (measure/step_tracker.py)."""


@torch.library.custom_op("qlora_fsdp::tile_work_end", mutates_args=())
def tile_work_end(anchor: torch.Tensor, repeats: float) -> None:
    """Nothing at run time: the work since the begin marker happens `repeats` times more (the skipped tiles)."""


@tile_work_begin.register_fake
def _(anchor: torch.Tensor) -> None:
    return None


@tile_work_end.register_fake
def _(anchor: torch.Tensor, repeats: float) -> None:
    return None


def tile_starts(x: torch.Tensor, tile: int, dim: int) -> tuple[list[int], float]:
    """Where the tiles that run start, and how many times over their work the skipped ones repeat (fake tensors)."""
    n = x.shape[dim]
    starts = list(range(0, n, tile))
    if not is_fake(x) or len(starts) <= PLANNED_TILES:
        return starts, 0.0
    return starts[:PLANNED_TILES], (n - PLANNED_TILES * tile) / (PLANNED_TILES * tile)


class TiledForward(torch.autograd.Function):
    """run(x) of a per-token module in tiles of `tile` tokens along dim `dim` (the MLP's -2, the attention side's 1:
    its head norms see [rows, tokens, heads, dim]); `params` the module's trainable tensors."""

    @staticmethod
    def forward(ctx: Any, run: Callable[[torch.Tensor], Any], module: nn.Module, tile: int, dim: int,
                x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.module, ctx.tile, ctx.dim = run, module, tile, dim  # backward finds the weights on the module
        ctx.save_for_backward(x)
        starts, skipped = tile_starts(x, tile, dim)
        if skipped:
            tile_work_begin(x)
        out: torch.Tensor | None = None
        with torch.no_grad():
            for start in starts:  # each tile's output into the row's (a list of them and a cat would hold two)
                part = hidden_of(run(x.detach().narrow(dim, start, min(tile, x.shape[dim] - start))))
                if out is None:
                    out = part.new_empty([*part.shape[:dim % part.dim()], x.shape[dim],
                                          *part.shape[dim % part.dim() + 1:]])
                out.narrow(dim, start, part.shape[dim]).copy_(part)
        if skipped:
            tile_work_end(x, skipped)
        assert out is not None, "a row has a tile"
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        params = tuple(p for p in ctx.module.parameters() if p.requires_grad)
        grad_x = torch.zeros_like(x) if ctx.needs_input_grad[4] else None
        grads: list[torch.Tensor] = []
        starts, skipped = tile_starts(x, ctx.tile, ctx.dim)
        if skipped:
            tile_work_begin(x)
        for start in starts:
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
        if skipped:
            tile_work_end(x, skipped)
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
