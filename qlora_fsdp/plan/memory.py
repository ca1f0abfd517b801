"""Memory planner: what one GPU (and its host) will hold for a recipe, before any weight is read.

The parameter side is exact: the model is built on the meta device and sharded by FSDP2 over a fake process
group of the recipe's world size, so each local shard has the shape rank 0 will allocate; gradients and
optimizer state follow from those shapes by the optimizers' own rules. The step itself (gathered layers,
gradients while accumulating, activations, logits and loss, the optimizer update) is measured: training's own
step runs on fake tensors under torch's FSDP2 memory tracker (plan/fake_step.py), and the GPU total is that
step's peak. Only the CUDA context and the allocator's slack stay estimates.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import multiprocessing
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

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
from qlora_fsdp.model.sharding import sharded_meta_model
from qlora_fsdp.optimizers import OPTIMIZERS
from qlora_fsdp.plan.batch_size import describe_batch, effective_rows, resolve_batch
from qlora_fsdp.plan.fake_step import NESTED_BLOCK, cached_step
from qlora_fsdp.plan.hardware import GPU, GPUS, planned_device
from qlora_fsdp.plan.step_memory import StepMemory
from qlora_fsdp.precision import resolve_dtypes

GIB = 2**30
CUDA_CONTEXT_GIB = 0.75  # CUDA context, cuBLAS workspace: outside the caching allocator
ALLOCATOR_SLACK = 0.05  # fragmentation, as a fraction of what the allocator holds
HOST_BASELINE_GIB = 1.5  # a rank's Python, torch, transformers and bitsandbytes before any weight


Basis = Literal["exact", "measured", "estimate"]
T = TypeVar("T")


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


def planned_dtypes(cfg: Config) -> Config:
    """`auto` dtypes as the recipe's hardware resolves them (float16 on a T4, bfloat16 on an RTX 4090)."""
    return resolve_dtypes(cfg, planned_device(cfg.hardware))


def meta_held(cfg: Config, mesh: DeviceMesh) -> Held:
    """Exact bytes from the recipe's model built and sharded as training does it, on the meta device."""
    cfg = planned_dtypes(cfg)
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
    layer_shard: int = 0  # one decoder layer's local shards (what offload copies to the GPU to gather it)
    largest_linear: int = 0  # elements of the biggest Linear4bit (read whole and quantized while loading)
    base_parameters: int = 0  # unpacked count, for MFU
    lora_elements: int = 0  # all ranks' LoRA elements together (the unsharded count)


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
    held.layer_shard = max(sum(nbytes(local_shard(p)) for p in layer.parameters()) for layer in decoder_layers(model))
    return held


def accumulated_grad_itemsize(cfg: Config) -> int:
    """Bytes an element of a gradient FSDP2 accumulates unsharded while gradient sync is off: upcast to the
    reduce dtype unless it equals the compute dtype (then FSDP2 drops it and keeps the compute dtype)."""
    compute = cfg.fsdp.param_dtype or cfg.lora.dtype
    kept = compute if cfg.fsdp.reduce_dtype == cfg.fsdp.param_dtype else cfg.fsdp.reduce_dtype
    return TORCH_DTYPES[kept].itemsize


def accumulating_gradient_bytes(held: Held, cfg: Config) -> int:
    """The LoRA gradients FSDP2 holds unsharded between micro-batches (sync off): the measured step's gradient
    rows include them; this exact figure is what the tests hold FSDP2 itself to."""
    return held.lora_elements * accumulated_grad_itemsize(cfg)


def gpu_spec(cfg: Config) -> GPU:
    if cfg.hardware.gpu not in GPUS:
        raise ConfigError(f"unknown hardware.gpu '{cfg.hardware.gpu}': choose one of {', '.join(GPUS)} "
                          "(or the nearest, with hardware.gpu_memory_gib set)")
    spec = GPUS[cfg.hardware.gpu]
    return GPU(cfg.hardware.gpu_memory_gib or spec.memory_gib, spec.bf16_tflops)


# ---- the measured step --------------------------------------------------------------------------------------

def _in_fake_world(cfg: Config, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a fresh process acting as rank 0 of a fake world of the recipe's size. For a process already
    in a real process group (a launched run sizing its auto micro-batch, the GPU check): the fake step's
    collectives must not reach the real ranks, and a process has one default group."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(_run_in_fake_world, (cfg.hardware.world_size, cfg.fsdp.shard_size, fn, args))


def _run_in_fake_world(world_size: int, shard_size: int | None, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    planning_mesh(world_size, shard_size)
    return fn(*args)


def in_real_world() -> bool:
    return dist.is_initialized() and dist.get_backend() != "fake"


def step_memory(cfg: Config) -> StepMemory:
    """The recipe's step measured on fake tensors (once per setting: see fake_step.cached_step)."""
    cfg = planned_dtypes(cfg)
    if in_real_world():
        return _in_fake_world(cfg, step_memory, cfg)
    return cached_step(cfg, planning_config(cfg), planning_mesh(cfg.hardware.world_size, cfg.fsdp.shard_size))


# ---- the plan -----------------------------------------------------------------------------------------------

def resident_rows(held: Held, cfg: Config) -> list[Row]:
    """What lives with the shards for the whole step: on the GPU, or in host RAM under CPU offload."""
    return [Row("4-bit base weights (this rank's shard)", held.base_4bit, "exact"),
            Row("other base weights: embeddings, norms, head (shard)", held.other_base, "exact"),
            Row(f"LoRA weights (shard, {cfg.lora.dtype})", held.lora, "exact"),
            Row(f"optimizer state ({cfg.optim.name})", held.optimizer, "exact")]


def checkpointing_words(cfg: Config) -> str:
    policy = cfg.activation_checkpointing
    if policy.mode == "off":
        return "no checkpointing" + (", saved tensors offloaded" if policy.offload else "")
    scope = "" if policy.scope == "layer" else f" ({policy.scope})"
    return f"{policy.mode} checkpointing{scope}" + (", its inputs offloaded" if policy.offload else "")


def loss_words(cfg: Config) -> str:
    return f"chunks of {cfg.loss.chunk_tokens} tokens" if cfg.loss.chunked else "full logits"


def measured_rows(cfg: Config, step: StepMemory, exact_on_gpu: float) -> list[Row]:
    """The step's peak, in rows that add up to it: what was alive at the peak of forward and backward, then what
    the loss and the optimizer update reach above it (each only when it does)."""
    top = step.model
    tokens = f"micro-batch {cfg.data.micro_batch} x {cfg.data.context_length} tokens"
    rows = [Row("gathered parameters: unsharded layers and root, all-gather buffers (measured at the peak of "
                "forward and backward)", top.gathered, "measured")] if top.gathered else []
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


def gpu_rows(held: Held, cfg: Config, step: StepMemory) -> list[Row]:
    rows = [] if cfg.fsdp.cpu_offload else resident_rows(held, cfg)
    rows.append(Row("quantization state (whole, on every rank)", held.quant_state, "exact"))
    rows += measured_rows(cfg, step, sum(r.bytes for r in rows))
    if cfg.fsdp.cpu_offload:
        # on a GPU, FSDP2 copies a layer's host shards to the device before gathering them; on the CPU mesh the
        # step is measured on they already are there, so this transient is added: a conservative bound
        rows.append(Row("offloaded shards copied to the GPU to gather a layer (not in the measured step; added)",
                        held.layer_shard, "exact"))
    allocated = sum(r.bytes for r in rows)
    rows.append(Row("CUDA context and allocator slack", CUDA_CONTEXT_GIB * GIB + ALLOCATOR_SLACK * allocated,
                    "estimate"))
    return rows


def host_rows(held: Held, cfg: Config, step: StepMemory) -> list[Row]:
    ranks = cfg.hardware.gpus_per_node
    rows = [Row(f"{ranks} rank processes before loading", ranks * HOST_BASELINE_GIB * GIB, "estimate"),
            Row("loading: each rank's largest tensor read and quantized",
                ranks * 2 * held.largest_linear * TORCH_DTYPES[cfg.model.dtype].itemsize, "estimate")]
    if cfg.fsdp.cpu_offload:
        rows += [Row(f"offloaded {r.name}, {ranks} ranks", ranks * r.bytes, r.basis) for r in resident_rows(held, cfg)]
        rows.append(Row(f"offloaded LoRA gradients (shard, {cfg.lora.dtype}), {ranks} ranks", ranks * held.grads,
                        "exact"))
    if step.offloaded:
        rows.append(Row(f"activations offloaded to host memory (peak), {ranks} ranks", ranks * step.offloaded,
                        "measured"))
    return rows


def plan(cfg: Config, held: Held, step: StepMemory | None = None) -> Plan:
    """The plan for `cfg`, from the bytes its sharded model holds (or a config's with the same shapes) and its
    measured step (measured here unless given)."""
    cfg = planned_dtypes(cfg)
    step = step if step is not None else step_memory(cfg)
    n = held.base_parameters
    count = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    description = (f"{count} base parameters, world size {cfg.hardware.world_size}, weights {cfg.model.dtype}, "
                   f"4-bit compute {cfg.quant.compute_dtype}")
    return Plan(gpu_rows(held, cfg, step), host_rows(held, cfg, step), gpu_spec(cfg).memory_gib,
                cfg.hardware.host_ram_gib, description)


# ---- what to change when it does not fit --------------------------------------------------------------------

# selective checkpointing scopes, least recompute first: element-wise ops only, then attention (about a fifth of a
# Llama layer's matmul FLOPs), then the MLP, then the whole layer
SCOPES_BY_RECOMPUTE = ("ops", "attention", "mlp", "layer")


def memory_levers(cfg: Config) -> list[tuple[str, dict[str, object]]]:
    """The loss and activation levers, the ones that cost the least throughput first."""
    policy = cfg.activation_checkpointing
    changes: list[tuple[str, dict[str, object]]] = []
    if not cfg.loss.chunked:  # recomputes only the output layer, a chunk at a time
        changes.append(("loss.chunked=true", {"loss.chunked": True}))
    if policy.mode != "off" and not policy.offload:  # copies that overlap compute; nothing recomputed
        changes.append(("activation_checkpointing.offload=true (what checkpointing keeps waits in host memory)",
                        {"activation_checkpointing.offload": True}))
    current = SCOPES_BY_RECOMPUTE.index(policy.scope) if policy.mode == "every_layer" else -1
    for scope in SCOPES_BY_RECOMPUTE[current + 1:]:
        what = "every layer" if scope == "layer" else f"{'element-wise ops' if scope == 'ops' else scope} only"
        changes.append((f"activation_checkpointing.mode=every_layer activation_checkpointing.scope={scope} "
                        f"(recomputes {what})", {"activation_checkpointing.mode": "every_layer",
                                                 "activation_checkpointing.scope": scope}))
    return changes


def variants(cfg: Config, batch_from_target: bool = False) -> list[tuple[str, Config]]:
    """Changes that shrink the footprint, the ones that keep the most throughput first. With
    `batch_from_target` the recipe states an effective batch, so only the micro-batch is the user's to set."""
    changes = memory_levers(cfg)
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
        try:
            result = plan(changed, held if same_shapes else meta_held(changed, mesh))
        except ConfigError:  # a lever this architecture lacks (a sub-layer scope it has no module for)
            continue
        if result.fits:
            found.append(f"{label}: {result.gpu_total / GIB:.1f} GiB a GPU")
    return found


def format_rows(rows: list[Row]) -> list[str]:
    lines = ["| item | GiB | |", "| --- | ---: | --- |"]
    lines += [f"| {r.name} | {r.bytes / GIB:.2f} | {r.basis} |" for r in rows]
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


def _resolve_with_plans(cfg: Config, run_cfg: Config, held: Held, world_size: int) -> Config:
    return resolve_batch(cfg, world_size, micro_batch_fits(run_cfg, held))


def resolve_run_batch(cfg: Config, model: nn.Module, info: DistInfo) -> Config:
    """`resolve_batch` for a launched run: the planner measures the model this rank really holds. Its step is
    measured in a fake world of its own (one process start, every candidate micro-batch in it)."""
    run_cfg = dataclasses.replace(cfg, hardware=this_run_hardware(cfg, info))
    held = held_bytes(model, cfg)
    if cfg.data.micro_batch_size != "auto":  # nothing to size: no step to measure
        return resolve_batch(cfg, info.world_size)
    if in_real_world():
        return _in_fake_world(run_cfg, _resolve_with_plans, cfg, run_cfg, held, info.world_size)
    return _resolve_with_plans(cfg, run_cfg, held, info.world_size)


def report(cfg: Config) -> tuple[str, bool]:
    """The planner's table and verdict for a recipe; (text, fits)."""
    gpu_spec(cfg)  # a mistyped GPU name fails here, before the model is built
    cfg = planned_dtypes(cfg)
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
