"""A generating objective's generation in the plan (generation/plan.py's GenerationPlan, as the run reads it):
what a rank holds while the policy samples its completions, and how long that takes on the recipe's GPUs, in each
layout of the weights (qlora_fsdp/generation/layouts.py); `auto` takes the layout the run would (GenerationPlan's
rule; objectives/rollouts.py generates; the update is the measured step).

Memory while generating, above what the rank holds all step (its shards, LoRA, optimizer state, quantization
state; the gradients are freed by the last update):
- the KV cache, from the architecture: a call's rows x (prompt + completion) tokens x, per layer, keys and values
  of its KV heads in the compute dtype (a sliding-window layer keeps its window). In `split` a rank caches every
  rank's rows for its share of the layers: the same bytes;
- the weights the layout gathers: `per_token`, the update's forward gathers (the root for the call, the layers one
  after another: the measured forward's peak); `gathered`, the whole model; `split`, the rank's share of the
  layers whole and the root;
- temporaries: the larger of the prompt's forward (one layer's MLP over the call's prompt tokens and a dequantized
  weight; in `split` every rank's rows at once) and a decoding step's logits and sampling buffers (an estimate).

Time: a call is one forward over the prompts, then a decoding step per new token. What a step moves (the 4-bit
weights, LoRA, the head, the KV cache) and how many kernels it runs come from plan/decoding_step.py, by path
(bitsandbytes and sdpa, or the fused kernels on the cards they are built for). Eagerly, a step is bound by those
bytes or by the host issuing each layer's kernels (at a few rows a step the GPU waits on Python: measured on an
H100, see DECODE_HOST_SECONDS_PER_LAYER), whichever is slower; replayed as a CUDA graph, it is the bytes plus every
kernel's launch gap plus the sampling between replays. Then what the layout puts on the link:
- `per_token`: every layer gathered every step (the forward's all-gather bytes), overlapping the compute;
- `gathered`: the model once a step; the ranks decode their own rows at once; with CUDA graphs (the recipe's
  `generation.graphs`, on a GPU) the step is replayed;
- `split`: the model once a step; each decoding step passes every rank's rows through the ranks in turn, so the
  ranks' shares of the weights are read one after another, every layer's hidden states cross the link twice, and
  the step runs eagerly (the relay is a collective between layers).
Every row is priced to max_completion_length: a plan cannot know the lengths. With tools, a rollout's replies and
tool turns share that length (the decoding steps stay as many), and each round of tool results adds a call whose
prompts are the contexts so far (GRPO's grpo.max_tool_calling_iterations rounds; the tools' own time is not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from qlora_fsdp.config import Config
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.generation.layouts import graphs_for
from qlora_fsdp.generation.plan import GenerationPlan, Layout
from qlora_fsdp.generation.room import kv_cache_bytes
from qlora_fsdp.measure.fake_step import planned_objective, update_rows
from qlora_fsdp.measure.op_work import DEQUANT_BYTES_PER_ELEMENT, Work
from qlora_fsdp.measure.step_tracker import StepMemory
from qlora_fsdp.plan.decoding_step import decoding_step
from qlora_fsdp.plan.step_time import Rates, link_seconds

# A decoding step's time a layer that neither bytes nor FLOPs explain: the host issuing the layer's kernels (FSDP2's
# hooks, bitsandbytes' and PEFT's Python, HF's cache), plus a part that grows with the rows (small-batch kernels,
# the cache's copies). Fitted to benchmarks/grpo_generation.py on an H100 machine: Llama 3.2 3B's shapes at 32 and
# 128 rows took 140 and 217 ms a step (28 layers); docs/benchmarks/grpo.md has the measured and planned figures
DECODE_HOST_SECONDS_PER_LAYER = 0.0041
DECODE_SECONDS_PER_ROW_LAYER = 0.0000286
RELAY_LATENCY_SECONDS = 0.00005  # one gather or scatter of a layer's hidden states between two ranks (PCIe)
SAMPLING_BYTES_PER_LOGIT = 32  # the logits upcast to fp32, temperature, top-k/top-p's sort (values, int64 indices)
MLP_TEMPORARIES = 3  # the gate's and up projection's outputs and their product, a prompt token at a time


@dataclass(frozen=True)
class Weights:
    """The model's weights as a rank holds them, for what a layout gathers: its shards (packed 4-bit, the rest,
    LoRA) and the root's whole bytes (embeddings, head)."""

    local: int
    root: int
    world: int
    offloaded: bool  # the shards live in host memory: the GPU holds none of them between forwards

    def gathered(self, layout: Layout, measured_forward_peak: int) -> int:
        """Bytes a layout adds on the GPU while generating."""
        whole = self.local * self.world
        if layout == "per_token":
            return measured_forward_peak
        if layout == "gathered":
            kept = whole
        else:  # split: its share of the layers, and the root
            kept = (whole - self.root) // self.world + self.root
        return kept if self.offloaded else kept - kept // self.world  # the rank's own shards of them are resident


@dataclass(frozen=True)
class GenerationMemory:
    """One rank's generation calls in a step, and what a call holds above the step's resident bytes."""

    layout: Layout
    made: GenerationPlan  # the rows a call, the calls, the prompt and new tokens
    kv_cache_bytes: int
    gathered_bytes: int
    temporaries_bytes: int


@dataclass(frozen=True)
class GenerationTime:
    """A step's generation on one rank, in seconds."""

    layout: Layout
    calls: int
    new_tokens: int
    setup: float  # the layout entered: the model gathered once a step (gathered, split)
    prefill: float  # a call's forward over its prompts
    decode_step: float  # one decoding step
    decode_link: float
    decode_gpu: float
    decode_host: float
    rounds: int = 0  # rounds of tool results a rollout may take (GenerationPlan.tool_rounds)
    round_prefill: float = 0.0  # a round's forward over the context so far (prompt and completion: re-read)
    fused: bool = False  # the decoding step runs the fused kernels (plan/decoding_step.py)

    @property
    def total(self) -> float:
        return self.setup + self.calls * (self.prefill + self.rounds * self.round_prefill
                                          + self.new_tokens * self.decode_step)


def root_bytes(cfg: Config, hf: PretrainedConfig) -> int:
    """The embeddings and the head, whole, in the weights' dtype (the final norm is a rounding error)."""
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    return hf.vocab_size * hf.hidden_size * TORCH_DTYPES[cfg.model.dtype].itemsize * (1 if tied else 2)


def planned_generation(cfg: Config) -> GenerationPlan | None:
    """What the recipe's objective generates a step, as it says (None: it generates nothing)."""
    return planned_objective(cfg).planned_generation()


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


def generation_memory(cfg: Config, hf: PretrainedConfig, step: StepMemory, largest_linear: int, layout: Layout,
                      weights: Weights | None = None) -> GenerationMemory:
    """`weights`: the rank's, for what `gathered` and `split` hold (None: time only, the memory's bytes unused)."""
    made, itemsize = planned_generation(cfg), TORCH_DTYPES[cfg.quant.compute_dtype].itemsize
    assert made is not None, f"train.objective {cfg.train.objective} generates nothing"
    rows, prompt, new = made.rows, made.prompt_tokens, made.new_tokens
    intermediate = getattr(hf, "intermediate_size", None) or 4 * hf.hidden_size
    layer_rows = rows * (cfg.hardware.world_size if layout == "split" else 1)  # split: every rank's rows at once
    prefill = layer_rows * prompt * intermediate * itemsize * MLP_TEMPORARIES + largest_linear * itemsize
    sampling = rows * hf.vocab_size * SAMPLING_BYTES_PER_LOGIT
    gathered = weights.gathered(layout, gathered_while_forward(step)) if weights is not None else 0
    return GenerationMemory(layout, made,
                            kv_cache_bytes(hf, rows, prompt + new, itemsize), gathered, max(prefill, sampling))


def generation_time(cfg: Config, hf: PretrainedConfig, step: StepMemory, memory: GenerationMemory,
                    rates: Rates) -> GenerationTime:
    itemsize = TORCH_DTYPES[cfg.quant.compute_dtype].itemsize
    layout, world = memory.layout, cfg.hardware.world_size
    made, layers = memory.made, hf.num_hidden_layers
    rows, prompt, new = made.rows, made.prompt_tokens, made.new_tokens
    forward = forward_work(step)
    flops_per_token = forward.matmul_flops / (update_rows(cfg) * cfg.data.context_length)  # as the update's forward
    _, _, gather = link_seconds(Work(gather_bytes=forward.gather_bytes, to_gpu_bytes=forward.to_gpu_bytes), rates)
    moved = decoding_step(cfg, hf, forward.distinct_dequant_elements, rows, prompt, new, itemsize)
    dequant = forward.distinct_dequant_elements * DEQUANT_BYTES_PER_ELEMENT / rates.memory  # the prompt's forward
    # split runs every rank's rows through each share of the layers in turn: the shares' reads add up to the whole
    # model's, the rows' cache reads and FLOPs to every rank's
    turns = world if layout == "split" else 1
    gpu = moved.bandwidth_seconds(rates.memory, turns) + turns * flops_per_token * rows / rates.flops
    host = layers * (DECODE_HOST_SECONDS_PER_LAYER + turns * rows * DECODE_SECONDS_PER_ROW_LAYER)
    rounds = made.tool_rounds
    if graphs_for(cfg.generation.graphs, True, layout, cfg.data.images_per_row > 0):  # a plan is of GPUs
        host = moved.launch_seconds  # after the replay's kernels, not beside them: the sampling waits for them
        gpu += host
    prompt_flops = turns * flops_per_token * rows * prompt / rates.flops
    if layout == "per_token":
        decode = max(gpu, gather, host) + min(gpu, gather) / max(layers, 1)  # the first gather hides behind nothing
        prefill = prompt_flops + gather + dequant
        return GenerationTime(layout, made.calls, new, 0.0, prefill, decode, gather, gpu, host, rounds,
                              prefill + prompt_flops * new / prompt, moved.fused)
    relay = hop = 0.0
    if layout == "split":  # each layer's hidden states to its owner and back, between the layers
        hop = (world - 1) * rows * hf.hidden_size * itemsize / (rates.nvlink or rates.pcie)
        relay = 2 * layers * (RELAY_LATENCY_SECONDS + hop)
    prompt_relay = 2 * layers * (RELAY_LATENCY_SECONDS + hop * prompt) if layout == "split" else 0.0
    prefill = prompt_flops + dequant + prompt_relay
    longer = (prompt + new) / prompt  # a round re-reads the prompt and the completion so far
    return GenerationTime(layout, made.calls, new, gather, prefill, max(gpu, host) + relay, relay, gpu, host,
                          rounds, dequant + (prompt_flops + prompt_relay) * longer, moved.fused)
