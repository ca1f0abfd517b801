"""What a rank holds for a whole run, from shapes alone: the 4-bit shards, the LoRA weights, their gradients
and optimizer state, by the optimizers' own rules; the model is built on the meta device and sharded by FSDP2
over a fake process group of the recipe's world size, so each local shard has the shape rank 0 will allocate."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import bitsandbytes as bnb
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from qlora_fsdp.config import Config
from qlora_fsdp.distributed import local_shard
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.families import quant_method
from qlora_fsdp.layers.decoder import decoder_layers
from qlora_fsdp.layers.experts4bit import NESTED_BLOCKSIZE, Experts4bit
from qlora_fsdp.layers.trained_embeddings import embedding_parameters
from qlora_fsdp.loading.build import base_parameter_count
from qlora_fsdp.loading.sharding import sharded_meta_model
from qlora_fsdp.measure.planning import Planning
from qlora_fsdp.optimizer_registry import OPTIMIZERS


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def quant_state_bytes(n_elements: int, blocksize: int, double_quant: bool) -> int:
    """A Linear4bit's quantization state, whole on every rank (FSDP shards only the packed weight)."""
    blocks = n_elements // blocksize
    codebook = 16 * 4  # the NF4/FP4 code, fp32
    if not double_quant:
        return blocks * 4 + codebook
    nested = math.ceil(blocks / NESTED_BLOCKSIZE) * 4 + 256 * 4 + 4  # nested absmax, its 8-bit code, the offset
    return blocks + nested + codebook


def meta_held(planning: Planning, mesh: DeviceMesh, cfg: Config | None = None) -> Held:
    """Exact bytes from the recipe's model (or `cfg`'s, a resolved variant of it) built and sharded as training does
    it, on the meta device."""
    cfg = planning.cfg if cfg is None else cfg  # the architecture copied: building a model changes its config
    return held_bytes(sharded_meta_model(planning.built(cfg), copy.deepcopy(planning.hf_config), mesh), cfg)


@dataclass
class Held:
    """Exact bytes rank 0 holds, from the sharded meta model."""
    base_4bit: int = 0  # experts: with their quantization statistics, which are sharded with them
    quant_state: int = 0
    other_base: int = 0
    lora: int = 0
    grads: int = 0
    optimizer: int = 0
    layer_shard: int = 0  # one decoder layer's local shards (what offload copies to the GPU to gather it)
    largest_linear: int = 0  # elements of the biggest weight read whole and quantized while loading
    largest_packed: int = 0  # bytes of the biggest pre-quantized weight, its packed bytes copied as stored
    base_parameters: int = 0  # unpacked count
    active_parameters: int = 0  # those a token computes with (a mixture of experts: its top-k experts), for MFU
    lora_elements: int = 0  # all ranks' LoRA elements together (the unsharded count)


def held_bytes(model: nn.Module, cfg: Config) -> Held:
    held = Held()
    packed = set()
    stored_4bit = quant_method(getattr(model, "config", None)) == "bitsandbytes"  # a pre-quantized checkpoint
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            n = module.in_features * module.out_features
            packed.add(id(module.weight))
            held.quant_state += quant_state_bytes(n, cfg.quant.blocksize, cfg.quant.double_quant)
            if stored_4bit:
                held.largest_packed = max(held.largest_packed, n // 2)
            else:
                held.largest_linear = max(held.largest_linear, n)
        if isinstance(module, Experts4bit):  # rows of packed values and their statistics, sharded over experts
            for name, matrix in module.expert_matrices.items():
                packed.add(id(getattr(module, name)))
                held.largest_linear = max(held.largest_linear, matrix.numel)  # read one expert at a time
    full_state = {id(p) for p in embedding_parameters(model)} if cfg.lora.train_embeddings else set()
    for param in model.parameters():
        shard = local_shard(param)
        if param.requires_grad:
            held.lora += nbytes(shard)
            held.grads += nbytes(shard)  # FSDP2 hands each shard its gradient in the parameter's dtype
            held.optimizer += OPTIMIZERS[cfg.optim.name].state_bytes_of(shard.numel(), shard.element_size(),
                                                                         id(param) in full_state)
            held.lora_elements += param.numel()
        elif id(param) in packed:
            held.base_4bit += nbytes(shard)
        else:
            held.other_base += nbytes(shard)
    held.base_parameters = base_parameter_count(model)
    held.active_parameters = held.base_parameters - sum(m.idle_parameters() for m in model.modules()
                                                        if isinstance(m, Experts4bit))
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
