"""Memory planner: what one GPU (and its host) will hold for a recipe, before any weight is read.

The parameter side is exact: the model is built on the meta device and sharded by FSDP2 over a fake process
group of the recipe's world size, so each local shard has the shape rank 0 will allocate; gradients and
optimizer state follow from those shapes by the optimizers' own rules. The step itself (gathered layers,
gradients while accumulating, activations, logits and loss, the optimizer update) is measured: training's own
step runs on fake tensors under torch's FSDP2 memory tracker (measure/fake_step.py), and the GPU total is that
step's peak. Only the CUDA context and the allocator's slack stay estimates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from qlora_fsdp.config import Config
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.errors import ConfigError
from qlora_fsdp.generation.plan import Layout, chosen_layout
from qlora_fsdp.measure.fake_step import planned_objective, update_rows
from qlora_fsdp.measure.fake_world import recipe_step
from qlora_fsdp.measure.held import Held
from qlora_fsdp.measure.image_side import image_side
from qlora_fsdp.measure.planning import Planning
from qlora_fsdp.measure.step_tracker import Segment, StepMemory
from qlora_fsdp.plan.generation import (
    Weights,
    generation_memory,
    planned_generation,
    root_bytes,
)
from qlora_fsdp.run.accelerators import GPU, GPUS

GIB = 2**30


CUDA_CONTEXT_GIB = 0.75  # CUDA context, cuBLAS workspace: outside the caching allocator


ALLOCATOR_SLACK = 0.05  # fragmentation, as a fraction of what the allocator holds


HOST_BASELINE_GIB = 1.5  # a rank's Python, torch, transformers and bitsandbytes before any weight


Basis = Literal["exact", "measured", "estimate"]


@dataclass
class Row:
    name: str
    bytes: float
    # exact: from the sharded meta model's shapes; measured: from the step run on fake tensors under torch's memory
    # tracker; estimate: neither (the CUDA context, the allocator's slack, host processes)
    basis: Basis


@dataclass
class Plan:
    gpu_rows: list[Row]
    host_rows: list[Row]
    capacity_gib: float
    host_capacity_gib: float | None
    description: str
    step: StepMemory | None = None  # the measured step (its work prices the step's time: plan/step_time.py)
    resident_gpu: float = 0.0  # bytes the device holds through the whole step (in the step's every instant)
    generating_rows: list[Row] = dataclasses.field(default_factory=list)  # GRPO: the device while generating
    image_forward_total: float = 0.0  # images: the device while the vision tower runs (before the decoder's forward)

    @property
    def update_total(self) -> float:
        return sum(r.bytes for r in self.gpu_rows)

    @property
    def generating_total(self) -> float:
        return sum(r.bytes for r in self.generating_rows)

    @property
    def gpu_total(self) -> float:
        """The step's peak: the update's, or generation's or the vision tower's where they hold more."""
        return max(self.update_total, self.generating_total, self.image_forward_total)

    @property
    def host_total(self) -> float:
        return sum(r.bytes for r in self.host_rows)

    @property
    def fits(self) -> bool:
        host_ok = self.host_capacity_gib is None or self.host_total <= self.host_capacity_gib * GIB
        return self.gpu_total <= self.capacity_gib * GIB and host_ok


def gpu_spec(cfg: Config) -> GPU:
    if cfg.hardware.gpu not in GPUS:
        raise ConfigError(f"unknown hardware.gpu '{cfg.hardware.gpu}': choose one of {', '.join(GPUS)} "
                          "(or the nearest, with hardware.gpu_memory_gib set)")
    spec, hardware = GPUS[cfg.hardware.gpu], cfg.hardware
    return dataclasses.replace(spec, memory_gib=hardware.gpu_memory_gib or spec.memory_gib,
                               pcie_gen=hardware.pcie_gen or spec.pcie_gen,
                               pcie_lanes=hardware.pcie_lanes or spec.pcie_lanes)


def resident_rows(held: Held, cfg: Config) -> list[Row]:
    """What lives with the shards for the whole step: on the GPU, or in host RAM under CPU offload."""
    return [Row("4-bit base weights (this rank's shard)", held.base_4bit, "exact"),
            Row("other base weights: embeddings, norms, head (shard)", held.other_base, "exact"),
            Row(f"LoRA weights (shard, {cfg.lora.dtype})", held.lora, "exact"),
            Row(f"optimizer state ({cfg.optim.name})", held.optimizer, "exact"),
            *([Row("the KL term's reference: the starting adapter, frozen (shard)", held.lora, "exact")]
              if planned_objective(cfg).keeps_reference_adapter() else [])]


def checkpointing_words(cfg: Config) -> str:
    policy = cfg.activation_checkpointing
    if policy.mode == "off":
        return "no checkpointing" + (", saved tensors offloaded" if policy.offload else "")
    scope = "" if policy.scope == "layer" else f" ({policy.scope})"
    return f"{policy.mode} checkpointing{scope}" + (", its inputs offloaded" if policy.offload else "")


def loss_words(cfg: Config) -> str:
    return f"chunks of {cfg.loss.chunk_tokens} tokens" if cfg.loss.chunked else "full logits"


def layer_words(layer: object) -> str:
    """A step segment's layer: an index, or a place in a shortened model's repeated block (measure/fake_step.py)."""
    if isinstance(layer, int):
        return f"layer {layer + 1}"
    return "the first layers" if isinstance(layer, tuple) and layer[1:2] == ("from start",) else "the last layers"


ORDINALS = ("first", "second", "third", "fourth")


def instant_words(segment: Segment) -> str:
    """Where in the step a part is, in words: "the second micro-batch's backward of the last layers"."""
    micro, part, layer = segment
    where = {"pre": "embeddings (before the first layer)", "post": "final norm (after the last layer)",
             "end": "embeddings' backward", "forward": f"forward of {layer_words(layer)}",
             "backward": f"backward of {layer_words(layer)}"}
    ordinal = ORDINALS[micro] if micro < len(ORDINALS) else f"{micro + 1}th"
    return f"the {ordinal} micro-batch's {where.get(part, part)}"


def activations_peak_line(step: StepMemory, resident: float = 0.0) -> str | None:
    """Where activations are largest, when that is not the step's peak (the gathers' peak can be elsewhere, at the
    start of a forward with the root's and first layers' gathers alive, and longer rows move it back). `resident`:
    what the device holds throughout (weights, LoRA, optimizer state, quantization state), not activations."""
    peak, largest = step.model_instant(), step.activations_instant
    if peak is None or largest is None or largest == peak:
        return None
    top, there = step.segments[peak], step.segments[largest]
    activations = there.total - resident - there.gathered - there.gradients
    return (f"activations and temporaries are largest elsewhere: {activations / GIB:.2f} GiB in "
            f"{instant_words(largest)}, where the device holds {(top.total - there.total) / GIB:.2f} GiB less "
            "than at the peak above")


def measured_rows(cfg: Config, step: StepMemory, exact_on_gpu: float) -> list[Row]:
    """The step's peak, in rows that add up to it: what was alive at the peak of forward and backward, then what
    the loss and the optimizer update reach above it (each only when it does)."""
    top, instant = step.model, step.model_instant()
    tokens = f"micro-batch {update_rows(cfg)} x {cfg.data.context_length} tokens"
    at = f": {instant_words(instant)}" if instant is not None else ""
    rows = [Row("gathered parameters: unsharded layers and root, all-gather buffers (measured at the peak of "
                f"forward and backward{at})", top.gathered, "measured")] if top.gathered else []
    rows += [Row("LoRA gradients at that peak (unsharded while accumulating, reduce-scatter buffers)", top.gradients,
                 "measured"),
             Row(f"activations and temporaries at that peak ({checkpointing_words(cfg)}, {tokens})",
                 top.total - exact_on_gpu - top.gathered - top.gradients, "measured"),
             Row(f"logits and loss above that peak ({loss_words(cfg)}; {step.own_loss_bytes / GIB:.2f} GiB their own)",
                 max(0, step.loss.total - top.total), "measured")]
    if step.optimizer.total > max(top.total, step.loss.total):
        rows.append(Row("optimizer update above both", step.optimizer.total - max(top.total, step.loss.total),
                        "measured"))
    return rows


def gpu_resident_rows(planning: Planning, held: Held, cfg: Config) -> list[Row]:
    """What the device holds through the whole step."""
    rows = [] if cfg.fsdp.cpu_offload else resident_rows(held, cfg)
    rows.append(Row("quantization state (whole, on every rank)", held.quant_state, "exact"))
    side = image_side(planning, cfg)
    if side is not None:
        rows.append(Row("image side, whole on every rank: vision tower and projector (4-bit where transformers "
                        "makes them so)", side.weights, "exact"))
        if side.trained:
            rows.append(Row("its trained projector / tower LoRA: gradients and optimizer state", side.trained,
                            "exact"))
    return rows


def with_context(rows: list[Row]) -> list[Row]:
    allocated = sum(r.bytes for r in rows)
    return [*rows, Row("CUDA context and allocator slack", CUDA_CONTEXT_GIB * GIB + ALLOCATOR_SLACK * allocated,
                       "estimate")]


def offload_copy_rows(held: Held, cfg: Config) -> list[Row]:
    # on a GPU, FSDP2 copies a layer's host shards to the device before gathering them; on the CPU mesh the step
    # is measured on they already are there, so this transient is added: a conservative bound
    return [Row("offloaded shards copied to the GPU to gather a layer (not in the measured step; added)",
                held.layer_shard, "exact")] if cfg.fsdp.cpu_offload else []


def gpu_rows(planning: Planning, held: Held, cfg: Config, step: StepMemory) -> list[Row]:
    rows = gpu_resident_rows(planning, held, cfg)
    rows += measured_rows(cfg, step, sum(r.bytes for r in rows))
    side = image_side(planning, cfg)
    if side is not None and side.masks:
        rows.append(Row("masks of the images' both-ways attention (full and sliding, a micro-batch's; added)",
                        side.masks, "exact"))
    return with_context(rows + offload_copy_rows(held, cfg))


def image_forward_total(planning: Planning, held: Held, cfg: Config) -> float:
    """The device while the vision tower runs a micro-batch's images: what it holds all step, and the forward."""
    side = image_side(planning, cfg)
    if side is None:
        return 0.0
    rows = [*gpu_resident_rows(planning, held, cfg), Row("the vision tower's forward", side.forward, "estimate")]
    return sum(r.bytes for r in with_context(rows))


def rank_weights(planning: Planning, held: Held, cfg: Config) -> Weights:
    return Weights(held.base_4bit + held.other_base + held.lora, root_bytes(cfg, planning.hf_config),
                   cfg.hardware.world_size, cfg.fsdp.cpu_offload)


GATHERED_WORDS = {"per_token": "the root for the call, layers in turn: the update's forward gathers",
                  "gathered": "the whole model, once a step", "split": "this rank's share of the layers and the root"}


def layout_rows(planning: Planning, held: Held, cfg: Config, step: StepMemory, layout: Layout) -> list[Row]:
    """The device while the policy generates in `layout`."""
    made = generation_memory(cfg, planning.hf_config, step, held.largest_linear, layout,
                             rank_weights(planning, held, cfg))
    plan = made.made
    tokens = f"{plan.rows} rows x ({plan.prompt_tokens} prompt + {plan.new_tokens} new) tokens"
    rows = [*gpu_resident_rows(planning, held, cfg),
            Row(f"KV cache ({tokens}; {plan.calls} call{'s' if plan.calls > 1 else ''} a step)", made.kv_cache_bytes,
                "exact"),
            Row(f"weights gathered while generating, {layout} ({GATHERED_WORDS[layout]})", made.gathered_bytes,
                "measured" if layout == "per_token" else "exact"),
            Row("temporaries: the prompts' forward (one layer's MLP, a dequantized weight) or sampling's logits",
                made.temporaries_bytes, "estimate")]
    return with_context(rows + (offload_copy_rows(held, cfg) if layout == "per_token" else []))


def planned_layout(planning: Planning, held: Held, cfg: Config, step: StepMemory) -> Layout:
    """The layout the run takes (generation/plan.py's one rule), asked of the planned bytes: whether the device
    while generating in a layout fits the GPU."""
    def fits(layout: Layout) -> Callable[[], bool]:
        return lambda: (sum(r.bytes for r in layout_rows(planning, held, cfg, step, layout))
                        <= gpu_spec(cfg).memory_gib * GIB)

    return chosen_layout(cfg.generation.layout, cfg.hardware.world_size, fits("gathered"), fits("split"))


def with_generation_layout(planning: Planning, cfg: Config, held: Held, step: StepMemory) -> Config:
    """`generation.layout: auto`: the layout the plan takes, written into the planned config (its time reads it)."""
    if planned_generation(cfg) is None or cfg.generation.layout != "auto":
        return cfg
    generation = dataclasses.replace(cfg.generation, layout=planned_layout(planning, held, cfg, step))
    return dataclasses.replace(cfg, generation=generation)


def generating_rows(planning: Planning, held: Held, cfg: Config, step: StepMemory) -> list[Row]:
    """The device while the policy generates (plan/generation.py), empty for objectives that generate nothing."""
    if planned_generation(cfg) is None:
        return []
    return layout_rows(planning, held, cfg, step, planned_layout(planning, held, cfg, step))


def loading_bytes(held: Held, cfg: Config) -> int:
    """The most loading holds at once: a weight read whole and its copy being quantized, or a pre-quantized
    checkpoint's packed bytes, copied as stored."""
    return max(2 * held.largest_linear * TORCH_DTYPES[cfg.model.dtype].itemsize, held.largest_packed)


def host_rows(held: Held, cfg: Config, step: StepMemory) -> list[Row]:
    ranks = cfg.hardware.gpus_per_node
    rows = [Row(f"{ranks} rank processes before loading", ranks * HOST_BASELINE_GIB * GIB, "estimate"),
            Row("loading: each rank's largest weight read (and quantized)", ranks * loading_bytes(held, cfg),
                "estimate")]
    if cfg.fsdp.cpu_offload:
        rows += [Row(f"offloaded {r.name}, {ranks} ranks", ranks * r.bytes, r.basis) for r in resident_rows(held, cfg)]
        rows.append(Row(f"offloaded LoRA gradients (shard, {cfg.lora.dtype}), {ranks} ranks", ranks * held.grads,
                        "exact"))
    if step.offloaded:
        rows.append(Row(f"activations offloaded to host memory (peak), {ranks} ranks", ranks * step.offloaded,
                        "measured"))
    return rows


def parameters(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def plan(planning: Planning, cfg: Config, held: Held, step: StepMemory | None = None) -> Plan:
    """The plan for `cfg` (the planning's recipe, resolved, or a variant of it), from the bytes its sharded model
    holds (or a config's with the same shapes) and its measured step (measured here unless given)."""
    step = step if step is not None else recipe_step(planning, cfg)
    n = held.base_parameters
    active = f" ({parameters(held.active_parameters)} active a token)" if held.active_parameters < n else ""
    description = (f"{parameters(n)} base parameters{active}, world size {cfg.hardware.world_size}, "
                   f"weights {cfg.model.dtype}, 4-bit compute {cfg.quant.compute_dtype}")
    return Plan(gpu_rows(planning, held, cfg, step), host_rows(held, cfg, step), gpu_spec(cfg).memory_gib,
                cfg.hardware.host_ram_gib, description, step,
                sum(r.bytes for r in gpu_resident_rows(planning, held, cfg)),
                generating_rows(planning, held, cfg, step), image_forward_total(planning, held, cfg))


def format_rows(rows: list[Row]) -> list[str]:
    lines = ["| item | GiB | |", "| --- | ---: | --- |"]
    lines += [f"| {r.name} | {r.bytes / GIB:.2f} | {r.basis} |" for r in rows]
    return lines


def with_micro_batch(cfg: Config, micro: int) -> Config:
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, micro_batch_size=micro))


def micro_batch_fits(planning: Planning, cfg: Config, held: Held) -> Callable[[int], bool]:
    return lambda micro: plan(planning, with_micro_batch(cfg, micro), held).fits
