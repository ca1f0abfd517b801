"""How a parameter is named in the wrapped model, in PEFT's adapter files and in the base model's weight files."""

from __future__ import annotations

from qlora_fsdp.layers.reward_head import REWARD_HEAD

AC_WRAPPER_PREFIX = "_checkpoint_wrapped_module."  # torch's activation-checkpoint wrapper
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model


def clean_name(name: str) -> str:
    """Parameter name without the activation-checkpoint wrapper's prefix, as PEFT and adapter files spell it."""
    return name.replace(AC_WRAPPER_PREFIX, "")


def weight_key(param_name: str) -> str:
    """The base model's weight-file key of a parameter of the PEFT-wrapped model."""
    name = clean_name(param_name).replace(".base_layer.", ".")
    return name.removeprefix(PEFT_PREFIX)


REWARD_HEAD_KEY = f"{PEFT_PREFIX}{REWARD_HEAD}.weight"  # a reward model's head, as PEFT's SEQ_CLS adapters name it


def is_lora_tensor(name: str) -> bool:
    """A tensor the adapter initializes (LoRA/DoRA, a reward model's head), not a base tensor that trains (a router,
    loaded from the checkpoint)."""
    return ".lora_" in name or clean_name(name) == REWARD_HEAD_KEY
