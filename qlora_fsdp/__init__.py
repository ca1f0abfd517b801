"""QLoRA + FSDP2 fine-tuning."""

import logging

# On AVX512-BF16 CPUs bitsandbytes tries to fetch a kernel from the hub and warns when it can't; we never
# fetch code at run time, and its portable CPU kernel is what we use (see model.make_meta_linear4bit).
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
