"""What a generation call holds on a rank, from the architecture and the model as sharded: the KV cache and the
weights a layout gathers. The plan prices the layouts with these; a run whose recipe leaves the layout to `auto`
asks them whether a layout's gathered bytes fit the memory free now (generation/plan.py's rule)."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from qlora_fsdp.distributed import all_reduce_max

FREE_MEMORY_MARGIN = 0.9  # of the free bytes: the allocator's fragmentation and the decoding temporaries
CACHE_BUCKET = 64  # tokens: a cache sized to the next multiple keeps one compiled decoding step across calls


def head_dim(hf: PretrainedConfig) -> int:
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def kv_cache_bytes(hf: PretrainedConfig, rows: int, tokens: int, itemsize: int) -> int:
    """Keys and values of every layer for `rows` rows of `tokens` tokens; a sliding-window layer keeps its window."""
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    per_token = 2 * kv_heads * head_dim(hf) * itemsize
    types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None) or tokens
    kept = [min(tokens, window) if kind == "sliding_attention" else tokens for kind in types]
    return rows * per_token * sum(kept)


def unsharded_extra(param: torch.Tensor) -> int:
    """Bytes a parameter adds to this rank's shard of it when gathered whole."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return (param.numel() - local.numel()) * param.element_size()


def gathered_extra_bytes(model: nn.Module) -> int:
    """Bytes the whole model would add to this rank's shards if every sharded parameter were gathered."""
    return sum(unsharded_extra(param) for param in model.parameters())


def fits_now(model: nn.Module, extra: int, rows: int, tokens: int, device: torch.device) -> bool:
    """Whether every rank has room for `extra` gathered bytes beside its KV cache now (the same answer on every
    rank: a collective)."""
    if device.type != "cuda":
        return True  # host memory: the plan checks it
    config = getattr(model, "config", None)
    assert isinstance(config, PretrainedConfig), "a transformers model (or PEFT's wrapper of one) has a config"
    embeddings = cast(Callable[[], nn.Module], model.get_input_embeddings)()
    itemsize = cast(torch.Tensor, embeddings.weight).element_size()  # the cache holds keys in the compute dtype
    need = extra + kv_cache_bytes(config.get_text_config(), rows, tokens, itemsize)
    free = torch.cuda.mem_get_info(device)[0]
    short = float(need > FREE_MEMORY_MARGIN * free)
    return (all_reduce_max(short, device) if dist.is_initialized() else short) == 0.0
