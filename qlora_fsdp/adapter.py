"""The adapter in PEFT format: gathered from the shards, written by rank 0, loadable without this repo."""

from __future__ import annotations

from pathlib import Path

import peft
import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PreTrainedTokenizerBase

from qlora_fsdp.sharding import clean_name

ADAPTER_NAME = "default"


def peft_adapter_key(name: str, adapter: str) -> str:
    """PEFT's on-disk key: no adapter name, and DoRA's magnitude without its `.weight` suffix."""
    name = name.replace(f".{adapter}.", ".")
    return name.removesuffix(".weight") if name.endswith("lora_magnitude_vector.weight") else name


def gather_trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) trainable tensors on the CPU; a collective, so every rank must call it."""
    state = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            full = param.detach().full_tensor() if isinstance(param, DTensor) else param.detach()
            state[clean_name(name)] = full.cpu().clone()
    return state


def export_adapter(model: peft.PeftModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path,
                   base_model_path: str, is_main: bool) -> None:
    """adapter_config.json + adapter_model.safetensors (+ tokenizer), loadable by PeftModel.from_pretrained."""
    state = gather_trainable_state(model)
    if not is_main:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    adapter_state = {peft_adapter_key(name, ADAPTER_NAME): tensor for name, tensor in state.items()}
    save_file({k: v.contiguous() for k, v in adapter_state.items()}, out_dir / "adapter_model.safetensors",
              metadata={"format": "pt"})
    config = model.peft_config[ADAPTER_NAME]
    config.base_model_name_or_path = base_model_path
    config.init_lora_weights = True  # we initialized them ourselves; loaders should use PEFT's default
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
