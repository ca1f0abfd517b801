"""The session's pool of gloo ranks (tests/rank_pool.py): each task starts from a fresh process's state, a
failing task reports its traceback and its workers are replaced, and the ranks of a group really are peers."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import run_ranks

pytestmark = pytest.mark.slow  # gloo ranks


def leave_marks(info) -> tuple[int, str | None, float, float]:
    """What this task found (its process, a variable an earlier task set, a random draw, the sum of a one over
    the ranks); then change what a task may change: the environment, the seed, the default dtype."""
    total = torch.ones(1)
    dist.all_reduce(total)
    found = (os.getpid(), os.environ.get("LEFT_BY_A_TASK"), torch.rand(()).item(), total.item())
    os.environ["LEFT_BY_A_TASK"] = "yes"
    torch.manual_seed(123)
    torch.set_default_dtype(torch.float64)
    return found


def fail_on_rank_1(info) -> None:
    if info.rank == 1:
        raise ValueError("planted failure on rank 1")


def segfault_on_rank_1(info, marker: Path | None) -> int:
    """Rank 1 dies of SIGSEGV (as native code does) the first time, or every time when `marker` is None."""
    if info.rank == 1 and (marker is None or not marker.exists()):
        if marker is not None:
            marker.touch()
        os.kill(os.getpid(), signal.SIGSEGV)
    total = torch.ones(1)
    dist.all_reduce(total)
    return int(total.item())


def test_a_worker_killed_by_a_signal_is_rerun_once_and_a_crash_that_repeats_fails(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"segfault_on_rank_1: worker died \(exit code -11\); rerun once"):
        assert run_ranks(segfault_on_rank_1, 2, tmp_path / "once", tmp_dir=tmp_path) == [2, 2]
    with pytest.raises(AssertionError, match=r"rank 1: worker died \(exit code -11\)"), pytest.warns(RuntimeWarning):
        run_ranks(segfault_on_rank_1, 2, None, tmp_dir=tmp_path)


def test_each_task_starts_from_a_fresh_process_state_in_the_same_processes(tmp_path):
    first = run_ranks(leave_marks, 2, tmp_dir=tmp_path)
    second = run_ranks(leave_marks, 2, tmp_dir=tmp_path)
    assert [mark[0] for mark in first] == [mark[0] for mark in second]  # the same workers served both
    assert all(mark[1] is None for mark in first + second)  # the environment was put back
    fresh = torch.rand((), generator=torch.Generator().manual_seed(67280421310721)).item()
    assert [mark[2] for mark in first + second] == [fresh] * 4  # torch's seed of a new process, each time
    assert [mark[3] for mark in first + second] == [2.0] * 4  # the ranks of each task are peers


def test_a_failing_task_names_the_rank_and_its_workers_are_replaced(tmp_path):
    before = {mark[0] for mark in run_ranks(leave_marks, 2, tmp_dir=tmp_path)}
    with pytest.raises(AssertionError, match="(?s)failed on 1 of 2 ranks:.*rank 1: .*ValueError: planted failure"):
        run_ranks(fail_on_rank_1, 2, tmp_dir=tmp_path)
    after = {mark[0] for mark in run_ranks(leave_marks, 2, tmp_dir=tmp_path)}
    assert before.isdisjoint(after)


def patch_the_package(info) -> int:
    import qlora_fsdp.loading.build

    qlora_fsdp.loading.build.QUANT_STORAGE = torch.bfloat16  # left patched, as a careless test would
    return os.getpid()


def test_a_task_that_leaves_the_package_patched_gets_fresh_workers_after_it(tmp_path):
    patched = {pid for pid in run_ranks(patch_the_package, 2, tmp_dir=tmp_path)}
    after = run_ranks(leave_marks, 2, tmp_dir=tmp_path)
    assert patched.isdisjoint(mark[0] for mark in after)
