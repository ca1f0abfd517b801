"""How much of a LoRA-on-NF4 linear's time is framework overhead? PEFT's layer against one fused autograd op.

The fused op does the same math (dequantize, base matmul, low-rank path, hand-written backward) with no
PEFT/bitsandbytes Python between the kernels and fewer autograd nodes; gradients are checked equal first.
On CPU this bounds what removing per-call overhead can buy in benchmarks/training_speed.py.

    python -m benchmarks.lora_linear [--tokens 512] [--repeats 300]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import bitsandbytes as bnb
import bitsandbytes.functional as bnb_f
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer


class FusedLoraNF4(torch.autograd.Function):
    """y = x W^T + s (x A^T) B^T with W in NF4; only A and B (and x) get gradients."""

    @staticmethod
    def forward(ctx, x, weight, lora_a, lora_b, scale):  # noqa: ANN001, ANN205
        dense = bnb_f.dequantize_4bit(weight, weight.quant_state).to(x.dtype)
        xa = x @ lora_a.t().to(x.dtype)
        ctx.save_for_backward(x, xa, lora_a, lora_b)
        ctx.weight, ctx.scale = weight, scale
        return x @ dense.t() + (xa @ lora_b.t().to(x.dtype)) * scale

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, xa, lora_a, lora_b = ctx.saved_tensors
        dense = bnb_f.dequantize_4bit(ctx.weight, ctx.weight.quant_state).to(grad.dtype)
        grad_b = ((grad.t() @ xa) * ctx.scale).to(lora_b.dtype)
        grad_xa = (grad @ lora_b.to(grad.dtype)) * ctx.scale
        grad_a = (grad_xa.t() @ x).to(lora_a.dtype)
        return grad @ dense + grad_xa @ lora_a.to(grad.dtype), None, grad_a, grad_b, None


def peft_layer(d_in: int, d_out: int) -> torch.nn.Module:
    proj = bnb.nn.Linear4bit(d_in, d_out, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                             quant_storage=torch.bfloat16)
    proj.weight = bnb.nn.Params4bit(torch.randn(d_out, d_in, dtype=torch.bfloat16) * 0.05,
                                    requires_grad=False, quant_type="nf4", quant_storage=torch.bfloat16,
                                    compress_statistics=True)._quantize("cpu")
    holder = torch.nn.Module()
    holder.proj = proj
    peft_model = get_peft_model(holder, LoraConfig(r=16, lora_alpha=32, target_modules=["proj"]))
    layer = peft_model.get_submodule("base_model.model.proj")
    assert isinstance(layer, LoraLayer), "get_peft_model put a LoRA layer where proj was"
    torch.nn.init.normal_(adapter_weight(layer.lora_B), std=0.02)  # nonzero, so every gradient path is exercised
    return layer


def adapter_weight(linears: torch.nn.ModuleDict) -> torch.Tensor:
    """The weight of a LoRA layer's A or B for the default adapter."""
    linear = linears["default"]
    assert isinstance(linear, torch.nn.Linear), "LoRA's A and B of a linear are linears"
    return linear.weight


def grad_of(tensor: torch.Tensor) -> torch.Tensor:
    assert tensor.grad is not None, "read after backward"
    return tensor.grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="rows of x: micro-batch x sequence length")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    torch.manual_seed(0)
    layer = peft_layer(128, 256)  # the tiny model's MLP up-projection shape
    assert isinstance(layer, LoraLayer), "peft_layer returns PEFT's LoRA layer"
    x = torch.randn(args.tokens, 128, dtype=torch.bfloat16, requires_grad=True)
    a, b = adapter_weight(layer.lora_A), adapter_weight(layer.lora_B)
    base = layer.base_layer
    assert isinstance(base, bnb.nn.Linear4bit), "the layer PEFT wrapped is the 4-bit linear built above"
    runs: dict[str, Callable[[], torch.Tensor]] = {
        "PEFT LoRA on bnb Linear4bit": lambda: layer(x),
        "fused autograd op": lambda: FusedLoraNF4.apply(x, base.weight, a, b, layer.scaling["default"]),
    }
    grads = {}
    for name, forward in runs.items():
        x.grad = a.grad = b.grad = None
        forward().float().sum().backward()
        grads[name] = [grad_of(t).float().clone() for t in (x, a, b)]
    reference, fused = grads.values()
    worst = max(((r - f).abs().max() / r.abs().max()).item() for r, f in zip(reference, fused, strict=True))
    print(f"gradients (x, A, B): max relative difference {worst:.2e}")
    print("| layer | forward+backward | vs PEFT |\n| --- | --- | --- |")
    times = {}
    for name, forward in runs.items():
        forward().float().sum().backward()  # warm-up
        start = time.perf_counter()
        for _ in range(args.repeats):
            forward().float().sum().backward()
        times[name] = (time.perf_counter() - start) / args.repeats
        print(f"| {name} | {times[name] * 1e3:.2f} ms | {times[name] / next(iter(times.values())):.2f}x time |")


if __name__ == "__main__":
    main()
