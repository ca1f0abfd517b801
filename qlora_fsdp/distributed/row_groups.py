"""Context parallel's groups: each row split over `degree` consecutive ranks (the GPUs of a node), each group
taking its own rows. FSDP2 still shards the weights over every rank; only the rows differ."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from qlora_fsdp.errors import ConfigError


@dataclass(frozen=True)
class RowSplit:
    """Where this rank stands: which part of each row it holds, and which rows (data) its group takes."""

    degree: int  # ranks a row is split over (1: whole rows, no split)
    index: int  # this rank's part of the row, 0..degree-1, in order
    data_rank: int  # this rank's group among the groups taking different rows
    data_ranks: int  # groups taking different rows: world size / degree
    group: dist.ProcessGroup | None = None  # the ranks sharing this rank's rows (None: no split)

    @property
    def splits(self) -> bool:
        return self.degree > 1


# per process group and degree (new_group must run once on every rank); the key holds the group itself, so a later
# group cannot take a destroyed one's id
_made: dict[tuple[object, int], RowSplit] = {}


def row_split(degree: int) -> RowSplit:
    """This rank's RowSplit for rows split over `degree` ranks, making the groups the first time (every rank calls
    this in the same order: new_group is a collective). Without a process group, or degree 1: no split."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if degree <= 1:
        return RowSplit(1, 0, rank, world)
    if world < degree:
        raise ConfigError(f"'fsdp.context_parallel: {degree}' needs {degree} ranks: launch with torchrun "
                          f"--nproc_per_node {degree}")
    if world % degree:
        raise ConfigError(f"'fsdp.context_parallel: {degree}' does not divide the {world} ranks: use a divisor "
                          "(the GPUs of one node)")
    key = (dist.group.WORLD, degree)
    if key not in _made:
        groups = [dist.new_group(list(range(start, start + degree))) for start in range(0, world, degree)]
        _made.clear()  # an earlier (destroyed) process group's groups are of no use
        _made[key] = RowSplit(degree, rank % degree, rank // degree, world // degree, groups[rank // degree])
    return _made[key]
