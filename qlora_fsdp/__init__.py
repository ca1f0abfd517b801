"""QLoRA + FSDP2 fine-tuning.

    from qlora_fsdp import train, load_config
    summary = train("tiny_cpu", ["train.max_steps=20", "train.output_dir=outputs/notebook"])
    summary = train(load_config("llama3_8b_1x4090"))   # or a Config you built or edited

`train` is the code path of train.py (one process here; under torchrun, every rank calls it).
"""

import logging
import warnings

# On AVX512-BF16 CPUs bitsandbytes tries to fetch a kernel from the hub and warns when it can't; we never
# fetch code at run time, and its portable CPU kernel is what we use (see model.make_meta_linear4bit).
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
# PEFT still calls a transformers property deprecated in 5.x; nothing a user can act on.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


__all__ = ["load_config", "train"]


def __getattr__(name: str):  # heavy imports (torch, transformers) only when the API is used
    if name == "train":
        from qlora_fsdp.api import train

        return train
    if name == "load_config":
        from qlora_fsdp.config import load_config

        return load_config
    raise AttributeError(f"module 'qlora_fsdp' has no attribute {name!r}")
