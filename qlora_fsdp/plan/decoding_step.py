"""A decoding step of GRPO's generation on the GPU, priced by what its kernels move and how many of them run.

Two paths, by `generation.kernels` and the card (qlora_fsdp/kernels/fused_decoding.py):
- bitsandbytes and sdpa: every 4-bit weight is dequantized into a 16-bit buffer that cuBLAS reads back (half a
  byte and the absmax's 1/64 read, two bytes written, two read, an element); LoRA's fp32 matrices are cast every
  step and multiplied apart; the static cache is read whole as allocated, its keys and values first expanded to
  the query heads (`repeat_kv`: written, then read, once per query head of a group).
- fused: half a byte and 1/64 an element read once (the double-quantized absmax: one byte a 64-block); LoRA's
  copies in the compute dtype, made once a call; the live part of the cache (over a call, on average the prompt
  and half the completion) read once per key/value head.
Either way the head reads its 16-bit weight, sampling reads the logits, and each kernel of a step costs its launch
gap even inside a CUDA graph (KERNEL_SECONDS).

KERNEL_SECONDS and SAMPLING_SECONDS_PER_LOGIT are fitted to the bitsandbytes path measured on an H200 (torch
2.11, CUDA graphs; docs/benchmarks/grpo.md, 2026-11-28): Llama 3.2 1B's shapes at 32 and 128 rows took 8.8 and
16.1 ms a step (this model: 9.0 and 16.6 ms), the 3B's at 64 rows 26.8 ms (this model: 22.3 ms). The fused path's
figures are this model's until a GPU measures them (`make gpu-check-quick`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transformers import PretrainedConfig

from qlora_fsdp.config import Config
from qlora_fsdp.generation.room import CACHE_BUCKET, head_dim, kv_cache_bytes
from qlora_fsdp.run.accelerators import FUSED_KERNEL_GPUS

KERNEL_SECONDS = 5.64e-6  # a kernel's launch gap and ramp in a graph replay (fitted, above)
SAMPLING_SECONDS_PER_LOGIT = 4.06e-10  # transformers' sampling between replays, per row and vocabulary entry
GRAPH_REPLAY_SECONDS = 0.0001  # the host launching a replay
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down
# a linear's kernels a step: bitsandbytes' absmax, dequantize and cuBLAS with its cast, PEFT's two casts and two
# matmuls folded to three; fused: A's product, the kernel, the split-K sum
KERNELS_PER_LINEAR = {"bitsandbytes": 7, "fused": 3}
KERNELS_PER_LAYER_BESIDES = {"bitsandbytes": 7, "fused": 6}  # norms, rotary, residuals, activation, attention
PACKED_BYTES_PER_ELEMENT = 0.5 + 1 / 64  # a 4-bit value and its share of the 8-bit absmax, read


@dataclass(frozen=True)
class DecodingStep:
    """One decoding step of a call on a rank's GPU: bytes by kind, kernels launched, logits sampled."""

    fused: bool
    weight_bytes: float
    lora_bytes: float
    head_bytes: float
    kv_bytes: float
    kernels: int
    logits: int

    def bandwidth_seconds(self, memory_rate: float, turns: int = 1) -> float:
        """The bytes at the card's rate (`turns`: the split layout passes the cache's rows through every share)."""
        return (self.weight_bytes + self.lora_bytes + self.head_bytes + turns * self.kv_bytes) / memory_rate

    @property
    def launch_seconds(self) -> float:
        """A replay's kernels' gaps, sampling between replays and the replay's launch (graphs only)."""
        return self.kernels * KERNEL_SECONDS + self.logits * SAMPLING_SECONDS_PER_LOGIT + GRAPH_REPLAY_SECONDS


def kernels_fused(cfg: Config) -> bool:
    """Whether the recipe's card decodes through the fused kernels (`auto` and `fused` on sm86/89/90 cards)."""
    return cfg.generation.kernels != "off" and cfg.hardware.gpu in FUSED_KERNEL_GPUS


def lora_parameters(cfg: Config, hf: PretrainedConfig) -> int:
    """The decoder's LoRA parameters where every linear of a layer carries r x (in + out) (an estimate: recipes
    target them all; experts' adapters are left out, a step reads only the routed ones)."""
    hidden, heads, kv_heads = hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads or hf.num_attention_heads
    q_width, kv_width = heads * head_dim(hf), kv_heads * head_dim(hf)
    intermediate = getattr(hf, "intermediate_size", None) or 4 * hidden
    sides = 2 * (hidden + q_width) + 2 * (hidden + kv_width) + 3 * (hidden + intermediate)
    return cfg.lora.r * sides * hf.num_hidden_layers


def decoding_step(cfg: Config, hf: PretrainedConfig, elements: float, rows: int, prompt: int, new: int,
                  itemsize: int) -> DecodingStep:
    """`elements`: the 4-bit weight elements a step reads (the update's forward's distinct dequantized ones)."""
    fused = kernels_fused(cfg)
    head = hf.vocab_size * hf.hidden_size * itemsize  # the head's weight, read once a step
    lora = lora_parameters(cfg, hf)
    layers = hf.num_hidden_layers
    path = "fused" if fused else "bitsandbytes"
    kernels = layers * (LINEARS_PER_LAYER * KERNELS_PER_LINEAR[path] + KERNELS_PER_LAYER_BESIDES[path])
    if fused:
        kv = kv_cache_bytes(hf, rows, prompt + new // 2, itemsize)
        return DecodingStep(True, elements * PACKED_BYTES_PER_ELEMENT, lora * itemsize, head, kv, kernels,
                            rows * hf.vocab_size)
    group = hf.num_attention_heads // (hf.num_key_value_heads or hf.num_attention_heads)
    slots = math.ceil((prompt + new + 1) / CACHE_BUCKET) * CACHE_BUCKET
    kv = kv_cache_bytes(hf, rows, slots, itemsize) * (1 + 2 * group)
    weights = elements * (PACKED_BYTES_PER_ELEMENT + 2 * itemsize)  # and the 16-bit copy written, then read
    return DecodingStep(False, weights, lora * (4 + 2 * itemsize), head, kv, kernels, rows * hf.vocab_size)
