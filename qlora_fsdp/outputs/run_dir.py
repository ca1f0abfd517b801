"""The output folder: never clobber a previous run, pick the checkpoint to resume from, keep the log whole.

Runs on rank 0 only (see distributed.decide_on_main); the other ranks get its decision.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from qlora_fsdp.config import TrainConfig
from qlora_fsdp.errors import CheckpointError, OutputExistsError
from qlora_fsdp.outputs.run_card import RUN_CARD
from qlora_fsdp.outputs.checkpoints import (
    CHECKPOINTS_DIR,
    STATE_FILE,
    complete_checkpoints,
    read_trainer_state,
    remove_incomplete,
)

METRICS_FILE = "metrics.jsonl"
# what a run writes, and overwrite=true removes (reference_logps: DPO's, when computed before training)
RUN_FILES = (METRICS_FILE, CHECKPOINTS_DIR, "adapter", "reference_logps.safetensors", RUN_CARD)


def elastic_restart() -> bool:
    """torchrun --max-restarts started this attempt after a failed one: it must resume, whatever the recipe says."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def checkpoint_step(path: Path) -> int:
    return int(read_trainer_state(path)["step"])


def choose_checkpoint(run_dir: Path, train: TrainConfig, restarted: bool) -> Path | None:
    target = "auto" if restarted else train.resume_target()
    if target == "never":
        return None
    if target == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    path = target
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"train.resume={path} is not a complete checkpoint (no {STATE_FILE}); pass auto, never, "
                              f"or a folder such as {run_dir / CHECKPOINTS_DIR / 'step-000050'}")
    return path


def refusal(run_dir: Path) -> OutputExistsError:
    found = complete_checkpoints(run_dir)
    if found:
        return OutputExistsError(f"output folder {run_dir} already holds a run (latest checkpoint {found[-1].name}); "
                                 "resume it with --resume (train.resume=auto), choose another train.output_dir, "
                                 "or pass train.overwrite=true to start over")
    return OutputExistsError(f"output folder {run_dir} already exists and is not empty; "
                             "choose another train.output_dir or pass train.overwrite=true")


def trim_metrics(path: Path, step: int) -> None:
    """Drop the records logged after the checkpoint's step: the resumed run logs those steps again."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            if json.loads(line).get("step", -1) > step:
                break
        except ValueError:  # a record cut short when the run was killed mid-write: it and what follows go
            break
        kept.append(line)
    path.write_text("".join(f"{line}\n" for line in kept))


def check_run_dir(run_dir: Path, train: TrainConfig) -> tuple[Path | None, bool]:
    """What prepare_run_dir refuses, without touching the folder (the studio asks before it launches): the
    checkpoint to resume from, and whether it lies in this folder."""
    if run_dir.exists() and not run_dir.is_dir():
        raise OutputExistsError(f"train.output_dir {run_dir} is a file, not a folder; choose another train.output_dir")
    restarted = elastic_restart()
    checkpoint = choose_checkpoint(run_dir, train, restarted)
    inside = checkpoint is not None and checkpoint.resolve().parent.parent == run_dir.resolve()
    occupied = run_dir.is_dir() and any(run_dir.iterdir())
    if occupied and not (restarted or inside or train.overwrite):
        raise refusal(run_dir)
    return checkpoint, inside


def prepare_run_dir(run_dir: Path, train: TrainConfig) -> Path | None:
    """Ready the folder for this run; returns the checkpoint to resume from, or None for a fresh start."""
    checkpoint, inside = check_run_dir(run_dir, train)
    run_dir.mkdir(parents=True, exist_ok=True)
    remove_incomplete(run_dir)
    if checkpoint is not None and inside:
        trim_metrics(run_dir / METRICS_FILE, checkpoint_step(checkpoint))
        return checkpoint
    for name in RUN_FILES:  # a fresh start here: an earlier attempt's files would mix with this run's
        target = run_dir / name
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    return checkpoint
