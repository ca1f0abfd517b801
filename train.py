"""Fine-tune a 4-bit base model with LoRA under FSDP2.

    torchrun --nproc_per_node 2 train.py --recipe tiny_cpu [key=value ...]
    python train.py --recipe tiny_cpu optim.lr=3e-4 data.micro_batch_size=4
    python train.py --recipe tiny_cpu --print-config
    torchrun --nproc_per_node 2 train.py --recipe tiny_cpu --resume    # continue from the latest checkpoint
"""

from __future__ import annotations

import sys

# the command line lives in the package (qlora_fsdp.cli), shared with scripts/plan.py and tests/fault_run.py
from qlora_fsdp.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
