"""A vision-language checkpoint's image side, trained (`lora.train_projector`, `lora.target_vision_tower`): the
projector in full (kept unquantized, in lora.dtype) and LoRA on the vision tower's linears, as PEFT trains them with
`modules_to_save` and a LoRA config that names the tower's modules.

The image side stays whole on every rank (loading/vision_encoder.py), so ranks whose micro-batches differ in images
still never wait on each other in its forward. Trained, it is registered under the causal LM as `image_side`, after
FSDP2 sharded the decoder (so FSDP2 leaves it alone): the optimizer, the checkpoint, the adapter's export and import
see its trainable tensors as they see the decoder's, and distributed/grad_sync.py sums their gradients over the ranks
on the step's last micro-batch (a rank without images adds zeros).
"""

from __future__ import annotations

import re
from typing import Any, cast

import bitsandbytes as bnb
import peft
import torch
from torch import nn

from qlora_fsdp.config import Config
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.families import ImageFamily
from qlora_fsdp.loading.names import PEFT_PREFIX

IMAGE_SIDE = "image_side"  # the trained image side's name under the causal LM
ADAPTER = "default"


def trains_image_side(cfg: Config) -> bool:
    return cfg.lora.train_projector or cfg.lora.target_vision_tower


def projector_modules(base: nn.Module, family: ImageFamily) -> list[str]:
    """The projector's modules in the base model, a ModuleList's items one by one (PEFT's modules_to_save wraps a
    module that computes, which a ModuleList does not)."""
    names = []
    for name in family.projector:
        module = base.get_submodule(name)
        names += [f"{name}.{i}" for i in range(len(module))] if isinstance(module, nn.ModuleList) else [name]
    return names


def under(name: str, prefixes: list[str]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def tower_linears(base: nn.Module, projector: list[str]) -> list[str]:
    """The vision tower's linears (exactly nn.Linear or 4-bit: not attention pooling's out_proj, which its module
    reads as a weight, never calling it)."""
    return [name for name, module in base.named_modules()
            if type(module) in (nn.Linear, bnb.nn.Linear4bit) and not under(name, projector)]


def make_trainable(base: nn.Module, cfg: Config, family: ImageFamily) -> None:
    """The projector trainable in full and LoRA on the tower's linears, as the recipe asks (the rest frozen)."""
    base.requires_grad_(False)
    projector = projector_modules(base, family)
    dtype = TORCH_DTYPES[cfg.lora.dtype]
    if cfg.lora.target_vision_tower:  # first: PEFT's injection freezes all but its LoRA
        config = peft.LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                                 use_rslora=cfg.lora.use_rslora, target_modules=tower_linears(base, projector))
        peft.inject_adapter_in_model(config, base, adapter_name=ADAPTER)
        for name, parameter in base.named_parameters():
            if ".lora_" in name:
                parameter.data = parameter.data.to(dtype)
    trained = projector if cfg.lora.train_projector else []
    for name in trained:
        module = base.get_submodule(name).to(dtype).requires_grad_(True)
        casting = InLoraDtype(dtype)
        module.register_forward_pre_hook(casting.before)
        module.register_forward_hook(casting.after)
    cast(Any, base).trained_projector = trained  # what the adapter names as modules_to_save


class InLoraDtype:
    """A trained projector computes in lora.dtype between the tower and the decoder, which compute in the compute
    dtype: its input cast in, its output cast back."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self.came_in = dtype, dtype

    def before(self, _module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        self.came_in = args[0].dtype
        return tuple(arg.to(self.dtype) if isinstance(arg, torch.Tensor) and arg.is_floating_point() else arg
                     for arg in args)

    def after(self, _module: nn.Module, _args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        return output.to(self.came_in)


def attach_trained(model: nn.Module, base: nn.Module) -> None:
    """The trained image side under the causal LM (after sharding: FSDP2 leaves it whole)."""
    causal_lm = cast(Any, model).get_base_model() if hasattr(model, "get_base_model") else model
    causal_lm.add_module(IMAGE_SIDE, base)


def peft_settings(model: nn.Module, full_prefix: str, decoder_targets: str | list[str] | None,
                  lora_modules: list[str]) -> dict[str, Any]:
    """adapter_config.json's target_modules and modules_to_save for a trained image side (as PEFT matches them
    on the checkpoint's full model: the base model under `full_prefix`); {} without one."""
    causal_lm = cast(Any, model).get_base_model() if hasattr(model, "get_base_model") else model
    base = getattr(causal_lm, IMAGE_SIDE, None)
    if base is None:
        return {}
    side = IMAGE_SIDE + "."
    names = [name.removeprefix(PEFT_PREFIX) for name in lora_modules]
    tower = [full_prefix + name.removeprefix(side) for name in names if name.startswith(side)]
    settings: dict[str, Any] = {}
    if base.trained_projector:
        settings["modules_to_save"] = [full_prefix + name for name in base.trained_projector]
    if tower:
        decoder = [name for name in names if not name.startswith(side)]
        pattern = decoder_targets if isinstance(decoder_targets, str) else None
        settings["target_modules"] = exact_targets(tower, decoder, pattern)
    return settings


def exact_targets(tower: list[str], decoder: list[str], decoder_pattern: str | None) -> str:
    """One regex for PEFT: the decoder's LoRA modules (its pattern, or their names) or exactly the tower's."""
    parts = [decoder_pattern] if decoder_pattern else [re.escape(name) for name in decoder]
    return "|".join([*parts, *(re.escape(name) for name in tower)])
