"""Where a full tensor's rows go on this rank: FSDP2's dim-0 chunk of a sharded parameter (or HSDP's), all of a
replicated one; the loader, the adapter's import and the inits that fill LoRA at load all place tensors this way."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from qlora_fsdp.distributed import local_shard
from qlora_fsdp.errors import ModelLoadError


def shard_row_range(param: torch.Tensor, n_rows: int) -> tuple[int, int]:
    """The rows of a full tensor this rank keeps for `param`: all, or FSDP2's `torch.chunk` dim-0 chunk over
    the mesh dimension that shards (HSDP replicates over the other)."""
    if not isinstance(param, DTensor):
        return 0, n_rows
    placements = tuple(param.placements)
    if placements not in ((Shard(0),), (Replicate(), Shard(0))):
        raise ModelLoadError(f"unsupported placement {placements}; expected FSDP2's Shard(0) or HSDP's")
    mesh, shard_dim = param.device_mesh, len(placements) - 1
    return chunk_rows(n_rows, mesh.size(shard_dim), mesh.get_local_rank(shard_dim))


def chunk_rows(n_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Row range of `torch.chunk(t, world_size)[rank]` (empty where torch.chunk makes fewer chunks)."""
    chunk = math.ceil(n_rows / world_size)
    return min(rank * chunk, n_rows), min((rank + 1) * chunk, n_rows)


@torch.no_grad()
def copy_rows_into(param: torch.Tensor, part: torch.Tensor) -> None:
    """Copy this rank's rows (already cut with `shard_row_range`) into the local shard."""
    local = local_shard(param)
    if local.shape != part.shape:
        raise ModelLoadError(f"shard shape {tuple(local.shape)} does not match checkpoint part {tuple(part.shape)}")
    local.copy_(part)


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    first, last = shard_row_range(param, full.shape[0])
    copy_rows_into(param, full[first:last])
