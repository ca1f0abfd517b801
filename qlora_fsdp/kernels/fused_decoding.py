"""GRPO's decoding through the fused kernels (`generation.kernels`): for one generation call, every 4-bit
linear (with its LoRA adapter) runs `nf4_lora_matmul` at decoding's row counts, and a decoding step's attention
runs over the live part of the cache (`decode_attention`).

Where: RTX 3090/4090 (sm86/sm89) and H100/H200 (sm90) with Triton, and a CPU under TRITON_INTERPRET=1 (the tests).
Elsewhere `auto` keeps bitsandbytes and sdpa and says so once; `fused` refuses in one line.

What stays on today's path, module by module: more than `MAX_FUSED_ROWS` rows (the prompt's forward: cuBLAS on
the dequantized weight wins there); adapters disabled, merged, several or DoRA; an attention layer with a sliding
window, soft-capping or sinks, or a cache layer without a live-length counter; a mask that is not a tensor.
The adapters are cast to the activations' dtype once per call, not once per step.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import bitsandbytes as bnb
import torch
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers import AttentionInterface, PretrainedConfig
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from qlora_fsdp.errors import ConfigError
from qlora_fsdp.kernels.decode_attention import decode_attention
from qlora_fsdp.kernels.nf4_matmul import interpreting, nf4_lora_matmul, packed_nf4, triton
from qlora_fsdp.layers.generation_attention import BLOCKWISE_GENERATION

MAX_FUSED_ROWS = 256
FUSED_CAPABILITIES = {(8, 6): "RTX 3090", (8, 9): "RTX 4090", (9, 0): "H100/H200"}
FUSED_ATTENTION = "fused_decode"
SAID: list[str] = []  # the reasons already printed by this process
KERNEL_CALLS: Counter[str] = Counter()  # "linear", "attention": the kernels' calls in this process


def kernels_unavailable(device: torch.device, forced: bool = False) -> str | None:
    """Why the fused kernels cannot run here, or None where they can (`forced`: a CPU under the interpreter too)."""
    if triton is None:
        return "Triton is not installed"
    if device.type != "cuda":
        if device.type == "cpu" and forced and interpreting():
            return None
        return f"a {device.type.upper()} (the kernels run on sm86, sm89 and sm90 GPUs)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) not in FUSED_CAPABILITIES:
        name = torch.cuda.get_device_name(device)
        return f"{name} (sm{major}{minor}; the kernels are built for sm86, sm89 and sm90)"
    return None


def kernels_wanted(setting: str, device: torch.device) -> bool:
    """`generation.kernels`: off; auto (where they run, else said once); fused (refused where they cannot;
    on a CPU only under TRITON_INTERPRET=1, as the tests run them)."""
    if setting == "off":
        return False
    reason = kernels_unavailable(device, forced=setting == "fused")
    if reason is None:
        return True
    if setting == "fused":
        raise ConfigError(f"generation.kernels: fused cannot run on {reason}; set it to auto or off")
    if reason not in SAID:
        SAID.append(reason)
        print(f"GRPO generation: decoding through bitsandbytes and sdpa on {reason}", flush=True)
    return False


class AdapterCopies:
    """Each LoRA linear's A and B in the activations' dtype, cast on first use in a call and kept for it."""

    def __init__(self) -> None:
        self.copies: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def of(self, module: Any, adapter: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (id(module), dtype)
        if key not in self.copies:
            self.copies[key] = (module.lora_A[adapter].weight.to(dtype), module.lora_B[adapter].weight.to(dtype))
        return self.copies[key]


def single_adapter(module: Any) -> str | None:
    """The one active plain-LoRA adapter whose forward the kernel reproduces, or None."""
    adapters = [a for a in module.active_adapters if a in module.lora_A]
    if module.disable_adapters or module.merged or len(adapters) != 1 or adapters[0] in module.lora_variant:
        return None
    return adapters[0]


def base_4bit(module: nn.Module) -> bnb.nn.Linear4bit | None:
    base = module.get_base_layer() if isinstance(module, LoraLayer) else module
    return base if isinstance(base, bnb.nn.Linear4bit) else None


def fused_linear(module: nn.Module, base: bnb.nn.Linear4bit, copies: AdapterCopies, original: Callable[..., Any],
                 x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    state = getattr(base.weight, "quant_state", None)  # FSDP2's gathered parameter has none: the module's
    state = state if state is not None else getattr(base, "quant_state", None)
    if rows > MAX_FUSED_ROWS or state is None or state.quant_type != "nf4" or module.training or args or kwargs:
        return original(x, *args, **kwargs)
    weight = packed_nf4(base.weight, state)
    KERNEL_CALLS["linear"] += 1
    if not isinstance(module, LoraLayer):
        return nf4_lora_matmul(x, weight, bias=base.bias)
    adapter = single_adapter(module)
    if adapter is None:
        return original(x, *args, **kwargs)
    lora_a, lora_b = copies.of(module, adapter, x.dtype)
    return nf4_lora_matmul(x, weight, lora_a, lora_b, float(module.scaling[adapter]), base.bias)


def fused_modules(model: nn.Module) -> list[nn.Module]:
    """The LoRA linears over a 4-bit base, and the 4-bit linears no adapter wraps."""
    wrapped = {id(m.get_base_layer()) for m in model.modules() if isinstance(m, LoraLayer)}
    return [m for m in model.modules()
            if (isinstance(m, LoraLayer) and base_4bit(m) is not None)
            or (isinstance(m, bnb.nn.Linear4bit) and id(m) not in wrapped)]


@contextmanager
def fused_linears(model: nn.Module) -> Iterator[int]:
    """Every 4-bit linear's forward through the kernel for the call (an instance attribute over whatever forward
    it had: PEFT's, or the shared-input one); restored on exit. Yields how many."""
    modules = fused_modules(model)
    copies = AdapterCopies()
    saved = [m.__dict__.get("forward") for m in modules]
    for module in modules:
        base = base_4bit(module)
        assert base is not None
        module.forward = functools.partial(fused_linear, module, base, copies, module.forward)
    try:
        yield len(modules)
    finally:
        for module, forward in zip(modules, saved, strict=True):
            if forward is None:
                del module.forward
            else:
                module.forward = forward


class LiveCache:
    """The call's static cache, where the attention reads each layer's filled length (a device counter)."""

    def __init__(self, fallback: str) -> None:
        self.fallback = fallback  # the kernel generation would have used
        self.cache: Any = None

    def length(self, layer_index: int | None) -> torch.Tensor | None:
        layers = getattr(self.cache, "layers", None)
        if layers is None or layer_index is None or layer_index >= len(layers):
            return None
        layer = layers[layer_index]
        counter = getattr(layer, "cumulative_length", None)
        if getattr(layer, "is_sliding", False) or not isinstance(counter, torch.Tensor):
            return None
        return counter


LIVE: list[LiveCache] = []  # the calls in progress (one: generation calls do not nest)


def watch(cache: Any) -> None:
    """The cache a generate call is about to fill: the fused attention reads its live length (a no-op without
    the kernels)."""
    if LIVE:
        LIVE[-1].cache = cache


def plain_causal(module: nn.Module) -> bool:
    """No window, soft-capping or sinks on this attention layer (those decode through today's path)."""
    config = getattr(module, "config", None)
    capped = getattr(config, "attn_logit_softcapping", None) is not None
    windowed = getattr(module, "sliding_window", None) is not None
    return not (capped or windowed or hasattr(module, "sinks"))


def valid_slots(mask: torch.Tensor | None) -> torch.Tensor | None:
    """(rows, slots) booleans of the last query's mask row: sdpa's booleans or eager's additive floats."""
    if mask is None:
        return None
    last = mask[:, 0, -1, :]
    return last if last.dtype == torch.bool else last == 0


def fused_decode_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:
    live = LIVE[-1] if LIVE else None
    fallback = ALL_ATTENTION_FUNCTIONS[live.fallback if live is not None else "sdpa"]
    length = live.length(getattr(module, "layer_idx", None)) if live else None
    mask_ok = attention_mask is None or isinstance(attention_mask, torch.Tensor)
    if query.shape[2] != 1 or length is None or not plain_causal(module) or not mask_ok or dropout:
        return fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    KERNEL_CALLS["attention"] += 1
    return decode_attention(query, key, value, length, valid_slots(attention_mask), scale), None


# the masks transformers builds for it: sdpa's booleans, which the kernels it falls back to read too
AttentionInterface.register(FUSED_ATTENTION, fused_decode_forward)
AttentionMaskInterface.register(FUSED_ATTENTION, sdpa_mask)
BOOLEAN_MASK_KERNELS = ("sdpa", BLOCKWISE_GENERATION)  # the kernels the fused attention may fall back to


@contextmanager
def fused_decoding(model: nn.Module, setting: str, device: torch.device) -> Iterator[LiveCache | None]:
    """The kernels for one generation layout's calls, where `generation.kernels` and the device allow; yields
    the LiveCache each call hands its cache to (None: today's path)."""
    if not kernels_wanted(setting, device):
        yield None
        return
    config = cast(PretrainedConfig, model.config)
    chosen = config._attn_implementation
    live = LiveCache(chosen)
    if chosen in BOOLEAN_MASK_KERNELS:  # eager (each model's own function), flex and flash keep their own path
        config._attn_implementation = FUSED_ATTENTION
    LIVE.append(live)
    try:
        with fused_linears(model):
            yield live
    finally:
        LIVE.remove(live)
        config._attn_implementation = chosen
