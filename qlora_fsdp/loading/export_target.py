"""`export.target`: the loaded model made to compute with its weights as the exported GGUF will hold them (each
LoRA linear and 4-bit linear through gguf_target/through_export.py, the frozen embeddings and head rounded once), each
weight at the type llama-quantize picks for it (gguf_target/tensor_types.py)."""

from __future__ import annotations

from typing import Any

import bitsandbytes as bnb
import peft

from qlora_fsdp.config import Config
from qlora_fsdp.errors import ConfigError
from qlora_fsdp.gguf_target.tensor_types import ModelShape, tensor_type
from qlora_fsdp.gguf_target.through_export import install_frozen, install_lora, round_in_place, rounding_kernel
from qlora_fsdp.layers.experts4bit import Experts4bit
from qlora_fsdp.loading.names import weight_key

LoraLinear = peft.tuners.lora.LoraLayer


def model_shape(model: Any) -> ModelShape:
    config = model.config.get_text_config()
    n_layers, heads = config.num_hidden_layers, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    # llama.cpp's LLM_TYPE_70B: a llama of 80 layers with grouped-query attention (Llama 2/3 70B)
    llama_70b = config.model_type == "llama" and n_layers == 80 and kv_heads != heads
    return ModelShape(n_layers, bool(getattr(config, "tie_word_embeddings", False)), llama_70b)


def train_through_export(model: Any, cfg: Config, counted_for: int = 1, fused: bool | None = None) -> dict[str, str]:
    """Install the exported weights' forward on every 4-bit linear and round the embeddings and an unquantized
    head in place; the GGUF type of each weight, by its checkpoint key. `counted_for`: the planner's (SearchCache);
    `fused`: the rounding kernel's (the planner's: as on the GPU it plans for), else by export.rounding_kernel."""
    target = cfg.export.target
    if target == "none":
        return {}
    fused = rounding_kernel(cfg.export.rounding_kernel) if fused is None else fused
    shape = model_shape(model)
    types: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, Experts4bit):
            raise ConfigError(f"export.target: {weight_key(name)} holds mixture-of-experts weights, which training "
                              "through the export does not round yet; set export.target: none")
        if isinstance(module, LoraLinear):
            base = module.get_base_layer()
            if not isinstance(base, bnb.nn.Linear4bit):
                raise ConfigError(f"export.target: {weight_key(name)} is a LoRA target that is not a 4-bit linear; "
                                  "set export.target: none")
            types[weight_key(name)] = tensor_type(target, weight_key(name), base.in_features, shape)
            install_lora(module, types[weight_key(name)], counted_for, fused)
        elif isinstance(module, bnb.nn.Linear4bit) and ".base_layer" not in name:
            types[weight_key(name)] = tensor_type(target, weight_key(name), module.in_features, shape)
            install_frozen(module, types[weight_key(name)], fused)
    for layer in unique_frozen(model):
        key = next(weight_key(n) for n, m in model.named_modules() if m is layer)
        types[key] = tensor_type(target, key, layer.weight.shape[1], shape)
        round_in_place(layer.weight, types[key])
    return types


def unique_frozen(model: Any) -> list[Any]:
    """The input embeddings, and the head where it is an unquantized matrix of its own (not tied to them)."""
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    frozen = [embeddings]
    if head is not None and not isinstance(head, bnb.nn.Linear4bit) and head.weight is not embeddings.weight:
        frozen.append(head)
    return frozen
