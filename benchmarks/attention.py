"""Attention of one packed row: the dense block-diagonal mask against per-sample attention, forward + backward.

A row of `--tokens` tokens is filled with samples of long-tailed lengths (benchmarks/bench_data.py's log-normal:
median 150, 90th percentile 500), as packing fills it. Kernels, all exact (checked against the dense mask):
- dense mask: scaled_dot_product_attention with the rows x tokens x tokens boolean mask transformers builds
  for `sdpa` when position ids restart (cost: tokens squared, whatever the samples)
- per sample (`sdpa_varlen`, ours): causal sdpa on each sample, no mask (cost: the sum of the samples' squares)
- flex: torch's flex_attention with a block mask of the same samples, compiled (`flex_attention`); CUDA only
  (torch 2.13 has no flex_attention backward on CPU)

    python -m benchmarks.attention            # a minute or two on 2 cores
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.bench_data import MEDIAN_TOKENS, SIGMA
from qlora_fsdp.layers.attention import packed_causal_mask, varlen_sdpa_forward

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64  # the benchmark model's attention (benchmarks/training_speed.py)


def packed_positions(tokens: int, rng: random.Random) -> torch.Tensor:
    """Position ids of one row filled with long-tailed samples (the last one cut to fit)."""
    lengths: list[int] = []
    while sum(lengths) < tokens:
        draw = round(rng.lognormvariate(math.log(MEDIAN_TOKENS), SIGMA))
        lengths.append(max(8, min(draw, tokens - sum(lengths))))
    return torch.cat([torch.arange(n) for n in lengths])[None]


def dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    groups = HEADS // KV_HEADS
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=packed_causal_mask(positions)).transpose(1, 2)


def per_sample(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return varlen_sdpa_forward(torch.nn.Module(), query, key, value, None, position_ids=positions)[0]


def flex_kernel() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)

    def flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        sample = torch.cumsum((positions[0] == 0).long(), 0)

        def same_sample_causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return (sample[q] == sample[kv]) & (q >= kv)

        n = positions.shape[1]
        block_mask = create_block_mask(same_sample_causal, None, None, n, n, device="cpu")
        return compiled(query, key, value, block_mask=block_mask, enable_gqa=True).transpose(1, 2)

    return flex


def time_kernel(kernel: Callable[..., torch.Tensor], tokens: int, positions: torch.Tensor, repeats: int) -> float:
    """Median seconds of forward + backward (bf16), after one warm-up."""
    torch.manual_seed(0)
    query = torch.randn(1, HEADS, tokens, HEAD_DIM, dtype=torch.bfloat16, requires_grad=True)
    key, value = (torch.randn(1, KV_HEADS, tokens, HEAD_DIM, dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(2))
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        kernel(query, key, value, positions).float().sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def check_exact(kernels: dict[str, Callable[..., torch.Tensor]], positions: torch.Tensor) -> None:
    torch.manual_seed(1)
    tokens = positions.shape[1]
    query = torch.randn(1, HEADS, tokens, HEAD_DIM)
    key, value = (torch.randn(1, KV_HEADS, tokens, HEAD_DIM) for _ in range(2))
    reference = dense(query, key, value, positions)
    for name, kernel in kernels.items():
        torch.testing.assert_close(kernel(query, key, value, positions), reference, rtol=1e-4, atol=1e-4,
                                   msg=f"{name} differs from the dense mask")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-flex", action="store_true",
                        help="skip flex attention (it compiles; needs a C++ compiler)")
    args = parser.parse_args()
    kernels: dict[str, Callable[..., torch.Tensor]] = {"dense mask (sdpa)": dense,
                                                       "per sample (sdpa_varlen)": per_sample}
    if args.no_flex:
        pass
    elif torch.cuda.is_available():
        kernels["flex attention, block mask"] = flex_kernel()
    else:
        print("flex attention left out: torch 2.13 has no flex_attention backward on CPU")
    rng = random.Random(0)
    print(f"threads: {torch.get_num_threads()}; heads {HEADS} (key/value {KV_HEADS}), head dim {HEAD_DIM}, bf16, "
          "forward + backward of one packed row, median of repeats")
    print("\n| tokens | samples in the row | " + " | ".join(kernels) + " | per sample vs dense |")
    print("| --- | --- |" + " --- |" * (len(kernels) + 1))
    for tokens in args.tokens:
        positions = packed_positions(tokens, rng)
        check_exact(kernels, positions)
        seconds = {name: time_kernel(kernel, tokens, positions, args.repeats) for name, kernel in kernels.items()}
        n_samples = int((positions == 0).sum())
        cells = " | ".join(f"{s * 1e3:.1f} ms" for s in seconds.values())
        ratio = seconds["dense mask (sdpa)"] / seconds["per sample (sdpa_varlen)"]
        print(f"| {tokens} | {n_samples} | {cells} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
