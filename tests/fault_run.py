"""train.py with an injected fault, for the resume and rank-error tests: under torchrun like train.py, or in the
test session's rank pool through `main_with_faults` (each injection is undone when the run ends, since the pool's
processes serve other tests next).

    torchrun ... tests/fault_run.py --nan-steps 3,4 -- --recipe tiny_cpu key=value ...
    torchrun ... tests/fault_run.py --die-saving 4 -- --recipe tiny_cpu key=value ...
    torchrun ... tests/fault_run.py --user-error-step 2 --on-rank 1 -- --recipe tiny_cpu key=value ...
    torchrun ... tests/fault_run.py --disk-full-saving 4 -- --recipe tiny_cpu key=value ...
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch.distributed.checkpoint.filesystem as dcp_filesystem

import qlora_fsdp.objectives.supervised as trainer_module
import qlora_fsdp.outputs.checkpoints as checkpoint_module
from qlora_fsdp.commands.train import main
from qlora_fsdp.errors import DataError


@contextmanager
def patched(module: object, name: str, replacement: object) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def inject_nan(steps: set[int]) -> ExitStack:
    """Poison the gradients and loss of the given optimizer steps (counted from this process's start)."""
    original = trainer_module.accumulate_gradients
    calls = [0]

    def poisoned(model, micro_batches, device, forward_loss, loss_factor=1.0):  # noqa: ANN001, ANN202
        calls[0] += 1
        result = original(model, micro_batches, device, forward_loss, loss_factor)
        if calls[0] in steps:
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.mul_(math.nan)
            result.loss = math.nan
        return result

    return patches((trainer_module, "accumulate_gradients", poisoned))


def die_while_saving(step: int) -> ExitStack:
    """Kill rank 0 hard after the checkpoint's data is written but before it is committed."""
    original = checkpoint_module.write_synced

    def deadly(path: Path, text: str) -> None:
        if path.parent.name == f"{checkpoint_module.TMP_PREFIX}{checkpoint_module.checkpoint_name(step)}":
            os._exit(9)
        original(path, text)

    return patches((checkpoint_module, "write_synced", deadly))


def user_error_at_step(step: int, rank: int | None) -> ExitStack:
    """One rank (every rank with rank=None) raises a user error at the start of an optimizer step, while its peer
    enters the step's collectives (a bad record met mid-run, say)."""
    original = trainer_module.accumulate_gradients
    calls = [0]

    def failing(model, micro_batches, device, forward_loss, loss_factor=1.0):  # noqa: ANN001, ANN202
        calls[0] += 1
        if calls[0] == step and rank in (None, int(os.environ["RANK"])):
            raise DataError(f"injected user error on rank {rank} at step {step}")
        return original(model, micro_batches, device, forward_loss, loss_factor)

    return patches((trainer_module, "accumulate_gradients", failing))


def disk_full_saving(step: int) -> ExitStack:
    """Rank 0's checkpoint write fails the way torch.save's zip writer fails on a full disk, inside DCP."""
    original_save, original_write = checkpoint_module.Checkpointer.save, dcp_filesystem._write_item
    saving = [0]

    def save(self, at_step, *args, **kwargs):  # noqa: ANN001, ANN202
        saving[0] = at_step
        return original_save(self, at_step, *args, **kwargs)

    def write_item(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if saving[0] == step and int(os.environ["RANK"]) == 0:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 5184 vs 5078")
        return original_write(*args, **kwargs)

    return patches((checkpoint_module.Checkpointer, "save", save), (dcp_filesystem, "_write_item", write_item))


def patches(*replacements: tuple[object, str, object]) -> ExitStack:
    """Applied at once; closing the stack undoes them."""
    stack = ExitStack()
    for module, name, replacement in replacements:
        stack.enter_context(patched(module, name, replacement))
    return stack


def main_with_faults(argv: list[str], *faults: ExitStack) -> int:
    """train.py's main with the given injections, undone afterwards."""
    with ExitStack() as stack:
        for fault in faults:
            stack.enter_context(fault)
        return main(argv)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--nan-steps", default="")
    parser.add_argument("--die-saving", type=int)
    parser.add_argument("--user-error-step", type=int)
    parser.add_argument("--on-rank", type=int, default=1)
    parser.add_argument("--disk-full-saving", type=int)
    args, rest = parser.parse_known_args()
    faults = []
    if args.nan_steps:
        faults.append(inject_nan({int(s) for s in args.nan_steps.split(",")}))
    if args.die_saving:
        faults.append(die_while_saving(args.die_saving))
    if args.user_error_step:
        faults.append(user_error_at_step(args.user_error_step, args.on_rank))
    if args.disk_full_saving:
        faults.append(disk_full_saving(args.disk_full_saving))
    sys.exit(main_with_faults([a for a in rest if a != "--"], *faults))
