"""GRPO's generation in the plan: what a rank holds while the policy samples its completions, and how long that
takes on the recipe's GPUs (objectives/rollouts.py generates; the update is the measured step).

Memory while generating, above what the rank holds all step (its shards, LoRA, optimizer state, quantization
state; the gradients are freed by the last update):
- the KV cache, from the architecture: a call's rows x (prompt + completion) tokens x, per layer, keys and values
  of its KV heads in the compute dtype (a sliding-window layer keeps its window);
- the gathered parameters: each decoding step runs the update's forward gathers (the root for the whole call, the
  layers one after another), so the measured forward's peak of gathered bytes;
- temporaries: the larger of the prompt's forward (one layer's MLP over the call's prompt tokens and a dequantized
  weight) and a decoding step's logits and sampling buffers (an estimate).

Time: a call is one forward over the prompts, then a decoding step per new token. Each step is a forward of every
layer for one token a row: every rank gathers every layer (the forward's all-gather bytes), dequantizes every
4-bit weight and reads it, and reads the KV cache. That is bound by the link, the memory bandwidth, or the host
issuing each layer's kernels (at a few rows a step the GPU waits on Python: measured on an H100, see
DECODE_HOST_SECONDS_PER_LAYER), whichever is slowest. Every row is priced to max_completion_length: ranks step
together until the last row ends, and a plan cannot know the lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transformers import PretrainedConfig

from qlora_fsdp.config import Config
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.measure.fake_step import update_rows
from qlora_fsdp.measure.op_work import DEQUANT_BYTES_PER_ELEMENT, Work
from qlora_fsdp.measure.step_tracker import StepMemory
from qlora_fsdp.plan.step_time import Rates, link_seconds

# A decoding step's time a layer that neither bytes nor FLOPs explain: the host issuing the layer's kernels (FSDP2's
# hooks, bitsandbytes' and PEFT's Python, HF's cache), plus a part that grows with the rows (small-batch kernels,
# the cache's copies). Fitted to benchmarks/grpo_generation.py on an H100 machine: Llama 3.2 3B's shapes at 32 and
# 128 rows took 140 and 217 ms a step (28 layers); docs/benchmarks/grpo.md has the measured and planned figures
DECODE_HOST_SECONDS_PER_LAYER = 0.0041
DECODE_SECONDS_PER_ROW_LAYER = 0.0000286
SAMPLING_BYTES_PER_LOGIT = 32  # the logits upcast to fp32, temperature, top-k/top-p's sort (values, int64 indices)
MLP_TEMPORARIES = 3  # the gate's and up projection's outputs and their product, a prompt token at a time


@dataclass(frozen=True)
class GenerationMemory:
    """One rank's generation calls in a step, and what a call holds above the step's resident bytes."""

    rows: int  # completions a call generates together
    calls: int
    prompt_tokens: int  # the longest prompt a recipe allows (the context less max_completion_length)
    new_tokens: int
    kv_cache_bytes: int
    gathered_bytes: int
    temporaries_bytes: int


@dataclass(frozen=True)
class GenerationTime:
    """A step's generation on one rank, in seconds."""

    calls: int
    new_tokens: int
    prefill: float  # a call's forward over its prompts
    decode_step: float  # one decoding step: the slowest of the three below, and the first gather
    decode_link: float
    decode_gpu: float
    decode_host: float

    @property
    def total(self) -> float:
        return self.calls * (self.prefill + self.new_tokens * self.decode_step)


def rank_completions(cfg: Config) -> int:
    """Completions a rank generates in a step: num_generations for each of its step's prompts."""
    return cfg.data.micro_batch * cfg.data.grad_accum_steps * cfg.grpo.num_generations


def head_dim(hf: PretrainedConfig) -> int:
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def kv_cache_bytes(hf: PretrainedConfig, rows: int, tokens: int, itemsize: int) -> int:
    """Keys and values of every layer for `rows` rows of `tokens` tokens; a sliding-window layer keeps its window."""
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    per_token = 2 * kv_heads * head_dim(hf) * itemsize
    types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None) or tokens
    kept = [min(tokens, window) if kind == "sliding_attention" else tokens for kind in types]
    return rows * per_token * sum(kept)


def forward_work(step: StepMemory) -> Work:
    """The first micro-batch's forward through the model (embeddings, layers, final norm): its gathers and its
    dequantized weights are what each decoding step repeats."""
    work = Work()
    for part in ("pre", "forward", "post"):
        work.add(step.work.get((0, part), Work()))
    return work


def gathered_while_forward(step: StepMemory) -> int:
    return max((m.gathered for (micro, part, _), m in step.segments.items() if micro == 0 and part in
                ("pre", "forward", "post")), default=0)


def generation_memory(cfg: Config, hf: PretrainedConfig, step: StepMemory, largest_linear: int) -> GenerationMemory:
    grpo, itemsize = cfg.grpo, TORCH_DTYPES[cfg.quant.compute_dtype].itemsize
    total_rows = rank_completions(cfg)
    rows = min(grpo.generation_rows or total_rows, total_rows)
    prompt, new = cfg.prompt_room, grpo.max_completion_length
    intermediate = getattr(hf, "intermediate_size", None) or 4 * hf.hidden_size
    prefill = rows * prompt * intermediate * itemsize * MLP_TEMPORARIES + largest_linear * itemsize
    sampling = rows * hf.vocab_size * SAMPLING_BYTES_PER_LOGIT
    return GenerationMemory(rows, math.ceil(total_rows / rows), prompt, new,
                            kv_cache_bytes(hf, rows, prompt + new, itemsize), gathered_while_forward(step),
                            max(prefill, sampling))


def generation_time(cfg: Config, hf: PretrainedConfig, step: StepMemory, memory: GenerationMemory,
                    rates: Rates) -> GenerationTime:
    itemsize = TORCH_DTYPES[cfg.quant.compute_dtype].itemsize
    rows, prompt, new, layers = memory.rows, memory.prompt_tokens, memory.new_tokens, hf.num_hidden_layers
    forward = forward_work(step)
    flops_per_token = forward.matmul_flops / (update_rows(cfg) * cfg.data.context_length)  # as the update's forward
    _, _, link = link_seconds(Work(gather_bytes=forward.gather_bytes, to_gpu_bytes=forward.to_gpu_bytes), rates)
    head = hf.vocab_size * hf.hidden_size * itemsize
    mean_cache = memory.kv_cache_bytes * (prompt + new / 2) / (prompt + new)  # the cache read grows a token a step
    weights = forward.dequant_elements * (DEQUANT_BYTES_PER_ELEMENT + itemsize) + head  # dequantized, then read
    gpu = (weights + mean_cache) / rates.memory + flops_per_token * rows / rates.flops
    host = layers * (DECODE_HOST_SECONDS_PER_LAYER + rows * DECODE_SECONDS_PER_ROW_LAYER)
    decode = max(gpu, link, host) + min(gpu, link) / max(layers, 1)  # the first gather hides behind nothing
    prefill = (flops_per_token * rows * prompt / rates.flops + link
               + forward.dequant_elements * DEQUANT_BYTES_PER_ELEMENT / rates.memory)
    return GenerationTime(memory.calls, new, prefill, decode, link, gpu, host)
