"""The checks of tests/gpu_check.py, one function each, run one per process by it.

    python -m tests.gpu_check_cases fsdp_real_path --device cpu --work /tmp/gc   # one check, in the foreground

Any check runs on either device: on the CPU at small sizes (the CUDA-only ones too, which then only try their
code, without GPU figures). Prints a JSON list of table rows, or writes it to --result.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import io
import json
import math
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import bitsandbytes as bnb
import peft
import torch
import torch.distributed.fsdp  # noqa: F401  (registers torch.ops.fsdp.all_gather_copy_in)
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

import qlora_fsdp.loading.build
from qlora_fsdp.api import train
from qlora_fsdp.commands.generate import main as generate_main
from qlora_fsdp.config import Config, load_config, validate
from qlora_fsdp.data.batching import Batch, Sample, collate, collate_packed
from qlora_fsdp.distributed import DistInfo, cleanup, init_distributed, init_fake_distributed, local_shard
from qlora_fsdp.layers.attention import (
    VARLEN_SDPA,
    flash_attn_installed,
    flattens_packed_rows,
    packed_causal_mask,
    transformers_name,
    varlen_sdpa_forward,
)
from qlora_fsdp.loading.adapter import config_for_adapter
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.measure.held import Held, held_bytes
from qlora_fsdp.measure.planning import Planning
from qlora_fsdp.objectives.supervised import accumulate_gradients
from qlora_fsdp.optimizer import build_optimizer, clip_grad_norm
from qlora_fsdp.outputs.metrics import proc_status_bytes, reset_memory_peaks
from qlora_fsdp.plan.memory import Plan, format_rows, gpu_spec, plan
from qlora_fsdp.plan.time_report import recipe_time, step_tokens
from qlora_fsdp.run.accelerators import GPUS, detect_gpu
from qlora_fsdp.tools.adapter_merge import merge_adapter
from qlora_fsdp.tools.tiny_model import TinyModelSpec, write_tiny_model
from tests.gpu_check import Row
from tests.gpu_check_speed import training_speed as measure_training_speed

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
ARCH_70B = REPO / "model_configs" / "llama-3.1-70b" / "config.json"
ARCH_8B = REPO / "model_configs" / "llama-3.1-8b" / "config.json"
RECIPE_70B = "llama70b_2x4090"
MERGE_TOLERANCE = 1e-2  # bf16 output: one rounding step of a weight near 1 is 2**-7
PLAN_TOLERANCE = 0.15


@dataclass
class Context:
    device: torch.device
    work: Path

    @property
    def small(self) -> bool:
        """CPU: small sizes, so the dry run stays well under two minutes on two cores."""
        return self.device.type != "cuda"


# ---- shared helpers ---------------------------------------------------------------------------------------

def arch_dir(ctx: Context, layers: int | None, source: Path = ARCH_70B) -> Path:
    """A folder with the Llama 3.1 70B config.json (or `source`; fewer layers if asked); on the CPU, hidden,
    intermediate and vocab sizes / 32 and heads / 8, so the shape ratios (and GQA's query heads per KV head) stay."""
    config = json.loads(source.read_text())
    if layers is not None:
        config["num_hidden_layers"] = layers
    if ctx.small:
        for key in ("hidden_size", "intermediate_size", "vocab_size"):
            config[key] //= 32
        config["num_attention_heads"] //= 8
        config["num_key_value_heads"] //= 8
        config["bos_token_id"], config["eos_token_id"] = 1, 2  # inside the smaller vocabulary
    folder = ctx.work / f"{source.parent.name}-arch-{config['num_hidden_layers']}{'-small' if ctx.small else ''}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cap_gpu_memory(device: torch.device, gib: float) -> None:
    """Make this process see a `gib` GPU (a 24 GB card on an 80 GB H100): allocations past it raise OOM."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * GIB / total), device)


def gpu_memory(device: torch.device) -> dict[str, float]:
    """Peaks since the last reset; outside_allocator is what the process holds beyond the caching allocator
    (CUDA context, cuBLAS workspace), which the plan's context row estimates."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
            "outside_allocator_gib": (total - free - torch.cuda.memory_reserved(device)) / GIB}


def random_batches(cfg: Config, vocab: int, count: int, seed: int = 0) -> list[Batch]:
    """Micro-batches of random tokens filling the context, packed rows as the 70B recipes train on."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        shape = (cfg.data.micro_batch, cfg.data.context_length)
        rows = [[Sample(ids, ids)] for ids in torch.randint(vocab, shape, generator=generator).tolist()]
        batches.append(collate_packed(rows, pad_id=0))
    return batches


@dataclass
class StepTimes:
    seconds: list[float]
    losses: list[float]
    tokens_per_step: float

    def tokens_per_s(self) -> float:
        """After the first step (warm-up: kernels load, the optimizer state is created)."""
        timed = self.seconds[1:] or self.seconds
        return self.tokens_per_step * len(timed) / sum(timed)


def train_steps(model: peft.PeftModel, cfg: Config, info: DistInfo, steps: int) -> StepTimes:
    """Optimizer steps as the trainer takes them: accumulate, clip the global norm, step the local shards."""
    optimizer = build_optimizer(model, cfg.optim, cfg.lora)
    batches = random_batches(cfg, model.config.vocab_size, cfg.data.grad_accum_steps)
    model.train()
    times = StepTimes([], [], 0.0)
    forward_loss = ForwardLoss.for_config(cfg, info.device)  # the recipe's loss and activation offload
    for _ in range(steps):
        started = time.perf_counter()
        result = accumulate_gradients(model, batches, info.device, forward_loss)
        clip_grad_norm(model, cfg.optim.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        synchronize(info.device)
        times.seconds.append(time.perf_counter() - started)
        times.losses.append(result.loss)
        times.tokens_per_step = result.n_tokens
        print(f"step {len(times.seconds)}: {times.seconds[-1]:.1f} s, loss {result.loss:.4f}", flush=True)
    return times


# ---- 1. nan_canary ----------------------------------------------------------------------------------------

def copy_in(data: torch.Tensor, device: torch.device, world_size: int = 2, rank: int = 0) -> torch.Tensor:
    """This rank's part of an all-gather output after FSDP2's copy-in, the data split as two parameters."""
    source = data.to(device)
    inputs = list(source.chunk(2))
    output = torch.empty(world_size * source.numel(), dtype=source.dtype, device=device)
    part, _ = torch.ops.fsdp.all_gather_copy_in(inputs, output, [t.numel() for t in inputs], source.numel(), rank)
    return part.cpu()


def nan_canary(ctx: Context) -> list[Row]:
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    as_bf16, as_bytes = patterns.view(torch.bfloat16), patterns.view(torch.uint8)
    changed = copy_in(as_bf16, ctx.device).view(torch.int16) != patterns
    bytes_changed = int((copy_in(as_bytes, ctx.device) != as_bytes).sum())
    bf16_changed, nan_changed = int(changed.sum()), int((changed & as_bf16.isnan()).sum())
    figures = {"bf16_patterns_changed": bf16_changed, "of_them_nan": nan_changed,
               "bf16_nan_patterns": int(as_bf16.isnan().sum()), "uint8_bytes_changed": bytes_changed}
    result = (f"uint8 (our storage): {bytes_changed} of {as_bytes.numel():,} bytes changed; bf16 (the hazard): "
              f"{bf16_changed} of {patterns.numel():,} bit patterns changed, {nan_changed} of them NaNs")
    if ctx.small:  # positive control: the count a GPU shows, from CUDA's copy emulated
        with emulated_cuda_copy():
            emulated = copy_in(as_bf16, ctx.device).view(torch.int16) != patterns
        figures["emulated_cuda_bf16_changed"] = int(emulated.sum())
        result += f" ({figures['emulated_cuda_bf16_changed']} with CUDA's copy emulated)"
    return [Row("nan_canary", "passed" if bytes_changed == 0 else "failed", result, figures)]


# ---- 2. fsdp_real_path ------------------------------------------------------------------------------------

def storage_bits(tensor: torch.Tensor) -> torch.Tensor:
    """Elements as integers of their own width, so a comparison is bitwise (NaN == NaN, -0 != +0)."""
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.int16) if flat.element_size() == 2 else flat.view(torch.uint8)


class GatherWatch:
    """Forward pre-hooks on every Linear4bit: this rank's rows of the gathered packed weight (FSDP2 shards dim 0
    like torch.chunk, rank 0 holds the first chunk) against its shard as loaded. They fire in the forward and
    again in the backward's recompute, after its own all-gather."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.loaded: dict[nn.Module, torch.Tensor] = {}
        self.counts = {"gathers": 0, "not_gathered": 0, "bytes_compared": 0, "bytes_differing": 0,
                       "elements_differing": 0}
        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                self.loaded[module] = storage_bits(local_shard(module.weight)).to(device).clone()
                module.register_forward_pre_hook(self.compare)

    def compare(self, module: nn.Module, args: Any) -> None:
        assert isinstance(module, bnb.nn.Linear4bit), "hooked on Linear4bit modules only (__init__)"
        loaded, weight = self.loaded[module], module.weight
        if isinstance(weight, DTensor) or weight.numel() <= loaded.numel():  # FSDP2 did not gather it
            self.counts["not_gathered"] += 1
            return
        mine = storage_bits(weight)[: loaded.numel()]
        self.counts["gathers"] += 1
        self.counts["bytes_compared"] += loaded.numel() * loaded.element_size()
        self.counts["elements_differing"] += int((mine != loaded).sum())
        self.counts["bytes_differing"] += int((mine.view(torch.uint8) != loaded.view(torch.uint8)).sum())


def fsdp_path_config(arch: Path, offload: bool) -> Config:
    """bf16 LoRA, base and compute policy: under the old storage, every layer's all-gather was uniformly bf16."""
    cfg = Config()
    cfg.model.path, cfg.model.init, cfg.model.dtype = str(arch), "random", "bfloat16"
    cfg.lora.dtype, cfg.fsdp.param_dtype, cfg.fsdp.cpu_offload = "bfloat16", "bfloat16", offload
    return validate(cfg)


@contextlib.contextmanager
def quant_storage(dtype: torch.dtype) -> Iterator[None]:
    """The packed 4-bit dtype models are built with (loading follows the model module's constant)."""
    saved = qlora_fsdp.loading.build.QUANT_STORAGE
    qlora_fsdp.loading.build.QUANT_STORAGE = dtype
    try:
        yield
    finally:
        qlora_fsdp.loading.build.QUANT_STORAGE = saved


def gathered_bytes_case(ctx: Context, arch: Path, storage: torch.dtype, offload: bool,
                        emulate_cuda_copy: bool = False) -> dict[str, int]:
    """Build, shard (fake 2-rank group) and load the model; a forward and backward under the watch."""
    info = init_fake_distributed(2, ctx.device)
    try:
        with quant_storage(storage):
            cfg = fsdp_path_config(arch, offload)
            model = build_sharded_model(resolved(cfg, info), info)
        watch = GatherWatch(model, ctx.device)
        ids = torch.randint(model.config.vocab_size, (1, 16 if ctx.small else 128), device=ctx.device)
        with emulated_cuda_copy() if emulate_cuda_copy else contextlib.nullcontext():
            model(input_ids=ids, use_cache=False).logits.float().mean().backward()
        synchronize(ctx.device)
        counts = watch.counts
        del model, watch  # freed before the next case builds its model (the hooks make a cycle: gc below)
        return counts
    finally:
        cleanup()
        free_memory(ctx.device)


def emulated_cuda_copy() -> contextlib.AbstractContextManager[None]:
    """FSDP2's copy-in as CUDA sm80+ runs it (bf16 NaNs rewritten as 0x7FFF): the CPU's positive control."""
    from tests.cuda_copy import cuda_bf16_copy_emulated

    return cuda_bf16_copy_emulated()


def fsdp_real_path(ctx: Context) -> list[Row]:
    arch = arch_dir(ctx, layers=2)
    # on the CPU under CUDA's copy, emulated: what the check would see on a GPU
    uint8 = {offload: gathered_bytes_case(ctx, arch, torch.uint8, offload, emulate_cuda_copy=ctx.small)
             for offload in (False, True)}
    bf16 = {offload: gathered_bytes_case(ctx, arch, torch.bfloat16, offload) for offload in (False, True)}
    control = gathered_bytes_case(ctx, arch, torch.bfloat16, False, emulate_cuda_copy=True) if ctx.small else None
    ok = all(c["bytes_differing"] == 0 and c["gathers"] > 0 and c["not_gathered"] == 0 for c in uint8.values())
    ok = ok and (control is None or control["elements_differing"] > 0)  # the watch must see what it looks for
    figures = {f"uint8_{name}_{key}": c[key] for name, c in (("offload_off", uint8[False]), ("offload_on", uint8[True]))
               for key in ("gathers", "bytes_compared", "bytes_differing")}
    size = "70B architecture, 2 layers"
    size += "" if not ctx.small else " shrunk to hidden 256, CUDA's copy emulated"
    result = (f"uint8 storage ({size}; fake 2-rank group; bf16 LoRA, base and param_dtype): "
              f"{uint8[False]['bytes_differing']:,} of {uint8[False]['bytes_compared']:,} gathered bytes differ from "
              f"the loaded shard with offload off, {uint8[True]['bytes_differing']:,} of "
              f"{uint8[True]['bytes_compared']:,} with offload on")
    rows = [Row("fsdp_real_path", "passed" if ok else "failed", result, figures)]
    return rows + [old_storage_row(bf16, control)]


def old_storage_row(bf16: dict[bool, dict[str, int]], control: dict[str, int] | None) -> Row:
    figures = {f"bf16_offload_{'on' if offload else 'off'}_elements_changed": c["elements_differing"]
               for offload, c in bf16.items()}
    result = (f"old bf16 storage: {bf16[False]['elements_differing']:,} of {bf16[False]['bytes_compared'] // 2:,} "
              f"gathered elements changed with offload off, {bf16[True]['elements_differing']:,} with offload on")
    if control is not None:
        figures["emulated_cuda_copy_elements_changed"] = control["elements_differing"]
        result += (f"; with CUDA's copy emulated on the CPU {control['elements_differing']:,} "
                   "(the watch sees the hazard)")
    return Row("fsdp_real_path (old bf16 storage)", "info", result, figures)


# ---- 3. plan_vs_measured_70b ------------------------------------------------------------------------------

def recipe_70b(ctx: Context, world_size: int, accumulation: int) -> Config:
    """The 70B recipe with random weights from the shipped config.json (no download, no tokenizer needed)."""
    overrides = ["model.init=random", f"model.path={arch_dir(ctx, None if not ctx.small else 4)}",
                 f"hardware.gpus_per_node={world_size}", f"data.grad_accum_steps={accumulation}",
                 f"train.output_dir={ctx.work / 'unused-output'}"]
    if ctx.small:
        overrides.append("data.context_length=128")
    return load_config(RECIPE_70B, overrides)


def load_capped(cfg: Config, info: DistInfo) -> tuple[peft.PeftModel, dict[str, float]]:
    """The model built and loaded with the GPU capped at the recipe's memory (a 24 GB card on a bigger one);
    then the peaks are reset, so the figures that follow are the training steps'."""
    cap_gpu_memory(info.device, gpu_spec(cfg).memory_gib)
    started = time.perf_counter()
    model = build_sharded_model(resolved(cfg, info), info)
    figures = {"load_s": time.perf_counter() - started}
    if info.device.type == "cuda":
        figures["load_peak_reserved_gib"] = torch.cuda.max_memory_reserved(info.device) / GIB
    reset_memory_peaks(info.device)
    return model, figures


def plan_allocated(planned: Plan) -> float:
    """The plan's total without its CUDA-context-and-slack row: what the caching allocator should hold."""
    return sum(r.bytes for r in planned.gpu_rows if not r.name.lower().startswith("cuda context"))


def plan_vs_measured_70b(ctx: Context) -> list[Row]:
    cfg = recipe_70b(ctx, world_size=2, accumulation=2)
    info = init_fake_distributed(2, ctx.device)
    try:
        model, load = load_capped(cfg, info)
        planned = planned_for(cfg, held_bytes(model, cfg))
        print("\n".join(format_rows(planned.gpu_rows)), flush=True)
        times = train_steps(model, cfg, info, steps=2)
        measured = gpu_memory(ctx.device)
    finally:
        cleanup()
    # the loss means nothing here: in a fake group the other rank's half of every all-gather is left unset
    figures = {"plan_gib": planned.gpu_total / GIB, **measured, **load, "step_s": times.seconds[-1],
               "tokens_per_s_this_rank": times.tokens_per_s(), "host_peak_rss_gib": proc_status_bytes("VmHWM") / GIB}
    if not measured:
        return [Row("plan_vs_measured_70b", "passed", "CPU smoke run: the steps ran; no GPU figures", figures)]
    return [plan_row(planned, measured, figures)]


def plan_row(planned: Plan, measured: dict[str, float], figures: dict[str, Any]) -> Row:
    total = measured["peak_reserved_gib"] + measured["outside_allocator_gib"]  # what the plan's total counts
    ratio = total * GIB / planned.gpu_total
    ratio_allocated = measured["peak_allocated_gib"] * GIB / plan_allocated(planned)
    figures.update(measured_total_gib=total, ratio=ratio, ratio_allocated=ratio_allocated)
    within_cap = measured["peak_reserved_gib"] <= planned.capacity_gib
    ok = within_cap and abs(ratio - 1) <= PLAN_TOLERANCE
    result = (f"rank 0 of 2, GPU capped at {planned.capacity_gib:g} GiB: measured {total:.2f} GiB (peak reserved "
              f"{measured['peak_reserved_gib']:.2f} + {measured['outside_allocator_gib']:.2f} outside the allocator; "
              f"peak allocated {measured['peak_allocated_gib']:.2f}) against the plan's "
              f"{planned.gpu_total / GIB:.2f} GiB: ratio {ratio:.2f} (allocated {ratio_allocated:.2f})")
    if not ok:
        result += "; over the cap" if not within_cap else f"; more than {PLAN_TOLERANCE:.0%} off the plan"
    return Row("plan_vs_measured_70b", "passed" if ok else "failed", result, figures)


# ---- 4. one_gpu_70b_offload -------------------------------------------------------------------------------

def one_gpu_70b_offload(ctx: Context) -> list[Row]:
    cfg = recipe_70b(ctx, world_size=1, accumulation=1)
    info = init_distributed()  # a world of one, as `python train.py` on one GPU makes it
    try:
        model, load = load_capped(cfg, info)
        planned = planned_for(cfg, held_bytes(model, cfg))
        times = train_steps(model, cfg, info, steps=2 if ctx.small else 3)
        measured = gpu_memory(ctx.device)
    finally:
        cleanup()
    figures = {**measured, "host_peak_rss_gib": proc_status_bytes("VmHWM") / GIB, "tokens_per_s": times.tokens_per_s(),
               **load, "loss_first": times.losses[0], "loss_last": times.losses[-1],
               "plan_gib": planned.gpu_total / GIB, "plan_host_gib": planned.host_total / GIB}
    finite = all(math.isfinite(loss) for loss in times.losses)
    within_cap = not measured or measured["peak_reserved_gib"] <= planned.capacity_gib
    tokens = int(times.tokens_per_step)
    result = (f"world size 1, CPU offload, {len(times.seconds)} steps of {tokens:,} tokens: "
              f"{times.tokens_per_s():,.0f} tokens/s, host RSS peak {figures['host_peak_rss_gib']:.1f} GiB")
    if measured:
        result += (f", GPU peak allocated {measured['peak_allocated_gib']:.2f} / reserved "
                   f"{measured['peak_reserved_gib']:.2f} GiB (capped at {planned.capacity_gib:g}; plan "
                   f"{planned.gpu_total / GIB:.2f})")
    if not finite:
        result += "; a loss was not finite"
    return [Row("one_gpu_70b_offload", "passed" if finite and within_cap else "failed", result, figures)]


# ---- 5. memory_levers -------------------------------------------------------------------------------------

# (label, overrides): each lever against the recipe's default (chunked loss, every layer checkpointed)
DEFAULT_LEVER = "chunked loss (default)"
LEVERS = [
    ("full logits", ["loss.chunked=false"]),
    (DEFAULT_LEVER, []),
    ("+ activation offload", ["activation_checkpointing.offload=true"]),
    ("selective: per operator", ["activation_checkpointing.scope=ops"]),
    ("selective: MLP only", ["activation_checkpointing.scope=mlp"]),
    ("no checkpointing", ["activation_checkpointing.mode='off'"]),
    # not memory levers: the LoRA matmuls in fp32 instead of bf16, and PEFT's forward instead of the fused one,
    # at the 70B's layer shapes (their step time; the same loss in fp32, as on the CPU dry run)
    ("LoRA matmuls in fp32", ["lora.compute_dtype=weights"]),
    ("PEFT's LoRA forward (unfused, fp32)", ["lora.fuse_projections=false", "lora.compute_dtype=weights"]),
]


def lever_config(ctx: Context, overrides: list[str]) -> Config:
    """The 70B's layer shapes and vocabulary at one GPU (no parameter offload), 2 layers, a long row."""
    context = 256 if ctx.small else 8192
    return load_config("llama70b_1x4090", ["model.init=random", f"model.path={arch_dir(ctx, 2)}",
                                            "fsdp.cpu_offload=false", f"data.context_length={context}",
                                            "data.micro_batch_size=1", "data.grad_accum_steps=1",
                                            f"train.output_dir={ctx.work / 'unused-output'}", *overrides])


def lever_row(ctx: Context, label: str, overrides: list[str]) -> dict[str, Any]:
    cfg = lever_config(ctx, overrides)
    info = init_distributed()
    model = None  # freed in `finally` even when building it fails
    try:
        model = build_sharded_model(resolved(cfg, info), info)
        reset_memory_peaks(info.device)
        times = train_steps(model, cfg, info, steps=2)
        measured = gpu_memory(ctx.device)
        # the planner's peak and tokens/s for the same setting on this GPU (its measured step runs in a child
        # process); on the CPU one setting, priced on the recipe's GPU, so that the dry run runs this path
        if measured or label == DEFAULT_LEVER:
            gpu = detect_gpu(ctx.device) or cfg.hardware.gpu
            on_gpu = dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, gpu=gpu))
            planned_run = planned_for(on_gpu, held_bytes(model, cfg))
            predicted = predicted_tokens_per_s(on_gpu, planned_run)
            measured.update(predicted_tokens_per_s=predicted, predicted_on=gpu)
        if "peak_allocated_gib" in measured:
            planned = plan_allocated(planned_run) / GIB
            measured.update(plan_allocated_gib=planned, ratio=measured["peak_allocated_gib"] / planned)
    finally:
        del model
        cleanup()
        free_memory(ctx.device)
    return {"lever": label, "tokens_per_s": times.tokens_per_s(), "loss": times.losses[-1], **measured}


def planned_for(cfg: Config, held: Held) -> Plan:
    """The plan of `cfg` as written (its dtypes resolved for its hardware.gpu), over the bytes a built model holds."""
    planning = Planning.of(cfg)
    return plan(planning, planning.cfg, held)


def predicted_tokens_per_s(cfg: Config, planned: Plan) -> float | None:
    """The step-time model's tokens/s for `cfg` on its hardware.gpu (none for a GPU missing from the table)."""
    if cfg.hardware.gpu not in GPUS or planned.step is None:
        return None
    planning = Planning.of(cfg)
    return step_tokens(planning.cfg) / recipe_time(planning, planning.cfg, planned.step).total


def memory_levers(ctx: Context) -> list[Row]:
    """What each memory lever saves on the device, and what it costs in tokens/s, measured one after another."""
    results = [lever_row(ctx, label, overrides) for label, overrides in LEVERS]
    for result in results:
        print(json.dumps(result), flush=True)
    if ctx.device.type != "cuda":
        default = next(r for r in results if r["lever"] == DEFAULT_LEVER)
        priced = default.get("predicted_tokens_per_s") is not None
        return [Row("memory_levers", "passed" if priced else "failed",
                    f"CPU smoke run: {len(results)} settings trained two steps each; the default setting priced at "
                    f"{default.get('predicted_tokens_per_s') or 0:,.0f} tokens/s on {default.get('predicted_on')}; "
                    "no GPU figures", {"settings": results})]
    rows = []
    for result in results:
        figures = {k: v for k, v in result.items() if k != "lever"}
        predicted = result.get("predicted_tokens_per_s")
        speed = f", predicted {predicted:,.0f} on {result['predicted_on']}" if predicted else ""
        rows.append(Row(f"memory_levers: {result['lever']}", "info",
                        f"peak allocated {result['peak_allocated_gib']:.2f} GiB (plan "
                        f"{result['plan_allocated_gib']:.2f}, "
                        f"ratio {result['ratio']:.2f}), {result['tokens_per_s']:,.0f} tokens/s{speed}", figures))
    return rows


# ---- 6. merge_device and 7. generate: a tiny adapter trained by the repo ---------------------------------

def tiny_model(ctx: Context) -> Path:
    """The tests' tiny Llama (2 layers, hidden 128, seeded), built as `make tiny-model` builds its own."""
    out = ctx.work / "tiny-llama"
    if not (out / "config.json").is_file():
        write_tiny_model(out, REPO / "data" / "tiny_instruct.jsonl", TinyModelSpec(hidden_size=128, layers=2))
    return out


def tiny_adapter(ctx: Context) -> Path:
    """Two steps of the tiny_cpu recipe on a world of one (on this device), trained once per work folder."""
    run = ctx.work / "tiny-run"
    if not (run / "adapter" / "adapter_config.json").is_file():
        train("tiny_cpu", [f"model.path={tiny_model(ctx)}", f"train.output_dir={run}", "train.max_steps=2",
                           "train.eval_every=0", "data.eval_samples=8", "logging.plot=false", "train.overwrite=true"])
        cleanup()  # the next user of this process makes its own group
    return run / "adapter"


def merged_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def timed_merge(cfg: Config, adapter: Path, out: Path, device: str) -> float:
    started = time.perf_counter()
    merge_adapter(cfg, adapter, out, device=device)
    return time.perf_counter() - started


def merge_device(ctx: Context) -> list[Row]:
    adapter = tiny_adapter(ctx)
    cfg = config_for_adapter(adapter, None, [])
    cpu_s = timed_merge(cfg, adapter, ctx.work / "merged-cpu", "cpu")
    cpu = merged_tensors(ctx.work / "merged-cpu")
    rows = [Row("merge_device (cpu)", "passed", f"{len(cpu)} tensors merged on the CPU (bf16)",
                {"tensors": len(cpu), "cpu_s": cpu_s})]
    if ctx.device.type != "cuda":
        return rows + [Row("merge_device (cuda vs cpu)", "skipped", "no CUDA device: only the CPU merge ran")]
    cuda_s = timed_merge(cfg, adapter, ctx.work / "merged-cuda", "cuda")
    return rows + [merge_comparison(cpu, merged_tensors(ctx.work / "merged-cuda"), cuda_s)]


def merge_comparison(cpu: dict[str, torch.Tensor], cuda: dict[str, torch.Tensor], cuda_s: float) -> Row:
    if cpu.keys() != cuda.keys():
        return Row("merge_device (cuda vs cpu)", "failed", f"different tensors: {sorted(cpu.keys() ^ cuda.keys())[:3]}")
    diffs = {k: (cpu[k].float() - cuda[k].float()).abs() for k in cpu}
    worst = max(diffs, key=lambda k: float(diffs[k].max()))
    max_diff = float(diffs[worst].max())
    figures = {"max_abs_diff": max_diff, "elements_differing": sum(int((d > 0).sum()) for d in diffs.values()),
               "elements": sum(d.numel() for d in diffs.values()), "cuda_s": cuda_s}
    result = f"--device cuda against --device cpu: max abs difference {max_diff:.3g} ({worst})"
    return Row("merge_device (cuda vs cpu)", "passed" if max_diff <= MERGE_TOLERANCE else "failed", result, figures)


def command_output(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str]:
    """A command's main in this process (no second start-up of torch); its exit code and stdout. The main, not
    scripts/generate.py's entry: that one ends its process with os._exit, and this check's result with it."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            code = main(argv)
    except SystemExit as stop:  # argparse's own errors
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    print(buffer.getvalue(), flush=True)
    return code, buffer.getvalue()


def generate(ctx: Context) -> list[Row]:
    adapter = tiny_adapter(ctx)
    argv = ["--adapter", str(adapter), "--prompt", "Reverse the letters of the word.", "--input", "river",
            "--max-new-tokens", "16"]
    started = time.perf_counter()
    code, text = command_output(generate_main, argv)
    figures = {"device": ctx.device.type, "characters": len(text.strip()), "seconds": time.perf_counter() - started}
    ok = code == 0 and bool(text.strip())
    shown = " ".join(text.split()).encode("ascii", "replace").decode()[:40]  # a random tiny model prints byte soup
    result = f"generate's main (--adapter: tiny, 2 steps) printed '{shown}'" if ok else f"exit code {code}, no text"
    return [Row("generate", "passed" if ok else "failed", result, figures)]


# ---- 8. packed_attention: every attention kernel keeps packed samples apart, and what per-sample saves ---------

def attention_kernels(device: torch.device) -> list[str]:
    """The kernels a packed run can use here: flash-attn only where installed, flex only on CUDA (no CPU backward)."""
    kernels = ["sdpa", VARLEN_SDPA]
    if device.type == "cuda":
        kernels.append("flex_attention")
        if flash_attn_installed():
            kernels.append("flash_attention_2")
    return kernels


def token_losses(model: torch.nn.Module, batch: Batch, device: torch.device, one_row: bool) -> torch.Tensor:
    with torch.no_grad():
        logits = model(**batch.model_inputs(device, one_row)).logits.float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.to(device).flatten(),
                                             reduction="none").view(batch.labels.shape)


def packed_vs_alone(ctx: Context, kernel: str, samples: list[Sample]) -> Row:
    """Each sample's per-token losses in two packed rows against the sample alone (bf16 where flash needs it)."""
    dtype = torch.bfloat16 if kernel == "flash_attention_2" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(tiny_model(ctx), dtype=dtype, device_map={"": ctx.device},
                                                 attn_implementation=transformers_name(kernel))  # as runs do
    packed = token_losses(model, collate_packed([samples[:3], samples[3:]], pad_id=0), ctx.device,
                          flattens_packed_rows(kernel))
    worst, row, start = 0.0, 0, 0
    for index, sample in enumerate(samples):
        if index == 3:
            row, start = 1, 0
        n = len(sample.input_ids)
        alone = token_losses(model, collate([sample], pad_id=0), ctx.device, False)[0, :n]
        worst = max(worst, float((packed[row, start : start + n] - alone).abs().max()))
        start += n
    tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-4
    status = "passed" if worst <= tolerance else "failed"
    return Row(f"packed_attention ({kernel})", status, f"packed = alone, max |loss difference| {worst:.1e} "
               f"(bound {tolerance:.0e})", {"kernel": kernel, "max_difference": worst})


def per_sample_speed(ctx: Context) -> Row:
    """Forward + backward of one packed row's attention, dense block-diagonal mask against per sample."""
    tokens = 1024 if ctx.small else 4096
    lengths = [int(x) for x in torch.randint(32, 600, (64,), generator=torch.Generator().manual_seed(0))]
    positions = torch.cat([torch.arange(n) for n in lengths])[:tokens][None].to(ctx.device)
    query = torch.randn(1, 8, tokens, 64, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
    key, value = (torch.randn(1, 2, tokens, 64, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(2))
    mask = packed_causal_mask(positions)

    def dense() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                                enable_gqa=True).transpose(1, 2)

    def varlen() -> torch.Tensor:
        return varlen_sdpa_forward(torch.nn.Module(), query, key, value, None, position_ids=positions)[0]

    seconds = {}
    for name, kernel in (("dense", dense), ("per_sample", varlen)):
        kernel().float().sum().backward()  # warm-up
        synchronize(ctx.device)
        started = time.perf_counter()
        for _ in range(5):
            kernel().float().sum().backward()
        synchronize(ctx.device)
        seconds[name] = (time.perf_counter() - started) / 5
    ratio = seconds["dense"] / seconds["per_sample"]
    n_samples = int((positions == 0).sum())
    return Row("packed_attention (speed)", "info", f"{tokens} tokens, {n_samples} samples: dense mask "
               f"{seconds['dense'] * 1e3:.1f} ms, per sample {seconds['per_sample'] * 1e3:.1f} ms ({ratio:.2f}x)",
               {"tokens": tokens, **seconds})


def packed_attention(ctx: Context) -> list[Row]:
    texts = ["The cat sat on the mat.", "Reverse the letters: stone", "A much longer sample " * 6, "Count: 1 2 3",
             "Another sample, in the second row " * 3]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model(ctx))
    samples = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        samples.append(Sample(ids, ids))
    rows = [packed_vs_alone(ctx, kernel, samples) for kernel in attention_kernels(ctx.device)]
    return [*rows, per_sample_speed(ctx)]


# ---- mixture-of-experts layer ---------------------------------------------------------------------------------

def moe_experts(ctx: Context) -> list[Row]:
    """benchmarks/moe_experts.py's four ways through one layer's experts: Qwen3-30B-A3B's on a GPU (128 experts,
    top-8, 2,048 tokens, bf16), the CPU benchmark's sizes on a CPU."""
    from benchmarks.moe_experts import measure_all, parse_args

    cuda = ctx.device.type == "cuda"
    sizes = ["--experts", "128", "--top-k", "8", "--hidden", "2048", "--intermediate", "768", "--dtype", "bfloat16"]
    args = parse_args([*(sizes if cuda else ["--tokens", "256", "--repeats", "2"]), "--device", str(ctx.device)])
    setting, results = measure_all(args)
    short = ["unquantized", "4-bit, gather per expert", "4-bit, grouped (ours)", "4-bit, grouped matmul"]
    return [Row(f"moe_experts ({label})", "info", f"{row['tokens_per_s']:,.0f} tokens/s ({row['ratio']:.2f}x "
                f"transformers' unquantized), peak {row['peak_gib']:.2f} GiB; {setting}", row)
            for label, row in zip(short, results, strict=True)]


# ---- long_rows: the largest row the one-GPU long recipes train in 24 GiB, each against its plan ----------------

# recipe -> (its architecture's config.json, rows tried on a GPU): a dense Llama and a windowed family (gpt-oss:
# sliding windows of 128, attention sinks, a mixture of experts)
LONG_ROW_RECIPES = {
    "llama3_8b_1x4090_long": (ARCH_8B, (65536, 98304, 131072, 163840, 196608)),
    "gpt_oss_20b_1x24gb_long": (REPO / "model_configs" / "gpt-oss-20b" / "config.json", (65536, 98304, 131072)),
}
LONG_ROW_PLAN_TOLERANCE = 0.10


def long_row_arch(ctx: Context, source: Path) -> Path:
    """2 layers of the recipe's model (one sliding, one full for a windowed family), random weights: what a layer
    holds is what limits a row (weights and layer inputs wait in host RAM or stay put), so 2 layers peak where all
    do, plus the gathers of the next layer. gpt-oss's MXFP4 checkpoint form is not the random build's."""
    folder = arch_dir(ctx, 2, source)
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:2]
    if ctx.small and config.get("model_type") == "gpt_oss":
        config["num_local_experts"], config["experts_per_token"], config["pad_token_id"] = 4, 2, 0
        config["hidden_size"] = config["intermediate_size"] = 128  # 2880 / 32 is no multiple of the 4-bit block
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def long_row_config(ctx: Context, recipe: str, tokens: int) -> Config:
    """The long recipe's levers (offload, tiled MLP and attention side, chunked loss) at its model's layer shapes."""
    tiles = ["activation_checkpointing.mlp_tile_tokens=64", "activation_checkpointing.attention_tile_tokens=64"]
    arch = long_row_arch(ctx, LONG_ROW_RECIPES[recipe][0])
    return load_config(recipe, ["model.init=random", f"model.path={arch}", f"data.context_length={tokens}",
                                "data.grad_accum_steps=1", f"train.output_dir={ctx.work / 'unused-output'}",
                                *(tiles if ctx.small else [])])


def long_row(ctx: Context, recipe: str, tokens: int) -> dict[str, Any]:
    """One optimizer step on a row of `tokens` with the GPU capped at the recipe's memory: its peak and the plan's,
    or the OOM."""
    cfg = long_row_config(ctx, recipe, tokens)
    info = init_distributed()
    model = None  # freed in `finally` even when building it fails
    try:
        cap_gpu_memory(ctx.device, gpu_spec(cfg).memory_gib)
        model = build_sharded_model(resolved(cfg, info), info)
        reset_memory_peaks(info.device)
        times = train_steps(model, cfg, info, steps=1)
        measured = {"recipe": recipe, "tokens": tokens, "trained": True, "tokens_per_s": times.tokens_per_s(),
                    "loss": times.losses[-1], **gpu_memory(ctx.device)}
        if ctx.device.type == "cuda":  # the plan of this very setting (memory_levers' dry run covers plan() on CPU)
            measured["plan_allocated_gib"] = plan_allocated(planned_for(cfg, held_bytes(model, cfg))) / GIB
        return measured
    except torch.OutOfMemoryError:
        return {"recipe": recipe, "tokens": tokens, "trained": False}
    finally:
        del model
        cleanup()
        free_memory(ctx.device)


def long_rows_of(ctx: Context, recipe: str) -> Row:
    """Rows of growing length until one does not fit: the largest that trains, and every trained row's measured
    peak against its plan (within 10%, or the check fails)."""
    results = []
    for tokens in (256, 512) if ctx.small else LONG_ROW_RECIPES[recipe][1]:
        results.append(long_row(ctx, recipe, tokens))
        print(json.dumps(results[-1]), flush=True)
        if not results[-1]["trained"]:
            break
    trained = [r for r in results if r["trained"]]
    name = f"long_rows ({recipe})"
    if ctx.device.type != "cuda":
        ok = len(trained) == len(results) and all(math.isfinite(r["loss"]) for r in trained)
        rows = ", ".join(str(r["tokens"]) for r in results)
        return Row(name, "passed" if ok else "failed", f"CPU smoke run: rows of {rows} tokens trained a step each "
                   f"with {recipe}'s levers; no GPU figures", {"rows": results})
    if not trained:
        return Row(name, "failed", f"no row of {results[0]['tokens']:,} tokens or more trained in 24 GiB",
                   {"rows": results})
    off = [r for r in trained if abs(r["plan_allocated_gib"] / r["peak_allocated_gib"] - 1) > LONG_ROW_PLAN_TOLERANCE]
    best = trained[-1]
    return Row(name, "failed" if off else "passed",
               f"largest row trained in 24 GiB: {best['tokens']:,} tokens (2 layers), peak allocated "
               f"{best['peak_allocated_gib']:.2f} GiB, plan {best['plan_allocated_gib']:.2f}"
               f"{'; plan off by more than 10% at ' + ', '.join(str(r['tokens']) for r in off) if off else ''}, "
               f"{best['tokens_per_s']:,.0f} tokens/s", {"rows": results})


def long_rows(ctx: Context) -> list[Row]:
    return [long_rows_of(ctx, recipe) for recipe in LONG_ROW_RECIPES]


# ---- grpo_generation: GRPO's decoding speed against transformers' generate, first (gpu-check-quick) -----------

def grpo_generation(ctx: Context) -> list[Row]:
    """benchmarks/grpo_generation.py at Llama 3.2 1B's shapes: 32 rows (the gathered layout with and without CUDA
    graphs) and 128 rows, each with the fused kernels and without, against transformers' generate and beside the
    plan and the bandwidth bound; a fused run passes when the plan is within 25% of its step. On a CPU the tiny
    shapes, a few tokens, bitsandbytes' path (the interpreter's kernels are the test suite's)."""
    from benchmarks.grpo_generation import measure, parse_args, report
    from qlora_fsdp.run.accelerators import detect_gpu

    gpu = detect_gpu(ctx.device) if ctx.device.type == "cuda" else None
    common = ["--work", str(ctx.work / "grpo-generation"), "--device", ctx.device.type]
    runs = [["--arch", "llama-1b", "--rows", "32", "--new-tokens", "128", "--prompt-tokens", "128", "--graphs", "both",
             "--kernels", "both"],
            ["--arch", "llama-1b", "--rows", "128", "--new-tokens", "128", "--prompt-tokens", "128", "--kernels",
             "both"]] if gpu else [["--arch", "tiny", "--rows", "8", "--new-tokens", "8", "--graphs", "both"]]
    rows = []
    for argv in runs:
        measured = measure(parse_args([*common, *argv, *(["--plan-on", gpu] if gpu else [])]))
        cleanup()
        assert measured is not None and measured.theirs is not None
        print(report(measured), flush=True)
        rows += [generation_row(name, timed, measured, argv) for name, timed in measured.mine.items()]
    return rows


def generation_row(name: str, timed: Any, measured: Any, argv: list[str]) -> Row:
    ratio = timed.rate / measured.theirs.rate
    planned = measured.predictions.get(name, (float("nan"), ""))[0] * 1e3
    bound = measured.measured_bound_ms or measured.bound_ms or float("nan")
    figures = {"tokens_per_s": timed.rate, "transformers_tokens_per_s": measured.theirs.rate, "ratio": ratio,
               "step_ms": timed.step_ms, "planned_step_ms": planned, "bound_ms": measured.bound_ms,
               "measured_bound_ms": measured.measured_bound_ms, "peak_gib": timed.peak_gib, "argv": argv}
    fused = name.endswith(":fused") and not math.isnan(planned)
    status = ("passed" if abs(planned / timed.step_ms - 1) <= 0.25 else "failed") if fused else "info"
    return Row(f"grpo_generation ({argv[3]} rows, {name})", status,
               f"{timed.rate:,.0f} tokens/s, {ratio:.2f}x transformers' generate ({measured.theirs.rate:,.0f}); a "
               f"decoding step {timed.step_ms:.1f} ms, planned {planned:.1f}, {timed.step_ms / bound:.1f}x the "
               f"bandwidth bound ({bound:.2f} ms)", figures)


# ---- entry --------------------------------------------------------------------------------------------------

# ---- training_speed: one GPU, train.py beside transformers' Trainer (tests/gpu_check_speed.py) ----------------

def training_speed(ctx: Context) -> list[Row]:
    return measure_training_speed(ctx, arch_dir(ctx, None, ARCH_8B))


# ---- export_rounding: export.target's rounding on the device, against the CPU's -------------------------------

def timed_ms(device: torch.device, work: Callable[[], object], repeats: int = 3) -> float:
    work()  # warm: kernels compiled, the allocator's blocks cut
    synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        work()
    synchronize(device)
    return (time.perf_counter() - started) / repeats * 1e3


def export_rounding(ctx: Context) -> list[Row]:
    """Each llama.cpp type's rounding (gguf_target/quantizers.py) of a 4096 x 4096 weight (448 x 512 on the CPU) on
    the device, bit for bit against the CPU's, which tests/test_export_target.py holds to llama.cpp's library: CUDA's
    division and the absence of fused multiply-adds across torch's element-wise kernels decide it; and the
    kernels of kernels/export_rounding.py (the rounding: a bf16 base + s B A in, the bf16 weight out; the k-quants'
    block search: the stored steps), bit for bit against the same. Their milliseconds: the rounding with searched
    steps in torch and in the kernel (every forward of export.target), the block search in torch and in its kernel
    (once an optimizer step), the bf16 matmul of 8,192 tokens by that weight."""
    from qlora_fsdp.gguf_target.quantizers import TYPES, block_steps, candidate_numerators, empty_steps, rounded
    from qlora_fsdp.kernels.export_rounding import available, export_rounded, export_searched, search_in_kernel

    rows, cols = (448, 512) if ctx.small else (4096, 4096)
    base = (0.02 * torch.randn(rows, cols)).bfloat16()  # a dequantized 4-bit base, as training hands it over
    product = 1e-3 * torch.randn(rows, cols)  # B A
    weight = (base.float() + product).half().float()  # the converter's f16 values of the merge
    on_device, base_on, product_on = weight.to(ctx.device), base.to(ctx.device), product.to(ctx.device)
    kernel = available(on_device.device)
    figures: dict[str, Any] = {"shape": [rows, cols], "kernel": kernel}
    differing = []
    for ggml_type in TYPES:
        cpu_steps = block_steps(weight, ggml_type)
        expected = rounded(weight, ggml_type, cpu_steps)
        steps = block_steps(on_device, ggml_type)
        equal = torch.equal(rounded(on_device, ggml_type, steps).cpu(), expected)
        differing += [] if equal else [ggml_type]
        rounding = functools.partial(rounded, on_device, ggml_type, steps)
        search = functools.partial(block_steps, on_device, ggml_type)
        figures[ggml_type] = {"equal": equal, "round_ms": timed_ms(ctx.device, rounding),
                              "search_ms": timed_ms(ctx.device, search, 1)}
        if kernel:
            out = torch.empty(rows, cols, dtype=torch.bfloat16, device=ctx.device)
            fused = functools.partial(export_rounded, out, base_on, product_on, 1.0, ggml_type,
                                      [s.to(ctx.device) for s in cpu_steps or ()])
            fused()
            kernel_equal = torch.equal(out.cpu(), expected.bfloat16())
            differing += [] if kernel_equal else [f"{ggml_type} kernel"]
            figures[ggml_type] |= {"kernel_equal": kernel_equal, "kernel_ms": timed_ms(ctx.device, fused)}
        if kernel and cpu_steps is not None and search_in_kernel():  # the search's kernel (not interpreted: slow)
            searched = empty_steps(on_device, ggml_type)
            kernel_search = functools.partial(export_searched, list(searched), on_device,
                                              candidate_numerators(ggml_type), ggml_type)
            kernel_search()
            search_equal = all(torch.equal(a.cpu(), b) for a, b in zip(searched, cpu_steps, strict=True))
            differing += [] if search_equal else [f"{ggml_type} search kernel"]
            figures[ggml_type] |= {"search_kernel_equal": search_equal,
                                   "search_kernel_ms": timed_ms(ctx.device, kernel_search, 1)}
    x = torch.randn(8192 if not ctx.small else 256, cols, device=ctx.device, dtype=torch.bfloat16)
    figures["matmul_ms"] = timed_ms(ctx.device, lambda: x @ on_device.to(torch.bfloat16).t())
    q4k = figures["q4_K"]
    result = (f"{len(TYPES) - len(differing)} of {len(TYPES)} types bit-equal to the CPU's"
              + (f" (differing: {', '.join(differing)})" if differing else "")
              + f"; q4_K {q4k['round_ms']:.1f} ms a rounding in torch"
              + (f", {q4k['kernel_ms']:.2f} ms in the kernel" if kernel else ", the kernel not run here")
              + f", {q4k['search_ms']:.1f} ms a search"
              + (f" ({q4k['search_kernel_ms']:.2f} ms in its kernel)" if "search_kernel_ms" in q4k else "")
              + f", against {figures['matmul_ms']:.2f} ms for the matmul")
    return [Row("export_rounding", "failed" if differing else "passed", result, figures)]


CASES: dict[str, Callable[[Context], list[Row]]] = {
    "nan_canary": nan_canary, "fsdp_real_path": fsdp_real_path, "plan_vs_measured_70b": plan_vs_measured_70b,
    "one_gpu_70b_offload": one_gpu_70b_offload, "memory_levers": memory_levers, "merge_device": merge_device,
    "generate": generate, "packed_attention": packed_attention, "moe_experts": moe_experts, "long_rows": long_rows,
    "grpo_generation": grpo_generation, "training_speed": training_speed, "export_rounding": export_rounding}


def environment(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = f"{torch.cuda.get_device_name(device)} (sm{major}{minor})"
    else:
        name = f"CPU ({torch.get_num_threads()} threads)"
    return {"device_name": name, "torch": torch.__version__, "bitsandbytes": bnb.__version__}


def run_case(name: str, ctx: Context) -> list[Row]:
    try:
        return CASES[name](ctx)
    except Exception as err:  # an OOM or a bug: this check fails, the others still run
        traceback.print_exc()
        first = (str(err).strip().splitlines() or [""])[0][:200]
        return [Row(name, "failed", f"{type(err).__name__}: {first}")]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=sorted(CASES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--work", type=Path, required=True, help="a folder for models, adapters and results")
    parser.add_argument("--result", type=Path, help="write the rows here (JSON); default: print them")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    rows = run_case(args.name, Context(device, args.work))
    payload = json.dumps({"rows": [asdict(r) for r in rows], "env": environment(device)}, indent=2, default=str)
    if args.result:
        args.result.write_text(payload)
    else:
        print(payload)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def resolved(cfg: Config, info: DistInfo) -> Config:
    """The recipe's `auto` dtypes for this GPU, as a run resolves them (build_sharded_model takes them resolved)."""
    from qlora_fsdp.precision import describe_device
    from qlora_fsdp.run.description import describe_run

    return describe_run(cfg, describe_device(info.device)).cfg
