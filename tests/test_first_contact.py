"""First contact between the ranks (qlora_fsdp.distributed.first_contact): the GPU report's text, and the first
all-reduce under `torchrun --nproc_per_node 2` on CPU, healthy and with a rank that never joins it.

Run as a script, this file is one rank: it joins the world with a small first-collective timeout, the way
train.py does under run_command, and writes when it started the check:

    torchrun --standalone --nproc_per_node 2 tests/test_first_contact.py TIMEOUT_S HANG_RANK OUT_DIR
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import qlora_fsdp.distributed.first_contact as first_contact
from qlora_fsdp.commands.exit import run_command
from qlora_fsdp.config import changed_settings, load_config, to_yaml
from qlora_fsdp.distributed import cleanup, init_distributed
from qlora_fsdp.distributed.first_contact import FirstCollectiveError, GpuReport, format_gpu_report, from_record
from qlora_fsdp.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TIMEOUT_S = 3.0
GIB = 1024**3


def rtx_4090(rank: int, peer: bool, host: str = "box") -> GpuReport:
    return GpuReport(host, rank, rank, "NVIDIA GeForce RTX 4090", int(22.9 * GIB), int(23.6 * GIB), {1 - rank: peer})


def test_report_of_two_4090s_without_peer_access_suggests_disabling_p2p():
    lines = format_gpu_report([rtx_4090(0, False), rtx_4090(1, False)])
    assert lines[:2] == [
        "GPU of rank 0 (box cuda:0): NVIDIA GeForce RTX 4090, 22.9 of 23.6 GiB free; peer access to cuda:1 no",
        "GPU of rank 1 (box cuda:1): NVIDIA GeForce RTX 4090, 22.9 of 23.6 GiB free; peer access to cuda:0 no"]
    assert len(lines) == 3 and lines[2].startswith("note: box's GPUs report no peer-to-peer access")
    assert "NCCL_P2P_DISABLE=1" in lines[2] and "ACS" in lines[2]


def test_report_notes_geforce_peer_access_but_not_a_datacenter_pair_or_one_gpu_or_cpu():
    geforce = format_gpu_report([rtx_4090(0, True), rtx_4090(1, True)])
    assert "peer access to cuda:1 yes" in geforce[0]
    assert geforce[2].startswith("note: box's GeForce GPUs report peer-to-peer access, which is broken on some")
    assert "NCCL_P2P_DISABLE=1" in geforce[2]
    h100s = [GpuReport("box", r, r, "NVIDIA H100 80GB HBM3", 79 * GIB, 80 * GIB, {1 - r: True}) for r in (0, 1)]
    assert len(format_gpu_report(h100s)) == 2  # peer access works there: no note
    one = GpuReport("box", 0, 0, "NVIDIA GeForce RTX 4090", GIB, 24 * GIB, {})
    assert format_gpu_report([one]) == ["GPU of rank 0 (box cuda:0): NVIDIA GeForce RTX 4090, 1.0 of 24.0 GiB free"]
    two_hosts = format_gpu_report([rtx_4090(0, False, "a"), rtx_4090(1, False, "b")])
    assert not [line for line in two_hosts if line.startswith("note")]  # one GPU a host: nothing between them
    assert format_gpu_report([]) == []  # CPU ranks report nothing


def test_a_report_survives_the_store_as_json():
    report = rtx_4090(1, False)
    assert from_record(json.loads(json.dumps(dataclasses.asdict(report)))) == report


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_wrong_sum_or_a_hang_is_one_user_error(world_of_one, monkeypatch):
    """What a broken link does to the first all-reduce, in one process: garbage, or no answer at all."""
    monkeypatch.setattr(dist, "all_reduce", lambda tensor: tensor.mul_(0.5))
    with pytest.raises(FirstCollectiveError, match=r"^the first all-reduce between the 1 ranks gave 0.5 where 1 "):
        first_contact.check_first_all_reduce(torch.device("cpu"), 5.0)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor: threading.Event().wait())
    began = time.monotonic()
    with pytest.raises(FirstCollectiveError, match=r"did not finish in 0.2 s: .*first_collective_timeout_s"):
        first_contact.check_first_all_reduce(torch.device("cpu"), 0.2)
    assert time.monotonic() - began < 2
    cuda_hint = first_contact.first_collective_hint("it hung", torch.device("cuda", 0))
    assert "NCCL_P2P_DISABLE=1" in cuda_hint and "ACS" in cuda_hint


def test_the_timeout_key_is_positive_seconds_and_may_change_on_resume():
    assert load_config("tiny_cpu", ["train.first_collective_timeout_s=2.5"]).train.first_collective_timeout_s == 2.5
    with pytest.raises(ConfigError, match="'train.first_collective_timeout_s' must be positive, got 0"):
        load_config("tiny_cpu", ["train.first_collective_timeout_s=0"])
    saved = to_yaml(load_config("tiny_cpu"))
    assert changed_settings(saved, load_config("tiny_cpu", ["train.first_collective_timeout_s=600"])) == []


def torchrun_ranks(tmp_path: Path, hang_rank: int) -> tuple[subprocess.CompletedProcess, float, list[float]]:
    """Two CPU ranks running this file; the run, when it ended, and when each rank began its first contact."""
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", __file__, str(TIMEOUT_S), str(hang_rank), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    started = [json.loads((tmp_path / f"rank{r}.json").read_text())["started"] for r in (0, 1)]
    return result, time.time(), started


@pytest.mark.slow
def test_a_rank_that_never_joins_the_first_all_reduce_ends_every_rank_in_seconds(tmp_path):
    """Rank 1 never reaches the first all-reduce (as if its GPU link hung): both ranks stop after the timeout
    with one line, printed once, exit code 2 and no traceback but torchrun's own report."""
    result, ended, started = torchrun_ranks(tmp_path, hang_rank=1)
    terminal = result.stdout + result.stderr
    lines = [line for line in terminal.splitlines() if line.startswith("error: ")]
    assert lines == ["error: the first all-reduce between the 2 ranks did not finish in 3 s: a rank stuck before "
                     "it, or a firewall between nodes; raise train.first_collective_timeout_s if a slow node is "
                     "expected"], terminal[-4000:]
    assert re.findall(r"^\s+exitcode\s+: (-?\d+) \(pid", terminal, re.MULTILINE) == ["2", "2"], terminal[-3000:]
    assert terminal.count("Traceback (most recent call last)") == 1  # torchrun's ChildFailedError report
    assert "[rank" not in terminal and "Connection closed" not in terminal, terminal[-3000:]
    # check to torchrun's exit (its agent notices, SIGTERMs, reports): seconds, not the 60-minute group timeout
    assert max(ended - t for t in started) < TIMEOUT_S + 6, (started, ended)


@pytest.mark.slow
def test_healthy_ranks_pass_the_first_all_reduce_at_once(tmp_path):
    result, _, _ = torchrun_ranks(tmp_path, hang_rank=-1)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    checks = [json.loads((tmp_path / f"rank{r}.json").read_text())["check_s"] for r in (0, 1)]
    assert max(checks) < 1.0, checks
    assert "GPU of rank" not in result.stdout  # CPU ranks: no device report


def rank_main(timeout_s: float, hang_rank: int, out_dir: Path) -> int:
    """One rank under torchrun: join the world (the first-contact check included) and note the times."""
    rank = int(os.environ["RANK"])
    if rank == hang_rank:  # this rank never takes part in the all-reduce: its check's thread blocks for good
        first_contact.dist.all_reduce = lambda *args, **kwargs: threading.Event().wait()
    original = first_contact.check_first_all_reduce
    record: dict[str, float] = {}

    def timed_check(device: torch.device, timeout_s: float) -> None:
        record["started"] = time.time()
        (out_dir / f"rank{rank}.json").write_text(json.dumps(record))  # before a hang ends the process
        original(device, timeout_s)
        record["check_s"] = time.time() - record["started"]
        (out_dir / f"rank{rank}.json").write_text(json.dumps(record))

    first_contact.check_first_all_reduce = timed_check

    def body() -> int:
        init_distributed(first_collective_timeout_s=timeout_s)
        cleanup()
        return 0

    return run_command(body)


if __name__ == "__main__":
    sys.exit(rank_main(float(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])))
