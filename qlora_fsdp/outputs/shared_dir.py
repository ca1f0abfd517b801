"""Across nodes, train.output_dir must be one folder that every node sees: every rank writes its part of a
checkpoint there, rank 0 alone renames the folder into place and writes the adapter, and every rank reads it
back on resume. Checked once at start-up, so a node-local path fails in seconds with one line, not at the first
checkpoint or resume.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from qlora_fsdp.distributed import DistInfo, all_reduce_max, decide_on_main
from qlora_fsdp.errors import ConfigError

MARKER_PREFIX = ".shared_storage_check_"


def spans_several_nodes(world_size: int) -> bool:
    """torchrun's LOCAL_WORLD_SIZE is the ranks on this node; fewer than the world means more nodes."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) < world_size


def check_output_dir_shared(run_dir: Path, info: DistInfo) -> None:
    """A collective (every rank calls it); a no-op within one node. The first process of each other node checks."""
    if info.world_size > 1 and spans_several_nodes(info.world_size):
        check_shared_folder(run_dir, info, checks=info.local_rank == 0 and not info.is_main)


def check_shared_folder(folder: Path, info: DistInfo, checks: bool, wait_s: float = 10.0) -> None:
    """Rank 0 writes a marker in `folder`; ranks with `checks` look for it in theirs (the same path, unless a node
    has its own disk there). If one cannot see it, every rank raises the same one-line ConfigError."""
    name = decide_on_main(lambda: write_marker(folder))  # the broadcast comes after the write: a barrier
    missing = checks and not appears(folder / name, wait_s)
    try:  # every rank learns the largest rank (+ 1) that cannot see it, 0 if all can, so all decide alike
        blind = int(all_reduce_max(float(info.rank + 1) if missing else 0.0, info.device))
    finally:
        if info.is_main:  # after the all-reduce every checking rank has looked
            (folder / name).unlink(missing_ok=True)
    if blind:
        raise ConfigError(f"train.output_dir {folder} is not on storage shared by all nodes: rank {blind - 1} cannot "
                          "see a file rank 0 wrote there, and rank 0 alone writes checkpoints and the adapter; use "
                          "a shared filesystem (NFS, Lustre, ...) mounted at the same path on every node")


def write_marker(folder: Path) -> str:
    """A new file with a name no earlier run used, so a stale marker on a node-local disk never passes."""
    name = f"{MARKER_PREFIX}{uuid.uuid4().hex}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).touch()
    return name


def appears(path: Path, wait_s: float) -> bool:
    """Whether `path` exists within `wait_s` seconds: a network filesystem may show another node's new file late."""
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True

