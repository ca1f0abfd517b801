"""train.py with an injected fault, for the resume tests (runs under torchrun like train.py).

    torchrun ... tests/fault_run.py --nan-steps 3,4 -- --recipe tiny_cpu key=value ...
    torchrun ... tests/fault_run.py --die-saving 4 -- --recipe tiny_cpu key=value ...
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import qlora_fsdp.training.checkpoints as checkpoint_module
import qlora_fsdp.training.loop as trainer_module
from qlora_fsdp.cli import main


def inject_nan(steps: set[int]) -> None:
    """Poison the gradients and loss of the given optimizer steps (counted from this process's start)."""
    original = trainer_module.accumulate_gradients
    calls = [0]

    def poisoned(model, micro_batches, device, forward_loss):  # noqa: ANN001, ANN202
        calls[0] += 1
        result = original(model, micro_batches, device, forward_loss)
        if calls[0] in steps:
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.mul_(math.nan)
            result.loss = math.nan
        return result

    trainer_module.accumulate_gradients = poisoned


def die_while_saving(step: int) -> None:
    """Kill rank 0 hard after the checkpoint's data is written but before it is committed."""
    original = checkpoint_module.write_synced

    def deadly(path: Path, text: str) -> None:
        if path.parent.name == f"{checkpoint_module.TMP_PREFIX}{checkpoint_module.checkpoint_name(step)}":
            os._exit(9)
        original(path, text)

    checkpoint_module.write_synced = deadly


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--nan-steps", default="")
    parser.add_argument("--die-saving", type=int)
    args, rest = parser.parse_known_args()
    if args.nan_steps:
        inject_nan({int(s) for s in args.nan_steps.split(",")})
    if args.die_saving:
        die_while_saving(args.die_saving)
    sys.exit(main([a for a in rest if a != "--"]))
