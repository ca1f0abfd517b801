"""A user error under `torchrun --nproc_per_node 2`: what the terminal shows.

One `error: ...` line, printed once; no Python traceback from any rank (torchrun's own ChildFailedError report
is all that follows); every rank exits 2; torchrun's summary names the line as the root cause; the output
folder is left as it was. Raised before the first collective (a bad data file, on the rank that tokenizes),
between collectives in the middle of a step (one rank only), and by a checkpoint write on a full disk. In one
process: the rank whose collective failed because a peer ended with a user error.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import NoReturn

import pytest
import torch.distributed as dist

import qlora_fsdp.distributed.rank_errors as rank_errors
from qlora_fsdp.commands.exit import run_command
from tests.test_resume import ENV, REPO, TORCHRUN, recipe_args

TORCHRUN_REPORT = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


def torchrun(script: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", script, *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)


def assert_one_clean_error(result: subprocess.CompletedProcess, expected: str) -> str:
    """The terminal (stdout and stderr) of a run that hit a user error; returns its error line."""
    terminal = result.stdout + result.stderr
    lines = [line for line in terminal.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, terminal[-4000:]  # printed once, not once per rank
    assert re.search(expected, lines[0]), lines[0]
    assert result.returncode != 0
    # torchrun's own report is the only traceback; no rank's ("[rank1]: Traceback ...", "Connection closed")
    assert terminal.count("Traceback (most recent call last)") == 1, terminal[-4000:]
    assert TORCHRUN_REPORT in terminal and "[rank" not in terminal and "Connection closed" not in terminal
    exit_codes = re.findall(r"^\s+exitcode\s+: (-?\d+) \(pid", terminal, re.MULTILINE)
    assert exit_codes == ["2", "2"], terminal[-3000:]  # every rank: 2, none killed by torchrun's SIGTERM
    root_cause = terminal.split("Root Cause (first observed failure):")[1]
    assert f"traceback : {lines[0]}" in root_cause
    return lines[0]


def root_cause_rank(result: subprocess.CompletedProcess) -> int:
    root_cause = (result.stdout + result.stderr).split("Root Cause (first observed failure):")[1]
    return int(re.search(r"rank\s+: (\d+)", root_cause).group(1))


@pytest.mark.slow  # torchrun
def test_bad_data_file_under_torchrun(tmp_path, tiny_model_dir):
    """Rank 0 tokenizes while rank 1 waits for it: the broken record's file and line, once, and nothing else."""
    bad = tmp_path / "bad.jsonl"
    good = (REPO / "data" / "tiny_instruct.jsonl").read_text().splitlines()[:3]
    bad.write_text("\n".join([*good, '{"instruction": "x", "output": ']) + "\n")
    out = tmp_path / "run"
    result = torchrun("train.py", *recipe_args(tiny_model_dir, out, f"data.path={bad}"))
    assert_one_clean_error(result, rf"^error: {re.escape(str(bad))}:4: not valid JSON")
    assert root_cause_rank(result) == 0  # the rank that raised it, though its waiting peer may exit first
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow  # torchrun
def test_user_error_on_one_rank_mid_step(tmp_path, tiny_model_dir):
    """Rank 1 raises while rank 0 is inside the step's collectives: rank 0 ends with rank 1's line."""
    out = tmp_path / "run"
    result = torchrun("tests/fault_run.py", "--user-error-step", "2", "--on-rank", "1", "--",
                      *recipe_args(tiny_model_dir, out))
    assert_one_clean_error(result, r"^error: injected user error on rank 1 at step 2$")
    assert root_cause_rank(result) == 1


@pytest.mark.slow  # torchrun
def test_disk_full_during_a_checkpoint(tmp_path, tiny_model_dir):
    """Rank 0's write fails as torch.save does on a full disk: the line says so, where, and what to resume
    from; the earlier checkpoint is whole and the partial one is gone."""
    out = tmp_path / "run"
    result = torchrun("tests/fault_run.py", "--disk-full-saving", "4", "--", *recipe_args(tiny_model_dir, out))
    line = assert_one_clean_error(result, r"^error: disk full: writing checkpoint step-000004 to ")
    kept = out / "checkpoints" / "step-000002"
    assert f"resume from {kept} (the last complete checkpoint) with --resume" in line
    assert "unexpected pos" in line and "GiB free there" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]
    assert (kept / "trainer_state.json").is_file()
    assert Path(out / "adapter").exists() is False  # the run never finished


class RankExit(BaseException):
    def __init__(self, code: int) -> None:
        self.code = code


def raise_rank_exit(code: int) -> NoReturn:
    raise RankExit(code)


def collective_failed() -> int:
    raise RuntimeError("[gloo] Connection closed by peer")


def test_a_failed_collective_after_a_peers_user_error_ends_quietly_with_2(monkeypatch, capsys):
    """Rank 0 of 2 whose collective failed: with the peer's line published, it exits 2 and prints nothing (the
    peer printed it); with none, the error is its own. The path a CUDA rank takes (no SIGTERM handler there), which
    on CPU torchrun's SIGTERM also covers."""
    store = dist.HashStore()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(rank_errors, "shared_store", lambda: store)
    monkeypatch.setattr(rank_errors, "install_sigterm_handler", lambda: None)
    monkeypatch.setattr(rank_errors, "hold_sigterm", lambda: None)  # the test process keeps its signals
    monkeypatch.setattr(rank_errors, "PUBLISH_WAIT_S", 0.2)
    monkeypatch.setattr(rank_errors, "exit_now", raise_rank_exit)
    with pytest.raises(RuntimeError, match="Connection closed"):  # nothing published: its own error
        run_command(collective_failed)
    store.set(rank_errors.RAISED_AT_KEY, "100")
    store.set(rank_errors.ERROR_KEY, "error: injected user error on rank 1")
    with pytest.raises((RankExit, RuntimeError)) as ended:  # the second: taken as its own crash, which it is not
        run_command(collective_failed)
    assert ended.type is RankExit and ended.value.code == 2 and capsys.readouterr().err == ""
