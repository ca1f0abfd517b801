"""One mixture-of-experts layer's experts, forward and backward (to the input, as under attention-only LoRA), four
ways in the same run: tokens/s and the peak memory above the layer's weights.

- `transformers, experts unquantized`: transformers' own experts module with the weights in the compute dtype:
  what transformers + bitsandbytes trains (bitsandbytes quantizes only nn.Linear, so fused experts stay as they are).
- `4-bit, a gather and a scatter per expert`: our 4-bit experts driven as transformers' loop drives its experts.
- `4-bit, grouped by expert (ours)`: what training runs (qlora_fsdp/layers/experts4bit.py): the routed rows sorted by
  expert once, one gather and one scatter, each hit expert dequantized for its matmul and again in the backward.
- `4-bit, one grouped matmul`: the hit experts dequantized together, then torch's grouped matmul (`_grouped_mm`);
  holds every hit expert's matrices at once.

Outputs are checked against the unquantized layer run on the NF4-rounded weights before anything is timed.

    python -m benchmarks.moe_experts        # CPU sizes: 32 experts, top-4, hidden 1024, 2,048 tokens, float32
    python -m benchmarks.moe_experts --experts 128 --top-k 8 --hidden 2048 --intermediate 768 \\
        --dtype bfloat16 --device cuda      # Qwen3-30B-A3B's experts (make gpu-check runs this)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from benchmarks.memory_sampler import peak_rss_gib, reset_peak_rss
from qlora_fsdp.config import QuantConfig
from qlora_fsdp.layers.experts4bit import ExpertMatrix, Experts4bit, Routes, make_4bit

Layer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def experts_pair(args: argparse.Namespace, dtype: torch.dtype) -> tuple[Qwen3MoeExperts, Experts4bit]:
    """transformers' experts with random weights, and our 4-bit copy of them; the unquantized module then holds
    the NF4-rounded weights, so all four compute the same function."""
    config = AutoConfig.for_model("qwen3_moe", hidden_size=args.hidden, moe_intermediate_size=args.intermediate,
                                  num_experts=args.experts, num_experts_per_tok=args.top_k)
    torch.manual_seed(0)
    plain = Qwen3MoeExperts(config).to(dtype).requires_grad_(False)  # frozen, as in training: no weight gradients
    with torch.no_grad():
        for param in (plain.gate_up_proj, plain.down_proj):
            param.normal_(0.0, 0.02)
    four_bit = Qwen3MoeExperts(config).to(dtype)
    four_bit.load_state_dict(plain.state_dict())
    make_4bit(four_bit, QuantConfig())
    assert isinstance(four_bit, Experts4bit)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            matrix = four_bit.expert_matrices[name]
            rows = torch.stack([matrix.to_row(expert) for expert in getattr(plain, name)])
            setattr(four_bit, name, torch.nn.Parameter(rows, requires_grad=False))
            getattr(plain, name).copy_(torch.stack([matrix.dequantize(row) for row in rows]))
    return plain, four_bit


def per_expert_loop(experts: Experts4bit) -> Layer:
    """Our 4-bit experts, driven as transformers' eager loop drives its own: a gather and a scatter per expert."""
    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert in top_k_index.unique().tolist():
            tokens, slots = (top_k_index == expert).nonzero(as_tuple=True)
            rows = experts.expert_mlp(expert, hidden[tokens]) * top_k_weights[tokens, slots, None]
            out.index_add_(0, tokens, rows.to(out.dtype))
        return out
    return forward


class GroupedDequantizedMatmul(torch.autograd.Function):
    """x times every hit expert's matrix in one grouped matmul; the matrices dequantized together, and again in
    the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: torch.Tensor, matrix: ExpertMatrix,
                offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, offsets)
        ctx.matrix = matrix
        weights = torch.stack([matrix.dequantize(row) for row in rows]).to(x.dtype)  # [hit, out, in]
        return torch._grouped_mm(x, weights.transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        rows, offsets = ctx.saved_tensors
        weights = torch.stack([ctx.matrix.dequantize(row) for row in rows]).to(grad.dtype)
        return torch._grouped_mm(grad.contiguous(), weights, offs=offsets), None, None, None


def grouped_matmul(experts: Experts4bit) -> Layer:
    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        routes = Routes.of(top_k_index, experts.gate_up_proj.shape[0])
        offsets = torch.tensor(routes.counts, device=hidden.device).cumsum(0).to(torch.int32)
        hit = torch.tensor(routes.experts, device=hidden.device)
        x = hidden[routes.tokens]
        gate_up = GroupedDequantizedMatmul.apply(x, experts.gate_up_proj[hit], experts.expert_matrices["gate_up_proj"],
                                                 offsets)
        down = GroupedDequantizedMatmul.apply(experts._apply_gate(gate_up), experts.down_proj[hit],
                                              experts.expert_matrices["down_proj"], offsets)
        weighted = down * top_k_weights.flatten()[routes.order, None]
        return torch.zeros_like(hidden).index_add_(0, routes.tokens, weighted.to(hidden.dtype))
    return forward


def routing(args: argparse.Namespace, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, and a router's top-k choices over the experts with their softmax weights (seeded)."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(args.tokens, args.hidden, generator=generator).to(dtype)
    logits = torch.randn(args.tokens, args.experts, generator=generator)
    weights, index = torch.softmax(logits, dim=-1).topk(args.top_k, dim=-1)
    return hidden, index, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def step(layer: Layer, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    x = hidden.detach().requires_grad_(True)
    layer(x, index, weights).square().sum().backward()
    assert x.grad is not None
    return x.grad


def measure(layer: Layer, inputs: tuple[torch.Tensor, ...], repeats: int) -> tuple[float, float]:
    """(seconds a forward and backward, peak memory above the start in GiB: the device's on a GPU, else RSS)."""
    cuda = inputs[0].is_cuda
    step(layer, *inputs)  # warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**30
    else:
        reset_peak_rss()
        before = peak_rss_gib()
    began = time.perf_counter()
    for _ in range(repeats):
        step(layer, *inputs)
    if cuda:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else peak_rss_gib()
    return (time.perf_counter() - began) / repeats, peak - before


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", help="float32 on a CPU (no bf16 units here), bfloat16 on a GPU")
    parser.add_argument("--device", default="cpu")
    return parser.parse_args(argv)


def measure_all(args: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:
    """(the setting in words, each way's name, tokens/s, ratio to transformers' and peak memory)."""
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    plain, four_bit = experts_pair(args, dtype)
    plain, four_bit = plain.to(device), four_bit.to(device)
    inputs = tuple(tensor.to(device) for tensor in routing(args, dtype))
    layers: dict[str, Layer] = {"transformers, experts unquantized": plain,
                                "4-bit, a gather and a scatter per expert": per_expert_loop(four_bit),
                                "4-bit, grouped by expert (ours)": four_bit,
                                "4-bit, one grouped matmul": grouped_matmul(four_bit)}
    with torch.no_grad():
        reference = plain(*inputs)
        for name, layer in layers.items():
            error = float((layer(*inputs) - reference).norm() / reference.norm())
            bound = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the order of the sums differs
            assert error < bound, f"{name}: relative difference {error:.1e} from the unquantized layer"
    weights_gib = {name: sum(p.numel() * p.element_size() for p in module.parameters()) / 2**30
                   for name, module in (("plain", plain), ("four_bit", four_bit))}
    setting = (f"{args.experts} experts, top-{args.top_k}, hidden {args.hidden}, intermediate {args.intermediate}, "
               f"{args.tokens} tokens, {args.dtype} on {args.device}; weights {weights_gib['plain']:.2f} GiB "
               f"unquantized, {weights_gib['four_bit']:.2f} GiB in 4-bit")
    results, baseline = [], 0.0
    for name, layer in layers.items():
        seconds, peak = measure(layer, inputs, args.repeats)
        baseline = baseline or seconds
        results.append({"name": name, "tokens_per_s": args.tokens / seconds, "ratio": baseline / seconds,
                        "peak_gib": peak})
    return setting, results


def main() -> None:
    setting, results = measure_all(parse_args())
    print(setting + "\n")
    print("| experts | tokens/s (forward + backward) | vs transformers | peak memory above the start, GiB |")
    print("| --- | ---: | ---: | ---: |")
    for row in results:
        print(f"| {row['name']} | {row['tokens_per_s']:,.0f} | {row['ratio']:.2f}x | {row['peak_gib']:.2f} |")


if __name__ == "__main__":
    main()
