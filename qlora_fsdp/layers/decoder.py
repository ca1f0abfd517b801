"""A model's decoder layers, found from the model; recurrent token mixers (Qwen3.5's Gated DeltaNet layers), whose
short convolution and recurrent state would run across the samples of a packed row, seeing one sample at a time;
and the start-up line that says what a family's attention computes."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import peft
import torch
from torch import nn
from transformers import PretrainedConfig

from qlora_fsdp.errors import ModelLoadError
from qlora_fsdp.families import attention_needs
from qlora_fsdp.layers.attention import REGISTERED_NAME, VARLEN_SDPA, sample_bounds


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, found from the model (its `_no_split_modules`, else the longest ModuleList)."""
    base = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    # by the class or a base of it: fully_shard swaps a module's class for a subclass (FSDPLlamaDecoderLayer)
    layers = [m for m in base.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if layers:
        return layers
    lists = [m for m in base.modules() if isinstance(m, nn.ModuleList) and len({type(c) for c in m}) == 1]
    if not lists:
        raise ModelLoadError(f"cannot find the decoder layers of {type(base).__name__}")
    longest: nn.ModuleList = max(lists, key=len)
    return list(longest)


def describe_attention(model: nn.Module) -> str:
    """The start-up line: the kernel the run uses and what of the family's attention it computes."""
    config = getattr(model, "config", None)
    assert isinstance(config, PretrainedConfig), "a transformers model (or PEFT's wrapper of one) has a config"
    kernel = VARLEN_SDPA if config._attn_implementation == REGISTERED_NAME else config._attn_implementation
    needs, window = attention_needs(config), getattr(config, "sliding_window", None)
    computed = [f"sliding windows of {window} tokens"] if window and getattr(config, "use_sliding_window", True) else []
    computed += ["logit soft-capping"] * needs.softcap + ["attention sinks"] * needs.sinks
    if any(recurrent_mixers(layer) for layer in decoder_layers(model)):
        computed.append("recurrent layers one sample at a time")
    return f"attention: {kernel} for {config.model_type}" + (f" ({', '.join(computed)})" if computed else "")


def recurrent_mixers(layer: nn.Module) -> list[nn.Module]:
    """A decoder layer's token mixers that carry state along the tokens: those holding a short convolution."""
    return [child for child in layer.children() if any(isinstance(m, nn.Conv1d) for m in child.modules())]


def run_mixers_per_sample(layers: list[nn.Module]) -> None:
    """Packed rows reach a recurrent mixer one sample at a time (its state starts afresh at each sample's start).

    The decoder layer sees the position ids (with the batch's sample bounds); a pre-hook hands the bounds to its
    mixers, whose forward splits the row. Checkpointing's recompute runs the layer again, and the hook with it."""
    for layer in layers:
        mixers = recurrent_mixers(layer)
        if not mixers:
            continue
        for mixer in mixers:
            mixer.forward = functools.partial(per_sample_forward, mixer, mixer.forward)
        layer.register_forward_pre_hook(functools.partial(hand_bounds_to, mixers), with_kwargs=True)


def hand_bounds_to(mixers: list[nn.Module], _layer: nn.Module, args: tuple, kwargs: dict) -> None:
    positions = kwargs.get("position_ids")
    bounds = None
    if isinstance(positions, torch.Tensor) and positions.ndim == 2:
        bounds = getattr(positions, "sample_bounds", None) or [sample_bounds(row) for row in positions]
    for mixer in mixers:
        vars(mixer)["packed_bounds"] = bounds  # a plain attribute, read by per_sample_forward


def per_sample_forward(mixer: nn.Module, forward: Callable[..., torch.Tensor], hidden_states: torch.Tensor,
                       *args: Any, **kwargs: Any) -> torch.Tensor:
    bounds = getattr(mixer, "packed_bounds", None)
    if bounds is None or all(len(row) == 1 for row in bounds) or kwargs.get("cache_params") is not None:
        return forward(hidden_states, *args, **kwargs)
    rows = []
    for row, row_bounds in enumerate(bounds):
        parts = [forward(hidden_states[row : row + 1, start:end], *args, **kwargs) for start, end in row_bounds]
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows)


def attention_modules(layer: nn.Module) -> list[nn.Module]:
    """A decoder layer's attention modules, by transformers' naming (LlamaAttention, Llama4TextAttention, ...), whose
    forward passes extra keywords on to the kernel."""
    return [m for m in layer.modules() if type(m).__name__.endswith("Attention") and takes_keywords(m.forward)]


def takes_keywords(function: Callable[..., Any]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(function).parameters.values())


def give_attention_the_positions(layers: list[nn.Module]) -> None:
    """Packed rows reach the attention kernel with their position ids, which mark where a sample starts. Some
    families' decoder layers take them and do not pass them on (Llama 4's); without them the kernel would attend
    across the samples of a row. A layer's pre-hook keeps them, its attention's pre-hook adds them where missing."""
    for layer in layers:
        attentions = attention_modules(layer)
        if not attentions:
            continue
        layer.register_forward_pre_hook(functools.partial(keep_positions_for, attentions), with_kwargs=True)
        for attention in attentions:
            attention.register_forward_pre_hook(add_kept_positions, with_kwargs=True)


def keep_positions_for(attentions: list[nn.Module], _layer: nn.Module, args: tuple, kwargs: dict) -> None:
    for attention in attentions:
        vars(attention)["kept_position_ids"] = kwargs.get("position_ids")  # a plain attribute, read below


def add_kept_positions(attention: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    kept = getattr(attention, "kept_position_ids", None)
    if kept is None or kwargs.get("position_ids") is not None:
        return None
    return args, {**kwargs, "position_ids": kept}
