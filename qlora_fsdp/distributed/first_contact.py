"""First contact between the ranks: a report of every rank's GPU, then one small all-reduce under a short timeout.

On two consumer GPUs NCCL can hang in the very first collective when peer-to-peer access is reported but broken
(RTX 4090 pairs); with train.collective_timeout_minutes at 60 a user would wait an hour for an error. The report
goes through the rendezvous store, not a collective, so it is printed even when the all-reduce then hangs.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from qlora_fsdp.distributed.rank_errors import shared_store
from qlora_fsdp.errors import UserError

GIB = 1024**3
REPORT_KEY = "qlora_fsdp/first_contact"
_rounds = 0  # reports exchanged by this process: each gets keys of its own (every rank counts alike)


class FirstCollectiveError(UserError, RuntimeError):
    """The first all-reduce between the ranks hung or gave a wrong sum."""


@dataclass(frozen=True)
class GpuReport:
    """One rank's GPU, as plain data (so the formatting is testable without one)."""

    host: str
    rank: int
    index: int  # the CUDA device index on its host
    name: str
    free_bytes: int
    total_bytes: int
    peer_access: dict[int, bool]  # another of this host's ranks' GPU index -> whether this one reaches it directly


def check_first_contact(device: torch.device, timeout_s: float) -> None:
    """Print every rank's GPU (rank 0, once), then make sure one all-reduce finishes in `timeout_s` with the
    right sum. A world of one has no all-reduce to check; a fake group (one process acting as one rank, for
    planning) nothing at all."""
    if dist.get_backend() == "fake":
        return
    world, report = dist.get_world_size(), gpu_report(device)
    reports = exchange_reports(report, timeout_s) if world > 1 else [report] if report is not None else []
    if dist.get_rank() == 0:
        for line in format_gpu_report(reports):
            print(line, flush=True)
    if world > 1:
        check_first_all_reduce(device, timeout_s)


def gpu_report(device: torch.device) -> GpuReport | None:
    """This rank's GPU (None on CPU): name, free and total memory, peer access to the other ranks' GPUs here."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    local_gpus = min(int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count())), torch.cuda.device_count())
    peers = {other: torch.cuda.can_device_access_peer(index, other) for other in range(local_gpus) if other != index}
    return GpuReport(socket.gethostname(), dist.get_rank(), index, torch.cuda.get_device_name(device), free, total,
                     peers)


def exchange_reports(report: GpuReport | None, timeout_s: float) -> list[GpuReport]:
    """Every rank's report, on rank 0 (an empty list elsewhere), through the store: a hung collective cannot
    stop it. Rank 0 waits at most `timeout_s` for them and goes on with those it has."""
    global _rounds
    _rounds += 1
    store, rank = shared_store(), dist.get_rank()
    if store is None:
        return [report] if report is not None else []
    prefix = f"{REPORT_KEY}/{_rounds}"
    store.set(f"{prefix}/{rank}", json.dumps(None if report is None else asdict(report)))
    if rank != 0:
        return []
    keys = [f"{prefix}/{r}" for r in range(dist.get_world_size())]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except dist.DistStoreError:  # a rank that never reported: the all-reduce that follows names the problem
        pass
    records = [json.loads(store.get(key)) for key in keys if store.check([key])]
    return [from_record(record) for record in records if record is not None]


def from_record(record: dict[str, Any]) -> GpuReport:
    record["peer_access"] = {int(index): flag for index, flag in record["peer_access"].items()}  # JSON keys: str
    return GpuReport(**record)


def format_gpu_report(reports: list[GpuReport]) -> list[str]:
    """One line per GPU, and a note per host whose peer-to-peer access is the usual suspect in a first-collective
    hang; nothing for CPU ranks (no reports)."""
    lines = [format_gpu(report) for report in reports]
    for host in dict.fromkeys(report.host for report in reports):
        note = peer_access_note(host, [report for report in reports if report.host == host])
        lines += [note] if note else []
    return lines


def format_gpu(report: GpuReport) -> str:
    peers = ", ".join(f"cuda:{index} {'yes' if ok else 'no'}" for index, ok in sorted(report.peer_access.items()))
    return (f"GPU of rank {report.rank} ({report.host} cuda:{report.index}): {report.name}, "
            f"{report.free_bytes / GIB:.1f} of {report.total_bytes / GIB:.1f} GiB free"
            + (f"; peer access to {peers}" if peers else ""))


def peer_access_note(host: str, reports: list[GpuReport]) -> str | None:
    """Where several of this host's GPUs talk to each other: peer access reported unavailable (NCCL should go
    through host memory, but a hang means it did not), or reported on GeForce GPUs, where it is broken on some
    boards and drivers."""
    flags = [ok for report in reports for ok in report.peer_access.values()]
    if len(reports) < 2 or not flags:
        return None
    fixes = "set NCCL_P2P_DISABLE=1, or try a newer driver, or PCIe ACS off in the BIOS"
    if not all(flags):
        return (f"note: {host}'s GPUs report no peer-to-peer access between them; if the first all-reduce hangs, "
                f"NCCL tried it anyway: {fixes}")
    if any("GeForce" in report.name for report in reports):
        return (f"note: {host}'s GeForce GPUs report peer-to-peer access, which is broken on some boards and drivers "
                f"(RTX 4090 pairs): if the first all-reduce hangs or the loss turns NaN, {fixes}")
    return None


def check_first_all_reduce(device: torch.device, timeout_s: float) -> None:
    """Sum a one on every rank, in a daemon thread the main thread waits for at most `timeout_s`: a hung NCCL
    call cannot be cancelled, and Work.wait(timeout) behaves differently per backend. On a timeout the thread is
    left behind: run_command ends the rank with os._exit, which does not wait for it (outside run_command,
    interpreter teardown meets the stuck thread and the process aborts: seen on gloo)."""
    outcome: list[float | BaseException] = []
    done = threading.Event()

    def all_reduce_ones() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
            ones = torch.ones(1, device=device)
            dist.all_reduce(ones)
            outcome.append(ones.item())  # waits for the device: a hung NCCL kernel hangs here
        except BaseException as err:  # handed to the main thread (a collective failed as a peer left, say)
            outcome.append(err)
        finally:
            done.set()

    threading.Thread(target=all_reduce_ones, name="first-all-reduce", daemon=True).start()
    world = dist.get_world_size()
    if not done.wait(timeout_s):
        raise FirstCollectiveError(first_collective_hint(
            f"the first all-reduce between the {world} ranks did not finish in {timeout_s:g} s", device)
            + "; raise train.first_collective_timeout_s if a slow node is expected")
    total = outcome[0]
    if isinstance(total, BaseException):
        raise total  # a failed collective: run_command tells a peer's published error from our own
    if total != world:  # a broken peer-to-peer link can also deliver garbage
        raise FirstCollectiveError(first_collective_hint(
            f"the first all-reduce between the {world} ranks gave {total:g} where {world} was expected", device))


def first_collective_hint(what: str, device: torch.device) -> str:
    if device.type == "cuda":
        return (f"{what}: on consumer GPUs this is usually broken peer-to-peer access; try NCCL_P2P_DISABLE=1, "
                "a newer driver, or PCIe ACS off in the BIOS")
    return f"{what}: a rank stuck before it, or a firewall between nodes"
