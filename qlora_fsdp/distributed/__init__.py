"""Process group, device and mesh; rank-0 helpers.

The same code path serves `torchrun --nproc_per_node N` (nccl on CUDA, gloo on CPU) and a plain
`python train.py`, which becomes a world of one so FSDP2 and the collectives behave identically.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from qlora_fsdp.distributed.first_contact import check_first_contact
from qlora_fsdp.distributed.rank_errors import (
    elastic_attempt_store,
    end_if_peer_failed,
    forget_store,
    peer_failed,
    shared_store,
)
from qlora_fsdp.errors import CollectiveTimeoutError, ConfigError

T = TypeVar("T")
# gloo: "Timed out waiting 3000ms for recv operation"; nccl: "... milliseconds before timing out"
TIMEOUT_ERROR = re.compile(r"timed out|timing out|timeout", re.IGNORECASE)
_timeout_minutes = 60.0  # this process group's, for the error message
_barriers = 0  # barriers passed: each gets its own key in the store
BARRIER_POLL_S = 0.05


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data_parallel_mesh(device_type: str, world_size: int, shard_size: int | None = None) -> DeviceMesh:
    """1-D (shard over every rank), or 2-D for HSDP: replicas across groups of `shard_size` ranks, each group
    sharding the model, so FSDP's per-layer all-gathers stay inside a node and only gradients cross nodes."""
    if shard_size is None or shard_size == world_size:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp_shard",))
    if world_size % shard_size:
        raise ConfigError(f"fsdp.shard_size {shard_size} does not divide the world size {world_size}: use a "
                          "divisor (the GPUs of one node), or null to shard over all ranks")
    return init_device_mesh(device_type, (world_size // shard_size, shard_size),
                            mesh_dim_names=("dp_replicate", "dp_shard"))


def init_distributed(shard_size: int | None = None, timeout_minutes: float = 60.0, *,
                     first_collective_timeout_s: float = 60.0) -> DistInfo:
    """Join the torchrun world, or make a world of one for a plain `python` run; `shard_size` as in
    data_parallel_mesh. A collective fails after `timeout_minutes` (train.collective_timeout_minutes): torch's
    default, 30 minutes (10 for NCCL alone), can stop ranks that wait while rank 0 tokenizes a large dataset.
    A group made here is first checked with one all-reduce that must finish in `first_collective_timeout_s`
    (train.first_collective_timeout_s), before any weight is read: a broken GPU link fails in a minute, not an
    hour (qlora_fsdp.distributed.first_contact)."""
    global _timeout_minutes
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"  # gloo for CPU tensors: offloaded shards' grad-norm all-reduce
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        store, timeout = elastic_attempt_store(), timedelta(minutes=timeout_minutes)
        _timeout_minutes = timeout_minutes
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        check_first_contact(device, first_collective_timeout_s)
    world_size = dist.get_world_size()
    mesh = data_parallel_mesh(device.type, world_size, shard_size)
    return DistInfo(dist.get_rank(), local_rank, world_size, device, mesh)


def init_fake_distributed(world_size: int, device: torch.device, rank: int = 0,
                          shard_size: int | None = None) -> DistInfo:
    """Act as one rank of a `world_size` world in this one process: collectives do nothing, but FSDP2 shards
    (and so allocates, loads and measures) exactly what that rank would. For planning and memory checks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    mesh = data_parallel_mesh(device.type, world_size, shard_size)
    return DistInfo(rank, device.index or 0, world_size, device, mesh)


def cleanup() -> None:
    global _barriers
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_store()  # a later group in this process gets a store and barrier keys of its own
    _barriers = 0


@contextmanager
def waiting_for_other_ranks() -> Iterator[None]:
    """Around a collective where another rank may be busy for long: a timeout becomes one actionable line.

    With "cuda:nccl,cpu:gloo", barriers and object collectives run over gloo, which raises here (an NCCL timeout
    would instead abort the process from its watchdog)."""
    try:
        yield
    except RuntimeError as err:  # gloo raises RuntimeError, NCCL's blocking wait DistBackendError (a subclass)
        if not TIMEOUT_ERROR.search(str(err)):
            raise
        raise CollectiveTimeoutError(
            f"a collective waited longer than train.collective_timeout_minutes={_timeout_minutes:g} for another "
            "rank (rank 0 tokenizing, deciding or saving, or a rank that died: see its log); raise it, e.g. "
            f"train.collective_timeout_minutes={4 * _timeout_minutes:g}") from None


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly DTensor) parameter or gradient."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def barrier() -> None:
    """Every rank meets here. Where there is a shared store the wait polls it rather than blocking in a
    collective, so a rank waiting here (for rank 0 tokenizing or saving) sees at once when another rank ended
    with a user error, and ends with it (qlora_fsdp.distributed.rank_errors) instead of waiting to be killed."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return  # nobody to wait for (a fake group, for planning, is one process acting as one rank)
    store = shared_store()
    if store is None:
        with waiting_for_other_ranks():
            dist.barrier()
        return
    global _barriers
    _barriers += 1
    key = f"qlora_fsdp/barrier/{_barriers}"
    store.add(key, 1)
    deadline = time.monotonic() + 60 * _timeout_minutes
    while store.add(key, 0) < dist.get_world_size():
        if peer_failed():
            end_if_peer_failed()
        if time.monotonic() > deadline:
            with waiting_for_other_ranks():
                raise RuntimeError("barrier timed out")
        time.sleep(BARRIER_POLL_S)


@contextmanager
def main_process_first(info: DistInfo | None) -> Iterator[None]:
    """The node's first process does the work (tokenizing, and filling the cache); the others follow and read it."""
    first = info is None or info.local_rank == 0
    if not first:
        barrier()
    yield
    if first and info is not None:
        barrier()


def all_reduce_sum(value: float | int, device: torch.device) -> float:
    """Sum a Python number over ranks (float64, so token counts stay exact)."""
    return all_reduce_sums([value], device)[0]


def all_reduce_sums(values: list[float | int], device: torch.device) -> list[float]:
    """Sum several Python numbers over ranks in one collective."""
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_max(value: float, device: torch.device) -> float:
    return all_reduce_maxes([value], device)[0]


def all_reduce_maxes(values: list[float], device: torch.device) -> list[float]:
    """The largest of several Python numbers over ranks, in one collective."""
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def decide_on_main(decide: Callable[[], T]) -> T:
    """Run `decide` on rank 0 only (it may touch files) and give every rank its result, or its error."""
    outcome: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            outcome[0] = ("ok", decide())
        except Exception as err:  # every rank raises it, not just rank 0
            outcome[0] = ("error", err)
    if dist.is_initialized() and dist.get_world_size() > 1:
        with waiting_for_other_ranks():
            dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "error":
        raise value
    return value
