"""The model as a rank trains (or samples from) it: built, sharded, allocated and filled, in that order."""

from __future__ import annotations

from pathlib import Path

import peft
import torch

from qlora_fsdp.config import Config
from qlora_fsdp.distributed import DistInfo
from qlora_fsdp.layers.decoder import decoder_layers
from qlora_fsdp.layers.embedding_noise import add_embedding_noise
from qlora_fsdp.loading.adapter import load_adapter_into
from qlora_fsdp.loading.checkpoint import load_hf_config
from qlora_fsdp.loading.export_target import train_through_export
from qlora_fsdp.loading.fill import load_weights, materialize
from qlora_fsdp.loading.sharding import sharded_meta_model


def build_sharded_model(cfg: Config, info: DistInfo, shard: bool = True, sampling: bool = False) -> peft.PeftModel:
    """Meta build -> activation checkpointing -> fully_shard -> allocate -> stream and quantize weights
    (`sampling`: for the sampler, one prompt a row)."""
    assert "auto" not in (cfg.model.dtype, cfg.quant.compute_dtype), (
        "build_sharded_model takes resolved dtypes: the config of run/description.py's describe_run (or planned_run)")
    model = sharded_meta_model(cfg, load_hf_config(cfg), info.mesh, shard, sampling)
    offload = shard and cfg.fsdp.cpu_offload  # offload always comes with FSDP (sharding.uses_fsdp)
    materialize(model, info.device, torch.device("cpu") if offload else info.device)
    load_weights(model, cfg, info.device)
    if cfg.model.adapter:  # training goes on from a saved adapter (an SFT run's, for preference tuning)
        load_adapter_into(model, Path(cfg.model.adapter))
    train_through_export(model, cfg)  # export.target: the forward computes with the exported GGUF's weights
    if cfg.train.neftune_alpha:
        add_embedding_noise(model, cfg.train.neftune_alpha)
    if cfg.train.compile:
        compile_decoder_layers(model)
    return model


def compile_decoder_layers(model: peft.PeftModel) -> None:
    """Each layer compiled in place (checkpointing and FSDP2 wrap it from outside, unchanged). Layers share
    their code, and parameters are graph inputs, so one compiled graph serves them all."""
    for layer in decoder_layers(model):
        layer.compile()
