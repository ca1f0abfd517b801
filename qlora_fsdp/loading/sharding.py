"""Activation checkpointing (checkpointing.py), then FSDP2 `fully_shard` per decoder layer, then the root."""

from __future__ import annotations

import peft
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from transformers import PretrainedConfig

from qlora_fsdp.config import Config, FSDPConfig
from qlora_fsdp.distributed.row_groups import row_split
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.families import attention_needs, router_loss_coefficient
from qlora_fsdp.layers.attention import (
    VARLEN_SDPA,
    refuse_blockwise_dropout,
    refuse_row_position_scaling,
    resolve_attention,
)
from qlora_fsdp.layers.checkpointing import apply_activation_checkpointing, layer_slots
from qlora_fsdp.layers.decoder import decoder_layers
from qlora_fsdp.layers.split_rows import HeadTrade, split_attention
from qlora_fsdp.layers.tiled_attention import tile_attention_sides
from qlora_fsdp.layers.tiled_mlp import tile_mlps
from qlora_fsdp.loading.build import build_meta_model
from qlora_fsdp.torch_versions import apply_fixes


def fsdp_policies(fsdp: FSDPConfig, device: torch.device) -> dict:
    mp_policy = MixedPrecisionPolicy(
        # None keeps every parameter in its storage dtype; FSDP2 never casts the uint8 packed 4-bit weights
        # and gathers them as bytes, so no policy can touch their bit patterns
        param_dtype=TORCH_DTYPES[fsdp.param_dtype] if fsdp.param_dtype else None,
        reduce_dtype=TORCH_DTYPES[fsdp.reduce_dtype],
    )
    # on a CPU mesh the offload policy saves nothing but runs FSDP2's offload code (host shards, host gradients,
    # the optimizer stepping host tensors), so CI executes the path every 24 GB recipe depends on
    pin = device.type == "cuda"  # pinned host memory is a CUDA notion: faster, async H2D/D2H copies
    offload_policy = CPUOffloadPolicy(pin_memory=pin) if fsdp.cpu_offload else OffloadPolicy()
    return {"mp_policy": mp_policy, "offload_policy": offload_policy}


def shard_model(model: nn.Module, fsdp: FSDPConfig, mesh: DeviceMesh) -> None:
    """fully_shard each decoder layer (wrapped or not), then the root for embeddings, norm and lm_head."""
    apply_fixes()  # an older torch's FSDP2 cannot shard the uint8 4-bit weights without them (torch_versions.py)
    policies = fsdp_policies(fsdp, torch.device(mesh.device_type))
    for parent, name in layer_slots(model):
        fully_shard(getattr(parent, name), mesh=mesh, reshard_after_forward=fsdp.reshard_after_forward, **policies)
    # the root (embeddings, final norm, head) stays gathered from forward to backward: the chunked loss runs the
    # head after the forward returns, and backward would gather it again at once anyway
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **policies)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # sum, not average, across ranks: the loss is already normalized by the global token count
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM


def uses_fsdp(fsdp: FSDPConfig, world_size: int) -> bool:
    """Several ranks, offload or a mixed-precision policy need FSDP2 (the policy is FSDP2's, so without the wrap
    one process would silently compute in storage dtypes); otherwise the wrap would only add copies (measured 8%
    fewer tokens/s, tiny_cpu, one process)."""
    return world_size > 1 or fsdp.cpu_offload or fsdp.param_dtype is not None


def sharded_meta_model(cfg: Config, hf_config: PretrainedConfig, mesh: DeviceMesh, shard: bool = True,
                       sampling: bool = False) -> peft.PeftModel:
    """Meta build -> checkpointing -> fully_shard (where FSDP is used): the model as this rank will hold it,
    before a byte is allocated. Training then allocates and loads it; the planner only measures it. `sampling`:
    for the sampler, whose rows hold one prompt each, whatever the recipe packs."""
    device_type = mesh.device_type if mesh is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    needs = attention_needs(hf_config)
    several = cfg.several_samples_a_row and not sampling
    attention = resolve_attention(cfg.model.attn_implementation, several, device_type, needs)
    refuse_row_position_scaling(needs, several, cfg.data.context_length)
    split = row_split(cfg.fsdp.context_parallel)
    if split.splits:  # the per-sample kernel is the one that trades the row's parts for heads around it
        attention = refuse_blockwise_dropout(VARLEN_SDPA, needs)
    model = build_meta_model(cfg, hf_config, attention)
    if split.splits:
        assert split.group is not None, "a split has its group"
        split_attention(decoder_layers(model), hf_config, HeadTrade(split.group, split.degree, split.index))
    tiles = cfg.activation_checkpointing
    if tiles.mlp_tile_tokens:
        tile_mlps(decoder_layers(model), tiles.mlp_tile_tokens, cfg.lora.dropout,
                  router_loss_coefficient(hf_config, cfg.train.kind.generates) is not None)
    if tiles.attention_tile_tokens:
        tile_attention_sides(decoder_layers(model), tiles.attention_tile_tokens, cfg.lora.dropout)
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if shard and uses_fsdp(cfg.fsdp, mesh.size()):
        shard_model(model, cfg.fsdp, mesh)
    return model
