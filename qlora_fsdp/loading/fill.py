"""Fill a meta-built (and possibly FSDP2-sharded) model from safetensors, one tensor at a time.

Each linear weight is read whole and quantized to NF4 on the compute device (its quantization state
covers the whole tensor); a rank keeps only its dim-0 chunk of the packed bytes (exactly FSDP2's
`torch.chunk` shard) and frees the rest before the next tensor. Other weights (embeddings, norms,
lm_head) are read only for the rows this rank keeps. A mixture of experts' experts are read one expert at
a time, and only by the rank that keeps that expert (ExpertRows). Peak host memory per rank: its shards plus
one full tensor, never the whole model or the whole quantized model.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from qlora_fsdp.config import Config, QuantConfig
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.errors import ModelLoadError
from qlora_fsdp.layers.experts4bit import EXPERT_MATRICES, ExpertMatrix, Experts4bit
from qlora_fsdp.loading.build import QUANT_STORAGE
from qlora_fsdp.loading.checkpoint import model_dir
from qlora_fsdp.loading.layout import CheckpointLayout, ExpertPart, PartsWaiting
from qlora_fsdp.loading.names import clean_name, is_lora_tensor, weight_key
from qlora_fsdp.loading.stored_forms import (
    MXFP4_PARTS,
    StoredStatistics,
    bnb_4bit_part,
    is_packed_shape,
    mxfp4_experts,
    mxfp4_part,
    packed_byte_rows,
)
from qlora_fsdp.loading.weight_files import InMemoryTensor, LazyTensor, StoredTensor, stored_weight_tensors

_LIBC = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None


@dataclass
class Target:
    """Where one checkpoint tensor goes."""

    param: nn.Parameter
    quantized_module: bnb.nn.Linear4bit | None = None
    dora_magnitude: nn.Parameter | None = None  # filled from the dequantized weight's row norms
    experts: ExpertMatrix | None = None  # a fused experts parameter: one row of 4-bit bytes an expert


def materialize(model: nn.Module, device: torch.device, param_device: torch.device) -> None:
    """Allocate real (uninitialized) storage, keeping the buffers that checkpoints do not hold."""
    computed = computed_buffers(model)
    tied = tied_parameter_slots(model)
    model.to_empty(device=param_device)
    retie(tied)
    for (module, name), value in computed.items():
        module.register_buffer(name, value.to(device), persistent=False)


BufferSlot = tuple[nn.Module, str]


def computed_buffers(model: nn.Module) -> dict[BufferSlot, torch.Tensor]:
    """The values of every non-persistent buffer (rotary `inv_freq`, Gemma's `embed_scale`), which `to_empty`
    would turn into garbage (the loss turns NaN). build_meta_model leaves buffers real, computed by the model's
    own code; a module built with meta buffers anyway is re-created from its config, if it has one."""
    values: dict[BufferSlot, torch.Tensor] = {}
    for module in model.modules():
        for name in sorted(getattr(module, "_non_persistent_buffers_set", set())):
            buffer = module._buffers.get(name)
            if buffer is None:
                continue
            if buffer.is_meta:
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


def shard_row_range(param: torch.Tensor, n_rows: int) -> tuple[int, int]:
    """The rows of a full tensor this rank keeps for `param`: all, or FSDP2's `torch.chunk` dim-0 chunk over
    the mesh dimension that shards (HSDP replicates over the other)."""
    if not isinstance(param, DTensor):
        return 0, n_rows
    placements = tuple(param.placements)
    if placements not in ((Shard(0),), (Replicate(), Shard(0))):
        raise ModelLoadError(f"unsupported placement {placements}; expected FSDP2's Shard(0) or HSDP's")
    mesh, shard_dim = param.device_mesh, len(placements) - 1
    return chunk_rows(n_rows, mesh.size(shard_dim), mesh.get_local_rank(shard_dim))


def chunk_rows(n_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Row range of `torch.chunk(t, world_size)[rank]` (empty where torch.chunk makes fewer chunks)."""
    chunk = math.ceil(n_rows / world_size)
    return min(rank * chunk, n_rows), min((rank + 1) * chunk, n_rows)


@torch.no_grad()
def copy_rows_into(param: torch.Tensor, part: torch.Tensor) -> None:
    """Copy this rank's rows (already cut with `shard_row_range`) into the local shard."""
    local = param.to_local() if isinstance(param, DTensor) else param.data
    if local.shape != part.shape:
        raise ModelLoadError(f"shard shape {tuple(local.shape)} does not match checkpoint part {tuple(part.shape)}")
    local.copy_(part)


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    first, last = shard_row_range(param, full.shape[0])
    copy_rows_into(param, full[first:last])


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
        target = Target(param)
        if isinstance(module, bnb.nn.Linear4bit) and attr == "weight":
            target.quantized_module = module
            target.dora_magnitude = dora_magnitude_of(modules, module_name)
        if isinstance(module, Experts4bit) and attr in EXPERT_MATRICES:
            target.experts = module.expert_matrices[attr]
        targets[key] = target
    return targets


def dora_magnitude_of(modules: dict[str, nn.Module], linear_name: str) -> nn.Parameter | None:
    owner_name = linear_name.removesuffix(".base_layer")
    magnitudes = getattr(modules.get(owner_name), "lora_magnitude_vector", None)
    if not magnitudes:
        return None
    return next(iter(magnitudes.values())).weight


@dataclass(frozen=True)
class Statistic:
    """A stored statistic of a pre-quantized 4-bit weight (`absmax`, `quant_map`, ...); the piece's key is the
    weight's."""

    name: str


# our key, the tensor, where from, and which expert it holds or which statistic of a 4-bit weight it is
Piece = tuple[str, StoredTensor, str, ExpertPart | Statistic | None]


def random_tensors(targets: dict[str, Target], std: float, seed: int, device: torch.device) -> Iterator[Piece]:
    """Seeded stand-ins for an architecture-only run: N(0, std) matrices, unit norms, zero biases.

    Each tensor has its own generator (seed, name), so any world size builds the very same model (on one
    device type: CUDA's generator draws other numbers than the CPU's, and is what makes a 70B init fast).
    Experts come one at a time and are drawn only by the rank that keeps them.
    """
    seen: set[int] = set()
    for key, target in targets.items():
        if id(target.param) in seen:  # tied weights: one tensor
            continue
        seen.add(id(target.param))
        module = target.quantized_module
        shape = (module.out_features, module.in_features) if module is not None else tuple(target.param.shape)
        if target.experts is not None:
            for expert in range(target.param.shape[0]):
                draw = functools.partial(normal, target.experts.shape, std, seed, f"{key}.{expert}", device)
                yield key, LazyTensor(target.experts.shape, draw), "random init", ExpertPart(expert)
        elif key.endswith("bias"):
            yield key, InMemoryTensor(torch.zeros(shape)), "random init", None
        elif "norm" in key:
            yield key, InMemoryTensor(torch.ones(shape)), "random init", None
        else:
            yield key, InMemoryTensor(normal(shape, std, seed, key, device)), "random init", None


def normal(shape: tuple[int, ...], std: float, seed: int, name: str, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)


def release_freed_memory() -> None:
    """glibc keeps freed blocks for reuse; with tensors of ever-changing sizes that grows RSS by hundreds of MB
    while loading (measured: 1.19 -> 0.94 GiB peak above baseline for a 0.84B model on one rank)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def tensor_source(cfg: Config, targets: dict[str, Target], model: nn.Module, device: torch.device
                  ) -> Iterator[Piece]:
    """(our model's key, tensor, where from): seeded random tensors, or the checkpoint's, renamed by its layout."""
    if cfg.model.init == "random":
        std = getattr(model.config, "initializer_range", 0.02)
        yield from random_tensors(targets, std, cfg.train.seed, device)
        return
    layout = model_layout(model)
    for stored_key, tensor, source in stored_weight_tensors(model_dir(cfg.model.path), cfg.model.allow_pickle):
        statistic = bnb_4bit_part(stored_key)
        if statistic is not None:  # named after its weight, which the layout knows
            key, _ = layout.model_key(statistic[0])
            if key is not None:
                yield key, tensor, source, Statistic(statistic[1])
            continue
        key, part = layout.model_key(stored_key)
        if key is not None:  # None: a part the text model does not hold (a vision tower)
            yield key, tensor, source, part


def model_layout(model: nn.Module) -> CheckpointLayout:
    """The checkpoint layout build_meta_model attached to the model."""
    layout = getattr(model, "checkpoint_layout", None)
    assert isinstance(layout, CheckpointLayout), "models come from build_meta_model, which attaches a layout"
    return layout


@torch.no_grad()
def load_weights(model: nn.Module, cfg: Config, device: torch.device) -> None:
    """Stream every base tensor into its (sharded) parameter; then initialize LoRA."""
    targets = base_targets(model)
    loaded: set[int] = set()
    experts = ExpertRows(cfg, device)
    stored_4bit = Prequantized(cfg, device)
    for key, tensor, source, part in tensor_source(cfg, targets, model, device):
        target = targets.get(key)
        if target is None and experts.load_mxfp4(key, targets, tensor):
            continue
        if target is None:
            if key.endswith("rotary_emb.inv_freq"):  # older checkpoints saved this computed buffer
                continue
            raise ModelLoadError(f"{source} holds '{key}', which the model built from config.json lacks: "
                                 "config and weights disagree")
        if isinstance(part, Statistic) or stored_4bit.is_packed(target, tensor):
            stored_4bit.load(key, target, tensor, part)
        elif target.experts is not None:
            experts.load(key, target, tensor, part)
        else:
            load_tensor(target, tensor, cfg, device)
            loaded.add(id(target.param))
        release_freed_memory()  # return the full tensor's pages before reading the next
    loaded |= experts.complete(targets) | stored_4bit.complete()
    missing = sorted(k for k, t in targets.items() if id(t.param) not in loaded)
    if missing:
        raise ModelLoadError(f"checkpoint lacks '{missing[0]}' ({len(missing)} missing): config and weights disagree")
    init_lora(model, cfg.train.seed)


class ExpertRows:
    """Fills fused experts parameters expert by expert: from a fused stored tensor (read one expert at a time) or
    from per-expert tensors (Mixtral's w1 and w3 joined into gate_up_proj). A rank reads and quantizes only the
    experts it keeps; per-expert parts wait only until their expert's other parts arrive."""

    def __init__(self, cfg: Config, device: torch.device) -> None:
        self.dtype, self.device = TORCH_DTYPES[cfg.model.dtype], device
        self.seen: dict[str, set[int]] = {}
        self.waiting = PartsWaiting()  # (key, expert) -> this rank's parts of an expert's matrix
        self.mxfp4 = PartsWaiting()  # key -> its MXFP4 blocks and scales, not read yet

    def load_mxfp4(self, key: str, targets: dict[str, Target], stored: StoredTensor) -> bool:
        """An experts parameter stored in MXFP4 (gpt-oss): once both its blocks and its scales have come, each of
        this rank's experts is decoded and quantized to NF4. False for a key that is not such a part."""
        found = mxfp4_part(key)
        target = targets.get(found[0]) if found else None
        if found is None or target is None or target.experts is None:
            return False
        name, which = found
        parts = self.mxfp4.add(name, MXFP4_PARTS.index(which), stored, len(MXFP4_PARTS))
        if parts is None:
            return True
        n_experts = target.param.shape[0]
        first, last = shard_row_range(target.param, n_experts)
        for expert in range(first, last):
            blocks, scales = (part.read((expert, expert + 1)).to(self.device) for part in parts)
            weight = mxfp4_experts(blocks, scales, self.dtype)[0]
            if tuple(weight.shape) != target.experts.shape:
                raise ModelLoadError(f"MXFP4 experts of '{name}' decode to {tuple(weight.shape)} where the config "
                                     f"wants {target.experts.shape}: config and weights disagree")
            self.store(target, expert - first, weight)
        self.seen[name] = set(range(n_experts))
        return True

    def load(self, key: str, target: Target, stored: StoredTensor, part: ExpertPart | None) -> None:
        matrix, n_experts = target.experts, target.param.shape[0]
        assert matrix is not None, "load_weights sends only experts targets here"
        first, last = shard_row_range(target.param, n_experts)
        if part is None:  # all experts in one tensor
            if tuple(stored.shape) != (n_experts, *matrix.shape):
                raise ModelLoadError(f"checkpoint experts of shape {tuple(stored.shape)} for '{key}', where the config "
                                     f"wants {(n_experts, *matrix.shape)}: config and weights disagree")
            for expert in range(first, last):
                self.store(target, expert - first, stored.read((expert, expert + 1))[0])
            self.seen.setdefault(key, set()).update(range(n_experts))
            return
        self.seen.setdefault(key, set()).add(part.expert)
        if not first <= part.expert < last:
            return  # another rank's expert: not even read
        parts = self.waiting.add((key, part.expert), part.part, stored.read(), part.n_parts)
        if parts is not None:
            weight = torch.cat(parts)
            if tuple(weight.shape) != matrix.shape:
                raise ModelLoadError(f"checkpoint expert {part.expert} of '{key}' has shape {tuple(weight.shape)} "
                                     f"where the config wants {matrix.shape}: config and weights disagree")
            self.store(target, part.expert - first, weight)

    def store(self, target: Target, local_expert: int, weight: torch.Tensor) -> None:
        assert target.experts is not None
        row = target.experts.to_row(weight.to(device=self.device, dtype=self.dtype))
        local = target.param.to_local() if isinstance(target.param, DTensor) else target.param.data
        local[local_expert].copy_(row)

    def complete(self, targets: dict[str, Target]) -> set[int]:
        """The experts parameters whose every expert was in the checkpoint."""
        if (name := self.mxfp4.incomplete()) is not None:
            raise ModelLoadError(f"checkpoint holds only one of the MXFP4 blocks and scales of '{name}': damaged or "
                                 "incomplete download?")
        if (waiting := self.waiting.incomplete()) is not None:
            key, expert = waiting
            raise ModelLoadError(f"checkpoint holds only part of expert {expert} of '{key}': config and weights "
                                 "disagree")
        return {id(t.param) for k, t in targets.items()
                if t.experts is not None and len(self.seen.get(k, ())) == t.param.shape[0]}


class Prequantized:
    """Fills 4-bit linears from a pre-quantized checkpoint as stored: a rank copies its rows of the packed bytes and
    rebuilds the whole weight's quantization state from the statistics (replicated, as after quantizing at load)."""

    def __init__(self, cfg: Config, device: torch.device) -> None:
        self.quant, self.device = cfg.quant, device
        self.statistics = StoredStatistics(TORCH_DTYPES[cfg.model.dtype])
        self.packed: set[str] = set()
        self.stated: dict[str, Target] = {}

    @staticmethod
    def is_packed(target: Target, stored: StoredTensor) -> bool:
        return target.quantized_module is not None and is_packed_shape(stored.shape)

    def load(self, key: str, target: Target, stored: StoredTensor, part: ExpertPart | Statistic | None) -> None:
        module = target.quantized_module
        if module is None:
            raise ModelLoadError(f"the checkpoint stores '{key}' in 4-bit, where this model has no 4-bit linear: "
                                 "config and weights disagree")
        if not isinstance(part, Statistic):
            self.copy_packed(key, target, stored)
            return
        state = self.statistics.add(key, part.name, stored.read(), self.device)
        if state is None:
            return
        state.check(key, (module.out_features, module.in_features), self.quant)
        module.quant_state = state.state
        if isinstance(module.weight, bnb.nn.Params4bit):
            module.weight.quant_state = state.state
        self.stated[key] = target
        self.fill_dora_magnitude(target)

    def copy_packed(self, key: str, target: Target, stored: StoredTensor) -> None:
        """This rank's rows of [n / 2, 1] packed bytes, read from however many stored elements cover them."""
        n_bytes = target.param.shape[0]
        itemsize, remainder = divmod(n_bytes, stored.shape[0])
        if remainder or itemsize not in (1, 2, 4):
            raise ModelLoadError(f"the 4-bit weight '{key}' is stored as {tuple(stored.shape)}, where the config "
                                 f"wants {n_bytes} packed bytes: config and weights disagree")
        first, last = shard_row_range(target.param, n_bytes)
        rows = stored.read((first // itemsize, -(-last // itemsize)))
        copy_rows_into(target.param, packed_byte_rows(rows, first, last - first).to(self.device))
        self.packed.add(key)
        self.fill_dora_magnitude(target)

    def fill_dora_magnitude(self, target: Target) -> None:
        """DoRA's magnitudes are the dequantized weight's row norms: the whole weight, gathered once both the
        bytes and the state are here (DoRA is rare; without it nothing is gathered)."""
        key = next((k for k, t in self.stated.items() if t is target), None)
        if target.dora_magnitude is None or key is None or key not in self.packed:
            return
        module = target.quantized_module
        assert module is not None and module.quant_state is not None
        local = target.param.to_local() if isinstance(target.param, DTensor) else target.param.data
        packed = target.param.full_tensor() if isinstance(target.param, DTensor) else local
        weight = bnbf.dequantize_4bit(packed, module.quant_state).float()
        copy_full_into(target.dora_magnitude, weight.norm(dim=1).to(target.dora_magnitude.dtype))

    def complete(self) -> set[int]:
        """The 4-bit parameters that got both their bytes and their state."""
        if (key := self.statistics.incomplete()) is not None:
            raise ModelLoadError(f"checkpoint holds only some of the statistics of the 4-bit weight '{key}': "
                                 "damaged or incomplete download?")
        one_sided = sorted(self.packed ^ self.stated.keys())
        if one_sided:
            has = "its packed bytes" if one_sided[0] in self.packed else "its statistics"
            raise ModelLoadError(f"checkpoint holds only {has} of the 4-bit weight '{one_sided[0]}': damaged or "
                                 "incomplete download?")
        return {id(target.param) for target in self.stated.values()}


def load_tensor(target: Target, stored: StoredTensor, cfg: Config, device: torch.device) -> None:
    dtype = TORCH_DTYPES[cfg.model.dtype]
    if target.quantized_module is None:
        if tuple(stored.shape) != tuple(target.param.shape):
            raise ModelLoadError(f"checkpoint tensor of shape {tuple(stored.shape)} where the config wants "
                                 f"{tuple(target.param.shape)}: config and weights disagree")
        rows = shard_row_range(target.param, stored.shape[0]) if stored.shape else None
        part = stored.read(rows).to(device=device, dtype=dtype)  # only this rank's rows are read
        copy_rows_into(target.param, part)
        return
    load_quantized(target, stored.read().to(device=device, dtype=dtype), cfg)


def load_quantized(target: Target, full: torch.Tensor, cfg: Config) -> None:
    """Quantize the whole weight (the quantization state is per whole tensor), keep this rank's packed rows."""
    module = target.quantized_module
    assert module is not None, "load_tensor sends only targets with a quantized module here"
    if (full.shape[0], full.shape[1]) != (module.out_features, module.in_features):
        raise ModelLoadError(f"checkpoint weight of shape {tuple(full.shape)} for a "
                             f"{module.out_features}x{module.in_features} linear: config and weights disagree")
    packed, quant_state = quantize(full, cfg.quant, target.param.dtype)
    module.quant_state = quant_state  # replicated per rank: double quantization keeps it small
    if isinstance(module.weight, bnb.nn.Params4bit):
        module.weight.quant_state = quant_state
    copy_full_into(target.param, packed)
    if target.dora_magnitude is not None:
        weight = bnbf.dequantize_4bit(packed, quant_state).float()
        copy_full_into(target.dora_magnitude, weight.norm(dim=1).to(target.dora_magnitude.dtype))


def quantize(weight: torch.Tensor, quant: QuantConfig, storage: torch.dtype = QUANT_STORAGE
             ) -> tuple[torch.Tensor, bnbf.QuantState]:
    """NF4/FP4 as the config says, packed into `storage` (the dtype the model's 4-bit parameters were built with)."""
    return bnbf.quantize_4bit(
        weight,
        blocksize=quant.blocksize,
        compress_statistics=quant.double_quant,
        quant_type=quant.quant_type,
        quant_storage=storage,
    )


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """A ~ U(+-1/sqrt(fan_in)) as nn.Linear (and PEFT) do, B = 0, from a generator seeded per name.

    Generated whole and then sharded, so every world size starts from the very same adapter.
    """
    for name, param in model.named_parameters():
        if not param.requires_grad or not is_lora_tensor(name) or "lora_magnitude_vector" in name:
            continue
        key = clean_name(name)
        full = torch.zeros(param.shape, dtype=torch.float32)
        if ".lora_A." in key or key.endswith(".lora_A"):  # PEFT's, or an ExpertLora's [r * experts, in]
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
            bound = 1.0 / param.shape[1] ** 0.5
            full.uniform_(-bound, bound, generator=generator)
        copy_full_into(param, full.to(device=param.device, dtype=param.dtype))
