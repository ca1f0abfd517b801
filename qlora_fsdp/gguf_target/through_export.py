"""Training through the export (`export.target`): every weight the forward reads is the one the exported GGUF holds.

What llama.cpp will run is the merged weight W + s B A (W the dequantized 4-bit base, as the merge writes it), stored
in float16 by the converter, then rounded by llama-quantize to the type it picks for that tensor. Without this, the
adapter's update is smaller than a q4_K step in many blocks and the rounding erases part of the fine-tune. Here the
forward multiplies by exactly that rounded weight (gguf_target/quantizers.py, equal to llama.cpp's quantizer), and the
backward treats the rounding as the identity (straight-through): the input's gradient is the rounded weight's, and A
and B get LoRA's usual gradients, computed from the thin products (x A^T, g B), never from a full-size gradient.

Linears without LoRA (a target list that leaves some out) round their 4-bit base the same way; the embeddings and
an unquantized head are frozen, so they are rounded once, in place, when the run starts.

A k-quant's block search is the costly part of its rounding, and its result changes only with the adapter: each
linear keeps its last search's block steps (0.25 bytes a weight: one or two floats a block of 16 or 32) with a copy
of the A and B it was made for, so the micro-batches of one optimizer step and their checkpointed recomputes search
once. The rounding itself (a few element-wise passes) runs in every forward.
"""

from __future__ import annotations

import functools
from typing import Any

import bitsandbytes.functional as bnbf
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from qlora_fsdp.gguf_target.quantizers import Steps, block_steps, rounded, row_chunks
from qlora_fsdp.layers.tiled_mlp import tile_work_begin, tile_work_end


class SearchCache:
    """One linear's last k-quant block search, with the adapter (A, B) it was made for. `counted_for`: on the
    planner's fake tensors, how many micro-batches the plan counts the first one's work for (its search runs once
    an optimizer step all the same); 0 for a weight that never changes (searched once a run: priced at nothing)."""

    def __init__(self, counted_for: int = 1) -> None:
        self.made_for: tuple[torch.Tensor, ...] | None = None
        self.steps: Steps | None = None
        self.counted_for = counted_for

    def steps_for(self, merged: torch.Tensor, ggml_type: str, adapter: tuple[torch.Tensor, ...]) -> Steps | None:
        if self.made_for is None or self.changed(adapter):
            self.steps = planned_search(merged, ggml_type, self.counted_for) if is_fake(merged) \
                else block_steps(merged, ggml_type)
            self.made_for = tuple(t.detach().clone() for t in adapter)
        return self.steps

    def changed(self, adapter: tuple[torch.Tensor, ...]) -> bool:
        # the planner's fake tensors have no values: within its one measured step the adapter is unchanged, as in
        # a real step, whose optimizer changes A and B after the last micro-batch
        if any(is_fake(a) for a in adapter):
            return False
        return not all(torch.equal(a, b) for a, b in zip(self.made_for or (), adapter, strict=True))


def planned_search(merged: torch.Tensor, ggml_type: str, counted_for: int) -> Steps | None:
    """block_steps on fake tensors: the first chunk's search run (its temporaries, as every chunk's), the other
    chunks priced as its repeats (tiled_mlp's markers), the whole counted once a step where the plan counts this
    micro-batch `counted_for` times; the steps of the whole weight, to be held as the run holds them."""
    chunks = row_chunks(merged)
    tile_work_begin(merged)
    first = block_steps(chunks[0], ggml_type)
    tile_work_end(merged, len(chunks) / counted_for - 1 if counted_for else -1.0)
    if first is None:
        return None
    per_row = first[0].numel() // chunks[0].shape[0]
    return tuple(torch.cat([part, part.new_empty(per_row * merged.shape[0] - part.numel())]) for part in first)


def exported_weight(base: torch.Tensor, delta: torch.Tensor | None, ggml_type: str,
                    cache: SearchCache | None = None, adapter: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """The merge's weight (fp32 sum, written float16 for the converter) rounded as llama-quantize stores it; with a
    cache, a k-quant's block search is reused while `adapter` (the tensors `delta` was made from) is unchanged."""
    merged = (base.float() if delta is None else base.float() + delta).to(torch.float16).float()
    steps = cache.steps_for(merged, ggml_type, adapter) if cache is not None else None
    return rounded(merged, ggml_type, steps)


class ThroughExport(torch.autograd.Function):
    """y = x round(W + s B A)^T (+ bias); the backward is LoRA's, with the rounded weight for the input's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, base: torch.Tensor,
                bias: torch.Tensor | None, scale: float, ggml_type: str, cache: SearchCache | None = None
                ) -> torch.Tensor:
        delta = scale * (lora_b.detach().float() @ lora_a.detach().float())
        weight = exported_weight(base, delta, ggml_type, cache, (lora_a, lora_b)).to(x.dtype)
        ctx.save_for_backward(x, lora_a, lora_b, weight)
        ctx.scale = scale
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, lora_a, lora_b, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        g, inputs = grad.reshape(-1, grad.shape[-1]).to(lora_a.dtype), x.reshape(-1, x.shape[-1]).to(lora_a.dtype)
        grad_b = ctx.scale * (g.t() @ (inputs @ lora_a.t())) if ctx.needs_input_grad[2] else None
        grad_a = ctx.scale * ((g @ lora_b).t() @ inputs) if ctx.needs_input_grad[1] else None
        return grad_x, grad_a, grad_b, None, None, None, None, None


def dequantized_base(linear4bit: Any) -> torch.Tensor:
    """The 4-bit base's weight as the 4-bit model computes with it (and the merge writes it)."""
    # the module keeps the whole weight's state (loading/fill.py): FSDP2's gathered weight is a plain Parameter
    return bnbf.dequantize_4bit(linear4bit.weight.data, linear4bit.quant_state)


def lora_forward(module: Any, ggml_type: str, caches: tuple[SearchCache, SearchCache], x: torch.Tensor, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
    """A PEFT LoRA linear over a Linear4bit, computing with its exported weight (its own search cache, and one for
    the base alone)."""
    (adapter,) = [a for a in module.active_adapters if a in module.lora_A]
    base_layer = module.get_base_layer()
    if module.disable_adapters:  # DPO's reference forward: the base alone, as it would be exported unmerged
        return frozen_forward(base_layer, ggml_type, caches[1], x)
    return ThroughExport.apply(x, module.lora_A[adapter].weight, module.lora_B[adapter].weight,
                               dequantized_base(base_layer), base_layer.bias, module.scaling[adapter], ggml_type,
                               caches[0])


def frozen_forward(linear4bit: Any, ggml_type: str, cache: SearchCache, x: torch.Tensor, *args: Any,
                   **kwargs: Any) -> torch.Tensor:
    """A Linear4bit without LoRA, with its exported weight (frozen: only the input gets a gradient; its block search
    made once)."""
    with torch.no_grad():
        weight = exported_weight(dequantized_base(linear4bit), None, ggml_type, cache).to(x.dtype)
    bias = linear4bit.bias
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


def install_lora(module: Any, ggml_type: str, counted_for: int = 1) -> None:
    """The forward of a LoRA linear (an instance attribute, as layers/fused_lora.py installs its own); the cache of
    the base alone (DPO's reference forward) searches once a run."""
    caches = (SearchCache(counted_for), SearchCache(0))
    module.forward = functools.partial(lora_forward, module, ggml_type, caches)


def install_frozen(linear4bit: Any, ggml_type: str) -> None:
    """A linear without LoRA: its weight never changes, so its search runs once a run."""
    linear4bit.forward = functools.partial(frozen_forward, linear4bit, ggml_type, SearchCache(0))


@torch.no_grad()
def round_in_place(weight: torch.Tensor, ggml_type: str) -> None:
    """A frozen unquantized weight (embeddings, head) as exported; each rank rounds its own rows (FSDP2 shards the
    rows, and llama.cpp's blocks run along a row)."""
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    if local.numel():
        local.copy_(exported_weight(local, None, ggml_type).to(local.dtype))
