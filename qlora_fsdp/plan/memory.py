"""Memory planner: what one GPU (and its host) will hold for a recipe, before any weight is read.

The parameter side is exact: the model is built on the meta device and sharded by FSDP2 over a fake process
group of the recipe's world size, so each local shard has the shape rank 0 will allocate; gradients and
optimizer state follow from those shapes by the optimizers' own rules. Activations, logits, gather buffers
and CUDA overhead are estimates from the architecture (formulas below), to be checked on a GPU.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import bitsandbytes as bnb
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoConfig, PretrainedConfig

from qlora_fsdp.config import REPO_ROOT, Config, HardwareConfig
from qlora_fsdp.distributed import DistInfo, data_parallel_mesh, init_fake_distributed, local_shard
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.errors import ConfigError
from qlora_fsdp.model.build import base_parameter_count, decoder_layers, load_hf_config
from qlora_fsdp.model.sharding import sharded_meta_model, uses_fsdp
from qlora_fsdp.optimizers import OPTIMIZERS
from qlora_fsdp.plan.batch_size import describe_batch, effective_rows, resolve_batch
from qlora_fsdp.plan.hardware import GPU, GPUS

GIB = 2**30
CUDA_CONTEXT_GIB = 0.75  # CUDA context, cuBLAS workspace: outside the caching allocator
ALLOCATOR_SLACK = 0.05  # fragmentation, as a fraction of what the allocator holds
HOST_BASELINE_GIB = 1.5  # a rank's Python, torch, transformers and bitsandbytes before any weight
NESTED_BLOCK = 256  # block size of the double quantization of absmax


@dataclass
class Row:
    name: str
    bytes: float
    exact: bool  # from the sharded meta model; else an estimate from the architecture


@dataclass
class Plan:
    gpu_rows: list[Row]
    host_rows: list[Row]
    capacity_gib: float
    host_capacity_gib: float | None
    description: str

    @property
    def gpu_total(self) -> float:
        return sum(r.bytes for r in self.gpu_rows)

    @property
    def host_total(self) -> float:
        return sum(r.bytes for r in self.host_rows)

    @property
    def fits(self) -> bool:
        host_ok = self.host_capacity_gib is None or self.host_total <= self.host_capacity_gib * GIB
        return self.gpu_total <= self.capacity_gib * GIB and host_ok


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def quant_state_bytes(n_elements: int, blocksize: int, double_quant: bool) -> int:
    """A Linear4bit's quantization state, whole on every rank (FSDP shards only the packed weight)."""
    blocks = n_elements // blocksize
    codebook = 16 * 4  # the NF4/FP4 code, fp32
    if not double_quant:
        return blocks * 4 + codebook
    nested = math.ceil(blocks / NESTED_BLOCK) * 4 + 256 * 4 + 4  # nested absmax, its 8-bit code, the offset
    return blocks + nested + codebook


def planning_config(cfg: Config) -> PretrainedConfig:
    """The architecture: the shipped copy for a recipe's hub model (model_configs/<name>), so planning needs
    no download and no weights; else the model folder's own config.json."""
    shipped = REPO_ROOT / "model_configs" / cfg.model.path.rstrip("/").split("/")[-1].lower() / "config.json"
    if not Path(cfg.model.path).is_dir() and shipped.is_file():
        return AutoConfig.from_pretrained(shipped.parent)
    return load_hf_config(cfg)


def planning_mesh(world_size: int, shard_size: int | None = None) -> DeviceMesh:
    """A mesh of the recipe's world size over a fake process group, unless one exists (then it must match)."""
    if not dist.is_initialized():
        return init_fake_distributed(world_size, torch.device("cpu"), shard_size=shard_size).mesh
    if dist.get_world_size() != world_size:
        raise ValueError(f"planning for world size {world_size} inside a process group of {dist.get_world_size()}")
    return data_parallel_mesh("cpu", world_size, shard_size)


def meta_held(cfg: Config, mesh: DeviceMesh) -> Held:
    """Exact bytes from the recipe's model built and sharded as training does it, on the meta device."""
    return held_bytes(sharded_meta_model(cfg, planning_config(cfg), mesh), cfg)


@dataclass
class Held:
    """Exact bytes rank 0 holds, from the sharded meta model."""
    base_4bit: int = 0
    quant_state: int = 0
    other_base: int = 0
    lora: int = 0
    grads: int = 0
    optimizer: int = 0
    layer_gathered: int = 0  # one decoder layer, unsharded (what an all-gather materializes)
    root_gathered: int = 0  # embeddings, final norm and head, unsharded
    largest_linear: int = 0  # elements of the biggest Linear4bit (dequantized for each matmul)
    base_parameters: int = 0  # unpacked count, for MFU
    lora_elements: int = 0  # all ranks' LoRA elements together (the unsharded count)
    lora_input_features: int = 0  # summed input width of one decoder layer's LoRA-adapted linears


def held_bytes(model: nn.Module, cfg: Config) -> Held:
    held = Held()
    packed = set()
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            n = module.in_features * module.out_features
            packed.add(id(module.weight))
            held.quant_state += quant_state_bytes(n, cfg.quant.blocksize, cfg.quant.double_quant)
            held.largest_linear = max(held.largest_linear, n)
    for param in model.parameters():
        shard = local_shard(param)
        if param.requires_grad:
            held.lora += nbytes(shard)
            held.grads += nbytes(shard)  # FSDP2 hands each shard its gradient in the parameter's dtype
            held.optimizer += OPTIMIZERS[cfg.optim.name].state_bytes(shard.numel(), shard.element_size())
            held.lora_elements += param.numel()
        elif id(param) in packed:
            held.base_4bit += nbytes(shard)
        else:
            held.other_base += nbytes(shard)
    held.base_parameters = base_parameter_count(model)
    layers = decoder_layers(model)
    held.layer_gathered = max(sum(nbytes(p) for p in layer.parameters()) for layer in layers)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    held.root_gathered = sum(nbytes(p) for p in model.parameters() if id(p) not in in_layers)
    held.lora_input_features = max(lora_input_features(layer) for layer in layers)
    return held


def lora_input_features(layer: nn.Module) -> int:
    """Summed in_features of a layer's LoRA-adapted linears: PEFT casts each one's input to the LoRA dtype
    separately, and the copy stays saved for backward."""
    # cast: nn.Module types any attribute as Tensor | Module; a LoRA layer's in_features is an int
    return sum(cast(int, module.in_features) for module in layer.modules()
               if hasattr(module, "lora_A") and module.lora_A and hasattr(module, "in_features"))


def accumulated_grad_itemsize(cfg: Config) -> int:
    """Bytes an element of a gradient FSDP2 accumulates unsharded while gradient sync is off: upcast to the
    reduce dtype unless it equals the compute dtype (then FSDP2 drops it and keeps the compute dtype)."""
    compute = cfg.fsdp.param_dtype or cfg.lora.dtype
    kept = compute if cfg.fsdp.reduce_dtype == cfg.fsdp.param_dtype else cfg.fsdp.reduce_dtype
    return TORCH_DTYPES[kept].itemsize


def lora_cast_bytes_per_feature(cfg: Config) -> int:
    """What PEFT's LoRA branch keeps per input element: the input cast to the LoRA compute dtype (nothing when
    it already is that dtype) and, with dropout, the dropped-out copy and its mask."""
    activation = cfg.fsdp.param_dtype or cfg.model.dtype  # the hidden states' dtype
    lora = cfg.fsdp.param_dtype or cfg.lora.dtype
    cast = 0 if lora == activation else TORCH_DTYPES[lora].itemsize
    dropout = TORCH_DTYPES[lora].itemsize + 1 if cfg.lora.dropout > 0 else 0
    return cast + dropout


def activation_bytes(cfg: Config, hf_config: PretrainedConfig, micro_batch: int,
                     lora_features: int = 0) -> tuple[int, int]:
    """(activations, logits and loss) per rank for one micro-batch, estimated from the architecture.

    A layer's forward keeps, per token, in the compute dtype: the two norm outputs, q/k/v and their rotated
    copies, attention and o_proj outputs, two residual sums, gate, up, act(gate), their product, down's
    output; plus the norms' fp32 upcasts and PEFT's casts of each LoRA input (`lora_features` wide). A
    checkpointed layer keeps only its input, and backward recomputes one layer at a time.
    """
    d = TORCH_DTYPES[cfg.quant.compute_dtype].itemsize
    h, inter, layers = hf_config.hidden_size, hf_config.intermediate_size, hf_config.num_hidden_layers
    head_dim = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    kv = hf_config.num_key_value_heads * head_dim
    tokens = micro_batch * cfg.data.context_length
    lora_casts = lora_features * lora_cast_bytes_per_feature(cfg)
    per_layer = tokens * (d * (9 * h + 3 * kv + 4 * inter) + 2 * 4 * h + lora_casts)
    kept_input = tokens * h * d
    checkpointed = cfg.activation_checkpointing.wrapped_count(layers)
    activations = checkpointed * kept_input + (layers - checkpointed) * per_layer + per_layer
    # logits in the compute dtype, their fp32 copy, log-softmax kept for backward, fp32 and compute-dtype grads
    logits = tokens * hf_config.vocab_size * (d + 4 + 4 + 4 + d)
    return activations, logits


def gpu_spec(cfg: Config) -> GPU:
    if cfg.hardware.gpu not in GPUS:
        raise ConfigError(f"unknown hardware.gpu '{cfg.hardware.gpu}': choose one of {', '.join(GPUS)} "
                          "(or the nearest, with hardware.gpu_memory_gib set)")
    spec = GPUS[cfg.hardware.gpu]
    return GPU(cfg.hardware.gpu_memory_gib or spec.memory_gib, spec.bf16_tflops)


def resident_rows(held: Held, cfg: Config) -> list[Row]:
    """What lives with the shards: on the GPU, or in host RAM under CPU offload."""
    return [Row("4-bit base weights (this rank's shard)", held.base_4bit, True),
            Row("other base weights: embeddings, norms, head (shard)", held.other_base, True),
            Row(f"LoRA weights (shard, {cfg.lora.dtype})", held.lora, True),
            Row(f"LoRA gradients (shard, {cfg.lora.dtype})", held.grads, True),
            Row(f"optimizer state ({cfg.optim.name})", held.optimizer, True)]


def compute_rows(held: Held, cfg: Config, hf_config: PretrainedConfig, sharded: bool) -> list[Row]:
    """What the step itself needs on the GPU, beyond the resident shards."""
    activations, logits = activation_bytes(cfg, hf_config, cfg.data.micro_batch, held.lora_input_features)
    compute = TORCH_DTYPES[cfg.quant.compute_dtype].itemsize
    rows = [Row("quantization state (whole, on every rank)", held.quant_state, True)]
    if sharded:  # the layer computing and the one prefetched; the root stays gathered for the whole step
        rows += [Row("all-gather buffers (2 decoder layers unsharded)", 2 * held.layer_gathered, True),
                 Row("root unit unsharded (embeddings, norm, head)", held.root_gathered, True)]
    if sharded and cfg.data.grad_accum_steps > 1:  # on the GPU even under offload, until the last micro-batch
        rows.append(Row("LoRA gradients while accumulating (unsharded: sync is off until the last micro-batch)",
                        held.lora_elements * accumulated_grad_itemsize(cfg), True))
    rows += [Row("dequantized weight of the largest linear", held.largest_linear * compute, True),
             Row(f"activations ({cfg.activation_checkpointing.mode} checkpointing, micro-batch "
                 f"{cfg.data.micro_batch_size} x {cfg.data.context_length} tokens)", activations, False),
             Row("logits and loss", logits, False)]
    return rows


def host_rows(held: Held, cfg: Config) -> list[Row]:
    ranks = cfg.hardware.gpus_per_node
    rows = [Row(f"{ranks} rank processes before loading", ranks * HOST_BASELINE_GIB * GIB, False),
            Row("loading: each rank's largest tensor read and quantized",
                ranks * 2 * held.largest_linear * TORCH_DTYPES[cfg.model.dtype].itemsize, False)]
    if cfg.fsdp.cpu_offload:
        rows += [Row(f"offloaded {r.name}, {ranks} ranks", ranks * r.bytes, r.exact) for r in resident_rows(held, cfg)]
    return rows


def plan(cfg: Config, held: Held) -> Plan:
    """The plan for `cfg`, from the bytes its sharded model holds (or a config's with the same shapes)."""
    gpu = compute_rows(held, cfg, planning_config(cfg), uses_fsdp(cfg.fsdp, cfg.hardware.world_size))
    if not cfg.fsdp.cpu_offload:
        gpu = resident_rows(held, cfg) + gpu
    allocated = sum(r.bytes for r in gpu)
    gpu.append(Row("CUDA context and allocator slack", CUDA_CONTEXT_GIB * GIB + ALLOCATOR_SLACK * allocated, False))
    n = held.base_parameters
    count = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    description = f"{count} base parameters, world size {cfg.hardware.world_size}"
    return Plan(gpu, host_rows(held, cfg), gpu_spec(cfg).memory_gib, cfg.hardware.host_ram_gib, description)


def variants(cfg: Config, batch_from_target: bool = False) -> list[tuple[str, Config]]:
    """Changes that shrink the footprint, the ones that keep the most throughput first. With
    `batch_from_target` the recipe states an effective batch, so only the micro-batch is the user's to set."""
    changes: list[tuple[str, dict[str, object]]] = []
    if cfg.activation_checkpointing.mode != "every_layer":
        changes.append(("activation_checkpointing.mode=every_layer", {"activation_checkpointing.mode": "every_layer"}))
    if cfg.data.micro_batch > 1:
        half, accum = max(1, cfg.data.micro_batch // 2), cfg.data.grad_accum_steps * 2
        label = (f"data.micro_batch_size={half} (the effective batch then takes {accum} accumulation steps)"
                 if batch_from_target else
                 f"data.micro_batch_size={half} data.grad_accum_steps={accum} (same effective batch)")
        changes.append((label, {"data.micro_batch_size": half, "data.grad_accum_steps": accum}))
    if cfg.data.context_length > 512:
        changes.append((f"data.context_length={cfg.data.context_length // 2}",
                        {"data.context_length": cfg.data.context_length // 2}))
    if cfg.lora.r > 8:
        changes.append((f"lora.r={cfg.lora.r // 2}", {"lora.r": cfg.lora.r // 2}))
    if not cfg.fsdp.cpu_offload:
        changes.append(("fsdp_preset=full_shard_cpu_offload (slower: the optimizer step runs on the CPU)",
                        {"fsdp.cpu_offload": True}))
    out = []
    for label, values in changes:
        changed = copy.deepcopy(cfg)
        for dotted, value in values.items():
            section, key = dotted.split(".")
            setattr(getattr(changed, section), key, value)
        out.append((label, changed))
    return out


def suggestions(cfg: Config, held: Held, mesh: DeviceMesh, batch_from_target: bool = False) -> list[str]:
    """Each single change that makes a misfit fit, with the total it gives."""
    found = []
    for label, changed in variants(cfg, batch_from_target):
        same_shapes = changed.lora.r == cfg.lora.r  # only the rank changes what is allocated
        result = plan(changed, held if same_shapes else meta_held(changed, mesh))
        if result.fits:
            found.append(f"{label}: {result.gpu_total / GIB:.1f} GiB a GPU")
    return found


def format_rows(rows: list[Row]) -> list[str]:
    lines = ["| item | GiB | |", "| --- | ---: | --- |"]
    lines += [f"| {r.name} | {r.bytes / GIB:.2f} | {'exact' if r.exact else 'estimate'} |" for r in rows]
    return lines


def with_micro_batch(cfg: Config, micro: int) -> Config:
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, micro_batch_size=micro))


def micro_batch_fits(cfg: Config, held: Held) -> Callable[[int], bool]:
    return lambda micro: plan(with_micro_batch(cfg, micro), held).fits


def this_run_hardware(cfg: Config, info: DistInfo) -> HardwareConfig:
    """The hardware a run really has, for `micro_batch_size: auto` at launch: the GPU memory this process can
    use (or no limit on CPU), the ranks torchrun started; the recipe's host RAM figure is kept."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    memory = None
    if info.device.type == "cuda":
        # free now (a display or another process may hold part of the total) plus what this process holds: this
        # runs with the shards allocated, and the plan counts them; it counts the CUDA context too, which is
        # spent already (not free), so that is added back at the plan's estimate
        free, total = torch.cuda.mem_get_info(info.device)
        available = free + torch.cuda.memory_reserved(info.device) + CUDA_CONTEXT_GIB * GIB
        memory = min(total, available) / GIB
        if memory < total / GIB and cfg.data.micro_batch_size == "auto":
            print(f"micro_batch_size auto: sized for {memory:.1f} GiB of this GPU's {total / GIB:.1f} GiB; other "
                  "processes (a display, another run) hold the rest", flush=True)
    return dataclasses.replace(cfg.hardware, gpu="cpu", gpu_memory_gib=memory, gpus_per_node=local,
                               nodes=max(1, info.world_size // local))


def resolve_run_batch(cfg: Config, model: nn.Module, info: DistInfo) -> Config:
    """`resolve_batch` for a launched run: the planner measures the model this rank really holds."""
    run_cfg = dataclasses.replace(cfg, hardware=this_run_hardware(cfg, info))
    fits = micro_batch_fits(run_cfg, held_bytes(model, cfg))
    return resolve_batch(cfg, info.world_size, fits)


def report(cfg: Config) -> tuple[str, bool]:
    """The planner's table and verdict for a recipe; (text, fits)."""
    gpu_spec(cfg)  # a mistyped GPU name fails here, before the model is built
    mesh = planning_mesh(cfg.hardware.world_size, cfg.fsdp.shard_size)
    held = meta_held(cfg, mesh)
    fits = micro_batch_fits(cfg, held)  # an auto micro-batch where none fits plans 1, to show the misfit
    recipe, cfg = cfg, resolve_batch(cfg, cfg.hardware.world_size, lambda micro: micro == 1 or fits(micro))
    result = plan(cfg, held)
    gpu = f"{cfg.hardware.gpu} ({result.capacity_gib:g} GiB)"
    host_capacity = f"of {result.host_capacity_gib:g} GiB" if result.host_capacity_gib else "unchecked"
    lines = [f"plan for {cfg.model.path} on {cfg.hardware.world_size} x {gpu}: {result.description}", "",
             "per GPU (rank 0):", *format_rows(result.gpu_rows),
             f"| **total** | **{result.gpu_total / GIB:.2f}** | of {result.capacity_gib:g} GiB |", "",
             "host RAM, per node:", *format_rows(result.host_rows),
             f"| **total** | **{result.host_total / GIB:.2f}** | {host_capacity} |",
             "", describe_batch(recipe, cfg, cfg.hardware.world_size), "FITS" if result.fits else "DOES NOT FIT"]
    if not result.fits:
        fixes = suggestions(cfg, held, mesh, effective_rows(recipe) is not None)
        lines += ["changes that make it fit, most throughput kept first:", *[f"  - {f}" for f in fixes]] if fixes \
            else ["no single change makes it fit; combine them, or use more GPUs"]
    return "\n".join(lines), result.fits
