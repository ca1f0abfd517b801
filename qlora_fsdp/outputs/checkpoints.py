"""Checkpoints of the trainable state with torch.distributed.checkpoint (DCP): atomic, resumable, pruned.

A checkpoint `checkpoints/step-000050/` holds
  - DCP files (.metadata, *.distcp): the LoRA weights (sharded DTensors), every rank's optimizer state
    (the 8-bit state included) and every rank's RNG state;
  - trainer_state.json: step, world size, sampler position, LR schedule, bad-step counters;
  - config.yaml: the resolved recipe; adapter/: the adapter in PEFT format.
The frozen 4-bit base is never saved; it is re-read from the model path. A checkpoint is written under
`.tmp-step-000050/` and renamed when complete, so every folder named `step-*` is whole: a kill at any
moment leaves the previous one loadable.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import peft
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from transformers import PreTrainedTokenizerBase

from qlora_fsdp.distributed import DistInfo, barrier
from qlora_fsdp.errors import CheckpointError, first_line
from qlora_fsdp.loading.adapter import export_adapter
from qlora_fsdp.loading.names import clean_name
from qlora_fsdp.optimizer import ShardedOptimizer

CHECKPOINTS_DIR = "checkpoints"
TMP_PREFIX = ".tmp-"
STATE_FILE = "trainer_state.json"
STEP_NAME = re.compile(r"step-(\d+)")


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first (temporary folders are never complete)."""
    root = run_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_NAME.fullmatch(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=step_in_name)


def step_in_name(folder: Path) -> int:
    """The step a checkpoint folder is named after (step-000120 -> 120)."""
    match = STEP_NAME.fullmatch(folder.name)
    assert match is not None, f"{folder.name} is not a checkpoint folder name"
    return int(match.group(1))


def remove_incomplete(run_dir: Path) -> None:
    """Temporary folders (and the run folder's temporary files) left by a kill during a write."""
    root = run_dir / CHECKPOINTS_DIR
    for stale in root.glob(f"{TMP_PREFIX}*") if root.is_dir() else []:
        shutil.rmtree(stale, ignore_errors=True)
    for stale in run_dir.glob(f"{TMP_PREFIX}*"):
        if stale.is_file():
            stale.unlink(missing_ok=True)


def lora_entries(model: nn.Module) -> dict[str, torch.Tensor]:
    """Trainable weights as DCP sees them: sharded DTensors reshard on load, plain tensors are replicated."""
    return {f"lora/{clean_name(name)}": param.detach() for name, param in model.named_parameters()
            if param.requires_grad}


def optimizer_entries(optimizer: ShardedOptimizer, rank: int) -> dict[str, Any]:
    """This rank's optimizer state under rank-keyed names: it belongs to the rank's local shards."""
    entries = {}
    for index, local in enumerate(optimizer.locals):
        for key, value in optimizer.inner.state.get(local, {}).items():
            entries[f"optim/rank{rank}/{index}/{key}"] = value
    return entries


def rank_state_file(rank: int) -> str:
    return f"rank{rank}_state.pt"


def rng_entries(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    entries = {f"rng/rank{rank}/cpu": torch.get_rng_state()}
    if device.type == "cuda":
        entries[f"rng/rank{rank}/cuda"] = torch.cuda.get_rng_state(device)
    return entries


def restore_rng(entries: dict[str, Any], rank: int, device: torch.device) -> None:
    torch.set_rng_state(entries[f"rng/rank{rank}/cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(entries[f"rng/rank{rank}/cuda"], device)


def restore_optimizer_values(optimizer: ShardedOptimizer, entries: dict[str, Any], rank: int) -> None:
    """Non-tensor state (step counters) comes back as new objects; tensors were loaded in place."""
    for index, local in enumerate(optimizer.locals):
        state = optimizer.inner.state[local]
        for key in state:
            state[key] = entries[f"optim/rank{rank}/{index}/{key}"]


def write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def sync_dir(path: Path) -> None:
    """Make a rename or new entry in `path` survive a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def out_of_space(err: BaseException) -> BaseException | None:
    """The error in the chain saying a write ran out of room: ENOSPC/EDQUOT, or torch.save's zip writer reporting
    a short write ("unexpected pos"), which is how a full disk surfaces through it; None if none does."""
    for exc in exception_chain(err):
        if isinstance(exc, CheckpointException):  # its text quotes every rank's error: look at those instead
            continue
        if (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
                sign in str(exc) for sign in ("No space left", "unexpected pos", "Disk quota")):
            return exc
    return None


def exception_chain(err: BaseException) -> list[BaseException]:
    """The error, its causes and contexts, and the per-rank errors DCP wraps in a CheckpointException."""
    found: list[BaseException] = []
    pending = [err]
    while pending:
        exc = pending.pop()
        if exc in found:
            continue
        found.append(exc)
        pending += [e for e in (exc.__cause__, exc.__context__) if e is not None]
        if isinstance(exc, CheckpointException):
            pending += [failure[0] for failure in exc.failures.values()]
    return found


def read_trainer_state(path: Path) -> dict:
    """A checkpoint's trainer_state.json; a damaged one is one line naming it and the checkpoint to use instead."""
    file = path / STATE_FILE
    try:
        state = json.loads(file.read_text())
        if not isinstance(state, dict) or not {"step", "world_size"} <= state.keys():
            raise ValueError("it lacks 'step' or 'world_size'")
        return state
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        earlier = [p for p in complete_checkpoints(path.parent.parent) if p.name < path.name]
        instead = (f"resume from {earlier[-1]} with --resume-from {earlier[-1]}" if earlier
                   else "no earlier checkpoint exists, so start over with train.overwrite=true")
        raise CheckpointError(f"{file} is damaged ({first_line(err)}): checkpoint {path.name} cannot be resumed; "
                              f"{instead} (and delete {path})") from None


def check_world_size(path: Path, world_size: int) -> dict:
    """The checkpoint's trainer state, if this world can load it (checked before any weight is read)."""
    state = read_trainer_state(path)
    if state["world_size"] != world_size:
        raise CheckpointError(
            f"checkpoint {path} was written by {state['world_size']} ranks and this run has {world_size}: each "
            "rank's optimizer state (8-bit, block-wise over its own shard) cannot be re-split; resume with "
            f"--nproc_per_node {state['world_size']}")
    return state


@dataclass
class Checkpointer:
    run_dir: Path
    info: DistInfo
    keep_last: int
    config_yaml: str
    tokenizer: PreTrainedTokenizerBase
    base_model_path: str

    def save(self, step: int, model: peft.PeftModel, optimizer: ShardedOptimizer, trainer_state: dict,
             rank_state: dict | None = None) -> Path:
        """Every rank calls this; returns the complete checkpoint's folder. `rank_state`: what this rank alone holds
        (GRPO's generation in use), tensors and plain values, saved beside the rest."""
        root = self.run_dir / CHECKPOINTS_DIR
        final, tmp = root / checkpoint_name(step), root / f"{TMP_PREFIX}{checkpoint_name(step)}"
        if (final / STATE_FILE).is_file():  # resumed from this very step and stopped before another
            return final
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        try:
            self.write(tmp, step, model, optimizer, trainer_state)
            if rank_state is not None:
                torch.save(rank_state, tmp / rank_state_file(self.info.rank))
        except (OSError, RuntimeError, CheckpointException) as err:  # DCP's error is a BaseException
            cause = out_of_space(err)
            if cause is None:
                raise
            raise self.disk_full(tmp, cause) from None
        barrier()  # every rank's files are written (a rank's own state is written after DCP's collective save)
        if self.info.is_main:
            os.rename(tmp, final)  # the commit point
            sync_dir(root)
            self.prune()
        barrier()
        return final

    def write(self, tmp: Path, step: int, model: peft.PeftModel, optimizer: ShardedOptimizer,
              trainer_state: dict) -> None:
        entries = {**lora_entries(model), **optimizer_entries(optimizer, self.info.rank),
                   **rng_entries(self.info.rank, self.info.device)}
        dcp.save(entries, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
        export_adapter(model, self.tokenizer, tmp / "adapter", self.base_model_path, self.info.is_main,
                       self.config_yaml)
        if self.info.is_main:
            state = {"step": step, "world_size": self.info.world_size,
                     "optimizer_state": bool(optimizer.inner.state), **trainer_state}
            write_synced(tmp / STATE_FILE, json.dumps(state, indent=1))
            write_synced(tmp / "config.yaml", self.config_yaml)
            sync_dir(tmp)

    def disk_full(self, tmp: Path, err: BaseException) -> CheckpointError:
        """The one line for a checkpoint the disk had no room for; the partial folder is removed to free space."""
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        free_gib = shutil.disk_usage(tmp.parent).free / 2**30
        complete = complete_checkpoints(self.run_dir)
        resume = (f"resume from {complete[-1]} (the last complete checkpoint) with --resume" if complete
                  else "no complete checkpoint exists yet, so the run starts over")
        return CheckpointError(
            f"disk full: writing checkpoint {tmp.name.removeprefix(TMP_PREFIX)} to {tmp.parent} failed "
            f"({first_line(err)}; {free_gib:.1f} GiB free there). Free space or point train.output_dir at a larger "
            f"disk (fewer kept: train.keep_last); {resume}")

    def prune(self) -> None:
        for old in complete_checkpoints(self.run_dir)[: -self.keep_last]:
            shutil.rmtree(old)

    def rank_state(self, path: Path) -> dict | None:
        """This rank's own saved state, if the run saved one (weights_only: tensors and plain values)."""
        file = path / rank_state_file(self.info.rank)
        return torch.load(file, weights_only=True) if file.is_file() else None

    def load(self, path: Path, model: nn.Module, optimizer: ShardedOptimizer) -> dict:
        """Load weights, optimizer state and RNG in place; returns the trainer state to apply."""
        state = check_world_size(path, self.info.world_size)
        if state["optimizer_state"]:  # False only if every step so far was skipped as non-finite
            optimizer.materialize_state()
        rank, device = self.info.rank, self.info.device
        entries = {**lora_entries(model), **optimizer_entries(optimizer, rank), **rng_entries(rank, device)}
        dcp.load(entries, storage_reader=dcp.FileSystemReader(path))
        restore_optimizer_values(optimizer, entries, rank)
        restore_rng(entries, rank, device)
        return state
