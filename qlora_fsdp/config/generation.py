"""The recipe's `generation` section: what a generating objective's policy samples (train.objective grpo, rloo)
and how the calls run. Resolved once into a typed plan (qlora_fsdp/generation/plan.py) that the run, the
planner's memory and its time all read. Part of the schema (schema.py re-exports)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

GenerationLayout = Literal["auto", "gathered", "split", "per_token"]


@dataclass
class GenerationConfig:
    """The completions the policy samples while it trains (TRL's generation settings; its defaults but
    max_completion_length)."""

    num_generations: int = 8  # completions per prompt: a group, whose rewards are compared with each other
    max_completion_length: int = 256  # new tokens at most (GRPO's dr_grpo normalizer too)
    temperature: float = 1.0  # sampling, and the log-probabilities the update computes (logits / temperature)
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens whose probability reaches it; 1.0: off
    top_k: int = 0  # sampling among the k likeliest tokens; 0: off
    stop: list[str] = field(default_factory=list)  # strings that end a completion besides EOS
    rows: int | None = None  # completions a call generates together (its KV cache's rows); None: a rank's step
    # where the weights are while generating (qlora_fsdp/generation/layouts.py): gathered (the whole model, once a
    # step), split (each rank holds its share of the layers) or per_token (gathered layer by layer every token, as
    # training holds them); auto: gathered where the whole model and the KV cache fit the GPU, else split where a
    # rank's share does, else per_token (the run asks its free memory, the plan its planned bytes; --plan names it)
    layout: GenerationLayout = "auto"
    # a preallocated KV cache and a decoding step replayed as one CUDA graph (transformers' static cache with
    # torch.compile's reduce-overhead mode); auto: on CUDA; eager on a CPU either way
    graphs: Literal["auto", "on", "off"] = "auto"
    # the decoding step's 4-bit linears (LoRA in the epilogue) and attention as fused Triton kernels
    # (qlora_fsdp/kernels/); auto: on RTX 3090/4090 and H100/H200, else bitsandbytes and sdpa (said once); fused:
    # refused where they cannot run; off: bitsandbytes and sdpa
    kernels: Literal["auto", "fused", "off"] = "auto"


# keys that moved into `generation` from `grpo` (a run's saved config is read with them moved; a recipe is told)
MOVED_TO_GENERATION = {
    "grpo.num_generations": "generation.num_generations",
    "grpo.max_completion_length": "generation.max_completion_length",
    "grpo.temperature": "generation.temperature", "grpo.top_p": "generation.top_p", "grpo.top_k": "generation.top_k",
    "grpo.stop": "generation.stop", "grpo.generation_rows": "generation.rows",
    "grpo.generation_layout": "generation.layout", "grpo.generation_graphs": "generation.graphs",
    "grpo.generation_kernels": "generation.kernels",
}
