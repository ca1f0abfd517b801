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
linear keeps its last search's block steps as the GGUF stores them (a float16 a super-block of 256 and a small
integer a block: 0.07-0.08 bytes a weight) with a copy of the A and B it was made for, so the micro-batches of one
optimizer step and their checkpointed recomputes search once. The rounding itself runs in every forward, a chunk of
rows at a time, so no float32 copy of a whole weight is ever made: on CUDA in one Triton kernel a chunk (about 8
bytes an element, kernels/export_rounding.py, which also searches), elsewhere as a few element-wise torch passes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import bitsandbytes.functional as bnbf
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from qlora_fsdp.errors import ConfigError
from qlora_fsdp.gguf_target.quantizers import (
    SEARCHED,
    Steps,
    candidate_numerators,
    chunk_steps,
    empty_steps,
    rounded_chunk,
    row_slices,
)
from qlora_fsdp.kernels.export_rounding import available, export_rounded, export_searched, search_in_kernel
from qlora_fsdp.layers.tiled_mlp import tile_work_begin, tile_work_end

Lora = tuple[torch.Tensor, torch.Tensor, float]  # (A, B, scale): the delta s B A


class SearchCache:
    """One linear's last k-quant block search (as the GGUF stores it: 0.07-0.08 bytes a weight), with the adapter
    (A, B) it was made for. `counted_for`: on the planner's fake tensors, how many micro-batches the plan counts the
    first one's work for (its search runs once an optimizer step all the same); 0 for a weight that never changes
    (searched once a run: priced at nothing)."""

    def __init__(self, counted_for: int = 1) -> None:
        self.made_for: tuple[torch.Tensor, ...] | None = None
        self.steps: Steps = ()
        self.counted_for = counted_for

    def stale(self, adapter: tuple[torch.Tensor, ...]) -> bool:
        return self.made_for is None or self.changed(adapter)

    def keep(self, steps: Steps, adapter: tuple[torch.Tensor, ...]) -> None:
        self.steps, self.made_for = steps, tuple(t.detach().clone() for t in adapter)

    def changed(self, adapter: tuple[torch.Tensor, ...]) -> bool:
        # the planner's fake tensors have no values: within its one measured step the adapter is unchanged, as in
        # a real step, whose optimizer changes A and B after the last micro-batch
        if any(is_fake(a) for a in adapter):
            return False
        return not all(torch.equal(a, b) for a, b in zip(self.made_for or (), adapter, strict=True))


def search_into(steps: Steps, merge: Callable[[], torch.Tensor], ggml_type: str, chunk: int, chunks: int,
                counted_for: int | None, fused: bool = False) -> None:
    """A chunk's block search of the merge `merge` makes, written into its rows of `steps`. On the planner's fake
    tensors with a cache, only the first chunk's merge and search run (their temporaries, as every chunk's) and
    tiled_mlp's markers price the others as its repeats, the whole counted once a step where the plan counts this
    micro-batch `counted_for` times."""
    planned = counted_for is not None and is_fake(steps[0])
    if planned and chunk > 0:
        return
    if planned:
        tile_work_begin(steps[0])
    merged = merge()
    if fused and search_in_kernel():
        export_searched(list(steps), merged, candidate_numerators(ggml_type), ggml_type)
    else:
        for whole, part in zip(steps, chunk_steps(merged, ggml_type), strict=True):
            whole.copy_(part)
    if planned:
        tile_work_end(steps[0], chunks / counted_for - 1 if counted_for else -1.0)


def merged_rows(base: torch.Tensor, lora: Lora | None, rows: slice) -> torch.Tensor:
    """Rows of the merge's weight: the fp32 sum, written float16 for the converter, read back."""
    merged = base.float()
    if lora is not None:
        lora_a, lora_b, scale = lora
        merged = merged + scale * (lora_b[rows].detach().float() @ lora_a.detach().float())
    return merged.to(torch.float16).float()


def exported_weight(base: torch.Tensor, ggml_type: str, lora: Lora | None = None, cache: SearchCache | None = None,
                    dtype: torch.dtype = torch.float32, fused: bool = False) -> torch.Tensor:
    """The merge's weight rounded as llama-quantize stores it, in `dtype`, made a chunk of rows at a time (no
    full-size float32 temporaries); with a cache, a k-quant's block search is reused while A and B are unchanged.
    `fused`: the rounding (and the search, off Triton's interpreter) by kernels/export_rounding.py's kernels, to the
    same values, else in plain torch."""
    adapter = lora[:2] if lora is not None else ()
    search = ggml_type in SEARCHED and (cache is None or cache.stale(adapter))
    steps = empty_steps(base, ggml_type) if search or cache is None else cache.steps
    out = torch.empty(base.shape, dtype=dtype, device=base.device)
    slices = row_slices(base)
    counted_for = None if cache is None else cache.counted_for
    for chunk, (rows, part) in enumerate(slices):
        rows_steps = tuple(s[rows] for s in steps)
        if fused:  # the search (if due) merges in torch; the rounding kernel forms the merge from B A itself
            if search:
                merge = functools.partial(merged_rows, part, lora, rows)
                search_into(rows_steps, merge, ggml_type, chunk, len(slices), counted_for, fused)
            product = None if lora is None else lora[1][rows].detach().float() @ lora[0].detach().float()
            export_rounded(out[rows], part, product, 1.0 if lora is None else lora[2], ggml_type, list(rows_steps))
            continue
        merged = merged_rows(part, lora, rows)
        if search:
            search_into(rows_steps, lambda: merged, ggml_type, chunk, len(slices), counted_for)  # noqa: B023
        out[rows] = rounded_chunk(merged, ggml_type, rows_steps)
    if search and cache is not None:
        cache.keep(steps, adapter)
    return out


class ThroughExport(torch.autograd.Function):
    """y = x round(W + s B A)^T (+ bias); the backward is LoRA's, with the rounded weight for the input's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, base: torch.Tensor,
                bias: torch.Tensor | None, scale: float, ggml_type: str, cache: SearchCache | None = None,
                fused: bool = False) -> torch.Tensor:
        weight = exported_weight(base, ggml_type, (lora_a, lora_b, scale), cache, x.dtype, fused)
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
        return grad_x, grad_a, grad_b, None, None, None, None, None, None


def dequantized_base(linear4bit: Any) -> torch.Tensor:
    """The 4-bit base's weight as the 4-bit model computes with it (and the merge writes it)."""
    # the module keeps the whole weight's state (loading/fill.py): FSDP2's gathered weight is a plain Parameter
    return bnbf.dequantize_4bit(linear4bit.weight.data, linear4bit.quant_state)


def lora_forward(module: Any, ggml_type: str, caches: tuple[SearchCache, SearchCache], fused: bool, x: torch.Tensor,
                 *args: Any, **kwargs: Any) -> torch.Tensor:
    """A PEFT LoRA linear over a Linear4bit, computing with its exported weight (its own search cache, and one for
    the base alone); `fused`: rounded by the kernels."""
    (adapter,) = [a for a in module.active_adapters if a in module.lora_A]
    base_layer = module.get_base_layer()
    if module.disable_adapters:  # DPO's reference forward: the base alone, as it would be exported unmerged
        return frozen_forward(base_layer, ggml_type, caches[1], fused, x)
    return ThroughExport.apply(x, module.lora_A[adapter].weight, module.lora_B[adapter].weight,
                               dequantized_base(base_layer), base_layer.bias, module.scaling[adapter], ggml_type,
                               caches[0], fused)


def frozen_forward(linear4bit: Any, ggml_type: str, cache: SearchCache, fused: bool, x: torch.Tensor, *args: Any,
                   **kwargs: Any) -> torch.Tensor:
    """A Linear4bit without LoRA, with its exported weight (frozen: only the input gets a gradient; its block search
    made once)."""
    with torch.no_grad():
        weight = exported_weight(dequantized_base(linear4bit), ggml_type, None, cache, x.dtype, fused)
    bias = linear4bit.bias
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


def install_lora(module: Any, ggml_type: str, counted_for: int = 1, fused: bool = False) -> None:
    """The forward of a LoRA linear (an instance attribute, as layers/fused_lora.py installs its own); the cache of
    the base alone (DPO's reference forward) searches once a run."""
    caches = (SearchCache(counted_for), SearchCache(0))
    module.forward = functools.partial(lora_forward, module, ggml_type, caches, fused)


def install_frozen(linear4bit: Any, ggml_type: str, fused: bool = False) -> None:
    """A linear without LoRA: its weight never changes, so its search runs once a run."""
    linear4bit.forward = functools.partial(frozen_forward, linear4bit, ggml_type, SearchCache(0), fused)


@torch.no_grad()
def round_in_place(weight: torch.Tensor, ggml_type: str) -> None:
    """A frozen unquantized weight (embeddings, head) as exported; each rank rounds its own rows (FSDP2 shards the
    rows, and llama.cpp's blocks run along a row)."""
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    if local.numel():
        local.copy_(exported_weight(local, ggml_type, dtype=local.dtype))


def rounding_kernel(choice: str) -> bool:
    """export.rounding_kernel on this machine: the kernels where they run (CUDA with Triton); `fused` refused
    elsewhere in one line."""
    runs = available(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if choice == "fused" and not runs:
        raise ConfigError("export.rounding_kernel: fused needs a CUDA GPU with Triton, which this machine lacks; "
                          "set it to auto or torch")
    return runs and choice != "torch"
