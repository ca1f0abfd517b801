"""Fill a meta-built (and possibly FSDP2-sharded) model from safetensors, one tensor at a time.

Each linear weight is read whole and quantized to NF4 on the compute device (its quantization state
covers the whole tensor); a rank keeps only its dim-0 chunk of the packed bytes (exactly FSDP2's
`torch.chunk` shard) and frees the rest before the next tensor. Other weights (embeddings, norms,
lm_head) are read only for the rows this rank keeps. A mixture of experts' experts are read one expert at
a time, and only by the rank that keeps that expert. The checkpoint's stored forms are read by loading/reader.py,
which merge uses too. Peak host memory per rank: its shards plus
one full tensor, never the whole model or the whole quantized model.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import torch
from torch import nn

from qlora_fsdp.config import Config
from qlora_fsdp.distributed import local_shard
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.errors import ModelLoadError
from qlora_fsdp.layers.experts4bit import EXPERT_MATRICES, ExpertMatrix, Experts4bit
from qlora_fsdp.layers.lora_math import dora_magnitude
from qlora_fsdp.loading.checkpoint import model_dir
from qlora_fsdp.loading.initial_adapter import initialized, lora_layer_of, start_of
from qlora_fsdp.loading.layout import CheckpointLayout, persistent_buffers
from qlora_fsdp.loading.names import REWARD_HEAD_KEY, clean_name, is_lora_tensor, weight_key
from qlora_fsdp.loading.nf4 import quantize
from qlora_fsdp.loading.placement import copy_full_into, copy_rows_into, shard_row_range
from qlora_fsdp.loading.reader import CheckpointReader, Experts, FourBit, ModelShapes, Piece, Plain
from qlora_fsdp.loading.weight_files import InMemoryTensor, StoredTensor

_LIBC = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None


@dataclass
class Target:
    """Where one checkpoint tensor goes."""

    param: torch.Tensor  # a parameter, or a persistent buffer (a router's score correction, a layer's scalar)
    quantized_module: bnb.nn.Linear4bit | None = None
    dora_magnitude: nn.Parameter | None = None  # filled from the dequantized weight's row norms
    experts: ExpertMatrix | None = None  # a fused experts parameter: one row of 4-bit bytes an expert
    lora_layer: nn.Module | None = None  # the LoRA layer around a 4-bit linear (lora.init computes its start)
    key: str = ""  # the checkpoint key (seeds a randomized init)
    buffer: bool = False  # read whole into every rank, in the buffer's own dtype (fp32 where transformers keeps it)


def materialize(model: nn.Module, device: torch.device, param_device: torch.device) -> None:
    """Allocate real (uninitialized) storage, keeping the values of the buffers."""
    computed = computed_buffers(model)
    tied = tied_parameter_slots(model)
    model.to_empty(device=param_device)
    retie(tied)
    for (module, name), value in computed.items():
        persistent = name not in module._non_persistent_buffers_set
        module.register_buffer(name, value.to(device), persistent=persistent)


BufferSlot = tuple[nn.Module, str]


def computed_buffers(model: nn.Module) -> dict[BufferSlot, torch.Tensor]:
    """The values of every buffer, which `to_empty` would turn into garbage (the loss turns NaN): the computed ones
    (rotary `inv_freq`, Gemma's `embed_scale`) and the model's own start of the persistent ones, which the
    checkpoint's values replace at load. build_meta_model leaves buffers real, computed by the model's own code; a
    computed buffer built on the meta device anyway is re-created from its module's config, if it has one."""
    values: dict[BufferSlot, torch.Tensor] = {}
    for module in model.modules():
        for name, buffer in sorted(module._buffers.items()):
            if buffer is None:
                continue
            if buffer.is_meta:
                if name not in module._non_persistent_buffers_set:
                    continue  # the checkpoint holds it: allocated by to_empty, filled by load_weights
                buffer = rebuilt_buffer(module, name)
            values[(module, name)] = buffer.detach().clone()
    return values


def rebuilt_buffer(module: nn.Module, name: str) -> torch.Tensor:
    if not hasattr(module, "config"):
        raise ModelLoadError(f"cannot rebuild buffer '{name}' of {type(module).__name__}: it was built on the meta "
                             "device and its module has no config to rebuild it from")
    with torch.device("cpu"):
        return getattr(type(module)(module.config), name)


ParamSlot = tuple[nn.Module, str]  # a module and the attribute name it holds a parameter under


def tied_parameter_slots(model: nn.Module) -> list[list[ParamSlot]]:
    """The places that hold one shared parameter (a head tied to the embeddings), for each parameter held twice."""
    slots: dict[int, list[ParamSlot]] = {}
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False):
            slots.setdefault(id(param), []).append((module, attr))
    return [group for group in slots.values() if len(group) > 1]


def retie(groups: list[list[ParamSlot]]) -> None:
    """`to_empty` gives every module its own new tensor, so a tied head would become a second, never-loaded
    matrix (FSDP2 keeps its managed parameters shared, an unsharded model does not): share the first again."""
    for (first_module, first_attr), *others in groups:
        shared = getattr(first_module, first_attr)
        for module, attr in others:
            setattr(module, attr, shared)


def base_targets(model: nn.Module) -> dict[str, Target]:
    """Checkpoint key -> where it goes, for every frozen base parameter (tied names included)."""
    targets: dict[str, Target] = {}
    modules = dict(model.named_modules())
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.requires_grad and is_lora_tensor(name):  # trained routers (lora.train_router) start as stored
            continue
        module_name, _, attr = name.rpartition(".")
        module = modules[module_name]
        key = weight_key(name)
        target = Target(param, key=key)
        if isinstance(module, bnb.nn.Linear4bit) and attr == "weight":
            target.quantized_module = module
            target.dora_magnitude = dora_magnitude_of(modules, module_name)
            target.lora_layer = lora_layer_of(modules, module_name)
        if isinstance(module, Experts4bit) and attr in EXPERT_MATRICES:
            target.experts = module.expert_matrices[attr]
        targets[key] = target
    for name, buffer in persistent_buffers(model):
        targets[weight_key(name)] = Target(buffer, key=weight_key(name), buffer=True)
    return targets


def dora_magnitude_of(modules: dict[str, nn.Module], linear_name: str) -> nn.Parameter | None:
    owner_name = linear_name.removesuffix(".base_layer")
    magnitudes = getattr(modules.get(owner_name), "lora_magnitude_vector", None)
    if not magnitudes:
        return None
    return next(iter(magnitudes.values())).weight


def random_pieces(targets: dict[str, Target], std: float, seed: int, device: torch.device) -> Iterator[Piece]:
    """Seeded stand-ins for an architecture-only run: N(0, std) matrices, unit norms, zero biases.

    Each tensor has its own generator (seed, name), so any world size builds the very same model (on one
    device type: CUDA's generator draws other numbers than the CPU's, and is what makes a 70B init fast).
    Experts are drawn one at a time and only by the rank that keeps them.
    """
    seen: set[int] = set()
    for key, target in targets.items():
        if id(target.param) in seen:  # tied weights: one tensor
            continue
        seen.add(id(target.param))
        module = target.quantized_module
        shape = (module.out_features, module.in_features) if module is not None else tuple(target.param.shape)
        if target.buffer:  # the model's own start (ones for a scalar, zeros for a correction)
            yield Plain(key, key, key, InMemoryTensor(target.param.detach().clone()), "random init")
        elif target.experts is not None:
            draw = functools.partial(random_expert, target.experts.shape, std, seed, key, device)
            yield Experts(key, key, range(target.param.shape[0]), draw, "random init")
        elif key.endswith("bias"):
            yield Plain(key, key, key, InMemoryTensor(torch.zeros(shape)), "random init")
        elif "norm" in key:
            yield Plain(key, key, key, InMemoryTensor(torch.ones(shape)), "random init")
        else:
            yield Plain(key, key, key, InMemoryTensor(normal(shape, std, seed, key, device)), "random init")


def random_expert(shape: tuple[int, int], std: float, seed: int, key: str, device: torch.device,
                  expert: int) -> torch.Tensor:
    return normal(shape, std, seed, f"{key}.{expert}", device)


def normal(shape: tuple[int, ...], std: float, seed: int, name: str, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)


def release_freed_memory() -> None:
    """glibc keeps freed blocks for reuse; with tensors of ever-changing sizes that grows RSS by hundreds of MB
    while loading (measured: 1.19 -> 0.94 GiB peak above baseline for a 0.84B model on one rank)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def pieces(cfg: Config, targets: dict[str, Target], model: nn.Module, device: torch.device) -> Iterator[Piece]:
    """Seeded random tensors, or the checkpoint's, read by the one reader merge uses too."""
    if cfg.model.init == "random":
        std = getattr(model.config, "initializer_range", 0.02)
        yield from random_pieces(targets, std, cfg.train.seed, device)
        return
    reader = CheckpointReader(model_dir(cfg), model_layout(model), model_shapes(targets, cfg), device,
                              cfg.model.allow_pickle)
    yield from reader.pieces()


def model_shapes(targets: dict[str, Target], cfg: Config) -> ModelShapes:
    """What the reader needs to know of the model: its 4-bit linears and its experts, by our keys."""
    four_bit = {key: (t.quantized_module.out_features, t.quantized_module.in_features)
                for key, t in targets.items() if t.quantized_module is not None}
    experts = {key: (t.param.shape[0], t.experts) for key, t in targets.items() if t.experts is not None}
    return ModelShapes(four_bit, experts, TORCH_DTYPES[cfg.model.dtype], cfg.quant)


def model_layout(model: nn.Module) -> CheckpointLayout:
    """The checkpoint layout build_meta_model attached to the model."""
    layout = getattr(model, "checkpoint_layout", None)
    assert isinstance(layout, CheckpointLayout), "models come from build_meta_model, which attaches a layout"
    return layout


@torch.no_grad()
def load_weights(model: nn.Module, cfg: Config, device: torch.device) -> None:
    """Stream every base tensor into its (sharded) parameter; then initialize LoRA."""
    targets = base_targets(model)
    placed: dict[int, set[int]] = {}  # parameter -> the experts placed (one for a parameter without experts)
    for piece in pieces(cfg, targets, model, device):
        if piece.key is None:  # a part the text model does not hold (a vision tower)
            continue
        target = targets.get(piece.key)
        if target is None:
            raise ModelLoadError(f"{piece.source} holds '{piece.key}', which the model built from config.json lacks: "
                                 "config and weights disagree")
        if isinstance(piece, Experts):
            place_experts(piece, target)
        elif isinstance(piece, FourBit):
            place_four_bit(piece, target, device, cfg)
        else:
            load_tensor(target, piece.tensor, cfg, device)
        placed.setdefault(id(target.param), set()).update(piece.experts if isinstance(piece, Experts) else {0})
        release_freed_memory()  # return the full tensor's pages before reading the next
    missing = sorted(k for k, t in targets.items() if len(placed.get(id(t.param), ())) < expected_pieces(t))
    if missing:
        raise ModelLoadError(f"checkpoint lacks '{missing[0]}' ({len(missing)} missing): config and weights disagree")
    init_lora(model, cfg.train.seed)


def expected_pieces(target: Target) -> int:
    return target.param.shape[0] if target.experts is not None else 1


def place_experts(piece: Experts, target: Target) -> None:
    """This rank's experts of the piece, each quantized into its row of bytes; the others are not even read."""
    if target.experts is None:
        raise ModelLoadError(f"{piece.source} holds experts for '{piece.key}', which the model holds as a plain "
                             "tensor: config and weights disagree")
    first, last = shard_row_range(target.param, target.param.shape[0])
    local = local_shard(target.param)
    for expert in piece.experts:
        if first <= expert < last:
            weight = piece.read(expert).to(dtype=target.experts.dtype)
            local[expert - first].copy_(target.experts.to_row(weight))


def place_four_bit(piece: FourBit, target: Target, device: torch.device, cfg: Config) -> None:
    """A pre-quantized weight as stored: this rank's rows of the packed bytes, and the whole weight's quantization
    state (replicated, as after quantizing at load)."""
    module = target.quantized_module
    if target.lora_layer is not None and initialized(cfg):
        raise ModelLoadError(f"lora.init {cfg.lora.init} computes from the full-precision weights, and the checkpoint "
                             f"stores '{piece.key}' in 4-bit; use its original checkpoint, or lora.init: default")
    if module is None:
        raise ModelLoadError(f"the checkpoint stores '{piece.key}' in 4-bit, where this model has no 4-bit linear: "
                             "config and weights disagree")
    first, last = shard_row_range(target.param, piece.n_bytes)
    copy_rows_into(target.param, piece.bytes(first, last).to(device))
    set_quant_state(module, piece.state)
    if target.dora_magnitude is not None:
        copy_full_into(target.dora_magnitude, dora_magnitude(piece.dequantized(), target.dora_magnitude.dtype))


def load_tensor(target: Target, stored: StoredTensor, cfg: Config, device: torch.device) -> None:
    dtype = target.param.dtype if target.buffer else TORCH_DTYPES[cfg.model.dtype]
    if target.quantized_module is None:
        if cfg.model.add_tokens and grows_rows(stored, target.param):
            copy_rows_into(target.param, grown_rows(stored, target.param).to(device=device, dtype=dtype))
            return
        if tuple(stored.shape) != tuple(target.param.shape):
            raise ModelLoadError(f"checkpoint tensor of shape {tuple(stored.shape)} where the config wants "
                                 f"{tuple(target.param.shape)}: config and weights disagree")
        rows = shard_row_range(target.param, stored.shape[0]) if stored.shape else None
        part = stored.read(rows).to(device=device, dtype=dtype)  # only this rank's rows are read
        copy_rows_into(target.param, part)
        return
    if target.lora_layer is not None and initialized(cfg):  # the adapter takes its part; the residual is quantized
        full = start_of(target.lora_layer, target.key, stored.read().to(device=device), cfg)  # as stored
    else:
        full = stored.read().to(device=device, dtype=dtype)
    load_quantized(target, full.to(dtype), cfg)


def grows_rows(stored: StoredTensor, param: torch.Tensor) -> bool:
    """The embeddings or the head, grown for model.add_tokens: more rows than stored, the same row width."""
    return len(stored.shape) == 2 and stored.shape[1] == param.shape[1] and stored.shape[0] < param.shape[0]


def grown_rows(stored: StoredTensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's rows of the grown tensor: the stored rows, then new ones that are each the stored rows' mean (a
    new token starts where the known ones are on average, not at a random point)."""
    full = stored.read().float()
    first, last = shard_row_range(param, param.shape[0])
    grown = torch.cat([full, full.mean(0, keepdim=True).expand(param.shape[0] - full.shape[0], -1)])
    return grown[first:last]


def load_quantized(target: Target, full: torch.Tensor, cfg: Config) -> None:
    """Quantize the whole weight (the quantization state is per whole tensor), keep this rank's packed rows."""
    module = target.quantized_module
    assert module is not None, "load_tensor sends only targets with a quantized module here"
    if (full.shape[0], full.shape[1]) != (module.out_features, module.in_features):
        raise ModelLoadError(f"checkpoint weight of shape {tuple(full.shape)} for a "
                             f"{module.out_features}x{module.in_features} linear: config and weights disagree")
    packed, quant_state = quantize(full, cfg.quant, target.param.dtype)
    set_quant_state(module, quant_state)
    copy_full_into(target.param, packed)
    if target.dora_magnitude is not None:
        weight = bnbf.dequantize_4bit(packed, quant_state)
        copy_full_into(target.dora_magnitude, dora_magnitude(weight, target.dora_magnitude.dtype))


def set_quant_state(module: bnb.nn.Linear4bit, state: bnbf.QuantState) -> None:
    """The whole weight's state, replicated per rank (double quantization keeps it small)."""
    module.quant_state = state
    if isinstance(module.weight, bnb.nn.Params4bit):
        module.weight.quant_state = state


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """A ~ U(+-1/sqrt(fan_in)) as nn.Linear (and PEFT) do, B = 0, a reward head ~ N(0, initializer_range), from a
    generator seeded per name.

    Generated whole and then sharded, so every world size starts from the very same adapter.
    """
    started = {id(factors.weight) for module in model.modules() if "_start" in vars(module)
               for factors in (cast(Any, module).lora_A["default"], cast(Any, module).lora_B["default"])}
    for name, param in model.named_parameters():
        if not param.requires_grad or not is_lora_tensor(name) or "lora_magnitude_vector" in name:
            continue
        if id(param) in started:  # filled from its weight (lora.init)
            continue
        key = clean_name(name)
        full = torch.zeros(param.shape, dtype=torch.float32)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        if ".lora_A." in key or key.endswith(".lora_A"):  # PEFT's, or an ExpertLora's [r * experts, in]
            bound = 1.0 / param.shape[1] ** 0.5
            full.uniform_(-bound, bound, generator=generator)
        elif key == REWARD_HEAD_KEY:  # as transformers initializes a classifier: N(0, initializer_range)
            full.normal_(0.0, getattr(model.config, "initializer_range", 0.02), generator=generator)
        copy_full_into(param, full.to(device=param.device, dtype=param.dtype))
