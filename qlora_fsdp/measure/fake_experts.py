"""The planner's variant of the 4-bit experts' forward, installed on the fake model only (training's never branches
on it). Fake tensors have no values, so routing cannot be known: every expert is hit by an equal share of the routed
tokens, the worst case for what a step dequantizes and holds. GROUP experts run as one op, the same FLOPs and
dequantized elements as one at a time in a sixteenth of the ops (a fake op costs what a real op's Python does); the
plan then holds a group's dequantized matrices at once where training holds one."""

from __future__ import annotations

import functools
import math
from typing import Any

import bitsandbytes.functional as bnbf
import torch
from torch import nn

from qlora_fsdp.families import experts_per_token
from qlora_fsdp.layers.experts4bit import ExpertMatrix, Experts4bit, LoraUpdate, StackedExperts4bit, shaped_quant_state

GROUP = 16  # experts one op of the planner's fake step stands for


def plan_experts(model: nn.Module) -> int:
    """Give every 4-bit experts module of a fake model the planner's forward; how many."""
    found = [module for module in model.modules() if isinstance(module, Experts4bit)]
    for module in found:
        if isinstance(module, StackedExperts4bit):
            module.forward = functools.partial(planned_stacked_forward, module)  # type: ignore[method-assign]
        else:
            module.forward = functools.partial(planned_forward, module)  # type: ignore[method-assign]
    return len(found)


def planned_stacked_forward(module: StackedExperts4bit, hidden_states: torch.Tensor) -> torch.Tensor:
    """Llama 4's call (every expert's rows stacked, zero where not picked): as planned_forward, every expert runs an
    equal share of the routed rows, the first ones of its block; the other rows' outputs are zeros."""
    n_experts = module.gate_up_proj.shape[0]
    stacked = hidden_states.view(n_experts, -1, hidden_states.shape[-1])
    top_k = experts_per_token(module.config, 1)
    per_expert = math.ceil(stacked.shape[1] * top_k / n_experts)
    grouped = stacked[:, :per_expert].split(GROUP)
    updates = module.lora_updates(hidden_states.dtype, GROUP)
    outputs = []
    for index, rows in enumerate(grouped):
        experts = slice(index * GROUP, (index + 1) * GROUP)
        lora = {name: group[index] for name, group in updates.items()}
        hidden = group_linear(module, "gate_up_proj", experts, rows, lora.get("gate_up_proj"))
        outputs.append(group_linear(module, "down_proj", experts, module._apply_gate(hidden), lora.get("down_proj")))
    idle = stacked.new_zeros(n_experts, stacked.shape[1] - per_expert, stacked.shape[2])
    return torch.cat([torch.cat(outputs).to(hidden_states.dtype), idle], dim=1).view_as(hidden_states)


def planned_forward(module: Experts4bit, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    (n_tokens, top_k), n_experts = top_k_weights.shape, module.gate_up_proj.shape[0]
    per_expert = math.ceil(n_tokens * top_k / n_experts)
    routed = torch.arange(n_experts * per_expert, device=hidden_states.device) % (n_tokens * top_k)
    grouped = hidden_states[routed // top_k].view(n_experts, per_expert, -1).split(GROUP)
    updates = module.lora_updates(hidden_states.dtype, GROUP)
    outputs = []
    for index, rows in enumerate(grouped):
        experts = slice(index * GROUP, (index + 1) * GROUP)
        lora = {name: group[index] for name, group in updates.items()}
        hidden = group_linear(module, "gate_up_proj", experts, rows, lora.get("gate_up_proj"))
        outputs.append(group_linear(module, "down_proj", experts, module._apply_gate(hidden), lora.get("down_proj")))
    weighted = torch.cat(outputs).flatten(0, 1) * top_k_weights.flatten()[routed, None]
    return torch.zeros_like(hidden_states).index_add_(0, routed // top_k, weighted.to(hidden_states.dtype))


def group_linear(module: Experts4bit, name: str, experts: slice, x: torch.Tensor,
                 lora: LoraUpdate | None) -> torch.Tensor:
    """x [group, rows, in] times a group's matrices, plus their LoRA updates and biases."""
    rows = getattr(module, name)[experts]
    y = GroupMatmul.apply(x, rows, module.expert_matrices[name], module.is_transposed)
    if lora is not None:
        y = y + lora(x)
    if module.has_bias:
        y = y + getattr(module, f"{name}_bias")[experts].unsqueeze(1)
    return y


class GroupMatmul(torch.autograd.Function):
    """A group's matmul with its matrices dequantized for the forward and again for the backward, as training's
    DequantizedMatmul does one expert at a time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: torch.Tensor, matrix: ExpertMatrix, transposed: bool) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.matrix, ctx.transposed = matrix, transposed
        return torch.bmm(x, group_weights(matrix, rows, transposed, for_backward=False).to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        (rows,) = ctx.saved_tensors
        return torch.bmm(grad, group_weights(ctx.matrix, rows, ctx.transposed, for_backward=True)), None, None, None


def group_weights(matrix: ExpertMatrix, rows: torch.Tensor, transposed: bool, for_backward: bool) -> torch.Tensor:
    """A group's matrices as bmm multiplies by them: [in, out] in the forward, [out, in] in the backward."""
    rows_dim, cols_dim = matrix.shape
    in_dim, out_dim = (rows_dim, cols_dim) if transposed else (cols_dim, rows_dim)  # gpt-oss stores x @ W's W
    return dequantize_group(matrix, rows, (out_dim, in_dim) if for_backward else (in_dim, out_dim))


def dequantize_group(matrix: ExpertMatrix, rows: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """One dequantization op for a group of experts, as [group, *shape] (the stored matrix or its transpose): shapes
    only, as fake tensors have no values to decode, so the orientation costs no copy."""
    n, (height, width) = rows.shape[0], matrix.shape
    state = shaped_quant_state((n * height, width), matrix.blocksize, matrix.double_quant, matrix.quant_type,
                               matrix.dtype)
    packed = torch.empty(n * matrix.numel // 2, 1, dtype=torch.uint8, device=rows.device)  # not a copy of rows
    return bnbf.dequantize_4bit(packed, state).view(n, *shape)
