"""LoRA projections that read the same input, run as one: q/k/v and gate/up.

PEFT runs each LoRA linear on its own: it casts the input to the adapter's dtype and multiplies by that
projection's A, so q, k and v cast the same activations three times and run three thin matmuls. Here the
projections of a group cast their shared input once and multiply it by their A matrices stacked (one matmul
with r_q + r_k + r_v outputs), and each then applies its own B and scaling. Autograd's backward of the stack and
split gives each A its own gradient and sums the input's gradient in one matmul.

The parameters and the modules stay PEFT's own (only their `forward` is replaced), so checkpoints, the saved
adapter, merge and generate are unchanged. `lora.compute_dtype: base` further runs the LoRA matmuls in the
dtype of the base layer's output (the fp32 weights cast on the way in, their gradients fp32), as the HF
Trainer does under bf16 autocast.

A projection falls back to PEFT's forward where the fusion does not apply: adapters disabled (DPO's reference
forward) or merged, several adapters, per-call adapter names. With dropout on in training each projection
draws its own mask, so each casts and multiplies on its own, as in PEFT.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import peft
import torch
import torch.nn.functional as F
from torch import nn

from qlora_fsdp.config import LoraConfig

# leaf names of LoRA targets that a model calls with the same input, in each family's call order
ATTENTION_GROUP, MLP_GROUP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
SHARED_INPUT_GROUPS = (ATTENTION_GROUP, MLP_GROUP)


def shared_input_groups(attention_tiled: bool) -> tuple[tuple[str, ...], ...]:
    """The groups to fuse. Attention-side tiles call q, k and v each on its own tiles of the row, so the group's
    round (every member taking its part of one input) never completes, and its cache would hold a view of the
    whole normed row past the layer's backward (measured: +1 GiB for gpt-oss-20b at 8,192 tokens)."""
    return (MLP_GROUP,) if attention_tiled else SHARED_INPUT_GROUPS
LoraLinear = peft.tuners.lora.LoraLayer


class SharedInput:
    """One group's A projections of the input it was last called with, until each member has taken its own."""

    def __init__(self, members: list[Any], compute_in_base_dtype: bool) -> None:
        self.members = members
        self.compute_in_base_dtype = compute_in_base_dtype
        self.input: torch.Tensor | None = None
        self.cast: torch.Tensor | None = None
        self.outputs: dict[int, torch.Tensor] = {}

    def lora_dtype(self, member: Any, adapter: str, result_dtype: torch.dtype) -> torch.dtype:
        """The base layer's output dtype (lora.compute_dtype: base), else the adapter weights' (PEFT's cast)."""
        return result_dtype if self.compute_in_base_dtype else member.lora_A[adapter].weight.dtype

    def project(self, x: torch.Tensor, adapter: str, dtype: torch.dtype) -> None:
        """Cast x once and multiply it by the members' A matrices stacked; split the product per member."""
        weights = [member.lora_A[adapter].weight.to(dtype) for member in self.members]
        stacked = weights[0] if len(weights) == 1 else torch.cat(weights)
        self.input, self.cast = x, cast_input(x, dtype)
        parts = F.linear(self.cast, stacked).split([w.shape[0] for w in weights], dim=-1)
        self.outputs = dict(enumerate(parts))

    def take(self, index: int, x: torch.Tensor, adapter: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(the cast input, this member's A product); an input not seen before, or seen by this member already
        (a recompute, a second call), projects again."""
        if self.input is not x or self.cast is None or self.cast.dtype != dtype or index not in self.outputs:
            self.project(x, adapter, dtype)
        assert self.cast is not None
        cast, output = self.cast, self.outputs.pop(index)
        if not self.outputs:  # every member has its part: hold no reference to this input any longer
            self.input = self.cast = None
        return cast, output


def cast_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype or torch.is_autocast_enabled() else x.to(dtype)


class CastLinear(nn.Module):
    """A LoRA matrix as DoRA's forward sees it: its weight cast to the input's dtype (the LoRA matmuls run in the
    activations' dtype under lora.compute_dtype: base; DoRA multiplies an identity in the weights' dtype
    through A and B to get the update's weight, which casts nothing)."""

    def __init__(self, linear: Any) -> None:
        super().__init__()
        self.inner = [linear]  # a list: not registered as a submodule

    @property
    def weight(self) -> torch.Tensor:
        return self.inner[0].weight

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return F.linear(inp, self.weight.to(inp.dtype))


class PrecomputedA(CastLinear):
    """DoRA's lora_A: the shared matmul's part for the input it was made from, the product for anything else."""

    def __init__(self, lora_A: Any, x: torch.Tensor, output: torch.Tensor) -> None:
        super().__init__(lora_A)
        self.x, self.output = x, output

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return self.output if inp is self.x else super().forward(inp)


def fused_forward(module: Any, group: SharedInput, index: int, peft_forward: Callable[..., torch.Tensor],
                  x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    adapters = [a for a in module.active_adapters if a in module.lora_A]
    if module.disable_adapters or module.merged or len(adapters) != 1 or kwargs.get("adapter_names") is not None:
        return peft_forward(x, *args, **kwargs)
    adapter = adapters[0]
    result = module.base_layer(x, *args, **kwargs)
    dtype = group.lora_dtype(module, adapter, result.dtype)
    lora_A, lora_B, scaling = module.lora_A[adapter], module.lora_B[adapter], module.scaling[adapter]
    dropout = module.lora_dropout[adapter]
    if module.training and not isinstance(dropout, nn.Identity) and dropout.p > 0:  # a mask per projection
        cast = cast_input(x, dtype)
        if adapter in module.lora_variant:
            return dora_update(module, adapter, result, dropout(cast), CastLinear(lora_A), base_result=None)
        return add_b_product(result, F.linear(dropout(cast), lora_A.weight.to(dtype)), lora_B.weight.to(dtype),
                             scaling)
    cast, a_output = group.take(index, x, adapter, dtype)
    if adapter in module.lora_variant:  # DoRA: its own forward, given A's product already made
        return dora_update(module, adapter, result, cast, PrecomputedA(lora_A, cast, a_output), base_result=result)
    return add_b_product(result, a_output, lora_B.weight.to(dtype), scaling)


def add_b_product(result: torch.Tensor, a_output: torch.Tensor, lora_B: torch.Tensor, scaling: float) -> torch.Tensor:
    """result + scaling * (a_output @ B^T): one addmm where the two share a dtype (no scaled copy, no separate
    add), else PEFT's order (the product scaled, cast to the result's dtype, added)."""
    if result.dtype != a_output.dtype:
        return result + (F.linear(a_output, lora_B) * scaling).to(result.dtype)
    flat = torch.addmm(result.reshape(-1, result.shape[-1]), a_output.reshape(-1, a_output.shape[-1]), lora_B.t(),
                       alpha=scaling)
    return flat.view(result.shape)


def dora_update(module: Any, adapter: str, result: torch.Tensor, x: torch.Tensor, lora_A: Any,
                base_result: torch.Tensor | None) -> torch.Tensor:
    """result plus DoRA's update, added in the update's dtype and cast back, as PEFT's DoRA variant does."""
    update = module.lora_magnitude_vector[adapter](
        x, lora_A=lora_A, lora_B=CastLinear(module.lora_B[adapter]), scaling=module.scaling[adapter],
        base_layer=module.get_base_layer(), base_result=base_result, adapter_name=adapter)
    return (result + update).to(result.dtype)


def fuse_lora_projections(model: nn.Module, lora: LoraConfig,
                          groups: tuple[tuple[str, ...], ...] = SHARED_INPUT_GROUPS) -> int:
    """Give every LoRA linear the shared-input forward (groups of one where no sibling shares its input);
    the number of groups of two or more. With neither fusion nor the base dtype asked for, PEFT's forward stays."""
    if not lora.fuse_projections and lora.compute_dtype == "weights":
        return 0
    fused = 0
    for parent in model.modules():
        children: dict[str, Any] = {name: child for name, child in parent.named_children()
                                    if isinstance(child, LoraLinear)}
        grouped: set[str] = set()
        for names in groups:
            members = [n for n in names if n in children and lora.fuse_projections]
            if len(members) > 1:
                install(members, children, lora)
                grouped.update(members)
                fused += 1
        for name in children.keys() - grouped:
            install([name], children, lora)
    return fused


def install(names: list[str], children: dict[str, Any], lora: LoraConfig) -> None:
    """The members' forward becomes the group's (an instance attribute: the class, PEFT's, is untouched)."""
    members = [children[name] for name in names]
    group = SharedInput(members, lora.compute_dtype == "base")
    for index, member in enumerate(members):
        peft_forward = type(member).forward.__get__(member)
        member.forward = functools.partial(fused_forward, member, group, index, peft_forward)
