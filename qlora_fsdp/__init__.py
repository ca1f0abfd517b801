"""QLoRA + FSDP2 fine-tuning."""

import logging
import warnings

# On AVX512-BF16 CPUs bitsandbytes tries to fetch a kernel from the hub and warns when it can't; we never
# fetch code at run time, and its portable CPU kernel is what we use (see model.make_meta_linear4bit).
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
# PEFT still calls a transformers property deprecated in 5.x; nothing a user can act on.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
