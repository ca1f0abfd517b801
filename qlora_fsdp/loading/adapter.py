"""The adapter in PEFT format: gathered from the shards, written by rank 0, loadable without this repo."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import peft
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PreTrainedTokenizerBase

from qlora_fsdp.config import Config, load_config
from qlora_fsdp.errors import ConfigError, ModelLoadError
from qlora_fsdp.layers.expert_lora import ExpertLora, peft_expert_key
from qlora_fsdp.layers.reward_head import REWARD_HEAD, reward_head
from qlora_fsdp.loading.fill import model_layout
from qlora_fsdp.loading.image_side_training import IMAGE_SIDE, peft_settings
from qlora_fsdp.loading.initial_adapter import alpha_factor, converted_for_saving, initialized_layers, trained_half
from qlora_fsdp.loading.layout import CheckpointLayout, lora_target_regex
from qlora_fsdp.loading.names import PEFT_PREFIX, clean_name
from qlora_fsdp.loading.placement import copy_full_into

ADAPTER_NAME = "default"
TRAINING_CONFIG = "training_config.yaml"  # the resolved recipe, next to the PEFT files
REWARD_TASK = "SEQ_CLS"  # PEFT's task type of a reward model's adapter


def refuse_reward_adapter(adapter_dir: Path) -> None:
    """Merge, generation and GGUF export make or run a causal LM; a reward model's adapter scores sequences."""
    config_file = adapter_dir / "adapter_config.json"
    if config_file.is_file() and json.loads(config_file.read_text()).get("task_type") == REWARD_TASK:
        raise ModelLoadError(f"{adapter_dir} is a reward model's adapter (task_type {REWARD_TASK}): it scores "
                             "sequences and makes no text to merge, sample or export; use it as a GRPO reward "
                             "(grpo.rewards: function reward_model) or with PEFT's "
                             "AutoPeftModelForSequenceClassification")


def peft_adapter_key(name: str, adapter: str) -> str:
    """PEFT's on-disk key: no adapter name, a trained module (modules_to_save) under its own name, and DoRA's
    magnitude without its `.weight` suffix."""
    name = name.replace(f".{adapter}.", ".").replace(".modules_to_save.", ".")
    return name.removesuffix(".weight") if name.endswith("lora_magnitude_vector.weight") else name


def adapter_file_key(param_name: str, layout: CheckpointLayout) -> str:
    """A trainable parameter's key in adapter_model.safetensors: PEFT's, with the checkpoint's full model's names
    (a multimodal checkpoint's decoder sits under `model.language_model.`)."""
    name = clean_name(param_name)
    key = peft_expert_key(name) or peft_adapter_key(name, ADAPTER_NAME)
    return PEFT_PREFIX + layout.full_from_ours(key.removeprefix(PEFT_PREFIX))


def gather_trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) trainable tensors on the CPU; a collective, so every rank must call it. A tensor under two
    names (trained embeddings the head is tied to) is given under both, as PEFT saves its modules_to_save."""
    state = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            detached = param.detach()  # a DTensor's detach is a DTensor
            full = detached.full_tensor() if isinstance(detached, DTensor) else detached
            state[clean_name(name)] = full.cpu().clone()
    return state


def export_adapter(model: peft.PeftModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path,
                   base_model_path: str, is_main: bool, config_yaml: str) -> None:
    """adapter_config.json + adapter_model.safetensors (+ tokenizer), loadable by PeftModel.from_pretrained;
    plus the run's resolved config, so merge and generate quantize and prompt exactly as training did."""
    state = gather_trainable_state(model)
    if not is_main:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    layout = model_layout(model)
    adapter_state = {adapter_file_key(name, layout): tensor for name, tensor in state.items()}
    config = model.peft_config[ADAPTER_NAME]
    assert isinstance(config, peft.LoraConfig), "build.attach_lora makes every adapter from a peft.LoraConfig"
    config.base_model_name_or_path = base_model_path
    config.init_lora_weights = True  # we initialized them ourselves; loaders should use PEFT's default
    lora_modules = [clean_name(name) for name, module in model.named_modules()
                    if hasattr(module, "lora_A") and not isinstance(module, ExpertLora)]  # those are target_parameters
    decoder_only = lora_target_regex(layout, [name for name in lora_modules if f".{IMAGE_SIDE}." not in name])
    if decoder_only is not None:  # PEFT on the multimodal model: the decoder's modules, not the vision tower's
        config.target_modules = decoder_only
    for key, value in peft_settings(model, layout.prefix + ".", config.target_modules, lora_modules).items():
        setattr(config, key, value)  # a trained image side: its projector (modules_to_save), its tower's LoRA
    if reward_head(model) is not None:  # a reward model: PEFT's sequence-classification adapter, its head trained
        saved_whole = [name for name in config.modules_to_save or [] if name != REWARD_HEAD]
        config.task_type, config.modules_to_save = REWARD_TASK, [*saved_whole, REWARD_HEAD]
    if initialized_layers(model):  # PiSSA/OLoRA/LoftQ: PEFT's conversion to rank 2r on the original base
        config = copy.deepcopy(config)
        converted_for_saving(adapter_state, model, lambda name: adapter_file_key(name, layout), config)
        config.init_lora_weights = True
    save_file({k: v.contiguous() for k, v in adapter_state.items()}, out_dir / "adapter_model.safetensors",
              metadata={"format": "pt"})
    config.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(out_dir)
    (out_dir / TRAINING_CONFIG).write_text(config_yaml)


def read_adapter(adapter_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors by PEFT's on-disk key) of a PEFT adapter folder."""
    config_file, weights = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    for needed in (config_file, weights):
        if not needed.is_file():
            raise ModelLoadError(f"{adapter_dir} is not a PEFT adapter folder: {needed.name} is missing")
    return json.loads(config_file.read_text()), load_file(weights)


# adapter_config.json key -> recipe key, for the settings that set the scaling (a shape check cannot see them)
SCALING_KEYS = {"lora_alpha": "lora.alpha", "use_rslora": "lora.use_rslora"}


def check_scaling(saved: dict[str, Any], model: peft.PeftModel, adapter_dir: Path) -> None:
    """The saved adapter scales its update as the model will (alpha/r, or alpha/sqrt(r) with rsLoRA); one saved from
    a PiSSA/OLoRA/LoftQ start is rank 2r with alpha grown to keep that scale."""
    ours = model.peft_config[ADAPTER_NAME]
    grown = alpha_factor(bool(getattr(ours, "use_rslora", False))) if initialized_layers(model) else 1
    for key, recipe_key in SCALING_KEYS.items():
        theirs, mine = saved.get(key, False), getattr(ours, key)  # PEFT before rsLoRA wrote no use_rslora
        if key == "lora_alpha":
            theirs = theirs / grown
        if theirs != mine:
            raise ModelLoadError(f"adapter in {adapter_dir} was trained with {recipe_key}={theirs}, the recipe "
                                 f"says {mine}: pass the settings it was trained with")


@torch.no_grad()
def load_adapter_into(model: peft.PeftModel, adapter_dir: Path) -> None:
    """Put a saved adapter's weights into a model built with the same LoRA settings, sharded or not: each rank
    keeps its FSDP2 dim-0 chunk of every tensor, as the base loader does (the inverse of export_adapter)."""
    saved_config, tensors = read_adapter(adapter_dir)
    check_scaling(saved_config, model, adapter_dir)
    initialized = bool(initialized_layers(model))
    layout = model_layout(model)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        key = adapter_file_key(name, layout)
        saved = tensors.pop(key, None)
        if saved is not None and initialized:  # a converted start's adapter: its trained half
            saved = trained_half(saved, param, key)
        if saved is None or saved.shape != param.shape:  # a DTensor's shape is the whole tensor's
            raise ModelLoadError(f"adapter in {adapter_dir} does not fit the model at '{key}': trained with other "
                                 "lora.r / target_modules settings, or on another base?")
        copy_full_into(param, saved.to(param.dtype))
    if tensors:
        raise ModelLoadError(f"adapter in {adapter_dir} has '{next(iter(tensors))}', which the model lacks")


def config_for_adapter(adapter_dir: Path, recipe: str | None, overrides: list[str]) -> Config:
    """The run's resolved config saved with the adapter, or the given recipe (with overrides either way); for
    merge, generation and export, which refuse a reward model's adapter."""
    refuse_reward_adapter(adapter_dir)
    saved = adapter_dir / TRAINING_CONFIG
    if recipe is None and not saved.is_file():
        raise ConfigError(f"{adapter_dir} has no {TRAINING_CONFIG} (not written by train.py?): pass --recipe with "
                          "the settings it was trained with")
    return load_config(recipe, overrides) if recipe else load_config(str(saved), overrides, saved_by_a_run=True)
