"""Checkpoints and exact resume under faults: kill -9, kill during a write, elastic restart, SIGTERM, NaN.

Every interrupted run is compared with one uninterrupted run of the same recipe (2 gloo ranks, fp32 compute):
the same per-step losses and a final adapter equal to 1e-6. Real torchrun runs only where a process must die or
torchrun itself acts (a kill during a write, elastic restart, SIGTERM then kill -9); the other runs call train.py's
main on the test session's pool ranks (tests/helpers.py run_cli), the same code without 9 s of imports per rank.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from tests.helpers import REPO, CliResult, run_cli

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
MAX_STEPS = 10


def recipe_args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["--recipe", "tiny_cpu", f"model.path={model_dir}", "model.dtype=float32", "quant.compute_dtype=float32",
            "data.eval_samples=8", "data.micro_batch_size=2", f"train.max_steps={MAX_STEPS}", "train.save_every=2",
            "train.keep_last=3", "train.eval_every=5", f"train.output_dir={out}", *extra]


def torchrun(script: str, *args: str, max_restarts: int = 0) -> list[str]:
    return [TORCHRUN, "--standalone", "--nproc_per_node", "2", f"--max-restarts={max_restarts}", script, *args]


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=ENV)


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every worker at once (torchrun puts its workers in sessions of their own)."""
    family = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    for member in family:
        member.kill()
    psutil.wait_procs(family, timeout=30)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    """Wait for a started run; on a hang kill it whole, so nothing outlives the test."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise


def finished(results: list[CliResult]) -> CliResult:
    """Rank 0's output of a pool run in which every rank exited 0."""
    assert [r.returncode for r in results] == [0] * len(results), results[0].stderr[-3000:]
    return results[0]


def records(out: Path) -> list[dict]:
    """The run's records so far: its complete lines (read while the run writes, a line may be half written)."""
    path = out / "metrics.jsonl"
    text = path.read_text() if path.is_file() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def step_losses(out: Path) -> dict[int, float]:
    """Training loss per step; a step logged twice (before a kill and after the resume) must agree."""
    losses: dict[int, float] = {}
    for r in records(out):
        if "loss" in r:
            assert losses.setdefault(r["step"], r["loss"]) == r["loss"], f"step {r['step']} logged two losses"
    return losses


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    wait_until(lambda logged: any(r.get("step", 0) >= step and "loss" in r for r in logged), out, proc, timeout,
               f"step {step} not reached")


def wait_for_a_step_after_a_resume(out: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Until the restarted world has resumed and logged a step of its own."""
    def resumed_and_stepped(logged: list[dict]) -> bool:
        resumes = [index for index, r in enumerate(logged) if r.get("event") == "resume"]
        return bool(resumes) and any("loss" in r for r in logged[resumes[-1] + 1 :])
    wait_until(resumed_and_stepped, out, proc, timeout, "no step after a resume")


def wait_until(condition, out: Path, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"run ended early: {proc.stderr.read()[-2000:]}"
        if condition(records(out)):
            return
        time.sleep(0.05)
    kill_tree(proc)
    raise TimeoutError(what)


def workers(proc: subprocess.Popen) -> list[psutil.Process]:
    return [p for p in psutil.Process(proc.pid).children(recursive=True) if "python" in p.name().lower()]


def assert_same_run(out: Path, reference: Path) -> None:
    assert step_losses(out) == step_losses(reference)
    ours = load_file(out / "adapter" / "adapter_model.safetensors")
    theirs = load_file(reference / "adapter" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    worst = max((ours[k].float() - theirs[k].float()).abs().max().item() for k in ours)
    assert worst <= 1e-6, worst


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reference")
    out = root / "run"
    finished(run_cli(recipe_args(tiny_model_dir, out), 2, root))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000006", "step-000008", "step-000010"]
    return out


LOGGED_BY_THREE = "train.log_every=3"


@pytest.fixture(scope="module")
def reference_logged_by_three(tiny_model_dir, tmp_path_factory) -> Path:
    """The same run with a metrics record every 3 steps; checkpoints (every 2) and evaluations (5, 10) end one early."""
    root = tmp_path_factory.mktemp("reference_by_three")
    out = root / "run"
    finished(run_cli(recipe_args(tiny_model_dir, out, LOGGED_BY_THREE), 2, root))
    return out


@pytest.mark.slow
def test_kill_during_checkpoint_write_keeps_the_previous_one(tiny_model_dir, tmp_path, reference_logged_by_three):
    """Also logged every 3 steps: the resumed run's records are the uninterrupted run's, windows included."""
    assert sorted(step_losses(reference_logged_by_three)) == [2, 3, 4, 5, 6, 8, 9, 10]  # records end early
    out = tmp_path / "run"
    args = recipe_args(tiny_model_dir, out, LOGGED_BY_THREE)
    died = run(torchrun("tests/fault_run.py", "--die-saving", "4", "--", *args))
    assert died.returncode != 0
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == [".tmp-step-000004", "step-000002"]  # step 4's data written, never committed
    resumed = finished(run_cli([*args, "--resume"], 2, tmp_path))
    assert "step-000002 at step 2" in resumed.stdout
    assert not (out / "checkpoints" / ".tmp-step-000004").exists()
    assert_same_run(out, reference_logged_by_three)


# every row split over the two ranks; micro-batches of 4 rows, the 2 + 2 the reference's ranks take apart
SPLIT_ROWS = ("fsdp.context_parallel=2", "data.micro_batch_size=4")


@pytest.mark.slow
def test_elastic_restart_then_sigterm_then_kill_9_then_resume_equals_the_uninterrupted_run(tiny_model_dir, tmp_path,
                                                                                           reference):
    """A rank killed under `torchrun --max-restarts 1`: torchrun restarts the world, which resumes by itself. The
    restarted world preempted politely (SIGTERM: save at once, exit 0), resumed under torchrun, then killed hard at
    a random step and resumed again: the losses and the adapter are the uninterrupted run's. (The restart and the
    SIGTERM were two tests, each with a torchrun of its own; the restarted world takes the signal as well.) The
    run splits every row over its two ranks (context parallel), and the uninterrupted run is the data-parallel
    reference: the same rows a step, so the same losses bit for bit and the same adapter to 1e-6 (held-out losses,
    batched per group of ranks rather than per rank, to 1e-6)."""
    out = tmp_path / "run"
    proc = start(torchrun("train.py", *recipe_args(tiny_model_dir, out, *SPLIT_ROWS), max_restarts=1))
    wait_for_step(out, 3, proc)
    workers(proc)[-1].kill()  # one rank dies; torchrun restarts the world, which must resume, not start over
    wait_for_a_step_after_a_resume(out, proc)
    for worker in workers(proc):  # as a cluster scheduler does before preempting
        worker.send_signal(signal.SIGTERM)
    stderr = finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert any(r.get("event") == "resume" for r in records(out))  # the restarted world resumed
    summary = records(out)[-1]
    stopped = summary["steps"]
    assert summary["stopped_by_signal"] and stopped < MAX_STEPS - 3
    assert Path(summary["checkpoint"]).name == f"step-{stopped:06d}"  # saved at the stop, not at save_every

    kill_at = random.Random().randint(stopped + 1, MAX_STEPS - 2)  # the kill must land before the run ends
    proc = start(torchrun("train.py", *recipe_args(tiny_model_dir, out, *SPLIT_ROWS), "--resume"))
    wait_for_step(out, kill_at, proc)
    kill_tree(proc)  # torchrun and both ranks, no warning
    finish(proc)
    assert not (out / "adapter").exists(), f"killed at step {kill_at} but the run had finished"
    resumed = finished(run_cli([*recipe_args(tiny_model_dir, out, *SPLIT_ROWS), "--resume"], 2, tmp_path))
    assert "resumed from" in resumed.stdout, f"killed at step {kill_at}"
    assert records(out)[0]["config"]["fsdp"]["context_parallel"] == 2
    assert_same_run(out, reference)
    held_out = [{r["step"]: r["eval_loss"] for r in records(run) if "eval_loss" in r} for run in (out, reference)]
    assert held_out[0] == pytest.approx(held_out[1], rel=1e-6) and sorted(held_out[0]) == [0, 5, 10]


@pytest.mark.slow
def test_cpu_offload_run_stopped_and_resumed_equals_the_run_without_offload(tiny_model_dir, tmp_path, reference):
    """The CPU-offload path end to end (host shards and gradients, the 8-bit optimizer on host tensors, DCP save
    and load of that state, adapter export), stopped by an error on every rank at a random step (a hard kill of
    the whole world is the SIGTERM test's) and resumed: the per-step losses and the final adapter of the
    uninterrupted run without offload."""
    out = tmp_path / "run"
    args = recipe_args(tiny_model_dir, out, "fsdp_preset=full_shard_cpu_offload")
    stop_at = random.Random().randint(3, MAX_STEPS - 2)  # after the first checkpoint (step 2), before the end
    stopped = run_cli(args, 2, tmp_path, faults=(("user_error_at_step", (stop_at, None)),))
    assert [r.returncode for r in stopped] == [2, 2], stopped[0].stderr[-3000:]
    assert not (out / "adapter").exists(), f"stopped at step {stop_at} but the run had finished"
    resumed = finished(run_cli([*args, "--resume"], 2, tmp_path))
    assert "resumed from" in resumed.stdout, f"stopped at step {stop_at}"
    assert records(out)[0]["config"]["fsdp"]["cpu_offload"] is True
    assert_same_run(out, reference)


@pytest.mark.slow
def test_non_finite_steps_are_skipped_then_stop_the_run(tiny_model_dir, tmp_path):
    once = tmp_path / "once"  # one process: the skip decision rests on global values, alike on every rank
    finished(run_cli(recipe_args(tiny_model_dir, once, "train.log_every=4"), 1, tmp_path,
                     faults=(("inject_nan", ({4},)),)))
    skipped = [r["step"] for r in records(once) if r.get("skipped")]
    assert skipped == [4] and records(once)[-1]["skipped_steps"] == 1
    losses = {r["step"]: r["loss"] for r in records(once) if "loss" in r}  # the skipped step logged alone:
    assert sorted(losses) == [2, 3, 4, 5, 6, 8, 10] and math.isnan(losses[4])
    assert all(math.isfinite(loss) for step, loss in losses.items() if step != 4)  # the others stay finite
    assert all(v.isfinite().all() for v in load_file(once / "adapter" / "adapter_model.safetensors").values())

    streak = tmp_path / "streak"
    results = run_cli(recipe_args(tiny_model_dir, streak, "train.max_bad_steps=3"), 2, tmp_path,
                      faults=(("inject_nan", ({3, 4, 5},)),))
    assert [r.returncode for r in results] == [2, 2]
    errors = [line for r in results for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, errors  # printed once
    message = errors[0]
    assert message.startswith("error: stopping at step 5: 3 steps in a row had a non-finite loss"), message
    assert "step-000004" in message  # saved mid-streak: skipped steps leave the weights as they were
    assert sorted(p.name for p in (streak / "checkpoints").iterdir()) == ["step-000002", "step-000004"]


@pytest.mark.slow
def test_existing_run_is_refused_and_other_world_size_explained(reference, tmp_path):
    from qlora_fsdp.config import TrainConfig
    from qlora_fsdp.errors import CheckpointError, OutputExistsError
    from qlora_fsdp.outputs.checkpoints import check_world_size
    from qlora_fsdp.outputs.run_dir import prepare_run_dir

    run = shutil.copytree(reference, tmp_path / "run")  # resuming trims the log: leave the shared reference alone
    with pytest.raises(OutputExistsError) as refused:  # what train.py prints after `error: `, with exit code 2
        prepare_run_dir(run, TrainConfig(output_dir=str(run)))
    assert str(refused.value) == (
        f"output folder {run} already holds a run (latest checkpoint step-000010); resume it with "
        "--resume (train.resume=auto), choose another train.output_dir, or pass train.overwrite=true to start over")
    latest = prepare_run_dir(run, TrainConfig(output_dir=str(run), resume="auto"))
    assert latest == run / "checkpoints" / "step-000010"
    with pytest.raises(CheckpointError, match="was written by 2 ranks and this run has 1: .* --nproc_per_node 2"):
        check_world_size(latest, 1)  # api.train checks this before loading the model
    assert sorted(p.name for p in (reference / "checkpoints").iterdir()) == ["step-000006", "step-000008",
                                                                              "step-000010"]
    # the last checkpoint's PEFT adapter is the final one (the export itself is tested in test_export.py)
    assert (reference / "checkpoints" / "step-000010" / "adapter" / "adapter_model.safetensors").read_bytes() == (
        reference / "adapter" / "adapter_model.safetensors").read_bytes()
    # starting over removes the earlier run's card with its other files
    (earlier := tmp_path / "earlier").mkdir()
    (earlier / "run.json").write_text("{}")
    (earlier / "metrics.jsonl").write_text("")
    assert prepare_run_dir(earlier, TrainConfig(output_dir=str(earlier), overwrite=True)) is None
    assert not any(earlier.iterdir())


@pytest.mark.slow
def test_second_signal_exits_at_once_but_a_forwarded_copy_does_not(tmp_path):
    code = ("import os, signal, time\n"
            "from qlora_fsdp.training.signals import GracefulStop\n"
            "stop = GracefulStop().install()\n"
            "os.kill(os.getpid(), signal.SIGINT); os.kill(os.getpid(), signal.SIGINT)  # torchrun forwards Ctrl-C\n"
            "print('still here', stop.received == signal.SIGINT, flush=True)\n"
            "time.sleep(1.5); os.kill(os.getpid(), signal.SIGTERM); time.sleep(10); print('not stopped')\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**ENV, "PYTHONPATH": str(REPO)})
    assert "still here True" in result.stdout and "not stopped" not in result.stdout
    assert result.returncode == -signal.SIGTERM


def test_trimmed_log_and_bad_resume_path(tmp_path):
    from qlora_fsdp.config import TrainConfig
    from qlora_fsdp.errors import CheckpointError
    from qlora_fsdp.outputs.run_dir import choose_checkpoint, trim_metrics

    log = tmp_path / "metrics.jsonl"
    lines = [{"event": "start"}, {"step": 0}, {"step": 1}, {"step": 2}, {"event": "checkpoint", "step": 2},
             {"step": 3}, {"step": 4}]
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    trim_metrics(log, 2)
    assert [json.loads(line) for line in log.read_text().splitlines()] == lines[:5]
    with pytest.raises(CheckpointError, match="is not a complete checkpoint"):
        choose_checkpoint(tmp_path, TrainConfig(resume=str(tmp_path / "nope")), restarted=False)
    assert choose_checkpoint(tmp_path, TrainConfig(resume="never"), restarted=True) is None  # auto, none yet


def test_changed_settings_are_named():
    from qlora_fsdp.config import Config, changed_settings, to_yaml

    saved, now = Config(), Config()
    now.optim.lr, now.train.max_steps, now.train.resume = 1e-3, 500, "auto"
    assert changed_settings(to_yaml(saved), now) == [f"optim.lr: {saved.optim.lr!r} -> 0.001",
                                                     f"train.max_steps: {saved.train.max_steps} -> 500"]
